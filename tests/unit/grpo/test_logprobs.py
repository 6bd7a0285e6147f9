import math

import pytest
import torch
from support.dist import run_ranks

from interlens_mcore.grpo.logprobs import (
    token_entropy,
    token_logprobs,
    vocab_parallel_token_entropy,
    vocab_parallel_token_logprobs,
)


def test_token_logprobs_hand_values():
    # Row 0: logits [0, ln 3] -> softmax [1/4, 3/4]; target 1 -> ln 0.75.
    # Row 1: same logits at temperature 2 -> [0, ln 3 / 2] -> weights [1, sqrt 3];
    #        target 0 -> ln(1 / (1 + sqrt 3)).
    logits = torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)]])
    out = token_logprobs(logits[:1], torch.tensor([1]))
    assert out.item() == pytest.approx(math.log(0.75), abs=1e-6)
    out = token_logprobs(logits[1:], torch.tensor([0]), temperature=2.0)
    assert out.item() == pytest.approx(-math.log(1 + math.sqrt(3)), abs=1e-6)


def test_token_logprobs_matches_log_softmax_with_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, targets, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, ref)
    (g,) = torch.autograd.grad(out.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g, g_ref)


def test_entropy_hand_values():
    # uniform over 4 ids: ln 4; [0, ln 3] -> [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4); a certain id: 0,
    # and a column of probability 0 (-inf) adds nothing
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -math.inf, -math.inf]])
    expected = [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert token_entropy(logits).tolist() == pytest.approx(expected, abs=1e-6)
    assert vocab_parallel_token_entropy(logits).tolist() == pytest.approx(expected, abs=1e-6)
    assert token_entropy(torch.tensor([[50.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    # temperature 2 halves the logits: [0, ln 3 / 2] -> weights [1, sqrt 3]
    p = 1 / (1 + math.sqrt(3))
    halved = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert token_entropy(logits[1:, :2], temperature=2.0).item() == pytest.approx(halved, abs=1e-6)


def test_vocab_parallel_on_one_rank_is_full_vocabulary():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 9)
    targets = torch.randint(0, 9, (3, 4))
    torch.testing.assert_close(
        vocab_parallel_token_logprobs(logits, targets, vocab_start=0, temperature=1.3),
        token_logprobs(logits, targets, temperature=1.3),
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(logits=torch.zeros(2, 3), targets=torch.zeros(3, dtype=torch.long)), "logits"),
        (dict(logits=torch.zeros(2, 3), targets=torch.zeros(2)), "targets"),
        (dict(logits=torch.zeros(2, 3), targets=torch.tensor([0, 3])), "targets"),
        (dict(logits=torch.zeros(2, 3), targets=torch.tensor([0, 1]), temperature=0.0), "temperature"),
    ],
)
def test_token_logprobs_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        token_logprobs(**kwargs)


def test_vocab_parallel_bad_vocab_start():
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_token_logprobs(torch.zeros(2, 3), torch.tensor([0, 1]), vocab_start=-1)


@pytest.mark.parametrize("bad", [-1, 9])
def test_vocab_parallel_range_checks_targets_on_one_rank(bad):
    # One rank (group None) holds the whole vocabulary of 9 columns: ids must lie in [0, 9).
    targets = torch.tensor([[0, 8], [bad, 1]])
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 9\)"):
        vocab_parallel_token_logprobs(torch.zeros(2, 2, 9), targets, vocab_start=0)


def _range_worker(rank, world_size, bad):
    import torch.distributed as dist

    # Two shards of 5 columns: the vocabulary is 10, so id 9 (last column of rank 1) is valid.
    shard = torch.zeros(2, 5)
    ok = vocab_parallel_token_logprobs(
        shard, torch.tensor([0, 9]), vocab_start=rank * 5, group=dist.group.WORLD
    )
    try:
        vocab_parallel_token_logprobs(
            shard, torch.tensor([0, bad]), vocab_start=rank * 5, group=dist.group.WORLD
        )
    except ValueError as exc:
        return ok.tolist(), str(exc)
    return ok.tolist(), None


@pytest.mark.parametrize("bad", [10, -2])
def test_vocab_parallel_range_checks_targets_on_two_ranks(bad):
    # Without the check, id 10 is owned by no rank and would silently score logit 0 (ln 1/10 here);
    # both ranks must raise, together, so neither waits in a collective for the other.
    results = run_ranks(_range_worker, 2, bad, timeout=120)
    for ok, error in results:
        assert ok == pytest.approx([math.log(0.1)] * 2)  # uniform logits over 10 ids
        assert error is not None and "targets must lie in [0, 10)" in error


def _tp2_worker(rank, world_size, temperature):
    import torch
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        torch.manual_seed(0)  # same full logits and targets on both ranks
        vocab, shard = 10, 5
        full = torch.randn(4, 3, vocab) * 3  # [S, B, V], megatron's layout
        targets = torch.randint(0, vocab, (4, 3))
        targets[0, 0], targets[0, 1] = 0, vocab - 1  # both shard edges
        upstream = torch.randn(4, 3)  # the same loss weights on both ranks, like a replicated loss

        local = full[..., rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
        ours = vocab_parallel_token_logprobs(
            local, targets, vocab_start=rank * shard, temperature=temperature, group=group
        )
        (ours * upstream).sum().backward()

        mega_in = (full[..., rank * shard : (rank + 1) * shard] / temperature).clone().requires_grad_(True)
        mega = -tensor_parallel.vocab_parallel_cross_entropy(mega_in.clone(), targets)
        (mega * upstream).sum().backward()
        # d/d(logits) = d/d(logits / T) / T
        mega_grad = mega_in.grad / temperature

        full_req = full.clone().requires_grad_(True)
        ref = torch.log_softmax(full_req / temperature, -1).gather(-1, targets[..., None])[..., 0]
        (ref * upstream).sum().backward()
        ref_grad = full_req.grad[..., rank * shard : (rank + 1) * shard]
        # the entropy from the shards is the full vocabulary's, on both ranks
        entropy = vocab_parallel_token_entropy(local, temperature=temperature, group=group)
        full_entropy = token_entropy(full, temperature=temperature)
        grads = (local.grad, mega_grad, ref_grad)
        return ours.detach(), mega.detach(), ref.detach(), *grads, entropy, full_entropy
    finally:
        parallel_state.destroy_model_parallel()


def test_vocab_parallel_tp2_matches_full_and_megatron():
    results = run_ranks(_tp2_worker, 2, 0.8, timeout=120)
    for ours, mega, ref, grad, mega_grad, ref_grad, entropy, full_entropy in results:
        torch.testing.assert_close(entropy, full_entropy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, mega, rtol=1e-5, atol=1e-5)
        # The shard's gradient is its slice of the full-vocabulary gradient (not TP times it).
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, mega_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0])  # replicated over the TP group


