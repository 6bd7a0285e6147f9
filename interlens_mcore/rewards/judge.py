"""`--judge-model PATH --judge-template FILE`: a generative judge scoring each trajectory.

The template is a text file whose `{name}` placeholders are filled per trajectory with
`{prompt}` (`inputs.RewardInputs.context_text`: the row's opening messages and whatever was
said before the seat's last message, a line apart), `{completion}` (that message) and the row's
columns (`{solution}`...; a dataset row's own `prompt` column is shadowed by ours). Literal
braces are doubled (`{{` / `}}`), as in `str.format`. A placeholder the row does not fill is a
`JudgeTemplateError` naming the file and the key, raised on every rank of the rollout group.

The judge sees the filled template as one user message (through its chat template when it has
one), answers greedily with at most `max_new_tokens` tokens, and the reply is read by
`parse_score`: the number after the last `score:` (or `score =`), else the last number in the
reply; it must lie in [0, 1]. A reply with no such number scores 0 and is counted
(`judge/unparsed` in the step's metrics, from `infos.extra["judge_unparsed"]`).

The judge is a frozen `HFEngine` of the folder (loaded once, on the first call) and its calls
go through the rollout's lockstep round (`rollout.round.run_rounds`): every rank of the rollout
group votes, then makes the same generate calls, a rank without samples with empty ones, and a
failure on one rank is the same error on all of them.
"""

from __future__ import annotations

import asyncio
import math
import re
import string
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from ..engines.base import Engine, Generation, GenerationRequest, SamplingParams
from ..grpo.rewards import RewardError
from ..rollout.round import Call, Driver, Need, generate_waves, run_rounds
from ..rollout.vote import GatherFn, RolloutError, local_gather
from ..types import Status, Trajectory
from .inputs import reward_inputs
from .model import RewardModelError, check_weights, fail, frozen

