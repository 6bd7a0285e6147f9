"""A tool for the fault-injection matrix: importable by the tool worker processes (stdlib only)."""

from __future__ import annotations


def lookup(query: str, fail: bool = False) -> str:
    """Look a word up.

    Args:
        query: the word
        fail: raise instead (the matrix decides, in the trainer, which call fails)
    """
    if fail:
        raise RuntimeError(f"injected fault: tool lookup({query!r})")
    return "found"
