"""`--lora-rank` from the command line (deepspeed backend, ZeRO-3, 2 ranks under torchrun): 3 steps
train, the start line names the adapters, each checkpoint holds the adapters in peft's layout and
nothing of the base, and a resumed run goes on from them. ZeRO-1 and the backend's own guarantees
(base bit-identical, no reference copy) are tests/multiproc/test_lora_deepspeed.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.launch import ROOT, SMALL, env, metrics, torchrun

pytest.importorskip("peft", reason="LoRA trains with peft, an optional extra: pip install -e .[lora]")

CONVERT = ROOT / "launch" / "convert.py"
# TRL's name for the rank (lora_r), an alpha and a module list
LORA = ["--zero-stage", "3", "--lora_r", "8", "--lora-alpha", "16", "--lora-target-modules", "q_proj,v_proj"]


def test_lora_runs_save_adapters_and_resume(tmp_path):
    out = tmp_path / "run"
    args = ["--backend", "deepspeed", *LORA, "--beta", "0.1", "--lr", "0.02", "--eval-every", "0", *SMALL]
    first = torchrun(*args, "--steps", "2", "--output-dir", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "--lora-rank 8 (command line)" in first.stderr
    step2 = out / "checkpoints" / "step-000002"
    config = json.loads((step2 / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    from safetensors import safe_open

    with safe_open(step2 / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)  # the adapters, no base weight
    rest = torchrun(*args, "--steps", "3", "--resume", "--output-dir", str(out))
    assert rest.returncode == 0, rest.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_megatron_lora_at_tp2_and_pp2_trains_exports_and_converts_the_merged_model(tmp_path, tiny_path):
    out, hf, merged = tmp_path / "run", tmp_path / "hf", tmp_path / "merged"
    lora = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.0"]
    args = ["--backend", "megatron", "--tp", "2", *lora, "--beta", "0.1", "--lr", "0.02", "--eval-every", "0"]
    args += ["--model", str(tiny_path), *SMALL, "--steps", "3", "--output-dir", str(out)]
    run = torchrun(*args, "--export-hf", str(hf))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["grad_norm"] > 0 for r in rows)
    step3 = out / "checkpoints" / "step-000003"
    config = json.loads((step3 / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    # --export-hf: the merged model where from_pretrained finds it, the adapters beside it
    assert (hf / "model.safetensors").is_file() and (hf / "adapter" / "adapter_model.safetensors").is_file()
    # the checkpoint holds the adapters alone: convert.py merges them into their base
    cmd = [sys.executable, str(CONVERT), "--megatron", str(step3), "--hf", str(tmp_path / "no-base")]
    alone = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=ROOT)
    assert alone.returncode == 2 and "holds LoRA adapters alone: add --base MODEL" in alone.stderr
    conv = torchrun("--megatron", str(step3), "--base", str(tiny_path), "--hf", str(merged), script=CONVERT)
    assert conv.returncode == 0, conv.stderr[-3000:]
    from safetensors.torch import load_file

    exported, converted = load_file(hf / "model.safetensors"), load_file(merged / "model.safetensors")
    assert sorted(exported) == sorted(converted)
    assert all(exported[k].equal(converted[k]) for k in exported)  # the same merge, at TP=2 either way
    # --pp 2: the same run through megatron's schedule, a stage a rank; its export a file a stage
    pp_out, pp_hf = tmp_path / "pp2", tmp_path / "pp2_hf"
    pp_args = [a if a != "--tp" else "--pp" for a in args]  # "--tp", "2" -> "--pp", "2"
    pp_args[pp_args.index("--output-dir") + 1] = str(pp_out)
    pp = torchrun(*pp_args, "--export-hf", str(pp_hf))
    assert pp.returncode == 0, pp.stderr[-3000:]
    # steps 0 and 1 agree to float error (seen: 3e-7); by step 2, two Adam steps at lr 2e-2 have
    # turned it into weights ~1e-3 apart (seen: grad norm 6e-4 apart); a wrong gradient is off by lr
    for r, w in zip(metrics(pp_out), rows, strict=True):
        assert r["tokens"] == w["tokens"] and r["reward_mean"] == w["reward_mean"], (r, w)
        rel = 1e-5 if r["step"] < 2 else 3e-3
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=rel), r["step"]
    staged = {}
    for f in sorted(pp_hf.glob("model-*.safetensors")):
        staged.update(load_file(f))
    assert sorted(staged) == sorted(exported)
    assert max(float((staged[k] - exported[k]).abs().max()) for k in exported) < 5e-3  # seen: 1.2e-3
    adapters = load_file(pp_hf / "adapter" / "adapter_model.safetensors")
    assert sorted(adapters) == sorted(load_file(hf / "adapter" / "adapter_model.safetensors"))
