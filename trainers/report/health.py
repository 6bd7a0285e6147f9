"""The health check of every step: signs that a run cannot learn, each with its likely cause and flag.

Each `Rule` reads one figure of the step's record. `HealthCheck.check(record)` returns the
`health/<rule>` figures (for how many steps in a row the rule's condition has held; 0 when it
does not) and, when a condition has held for `patience` steps in a row or for steps that took
`patience_s` seconds together (a slow task warns after its first long step), one warning line
for it, repeated only after the condition cleared and came back (a resumed run counts afresh).
`HealthCheck.early(rollout_record)` says a warning already due on the step's rollout figures
before the update, which on a slow task may take longer than the rollout::

    check = HealthCheck(max_new_tokens=6)
    figures, warnings = check.check(record)   # {"health/clipped_replies": 3, ...}, ["..."]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A condition on one figure of the record, and what to tell the user when it persists."""

    name: str  # the figure is `health/<name>`
    key: str  # the record's figure it reads; a record without it does not trigger it
    threshold: float
    below: bool = False  # the condition: value <= threshold (else value >= threshold)
    message: Callable[[float, int], str]  # (value, max_new_tokens) -> the warning's text

    def holds(self, record: Mapping[str, object]) -> bool:
        value = record.get(self.key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return value <= self.threshold if self.below else value >= self.threshold


def _zero_std(v: float, _: int) -> str:
    return (
        f"{v:.0%} of groups got equal rewards (frac_reward_zero_std): their advantages are 0, so "
        "nothing is learnt from them; read the rewards in completions.jsonl, raise --temperature or "
        "--num-generations, or use a task setting the policy can sometimes solve"
    )


def _truncated(v: float, _: int) -> str:
    return (
        f"{v:.0%} of samples outgrew the model's context (truncated_fraction) and could not finish; "
        "shorten the episodes (the task's own limit, e.g. --task-arg max_steps=8; --max-turns with a "
        "scheduler), lower --max-new-tokens, or use a model with a longer context (--model)"
    )


def _invalid(v: float, _: int) -> str:
    return (
        f"{v:.0%} of samples ended on invalid moves or actions (invalid/ended_fraction): the policy "
        "does not answer in the task's move format; read its replies in completions.jsonl "
        "(--log-completions-every 1), raise --max-new-tokens if they are cut, start with a supervised "
        "warm-up on demonstrations in that format (--sft-data, e.g. from launch/demos.py), or start "
        "from an instruction-tuned model (--model)"
    )


def _clipped(v: float, max_new_tokens: int) -> str:
    return (
        f"--max-new-tokens {max_new_tokens} cuts {v:.0%} of replies (completions/clipped_ratio); "
        "raise --max-new-tokens"
    )


def _no_tools(v: float, _: int) -> str:
    return (
        f"the policy calls no tool (tool/calls_per_sample {v:.2f}) although --tools offers them; warm it "
        "up on demonstrations of calls (--sft-data, e.g. from launch/demos.py), use a "
        "model tuned for tool calling (--model), and check in completions.jsonl that its chat "
        "template shows the tools"
    )


def _failed(v: float, _: int) -> str:
    return (
        f"{v:.0f} samples of the step failed (failed_samples): a scheduler, environment or tool raised "
        "for them, and they leave the loss; metrics.jsonl counts them per cause (failed/<cause>), "
        "completions.jsonl shows their stop_reason; --on-sample-error raise stops at the first one"
    )


def _no_success(v: float, _: int) -> str:
    return (
        f"no sample reached the task's goal (success_rate {v:.0%}): what is learnt comes only from "
        "differences in partial rewards; make the task easier (its own settings, e.g. --task-arg "
        "max_steps=... or a smaller map), sample more (--num-generations, --temperature), or start "
        "from a stronger model (--model)"
    )


RULES = (
    Rule(name="zero_std_groups", key="frac_reward_zero_std", threshold=0.9, message=_zero_std),
    Rule(name="truncated", key="truncated_fraction", threshold=0.5, message=_truncated),
    Rule(name="invalid_moves", key="invalid/ended_fraction", threshold=0.5, message=_invalid),
    Rule(name="clipped_replies", key="completions/clipped_ratio", threshold=0.9, message=_clipped),
    Rule(name="no_tool_calls", key="tool/calls_per_sample", threshold=0.0, below=True, message=_no_tools),
    Rule(name="failed_samples", key="failed_samples", threshold=1, message=_failed),
    Rule(name="no_success", key="success_rate", threshold=0.0, below=True, message=_no_success),
)


@dataclass(kw_only=True)
class HealthCheck:
    """Counts, rule by rule, the steps in a row whose record meets the rule's condition."""

    max_new_tokens: int  # what the clipped-replies warning names
    patience: int = 3  # steps in a row before a warning
    # or this long in a row (the steps' rollout_s + train_s): a task whose steps take half an hour
    # says so after its first one
    patience_s: float = 600.0
    rules: tuple[Rule, ...] = RULES
    streaks: dict[str, int] = field(default_factory=dict)
    held_s: dict[str, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)  # rules that warned in their current stretch

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"HealthCheck.patience must be >= 1, got {self.patience}")
        if not self.patience_s > 0:
            raise ValueError(f"HealthCheck.patience_s must be > 0 seconds, got {self.patience_s}")

    def check(self, record: Mapping[str, object]) -> tuple[dict[str, int], list[str]]:
        """This step's `health/<rule>` figures, and the warnings that are due now."""
        figures, warnings = {}, []
        seconds = _seconds(record, ("rollout_s", "train_s"))
        for rule in self.rules:
            if rule.holds(record):
                streak = self.streaks.get(rule.name, 0) + 1
                held = self.held_s.get(rule.name, 0.0) + seconds
            else:
                streak, held = 0, 0.0
                self.warned.discard(rule.name)
            self.streaks[rule.name], self.held_s[rule.name] = streak, held
            figures[f"health/{rule.name}"] = streak
            warnings += self._due(rule, record, streak, held)
        return figures, warnings

    def early(self, rollout_record: Mapping[str, object]) -> list[str]:
        """The warnings already due on this step's rollout figures and `rollout_s`, before its
        update (which may take longer than the rollout): each is said once, and the step's
        `check` then counts the step without saying it again. Counts nothing itself."""
        seconds = _seconds(rollout_record, ("rollout_s",))
        warnings = []
        for rule in self.rules:
            if rule.holds(rollout_record):
                streak = self.streaks.get(rule.name, 0) + 1
                held = self.held_s.get(rule.name, 0.0) + seconds
                warnings += self._due(rule, rollout_record, streak, held)
        return warnings

    def _due(self, rule: Rule, record: Mapping[str, object], streak: int, held: float) -> list[str]:
        """The rule's warning when its stretch is long enough and has not warned yet (marked as
        warned): once per stretch, so a run that stays stuck says it once."""
        due = streak >= self.patience or (streak and held >= self.patience_s)
        if not due or rule.name in self.warned:
            return []
        self.warned.add(rule.name)
        value = record[rule.key]
        assert isinstance(value, (int, float))  # Rule.holds checked it
        stretch = f"{streak} steps in a row" if streak > 1 else "1 step"
        if streak < self.patience:
            stretch += f" of {held / 60:.0f} min"
        return [
            f"warning: {rule.message(float(value), self.max_new_tokens)} "
            f"(for {stretch}, step {record.get('step')})"
        ]


def _seconds(record: Mapping[str, object], keys: tuple[str, ...]) -> float:
    """The record's positive durations under `keys`, summed."""
    return sum(v for k in keys if isinstance(v := record.get(k), (int, float)) and v > 0)
