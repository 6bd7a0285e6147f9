"""A bounded evaluator of Python expressions, for tools a policy may call with any text.

The expression is parsed, checked against an allow-list, then interpreted node by node by
this module (never by `eval`), so every bound is enforced before the work is done:

- refused before anything runs: statements and imports (only an expression parses), names
  outside the allowed functions and comprehension variables, any name starting with `_`
  (`__import__`, `__builtins__`), attribute access of any kind (`().__class__.__mro__`,
  `x.real`), lambdas, f-strings and `%`-formatting (a format width allocates), starred
  arguments, more than `max_chars` characters, nesting deeper than `max_depth`;
- refused when reached, before the operation runs (`sandbox_bounds`): integers over
  `max_int_bits` bits (`9 ** 9 ** 9`, `1 << 10**9`, products of big numbers, `factorial`,
  `perm` and `comb` of large arguments), `round` to more digits than such an integer has
  (`round(1, -10**7)`), sequences over `max_items` items (`"a" * 10**9`, `range(10**12)`,
  concatenation), sets and dicts whose keys share hash values (`{x * (2**61 - 1) for x in
  ...}`); a function passed as a value (`sorted(xs, key=perm)`) is called back through the
  same checks, one step a call;
- stopped while running: more than `max_steps` evaluated nodes and function calls (each loop
  iteration counts), or more than `max_seconds` of wall time, checked at every step.

Every refusal is a `SandboxError` whose message says what was refused and the limit.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from .sandbox_bounds import (
    HashedBuilder,
    SandboxError,
    SandboxLimits,
    check_binop,
    check_call,
    check_hash_spread,
)


def _sum(values: Iterable, start: object = 0) -> object:
    # a non-number start would let sum() concatenate sequences past every size check
    if not isinstance(start, (int, float, complex)):
        raise SandboxError("sum() takes a number as its start value")
    return sum(values, start)


def _str(value: object) -> str:
    # the text of a container can be far larger than its item count (shared references)
    if not isinstance(value, (int, float, complex, bool, str, type(None))):
        raise SandboxError(f"str() of a {type(value).__name__} is not allowed; only of numbers and strings")
    return str(value)


_CONTAINERS = (str, list, tuple, set, frozenset, dict, range)


def _total_items(value: object, cap: int) -> int:
    """Items reachable from `value`, shared references counted each time; stops past `cap`."""
    total, stack = 0, [value]
    while stack and total <= cap:
        v = stack.pop()
        if isinstance(v, (str, range)):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
    return total


# Pure functions of values; none of them reaches an object's attributes or the interpreter.
SAFE_FUNCTIONS: dict[str, object] = {
    "abs": abs, "all": all, "any": any, "bool": bool, "divmod": divmod, "enumerate": enumerate,
    "float": float, "int": int, "len": len, "list": list, "max": max, "min": min, "range": range,
    "reversed": reversed, "round": round, "set": set, "sorted": sorted, "str": _str, "sum": _sum,
    "tuple": tuple, "zip": zip, "dict": dict,
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log2": math.log2, "log10": math.log10,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "atan": math.atan, "floor": math.floor,
    "ceil": math.ceil, "gcd": math.gcd, "isqrt": math.isqrt, "factorial": math.factorial,
    "comb": math.comb, "perm": math.perm,
    "pi": math.pi, "e": math.e, "True": True, "False": False, "None": None,
}  # fmt: skip

# Python's own operations, applied to the expression's values whatever they are: a value that
# does not support one raises TypeError, which `evaluate` reports as the expression's error
_BINOPS: dict[type, Callable[..., object]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_, ast.BitXor: operator.xor,
}  # fmt: skip
_UNARY: dict[type, Callable[..., object]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert,
}  # fmt: skip
_COMPARE: dict[type, Callable[..., object]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip
_GETITEM: Callable[..., object] = operator.getitem
_ITER: Callable[..., Iterator[object]] = iter

ARITHMETIC_NODES = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, *_BINOPS, *_UNARY)
EXPRESSION_NODES = (
    *ARITHMETIC_NODES, ast.BoolOp, ast.And, ast.Or, ast.Compare, *_COMPARE, ast.IfExp, ast.Name,
    ast.Load, ast.Store, ast.Call, ast.keyword, ast.Tuple, ast.List, ast.Set, ast.Dict,
    ast.Subscript, ast.Slice, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
    ast.comprehension,
)  # fmt: skip

_REFUSED = {
    ast.Attribute: "attribute access is",
    ast.Lambda: "lambda is",
    ast.JoinedStr: "f-strings are",
    ast.FormattedValue: "f-strings are",
    ast.NamedExpr: "assignment expressions (:=) are",
    ast.Starred: "starred arguments are",
    ast.Await: "await is",
    ast.Yield: "yield is",
    ast.YieldFrom: "yield is",
}


def _depth(node: ast.AST) -> int:
    # iterative, so a tree deep enough to be refused cannot exhaust the interpreter's stack
    deepest, stack = 0, [(node, 1)]
    while stack:
        n, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in ast.iter_child_nodes(n))
    return deepest


_DEFAULT_LIMITS = SandboxLimits()


class Sandbox:
    """Evaluates checked expressions under `limits`, with `names` as the only free names.

    `Sandbox()` allows the expression language above with `SAFE_FUNCTIONS`;
    `Sandbox(nodes=ARITHMETIC_NODES, names={})` allows numbers and arithmetic only. One
    sandbox may evaluate from several threads at once: each evaluation keeps its own count.
    """

    def __init__(
        self,
        limits: SandboxLimits = _DEFAULT_LIMITS,
        *,
        names: Mapping[str, object] = SAFE_FUNCTIONS,
        nodes: tuple[type, ...] = EXPRESSION_NODES,
    ):
        self.limits, self.names, self.nodes = limits, dict(names), tuple(nodes)

    # -- static check -----------------------------------------------------------------------
    def check(self, source: str) -> ast.Expression:
        """The parsed expression, or a SandboxError naming the first thing refused."""
        lim = self.limits
        if not isinstance(source, str):
            raise SandboxError(f"expected the expression as a string, got {type(source).__name__}")
        if len(source) > lim.max_chars:
            raise SandboxError(
                f"expression of {len(source)} characters refused: the limit is {lim.max_chars}"
            )
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as exc:
            raise SandboxError(
                f"not a Python expression ({exc.msg}); statements and imports are refused"
            ) from None
        except (RecursionError, MemoryError):
            raise SandboxError("expression nested too deeply to parse") from None
        if _depth(tree) > lim.max_depth:
            raise SandboxError(f"expression nested deeper than {lim.max_depth} levels refused")
        bound = {
            n.id for c in ast.walk(tree) if isinstance(c, ast.comprehension) for n in ast.walk(c.target)
            if isinstance(n, ast.Name)
        }  # fmt: skip
        for node in ast.walk(tree):
            self._check_node(node, bound)
        return tree

    def _check_node(self, node: ast.AST, bound: set[str]) -> None:
        kind = type(node)
        if kind in _REFUSED:
            raise SandboxError(f"{_REFUSED[kind]} not allowed")
        if not isinstance(node, self.nodes):
            raise SandboxError(f"{kind.__name__} is not allowed here")
        if isinstance(node, ast.Name):
            if node.id.startswith("_"):
                raise SandboxError(f"name {node.id!r} is not allowed (names starting with '_' are refused)")
            if node.id not in self.names and node.id not in bound:
                allowed = ", ".join(sorted(k for k in self.names if k not in ("True", "False", "None")))
                raise SandboxError(f"unknown name {node.id!r}; allowed: {allowed or 'none'}")
        elif isinstance(node, ast.Constant) and not isinstance(
            node.value, (int, float, complex, str, type(None))
        ):
            raise SandboxError(f"constant {type(node.value).__name__} is not allowed")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, (ast.Name, ast.Attribute)):  # an attribute is refused as such
                raise SandboxError("only the allowed functions can be called, by name")
            if any(k.arg is None for k in node.keywords):
                raise SandboxError("** arguments are not allowed")
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and isinstance(node.left, ast.Constant)
        ):
            if isinstance(node.left.value, str):
                raise SandboxError("%-formatting of strings is not allowed")
        elif isinstance(node, ast.comprehension) and node.is_async:
            raise SandboxError("async comprehensions are not allowed")

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, source: str) -> object:
        """The value of `source`, or a SandboxError saying what was refused or failed."""
        tree = self.check(source)
        try:
            return _Evaluation(self.limits, self.names).run(tree.body)
        except SandboxError:
            raise
        except RecursionError:
            raise SandboxError("expression nested too deeply to evaluate") from None
        except MemoryError:
            raise SandboxError("the evaluation ran out of memory") from None
        except Exception as exc:  # whatever an allowed operation raises is the expression's error
            raise SandboxError(f"{type(exc).__name__}: {exc}") from None


@dataclass(frozen=True, eq=False)
class _Function:
    """An allowed function as the expression sees it: calling it goes through the checks.

    So a function handed to another as a value (`sorted(xs, key=perm)`) is checked, counted
    and sized on each call the other makes, as a call written in the expression would be.
    """

    fn: Callable[..., object]
    evaluation: _Evaluation

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.evaluation.apply(self.fn, args, kwargs)

    def __repr__(self) -> str:
        return repr(self.fn)


class _Evaluation:
    """One evaluation: the interpreter, its step count and its deadline."""

    def __init__(self, limits: SandboxLimits, names: dict[str, object]):
        self.limits, self.names = limits, names
        self.steps, self.start = 0, time.monotonic()
        self.functions: dict[int, _Function] = {}  # one wrapper per function, so `is` holds

    def run(self, node: ast.AST) -> object:
        return self.eval(node, {})

    def tick(self) -> None:
        self.steps += 1
        lim = self.limits
        if self.steps > lim.max_steps:
            raise SandboxError(f"evaluation stopped after {lim.max_steps} steps (the step limit)")
        elapsed = time.monotonic() - self.start
        if elapsed > lim.max_seconds:
            raise SandboxError(
                f"evaluation stopped after {elapsed:.2f} s (the time limit is {lim.max_seconds:g} s)"
            )

    def eval(self, node: ast.AST, scope: dict[str, object]) -> object:
        self.tick()
        method = getattr(self, f"_eval_{type(node).__name__}")
        value = method(node, scope)
        # a name's value was sized when it was made, and a call's result by `apply`
        return value if isinstance(node, (ast.Name, ast.Call)) else self.sized(value)

    def sized(self, value: object) -> object:
        lim = self.limits
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > lim.max_int_bits:
            raise SandboxError(
                f"an integer of {value.bit_length()} bits refused: the limit is {lim.max_int_bits}"
            )
        if isinstance(value, _CONTAINERS) and _total_items(value, lim.max_items) > lim.max_items:
            raise SandboxError(
                f"a {type(value).__name__} holding more than {lim.max_items} items in all refused "
                f"(nested items and characters count): the limit is {lim.max_items}"
            )
        return value

    def apply(self, fn: Callable[..., object], args: tuple, kwargs: dict) -> object:
        """fn(*args, **kwargs) for an allowed function: counted, checked before, sized after."""
        self.tick()
        check_call(fn, args, kwargs, self.limits)
        if fn is set:
            out: object = self._set(*args, **kwargs)
        elif fn is dict:
            out = self._dict(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        if isinstance(out, (enumerate, zip, reversed)):
            out = list(self.iterate(out))
        return self.sized(out)

    def _set(self, *args: object) -> set:
        if len(args) > 1:
            raise SandboxError(f"set() takes at most 1 argument, got {len(args)}")
        return HashedBuilder(self.limits).set_of(self.iterate(args[0] if args else ()))

    def _dict(self, *args: object, **named: object) -> dict:
        if len(args) > 1:
            raise SandboxError(f"dict() takes at most 1 positional argument, got {len(args)}")
        source = args[0] if args else ()
        # each item is unpacked into (key, value) below, as dict() would (a TypeError if it can't be)
        items = cast(Iterator[tuple[object, object]], self.iterate(source))
        pairs = source.items() if isinstance(source, dict) else items
        return HashedBuilder(self.limits).dict_of([*((k, v) for k, v in pairs), *named.items()])

    def _eval_Constant(self, node: ast.Constant, scope: dict) -> object:
        return node.value

    def _eval_Name(self, node: ast.Name, scope: dict) -> object:
        value = scope[node.id] if node.id in scope else self.names[node.id]
        if not callable(value) or isinstance(value, _Function):
            return value
        if id(value) not in self.functions:
            self.functions[id(value)] = _Function(value, self)
        return self.functions[id(value)]

    def _eval_BinOp(self, node: ast.BinOp, scope: dict) -> object:
        left, right = self.eval(node.left, scope), self.eval(node.right, scope)
        check_binop(type(node.op), left, right, self.limits)
        if isinstance(node.op, ast.Mod) and isinstance(left, str):
            raise SandboxError("%-formatting of strings is not allowed")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, (set, frozenset, dict)):  # `a | b` hashes every key of both
            check_hash_spread(out, self.limits)
        return out

    def _eval_UnaryOp(self, node: ast.UnaryOp, scope: dict) -> object:
        return _UNARY[type(node.op)](self.eval(node.operand, scope))

    def _eval_BoolOp(self, node: ast.BoolOp, scope: dict) -> object:
        value: object = None
        for v in node.values:
            value = self.eval(v, scope)
            if isinstance(node.op, ast.And) != bool(value):
                return value
        return value

    def _eval_Compare(self, node: ast.Compare, scope: dict) -> bool:
        left = self.eval(node.left, scope)
        for op, comp in zip(node.ops, node.comparators):
            right = self.eval(comp, scope)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _eval_IfExp(self, node: ast.IfExp, scope: dict) -> object:
        return self.eval(node.body if self.eval(node.test, scope) else node.orelse, scope)

    def _eval_Call(self, node: ast.Call, scope: dict) -> object:
        fn = self.eval(node.func, scope)
        args = [self.eval(a, scope) for a in node.args]
        kwargs: dict[str, object] = {}
        for k in node.keywords:
            assert k.arg is not None, "check() refuses ** arguments"
            kwargs[k.arg] = self.eval(k.value, scope)
        if not isinstance(fn, _Function):
            raise SandboxError(f"{ast.unparse(node.func)!r} is not a function")
        return fn(*args, **kwargs)

    def _eval_Tuple(self, node: ast.Tuple, scope: dict) -> tuple:
        return tuple(self.eval(e, scope) for e in node.elts)

    def _eval_List(self, node: ast.List, scope: dict) -> list:
        return [self.eval(e, scope) for e in node.elts]

    def _eval_Set(self, node: ast.Set, scope: dict) -> set:
        return HashedBuilder(self.limits).set_of(self.eval(e, scope) for e in node.elts)

    def _eval_Dict(self, node: ast.Dict, scope: dict) -> dict:
        pairs: list[tuple[object, object]] = []
        for key, value in zip(node.keys, node.values):
            if key is not None:
                pairs.append((self.eval(key, scope), self.eval(value, scope)))
                continue
            merged = self.eval(value, scope)  # `{**m}`: the pairs of the dict m
            if not isinstance(merged, dict):
                raise SandboxError(f"** in a dict display takes a dict, got {type(merged).__name__}")
            pairs.extend(merged.items())
        return HashedBuilder(self.limits).dict_of(pairs)

    def _eval_Subscript(self, node: ast.Subscript, scope: dict) -> object:
        return _GETITEM(self.eval(node.value, scope), self.eval(node.slice, scope))

    def _eval_Slice(self, node: ast.Slice, scope: dict) -> slice:
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if p is None else self.eval(p, scope) for p in parts))

    def iterate(self, values: object) -> Iterator[object]:
        for v in _ITER(values):
            self.tick()  # every iteration counts, so a long loop hits the step limit
            yield v

    def _bindings(self, generators: list[ast.comprehension], scope: dict) -> Iterable[dict]:
        """Every scope the comprehension's `for` and `if` clauses produce, in order."""
        if not generators:
            yield scope
            return
        first, rest = generators[0], generators[1:]
        for value in self.iterate(self.eval(first.iter, scope)):
            inner = dict(scope)
            self._bind(first.target, value, inner)
            if all(self.eval(cond, inner) for cond in first.ifs):
                yield from self._bindings(rest, inner)

    def _bind(self, target: ast.AST, value: object, scope: dict) -> None:
        if isinstance(target, ast.Name):
            scope[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = list(_ITER(value))
            if len(values) != len(target.elts):
                raise SandboxError(f"cannot unpack {len(values)} values into {len(target.elts)} names")
            for t, v in zip(target.elts, values):
                self._bind(t, v, scope)
        else:
            raise SandboxError(f"{type(target).__name__} is not allowed as a loop target")

    def _collect(self, items: Iterable) -> list:
        # the items' own contents count as they arrive, so a comprehension of big values stops
        # before it holds more than the limit, not after
        cap, out, total = self.limits.max_items, [], 0
        for item in items:
            out.append(item)
            total += 1 + (_total_items(item, cap) if isinstance(item, _CONTAINERS) else 0)
            if total > cap:
                raise SandboxError(f"a comprehension of more than {cap} items in all refused")
        return out

    def _eval_ListComp(self, node: ast.ListComp, scope: dict) -> list:
        return self._collect(self.eval(node.elt, s) for s in self._bindings(node.generators, scope))

    _eval_GeneratorExp = _eval_ListComp  # evaluated eagerly: its consumer gets a bounded list

    def _eval_SetComp(self, node: ast.SetComp, scope: dict) -> set:
        items = self._collect(self.eval(node.elt, s) for s in self._bindings(node.generators, scope))
        return HashedBuilder(self.limits).set_of(items)

    def _eval_DictComp(self, node: ast.DictComp, scope: dict) -> dict:
        pairs = (
            (self.eval(node.key, s), self.eval(node.value, s)) for s in self._bindings(node.generators, scope)
        )
        return HashedBuilder(self.limits).dict_of(self._collect(pairs))
