"""docs/rewards.md stays true: its built-ins table is the registry, its examples run as documented."""

from __future__ import annotations

import re
from pathlib import Path

from support.reward_samples import row, sample

from interlens_mcore.grpo.rewards import WeightedRewards
from interlens_mcore.rewards import Convention, adapt, convention_of
from interlens_mcore.rewards.builtins import BUILTINS

DOC = Path(__file__).resolve().parents[3] / "docs" / "rewards.md"


def test_the_built_ins_table_is_the_registry():
    section = DOC.read_text().split("## Built-ins", 1)[1].split("\n## ", 1)[0]
    table = re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section, flags=re.M)
    assert table == [(name, cls.__name__) for name, cls in BUILTINS.items()]


def test_each_example_is_of_its_convention_and_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    found: list[dict] = []
    for code in blocks:
        scope: dict = {}
        exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102  # the doc's own examples
        found.append(scope)
    brevity, contains, orms = found[0]["brevity"], found[1]["contains_answer"], found[2]["orms"]
    assert convention_of(brevity, what="doc") is Convention.OURS
    assert convention_of(contains, what="doc") is Convention.TRL
    assert convention_of(orms["short"], what="doc") is Convention.ORM
    fns = [adapt(f, what="doc") for f in (brevity, contains, orms["short"])]
    parts = WeightedRewards(fns).score([sample("it is 12")], [row("12", answer=12)])[1]
    assert parts == {"brevity": [1.0], "contains_answer": [1.0], "ShortAnswer": [0.0]}
