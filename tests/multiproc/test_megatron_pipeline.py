"""Pipeline parallelism through megatron-core's own schedule on gloo ranks: the tiny model split in
two stages (one layer each, the tied embedding on both ends) gives the logprobs, the GRPO loss
and every gradient of the whole model on one rank, and so does TP=2 x PP=2 on four ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.dist import run_ranks
from support.play import engine_turns

# three packed micro-batches of different lengths (megatron sends each activation's shape first)
SAMPLES = [
    [[1, 5, 9, 13, 17, 21, 25, 29, 33], [2, 6, 10, 14, 18]],
    [[3, 7, 11, 15, 19, 23, 27]],
    [[4, 8, 12, 16], [40, 41, 42, 43, 44, 45], [50, 51, 52]],
]


def _batches():
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.types import Trajectory

    out = []
    for rows in SAMPLES:
        trajs = [
            Trajectory(token_ids=ids, loss_mask=[0] * 2 + [1] * (len(ids) - 2), rollout_logprobs=None)
            for ids in rows
        ]
        out.append(build_batch(trajs, [1.0 - 0.7 * k for k in range(len(rows))]))
    return out


def _loss_of(batches):
    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.grpo.loss.objective import batch_loss

    cfg = LossConfig(beta=0.0)
    tokens = float(sum(int(b.loss_mask.sum()) for b in batches))
    sequences = float(sum(len(b.seq_lens) for b in batches))

    def loss_of(i, lp, h):
        return batch_loss(lp, batches[i], cfg, num_tokens=tokens, num_sequences=sequences)[0]

    return loss_of


def _run(rank, world_size, tiny_path, tp, pp, schedule):
    from interlens_mcore import distributed
    from interlens_mcore.megatron import build_model, forward_logits, load_layout, pipeline
    from interlens_mcore.megatron.convert import stage_parameters
    from interlens_mcore.megatron.weights import load_weights

    distributed.init_megatron(tp, pp=pp)
    layout = load_layout(tiny_path)
    model = build_model(layout, init_weights=False)
    load_weights(model, layout, tiny_path)
    batches = _batches()
    loss_of = _loss_of(batches)
    forward = pipeline.run(model, layout, batches)  # forward only: no graph, no gradient
    assert all(p.grad is None for p in model.parameters())
    if schedule:
        trained = pipeline.run(model, layout, batches, loss_of=loss_of)
        loss = float(sum(loss_of(i, lp, None) for i, lp in enumerate(trained)).detach())
    else:  # the plain forward of PP=1, one micro-batch after the other
        from interlens_mcore.grpo.logprobs import token_logprobs

        total = 0.0
        for i, b in enumerate(batches):
            logits = forward_logits(model, layout, b.input_ids, b.cu_seqlens)
            out = loss_of(i, token_logprobs(logits, b.targets[0])[None], None)
            out.backward()
            total += float(out.detach())
        loss, trained = total, forward
    tp_rank = distributed.rank(distributed.megatron_tp_group())
    # numpy arrays travel by value (tensors would go through shared memory the rank unlinks)
    grads = {n: p.grad.numpy().copy() for n, p in stage_parameters(model).items()}
    lps = {
        "forward": [lp.numpy().copy() for lp in forward],
        "trained": [lp.detach().numpy().copy() for lp in trained],
    }
    return {**lps, "loss": loss, "grads": grads, "tp_rank": tp_rank}


@pytest.fixture(scope="module")
def whole(tiny_path):
    """The whole model on one rank, without megatron's schedule."""
    return run_ranks(_run, 1, str(tiny_path), 1, 1, False)[0]


def test_pp1_through_the_schedule_is_the_plain_forward(tiny_path, whole):
    [mine] = run_ranks(_run, 1, str(tiny_path), 1, 1, True)
    for a, b in zip(mine["forward"], whole["forward"]):
        assert np.array_equal(a, b)
    assert mine["loss"] == pytest.approx(whole["loss"], abs=1e-7)
    for name, g in whole["grads"].items():
        assert np.allclose(mine["grads"][name], g, rtol=0, atol=1e-7), name


