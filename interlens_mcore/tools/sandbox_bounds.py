"""What each operation the sandbox allows may cost, checked before the operation runs.

The sandbox's interpreter (`sandbox`) asks these checks about an operation's operands before
it computes anything. Each check bounds the work the operation would do, not only the size of
what it returns: CPython computes `10 ** 10**7` inside `round(1, -10**7)`, `n!` inside
`perm(n)`, and a set of keys with equal hashes in time quadratic in their number, all in one C
call that no step counter or clock can interrupt. So:

- powers, shifts and products of integers: refused when the result would exceed
  `max_int_bits` (a lower bound of its size, from the operands' bit lengths);
- `round(x, n)`: refused when `|n|` exceeds the digits of a `max_int_bits`-bit integer;
- `factorial`, `perm`, `comb`: refused when a lower bound of the result's size exceeds
  `max_int_bits` (which also bounds their number of multiplications);
- repetition and concatenation of sequences, `range`: refused past `max_items`;
- sets and dicts: built one key at a time, and refused when more than
  `max_hash_collisions` different keys share one hash value (`x * (2**61 - 1)` all hash to 0),
  so every lookup walks a short chain;
- functions passed as values (`sorted(xs, key=f)`) are called back through the interpreter,
  so each call counts as a step and is checked like a direct call.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeGuard


class SandboxError(ValueError):
    """An expression was refused or failed; the message says why."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Bounds of one evaluation."""

    max_chars: int = 2000  # length of the expression's source
    max_depth: int = 40  # nesting of the syntax tree
    max_steps: int = 100_000  # syntax nodes evaluated and functions called, loop iterations included
    max_int_bits: int = 4096  # size of any integer produced
    max_items: int = 10_000  # items of any value produced, nested items and characters included
    max_hash_collisions: int = 8  # different keys of one set or dict that share a hash value
    max_seconds: float = 1.0  # wall time of the evaluation

    @property
    def max_round_digits(self) -> int:
        """Digits of the largest integer allowed: `round(x, n)` beyond them computes a huge power."""
        return math.ceil(self.max_int_bits * math.log10(2)) + 1


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: object) -> str:
    """A number as a message shows it: a big integer by its size, not its 1,000 digits."""
    if _is_int(value) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    return repr(value)


def check_binop(op: type, left: object, right: object, limits: SandboxLimits) -> None:
    """Refuse `left <op> right` if its result would break a size limit, before computing it."""
    items = limits.max_items
    if _is_int(left) and _is_int(right):
        _check_int_binop(op, left, right, limits.max_int_bits)
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > items:
                raise SandboxError(
                    f"repeating a {type(seq).__name__} {n} times refused: the limit is {items} items"
                )
    if op is ast.Add and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if len(left) + len(right) > items:
            raise SandboxError(
                f"a concatenation of {len(left) + len(right)} items refused: the limit is {items}"
            )


def _check_int_binop(op: type, left: int, right: int, bits: int) -> None:
    # |left| ** right has at least right * (bit_length(left) - 1) bits
    if op is ast.Pow and right > 0 and right * (abs(left).bit_length() - 1) > bits:
        raise SandboxError(f"{_show(left)} ** {_show(right)} refused: the result would exceed {bits} bits")
    if op is ast.LShift and left and right > 0 and abs(left).bit_length() + right > bits + 1:
        raise SandboxError(f"{_show(left)} << {_show(right)} refused: the result would exceed {bits} bits")
    if op is ast.Mult and left.bit_length() + right.bit_length() > bits + 1:
        raise SandboxError(f"a product of {left.bit_length()}- and {right.bit_length()}-bit integers "
                           f"refused: the result would exceed {bits} bits")  # fmt: skip


