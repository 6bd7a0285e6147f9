"""The expression sandbox: known escapes refused before they run, bounds enforced, values right."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlens_mcore.tools.examples import calculator, python_eval
from interlens_mcore.tools.sandbox import Sandbox, SandboxError, SandboxLimits

ESCAPES = [
    ('__import__("os").system("echo hi")', "attribute access"),
    ('__import__("os")', "names starting with '_'"),
    ("().__class__.__mro__[1].__subclasses__()", "attribute access"),
    ("(1).__class__", "attribute access"),
    ('"".join(["a"])', "attribute access"),
    ("[c for c in ().__class__.__bases__]", "attribute access"),
    ("__builtins__", "names starting with '_'"),
    ("_x", "names starting with '_'"),
    ("import os", "not a Python expression"),
    ("exec('1')", "unknown name 'exec'"),
    ("eval('1')", "unknown name 'eval'"),
    ("getattr((), '__class__')", "unknown name 'getattr'"),
    ("open('/etc/passwd')", "unknown name 'open'"),
    ("globals()", "unknown name 'globals'"),
    ("type(1)", "unknown name 'type'"),
    ("lambda: 1", "lambda"),
    ("(x := 1)", "assignment expressions"),
    ("f'{1:999999999}'", "f-strings"),
    ("'%0999999999d' % 1", "%-formatting"),
    ("9 ** 9 ** 9", "exceed 4096 bits"),
    ("2 ** 100000", "exceed 4096 bits"),
    ("1 << 10 ** 9", "exceed 4096 bits"),
    ("(10 ** 1000) * (10 ** 1000)", "exceed 4096 bits"),
    ("'a' * 10 ** 9", "repeating a str"),
    ("[0] * 10 ** 9", "repeating a list"),
    ("[[0] * 1000] * 1000", "more than 10000 items"),
    ("sum([[1] * 100] * 100, [])", "more than 10000 items"),
    ("sum([[1]], [])", "sum() takes a number"),
    ("str([1] * 5000)", "str() of a list"),
    ("range(10 ** 12)", "a range of"),
    ("[x for x in range(10000) for y in range(10000)]", "comprehension of more than"),
    ("sum(1 for x in range(10000) for y in range(10000) if 0)", "step limit"),
    ("[list(range(10000)) for i in range(10000)]", "comprehension of more than"),
    ("[s for s in ['a' * 5000] * 3]", "more than 10000 items"),
    ("-" * 60 + "1", "nested deeper than"),
    ("[" * 60 + "]" * 60, "nested deeper than"),
    ("1 + " * 1000 + "1", "characters refused"),
    ("factorial(10 ** 6)", "factorial"),
    ("print(1)", "unknown name 'print'"),
    ("max(*[1, 2])", "starred arguments"),
    ("dict(**{'a': 1})", "** arguments"),
    ("b'x'", "constant bytes"),
    # one C call of the allowed ones that would run far past the time limit, bounded before it runs
    ("round(1, -10 ** 7)", "round() to -10000000 digits refused"),  # CPython computes 10 ** 10**7
    ("round(2.5, 10 ** 30)", "digits refused"),
    ("sorted(range(10000), key=perm)", "4096"),  # each key call is checked: perm(9999) is 9999!
    ("max(range(10000), key=factorial)", "4096"),
    ("perm(10 ** 18)", "perm(1000000000000000000, 1000000000000000000) refused"),
    ("comb(10 ** 100, 10 ** 99)", "comb(<333-bit integer>, <329-bit integer>) refused"),
    # every x * (2**61 - 1) hashes to 0: building them is quadratic in one C call
    ("len({x * (2 ** 61 - 1) for x in range(10000)})", "keys of one hash value refused"),
    ("len(set(x * (2 ** 61 - 1) for x in range(10000)))", "keys of one hash value refused"),
    ("{x * (2 ** 61 - 1): 0 for x in range(3000)}", "keys of one hash value refused"),
    ("dict((x * (2 ** 61 - 1), 0) for x in range(3000))", "keys of one hash value refused"),
    ("{x * (2 ** 61 - 1) for x in range(8)} | {x * (2 ** 61 - 1) for x in range(8, 16)}", "hash value"),
    ("{**[1]}", "** in a dict display takes a dict, got list"),
    ("set([1], [2])", "set() takes at most 1 argument"),
]


@pytest.mark.parametrize("source,why", ESCAPES, ids=[e[0][:30] for e in ESCAPES])
def test_escapes_are_refused_with_a_message(source, why):
    start = time.monotonic()
    with pytest.raises(SandboxError, match=None) as exc:
        python_eval(source)
    assert why in str(exc.value), str(exc.value)
    assert time.monotonic() - start < 2.0  # refused, not run to the end


def test_refusals_come_before_running():
    # a huge power inside an unknown call is refused by the static check, with no evaluation
    sandbox = Sandbox()
    with pytest.raises(SandboxError, match="unknown name 'system'"):
        sandbox.evaluate("system(9 ** 9 ** 9)")
    with pytest.raises(SandboxError, match="attribute access"):
        sandbox.check("(9 ** 9 ** 9).bit_length()")


@pytest.mark.parametrize(
    "source,value",
    [
        ("1 + 2 * 3", "7"),
        ("(3 + 4) * 2", "14"),
        ("sum(x * x for x in range(10))", "285"),
        ("sorted([3, 1, 2], reverse=True)", "[3, 2, 1]"),
        ("{i: i % 3 for i in range(4) if i}", "{1: 1, 2: 2, 3: 0}"),
        ("[a + b for a, b in zip(range(3), range(3, 6))]", "[3, 5, 7]"),
        ("'ab' * 3", "'ababab'"),
        ("round(sqrt(2), 3)", "1.414"),
        ("2 ** 4095 > 0", "True"),
        ("max(3, 9) if 1 < 2 < 3 else 0", "9"),
        ("'b' in 'abc' and not 0", "True"),
        ("len(str(10 ** 100))", "101"),
        ("(1, 2, 3)[::-1]", "(3, 2, 1)"),
        ("{**{1: 2}}", "{1: 2}"),
        ("{**{1: 2}, 3: 4, **{1: 5}}", "{1: 5, 3: 4}"),
        ("round(12345, -2)", "12300"),
        ("sorted([3, -1, 2], key=abs)", "[-1, 2, 3]"),
        ("{-1, -2} == {-2, -1}", "True"),  # hash(-1) == hash(-2): a collision the limit allows
        ("len({x * (2 ** 61 - 1) for x in range(8)})", "8"),  # up to 8 keys of one hash
        ("dict(zip('ab', range(2)))", "{'a': 0, 'b': 1}"),
        ("comb(10 ** 100, 3) > 0 and perm(10 ** 100, 2) > 0", "True"),
        ("factorial(500) > 2 ** 3700", "True"),
        ("sqrt is sqrt", "True"),
    ],
)
def test_values(source, value):
    assert python_eval(source) == value


def test_calculator_allows_arithmetic_only():
    assert calculator("(3 + 4) * 2 - 1 / 4") == "13.75"
    assert calculator("-2 ** 3 // 3") == "-3"
    for bad, why in [("sqrt(4)", "Call"), ("x", "Name"), ("[1]", "List"), ("'a' * 3", "")]:
        if why:
            with pytest.raises(SandboxError, match=f"{why} is not allowed"):
                calculator(bad)
    with pytest.raises(SandboxError, match="ZeroDivisionError"):
        calculator("1 / 0")
    with pytest.raises(SandboxError, match="exceed 4096 bits"):
        calculator("10 ** 10 ** 10")


def test_limits_are_configurable():
    small = Sandbox(SandboxLimits(max_steps=50))
    assert small.evaluate("sum(range(10))") == 45
    with pytest.raises(SandboxError, match="after 50 steps"):
        small.evaluate("[x for x in range(100)]")
    slow = Sandbox(SandboxLimits(max_seconds=0.05, max_steps=10**9, max_items=10**6))
    start = time.monotonic()
    with pytest.raises(SandboxError, match="time limit"):
        slow.evaluate("sum(1 for x in range(1000) for y in range(1000) if 0)")
    assert time.monotonic() - start < 1.0


def test_a_function_passed_as_a_value_is_counted_per_call():
    # sorted calls its key 50 or 150 times: those calls are steps like any other
    small = Sandbox(SandboxLimits(max_steps=100))
    assert small.evaluate("sorted(range(50), key=abs)")[-1] == 49
    with pytest.raises(SandboxError, match="after 100 steps"):
        small.evaluate("sorted(range(150), key=abs)")


def test_the_time_limit_reports_the_time_taken():
    # the clock is read at every step, so the evaluation stops within one step of its limit
    # and says how long it ran, never less than the limit nor more than it really took
    slow = Sandbox(SandboxLimits(max_seconds=0.2, max_steps=10**9))
    start = time.monotonic()
    with pytest.raises(SandboxError, match="time limit is 0.2 s") as exc:
        slow.evaluate("sum(len(list(range(10000))) for x in range(10000) for y in range(10000))")
    took = time.monotonic() - start
    reported = float(str(exc.value).split("after ")[1].split(" s")[0])
    assert 0.2 <= reported <= took + 0.01, (reported, took)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("0123456789+-*/%()[]{}<>=!~^&|,.:' abcdefgxyz_*\"\n")), max_size=60)
)
def test_any_text_is_a_value_or_a_sandbox_error(text):
    start = time.monotonic()
    try:
        python_eval(text)
    except SandboxError:
        pass
    assert time.monotonic() - start < 2.0