def test_two_stages_give_the_whole_models_logprobs_loss_and_gradients(tiny_path, whole):
    first, last = run_ranks(_run, 2, str(tiny_path), 1, 2, True)
    for got in (first, last):  # every stage gets the last stage's logprobs
        for a, b in zip(got["forward"], whole["forward"]):
            assert np.allclose(a, b, rtol=0, atol=1e-6)
        for a, b in zip(got["trained"], whole["forward"]):
            assert np.allclose(a, b, rtol=0, atol=1e-6)
        assert got["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert "embedding.word_embeddings.weight" in first["grads"] and "output_layer.weight" in last["grads"]
    assert "decoder.layers.0.mlp.linear_fc2.weight" in first["grads"]
    assert "decoder.layers.1.mlp.linear_fc2.weight" in last["grads"]  # its global name
    assert not set(first["grads"]) & set(last["grads"])
    stages = {**first["grads"], **last["grads"]}
    tied = stages.pop("output_layer.weight")
    assert set(stages) == set(whole["grads"])
    for name, g in whole["grads"].items():
        assert np.allclose(stages[name], g, rtol=0, atol=1e-6), name
    # the tied weight's two copies both carry the whole gradient (embedding + output projection)
    assert np.allclose(tied, whole["grads"]["embedding.word_embeddings.weight"], rtol=0, atol=1e-6)


def test_tp2_by_pp2_on_four_ranks_gives_the_same(tiny_path, whole):
    from interlens_mcore.megatron import load_layout
    from interlens_mcore.megatron.convert import _join, param_map

    ranks = run_ranks(_run, 4, str(tiny_path), 2, 2, True, timeout=240)
    for got in ranks:
        for a, b in zip(got["trained"], whole["forward"]):
            assert np.allclose(a, b, rtol=0, atol=1e-5)
        assert got["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    # megatron's rank order: TP fastest, then PP; join each parameter's two TP shards
    layout = load_layout(tiny_path, tp_size=2)
    rules = {r.megatron: r for r in param_map(layout, set(whole["grads"]))}
    for stage in (ranks[0:2], ranks[2:4]):
        shards = sorted(stage, key=lambda r: r["tp_rank"])
        for name in shards[0]["grads"]:
            if name == "output_layer.weight":
                continue
            joined = _join(rules[name], [torch.from_numpy(s["grads"][name]) for s in shards]).numpy()
            want = whole["grads"][name]
            assert np.allclose(joined, want, rtol=0, atol=1e-5), name


def _generate(rank, world_size, tiny_path, tp, pp):
    from megatron.core import parallel_state as ps

    from interlens_mcore import distributed
    from interlens_mcore.engines.base import GenerationRequest
    from interlens_mcore.megatron import build_model, load_layout
    from interlens_mcore.megatron.engine import MegatronEngine
    from interlens_mcore.megatron.weights import load_weights

    distributed.init_megatron(tp, pp=pp)
    layout = load_layout(tiny_path)
    model = build_model(layout, init_weights=False)
    load_weights(model, layout, tiny_path)
    engine = MegatronEngine(model, layout, group=ps.get_model_parallel_group())
    rows = [
        ([5, 9, 33, 2, 100, 7], 1.0, 11, 12),
        ([1, 2, 3], 0.7, 12, 6),
        ([300, 301], 0.0, 0, 8),
        ([44] * 9, 1.3, 13, 1),
    ]
    reqs = [
        GenerationRequest(
            prompt_ids=p, temperature=t, seed=s, max_new_tokens=n, stop_token_ids=(4, 8), tag=f"r{i}"
        )
        for i, (p, t, s, n) in enumerate(rows)
    ]
    # every rank of the model-parallel group brings the same rows here; each keeps its own share
    mine = reqs if distributed.rank(ps.get_model_parallel_group()) == 0 else []
    # the second turn extends the first: each stage's kept keys/values
    turns = engine_turns(engine, mine, turns=2)
    out = [
        [(g.token_ids, [round(x, 5) for x in g.logprobs], g.finish_reason) for g in gens] for gens in turns
    ]
    return out, engine.reuse.reused_tokens


def test_generation_under_pp2_and_tp2_by_pp2_samples_what_one_rank_samples(tiny_path):
    [(whole, _)] = run_ranks(_generate, 1, str(tiny_path), 1, 1)
    assert any(len(ids) > 1 for ids, _, _ in whole[0])
    for tp, pp in ((1, 2), (2, 2)):
        ranks = run_ranks(_generate, tp * pp, str(tiny_path), tp, pp, timeout=240)
        got, reused = ranks[0]
        assert [[(ids, reason) for ids, _, reason in turn] for turn in got] == [
            [(ids, reason) for ids, _, reason in turn] for turn in whole
        ]
        for turn, want in zip(got, whole):
            for (_, lp, _), (_, lp_want, _) in zip(turn, want):
                assert lp == pytest.approx(lp_want, abs=1e-4)
        assert reused > 0  # the second turn's prefixes came from each stage's kept keys/values
        assert all(r[0] == [[], []] for r in ranks[1:])  # the other ranks brought no rows


def _checkpoint(rank, world_size, tiny_path, pp, folder, save):
    """save: one Adam step through the pipeline, then the sharded checkpoint; else: load it."""
    from interlens_mcore import distributed
    from interlens_mcore.megatron import build_model, load_layout, pipeline
    from interlens_mcore.megatron import checkpoint as megatron_checkpoint
    from interlens_mcore.megatron.convert import stage_parameters
    from interlens_mcore.megatron.weights import load_weights

    distributed.init_megatron(1, pp=pp)
    layout = load_layout(tiny_path)
    model = build_model(layout, init_weights=False)
    load_weights(model, layout, tiny_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if save:
        batches = _batches()
        pipeline.run(model, layout, batches, loss_of=_loss_of(batches))
        optimizer.step()
        megatron_checkpoint.save(folder, model, layout, optimizer)
    else:
        megatron_checkpoint.load(folder, model, layout, optimizer)
    params = stage_parameters(model)
    return {
        n: (p.detach().numpy().copy(), optimizer.state[p]["exp_avg"].numpy().copy())
        for n, p in params.items()
    }


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 1), (1, 2)])
def test_a_checkpoint_reshards_across_pipeline_sizes(tiny_path, tmp_path, saved_at, loaded_at):
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(_checkpoint, saved_at, str(tiny_path), saved_at, folder, True)
    loaded = run_ranks(_checkpoint, loaded_at, str(tiny_path), loaded_at, folder, False)
    want = {k: v for r in saved for k, v in r.items()}
    got = {k: v for r in loaded for k, v in r.items()}
    assert set(got) - {"output_layer.weight"} == set(want) - {"output_layer.weight"}
    for name, (weight, moment) in got.items():
        source = want.get(name, want["embedding.word_embeddings.weight"])  # a tied copy: the embedding
        assert np.array_equal(weight, source[0]) and np.array_equal(moment, source[1]), name
    assert np.abs(want["decoder.layers.1.mlp.linear_fc2.weight"][1]).max() > 0  # a step was taken
    if "output_layer.weight" in want:  # saved at PP=2: the tied copies stepped alike
        tied, embedding = want["output_layer.weight"], want["embedding.word_embeddings.weight"]
        assert np.array_equal(tied[0], embedding[0]) and np.array_equal(tied[1], embedding[1])


