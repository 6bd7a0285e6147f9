"""The built-in rewards (`--reward-funcs NAME`), answers compared by math_verify."""

from __future__ import annotations

import math

import pytest

from interlens_mcore.rewards.builtins import (
    Accuracy,
    Cosine,
    Format,
    ReactFormat,
    Repetition,
    SoftOverlong,
    builtin,
)


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"so the total is \boxed{\frac{1}{2}}", "0.5", 1.0),  # equal values in other forms
        (r"<think>halves</think><answer>1/2</answer>", r"$\frac{1}{2}$", 1.0),  # the answer tag first
        ("<answer>x = 3</answer>", "<answer>3</answer>", 1.0),  # a gold answer in tags too
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
        ("no answer here", "7", 0.0),
        (r"\boxed{2}", "not math at all", None),  # a gold answer that does not parse: not applicable
        ("<answer>12</answer>", 12, 1.0),  # a number column (a reasoning-gym answer)
    ],
)
def test_accuracy_compares_math_answers(completion, gold, expected):
    assert Accuracy()([completion], solution=[gold]) == [expected]


def test_accuracy_reads_the_answer_column_when_there_is_no_solution_and_needs_one():
    assert Accuracy()(["<answer>4</answer>"], answer=["4"]) == [1.0]
    with pytest.raises(KeyError, match="accuracy needs a 'solution' or 'answer' column"):
        Accuracy()(["<answer>4</answer>"], question=["2 + 2?"])


def test_format_and_react_format():
    good = "<think>a</think>\n<answer>b</answer>"
    assert Format()([good, good + " extra", "<answer>b</answer>"]) == [1.0, 0.0, 0.0]
    react = "<think>look it up</think>\nAction: search\nAction Input: weather"
    assert ReactFormat()([react, "<think>x</think> Action: search"]) == [1.0, 0.0]


def test_cosine_scales_correctness_by_length():
    cos = Cosine(max_len=10)
    kw = {"solution": ["1", "1", "1", "1"]}
    right, wrong = "<answer>1</answer>", "<answer>2</answer>"
    out = cos([right, right, wrong, wrong], response_token_ids=[[0] * 0, [0] * 10, [], [0] * 10], **kw)
    assert out == [1.0, 0.5, -0.5, 0.0]  # ms-swift's defaults at both ends
    mid = cos([right], response_token_ids=[[0] * 5], solution=["1"])[0]
    assert math.isclose(mid, 0.75)  # the cosine's midpoint
    assert cos([right], response_token_ids=[[0] * 50], solution=["not math"]) == [None]


def test_repetition_penalizes_repeated_ngrams():
    rep = Repetition(ngram_size=2, max_penalty=-1.0)
    assert rep(["a b c d", "a b a b a b", "one"]) == [0.0, pytest.approx(-0.6), 0.0]
    with pytest.raises(ValueError, match="max_penalty <= 0"):
        Repetition(max_penalty=1.0)


def test_soft_overlong_is_a_linear_penalty_in_the_buffer():
    soft = SoftOverlong(max_length=8, buffer=4)
    ids = [[0] * n for n in (3, 4, 6, 8)]
    assert soft(["", "", "", ""], response_token_ids=ids) == [0.0, 0.0, -0.5, -1.0]
    # by name: the cap is --max-new-tokens, the buffer a quarter of it
    by_name = builtin("soft_overlong", max_new_tokens=8)
    assert isinstance(by_name, SoftOverlong) and (by_name.max_length, by_name.buffer) == (8, 2)
