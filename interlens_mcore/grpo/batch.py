"""Trajectories -> the tensors a training forward consumes (packed THD row or padded [B, T]).

Everything per token sits on *target positions*: position t of a sample predicts token t + 1,
so `targets[t]`, `loss_mask[t]`, `rollout_logprobs[t]` and `segment_ids[t]` all describe token
t + 1, and the logits at t score it. The last token of a sample predicts nothing (mask 0).

Building is vectorised: the token lists are flattened once with `np.fromiter`, every shift,
segment number and layout scatter is an array operation; Python loops run per sample or per
turn, never per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from itertools import chain
from typing import Literal, Protocol

import numpy as np
import torch

from interlens_mcore.types import Trajectory

Layout = Literal["packed", "padded"]
LAYOUTS = ("packed", "padded")
_TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "targets",
    "loss_mask",
    "rollout_logprobs",
    "advantages",
    "segment_ids",
    "sample_ids",
)


@dataclass(kw_only=True)
class TrainingBatch:
    """One micro-batch of N samples, in the packed ([1, T]) or padded ([N, T]) layout.

    Packed: the samples are concatenated into one row, then `pad` tokens (belonging to no
    sample) bring the row length to a multiple of `pad_to_multiple`. `cu_seqlens` [N + 1]
    bounds the samples only; `packed_seq_params()` adds the padding as one trailing
    pseudo-sequence (positions 0..pad-1), so THD attention covers every token of the row and
    no real token attends to padding.
    """

    layout: Layout
    input_ids: torch.Tensor  # [B, T] int64; B = 1 packed, N padded
    position_ids: torch.Tensor  # [B, T] int64, restarting at 0 for each sample (and the padding)
    targets: torch.Tensor  # [B, T] int64, next token of the same sample; pad_id where none
    loss_mask: torch.Tensor  # [B, T] bool, the target token is trained
    rollout_logprobs: torch.Tensor  # [B, T] float32, engine logprob of the target; 0.0 where absent
    advantages: torch.Tensor  # [B, T] float32, the sample's advantage on its positions; 0 on pad
    segment_ids: torch.Tensor  # [B, T] int64, batch-wide trained-turn index of the target; -1 else
    sample_ids: torch.Tensor  # [B, T] int64, index of the sample owning the position; -1 on pad
    logprobs_complete: torch.Tensor  # [N] bool, rollout logprobs usable for IS correction
    seq_lens: torch.Tensor  # [N] int64, tokens per sample
    cu_seqlens: torch.Tensor  # [N + 1] int32, sample bounds in the packed row (cumsum of seq_lens)
    num_segments: int  # trained turns in the batch; segment ids are 0..num_segments-1

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"TrainingBatch.layout must be one of {LAYOUTS}, got {self.layout!r}")
        shape = self.input_ids.shape
        for name in _TOKEN_FIELDS:
            if getattr(self, name).shape != shape or len(shape) != 2:
                raise ValueError(
                    f"TrainingBatch.{name} must be [B, T] like input_ids {tuple(shape)}, "
                    f"got {tuple(getattr(self, name).shape)}"
                )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"TrainingBatch.loss_mask must be bool, got {self.loss_mask.dtype}")
        n = self.seq_lens.numel()
        if n == 0 or self.logprobs_complete.shape != (n,) or self.cu_seqlens.shape != (n + 1,):
            raise ValueError(
                "TrainingBatch needs N >= 1 with logprobs_complete [N] and cu_seqlens [N + 1], got "
                f"seq_lens {tuple(self.seq_lens.shape)}, logprobs_complete "
                f"{tuple(self.logprobs_complete.shape)}, cu_seqlens {tuple(self.cu_seqlens.shape)}"
            )
        expected_rows = 1 if self.layout == "packed" else n
        if shape[0] != expected_rows:
            raise ValueError(f"TrainingBatch ({self.layout}) needs {expected_rows} rows, got {shape[0]}")

    @property
    def num_samples(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.cu_seqlens[-1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.num_tokens / self.input_ids.numel()

    def to(self, device: torch.device | str) -> TrainingBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        return replace(self, **moved)

    def packed_seq_params(self):
        """megatron-core `PackedSeqParams` ('thd') for the packed row; padding is a last segment."""
        if self.layout != "packed":
            raise ValueError(f"packed_seq_params needs layout 'packed', got {self.layout!r}")
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        total = self.input_ids.shape[1]
        if total > int(cu[-1]):
            cu = torch.cat([cu, cu.new_tensor([total])])  # [N + 2]: the padding pseudo-sequence
        max_len = int((cu[1:] - cu[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )


def block_causal_mask(sample_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool attention mask: causal, and only within a sample (padding with padding).

    For backends without varlen attention (an HF model on the packed row). It costs T^2, so
    use it on windows of a few thousand tokens cut at `cu_seqlens`, not on a long packed row.
    """
    t = sample_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=sample_ids.device).tril()
    return (causal & (sample_ids[:, :, None] == sample_ids[:, None, :]))[:, None]