def _export(rank, world_size, tiny_path, tp, pp, out):
    from interlens_mcore import distributed
    from interlens_mcore.megatron import build_model, export_hf, load_layout
    from interlens_mcore.megatron.weights import load_weights

    distributed.init_megatron(tp, pp=pp)
    layout = load_layout(tiny_path)
    model = build_model(layout, init_weights=False)
    load_weights(model, layout, tiny_path)
    export_hf(model, layout, tiny_path, out)
    from interlens_mcore.engines.weight_sync import megatron_hf_tensors

    # what a colocated vLLM loads at each sync: the whole model on every rank, in stream order
    return [(name, t.numpy().copy()) for name, t in megatron_hf_tensors(model, layout)]


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)])
def test_export_under_pp_writes_a_stage_a_file_with_the_hf_tensors(tiny_path, tmp_path, tp, pp):
    """And the weight stream a colocated vLLM loads gives every rank every HF tensor once."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")  # replaced, not left to shadow the index
    streams = run_ranks(_export, tp * pp, str(tiny_path), tp, pp, str(out))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = {}
    for f in tiny_path.glob("*.safetensors"):
        source.update(load_file(f))
    got = {name: load_file(out / file)[name] for name, file in index["weight_map"].items()}
    assert set(got) == set(source)
    for name, tensor in source.items():
        assert torch.equal(got[name], tensor), name  # bit for bit: nothing trained
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert (out / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in got.items())
    for rank in range(tp * pp):
        names = [name for name, _ in streams[rank]]
        assert sorted(names) == sorted(source), rank  # each name once: the tied embedding too
        assert all(torch.equal(torch.from_numpy(t), source[name]) for name, t in streams[rank]), rank
