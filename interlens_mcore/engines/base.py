"""The engine protocol and a colocated Hugging Face engine.

An engine turns rows of prompt ids into sampled continuations. Every row carries its own
sampling settings, token cap and seed, so the tokens a row gets depend only on that row:
never on its batch, its wave or its neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from . import parallel
from .sampling import BatchSampling


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How tokens are drawn, with vLLM's meanings (shared by SamplingParams and GenerationRequest).

    Order of application: repetition / presence / frequency penalties on the raw logits, then
    temperature, min-p, top-k and top-p, then a sample from the renormalised survivors. Greedy
    rows (temperature 0) ignore the filters. Logprobs are those of the distribution actually
    sampled from (penalised, scaled, filtered, renormalised), so IS correction divides by the
    true behaviour policy.
    """

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # keep the most likely tokens holding at least this mass; 1: off
    top_k: int = 0  # keep the k most likely tokens (ties included); 0 or -1: off
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from every token already sampled, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the sampled ids, in [-2, 2]
    stop: tuple[str, ...] = ()  # the turn ends at the first match in the decoded text
    stop_token_ids: tuple[int, ...] = ()  # the turn ends when one of these is sampled

    def __post_init__(self) -> None:
        where = self._where()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:  # vLLM's older spelling of "off"
            object.__setattr__(self, "top_k", 0)
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, "0 or -1 (off), or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{where}.{name} must be {expected}, got {getattr(self, name)}")
        if not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"{where}.stop must hold non-empty strings, got {list(stop)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"{where}.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")

    def _where(self) -> str:
        return type(self).__name__

    def options(self) -> dict[str, Any]:
        """The sampling options as keyword arguments (for another SamplingOptions)."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingOptions)}


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingOptions):
    """How a participant samples: the options above and a per-turn token cap.

    Example::

        SamplingParams(temperature=0.8, top_p=0.95, stop=["</answer>"], max_new_tokens=128)
    """

    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def request(
        self,
        prompt_ids: Sequence[int],
        *,
        seed: int,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] = (),
        tag: str = "",
    ) -> GenerationRequest:
        """A generation row with these options; `stop_token_ids` (the chat's) join the policy's own."""
        options = self.options()
        options["stop_token_ids"] = tuple(dict.fromkeys([*stop_token_ids, *self.stop_token_ids]))
        cap = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        return GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=cap, seed=seed, tag=tag, **options)


@dataclass(frozen=True, kw_only=True)
class GenerationRequest(SamplingOptions):
    """One row of a generate call: a prompt, a token cap, a seed and the sampling options."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    tag: str = ""  # names the row in errors (e.g. the conversation id)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.prompt_ids) == 0:
            raise ValueError(f"GenerationRequest {self.tag!r}: prompt_ids is empty")
        if self.max_new_tokens < 0:
            raise ValueError(
                f"GenerationRequest {self.tag!r}: max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )

    def _where(self) -> str:
        return f"GenerationRequest {self.tag!r}"


@dataclass(kw_only=True)
class Generation:
    """What one row produced."""

    token_ids: list[int]  # sampled ids, verbatim, including a final stop token if one came
    # logprob of each sampled id under the distribution it was drawn from (SamplingOptions)
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop id or stop string came) or "length" (the cap was reached)


@runtime_checkable
class Engine(Protocol):
    """Anything that generates rows. Rollouts tell engines apart by object; `name` is for
    display and for aligning engine calls across ranks, so two different engines in one
    rollout need different names (`co_step` refuses two under one name).

    Example (a fake that always answers token 7 once)::

        class Seven:
            name = "seven"
            max_context = 4096
            def generate(self, requests):
                return [Generation(token_ids=[7], logprobs=[0.0], finish_reason="length")
                        for _ in requests]
    """

    name: str
    max_context: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...


def check_context(requests: Sequence[GenerationRequest], max_context: int) -> list[int]:
    """Per-row token caps that keep prompt + new tokens inside the context; errors name the row."""
    caps = []
    for r in requests:
        if len(r.prompt_ids) >= max_context:
            raise ValueError(
                f"request {r.tag!r}: prompt of {len(r.prompt_ids)} tokens does not fit the "
                f"engine's context of {max_context} tokens"
            )
        caps.append(min(r.max_new_tokens, max_context - len(r.prompt_ids)))
    return caps


@dataclass
class EngineStats:
    """Time spent inside model forwards, for engine-time fractions in benchmarks."""

    forward_s: float = 0.0
    forwards: int = 0
    generated_tokens: int = 0

    def reset(self) -> None:
        self.forward_s, self.forwards, self.generated_tokens = 0.0, 0, 0


@dataclass
class HFEngine:
    """Generation with the `transformers` model being trained: left-padded batches, KV cache.

    The model is put in eval mode for the call and restored afterwards; no gradient is kept.
    With `sync_group` (an HF model under DeepSpeed ZeRO-3, whose every forward gathers
    weights across the group) the ranks take the same number of forward steps: a rank that is
    done, or called with no rows, keeps stepping a dummy row while any rank still decodes.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str = "policy"
    max_context: int = 0  # 0: the model's max_position_embeddings
    stats: EngineStats = field(default_factory=EngineStats)
    sync_group: Any = None  # process group whose ranks must forward in lockstep

    def __post_init__(self) -> None:
        if not self.max_context:
            self.max_context = int(self.model.config.max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)

    def _forward(self, **kwargs):
        t0 = time.perf_counter()
        out = self.model(**kwargs, use_cache=True)
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.forwards += 1
        return out

    def _checked_caps(self, requests: Sequence[GenerationRequest], synced: bool) -> list[int]:
        """`check_context`; in lockstep every rank learns whether any rank's rows were rejected.

        A rank that raised here while the others entered the first forward's all-reduce would
        leave them waiting there, so the rejection is agreed on first and every rank raises
        (the vote then names the real cause). A failure in the middle of decoding would still
        stall the group until the collective times out: lockstep forwards share one collective.
        """
        try:
            caps, error = check_context(requests, self.max_context), None
        except ValueError as exc:
            caps, error = [], exc
        if synced:
            flag = torch.tensor([0.0 if error is None else 1.0])
            parallel.all_reduce(flag, "max", self.sync_group)
            if error is None and flag.item() > 0:
                raise ValueError(f"engine {self.name!r}: another rank's rows were rejected (see its error)")
        if error is not None:
            raise error
        return caps

    def _anyone(self, active: torch.Tensor, synced: bool) -> bool:
        """Is any row still decoding (on any rank of the sync group, when synced)?"""
        flag = torch.tensor([int(active.any())])
        if synced:
            parallel.all_reduce(flag, "max", self.sync_group)
        return bool(flag.item())

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        synced = self.sync_group is not None and parallel.world_size(self.sync_group) > 1
        if not requests and not synced:
            return []
        caps = self._checked_caps(requests, synced)
        dummy = not requests
        if dummy:  # join the group's forwards with one dummy row that samples nothing
            requests, caps = [GenerationRequest(prompt_ids=[self.pad_id], max_new_tokens=0)], [0]
        was_training = self.model.training
        self.model.eval()
        try:
            out = self._generate(requests, caps, synced)
            return [] if dummy else out
        finally:
            self.model.train(was_training)

    def _generate(
        self, requests: Sequence[GenerationRequest], caps: list[int], synced: bool
    ) -> list[Generation]:
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        b = len(requests)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every row's last prompt token aligns
            ids[i, width - lens[i] :] = torch.as_tensor(list(r.prompt_ids), dtype=torch.long)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T] each row starts at 0
        cap_t = torch.tensor(caps)

        out_ids: list[list[int]] = [[] for _ in range(b)]
        out_lp: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        active = torch.tensor([c > 0 for c in caps])
        cache = DynamicCache()
        logits = self._forward(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache
        ).logits[:, -1]  # [B, V]
        sampler = BatchSampling(
            requests,
            vocab_start=0,
            vocab_width=logits.shape[-1],
            tokenizer=self.tokenizer,
            owner=f"engine {self.name!r}",
        )
        next_pos = positions[:, -1] + 1  # [B]
        step = 0
        running = self._anyone(active, synced)
        while running:
            rows = torch.nonzero(active).flatten()  # [A] only the rows still decoding sample
            picked, logp = sampler.sample(logits.float().cpu()[rows], rows, step)
            tokens = torch.full((b,), self.pad_id, dtype=torch.long).index_copy(0, rows, picked)
            for i, tok, lp in zip(rows.tolist(), picked.tolist(), logp.tolist(), strict=True):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                if sampler.record(i, tok, out_ids[i]):
                    reasons[i] = "stop"
                    active[i] = False
            step += 1
            active &= cap_t > step
            running = self._anyone(active, synced)
            if not running:
                break
            # finished rows keep decoding a pad token, masked out, so shapes stay aligned
            feed = torch.where(active, tokens, torch.full_like(tokens, self.pad_id))
            mask = torch.cat([mask, active.to(mask.dtype)[:, None].to(device)], dim=1)
            logits = self._forward(
                input_ids=feed[:, None].to(device),
                attention_mask=mask,
                position_ids=next_pos[:, None],
                cache=cache,
            ).logits[:, -1]
            next_pos = next_pos + 1
        self.stats.generated_tokens += sum(len(x) for x in out_ids)
        return [
            Generation(token_ids=out_ids[i], logprobs=out_lp[i], finish_reason=reasons[i]) for i in range(b)
        ]
