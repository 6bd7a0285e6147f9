"""Each task family through RolloutMixin: rows in, scored trajectories, group advantages, batches."""

from __future__ import annotations

import json

import pytest
from support.fakes import ForeignTrainer

from interlens_mcore.tasks import dataset as ds_tasks
from interlens_mcore.tasks.families import make_source
from interlens_mcore.tools import tool_metrics, with_tools
from interlens_mcore.tools.examples import calculator

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _check(trainer, rollout, seats):
    trajs = rollout.trajectories
    assert {t.participant for t in trajs} == set(seats)
    by_id = {c.id: c for c in rollout.conversations}
    for t in trajs:
        conv = by_id[t.infos["conversation"]]
        own = [m for m in conv.messages if m.speaker == t.participant]
        assert len(t.turns) == len(own) and t.logprobs_complete
    # advantages are centred per (row, seat) group
    for g in {(t.group, t.participant) for t in trajs}:
        idx = [i for i, t in enumerate(trajs) if (t.group, t.participant) == g]
        assert abs(float(rollout.advantages[idx].sum())) < 1e-5
    assert sum(b.num_samples for b in trainer.training_batches(rollout) if b) > 0


@pytest.mark.parametrize(
    "spec,args",
    [
        ("reasoning_gym:basic_arithmetic", {"max_attempts": 2}),
        ("gym:FrozenLake-v1", {"max_steps": 2}),
        ("textarena:TicTacToe-v0", {"max_moves": 2}),
    ],
)
def test_family_rollouts_and_evaluation(tiny, spec, args):
    src = make_source(spec, **args)
    trainer = ForeignTrainer(*tiny, num_generations=2)
    rollout = trainer.generate_rollouts(src.rows(2, seed=0), step=0)
    _check(trainer, rollout, src.trained_seats)
    assert len(rollout.trajectories) == 2 * 2 * len(src.trained_seats)
    evaluated = trainer.evaluate(src.eval_rows(1, seed=0), step=0)
    # every evaluated seat reports how it did: a win rate per seat, or solved / not
    assert all(t.infos["success"] in (0.0, 0.5, 1.0) for t in evaluated.trajectories)
    if spec.startswith("textarena"):
        assert {t.participant for t in evaluated.trajectories} == {"player_0", "player_1"}
    else:
        assert all(c.infos["success"] in (0.0, 1.0) for c in rollout.conversations)


def test_dataset_with_tools_and_a_reward_function(tmp_path, tiny):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i} plus one", "answer": i + 1}) for i in range(6)))
    src = with_tools(ds_tasks.source(str(path), eval_fraction=0.0), [calculator], tokenizer=tiny[1])

    class Scored(ForeignTrainer):  # a dataset has no environment reward: a reward function scores it
        def compute_rewards(self, trajectories, rows):
            assert all(row.columns["answer"] >= 1 for row in rows)  # every column reaches the reward
            return [float(t.infos["messages"][-1]["content"].isdigit()) for t in trajectories]

    trainer = Scored(*tiny, num_generations=2)
    rollout = trainer.generate_rollouts(src.rows(3, seed=0), step=0)
    _check(trainer, rollout, ["policy"])
    assert all("tool_calls" in t.infos for t in rollout.trajectories)  # the tool environment ran
    metrics = tool_metrics([t.infos for t in rollout.trajectories])
    # the random model calls no tool: its reply, then the silent close
    assert metrics["tool/calls_per_sample"] == 0.0 and metrics["turns_per_sample"] == 2.0
