"""The supervised warm-up's data (`--sft-data`): parsing and refusals, the token layout and its
mask, the phase's resume decision, and the built-in demonstrations (in process, no launch)."""

from __future__ import annotations

import json

import pytest

from interlens_mcore.chat import ChatFormat
from interlens_mcore.tasks.guess import game_state, guess_tasks, reply_number
from interlens_mcore.tasks.toy import GuessTasks
from trainers.config import TrainerConfig
from trainers.grpo import supervised_steps_left
from trainers.sft import BadDemonstration, demonstration_trajectories, read_demonstrations

DEMO = [
    {"role": "system", "content": "answer with a number"},
    {"role": "user", "content": "guess between 1 and 7"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "higher: between 5 and 7"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "correct"},
]


def write(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_only_the_assistant_turns_are_targets_token_by_token(tiny, tmp_path):
    _, tok = tiny
    chat = ChatFormat(tok)
    [traj] = demonstration_trajectories(
        chat, read_demonstrations(write(tmp_path / "d.jsonl", json.dumps(DEMO)))
    )
    ids, mask = traj.token_ids, traj.loss_mask
    # what the template renders for the whole conversation is what the sequence holds
    assert tok.decode(ids) == tok.apply_chat_template(DEMO, tokenize=False)
    # walk the sequence: each assistant turn's content ids and the eos are 1, every other token 0
    expected = [0] * len(ids)
    pos = len(chat.preamble_ids("system"))
    for m in DEMO:
        if m["role"] == "assistant":
            pos += len(chat.generation_prompt_ids())
            said = chat.encode(m["content"]) + list(chat.stop_token_ids)
            assert ids[pos : pos + len(said)] == said
            expected[pos : pos + len(said)] = [1] * len(said)
            pos += len(said) + len(chat.close_ids("stop"))
        else:
            piece = chat.message_ids(m["role"], m["content"])
            assert ids[pos : pos + len(piece)] == piece
            pos += len(piece)
    assert pos == len(ids)
    assert mask == expected
    trained = tok.decode([t for t, k in zip(ids, mask) if k])
    assert trained.replace(tok.eos_token, "|") == "4|6|"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ('{"role": "user", "content": "hi"}', "got dict"),
        ('[{"role": "robot", "content": "hi"}]', "message 0"),
        ('[{"role": "user", "content": 3}]', "string content"),
        ('[{"role": "user", "content": "hi"}]', "no assistant turn"),
    ],
)
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, line, says):
    path = write(tmp_path / "demos.jsonl", json.dumps(DEMO), "", line)
    with pytest.raises(BadDemonstration) as err:
        read_demonstrations(path)
    text = str(err.value)
    assert text.startswith(f"{path}:3: ") and says in text and "\n" not in text


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(BadDemonstration, match="holds no demonstration"):
        read_demonstrations(write(tmp_path / "empty.jsonl", ""))


def test_a_cut_phase_continues_and_a_finished_one_is_not_redone():
    cfg = TrainerConfig(sft_data="d.jsonl", sft_steps=6, steps=0)
    assert supervised_steps_left(cfg, step=0, sft_step=0) == 6
    assert supervised_steps_left(cfg, step=0, sft_step=4) == 2  # cut during the phase
    assert supervised_steps_left(cfg, step=0, sft_step=6) == 0  # cut right after it
    assert supervised_steps_left(cfg, step=3, sft_step=2) == 0  # GRPO began: never again
    assert supervised_steps_left(TrainerConfig(), step=0, sft_step=0) == 0
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainerConfig(steps=0)


def test_guess_demonstrations_win_and_parse(tmp_path):
    source = GuessTasks(max_guesses=4)
    demos = source.demonstrations(20, seed=3)
    path = write(tmp_path / "g.jsonl", *(json.dumps(d) for d in demos))
    parsed = read_demonstrations(path)
    for task, messages in zip(guess_tasks(20, seed=3, max_guesses=4), parsed, strict=True):
        guesses = [reply_number(m.content) for m in messages if m.role == "assistant"]
        assert game_state(task, guesses).solved_at == len(guesses)  # binary search: the last guess wins
        assert messages[-1].content == "correct"


def test_demos_script_writes_jsonl_and_refuses_a_task_without_a_solver(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "launch" / "demos.py"
    spec = importlib.util.spec_from_file_location("demos", script)
    assert spec is not None and spec.loader is not None
    demos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demos)
    main = demos.main
    out = tmp_path / "demos.jsonl"
    assert main(["--task", "guess", "--n", "5", "--out", str(out)]) == 0
    assert len(read_demonstrations(out)) == 5
    assert main(["--task", "duel", "--n", "5", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "has no demonstrations" in capsys.readouterr().err
    assert main(["--task", "guess", "--n", "5", "--out", str(out), "--num-generatoins", "4"]) == 2
    assert "--num-generatoins" in capsys.readouterr().err  # train_grpo.py's parser names the flag
    assert main(["--task", "guess", "--n", "5"]) == 2 and "--out FILE" in capsys.readouterr().err
    # train_grpo.py's options: the demonstrations open as that run's rollouts do
    calc = tmp_path / "calc.jsonl"
    tools = "interlens_mcore.tools.examples:calculator"
    argv = ["--n", "4", "--out", str(calc), "--task", "reasoning_gym:basic_arithmetic", "--model", "tiny",
            "--system-prompt", "Show your work.", "--tools", tools]  # fmt: skip
    assert main(argv) == 0
    demos = [json.loads(line) for line in calc.read_text().splitlines()]
    assert len(demos) == 4 and len(read_demonstrations(calc)) == 4
    for demo in demos:
        assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant"]
        assert "calculator" in demo[0]["content"] and "Show your work." in demo[0]["content"]
        assert demo[2]["content"].startswith("<tool_call>") and demo[4]["content"].startswith("<answer>")


def test_reasoning_gym_demonstrations_score_one(tmp_path):
    from interlens_mcore.tasks.registry import resolve_task

    source = resolve_task("reasoning_gym:leg_counting")
    demos = source.demonstrations(8, seed=1)
    parsed = read_demonstrations(
        tmp_path.joinpath("r.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
        and tmp_path / "r.jsonl"
    )
    for task, messages in zip(source.rows(8, seed=1), parsed, strict=True):
        assert messages[-1].content.startswith("<answer>")
        assert task.judge(messages[-1].content)[1] == 1.0  # the verifier accepts the row's own answer
