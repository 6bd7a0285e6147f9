"""The memory benchmark at a tiny size: LoRA with a reference keeps one model in memory, on both
backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # two DeepSpeed starts in processes of their own: about a minute
def test_bench_memory_counts_one_model_for_lora_with_a_reference():
    pytest.importorskip("peft", reason="LoRA trains with peft, an optional extra: pip install -e .[lora]")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_memory.py"),
        *("--models", "tiny", "--configs", "deepspeed-full-ref,deepspeed-lora-ref,megatron-lora-ref"),
        *("--samples", "2", "--tokens", "16", "--micro-batch-size", "1", "--threads", "1", "--json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["results"]["tiny"]
    full_ref, lora_ref = got["deepspeed-full-ref"], got["deepspeed-lora-ref"]
    assert "error" not in full_ref and "error" not in lora_ref, got
    base = full_ref["params_trained"]  # full fine-tuning trains every base parameter
    assert full_ref["params_alive"] == 2 * base  # the policy and its reference copy
    assert lora_ref["params_alive"] == base + lora_ref["params_trained"]  # no reference copy
    assert 0 < lora_ref["params_trained"] < base / 5
    megatron_lora = got["megatron-lora-ref"]  # the same on the megatron backend's own adapters
    assert "error" not in megatron_lora, got
    assert megatron_lora["params_alive"] == base + megatron_lora["params_trained"]
    assert 0 < megatron_lora["params_trained"] < base / 5
    assert all(r["peak_mb"] >= r["resident_built_mb"] > 0 for r in got.values())
