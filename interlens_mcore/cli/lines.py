"""Lines on stderr, each written whole.

`print(text, file=sys.stderr)` writes the text and its newline in two calls; with an unbuffered
stderr (`PYTHONUNBUFFERED=1`, `python -u`) each is its own write to the file, and two ranks
sharing a terminal or a pipe can put one's line between the other's text and its newline
("...(rank 1 failed too)train_grpo.py: error: rank 0 failed ..."). One write of the whole line,
newline included, flushed, reaches a pipe in one piece (POSIX keeps writes under PIPE_BUF whole).
"""

from __future__ import annotations

import sys
from typing import TextIO


def say(line: str, stream: TextIO | None = None) -> None:
    """Write `line` and its newline to `stream` (stderr by default) in one call, then flush."""
    out = sys.stderr if stream is None else stream
    out.write(line + "\n")
    out.flush()
