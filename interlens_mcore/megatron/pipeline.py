"""Pipeline parallelism: megatron-core's own 1F1B schedule over a GPTModel's stages, on CPU too.

Each rank of a pipeline group holds one stage of the model (`build_model` under
`init_megatron(tp, pp=...)`): the first stage embeds, the last one normalises and projects onto
the vocabulary, and with tied embeddings the last stage holds its own copy of the embedding
(megatron's `output_layer.weight`), kept equal to the first stage's by summing the two
gradients over megatron's embedding group after each backward.

`run(model, layout, batches, ...)` drives `get_forward_backward_func()` over packed micro-batches
(one `TrainingBatch` each, lengths free: megatron's `variable_seq_lengths` sends each
activation's shape first). On the last stage each micro-batch's logits become the logprobs of
its targets, and, when training, `loss_of(i, logprobs, entropy)` is the loss megatron's
schedule backpropagates, as it is (`entropy`: the micro-batch's policy entropy with gradient,
for an entropy bonus, when asked for; else None): the GRPO loss is already divided by global
token counts, so the schedule's per-micro-batch averaging is turned off
(`calculate_per_token_loss`, with a token count of 1). Every stage gets the logprobs back (a
broadcast from the last stage; their shapes are known from the batches), so what comes after
the forward (masks, denominators, metrics) runs alike on every rank.

On CPU megatron 0.16.1's schedule and point-to-point code allocate receive buffers and a token
counter on `torch.cuda.current_device()` and call `torch.cuda.synchronize()`; for the length of
a call, `_on_cpu` gives those two modules a `torch` whose `cuda` is the CPU (the real
`torch.cuda` is untouched). Everything else is megatron's: the 1F1B order, the shape exchange,
batched isend/irecv (over gloo here). Model construction needs one more stand-in on CPU: with
tied embeddings megatron moves the last stage's copy to CUDA before summing it with the
first stage's (`stages.building`).

Example (every rank of the pipeline group, same batches)::

    distributed.init_megatron(1, pp=2)
    model = build_model(layout)                          # this rank's stage
    lps = pipeline.run(model, layout, batches, loss_of=lambda i, lp, h: my_loss(i, lp))
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from ..grpo.batch import TrainingBatch
from ..grpo.logprobs import (
    token_entropy,
    token_logprobs,
    vocab_parallel_token_entropy,
    vocab_parallel_token_logprobs,
)
from .model import ModelLayout, compute_autocast, mask_padded_vocab, packed_seq_params, vocab_start
from .spec import packed_positions
from .stages import pipeline_size, stage

# (micro-batch index, [1, T] logprobs, [1, T] entropy with gradient or None) -> loss
LossOf = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


class _CpuTorch(types.ModuleType):
    """`torch` as megatron's schedule and p2p modules see it on CPU: CUDA device queries answer
    with the CPU, synchronisation is a no-op; every other name is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(
            current_device=lambda: torch.device("cpu"),
            synchronize=lambda *args, **kwargs: None,
            is_available=lambda: False,
        )

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    """megatron's schedule and p2p modules allocate on the CPU for the length of the block."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    if torch.cuda.is_available():
        yield
        return
    shim = _CpuTorch()
    saved = p2p_communication.torch, schedules.torch
    p2p_communication.torch = schedules.torch = shim
    try:
        yield
    finally:
        p2p_communication.torch, schedules.torch = saved


def run(
    model: torch.nn.Module,
    layout: ModelLayout,
    batches: Sequence[TrainingBatch],
    *,
    temperature: float = 1.0,
    loss_of: LossOf | None = None,
    compute_dtype: torch.dtype | None = None,
    entropies: list[torch.Tensor] | None = None,
    entropy_grad: bool = False,
    before_forward: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Every micro-batch through the pipeline: [1, T_i] logprobs of its targets on every stage.

    With `loss_of` the schedule also runs the backward of `loss_of(i, logprobs, entropy)` (built on the
    last stage; gradients accumulate in the stage's parameters); without it, forward only and no
    graph. With `entropies` (a list), it receives each micro-batch's [1, T_i] policy entropy
    (no gradient) on every stage too. With `entropy_grad`, `loss_of` gets each micro-batch's
    entropy with gradient (an entropy bonus). `before_forward(i)` runs before micro-batch `i`'s
    forward on this stage. Collective over the pipeline group (and TP); every rank
    passes the same batches.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for b in batches:
        if b.layout != "packed" or b.cu_seqlens is None or b.num_tokens != b.input_ids.shape[1]:
            raise ValueError("pipeline.run needs packed batches without padding")
    first, last = stage()
    tp = ps.get_tensor_model_parallel_world_size()
    device = next(model.parameters()).device
    forward_only = loss_of is None

    def loss_func(i: int, output: torch.Tensor):
        logits = mask_padded_vocab(output[0], layout)  # [T, V_pad / tp]
        if compute_dtype is not None:
            logits = logits.float()
        targets = batches[i].targets[0].to(device)
        if tp == 1:
            lp = token_logprobs(logits, targets, temperature=temperature)
        else:
            start = vocab_start(layout)
            group = ps.get_tensor_model_parallel_group()
            lp = vocab_parallel_token_logprobs(
                logits, targets, vocab_start=start, temperature=temperature, group=group
            )
        lp = lp[None]  # [1, T]
        h = None
        if entropies is not None or entropy_grad:
            grad = entropy_grad and not forward_only
            if tp == 1:
                h = token_entropy(logits, temperature=temperature, grad=grad)
            else:
                group = ps.get_tensor_model_parallel_group()
                h = vocab_parallel_token_entropy(logits, temperature=temperature, group=group, grad=grad)
            h = h[None]  # [1, T]
        loss = lp.sum() * 0.0 if loss_of is None else loss_of(i, lp, h if entropy_grad else None)
        stored = {"logprobs": lp.detach()}
        if entropies is not None:
            assert h is not None
            stored["entropy"] = h.detach()
        return loss, torch.ones((), dtype=torch.int), stored

    def forward_step(data: Iterator[int], stage_model: torch.nn.Module):
        i = next(data)
        b = batches[i]
        if before_forward is not None:
            before_forward(i)
        return _stage_forward(stage_model, b.input_ids, b.cu_seqlens, first), partial(loss_func, i)

    grad = contextlib.nullcontext() if not forward_only else torch.no_grad()
    with _on_cpu(), grad, compute_autocast(device.type, compute_dtype):
        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(len(batches))),
            model=[model],
            num_microbatches=len(batches),
            seq_length=max(b.input_ids.shape[1] for b in batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    if not forward_only:
        sum_tied_embedding_grads(model, layout)
    if entropies is not None:
        entropies.extend(_from_last_stage([s["entropy"] for s in stored] if last else None, batches, device))
    return _from_last_stage([s["logprobs"] for s in stored] if last else None, batches, device)


def _stage_forward(
    model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, first: bool
) -> torch.Tensor:
    """This stage's forward of a packed batch: the first stage embeds the ids (positions restart
    per sequence); the others read the activations given by `set_input_tensor`."""
    device = next(model.parameters()).device
    params = packed_seq_params(cu_seqlens.to(device))
    ids = input_ids.to(device) if first else None
    positions = packed_positions(cu_seqlens).to(device)[None] if first else None
    return model(input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=params)


def sum_tied_embedding_grads(model: torch.nn.Module, layout: ModelLayout) -> None:
    """With tied embeddings on PP > 1, the first stage's embedding and the last stage's output
    layer are one weight: each gets the sum of both gradients (megatron's embedding group)."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1 or not layout.tied_embeddings or not ps.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()  # type: ignore[operator]
    if not weight.requires_grad:  # frozen (a LoRA base) on both stages alike
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())


