"""Each line on stderr is written whole: one write of text and newline, flushed (issue 54's two
ranks' lines on one line came from print's two writes under an unbuffered stderr)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.launch import ROOT, env

from interlens_mcore.cli.lines import say


class Recording:
    """A stream that keeps each write call apart (what an unbuffered stderr hands the OS)."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def test_a_line_is_one_write_with_its_newline_then_flushed():
    out = Recording()
    say("train_grpo.py: error: rank 0 failed (rank 1 failed too)", out)
    assert out.writes == ["train_grpo.py: error: rank 0 failed (rank 1 failed too)\n"] and out.flushes == 1
    print("what print does", file=out)  # the contrast: text and newline apart
    assert out.writes[1:] == ["what print does", "\n"]


def test_two_unbuffered_writers_on_one_pipe_keep_every_line_whole():
    # two processes, as two ranks, write 300 lines each into one pipe with PYTHONUNBUFFERED=1
    code = textwrap.dedent(
        """
        import sys
        from interlens_mcore.cli.lines import say
        for i in range(300):
            say(f"rank {sys.argv[1]} line {i} " + "x" * 60)
        """
    )
    run = env(PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", code]
    shared = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writers = [subprocess.Popen([*cmd, r], stderr=shared.stdin, env=run, cwd=ROOT) for r in "01"]
    for w in writers:
        assert w.wait(timeout=60) == 0
    shared.stdin.close()
    lines = shared.stdout.read().splitlines()
    shared.wait(timeout=10)
    assert len(lines) == 600
    whole = [ln.startswith("rank ") and ln.endswith("x" * 60) and ln.count("rank") == 1 for ln in lines]
    assert all(whole)
