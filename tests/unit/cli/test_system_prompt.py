"""--system-prompt reaches the tokens the engine sees, for a dataset, a task family and a scheduler."""

from __future__ import annotations

import json

import pytest
from support.fakes import ForeignTrainer, Recording

from interlens_mcore.cli.args import parse
from interlens_mcore.cli.build import task_source
from interlens_mcore.cli.system_prompt import with_system_messages

TEXT = "You are a careful player. Answer in one word."


def _engine_prompts(tiny, source) -> list[str]:
    model, tok = tiny
    trainer = ForeignTrainer(model, tok, num_generations=2, max_new_tokens=2)
    trainer.engine = spy = Recording(trainer.engine)
    source.run(trainer.rollouter, source.rows(2, seed=0), 0)  # the source's own driver, as the trainer's
    return [tok.decode(r.prompt_ids) for call in spy.calls for r in call]


@pytest.mark.parametrize("with_prompt", [True, False])
def test_dataset_prompts_open_with_the_system_prompt(tiny, tiny_path, tmp_path, with_prompt):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?"}) + "\n" for i in range(4)))
    argv = ["--dataset", str(data), "--model", str(tiny_path)]
    args = parse([*argv, "--system-prompt", TEXT] if with_prompt else argv, "test")
    prompts = _engine_prompts(tiny, task_source(args))
    assert prompts and all(("What is" in p) for p in prompts)
    # the old code has no such option: without it the text is nowhere (the assertion can fail)
    assert all((TEXT in p) == with_prompt for p in prompts)
    if with_prompt:
        assert all(p.index(TEXT) < p.index("What is") for p in prompts)


def test_a_task_family_keeps_its_own_system_message_after_ours(tiny, tiny_path):
    args = parse(["--task", "gym:FrozenLake-v1", "--model", str(tiny_path), "--system-prompt", TEXT], "test")
    source = task_source(args)
    (row,) = source.rows(1, seed=0)
    assert row.prompt()[0].role == "system" and row.prompt()[0].content.startswith(TEXT)
    assert sum(m.role == "system" for m in row.prompt()) == 1
    prompts = _engine_prompts(tiny, source)
    assert prompts and all(TEXT in p for p in prompts)
    assert source.describe()["system_prompt"] == TEXT


def test_scheduler_rows_gain_a_system_message():
    row = {"messages": [{"role": "user", "content": "hi"}], "solution": "3"}
    out = with_system_messages(row, TEXT, "rows.jsonl")
    assert out["messages"][0] == {"role": "system", "content": TEXT} and out["solution"] == "3"
    assert row["messages"][0]["role"] == "user"  # the dataset's own row is left as it was
    merged = with_system_messages([{"role": "system", "content": "Be kind."}], TEXT, "rows.jsonl")
    assert merged == [{"role": "system", "content": f"{TEXT}\n\nBe kind."}]
    with pytest.raises(ValueError, match="--system-prompt: a row of rows.jsonl is int"):
        with_system_messages(5, TEXT, "rows.jsonl")
