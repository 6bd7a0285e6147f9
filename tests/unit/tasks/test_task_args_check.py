"""--task-arg keys are checked against the task factory's signature before anything is built."""

from __future__ import annotations

import pytest

from interlens_mcore.tasks import resolve_task
from interlens_mcore.tasks.registry import check_task_args


def test_a_mistyped_gym_argument_names_the_closest_one():
    with pytest.raises(
        ValueError, match=r"^--task-arg max_step: gym:Taxi-v4 takes no max_step \(did you mean max_steps\?\)$"
    ):
        resolve_task("gym:Taxi-v4", {"max_step": 30})


def test_gym_arguments_of_the_environment_and_of_make_pass():
    # is_rainy: TaxiEnv's constructor; max_episode_steps: gymnasium.make's; max_steps: the factory's
    check_task_args("gym:Taxi-v4", {"is_rainy": True, "max_episode_steps": 9, "max_steps": 5})
    with pytest.raises(
        ValueError, match=r"gym:FrozenLake-v1 takes no is_slipery \(did you mean is_slippery\?\)"
    ):
        check_task_args("gym:FrozenLake-v1", {"is_slipery": False})


def test_a_factory_without_kwargs_lists_what_it_takes(tmp_path, monkeypatch):
    (tmp_path / "mytasks.py").write_text(
        "from interlens_mcore.tasks import GuessTasks\n\ndef make(level: int = 1):\n    return GuessTasks()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from interlens_mcore.tasks.registry import TASKS

    monkeypatch.setitem(TASKS, "mine", __import__("mytasks").make)
    with pytest.raises(ValueError, match=r"^--task-arg colour: mine takes no colour \(it takes level\)$"):
        resolve_task("mine", {"colour": "red"})
    assert resolve_task("mine", {"level": 2}) is not None
