"""Example tools: a calculator and a sandboxed Python-expression evaluator.

Both refuse what could run away (see `sandbox`) with a `SandboxError`; a tool environment
shows the policy the message.
"""

from __future__ import annotations

import reprlib

from .sandbox import ARITHMETIC_NODES, Sandbox

_ARITHMETIC = Sandbox(names={}, nodes=ARITHMETIC_NODES)
_EXPRESSIONS = Sandbox()
_REPR = reprlib.Repr()  # a value's text, cut to a size a policy can read
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 4, 500, 500, 500
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 50


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers with + - * / // % ** and parentheses.

    Args:
        expression: the arithmetic expression, e.g. "(3 + 4) * 2"
    """
    return _REPR.repr(_ARITHMETIC.evaluate(expression))


def python_eval(expression: str) -> str:
    """Evaluate one Python expression (no imports, no attributes) and return its value.

    Args:
        expression: a Python expression, e.g. "sum(x * x for x in range(10))"
    """
    return _REPR.repr(_EXPRESSIONS.evaluate(expression))
