"""`trainers.update.update` on a FakeBackend: skipped steps, micro-batches, metric reduction.

The fake is a bigram table (an embedding of V x V logits) with a real torch optimizer: the
update's own logic (denominators, placeholders, the NaN guard, the reductions) is what runs,
on one process, in milliseconds.
"""

from __future__ import annotations

import math

import pytest
import torch

from interlens_mcore.grpo.batch import build_batch
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.objective import batch_loss
from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Trajectory
from trainers.update import UpdateResult, update

V = 8


class FakeBackend:
    """Logits depend on the current token only; the optimizer step reports the true grad norm."""

    layout, pad_to_multiple = "padded", 1

    def __init__(self, *, poison: bool = False):
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(V, V)
        self.opt = torch.optim.SGD(self.table.parameters(), lr=0.1)
        self.poison = poison  # every gradient norm comes back NaN: the step must be skipped
        self.forwards, self.backwards, self.steps_applied = 0, 0, 0

    def logprobs_of(self, batch, *, reference=False):
        self.forwards += 1
        logp = torch.log_softmax(self.table(batch.input_ids), dim=-1)  # [B, T, V]
        return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # [B, T]

    def backward(self, loss):
        self.backwards += 1
        loss.backward()

    def optimizer_step(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.table.parameters(), 1e9))
        if self.poison:
            norm = math.nan
        if math.isfinite(norm):
            self.opt.step()
            self.steps_applied += 1
        self.opt.zero_grad()
        return norm


class Capturing(FakeBackend):
    """Keeps the gradient each optimizer step sees."""

    def __init__(self):
        super().__init__()
        self.grads: list[torch.Tensor] = []

    def optimizer_step(self) -> float:
        self.grads.append(self.table.weight.grad.clone())
        return super().optimizer_step()


def _rollout(n: int = 4) -> tuple[Rollout, list[Trajectory], torch.Tensor]:
    ids = [[1, 2, 3, 4], [1, 3, 3, 4], [5, 6, 7, 5], [5, 7, 6, 5]][:n]  # the halves share no bigram
    trajectories = [Trajectory(token_ids=t, loss_mask=[0, 1, 1, 1], rollout_logprobs=None) for t in ids]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5][:n])
    rollout = Rollout(trajectories=trajectories, rows=[None] * n, advantages=advantages)
    return rollout, trajectories, advantages


def _batches(trajectories, advantages, per_batch: int):
    return [
        build_batch(trajectories[i : i + per_batch], advantages[i : i + per_batch], layout="padded")
        for i in range(0, len(trajectories), per_batch)
    ]


CFG = LossConfig(beta=0.0, is_mode="none")


def test_one_update_applies_the_step_and_reports_finalized_metrics():
    rollout, ts, adv = _rollout()
    backend = FakeBackend()
    before = backend.table.weight.detach().clone()
    result = update(backend, _batches(ts, adv, 4), rollout, loss_config=CFG)
    assert isinstance(result, UpdateResult) and result.skipped == 0
    assert backend.steps_applied == 1 and not torch.equal(before, backend.table.weight)
    # 4 samples x 3 trained tokens, each target once: the token count is the loss mask's
    assert result.metrics["tokens"] == 12.0 and result.metrics["samples"] == 4.0
    assert result.metrics["step_skipped"] == 0.0 and result.metrics["grad_norm"] > 0
    # one micro-batch, one update: the update's forward is the old policy's, so ratio 1, nothing clipped
    assert result.metrics["clip/fraction"] == 0.0 and result.metrics["ratio/max"] == pytest.approx(1.0)


def test_a_non_finite_gradient_norm_is_a_skipped_step_counted():
    rollout, ts, adv = _rollout()
    backend = FakeBackend(poison=True)
    before = backend.table.weight.detach().clone()
    result = update(backend, _batches(ts, adv, 2), rollout, loss_config=CFG, updates=3)
    assert result.skipped == 3 and result.metrics["step_skipped"] == 1.0
    assert math.isnan(result.metrics["grad_norm"])
    assert backend.steps_applied == 0 and torch.equal(before, backend.table.weight)


def test_micro_batches_sum_to_the_one_batch_gradient():
    # the global denominators make two micro-batches of 2 give the gradient of one batch of 4
    rollout, ts, adv = _rollout()
    grads = []
    for per_batch in (4, 2):
        backend = Capturing()
        result = update(backend, _batches(ts, adv, per_batch), rollout, loss_config=CFG)
        assert result.metrics["tokens"] == 12.0
        grads.append(backend.grads[0])
    torch.testing.assert_close(grads[0], grads[1])
    # with two micro-batches the tokens kept are known from a no-grad pass first: 2 + 2 forwards
    assert backend.forwards == 4 and backend.backwards == 2


def test_a_rank_without_rows_joins_with_a_zero_weighted_placeholder():
    rollout, ts, adv = _rollout()
    backend = FakeBackend()
    batches = _batches(ts, adv, 2)
    result = update(backend, [batches[0], None], rollout, loss_config=CFG)
    # the placeholder's backward ran (collectives stay aligned) but counts in no metric
    assert backend.backwards == 2 and result.metrics["samples"] == 2.0 and result.metrics["tokens"] == 6.0


def test_metrics_reduce_by_their_suffix_over_micro_batches():
    rollout, ts, adv = _rollout()
    calls = []

    def recording_loss(*args, **kwargs):  # the real loss; its per-call metrics kept
        loss, metrics = batch_loss(*args, **kwargs)
        calls.append({k: float(v) for k, v in metrics.items()})
        return loss, metrics

    # two updates: the second sees moved weights, so each micro-batch's ratio departs from 1
    batches = _batches(ts, adv, 2)
    result = update(FakeBackend(), batches, rollout, loss_config=CFG, updates=2, loss_fn=recording_loss)
    last = calls[-2:]  # the metrics come from the last update's two micro-batches
    assert last[0]["ratio/max"] != last[1]["ratio/max"]
    # a '/max' key reduces to the max, the rest to sums
    assert result.metrics["ratio/max"] == pytest.approx(max(c["ratio/max"] for c in last))
    assert result.metrics["tokens"] == sum(c["tokens"] for c in last) == 12.0


def test_progress_counts_every_micro_batch_of_every_update():
    # what the progress bar shows during a long update: one call before each forward with gradient
    rollout, ts, adv = _rollout()
    seen: list[tuple[int, int]] = []
    update(
        FakeBackend(),
        _batches(ts, adv, 2),
        rollout,
        loss_config=CFG,
        updates=3,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen == [(i, 6) for i in range(1, 7)]