def _from_last_stage(
    mine: list[torch.Tensor] | None, batches: Sequence[TrainingBatch], device: torch.device
) -> list[torch.Tensor]:
    """The last stage's [1, T_i] figures (logprobs, entropies) on every rank of the pipeline group."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        assert mine is not None
        return mine
    sizes = [b.input_ids.shape[1] for b in batches]
    flat = torch.cat([lp[0].float() for lp in mine]) if mine is not None else torch.empty(sum(sizes))
    flat = flat.to(device).contiguous()
    torch.distributed.broadcast(
        flat, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return [part[None] for part in torch.split(flat, sizes)]


def forward_stages(
    model: torch.nn.Module,
    layout: ModelLayout,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """One packed forward through the pipeline outside megatron's schedules (a generation step:
    one micro-batch, no backward): [T, 1, H] activations go stage to stage by send / receive,
    their shape known to every stage from `input_ids`. The last stage's logits shard
    [T, V_pad / tp] (padded ids -inf), None on the other stages. Collective over the pipeline
    group; every rank passes the same tokens."""
    from megatron.core import parallel_state as ps

    first, last = stage()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype  # what a stage sends and the next one receives
    group = ps.get_pipeline_model_parallel_group()
    if not first:
        hidden = torch.empty(input_ids.shape[1], 1, layout.hidden_size, dtype=dtype, device=device)
        torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
        model.set_input_tensor(hidden)  # type: ignore[operator]
    with compute_autocast(device.type, compute_dtype):
        out = _stage_forward(model, input_ids, cu_seqlens, first)
    if not last:
        torch.distributed.send(
            out.to(dtype).contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group
        )
        return None
    logits = out[0].float() if compute_dtype is not None else out[0]
    return mask_padded_vocab(logits, layout)


def sampled_from_last_stage(
    tokens: torch.Tensor | None, logprobs: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's `n` sampled ids and their logprobs on every rank of the pipeline group."""
    from megatron.core import parallel_state as ps

    src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
    ids = tokens.to(torch.int64).cpu() if tokens is not None else torch.empty(n, dtype=torch.int64)
    lps = logprobs.float().cpu() if logprobs is not None else torch.empty(n)
    torch.distributed.broadcast(ids, src=src, group=group)
    torch.distributed.broadcast(lps, src=src, group=group)
    return ids, lps