@dataclass
class _Flat:
    """All samples concatenated, in token space (position p describes token p)."""

    lens: np.ndarray  # [N] int64
    starts: np.ndarray  # [N] int64, first token of each sample
    ids: np.ndarray  # [S] int64, S = sum(lens)
    mask: np.ndarray  # [S] bool
    logprobs: np.ndarray  # [S] float32, rollout logprob of a mask-1 token of a complete sample
    complete: np.ndarray  # [N] bool
    sample: np.ndarray  # [S] int64


def _flatten(trajectories: Sequence[Trajectory]) -> _Flat:
    n = len(trajectories)
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    lens = np.fromiter((len(t.token_ids) for t in trajectories), np.int64, n)
    mask_lens = np.fromiter((len(t.loss_mask) for t in trajectories), np.int64, n)
    if (bad := np.flatnonzero(lens != mask_lens)).size:
        i = int(bad[0])
        raise ValueError(f"trajectories[{i}].loss_mask has {mask_lens[i]} entries, token_ids {lens[i]}")
    total = int(lens.sum())
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    ids = np.fromiter(chain.from_iterable(t.token_ids for t in trajectories), np.int64, total)
    mask = np.fromiter(chain.from_iterable(t.loss_mask for t in trajectories), np.int8, total) != 0
    sample = np.repeat(np.arange(n, dtype=np.int64), lens)
    if (bad := np.flatnonzero(ids < 0)).size:
        raise ValueError(f"trajectories[{int(sample[bad[0]])}].token_ids must be >= 0, got {ids[bad[0]]}")

    csum = np.concatenate([[0], np.cumsum(mask)])
    trained = csum[starts + lens] - csum[starts]  # [N] mask-1 tokens per sample
    if (bad := np.flatnonzero(trained == 0)).size:
        raise ValueError(f"trajectories[{int(bad[0])}] has no loss-mask-1 token; nothing to train on")
    # Every sample now has >= 1 token, so `starts` indexes real tokens.
    if (bad := np.flatnonzero(mask[starts])).size:
        i = int(bad[0])
        raise ValueError(
            f"trajectories[{i}].loss_mask[0] is 1, but the first token has no position before it "
            "to predict it from"
        )
    # the completeness rule is the trajectory's own (trajectory.logprobs_fit): IS is off otherwise
    complete = np.fromiter((t.logprobs_complete for t in trajectories), bool, n)
    logprobs = np.zeros(total, np.float32)
    where = mask & complete[sample]
    values = chain.from_iterable(
        t.rollout_logprobs or () for t, ok in zip(trajectories, complete, strict=True) if ok
    )
    # Boolean assignment fills in token order, which is the order of each sample's logprobs.
    logprobs[where] = np.fromiter(values, np.float64, int(where.sum()))
    return _Flat(lens, starts, ids, mask, logprobs, complete, sample)


def _segments(trajectories: Sequence[Trajectory], flat: _Flat) -> tuple[np.ndarray, int]:
    """[S] batch-wide trained-turn index of each token (-1 outside), and the number of turns.

    A sample's turns are its trained `TurnSpan`s; a sample without any has one turn per maximal
    run of mask-1 tokens (what a sampled turn is when no spans were recorded).
    """
    spans = [
        (i, s.start, s.end)
        for i, t in enumerate(trajectories)
        for s in t.turns
        if s.trained and s.end > s.start
    ]
    span_arr = np.array(spans, np.int64).reshape(-1, 3)
    has_spans = np.zeros(len(flat.lens), bool)
    has_spans[span_arr[:, 0]] = True

    total = flat.ids.size
    first = np.zeros(total, bool)
    first[flat.starts] = True
    last = np.zeros(total, bool)
    last[flat.starts + flat.lens - 1] = True
    prev = np.concatenate([[False], flat.mask[:-1]]) & ~first
    nxt = np.concatenate([flat.mask[1:], [False]]) & ~last
    runs = flat.mask & ~has_spans[flat.sample]
    run_starts = np.flatnonzero(runs & ~prev)
    run_ends = np.flatnonzero(runs & ~nxt) + 1

    begin = np.concatenate([flat.starts[span_arr[:, 0]] + span_arr[:, 1], run_starts])
    end = np.concatenate([flat.starts[span_arr[:, 0]] + span_arr[:, 2], run_ends])
    depth = np.cumsum(np.bincount(begin, minlength=total + 1) - np.bincount(end, minlength=total + 1))[:total]
    if (bad := np.flatnonzero(depth > 1)).size:
        raise ValueError(f"trajectories[{int(flat.sample[bad[0]])}].turns: trained turn spans overlap")
    number = np.cumsum(np.bincount(begin, minlength=total)[:total]) - 1  # spans begun so far - 1
    seg = np.where(depth == 1, number, -1)
    if (bad := np.flatnonzero(flat.mask & (seg < 0))).size:
        p = int(bad[0])
        i = int(flat.sample[p])
        raise ValueError(
            f"trajectories[{i}].turns: loss-mask-1 token {p - int(flat.starts[i])} lies outside every "
            "trained turn span"
        )
    return seg, int(begin.size)


