"""`--agent MODULE:FN` under torchrun: agents written against the OpenAI API (the OpenAI Agents SDK,
the plain `openai` client) train as written, through each rank's endpoint."""

from __future__ import annotations

import json

from support.launch import ROOT, SMALL, torchrun, trained


def test_an_agents_sdk_agent_trains(tmp_path):
    out = tmp_path / "run"
    agent = ROOT / "launch" / "agents" / "sdk_guess_agent.py"
    res = torchrun("--agent", f"{agent}:play", "--steps", "3", "--output-dir", str(out), *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = trained(out)
    # the SDK re-sends the whole conversation each call: every call after the first extends the
    # session's last one (no branch), and a game takes more than one call
    assert all(r["agent/branches_per_sample"] == 0 for r in rows)
    assert max(r["agent/calls_per_sample"] for r in rows) > 1
    # what was trained is the game as the agent played it: its guesses, the hints it wrote
    texts = [json.loads(line)["text"] for line in (out / "completions.jsonl").read_text().splitlines()]
    assert texts and any("higher: between" in t or "lower: between" in t for t in texts)


SYNC_AGENT = """
def solve(client, row):  # a plain function: it gets an openai.OpenAI client
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["question"]}], max_tokens=4
    )
    said = reply.choices[0].message.content.strip()
    if row["answer"] == 6:  # one row in four: the agent's own bug
        raise ValueError("no answer for " + row["question"])
    right = said == str(row["answer"])
    return {"reward": float(right) + 0.1 * said.isdigit(), "success": float(right)}
"""


def test_a_sync_agent_on_dataset_rows(tmp_path):
    """Also: an agent raising on one row in four (each rank plays all four rows every step)
    fails those samples only, says the cause once on stderr at step 0, and the count at the end."""
    data = tmp_path / "sums.jsonl"
    rows = [{"question": f"what is {i} + {i}?", "answer": 2 * i} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "myagent.py").write_text(SYNC_AGENT)
    out = tmp_path / "run"
    args = ["--agent", "myagent:solve", "--dataset", str(data), "--prompt-column", "question"]
    args += ["--eval-dataset", str(data), "--steps", "2", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, "--num-generations", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows_logged = trained(out, steps=2)
    assert all(r["agent/calls_per_sample"] == 1 for r in rows_logged)
    assert [r["failed/agent"] for r in rows_logged] == [4, 4]  # 2 samples of the row on each rank
    run = json.loads((out / "run.json").read_text())
    assert run["task_source"]["agent"] == "solve" and run["task_source"]["rows"]["name"]
    site = f"{tmp_path / 'myagent.py'}:8"  # the raise (the file opens with a blank line)
    said = [line for line in res.stderr.splitlines() if "failed at step" in line]
    assert len(said) == 1, res.stderr[-3000:]
    assert "failed at step 0: agent: ValueError: no answer for what is 3 + 3?" in said[0] and site in said[0]
    assert f"8 samples failed with agent: ValueError at {site}" in res.stderr


def test_the_readme_agent_is_the_launch_file():
    # the README's agent is launch/agents/guess_agent.py's code, which
    # test_the_readme_agent_trains runs: what it shows is what trains
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Agents written against the OpenAI API", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = (ROOT / "launch" / "agents" / "guess_agent.py").read_text()
    assert block == code[code.index("import re") :]
    assert "--agent launch/agents/guess_agent.py:play" in section


def test_the_readme_agent_trains(tmp_path):
    out = tmp_path / "run"
    agent = ROOT / "launch" / "agents" / "guess_agent.py"
    res = torchrun("--agent", f"{agent}:play", "--steps", "2", "--output-dir", str(out), *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = trained(out, steps=2)
    assert all(r["agent/branches_per_sample"] == 0 for r in rows)