def test_entropy_gradient_is_the_hand_formula():
    # dH/dlogits = -p (x - E_p[x]) / T with x = logits / T; a -inf column gets 0, not NaN
    torch.manual_seed(1)
    logits = torch.randn(3, 6) * 2
    logits[0, 2] = -math.inf
    logits.requires_grad_(True)
    h = token_entropy(logits, temperature=0.5, grad=True)
    torch.testing.assert_close(h, token_entropy(logits, temperature=0.5))
    weights = torch.tensor([1.0, -2.0, 0.5])
    (g,) = torch.autograd.grad((h * weights).sum(), logits)
    x = logits.detach() / 0.5
    p = torch.softmax(x, -1)
    mean = torch.where(p > 0, p * x, 0.0).sum(-1, keepdim=True)
    expected = -p * torch.where(p > 0, x - mean, 0.0) / 0.5 * weights[:, None]
    assert torch.isfinite(g).all() and g[0, 2] == 0
    torch.testing.assert_close(g, expected)
    assert not token_entropy(logits).requires_grad  # the default stays gradient-free


def _tp2_entropy_worker(rank, world_size, temperature):
    import torch
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        torch.manual_seed(0)  # same full logits on both ranks
        vocab, shard = 10, 5
        full = torch.randn(4, 3, vocab) * 3
        full[1, 1, 7] = -math.inf  # a masked column on rank 1's shard
        upstream = torch.randn(4, 3)  # the same loss weights on both ranks, like a replicated loss
        local = full[..., rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
        ours = vocab_parallel_token_entropy(local, temperature=temperature, group=group, grad=True)
        (ours * upstream).sum().backward()
        full_req = full.clone().requires_grad_(True)
        ref = token_entropy(full_req, temperature=temperature, grad=True)
        (ref * upstream).sum().backward()
        return ours.detach(), ref.detach(), local.grad, full_req.grad[..., rank * shard : (rank + 1) * shard]
    finally:
        parallel_state.destroy_model_parallel()


def test_vocab_parallel_entropy_gradient_tp2_matches_full():
    results = run_ranks(_tp2_entropy_worker, 2, 0.8, timeout=120)
    for ours, ref, grad, ref_grad in results:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        # the shard's gradient is its slice of the full-vocabulary gradient (not TP times it)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0])