T = TypeVar("T")
NAME = "judge"
OURS = ("prompt", "completion")
SCORE = re.compile(r"score\s*[:=]\s*([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


class JudgeTemplateError(ValueError):
    """A --judge-template file that cannot be read or filled."""


class JudgeError(RewardError):
    """The judge's round failed on some rank: the same error on every rank of the rollout group.

    A `RewardError`, so a caller that retries a raising reward function sample by sample does
    not retry this one: a retry would run a different number of rounds on each rank.
    """


def parse_score(reply: str) -> float | None:
    """The judge's score in `reply`: the last `score: X`, else the last number; None outside [0, 1]."""
    found = SCORE.findall(reply) or NUMBER.findall(reply)
    if not found:
        return None
    value = float(found[-1])
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


@dataclass(frozen=True)
class Template:
    """A judge prompt with `{name}` placeholders, read from `path`."""

    path: Path
    text: str
    keys: tuple[str, ...]

    @classmethod
    def read(cls, path: str | Path) -> Template:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise JudgeTemplateError(f"--judge-template {path}: cannot be read ({exc})") from None
        try:
            fields = [f for _, f, spec, conv in string.Formatter().parse(text) if f is not None]
        except ValueError as exc:  # a lone brace
            raise JudgeTemplateError(
                f"--judge-template {path}: {exc} (write a literal brace as {{{{ or }}}})"
            ) from None
        for f in fields:
            if not f.isidentifier():
                raise JudgeTemplateError(
                    f"--judge-template {path}: placeholder {{{f}}} is not a name; expected "
                    "{prompt}, {completion} or a row column such as {solution}"
                )
        if "completion" not in fields:
            raise JudgeTemplateError(
                f"--judge-template {path}: no {{completion}} placeholder; the judge would not see "
                "what it scores"
            )
        return cls(path, text, tuple(dict.fromkeys(fields)))

    def fill(self, values: dict[str, object], where: str) -> str:
        """The template with `values`; a key they lack is an error naming the file and `where`."""
        missing = [k for k in self.keys if k not in values]
        if missing:
            have = ", ".join(sorted(values))
            raise JudgeTemplateError(
                f"--judge-template {self.path}: placeholder {{{missing[0]}}} is not filled for "
                f"{where} (it has: {have})"
            )
        return self.text.format_map({k: values[k] for k in self.keys})


@dataclass
class _Round(Driver):
    """One judge call in the rollout's lockstep round: vote, then the same generate calls everywhere."""

    engine: Callable[[], Engine]
    requests: list[GenerationRequest]
    done: bool = False
    out: list[Generation] = field(default_factory=list)

    async def local(self) -> dict[str, Need]:
        return {} if self.done or not self.requests else {NAME: Need(engine=NAME, rows=len(self.requests))}

    def call(self, calls: list[Call]) -> None:
        self.done = True
        for c in calls:  # one: the judge's
            self.out = generate_waves(self.engine(), self.requests, c, None)


@dataclass
class Judge:
    """The `judge` reward function: `fn(trajectories, rows)` -> the judge's parsed scores."""

    path: Path
    template: Template
    max_new_tokens: int = 16
    gather_fn: GatherFn = local_gather  # the rollout group's vote (`ParallelGroups.gather_fn()`)
    rank: int = 0
    name: str = NAME
    _engine: Engine | None = field(default=None, init=False, repr=False)
    # every rank of the rollout group must call it as often, even one without live samples
    # (with empty lists), and never retry it sample by sample: its round is collective
    collective: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.max_new_tokens < 1:
            raise RewardModelError(f"--judge-max-new-tokens must be >= 1, got {self.max_new_tokens}")
        archs = check_weights(self.path, "--judge-model").get("architectures") or []
        if not any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            raise RewardModelError(
                f"--judge-model {self.path}: not a causal LM (config.json architectures: {archs}); "
                "the judge generates its verdict, so it needs a ...ForCausalLM folder"
            )

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = load_engine(self.path)
        return self._engine

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
        error: Exception | None = None
        judged: list[int] = []
        requests: list[GenerationRequest] = []
        try:
            for i, (t, row) in enumerate(zip(trajectories, rows, strict=True)):
                request = self.request(t, row, i)
                if request is not None:
                    judged.append(i)
                    requests.append(request)
        except Exception as exc:  # voted on: every rank raises it alike
            error, judged, requests = exc, [], []
        driver = _Round(self.engine, requests)
        try:
            run_blocking(run_rounds(driver, gather_fn=self.gather_fn, rank=self.rank, bound=1, error=error))
        except RolloutError as exc:
            raise JudgeError(f"judge: {exc}") from exc
        return self.scores(trajectories, judged, driver.out)

    def request(self, t: Trajectory, row: object, i: int) -> GenerationRequest | None:
        """The generate row judging `t`; None when `t` is not judged (FAILED, or too long)."""
        if t.status is Status.FAILED:
            return None
        where = f"trajectory {i} ({t.infos.conversation or '?'}, seat {t.participant!r})"
        seen = reward_inputs(t, row)
        values = {**seen.columns, "prompt": seen.context_text, "completion": seen.completion_text}
        prompt = self.template.fill(values, where)  # a key the rows lack: every sample's error, raised
        engine = self.engine()  # loading it is not one sample's failure: outside the try
        try:  # a text the judge's chat template refuses fails only its own sample
            ids = self.prompt_ids(prompt)
        except Exception as exc:
            fail(t, f"judge: {type(exc).__name__}: {exc}")
            return None
        if len(ids) >= engine.max_context:
            fail(
                t,
                f"judge: the filled template is {len(ids)} tokens, the judge's context "
                f"{engine.max_context} ({self.template.path})",
            )
            return None
        tok = self.tokenizer
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return params.request(ids, seed=0, stop_token_ids=stops, tag=t.infos.conversation or str(i))

    @property
    def tokenizer(self):
        return self.engine().tokenizer  # type: ignore[attr-defined]

    def prompt_ids(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template:
            message = [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(prompt)["input_ids"])

    def scores(
        self, trajectories: Sequence[Trajectory], judged: list[int], out: list[Generation]
    ) -> list[float]:
        """Each judged trajectory's parsed score (0 when unparsable), the reply kept in `extra`."""
        scores = [0.0] * len(trajectories)
        for i, gen in zip(judged, out, strict=True):
            reply = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            value = parse_score(reply)
            extra = trajectories[i].infos.extra
            extra["judge_reply"], extra["judge_unparsed"] = reply, int(value is None)
            scores[i] = 0.0 if value is None else value
        return scores


def run_blocking(coroutine: Coroutine[object, object, T]) -> T:
    """Run `coroutine` to its end from synchronous code, also when called inside a running event
    loop (a caller that awaits async reward functions): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def load_engine(path: Path) -> Engine:
    """A frozen `HFEngine` of the causal LM in `path` (safetensors only) on this rank's device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engines.hf import HFEngine

    model, _ = frozen(AutoModelForCausalLM, path)
    return HFEngine(model, AutoTokenizer.from_pretrained(path), name=NAME)
