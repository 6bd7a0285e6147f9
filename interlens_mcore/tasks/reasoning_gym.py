"""reasoning-gym tasks: procedurally generated questions, its verifiers as the reward.

`source("basic_arithmetic")` gives rows of one dataset; `source("chain_sum+basic_arithmetic",
weights="1,2")` a weighted mix (reasoning-gym's composite dataset). Other keyword arguments go
to the dataset's config (e.g. `min_terms=2`), or per dataset of a mix through `configs`.

Rows are drawn from a seed alone; a question is held out for evaluation by a hash of its text
(`eval_fraction` of all questions), so training and evaluation never share a question.

The answer is taken from the reply by `AnswerRule`: the text inside the last
`<answer>...</answer>` (tag configurable), else the reply's last non-empty line
(`fallback="last_line"`, or `"last_number"` the last number in the reply, as GSM8K-style
graders read one, or `"whole"` the whole reply, or `"none"` no answer). It is scored by
the dataset's `score_answer`, in [0, 1]; a verifier that raises scores 0 and the cause is kept.

With `max_attempts > 1` the judge answers a wrong reply ("plain": that it is wrong;
"detailed": also the answer it read and its score, or why none was read) and the policy tries
again. Reward: the last attempt's score x `discount ** (attempts - 1)`.

`conv.infos`: `success` (1.0 when an answer scored 1), `score`, `attempts`, `answer_found`
(attempts whose reply held an answer), `verifier_errors`, and `verifier_error` (the last
cause, as text). With `max_attempts > 1` also two rates that evaluation reports with their
intervals (`eval/rate/...`, see trainers/report/record.py): `rate/first_attempt` (the first
reply solved it) and, only where the first failed and a second attempt was made,
`rate/second_attempt_after_miss` (the second reply solved it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..types import Message
from .base import TaskSource
from .families import PRETRAINED_ON_CPU
from .split import check_fraction, derive_seed, held_out

AnswerFallback = Literal["last_line", "last_number", "whole", "none"]
_FALLBACKS = ("last_line", "last_number", "whole", "none")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
Feedback = Literal["plain", "detailed"]


@dataclass(frozen=True, kw_only=True)
class AnswerRule:
    """How the answer is read from a reply (see the module docstring)."""

    tag: str | None = "answer"  # None: no tag, the fallback alone decides
    fallback: AnswerFallback = "last_line"

    def __post_init__(self) -> None:
        if self.fallback not in _FALLBACKS:
            raise ValueError(
                f"AnswerRule.fallback must be one of {', '.join(_FALLBACKS)}; got {self.fallback!r}"
            )
        if self.tag is not None and not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"AnswerRule.tag must be a tag name like 'answer', got {self.tag!r}")

    @property
    def instruction(self) -> str:
        if self.tag is None:
            return "Give your final answer on the last line."
        return f"Give your final answer between <{self.tag}> and </{self.tag}>."

    def extract(self, text: str) -> str | None:
        """The answer in `text`, stripped, or None when the reply holds none."""
        if self.tag is not None:
            found = re.findall(rf"<{self.tag}>(.*?)</{self.tag}>", text, flags=re.DOTALL)
            if found:
                return found[-1].strip() or None
        if self.fallback == "whole":
            return text.strip() or None
        if self.fallback == "last_line":
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            return lines[-1] if lines else None
        if self.fallback == "last_number":
            numbers = _NUMBER.findall(text)
            return numbers[-1].replace(",", "") if numbers else None
        return None


@dataclass(frozen=True, kw_only=True)
class ReasoningOptions:
    """How a question is played: attempts, discount, feedback, answer rule."""

    max_attempts: int = 1
    discount: float = 1.0  # reward x discount ** (attempts - 1)
    feedback: Feedback = "plain"
    rule: AnswerRule = field(default_factory=AnswerRule)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"reasoning_gym: max_attempts must be >= 1, got {self.max_attempts}")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"reasoning_gym: discount must lie in (0, 1], got {self.discount}")
        if self.feedback not in ("plain", "detailed"):
            raise ValueError(f"reasoning_gym: feedback must be 'plain' or 'detailed', got {self.feedback!r}")


@dataclass(eq=False)
class ReasoningTask:
    """One question: the reasoning-gym entry, its verifier, how it is played."""

    entry: dict[str, object]  # {"question", "answer", "metadata"}
    score: Callable[[str | None, dict[str, object]], float]  # the dataset's score_answer
    options: ReasoningOptions

    @property
    def max_turns(self) -> int:
        return 2 * self.options.max_attempts

    @property
    def columns(self) -> dict[str, object]:
        """What reward functions read of the row: the entry's question, answer and metadata."""
        return self.entry

    def judge(self, reply: str) -> tuple[str | None, float, str | None]:
        """The answer read from `reply` by the answer rule, its verifier score in [0, 1], and why the
        verifier failed (None when it did not): a verifier that raises or returns something other
        than a finite number scores 0."""
        answer = self.options.rule.extract(reply)
        try:
            score = self.score(answer, self.entry)
        except Exception as exc:  # a verifier that chokes on a malformed answer scores it 0
            return answer, 0.0, f"{type(exc).__name__}: {exc}"
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            return answer, 0.0, f"verifier returned {score!r}, expected a finite number"
        return answer, float(score), None

    def prompt(self) -> list[Message]:
        text = f"{self.entry['question']}\n{self.options.rule.instruction}"
        return [Message(speaker="user", content=text, role="user")]

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        return [seat("policy"), ReasoningJudge(self)]


