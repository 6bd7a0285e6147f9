"""vLLM inside the training processes (colocated), behind the `Engine` protocol (extra `vllm`).

Prompt ids go in as `TokensPrompt`, so the trajectory is token for token what vLLM saw; the
sampled ids come back verbatim with the logprob of each under the distribution vLLM sampled
from (`logprobs_mode="processed_logprobs"`: penalised, temperature-scaled, filtered), the
same convention as our engines. Each row keeps its own seed and sampling options
(`SamplingOptions` maps one to one onto vLLM's `SamplingParams`), stop ids and stop strings.
vLLM's own end-of-sequence stop is off (`ignore_eos`): as in our engines a row stops only on
the ids it names (the chat's and the policy's).

Colocated under torchrun: every process builds the engine with
`distributed_executor_backend="external_launcher"`; vLLM's TP group is carved from the
launched world. With `group` (the ranks of one vLLM TP group) a generate call is collective:
the ranks gather their rows, all run the same union (external-launcher TP needs identical
inputs on its ranks) and each keeps its own; an idle rank passes no rows and still calls.

Weights follow training with `update_weights(named_tensors)`, straight from memory through the
worker's `reload_weights(weights_iterator=...)` (weight_sync.py yields the tensors from each
backend). That needs the engine core in this process: `create` turns vLLM's V1
multiprocessing off unless the caller already decided.

After every optimizer step, on every rank that holds a vLLM (weight_sync.py):

- Megatron-core: `engine.update_weights(megatron_hf_tensors(model, layout))`, collective over
  the TP group (every TP rank consumes the stream); vLLM's TP equals the trainer's, or is 1 per
  rank.
- DeepSpeed ZeRO-3: `engine.update_weights(zero3_hf_tensors(ds_engine.module))`, collective
  over the data-parallel group; each rank's vLLM (TP=1) then generates its own rows with no
  lockstep, unlike `HFEngine` under ZeRO-3.
- Anything else: `engine.update_weights(hf_tensors(model))`.

LoRA runs either way: the merged weights (W + scale * B A) through `update_weights`, or the
adapters alone through vLLM's LoRA path (`VLLMConfig(max_lora_rank=R)` turns `enable_lora` on):
`engine.load_adapter(folder)` with a peft `save_pretrained` folder; every later generate call
runs under that adapter, and the base weights stay as they were.

The GRPO trainer does all of this with `--engine vllm` (`trainers.backends.colocated_vllm`): it
syncs once after each rollout's optimizer steps and records the time as `weight_sync_s`.

Example (each rank, after `torch.distributed` is initialised by torchrun)::

    engine = VLLMEngine.create("path/to/hf_model", VLLMConfig(tensor_parallel_size=1))
    outs = engine.generate(requests)
    optimizer.step()
    engine.update_weights(weight_sync.hf_tensors(model))  # -> SyncReport(seconds=...)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import distributed
from .base import EngineStats, Generation, GenerationRequest, check_context
from .weight_sync import SyncReport, counted

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm import LLM
    from vllm.lora.request import LoRARequest


@dataclass(frozen=True, kw_only=True)
class VLLMConfig:
    """How the colocated vLLM engine is built (the `LLM(...)` arguments this project sets)."""

    tensor_parallel_size: int = 1  # the rollout group's TP (the trainer's TP for Megatron)
    colocated: bool = True  # external_launcher: vLLM joins the torchrun world instead of spawning
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # on GPU, the share vLLM may take beside training
    enable_sleep: bool = False  # GPU only: `release()` frees weights and KV cache during training
    enforce_eager: bool = True  # no graph capture: starts in seconds (CPU, tests)
    enable_prefix_caching: bool = True
    seed: int = 0
    max_lora_rank: int = 0  # > 0: vLLM's LoRA path on (`load_adapter`), adapters up to this rank
    extra: dict[str, object] = field(default_factory=dict)  # any other `LLM` keyword argument

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"VLLMConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_lora_rank:
            vllm_lora_rank(self.max_lora_rank)

    def llm_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = dict(
            tensor_parallel_size=self.tensor_parallel_size,
            dtype=self.dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            logprobs_mode="processed_logprobs",
            # seeded requests with chunked prefill crash vLLM's CPU build ("CPU Generator does not
            # use offset"); whole-prompt prefills are what rollouts of short turns do anyway
            enable_chunked_prefill=False,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.max_lora_rank > 0:
            # one adapter at a time: each update replaces the one before
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(self.max_lora_rank))
        if self.colocated:
            kwargs["distributed_executor_backend"] = "external_launcher"
        return kwargs | self.extra


@dataclass
class VLLMEngine:
    """The Engine protocol over a vLLM `LLM` of this process; build it with `create`."""

    llm: LLM
    name: str = "policy"
    max_context: int = 0  # 0: vLLM's max_model_len
    group: ProcessGroup | None = None  # this vLLM's TP group when > 1 (rows are gathered over it)
    stats: EngineStats = field(default_factory=EngineStats)
    syncs: list[SyncReport] = field(default_factory=list)  # one per update_weights / load_adapter call
    adapter: LoRARequest | None = None  # the adapter every generate call runs under (load_adapter)

    def __post_init__(self) -> None:
        config = self.llm.llm_engine.model_config
        if not self.max_context:
            self.max_context = int(config.max_model_len)
        self.tied = bool(config.hf_text_config.tie_word_embeddings)

    @classmethod
    def create(
        cls,
        model: str,
        config: VLLMConfig | None = None,
        *,
        name: str = "policy",
        group: ProcessGroup | None = None,
    ) -> VLLMEngine:
        """Build vLLM for the HF folder `model` in this process (on every rank when colocated)."""
        from vllm import LLM

        config = config or VLLMConfig()
        # update_weights hands the worker an iterator of tensors: the engine core must be here
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        tp = config.tensor_parallel_size
        if config.colocated and tp > 1 and (group is None or distributed.world_size(group) != tp):
            size = None if group is None else distributed.world_size(group)
            raise ValueError(
                f"VLLMConfig.tensor_parallel_size={tp} colocated needs group= the {tp} ranks of this "
                f"vLLM's TP group (they must run the same rows), got a group of {size} ranks"
            )
        return cls(LLM(model=str(model), **config.llm_kwargs()), name=name, group=group)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        mine = list(requests)
        synced = self.group is not None and distributed.world_size(self.group) > 1
        if synced:  # every rank of vLLM's TP group must run the same batch
            per_rank = distributed.all_gather_object(mine, self.group)
            union = [r for rank_rows in per_rank for r in rank_rows]
            offset = sum(len(x) for x in per_rank[: distributed.rank(self.group)])
        else:
            union, offset = mine, 0
        if not union:
            return []
        caps = check_context(union, self.max_context)
        outs = self._generate(union, caps)[offset : offset + len(mine)]
        self.stats.generated_tokens += sum(len(g.token_ids) for g in outs)
        return outs

    def _generate(self, requests: list[GenerationRequest], caps: list[int]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        live = [i for i, c in enumerate(caps) if c > 0]  # vLLM needs max_tokens >= 1
        prompts = [TokensPrompt(prompt_token_ids=list(requests[i].prompt_ids)) for i in live]
        params = [_vllm_params(requests[i], caps[i]) for i in live]
        t0 = time.perf_counter()
        results = (
            self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter) if live else []
        )
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.forwards += 1
        out = [Generation(token_ids=[], logprobs=[], finish_reason="length") for _ in requests]
        for i, result in zip(live, results, strict=True):
            out[i] = _generation(result.outputs[0], requests[i])
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Load HF-named full tensors into vLLM in place; clears its prefix cache. Returns the timing.

        Collective when vLLM runs TP over several ranks (each rank passes the same full tensors
        and keeps its slice). A tied model gets `lm_head.weight` from the embedding when the
        stream has none: vLLM's CPU build keeps a separate output weight that would stay old.
        """
        tally = [0, 0]
        t0 = time.perf_counter()
        stream = counted(self._with_output_layer(named_tensors), tally)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        report = SyncReport(seconds=time.perf_counter() - t0, tensors=tally[0], bytes=tally[1])
        self.syncs.append(report)
        return report

    def load_adapter(self, folder: str | Path) -> SyncReport:
        """Load the LoRA adapter in `folder` (peft's `save_pretrained` layout) for every later
        generate call, replacing the one before; vLLM built with `VLLMConfig.max_lora_rank`.

        The folder is read here, once: it may be rewritten or deleted as soon as this returns.
        Colocated under TP, every rank of the group calls it with the same adapter (each loads its
        own slice). Returns the timing (tensors and bytes: the adapter's safetensors file).
        """
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.vllm_config.lora_config:
            raise ValueError(
                f"load_adapter({str(folder)!r}): this vLLM was built without LoRA; "
                "build it with VLLMConfig(max_lora_rank=R)"
            )
        t0 = time.perf_counter()
        tensors, size = _adapter_size(Path(folder))
        previous = self.adapter
        number = 1 + (previous.lora_int_id if previous is not None else 0)
        # a new id each time: vLLM caches adapters by id, and this one has new weights
        request = LoRARequest(f"{self.name}-adapter-{number}", number, str(Path(folder).resolve()))
        self.llm.llm_engine.add_lora(request)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.adapter = request
        self.llm.reset_prefix_cache()
        report = SyncReport(seconds=time.perf_counter() - t0, tensors=tensors, bytes=size)
        self.syncs.append(report)
        return report

    def _with_output_layer(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        embedding, has_head = None, False
        for name, tensor in named:
            has_head |= name == "lm_head.weight"
            if name == "model.embed_tokens.weight":
                embedding = tensor
            yield name, tensor
        if self.tied and not has_head and embedding is not None:
            yield "lm_head.weight", embedding

    def release(self) -> None:
        """Free vLLM's weights and KV cache during training (GPU, `VLLMConfig.enable_sleep`)."""
        self.llm.sleep(level=1)

    def resume(self) -> None:
        """Take the memory back before the next rollout."""
        self.llm.wake_up()

    def close(self) -> None:
        """Shut vLLM's engine down now; colocated, call it last, right before the process groups go.

        vLLM's shutdown destroys its own parallel groups and then torch's default process group.
        Left to run at interpreter exit, after the trainer had destroyed the process groups, it met
        groups already gone and raised `Invalid process group specified` on every rank.
        """
        self.llm.llm_engine.engine_core.shutdown()


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` values


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"VLLMConfig.max_lora_rank {rank}: vLLM's LoRA path takes adapters of rank up to "
        f"{_VLLM_LORA_RANKS[-1]}; sync merged weights instead"
    )


def _adapter_size(folder: Path) -> tuple[int, int]:
    """(tensors, bytes) of the adapter in `folder`; ValueError when it is not peft's layout."""
    from safetensors import safe_open

    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if not (weights.is_file() and config.is_file()):
        raise ValueError(
            f"load_adapter({str(folder)!r}): expected peft's save_pretrained layout "
            "(adapter_config.json and adapter_model.safetensors)"
        )
    with safe_open(str(weights), "pt") as f:
        keys = list(f.keys())
    return len(keys), weights.stat().st_size


def _vllm_params(r: GenerationRequest, cap: int):
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        max_tokens=cap,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty,
        seed=r.seed,
        stop=list(r.stop) or None,
        stop_token_ids=list(r.stop_token_ids),
        ignore_eos=True,  # stop only on the ids the row names, as our engines do
        logprobs=0,  # the sampled token's own logprob only
        detokenize=bool(r.stop),  # text is needed only to match stop strings
    )


def _generation(completion, r: GenerationRequest) -> Generation:
    ids = list(completion.token_ids)
    if len(completion.logprobs or ()) != len(ids):
        raise ValueError(
            f"vLLM returned {len(completion.logprobs or ())} logprobs for {len(ids)} tokens of "
            f"request {r.tag!r}; expected one per sampled token"
        )
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids, strict=True)]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished request {r.tag!r} with {reason!r}; expected 'stop' or 'length'")
    return Generation(token_ids=ids, logprobs=logprobs, finish_reason=reason)
