#!/usr/bin/env bash
# Run every benchmark, write benchmarks/results/*.json, PNG plots and benchmarks/RESULTS.md.
#
#   bash launch/bench_all.sh
#
# Knobs (environment variables, defaults sized for ~10-15 minutes on 2 CPU cores):
#   ROLLOUT_CONVS=8,32,128 ROLLOUT_NEW=16 SEQ_SAMPLE=8   rollout throughput
#   TURNS=2,4,8,16 TURNS_CONVS=32 TURNS_NEW=16 REPEATS=3  key/value reuse vs re-encoding
#   GROWTH_CONVS=1,4,16,64,256 GROWTH_TURNS=1,2,4,8,16 GROWTH_NEW=8
#   TRAIN_STEPS=4 TRAIN_BATCH=16 TRAIN_TIMEOUT=240                          training-step breakdown (2 ranks)
#   TURNS_MODEL=tiny (or smollm2)                         the same through MegatronEngine
#   MEMORY_MODELS=tiny,smollm2                            memory of one step, full vs LoRA
#   TENSORS_TRAJ=256                                      packed vs padded tensors
#   OVERLAP_MS=0,100,500                                  environment latency, with and without overlap
#   SOAK_RUNS=200                                         randomised fault soak (2 ranks)
#   TRL_VERSION=1.16.0 (empty: skip installing TRL) TRL_STEPS=12   peer comparison
#   LEARNING=1 LEARNING_STEPS=30                          learning side by side with TRL (SmolLM2;
#                                                         about 35 minutes, so off unless asked for)
#   (engines: run when .venv-vllm exists, which .ci/vllm_stage.sh --build makes)
#   RESUME=1: skip every benchmark whose JSON is already in benchmarks/results
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

# the last stdout line of every benchmark is its JSON object
last() { tail -n 1; }
step() { echo "[bench_all $(( $(date +%s) - start ))s] $*" >&2; }
# with RESUME=1, a benchmark whose non-empty JSON exists is not run again
todo() { [ -z "${RESUME:-}" ] || [ ! -s "$OUT/$1.json" ]; }

step rollout
todo rollout && python benchmarks/bench_rollout.py --json --conversations "${ROLLOUT_CONVS:-8,32,128}" \
    --max-new-tokens "${ROLLOUT_NEW:-16}" --sequential-sample "${SEQ_SAMPLE:-8}" | last > "$OUT/rollout.json"
step turns
todo turns && python benchmarks/bench_turns.py --json --turns "${TURNS:-2,4,8,16}" --conversations "${TURNS_CONVS:-32}" \
    --max-new-tokens "${TURNS_NEW:-16}" --repeats "${REPEATS:-3}" | last > "$OUT/turns.json"
step turns_megatron
todo turns_megatron && python benchmarks/bench_turns.py --json --engine megatron --model "${TURNS_MODEL:-tiny}" \
    --turns "${TURNS:-2,4,8,16}" --conversations "${TURNS_CONVS:-32}" --max-new-tokens "${TURNS_NEW:-16}" \
    --repeats "${REPEATS:-3}" | last > "$OUT/turns_megatron.json"
step memory
todo memory && python benchmarks/bench_memory.py --json --models "${MEMORY_MODELS:-tiny,smollm2}" | last > "$OUT/memory.json"
step tensors
todo tensors && python benchmarks/bench_tensors.py --json --trajectories "${TENSORS_TRAJ:-256}" | last > "$OUT/tensors.json"
step growth
todo growth && python benchmarks/bench_growth.py --json --conversations "${GROWTH_CONVS:-1,4,16,64,256}" \
    --turns "${GROWTH_TURNS:-1,2,4,8,16}" --max-new-tokens "${GROWTH_NEW:-8}" | last > "$OUT/growth.json"
step vote
todo vote && torchrun --nproc_per_node=2 benchmarks/bench_vote.py --json | last > "$OUT/vote.json"

step agent_endpoint
todo agent_endpoint && python benchmarks/bench_agent_endpoint.py --json --repeats "${REPEATS:-3}" \
    | last > "$OUT/agent_endpoint.json"

step overlap
todo overlap && python benchmarks/bench_overlap.py --json --latency-ms "${OVERLAP_MS:-0,100,500}" \
    --repeats "${REPEATS:-3}" | last > "$OUT/overlap.json"

step soak
todo soak && torchrun --nproc_per_node=2 benchmarks/soak_rollout.py --json --runs "${SOAK_RUNS:-200}" | last > "$OUT/soak.json"

train() {  # name, then options for launch/train_grpo.py's parser
    local name=$1; shift
    step "train $name"
    todo "train_$name" || return 0
    # a hung configuration is recorded as an error instead of stopping the other benchmarks
    if ! timeout "${TRAIN_TIMEOUT:-240}" torchrun --nproc_per_node=2 benchmarks/bench_train_step.py --json \
        --steps "${TRAIN_STEPS:-4}" --batch-size "${TRAIN_BATCH:-16}" "$@" | last > "$OUT/train_$name.json"; then
        echo "{\"config\": \"$name\", \"error\": \"failed or exceeded ${TRAIN_TIMEOUT:-240} s (exit ${PIPESTATUS[0]})\"}" \
            > "$OUT/train_$name.json"
    fi
}
train megatron_tp1_dp2 --backend megatron --tp 1
train megatron_tp2_dp1 --backend megatron --tp 2
train deepspeed_zero1 --backend deepspeed --zero-stage 1
train deepspeed_zero3 --backend deepspeed --zero-stage 3

step trl
if [ -n "${TRL_VERSION-1.16.0}" ]; then
    # a benchmark-only extra; this version needs no new torch (checked with pip install --dry-run)
    pip install -q "trl==${TRL_VERSION-1.16.0}" >&2 || echo "pip install trl failed" >&2
fi
todo trl && python benchmarks/bench_trl.py --json --steps "${TRL_STEPS:-12}" --batch-size "${TRAIN_BATCH:-16}" \
    --repeats "${REPEATS:-3}" | last > "$OUT/trl.json"

step engines
# vLLM lives in its own environment (.ci/vllm_stage.sh --build makes it); skipped without it
if [ -x .venv-vllm/bin/python ] && todo engines; then
    .venv-vllm/bin/python benchmarks/bench_engines.py --json --repeats "${REPEATS:-3}" \
        --plot "$OUT/engines.png" | last > "$OUT/engines.json"
fi

step learning
if [ -n "${LEARNING:-}" ] && todo learning; then
    python benchmarks/bench_learning.py --json --steps "${LEARNING_STEPS:-30}" --plot "$OUT/learning.png" \
        | last > "$OUT/learning.json"
fi

step "plots and table"
python launch/bench_report.py "$OUT" benchmarks/RESULTS.md
step "done in $(( $(date +%s) - start ))s"
