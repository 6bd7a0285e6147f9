"""`MathAccuracy`: the ms-swift ORM ported schedulers and environments score math answers with.

An ORM is called as ms-swift calls one: `orm(completions, solution, **columns)` returns one
float per completion. `MathAccuracy` is 1.0 where math_verify finds the completion's answer
equal to the solution, else 0.0. A completion's answer is what its `<answer>...</answer>` holds,
else the whole text (where math_verify then looks for a boxed or plain LaTeX answer); the
solution is read the same way. A solution math_verify cannot read scores 0.0: a row's bad
solution should not reward every reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer(text: str) -> str:
    found = _ANSWER.search(text)
    return found.group(1).strip() if found else text


class MathAccuracy:
    """1.0 for a completion whose answer math_verify finds equal to its solution, else 0.0."""

    def __init__(self, args: Any = None, **kwargs: Any):
        try:  # imported here: math_verify is an extra (pip install interlens_mcore[swift])
            import math_verify
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "MathAccuracy needs math_verify: pip install math-verify==0.9.0"
            ) from None
        self._verify = math_verify

    def __call__(self, completions: Sequence[str], solution: Sequence[str], **kwargs: Any) -> list[float]:
        if len(completions) != len(solution):
            raise ValueError(
                f"MathAccuracy: {len(completions)} completions for {len(solution)} solutions"
            )
        return [self._score(str(c), str(s)) for c, s in zip(completions, solution, strict=True)]

    def _score(self, completion: str, solution: str) -> float:
        mv = self._verify
        gold = mv.parse(_answer(solution))
        if not gold:
            return 0.0
        answer = mv.parse(_answer(completion))
        try:
            return float(mv.verify(gold, answer))
        except Exception:  # math_verify raises on answers sympy cannot compare: not equal
            return 0.0
