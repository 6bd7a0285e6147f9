"""Worker start-up (`tools/pool.py`): it happens before any step's clock, it is cheap for this
package's own tools, and a worker whose trainer went away before it was ready exits quietly.

A tool module that sleeps at import (SLOW_IMPORT_S) stands for one with heavy imports, so the
first test does not depend on how loaded the machine is: its import alone outlasts the step
limit, and the steps must not see it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from interlens_mcore.rollout.conversation import Conversation, Scripted
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.tools import ToolEnvironment, WorkerLimits
from interlens_mcore.tools.examples import calculator
from interlens_mcore.types import Status

ROOT = Path(__file__).resolve().parents[3]  # the checkout under test, for the fresh interpreters
SLOW_IMPORT_S = 1.5
STEP_LIMIT_S = 1.0  # shorter than the slow module's import: a step that waited for it times out

SLOW_TOOL = f"""
import time

time.sleep({SLOW_IMPORT_S})


def slow_add(a: int, b: int) -> int:
    \"\"\"Add two integers (its module takes {SLOW_IMPORT_S} s to import).

    Args:
        a: the first
        b: the second
    \"\"\"
    return a + b
"""


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_cold_tool_environment_finishes_every_conversation_within_a_short_step_limit(
    tmp_path, monkeypatch, capfd
):
    (tmp_path / "slow_tools.py").write_text(SLOW_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get this process's sys.path
    import slow_tools

    # limits no other test uses: a pool of its own, so its workers are cold
    limits = WorkerLimits(workers=3, start_timeout_s=97.0)
    env = ToolEnvironment([calculator, slow_tools.slow_add], worker_limits=limits, tool_timeout_s=30.0)
    convs = [
        Conversation(
            [Scripted("policy", [call("calculator", expression=f"{i} * 3") + call("slow_add", a=i, b=1),
                                 "done"], role="assistant"), env],
            run_until=MaxTurns(4),
        )
        for i in range(3)
    ]  # fmt: skip
    co_step(convs, step_timeout_s=STEP_LIMIT_S, on_sample_error="skip")
    assert [c.status for c in convs] == [Status.STOPPED] * 3, [c.stop_reason for c in convs]
    assert [c.messages[1].content for c in convs] == ["0\n1", "3\n2", "6\n3"]
    assert "Traceback" not in capfd.readouterr().err


def test_this_packages_tools_import_no_torch_in_a_worker():
    """What a worker imports for `interlens_mcore.tools.examples:calculator` (a fresh interpreter:
    this one has long imported torch)."""
    code = (
        "import sys, interlens_mcore.tools.examples\n"
        "heavy = ('torch', 'transformers', 'numpy', 'megatron', 'deepspeed')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_worker_whose_trainer_exits_before_it_is_ready_exits_quietly(tmp_path):
    """The trainer (here a small process) starts two workers and exits at once, without closing its
    pool; the workers, still importing, find nobody at the pipe's other end. They inherit its
    stderr, which this test reads to the end: it closes when the last worker has exited."""
    (tmp_path / "slow_tools.py").write_text(SLOW_TOOL)
    trainer = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from interlens_mcore.tools.pool import WorkerLimits, WorkerPool
        WorkerPool(WorkerLimits(workers=2)).prepare(["slow_tools"])
        os._exit(0)  # as a rank killed by its launcher: no clean-up runs
        """
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0
    assert time.monotonic() - start >= SLOW_IMPORT_S  # the workers outlived the trainer
    assert out.stderr == ""
