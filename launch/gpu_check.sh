#!/usr/bin/env bash
# Every GPU-only path one GPU can exercise, in under 10 minutes; prints one JSON line.
#
#     bash launch/gpu_check.sh            # PYTHON=/path/to/venv/bin/python to choose the interpreter
#
# Parts (each with its own time limit, so one hang cannot eat the others' time):
#   megatron  launch/gpu_check/megatron_gpu.py under torchrun (1 GPU): NCCL at DP=1 and the gloo
#             vote group; TP=1 logits against transformers for megatron's local spec (megatron's
#             RoPE) and Transformer Engine's spec when TE is installed; GRPO steps with megatron's
#             DistributedDataParallel + distributed optimizer in bf16 (fp32 main weights) and the
#             colocated MegatronEngine; a NaN step skipped; checkpoint of model + megatron optimizer.
#   vllm      SLOT for the vLLM-on-GPU check (sleep / wake, weight sync): launch/gpu_check/vllm_gpu.py,
#             written separately; it must print one JSON line with an "ok" field. Reported as
#             "not written" while the file does not exist.
#   trainer   launch/train_grpo.py --backend megatron for 2 steps on the GPU: the whole trainer,
#             which reaches megatron's DDP / optimizer once it builds them through
#             interlens_mcore.megatron.training.
#   trainer_lora  the same with --lora-rank 8 --recompute: LoRA adapters on the local spec's
#             parallel linears, only they in megatron's DDP and distributed optimizer, the
#             reference with them off, megatron's full recompute.
# Exit status 0 when every part that exists passed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
export INTERLENS_ASSETS="${INTERLENS_ASSETS:-$(mktemp -d)}"  # the tiny models are built here once
OUT=$(mktemp -d)

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, keep stdout, stderr, status, seconds
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
    echo "$? $((SECONDS - start))" >"$OUT/$name.status"
}

part megatron 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 launch/gpu_check/megatron_gpu.py
if [ -f launch/gpu_check/vllm_gpu.py ]; then
    part vllm 150 "$PY" launch/gpu_check/vllm_gpu.py
fi
part trainer 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 launch/train_grpo.py \
    --backend megatron --steps 2 --output-dir "$OUT/trainer-run"
part trainer_lora 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 launch/train_grpo.py \
    --backend megatron --lora-rank 8 --beta 0.1 --recompute --steps 2 --output-dir "$OUT/trainer_lora-run"

"$PY" - "$OUT" <<'PYEOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
report = {"check": "gpu_check"}
for name in ("megatron", "vllm", "trainer", "trainer_lora"):
    status = out / f"{name}.status"
    if not status.exists():
        report[name] = {"ok": None, "note": "not written (launch/gpu_check/vllm_gpu.py is the slot)"}
        continue
    rc, seconds = (int(x) for x in status.read_text().split())
    lines = (out / f"{name}.out").read_text().strip().splitlines()
    errors = [l for l in (out / f"{name}.err").read_text().strip().splitlines() if l.strip()]
    entry = {"rc": rc, "seconds": seconds, "timed_out": rc in (124, 137)}
    try:
        entry.update(json.loads(lines[-1]))  # the part's own JSON line
    except (IndexError, ValueError):
        entry["ok"] = rc == 0
    if rc != 0:
        entry["ok"] = False
        entry["last_stderr"] = errors[-3:]
    if name.startswith("trainer") and rc == 0:
        metrics = out / f"{name}-run" / "metrics.jsonl"
        entry["steps_logged"] = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    report[name] = entry
report["ok"] = all(v.get("ok") is not False for v in report.values() if isinstance(v, dict))
print(json.dumps(report, default=str))
sys.exit(0 if report["ok"] else 1)
PYEOF
