"""Built-in rewards by name (`--reward-funcs accuracy format ...`), in ms-swift's ORM convention.

Each is a class whose keyword parameters are its options (defaults: ms-swift's); the name
resolves to an instance with those defaults, the length caps taken from `--max-new-tokens`.
Use other values from Python: `myrewards.py` holds `cosine = Cosine(max_len=256)`, then
`--reward myrewards.py:cosine`.

| name | reward |
| accuracy | 1.0 when the completion's answer equals the row's `solution` (else `answer`) by
  `math_verify`, 0.0 when not, None when the gold answer does not parse |
| format | 1.0 for `<think>...</think><answer>...</answer>` and nothing after, else 0.0 |
| react_format | 1.0 for `<think>...</think>` then `Action: ...` and `Action Input: ...` |
| cosine | accuracy scaled by length on a cosine from `min_len_value_*` (empty) to
  `max_len_value_*` (`max_len` tokens), `_correct` or `_wrong` by accuracy |
| repetition | `max_penalty` times the share of repeated word `ngram_size`-grams |
| soft_overlong | 0 up to `max_length - buffer` tokens, then linear down to -1 at `max_length` |
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
from collections.abc import Sequence

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
REACT = re.compile(r"^\s*<think>.*?</think>\s*Action:.*?Action Input:.*$", re.DOTALL)


def _inside_answer(text: str) -> str | None:
    found = ANSWER.search(text)
    return found.group(1).strip() if found else None


class Accuracy:
    """Math answer equivalence by `math_verify` (module docstring)."""

    name = "accuracy"

    def __init__(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(
                "the accuracy reward compares answers with math_verify, which is not installed "
                "(pip install -e '.[rewards]')"
            )

    def __call__(
        self,
        completions: Sequence[str],
        solution: Sequence[object] | None = None,
        answer: Sequence[object] | None = None,
        **kwargs: object,
    ) -> list[float | None]:
        gold = solution if solution is not None else answer
        if gold is None:
            raise KeyError("accuracy needs a 'solution' or 'answer' column in the rows")
        return [self.one(c, g) for c, g in zip(completions, gold, strict=True)]

    def one(self, completion: str, gold: object) -> float | None:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        # math_verify times out with signal.alarm, which works in the main thread only
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold_text = str(gold)
        gold_parsed = parse(_inside_answer(gold_text) or gold_text, parsing_timeout=timeout)
        if not gold_parsed:
            return None  # an unparseable gold answer: not applicable (as TRL's accuracy_reward)
        tagged = _inside_answer(completion)
        if tagged is not None:
            found = parse(tagged, parsing_timeout=timeout)
        else:  # no answer tag: a boxed or otherwise anchored LaTeX answer in the text
            config = LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
            found = parse(completion, extraction_config=[config], parsing_timeout=timeout)
        return float(verify(gold_parsed, found, timeout_seconds=timeout))


class Format:
    """1.0 for `<think>...</think><answer>...</answer>` and nothing after it."""

    name = "format"

    def __call__(self, completions: Sequence[str], **kwargs: object) -> list[float]:
        return [1.0 if FORMAT.match(c) else 0.0 for c in completions]


class ReactFormat:
    """1.0 for `<think>...</think>` followed by `Action:` and `Action Input:`."""

    name = "react_format"

    def __call__(self, completions: Sequence[str], **kwargs: object) -> list[float]:
        return [1.0 if REACT.match(c) else 0.0 for c in completions]


class Cosine:
    """Correctness scaled by length: short right answers score most, short wrong ones least.

    `max_len`: the length (tokens) at which the `max_len_value_*` is reached (default
    `--max-new-tokens`); a sample `accuracy` finds not applicable gets None.
    """

    name = "cosine"

    def __init__(
        self,
        *,
        max_len: int = 1000,
        min_len_value_wrong: float = -0.5,
        max_len_value_wrong: float = 0.0,
        min_len_value_correct: float = 1.0,
        max_len_value_correct: float = 0.5,
    ):
        if max_len < 1:
            raise ValueError(f"cosine: max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.wrong = (min_len_value_wrong, max_len_value_wrong)
        self.correct = (min_len_value_correct, max_len_value_correct)
        self.accuracy = Accuracy()

    def __call__(
        self, completions: Sequence[str], response_token_ids: Sequence[Sequence[int]], **kwargs: object
    ) -> list[float | None]:
        right = self.accuracy(completions, **kwargs)  # type: ignore[arg-type]  # solution / answer
        return [self.one(len(ids), ok) for ids, ok in zip(response_token_ids, right, strict=True)]

    def one(self, length: int, accuracy: float | None) -> float | None:
        if accuracy is None:
            return None
        at_empty, at_max = self.correct if accuracy >= 1.0 else self.wrong
        progress = min(length, self.max_len) / self.max_len
        return at_max + (at_empty - at_max) * (1 + math.cos(math.pi * progress)) / 2


class Repetition:
    """`max_penalty` (<= 0) times the share of repeated word n-grams; 0 for a text shorter than n words."""

    name = "repetition"

    def __init__(self, *, ngram_size: int = 3, max_penalty: float = -1.0):
        if ngram_size < 1 or max_penalty > 0:
            raise ValueError(
                f"repetition: ngram_size must be >= 1 and max_penalty <= 0, got {ngram_size}, {max_penalty}"
            )
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completions: Sequence[str], **kwargs: object) -> list[float]:
        return [self.one(c) for c in completions]

    def one(self, text: str) -> float:
        words = text.lower().split()
        n = self.ngram_size
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        if not grams:
            return 0.0
        return (1 - len(set(grams)) / len(grams)) * self.max_penalty


class SoftOverlong:
    """0 up to `max_length - buffer` sampled tokens, then linearly down to -1 at `max_length` (DAPO).

    `max_length`: default `--max-new-tokens`; `buffer`: default a quarter of it.
    """

    name = "soft_overlong"

    def __init__(self, *, max_length: int = 1000, buffer: int | None = None):
        buffer = max(1, max_length // 4) if buffer is None else buffer
        if not 0 < buffer <= max_length:
            raise ValueError(f"soft_overlong: buffer must be in (0, max_length={max_length}], got {buffer}")
        self.max_length, self.buffer = max_length, buffer

    def __call__(
        self, completions: Sequence[str], response_token_ids: Sequence[Sequence[int]], **kwargs: object
    ) -> list[float]:
        free = self.max_length - self.buffer
        return [max(-1.0, min(0.0, (free - len(ids)) / self.buffer)) for ids in response_token_ids]


BUILTINS = {
    "accuracy": Accuracy,
    "format": Format,
    "react_format": ReactFormat,
    "cosine": Cosine,
    "repetition": Repetition,
    "soft_overlong": SoftOverlong,
}


def builtin(name: str, *, max_new_tokens: int) -> object:
    """The built-in `name` with its defaults, length caps from `--max-new-tokens`."""
    if name == "cosine":
        return Cosine(max_len=max_new_tokens)
    if name == "soft_overlong":
        return SoftOverlong(max_length=max_new_tokens)
    return BUILTINS[name]()
