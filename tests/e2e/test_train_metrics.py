"""The metrics as documented: every key the README and docs/*.md list is written by real 2-step runs
of launch/train_grpo.py; and the health check's warning, once, on a run that cannot learn."""

from __future__ import annotations

import re

from support.launch import ROOT, SMALL, all_records, metrics, python, torchrun

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

EXTRA_REWARD = """
def brevity(trajectories, rows):
    return [1.0 if len(t.infos["completion"]) < 4 else 0.0 for t in trajectories]
"""

# between them the runs meet every condition a documented key needs: several reward functions,
# two trained seats and invalid moves (textarena self-play); tools and a task mix; an --agent
# with dynamic sampling
RUNS = {
    "agent+dynamic": ["--agent", f"{ROOT}/launch/agents/guess_agent.py:play", "--dynamic-sampling"],
    "selfplay": [
        "--task",
        "textarena:TicTacToe-v0",
        "--task-args",
        '{"max_moves": 3}',
        "--reward",
        "{extra}",
        "--model",
        "tiny",  # the tiny policy, not the family's SmolLM2: these runs check names, not learning
    ],
    "mix+tools": [
        "--task",
        "reasoning_gym:chain_sum+leg_counting",
        "--tools",
        "interlens_mcore.tools.examples:calculator",
        "--model",
        "tiny",
    ],
}


def documented_keys() -> dict[str, str]:
    """{key: the file naming it} for every backticked name in the first column of a `| key |` table."""
    out: dict[str, str] = {}
    for path in DOCS:
        in_table = False
        for line in path.read_text().splitlines():
            cells = (
                [c.strip() for c in line.strip().strip("|").split("|")]
                if line.lstrip().startswith("|")
                else []
            )
            if not cells:
                in_table = False
            elif cells[0] == "key":
                in_table = True
            elif in_table and not set(cells[0]) <= {"-", ":"}:
                out.update({k: path.name for k in re.findall(r"`([^`]+)`", cells[0])})
    return out


def _pattern(key: str) -> re.Pattern:
    # `reward/<name>`: any one name in the placeholder's place
    return re.compile(
        "".join("[^/]+" if p.startswith("<") else re.escape(p) for p in re.split(r"(<[^>]+>)", key))
    )


def test_every_documented_metric_is_written(tmp_path):
    keys = documented_keys()
    # the tables were found: the IS diagnostics, the step figures, the tool metrics
    assert {"is/kl_k3", "is/weight_mean", "is/weight/max", "completions/clipped_ratio"} <= set(keys)
    assert {"tool/calls_per_sample", "frac_reward_zero_std", "learning_rate", "reward_mean/<seat>"} <= set(
        keys
    )
    extra = tmp_path / "extra_reward.py"
    extra.write_text(EXTRA_REWARD)
    written: set[str] = set()
    for name, args in RUNS.items():
        out = tmp_path / name.replace("+", "_")
        args = [a.replace("{extra}", f"{extra}:brevity") for a in args]
        res = python(
            *args, "--steps", "2", "--output-dir", str(out), *SMALL, "--max-new-tokens", "8", timeout=400
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert len(metrics(out)) == 2
        written |= {k for r in all_records(out) for k in r}
    missing = {k: f for k, f in keys.items() if not any(_pattern(k).fullmatch(w) for w in written)}
    assert not missing, f"documented but not written: {missing}"
    # the one naming scheme: no IS figure under its former `is_` names
    assert not [w for w in written if w.startswith("is_")]


def test_a_run_that_cuts_every_reply_warns_once_with_the_flag(tmp_path):
    """One token per reply on 2 ranks: every reply ends at the cap, so from the third step on the
    health check holds and one line (rank 0's, once) names --max-new-tokens."""
    out = tmp_path / "run"
    args = ["--steps", "4", "--output-dir", str(out), *SMALL, "--max-new-tokens", "1"]
    res = torchrun(*args, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["completions/clipped_ratio"] for r in rows] == [1.0] * 4
    assert [r["health/clipped_replies"] for r in rows] == [1, 2, 3, 4]
    warnings = [line for line in res.stderr.splitlines() if "warning: " in line]
    assert len(warnings) == 1, res.stderr[-3000:]
    assert (
        "--max-new-tokens 1 cuts 100% of replies (completions/clipped_ratio); raise --max-new-tokens"
        in warnings[0]
    )
    assert "step 2" in warnings[0]