# -- functions --------------------------------------------------------------------------------
def _argument(args: tuple, kwargs: dict, index: int, name: str) -> object:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _check_round(args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    digits = _argument(args, kwargs, 1, "ndigits")
    if _is_int(digits) and abs(digits) > limits.max_round_digits:
        raise SandboxError(
            f"round() to {_show(digits)} digits refused: "
            f"the limit is {limits.max_round_digits} digits either way"
        )


def _log2_factorial_at_least(n: int) -> float:
    # Stirling: n! >= (n / e) ** n; past 2 ** 53 the bound is astronomically over any limit
    if n >= 2**53:
        return math.inf
    return n * (math.log2(n) - math.log2(math.e)) if n > 2 else 1.0


def _refuse_bits(call: str, lower_bound: float, limits: SandboxLimits) -> None:
    if lower_bound > limits.max_int_bits:
        raise SandboxError(f"{call} refused: the result would exceed {limits.max_int_bits} bits")


def _check_factorial(args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    n = _argument(args, kwargs, 0, "n")
    if _is_int(n):
        _refuse_bits(f"factorial({_show(n)})", _log2_factorial_at_least(n), limits)


def _check_perm(args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    n, k = _argument(args, kwargs, 0, "n"), _argument(args, kwargs, 1, "k")
    k = n if k is None else k
    if _is_int(n) and _is_int(k) and 0 < k <= n:
        # perm(n, k) = n (n-1) ... (n-k+1) is at least k! and at least (n-k+1) ** k
        _refuse_bits(f"perm({_show(n)}, {_show(k)})", _log2_factorial_at_least(k), limits)
        _refuse_bits(f"perm({_show(n)}, {_show(k)})", k * math.log2(n - k + 1), limits)


def _check_comb(args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    n, k = _argument(args, kwargs, 0, "n"), _argument(args, kwargs, 1, "k")
    if _is_int(n) and _is_int(k) and 0 < k < n:
        m = min(k, n - k)
        # comb(n, m) >= 2 ** m since m <= n / 2, and >= (n / m) ** m
        _refuse_bits(f"comb({_show(n)}, {_show(k)})", m if m <= 2**53 else math.inf, limits)
        _refuse_bits(f"comb({_show(n)}, {_show(k)})", m * (math.log2(n) - math.log2(m)), limits)


def _check_range(args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    size = len(range(*args))  # OverflowError past sys.maxsize, reported as such
    if size > limits.max_items:
        raise SandboxError(f"a range of {size} items refused: the limit is {limits.max_items}")


CallCheck = Callable[[tuple, dict, SandboxLimits], None]
FUNCTION_CHECKS: dict[Callable[..., object], CallCheck] = {
    round: _check_round,
    math.factorial: _check_factorial,
    math.perm: _check_perm,
    math.comb: _check_comb,
    range: _check_range,
}


def check_call(fn: Callable[..., object], args: tuple, kwargs: dict, limits: SandboxLimits) -> None:
    """Refuse `fn(*args, **kwargs)` if it would break a limit, for the functions that can."""
    for known, check in FUNCTION_CHECKS.items():
        if fn is known:  # by identity: a name's function may be any object, hashable or not
            check(args, kwargs, limits)
            return


# -- hashing ----------------------------------------------------------------------------------
class HashedBuilder:
    """Builds one set or dict a key at a time, refusing keys that would collide past the limit.

    A key whose hash no earlier key has is new (equal keys hash equally); otherwise the table's
    lookup walks the chain of keys with that hash, which this builder keeps at most
    `max_hash_collisions` long. So building n keys costs O(n * max_hash_collisions) probes.
    """

    def __init__(self, limits: SandboxLimits):
        self.limit = limits.max_hash_collisions
        self.per_hash: dict[int, int] = {}

    def admit(self, table: set | dict, key: object) -> None:
        h = hash(key)  # TypeError for an unhashable key, as the builtins raise
        n = self.per_hash.get(h, 0)
        if n and key in table:
            return
        if n >= self.limit:
            raise _collisions(self.limit)
        self.per_hash[h] = n + 1

    def set_of(self, keys: Iterable) -> set:
        out: set = set()
        for key in keys:
            self.admit(out, key)
            out.add(key)
        return out

    def dict_of(self, pairs: Iterable[tuple[object, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            self.admit(out, key)
            out[key] = value
        return out


def check_hash_spread(value: set | frozenset | dict, limits: SandboxLimits) -> None:
    """Refuse a set or dict made by an operator (`a | b`) whose keys collide past the limit."""
    builder = HashedBuilder(limits)
    for key in value:  # all different: at most one per key and hash
        h = hash(key)
        builder.per_hash[h] = builder.per_hash.get(h, 0) + 1
        if builder.per_hash[h] > builder.limit:
            raise _collisions(builder.limit)


def _collisions(limit: int) -> SandboxError:
    return SandboxError(
        f"a set or dict with more than {limit} different keys of one hash value refused "
        "(such keys make every lookup slow)"
    )
