"""Prompt datasets: every file format, message prompts, columns for rewards, splits, errors."""

from __future__ import annotations

import json

import pytest
from support.play import play

from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.tasks import dataset as ds_tasks
from interlens_mcore.tasks.dataset import prompt_messages

ROWS = [{"prompt": f"what is {i} plus {i}", "answer": 2 * i, "level": i % 3} for i in range(20)]


def _write(tmp_path, fmt, rows=ROWS):
    import datasets

    data = datasets.Dataset.from_list(rows)
    path = tmp_path / f"d.{fmt}" if fmt != "disk" else tmp_path / "folder"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        data.to_parquet(str(path))
    elif fmt == "csv":
        data.to_csv(str(path), index=False)
    else:
        data.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    src = ds_tasks.source(_write(tmp_path, fmt), eval_fraction=0.1)
    rows = src.rows(18, seed=0)
    assert len({r.columns["prompt"] for r in rows}) == 18  # one permutation: no repeats
    assert all(r.columns["answer"] == 2 * int(r.columns["prompt"].split()[2]) for r in rows)
    assert rows[0].prompt()[0].role == "user" and rows[0].prompt()[0].content == rows[0].columns["prompt"]
    assert src.describe()["train_rows"] == 18 and src.describe()["eval_rows"] == 2


def test_splits_are_disjoint_and_reproducible(tmp_path):
    path = _write(tmp_path, "jsonl")
    src = ds_tasks.source(path, eval_fraction=0.25)
    held = {r.columns["prompt"] for r in src.eval_rows(100, seed=0)}
    # 5 of 20 rows, the same ones for a new source over the same file, whatever the seed
    assert len(held) == 5
    assert held == {
        r.columns["prompt"] for r in ds_tasks.source(path, eval_fraction=0.25).eval_rows(5, seed=9)
    }
    train = {r.columns["prompt"] for s in range(10) for r in src.rows(15, seed=s)}
    assert not train & held and len(train) == 15
    assert [r.columns for r in src.rows(7, seed=3)] == [r.columns for r in src.rows(7, seed=3)]
    assert len(src.rows(40, seed=1)) == 40  # more than there are: whole permutations, then repeats
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"prompt": "held out", "answer": 0, "level": 0}))
    with_eval = ds_tasks.source(path, eval_path=str(other))
    assert [r.columns["prompt"] for r in with_eval.eval_rows(5, seed=0)] == ["held out"]
    assert with_eval.describe()["train_rows"] == 20
    assert ds_tasks.source(path, eval_fraction=0.0).eval_rows(5, seed=0) == []


def test_message_prompts(tmp_path):
    rows = [
        {
            "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": f"q{i}"}],
            "id": i,
        }
        for i in range(3)
    ]
    src = ds_tasks.source(_write(tmp_path, "jsonl", rows), prompt_column="messages", eval_fraction=0.0)
    opening = src.rows(1, seed=0)[0].prompt()
    assert [(m.role, m.content[:1]) for m in opening] == [("system", "b"), ("user", "q")]


@pytest.mark.parametrize(
    "value,why",
    [
        ("", "the prompt is empty"),
        ([], "non-empty list"),
        (3, "must be a string"),
        ([{"role": "user"}], "message 0 must be a dict"),
        ([{"role": "", "content": "x"}], "message 0 must be a dict"),
        (["hello"], "message 0 must be a dict"),
    ],
)
def test_bad_prompt_cells(value, why):
    with pytest.raises(ValueError, match=why):
        prompt_messages(value, where="row 0")


def test_errors_name_the_input(tmp_path):
    path = _write(tmp_path, "jsonl")
    with pytest.raises(
        ValueError, match="has no column 'question'; its columns: \\['prompt', 'answer', 'level'\\]"
    ):
        ds_tasks.source(path, prompt_column="question")
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="empty.csv' is empty"):
        ds_tasks.source(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{not json')
    with pytest.raises(ValueError, match="broken.jsonl' line 2: not JSON"):  # the row, named
        ds_tasks.source(str(broken))
    with pytest.raises(ValueError, match="expected a .jsonl, .json, .parquet, .csv file"):
        ds_tasks.source(str(tmp_path / "d.txt"))
    with pytest.raises(ValueError, match="no such file"):
        ds_tasks.source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one written by save_to_disk"):
        ds_tasks.source(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="apply to tools"):
        ds_tasks.source(path, max_calls=2)


def test_tiny_model_rollout_and_reward_columns(tmp_path, tiny):
    model, tok = tiny
    src = ds_tasks.source(_write(tmp_path, "parquet"))
    rows = src.rows(4, seed=0)
    convs = play(rows, HFEngine(model, tok), tok, max_new_tokens=6)

    def says_the_answer(trajectories, rows):  # a reward function reading a column of the row
        return [float(str(r.columns["answer"]) in t.infos.completion) for t, r in zip(trajectories, rows)]

    trajectories = [c.trajectories()[0] for c in convs]
    for c, t in zip(convs, trajectories):
        assert c.stop_reason == "answered" and len(c.messages) == 1 and len(t.turns) == 1
        t.infos.completion = c.messages[-1].content
    expected = [float(str(2 * int(c.prompt[0].content.split()[2])) in c.messages[-1].content) for c in convs]
    assert says_the_answer(trajectories, rows) == expected


def test_the_reward_function_of_docs_tasks_md(tmp_path):
    import re
    from pathlib import Path

    from interlens_mcore.types import Trajectory

    text = (Path(__file__).resolve().parents[3] / "docs" / "tasks.md").read_text()
    [block] = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict = {}
    exec(block, scope)
    rows = ds_tasks.source(_write(tmp_path, "jsonl"), eval_fraction=0.0).rows(2, seed=0)
    said = [f"it is {rows[0].columns['answer']}", "no idea"]
    trajectories = [
        Trajectory(token_ids=[1], loss_mask=[1], rollout_logprobs=None, infos={"completion": s}) for s in said
    ]
    assert scope["exact_answer"](trajectories, rows) == [1.0, 0.0]
    # the tool specs the commands name load as written
    from interlens_mcore.tools import load_tools

    for spec in set(re.findall(r"--tools (interlens_mcore\S+)", text)):
        assert load_tools(spec)
