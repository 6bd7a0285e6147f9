"""TRL's GRPOTrainer with our rollout_func under torchrun: 2 gloo processes, CPU, tiny model.

Needs real processes because what it checks lives between them: TRL/accelerate's process
group carries our termination vote (rank 1 plays 6 conversation turns, rank 0 two, and both
finish 3 steps), and one rank's environment error must end both ranks, named. Each launch
takes about 15 s here. `trl_job.py` runs launch/trl_grpo.py's trainer and records, per step,
what TRL's loss received against what our rollouts returned.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.launch import torchrun

JOB = Path(__file__).with_name("trl_job.py")


def test_three_steps_uneven_turns(tiny_path, tmp_path):
    done = torchrun(
        str(tiny_path), str(tmp_path), "train", script=JOB, timeout=180, TRL_EXPERIMENTAL_SILENCE="1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert len(r["steps"]) == 3  # TRL's loss ran 3 times on each rank
        for step in r["steps"]:
            # TRL's loss saw our prompt ids, completion ids and env_mask, sample for sample
            assert step["same"] and step["samples"] == 2
            # the logprobs TRL holds equal the policy's own, recomputed by a full forward
            assert step["logprob_diff"] < 1e-5
    # rank 0's games last one guess (2 turns), rank 1's three (6): the vote kept both going
    assert {t for s in ranks[0]["steps"] for t in s["turns"]} == {2}
    assert {t for s in ranks[1]["steps"] for t in s["turns"]} == {6}


def test_one_rank_environment_error_ends_both(tiny_path, tmp_path):
    # the real torchrun: its `[rankN]:` prefix tells which rank said each line
    done = torchrun(
        str(tiny_path),
        str(tmp_path),
        "raise",
        script=JOB,
        timeout=180,
        warm=False,
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    assert done.returncode != 0
    named = "rollout failed on 1 rank(s): rank 1: RuntimeError: the game master broke on purpose"
    # the same named error on both ranks, not a hang on rank 0
    assert f"[rank0]: interlens_mcore.rollout.vote.RolloutError: {named}" in done.stderr
    assert f"[rank1]: interlens_mcore.rollout.vote.RolloutError: {named}" in done.stderr