class ReasoningJudge(Environment):
    """Scores each reply with the verifier; asks again while attempts remain."""

    name, role = "judge", "user"

    def __init__(self, task: ReasoningTask, *, policy: str = "policy"):
        self.task, self.policy = task, policy

    def respond(self, conv: Conversation) -> str | None:
        info = conv.infos
        for key in ("attempts", "answer_found", "verifier_errors"):
            info.setdefault(key, 0)
        replies = [m.content for m in conv.messages if m.speaker == self.policy]
        answer, score, error = self.task.judge(replies[-1] if replies else "")
        info["attempts"] += 1
        info["answer_found"] += int(answer is not None)
        if error is not None:
            info["verifier_errors"] += 1
            info["verifier_error"] = error
        info["score"], info["success"] = score, float(score >= 1.0)
        if self.task.options.max_attempts > 1 and info["attempts"] <= 2:
            key = "rate/first_attempt" if info["attempts"] == 1 else "rate/second_attempt_after_miss"
            info[key] = float(score >= 1.0)
        if score >= 1.0:
            conv.request_stop("solved")
            return None
        if info["attempts"] >= self.task.options.max_attempts:
            conv.request_stop("out of attempts")
            return None
        return self._feedback(answer, score, error)

    def _feedback(self, answer: str | None, score: float, error: str | None) -> str:
        if self.task.options.feedback == "plain":
            return "That is not right. Try again."
        if answer is None:
            return f"No answer found. {self.task.options.rule.instruction} Try again."
        if error is not None:
            return f"Your answer {answer!r} could not be checked ({error}). Try again."
        return f"Your answer {answer!r} scored {score:.2f} of 1. Try again."

    def reward(self, conv: Conversation) -> float:
        attempts = conv.infos.get("attempts", 0)
        if not attempts:
            return 0.0
        return conv.infos["score"] * self.task.options.discount ** (attempts - 1)


def _weights(weights: str | Sequence[float] | None, names: list[str]) -> list[float]:
    if weights is None:
        return [1.0] * len(names)
    values = (
        [float(w) for w in weights.split(",")] if isinstance(weights, str) else [float(w) for w in weights]
    )
    if len(values) != len(names) or any(not w > 0 for w in values):
        raise ValueError(
            f"reasoning_gym: weights {weights!r} must be {len(names)} positive numbers, one per {names}"
        )
    return values


