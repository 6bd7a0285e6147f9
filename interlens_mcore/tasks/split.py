"""Train / evaluation splits that hold for any seed: a row is held out by its content.

`held_out(key, fraction)` decides from a hash of the row's text (a question, a prompt, a game
seed), so the training rows of every step and the evaluation rows of every evaluation are
disjoint however many are drawn and from whichever seeds, and the split is the same on every
rank and every resume.
"""

from __future__ import annotations

import zlib

from ..engines.sampler import mix_seed

_BUCKETS = 10_000


def held_out(key: str, fraction: float) -> bool:
    """True if the row with text `key` belongs to the evaluation side of the split."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % _BUCKETS < round(fraction * _BUCKETS)


def check_fraction(fraction: float, where: str) -> None:
    if not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
        raise ValueError(f"{where} must lie strictly between 0 and 1, got {fraction!r}")


def derive_seed(seed: int, salt: str) -> int:
    """A 31-bit seed for a library's generator, from the step seed and what it is for."""
    return mix_seed(seed, zlib.crc32(salt.encode())) % (1 << 31)
