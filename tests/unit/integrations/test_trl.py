"""`integrations.trl`: what TRL's GRPOTrainer receives from our rollouts, in one process.

The trainer here is a stand-in with the four attributes `TRLRollouts` reads (model, tokenizer,
accelerator, step): the test is about our fields, not TRL's loop, which
tests/multiproc/test_trl_dist.py runs for real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from interlens_mcore.grpo.batch import build_batch
from interlens_mcore.integrations.trl import ROW_KEY, TRLRollouts, env_reward, trl_fields
from interlens_mcore.rollout.rollouter import RolloutConfig
from interlens_mcore.tasks import resolve_task


def trainer_of(tiny, step=0):
    model, tok = tiny
    return SimpleNamespace(
        model=model,
        processing_class=tok,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        state=SimpleNamespace(global_step=step),
    )


def rollouts_of(spec, args=None):
    return TRLRollouts(
        resolve_task(spec, args or {}), config=RolloutConfig(num_generations=1, max_new_tokens=4)
    )


@pytest.mark.parametrize(
    ("spec", "args"), [("guess", {}), ("reasoning_gym:basic_arithmetic", {"max_attempts": 2})]
)
def test_fields_for_trl_from_two_sources(tiny, spec, args):
    rollouts = rollouts_of(spec, args)
    data = rollouts.dataset(3)
    # TRL's sampler repeats every row num_generations times, consecutively: one sample per prompt
    prompts = [data[i]["prompt"] for i in (0, 0, 2, 2)]
    out = rollouts(prompts, trainer_of(tiny))
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == 4
    for key in ("logprobs", "env_mask"):
        assert [len(x) for x in out[key]] == [len(c) for c in out["completion_ids"]]
    assert out["completion_ids"][0] != out["completion_ids"][1]  # two samples, two seeds
    assert out["prompt_ids"][0] == out["prompt_ids"][1]
    assert env_reward(None, out["env_reward"]) == out["env_reward"]
    assert all(m[0] == 1 for m in out["env_mask"])  # the completion starts where the policy speaks


def test_env_mask_and_logprobs_match_our_training_batch(tiny):
    rollouts = rollouts_of("guess", {"max_guesses": 3})
    data = rollouts.dataset(2)
    trajectories = rollouts.source.run(
        rollouts.rollouter(trainer_of(tiny)), rollouts.rows_of(data["prompt"]), 0
    )
    trajectories = trajectories.trajectories
    assert max(t.infos.turns for t in trajectories) > 2  # environment replies inside the completion
    out = trl_fields(trajectories)
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), layout="padded")
    for i, t in enumerate(trajectories):
        split = len(out["prompt_ids"][i])
        assert out["prompt_ids"][i] + out["completion_ids"][i] == t.token_ids
        # our batch's position p predicts token p + 1: completion token j is target split + j - 1
        n = len(t.token_ids)
        ours = batch.loss_mask[i, split - 1 : n - 1].int().tolist()
        assert out["env_mask"][i] == ours and 0 in ours  # environment tokens are zeroed
        assert not batch.loss_mask[i, : split - 1].any()  # nothing of the prompt is trained
        ours_lp = batch.rollout_logprobs[i, split - 1 : n - 1]
        assert torch.allclose(torch.tensor(out["logprobs"][i]), ours_lp, atol=1e-7)
        # TRL's own tool loop puts 0.0 at tokens it does not train; so do we
        assert all(lp == 0.0 for lp, m in zip(out["logprobs"][i], out["env_mask"][i]) if not m)


def test_refusals(tiny):
    with pytest.raises(ValueError, match="GRPOConfig.num_generations"):
        TRLRollouts(resolve_task("guess", {}), config=RolloutConfig(num_generations=4))
    rollouts = rollouts_of("guess")
    rollouts.dataset(1)
    with pytest.raises(ValueError, match=f"{ROW_KEY!r} in its messages"):
        rollouts([[{"role": "user", "content": "guess"}]], trainer_of(tiny))
