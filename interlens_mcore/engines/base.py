"""The engine protocol and what it is called with: sampling options, requests, generations.

An engine turns rows of prompt ids into sampled continuations. Every row carries its own
sampling settings, token cap and seed, so the tokens a row gets depend only on that row:
never on its batch, its wave or its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable


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


# below this a temperature-scaled logit overflows float32 (and logprobs turn NaN) long before
# it differs from greedy; 0 is greedy
MIN_TEMPERATURE = 1e-4


def check_temperature(temperature: float, where: str) -> None:
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"{where}: temperature {temperature!r} is too small to sample with (logits scaled by it "
            f"overflow); use 0 for greedy or a temperature >= {MIN_TEMPERATURE:g}"
        )
