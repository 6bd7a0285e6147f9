"""`update` with an entropy bonus and the top-entropy mask, on test_update's bigram fake."""

from __future__ import annotations

import pytest
import torch
from test_update import CFG, Capturing, FakeBackend, _batches, _rollout

from interlens_mcore.grpo.logprobs import token_entropy
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.objective import batch_loss
from trainers.update import update


class EntropyBackend(Capturing):
    """The fake, also giving `token_entropy` as the real backends do (with gradient on request)."""

    def __init__(self):
        super().__init__()
        self.entropy_grad = False
        self.token_entropy = None

    def logprobs_of(self, batch, *, reference=False):
        logits = self.table(batch.input_ids)
        self.token_entropy = token_entropy(logits, grad=self.entropy_grad and torch.is_grad_enabled())
        return super().logprobs_of(batch, reference=reference)


def _entropy_gradient(backend: FakeBackend, batches) -> torch.Tensor:
    """d/dtable of the token-mean entropy over every loss token (computed directly)."""
    table = torch.nn.Embedding(8, 8)
    table.load_state_dict(backend.table.state_dict())
    total, count = 0.0, 0
    for b in batches:
        h = token_entropy(table(b.input_ids), grad=True)
        total = total + h[b.loss_mask.bool()].sum()
        count += int(b.loss_mask.sum())
    (total / count).backward()
    return table.weight.grad


@pytest.mark.parametrize("per_batch", [4, 2])
def test_entropy_bonus_adds_minus_coeff_times_the_entropy_gradient(per_batch):
    rollout, ts, adv = _rollout()
    batches = _batches(ts, adv, per_batch)
    plain = EntropyBackend()
    update(plain, batches, rollout, loss_config=CFG)
    expected_h = _entropy_gradient(EntropyBackend(), batches)  # same initial weights (seed 0)
    bonus = EntropyBackend()
    result = update(
        bonus, batches, rollout, loss_config=LossConfig(beta=0.0, is_mode="none", entropy_coeff=0.3)
    )
    assert bonus.entropy_grad
    torch.testing.assert_close(bonus.grads[0] - plain.grads[0], -0.3 * expected_h)
    assert result.metrics["entropy"] > 0


def test_entropy_bonus_needs_a_backend_that_gives_the_entropy():
    rollout, ts, adv = _rollout()
    with pytest.raises(ValueError, match="--entropy-coeff"):
        update(
            FakeBackend(), _batches(ts, adv, 4), rollout, loss_config=LossConfig(beta=0.0, entropy_coeff=0.1)
        )


@pytest.mark.parametrize("per_batch", [4, 2])
def test_top_entropy_quantile_masks_the_low_entropy_tokens(per_batch):
    rollout, ts, adv = _rollout()
    batches = _batches(ts, adv, per_batch)
    config = LossConfig(beta=0.0, is_mode="none", top_entropy_quantile=0.5)
    backend = EntropyBackend()
    result = update(backend, batches, rollout, loss_config=config)
    # the same gradient by hand: the 0.5 quantile of the twelve loss-token entropies, then the loss
    ref = EntropyBackend()
    hs = []
    with torch.no_grad():
        for b in batches:
            ref.logprobs_of(b)
            hs.append(ref.token_entropy)
    threshold = torch.quantile(torch.cat([h[b.loss_mask.bool()] for h, b in zip(hs, batches)]), 0.5)
    for b, h in zip(batches, hs):
        lp = ref.logprobs_of(b)
        keep = b.loss_mask.bool() & (h >= threshold)
        loss, _ = batch_loss(lp, b, config, num_tokens=12, num_sequences=4, entropy_mask=keep)
        loss.backward()
    torch.testing.assert_close(backend.grads[0], ref.table.weight.grad)
    kept = sum(int((b.loss_mask.bool() & (h >= threshold)).sum()) for b, h in zip(batches, hs))
    assert result.metrics["entropy/masked_fraction"] == pytest.approx(1 - kept / 12)
    assert 0 < result.metrics["entropy/masked_fraction"] < 1
    assert result.metrics["tokens_kept"] == 12.0  # the denominators are unchanged


def test_a_loss_fn_without_the_entropy_arguments_still_works_when_off():
    rollout, ts, adv = _rollout()

    def old_style(lp, batch, config, *, num_tokens, num_sequences, old_logprobs, ref_logprobs, token_mask):
        return batch_loss(
            lp, batch, config, num_tokens=num_tokens, num_sequences=num_sequences,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, token_mask=token_mask,
        )  # fmt: skip

    result = update(EntropyBackend(), _batches(ts, adv, 2), rollout, loss_config=CFG, loss_fn=old_style)
    assert result.metrics["tokens"] == 12.0


def test_several_updates_keep_the_mask_and_differentiate_each_forward():
    # two updates over two micro-batches: the mask is decided once, before the first backward;
    # every update's forward gives its own entropy, so the bonus moves both steps' gradients
    rollout, ts, adv = _rollout()
    batches = _batches(ts, adv, 2)
    runs = {}
    for coeff in (0.0, 0.3):
        backend = EntropyBackend()
        config = LossConfig(beta=0.0, is_mode="none", entropy_coeff=coeff, top_entropy_quantile=0.5)
        result = update(backend, batches, rollout, loss_config=config, updates=2)
        assert result.skipped == 0 and 0 < result.metrics["entropy/masked_fraction"] < 1
        runs[coeff] = backend.grads
    assert len(runs[0.3]) == 2
    for plain, bonus in zip(runs[0.0], runs[0.3]):
        assert not torch.allclose(plain, bonus)
