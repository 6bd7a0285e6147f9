"""HF <-> megatron-core weights for tiny Llama and Qwen2 models, at TP=1 and TP=2 on gloo ranks.

One 2-rank job does the distributed work (megatron is initialised with TP=1, i.e. DP=2, then
with TP=2) and returns measurements; the tests below assert on them. The Llama model is
untied with a vocabulary of 515, so TP=2 pads it to 516 and the padded row is exercised.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.dist import run_ranks
from support.launch import env, torchrun

from interlens_mcore.assets import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONVERT = ROOT / "launch" / "convert.py"
SEQS = [[5, 9, 33, 2, 100, 7], [1, 2, 3], [44, 45, 46, 47, 48, 49, 50, 51, 300, 511]]


def _full_logits(model, layout, ids, cu=None):
    """Vocab-sharded logits gathered over the TP group, padding cut: [..., V]."""
    from interlens_mcore import distributed
    from interlens_mcore.megatron import forward_logits

    shard = forward_logits(model, layout, ids, cu)
    full = torch.cat(distributed.all_gather_tensor(shard, distributed.megatron_tp_group()), dim=-1)
    return full[..., : layout.vocab_size]


@torch.no_grad()
def _logit_diffs(model, layout, path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model.eval()
    ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in SEQS])  # [T, V]
    cu = torch.tensor([0, 6, 9, 19], dtype=torch.int32)
    packed = _full_logits(model, layout, torch.tensor([sum(SEQS, [])]), cu)  # [T, V]
    batch = torch.tensor([SEQS[0], SEQS[2][:6]])  # unpacked [B, T] path, no padding
    unpacked = _full_logits(model, layout, batch)  # [B, T, V]
    return {
        "packed": float((packed - ref).abs().max()),
        "unpacked": float((unpacked - hf(batch).logits).abs().max()),
        "scale": float(ref.abs().max()),
    }


def _grad_diff(model, layout, path, tp_rank: int) -> float:
    """Max |grad| difference of layer 0's MLP down projection under a next-token loss vs HF."""
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from interlens_mcore.megatron import forward_logits

    model.train()
    labels = torch.tensor([t for s in SEQS for t in s[1:] + [0]])  # [T] (last label per sequence: 0)
    cu = torch.tensor([0, 6, 9, 19], dtype=torch.int32)
    logits = forward_logits(model, layout, torch.tensor([sum(SEQS, [])]), cu)  # [T, V_pad / tp]
    # padded vocabulary entries are -inf: they add nothing to the vocab-parallel softmax
    tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], labels[:, None]).mean().backward()
    hf = AutoModelForCausalLM.from_pretrained(path)
    hf_logits = torch.cat([hf(torch.tensor([s])).logits[0] for s in SEQS])
    torch.nn.functional.cross_entropy(hf_logits, labels).backward()
    want = hf.model.layers[0].mlp.down_proj.weight.grad.chunk(layout.tp_size, dim=1)[tp_rank]
    return float((model.decoder.layers[0].mlp.linear_fc2.weight.grad - want).abs().max())


def _convert_job(rank, world_size, paths: dict[str, str], out_dir: str):
    from megatron.core import parallel_state

    from interlens_mcore.megatron import build_model, export_hf, load_hf_weights, load_layout

    results: dict = {"logits": {}, "reimport_equal": {}, "grad_diff": {}}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            for family, path in paths.items():
                layout = load_layout(path)
                model = build_model(layout, init_weights=False)
                load_hf_weights(model, layout, path)
                results["logits"][family, tp] = _logit_diffs(model, layout, path)
                if tp == 2:
                    results["grad_diff"][family] = _grad_diff(model, layout, path, rank)
                    exported = export_hf(model, layout, path, Path(out_dir) / family)
                    fresh = build_model(layout)  # randomly initialised, then overwritten
                    load_hf_weights(fresh, layout, exported)
                    pairs = zip(model.named_parameters(), fresh.named_parameters(), strict=True)
                    results["reimport_equal"][family] = all(
                        na == nb and torch.equal(a, b) for (na, a), (nb, b) in pairs
                    )
        finally:
            parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def tiny_llama_path():
    # cached in the asset dir; a larger init than the default makes the logits O(1)
    return ensure_tiny_model(arch="llama", vocab_size=515, tie_word_embeddings=False, initializer_range=0.1)


