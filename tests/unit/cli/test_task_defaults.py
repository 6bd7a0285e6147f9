"""Options a task brings: under the user's YAML and command line, over the library's defaults."""

from __future__ import annotations

import json

import pytest

from interlens_mcore.cli import defaults
from interlens_mcore.cli.args import UsageError, parse
from interlens_mcore.cli.build import with_task_defaults
from interlens_mcore.tasks.families import PRETRAINED_ON_CPU


def _args(*argv: str):
    return with_task_defaults(parse(list(argv), description="test"))[0]


def plain_recompute() -> bool:
    """Whether a short-answer task (reasoning-gym) turns activation checkpointing on."""
    return _args("--task", "reasoning_gym:basic_arithmetic").backend.recompute


def test_a_task_family_brings_its_model_and_lengths_unless_the_user_sets_them():
    args = _args("--task", "gym:FrozenLake-v1", "--max-new-tokens", "9")
    assert args.rollout.max_new_tokens == 9  # the command line wins
    assert args.origins["max_new_tokens"] == "command line"
    assert (args.backend.model, args.trainer.lr, args.rollout.temperature) == ("smollm2", 1e-5, 0.7)
    assert args.origins["model"] == "task gym:FrozenLake-v1"
    assert args.rollout.micro_batch_size == 1  # an episode a micro-batch: its conversation is long
    assert args.trainer.eval_size == 16  # held-out episodes are as long
    # and their activations would fill a CPU machine's memory: recomputed in the backward
    assert (args.backend.recompute, args.origins["recompute"]) == (True, "task gym:FrozenLake-v1")
    assert not plain_recompute()
    plain = _args("--task", "reasoning_gym:basic_arithmetic")
    assert plain.rollout.max_new_tokens == 48  # room for <answer>...</answer>, where 6 holds none
    assert plain.trainer.batch_size == PRETRAINED_ON_CPU["batch_size"]
    assert plain.rollout.micro_batch_size == PRETRAINED_ON_CPU["micro_batch_size"] == 4


def test_yaml_sits_between_the_task_and_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.01\ntemperature: 0.9\n")
    args = _args("--config", str(config), "--task", "textarena:TicTacToe-v0", "--temperature", "1.1")
    assert (args.trainer.lr, args.origins["lr"]) == (0.01, "YAML")
    assert (args.rollout.temperature, args.origins["temperature"]) == (1.1, "command line")
    assert args.rollout.max_new_tokens == 16
    assert args.origins["max_new_tokens"] == "task textarena:TicTacToe-v0"


def test_the_default_task_changes_nothing_and_says_so():
    args = _args()
    assert args.origins == {} and args.backend.model is None and args.rollout.max_new_tokens == 6
    assert defaults.describe(args).startswith("options: none set;")


def test_tools_widen_the_reply_over_the_task_but_not_over_the_user(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "2 + 2?"}) + "\n")
    tools = ["--dataset", str(data), "--tools", "interlens_mcore.tools.examples:calculator"]
    args = _args(*tools)
    assert (args.rollout.max_new_tokens, args.origins["max_new_tokens"]) == (128, "--tools")
    assert _args(*tools, "--max-new-tokens", "20").rollout.max_new_tokens == 20
    line = defaults.describe(args)
    assert "--max-new-tokens 128 (--tools)" in line and f"--dataset {data} (command line)" in line


def test_a_task_default_that_is_no_option_is_named():
    args = parse([], description="test")
    with pytest.raises(ValueError, match=r"task mine: option_defaults\(\) names 'max_new_token', which"):
        defaults.apply(args, {"max_new_token": 8}, "task mine")
    with pytest.raises(UsageError, match="task mine: its default options do not hold"):
        defaults.apply(args, {"num_generations": 0}, "task mine")


def test_a_dataset_scores_with_its_reward_functions_and_smollm2_brings_its_sizes(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "2 + 2?", "answer": "4"}) + "\n")
    args = _args("--dataset", str(data), "--model", "smollm2", "--reward-funcs", "accuracy", "--beta", "0.1")
    assert args.launch.no_env_reward and args.origins["no_env_reward"] == defaults.DATASET_HAS_NO_REWARD
    # the tiny policy's lr 1e-3 would wreck a pretrained model: the model's CPU sizes instead
    assert (args.trainer.lr, args.origins["lr"]) == (1e-5, "--model smollm2")
    assert args.trainer.batch_size == PRETRAINED_ON_CPU["batch_size"]
    assert (args.loss.beta, args.origins["beta"]) == (0.1, "command line")  # the user's stays
    assert args.rollout.max_new_tokens == 64  # the task's defaults come after the model's
    # an agent's returned reward is the task's: its env reward stays on
    agent = _args("--dataset", str(data), "--agent", "launch.agents.guess_agent:play")
    assert not agent.launch.no_env_reward
    # the tiny model keeps the library's sizes
    assert _args("--dataset", str(data), "--model", "tiny").trainer.lr == 1e-3