class ReasoningGymSource(TaskSource):
    """Rows of one reasoning-gym dataset or a weighted mix of several."""

    def __init__(
        self,
        name: str,
        *,
        weights: str | Sequence[float] | None = None,
        configs: dict[str, dict[str, object]] | None = None,
        eval_fraction: float = 0.1,
        options: ReasoningOptions = ReasoningOptions(),
        **config: object,
    ):
        import reasoning_gym
        from reasoning_gym.composite import DatasetSpec
        from reasoning_gym.factory import DATASETS

        names = [n.strip() for n in name.split("+")]
        unknown = [n for n in names if n not in DATASETS or n == "composite"]
        if unknown or not all(names):
            known = ", ".join(sorted(n for n in DATASETS if n != "composite"))
            raise ValueError(f"reasoning_gym: no dataset {unknown or [name]!r}; the datasets: {known}")
        if len(set(names)) != len(names):
            raise ValueError(f"reasoning_gym: {name!r} names a dataset twice")
        check_fraction(eval_fraction, "reasoning_gym: eval_fraction")
        configs = dict(configs or {})
        if config and len(names) > 1:
            raise ValueError(
                f"reasoning_gym: options {sorted(config)} are ambiguous for the mix {name!r}; "
                "pass them per dataset through configs={'NAME': {...}}"
            )
        if config:
            configs[names[0]] = {**configs.get(names[0], {}), **config}
        stray = sorted(set(configs) - set(names))
        if stray:
            raise ValueError(f"reasoning_gym: configs names {stray}, which are not in {names}")
        self.name = f"reasoning_gym:{name}"
        self.names, self.weights, self.configs = names, _weights(weights, names), configs
        self.eval_fraction, self.options = eval_fraction, options
        self._create = reasoning_gym.create_dataset
        self._spec = DatasetSpec
        self._dataset(0, 1)  # a wrong option fails here, naming the dataset, not at the first step

    def _dataset(self, seed: int, size: int) -> Any:
        try:
            if len(self.names) == 1:
                return self._create(
                    self.names[0], size=size, seed=seed, **self.configs.get(self.names[0], {})
                )
            specs = [
                self._spec(name=n, weight=w, config=self.configs.get(n, {}))
                for n, w in zip(self.names, self.weights)
            ]
            return self._create("composite", size=size, seed=seed, datasets=specs)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"{self.name}: cannot create the dataset with {self.configs}: {exc}") from exc

    def _draw(self, n: int, seed: int, *, evaluation: bool) -> list[ReasoningTask]:
        bound = 50 * n + 200  # a held-out fraction of 0.1 needs about 10 draws per evaluation row
        ds = self._dataset(derive_seed(seed, "eval" if evaluation else "train"), bound)
        out: list[ReasoningTask] = []
        seen: set[str] = set()  # held-out questions are distinct: n of them are n problems
        for i in range(bound):
            if len(out) == n:
                break
            entry = ds[i]
            if held_out(entry["question"], self.eval_fraction) != evaluation:
                continue
            if evaluation:
                if entry["question"] in seen:
                    continue
                seen.add(entry["question"])
            out.append(ReasoningTask(entry=entry, score=ds.score_answer, options=self.options))
        if len(out) < n:
            side = "held-out" if evaluation else "training"
            raise ValueError(
                f"{self.name}: found {len(out)} of {n} {side} questions in {bound} draws; the dataset has "
                "too few distinct questions for this eval_fraction (configure a wider range)"
            )
        return out

    def rows(self, n: int, *, seed: int) -> list[ReasoningTask]:
        return self._draw(n, seed, evaluation=False)

    def eval_rows(self, n: int, *, seed: int) -> list[ReasoningTask]:
        return self._draw(n, seed, evaluation=True)

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """The rows' own answers in the task's answer format (their working, where a row gives one,
        is not shown: reasoning-gym keeps it in free-form metadata)."""
        out = []
        for task in self.rows(n, seed=seed):
            rule, answer = task.options.rule, str(task.entry["answer"])
            reply = f"<{rule.tag}>{answer}</{rule.tag}>" if rule.tag else answer
            out.append(
                [{"role": m.role, "content": m.content} for m in task.prompt()]
                + [{"role": "assistant", "content": reply}]
            )
        return out

    def option_defaults(self) -> dict[str, object]:
        # room for a short working and `<answer>...</answer>` (6 tokens cannot hold the tags)
        return {**PRETRAINED_ON_CPU, "max_new_tokens": 48}

    def dataset_of(self, row: object) -> str | None:
        assert isinstance(row, ReasoningTask), "this source's rows are ReasoningTasks"
        # reasoning-gym's composite dataset names each entry's source dataset
        if len(self.names) == 1:
            return None
        metadata = row.entry["metadata"]
        name = metadata.get("source_dataset") if isinstance(metadata, dict) else None
        return name if isinstance(name, str) else None

    def describe(self) -> dict[str, object]:
        o = self.options
        return {
            "name": self.name,
            "datasets": self.names,
            "weights": self.weights,
            "configs": self.configs,
            "eval_fraction": self.eval_fraction,
            "max_attempts": o.max_attempts,
            "discount": o.discount,
            "feedback": o.feedback,
            "answer_tag": o.rule.tag,
            "answer_fallback": o.rule.fallback,
        }


def source(
    name: str,
    *,
    max_attempts: int = 1,
    discount: float = 1.0,
    feedback: Feedback = "plain",
    answer_tag: str | None = "answer",
    answer_fallback: AnswerFallback = "last_line",
    weights: str | Sequence[float] | None = None,
    configs: dict[str, dict[str, object]] | None = None,
    eval_fraction: float = 0.1,
    **config: object,
) -> ReasoningGymSource:
    """The task source of `--task reasoning_gym:NAME` (NAME one dataset, or "a+b" a mix)."""
    rule = AnswerRule(tag=answer_tag, fallback=answer_fallback)
    options = ReasoningOptions(max_attempts=max_attempts, discount=discount, feedback=feedback, rule=rule)
    return ReasoningGymSource(
        name, weights=weights, configs=configs, eval_fraction=eval_fraction, options=options, **config
    )
