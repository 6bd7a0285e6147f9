"""compat/swift/foreign.py: a scheduler built on ms-swift's own base classes (its release
`multi_turn.py`, import lines changed) runs through `compat.swift.run` and `SwiftTaskSource`
by its hooks, as the command line runs the same class by registry name."""

from __future__ import annotations

import pytest
from support.fakes import Says
from support.swift_release import release_files

from interlens_mcore import SamplingParams
from interlens_mcore.compat.swift import SwiftTaskSource, load_plugins, resolve_scheduler, run
from interlens_mcore.types import Status

TIP = "But wait... It seems I made a mistake,"  # what only MathTipsScheduler.step writes


@pytest.fixture(scope="module")
def math_tips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    release_files(folder)
    load_plugins([folder / "multi_turn.py"])
    cls = resolve_scheduler("math_tip_trick")  # the plugin file's own registry
    assert cls.__name__ == "MathTipsScheduler" and cls.__module__ != "interlens_mcore.compat.swift.scheduler"
    return cls


def _rows():
    return [{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "solution": "5"}]


def test_run_takes_a_scheduler_on_ms_swifts_own_base_class(tiny, math_tips):
    _, tok = tiny
    says = Says(tok.encode("4", add_special_tokens=False) + [tok.eos_token_id])
    outputs = run(_rows(), math_tips(max_turns=2), says, tok, SamplingParams(max_new_tokens=4))
    (out,) = outputs
    assert out.status is not Status.FAILED and out.num_turns == 2  # wrong once: a tip, then a retry
    assert any(TIP in str(m.get("content")) for m in out.messages)


def test_a_task_source_takes_it_too_and_anything_else_is_named(math_tips):
    source = SwiftTaskSource(math_tips(max_turns=2), _rows())
    assert source.describe()["scheduler"] == "MathTipsScheduler"
    with pytest.raises(
        ValueError,
        match=r"compat.swift.run needs a compat.swift.MultiTurnScheduler or a "
        r"scheduler with ms-swift's hooks \(check_finished, step, on_turn_end\), got dict",
    ):
        run(_rows(), {}, None, None, SamplingParams(max_new_tokens=4))  # fmt: skip