@pytest.fixture(scope="module")
def converted(tiny_path, tiny_llama_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("exported")
    paths = {"qwen2": str(tiny_path), "llama": str(tiny_llama_path)}
    results = run_ranks(_convert_job, 2, paths, str(out_dir), timeout=180)
    return results, paths, out_dir


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_logits_equal_hf(converted, family, tp):
    results, _, _ = converted
    for rank_result in results:
        diffs = rank_result["logits"][family, tp]
        assert diffs["scale"] > 1.0  # the comparison is not between near-zero logits
        # float32 rounding only. Measured max |diff| / max |logit|: TP=1 3.9e-6 / 4.2 (packed;
        # unpacked is bit-exact), TP=2 3.8e-6 / 4.2 (Llama); Qwen2 about 5e-7 / 1.3
        assert diffs["packed"] < 1e-5 * diffs["scale"], diffs
        assert diffs["unpacked"] < 1e-5 * diffs["scale"], diffs


def test_training_gradients_equal_hf_at_tp2(converted):
    results, _, _ = converted
    for rank_result in results:
        for family, diff in rank_result["grad_diff"].items():
            assert diff < 1e-5, (family, diff)  # measured about 2e-7 on gradients of scale 0.2


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_round_trips_every_tensor(converted, family):
    from safetensors.torch import load_file

    results, paths, out_dir = converted
    assert all(r["reimport_equal"][family] for r in results)  # HF -> TP=2 -> HF -> TP=2
    source = load_file(Path(paths[family]) / "model.safetensors")
    exported = load_file(out_dir / family / "model.safetensors")
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_exported_folder_loads_with_from_pretrained(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, paths, out_dir = converted
    tokenizer = AutoTokenizer.from_pretrained(out_dir / "llama")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(paths["llama"]).chat_template
    ids = torch.tensor([tokenizer("My guess is 42.")["input_ids"]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out_dir / "llama")(ids).logits
        want = AutoModelForCausalLM.from_pretrained(paths["llama"])(ids).logits
    assert torch.equal(got, want)


def test_qkv_and_glu_layouts_on_a_worked_example():
    from transformers import LlamaConfig

    from interlens_mcore.megatron.convert import ParamRule, _fuse, _join, _split, _unfuse
    from interlens_mcore.megatron.model import layout_from_hf_config

    cfg = LlamaConfig(
        hidden_size=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=1,
        vocab_size=8,
        intermediate_size=2,
    )
    layout = layout_from_hf_config(cfg, tp_size=2)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    rule = ParamRule("qkv", ("q", "k", "v"), "qkv", "rows")
    fused = _fuse(rule, layout, [q, k, v])
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1; TP=2 gives each rank one whole group
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [s.flatten().tolist() for s in _split(rule, fused, 2)] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    assert all(torch.equal(a, b) for a, b in zip(_unfuse(rule, layout, fused), [q, k, v], strict=True))

    glu = ParamRule("fc1", ("gate", "up"), "glu", "glu_rows")
    gate, up = torch.tensor([[0.0], [1]]), torch.tensor([[10.0], [11]])
    shards = _split(glu, _fuse(glu, layout, [gate, up]), 2)
    assert [s.flatten().tolist() for s in shards] == [[0, 10], [1, 11]]  # rank r: [gate_r; up_r]
    assert _join(glu, shards).flatten().tolist() == [0, 1, 10, 11]


def test_another_family_is_rejected():
    from transformers import GPT2Config

    from interlens_mcore.megatron import layout_from_hf_config

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        layout_from_hf_config(GPT2Config(), tp_size=1)


def test_tp_size_must_divide_heads_and_kv_heads():
    from transformers import Qwen2Config

    from interlens_mcore.megatron import layout_from_hf_config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    assert layout_from_hf_config(cfg, tp_size=2).padded_vocab_size == cfg.vocab_size
    with pytest.raises(ValueError, match="TP size 3 does not divide num_attention_heads=4"):
        layout_from_hf_config(cfg, tp_size=3)
    with pytest.raises(ValueError, match="TP size 4 does not divide num_key_value_heads=2"):
        layout_from_hf_config(cfg, tp_size=4)


# ---- conversion without training: HF folder <-> sharded megatron checkpoint ----


def _bf16_llama(tiny_path, out: Path) -> Path:
    """A tied Llama of our own config, stored in bfloat16 (as released checkpoints are)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _round_trip_job(rank, world_size, paths: dict[str, str], out_dir: str):
    """Each family: HF -> megatron at TP=2 -> HF at TP=1, and HF -> megatron at TP=1 -> HF at TP=2."""
    from megatron.core import parallel_state

    from interlens_mcore.megatron import hf_to_megatron, is_megatron_checkpoint, load_model, megatron_to_hf

    out, results = Path(out_dir), {"same_params": {}, "is_megatron": {}}

    def at_tp(tp: int, work) -> None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            for family, path in paths.items():
                work(family, Path(path))
        finally:
            parallel_state.destroy_model_parallel()

    def tp1(family: str, path: Path) -> None:
        hf_to_megatron(path, out / f"{family}-mg1")
        megatron_to_hf(out / f"{family}-mg2", out / f"{family}-hf-from-tp2")
        # the megatron folder gives the same model as the HF folder it came from
        a, _ = load_model(out / f"{family}-mg1")
        b, _ = load_model(path)
        pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
        results["same_params"][family] = all(na == nb and torch.equal(x, y) for (na, x), (nb, y) in pairs)
        results["is_megatron"][family] = (
            is_megatron_checkpoint(out / f"{family}-mg1"),
            is_megatron_checkpoint(path),
        )

    at_tp(2, lambda family, path: hf_to_megatron(path, out / f"{family}-mg2"))
    at_tp(1, tp1)
    at_tp(2, lambda family, path: megatron_to_hf(out / f"{family}-mg1", out / f"{family}-hf-from-tp1"))
    return results


@pytest.fixture(scope="module")
def round_trips(tiny_path, tiny_llama_path, tmp_path_factory):
    bf16 = _bf16_llama(tiny_path, tmp_path_factory.mktemp("assets") / "llama-bf16")
    paths = {"qwen2": str(tiny_path), "llama": str(tiny_llama_path), "llama-bf16": str(bf16)}
    out = tmp_path_factory.mktemp("round-trips")
    return run_ranks(_round_trip_job, 2, paths, str(out), timeout=240), paths, out


def _assert_same_safetensors(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name


@pytest.mark.parametrize("saved_tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-bf16"])
def test_hf_megatron_hf_is_bit_identical_across_tp_sizes(round_trips, family, saved_tp):
    results, paths, out = round_trips
    # saved at TP=2 and read back at TP=1, or saved at TP=1 and read back at TP=2
    _assert_same_safetensors(Path(paths[family]), out / f"{family}-hf-from-tp{saved_tp}")


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-bf16"])
def test_load_model_takes_either_form(round_trips, family):
    results, paths, out = round_trips
    assert all(r["same_params"][family] for r in results)
    assert all(r["is_megatron"][family] == (True, False) for r in results)
    files = sorted(p.name for p in (out / f"{family}-mg2").iterdir())
    # the HF config and tokenizer travel with the weights, so AutoTokenizer reads the folder
    assert {"config.json", "megatron.json", "tokenizer.json", "weights"} <= set(files)
    assert "model.safetensors" not in files


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(*args, nproc=nproc, script=CONVERT)


def _env() -> dict:
    return env(PYTHONPATH=str(ROOT))


def test_convert_script_round_trip_at_tp2_then_tp1(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    src = _bf16_llama(tiny_path, tmp_path / "src")
    there = _torchrun(2, "--hf", str(src), "--megatron", str(tmp_path / "mg"), "--tp", "2")
    assert there.returncode == 0, there.stderr[-3000:]
    assert (tmp_path / "mg" / "manifest.json").is_file()
    back = _torchrun(1, "--megatron", str(tmp_path / "mg"), "--hf", str(tmp_path / "hf"))
    assert back.returncode == 0, back.stderr[-3000:]
    _assert_same_safetensors(src, tmp_path / "hf")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
    # the written checkpoint is checked before it is read: a flipped byte is refused by name
    blob = next((tmp_path / "mg" / "weights").glob("*.distcp"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    bad = _run_convert("--megatron", str(tmp_path / "mg"), "--hf", str(tmp_path / "hf2"))
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        f"convert.py: error: --megatron {tmp_path / 'mg'}: corrupt checkpoint "
        f"(weights/{blob.name}: sha256 mismatch)"
    )
    assert not (tmp_path / "hf2").exists()


def _run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CONVERT), *args], capture_output=True, text=True, timeout=120, env=_env()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--hf", "{tmp}/absent", "--megatron", "{tmp}/out"],
            "--hf {tmp}/absent and --megatron {tmp}/out: neither exists, so there is no input",
        ),
        (
            ["--hf", "{tiny}", "--megatron", "{tiny}"],
            "--hf {tiny} and --megatron {tiny} both hold files; one must be the output",
        ),
        (
            ["--hf", "{tiny}", "--megatron", "{tmp}/out", "--tp", "3"],
            "--tp 3 does not divide the number of processes 1",
        ),
        (
            ["--hf", "{tmp}/notes", "--megatron", "{tmp}/out"],
            "--hf {tmp}/notes: not an HF folder (no config.json)",
        ),
        (
            ["--megatron", "{tmp}/notes", "--hf", "{tmp}/out"],
            "--megatron {tmp}/notes: not a sharded megatron checkpoint (no megatron.json and weights/)",
        ),
        (["--hf", "{tiny}"], "the following arguments are required: --megatron"),
    ],
)
def test_convert_script_bad_input_is_one_line_naming_the_flag(tiny_path, tmp_path, args, message):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("not a model")
    fill = {"tmp": str(tmp_path), "tiny": str(tiny_path)}
    result = _run_convert(*[a.format(**fill) for a in args])
    assert result.returncode == 2
    assert result.stderr == f"convert.py: error: {message.format(**fill)}\n"
    assert not (tmp_path / "out").exists()


def test_convert_script_refuses_a_tp_that_does_not_divide_the_heads(tiny_path, tmp_path):
    env = {**_env(), "WORLD_SIZE": "4"}  # as torchrun would set it for 4 processes
    cmd = [
        sys.executable,
        str(CONVERT),
        "--hf",
        str(tiny_path),
        "--megatron",
        str(tmp_path / "o"),
        "--tp",
        "4",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr == (
        f"convert.py: error: --tp 4 does not divide num_key_value_heads=2 of the model in --hf {tiny_path}\n"
    )
