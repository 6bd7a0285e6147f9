"""The megatron backend's step forwards project only the trained positions (`trained_only`, set
by trainers.update): the same logprobs, entropy and gradients there as the whole projection, 0
elsewhere, and the output layer really sees fewer rows. TP=1 (DP=2) and TP=2 on 2 gloo ranks."""

from __future__ import annotations

from support.dist import run_ranks

TOKENS = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 33, 9, 70, 71, 72, 300]
# a prompt, a trained reply, an untrained answer, a second trained reply, an untrained tail
MASK = [0] * 5 + [1] * 4 + [0] * 3 + [1] * 2 + [0] * 2


def _job(rank, world_size, tiny_path: str):
    from megatron.core import parallel_state

    from interlens_mcore import distributed
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.types import Trajectory
    from trainers.backends.megatron import MegatronBackend

    batch = build_batch(
        [
            Trajectory(token_ids=TOKENS, loss_mask=MASK, rollout_logprobs=None),
            Trajectory(token_ids=TOKENS[:10], loss_mask=MASK[:10], rollout_logprobs=None),
        ],
        [1.0, -0.5],
    )
    out = {}
    for tp in (1, 2):
        distributed.init_megatron(tp)
        groups = distributed.build_groups(rollout="model_parallel")
        backend = MegatronBackend(model_path=tiny_path, groups=groups, lr=1e-2)
        rows_seen = []
        backend.model.output_layer.register_forward_hook(  # the logits it made: [rows, 1, V / tp]
            lambda module, args, output, seen=rows_seen: seen.append(int(output[0].shape[0]))
        )
        got = {}
        for only in (False, True):
            backend.trained_only = only
            lp = backend.logprobs_of(batch)
            h = backend.token_entropy
            loss = -(lp * batch.advantages * batch.loss_mask).sum() / batch.loss_mask.sum()
            backend.backward(loss)
            grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
            backend.model.zero_grad(set_to_none=True)
            got[only] = (lp.detach()[0], h[0].detach(), grads)
        (lp0, h0, g0), (lp1, h1, g1) = got[False], got[True]
        kept = batch.loss_mask[0]
        out[tp] = {
            "rows_seen": rows_seen,
            "trained": int(kept.sum()),
            "tokens": int(kept.numel()),
            "lp_diff": float((lp0[kept] - lp1[kept]).abs().max()),
            "h_diff": float((h0[kept] - h1[kept]).abs().max()),
            "zero_elsewhere": bool((lp1[~kept] == 0).all() and (h1[~kept] == 0).all()),
            "same_names": sorted(g0) == sorted(g1) and len(g0) > 0,
            "grad_diff": max(float((g0[k] - g1[k]).abs().max()) for k in g0),
            "max_grad": max(float(g.abs().max()) for g in g0.values()),
        }
        del backend
        parallel_state.destroy_model_parallel()
    return out


def test_trained_positions_only_give_the_same_step(tiny_path):
    for r in run_ranks(_job, 2, str(tiny_path), timeout=300):
        for tp in (1, 2):
            f = r[tp]
            assert f["trained"] == (4 + 2) + 4 and f["tokens"] == 16 + 10, f  # both samples' replies
            # the whole row, then only the trained positions: the projection really shrank
            assert f["rows_seen"] == [f["tokens"], f["trained"]], f
            assert f["lp_diff"] < 1e-5 and f["h_diff"] < 1e-5, f
            assert f["zero_elsewhere"], f
            assert f["same_names"] and f["max_grad"] > 0, f
            assert f["grad_diff"] < 1e-6, f
