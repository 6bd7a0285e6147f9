"""ms-swift's reward-model names for ported files: `ORM`, `AsyncORM`, `orms`, `MathAccuracy`.

A plugin file written for ms-swift subclasses `ORM` (or `AsyncORM`, whose `__call__` is a
coroutine) and registers the class in `orms`; after its import line changes to this package,
`--external-plugins FILE.py --reward-funcs NAME` finds it there (interlens_mcore.rewards.registry
reads a plugin module's `orms`). An ORM is called as ms-swift calls one:
`orm(completions, **columns)` returns one float per completion.

`MathAccuracy` is the built-in `accuracy` (interlens_mcore.rewards.builtins.Accuracy, math_verify
over the `<answer>` text, else a boxed or anchored LaTeX answer) with ms-swift's one difference:
a solution math_verify cannot read scores 0.0 instead of None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...rewards.builtins import Accuracy


class ORM:
    """Base of an ms-swift style reward class: `__call__(completions, **kwargs) -> list[float]`."""

    def __init__(self, args: Any = None, **kwargs: Any):
        self.args = args  # ms-swift passes its training arguments; here nothing (None)

    def __call__(self, completions: Sequence[str], **kwargs: Any) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} does not define __call__(completions, **kwargs)")


class AsyncORM(ORM):
    """An ORM whose `__call__` is `async def`: awaited (interlens_mcore.rewards.conventions)."""


# name -> ORM class, filled by plugin files (`orms["my_reward"] = MyReward`); the built-ins
# (`--reward-funcs accuracy format ...`) resolve by name without being listed here
orms: dict[str, type] = {}


class MathAccuracy(Accuracy):
    """1.0 where math_verify finds the completion's answer equal to its solution, else 0.0."""

    def __init__(self, args: Any = None, **kwargs: Any):
        super().__init__()

    def __call__(  # type: ignore[override]  # ms-swift's: `solution` is required, the result never None
        self, completions: Sequence[str], solution: Sequence[object], **kwargs: Any
    ) -> list[float]:
        if len(completions) != len(solution):
            raise ValueError(f"MathAccuracy: {len(completions)} completions for {len(solution)} solutions")
        return [self.one(c, s) for c, s in zip(completions, solution, strict=True)]

    def one(self, completion: str, gold: object) -> float:
        score = super().one(completion, gold)
        return 0.0 if score is None else score  # an unreadable solution rewards nothing