def _as_advantages(advantages: torch.Tensor | Sequence[float], n: int) -> np.ndarray:
    adv = torch.as_tensor(advantages, dtype=torch.float32).detach().cpu()
    if adv.dim() > 1 or adv.numel() != n:
        raise ValueError(f"advantages must be [N] with N = {n} trajectories, got shape {tuple(adv.shape)}")
    if not torch.isfinite(adv).all():
        raise ValueError("advantages must be finite")
    return adv.reshape(n).numpy()


def build_batch(
    trajectories: Sequence[Trajectory],
    advantages: torch.Tensor | Sequence[float],
    *,
    layout: Layout = "packed",
    pad_to_multiple: int = 1,
    pad_id: int = 0,
) -> TrainingBatch:
    """A `TrainingBatch` of `trajectories` with per-sample `advantages` [N].

    `pad_to_multiple` pads the packed row's length (e.g. to TP x CP for sequence parallelism),
    or the padded layout's T. `pad_id` fills padding and the target slot of each sample's last
    token, so gathers on `targets` stay in range.
    """
    if not trajectories:
        raise ValueError("trajectories must hold at least one Trajectory, got none")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(pad_to_multiple, int) or pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be an int >= 1, got {pad_to_multiple!r}")
    if not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be an int >= 0 (a real vocabulary id), got {pad_id!r}")
    adv = _as_advantages(advantages, len(trajectories))
    flat = _flatten(trajectories)
    seg_tok, num_segments = _segments(trajectories, flat)

    total = flat.ids.size
    has_next = np.ones(total, bool)
    has_next[flat.starts + flat.lens - 1] = False

    def shift(a: np.ndarray, fill) -> np.ndarray:  # token space -> target positions
        out = np.concatenate([a[1:], a[:1]])
        return np.where(has_next, out, fill)

    columns = {
        "input_ids": (flat.ids, pad_id),
        "position_ids": (np.arange(total) - np.repeat(flat.starts, flat.lens), None),
        "targets": (shift(flat.ids, pad_id), pad_id),
        "loss_mask": (shift(flat.mask, False), False),
        "rollout_logprobs": (shift(flat.logprobs, 0.0), 0.0),
        "advantages": (np.repeat(adv, flat.lens), 0.0),
        "segment_ids": (shift(seg_tok, -1), -1),
        "sample_ids": (flat.sample, -1),
    }
    place = _pack if layout == "packed" else _pad
    tensors = {
        k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in place(columns, flat, pad_to_multiple).items()
    }
    cu = np.concatenate([[0], np.cumsum(flat.lens)]).astype(np.int32)
    return TrainingBatch(
        layout=layout,
        **tensors,
        logprobs_complete=torch.from_numpy(flat.complete),
        seq_lens=torch.from_numpy(flat.lens),
        cu_seqlens=torch.from_numpy(cu),
        num_segments=num_segments,
    )


def _pack(columns: dict, flat: _Flat, multiple: int) -> dict[str, np.ndarray]:
    """One row [1, T]; the trailing padding counts positions from 0 as its own pseudo-sequence."""
    pad = -flat.ids.size % multiple
    out = {}
    for name, (values, fill) in columns.items():
        tail = np.arange(pad) if fill is None else np.full(pad, fill)
        out[name] = np.concatenate([values, tail.astype(values.dtype)])[None, :]
    return out


def _pad(columns: dict, flat: _Flat, multiple: int) -> dict[str, np.ndarray]:
    """[N, T] right-padded rows, T = longest sample rounded up to `multiple`."""
    n = flat.lens.size
    width = -(-int(flat.lens.max()) // multiple) * multiple
    slots = flat.sample * width + columns["position_ids"][0]  # [S] flat index into [N, T]
    out = {}
    for name, (values, fill) in columns.items():
        if fill is None:  # positions keep counting across the right padding
            out[name] = np.broadcast_to(np.arange(width, dtype=values.dtype), (n, width)).copy()
            continue
        grid = np.full(n * width, fill, dtype=values.dtype)
        grid[slots] = values
        out[name] = grid.reshape(n, width)
    return out


class SpecialTokens(Protocol):
    """The part of a tokenizer (`transformers.PreTrainedTokenizerBase`) `pad_id` reads."""

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...


def pad_id(tokenizer: SpecialTokens) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its eos token."""
    pad = tokenizer.pad_token_id
    pad = pad if pad is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token id")
    return int(pad)
