#!/usr/bin/env bash
# One node's share of a multi-node run: start it once on every node, with the same arguments.
# It runs launch/run.py (torchrun's own agent) with a c10d rendezvous, restarts of lost workers
# (--resume auto continues from the last checkpoint) and launch/train_grpo.py's ARGS.
#
# Under Slurm, one task a node (the node count, this node's rank and the first node's name come
# from Slurm's variables):
#
#     srun --nodes 2 --ntasks-per-node 1 bash launch/multinode.sh --output-dir /shared/runs/grpo
#
# Anywhere else, on each node K of N (MASTER_ADDR: an address of node 0 the others can reach):
#
#     NNODES=2 NODE_RANK=K MASTER_ADDR=10.0.0.1 bash launch/multinode.sh --output-dir /shared/runs/grpo
#
# Settings (environment variables):
#   NNODES, NODE_RANK    the node count and this node's rank (default: SLURM_NNODES, SLURM_NODEID)
#   MASTER_ADDR          where the rendezvous store listens (default: the first node of the job)
#   MASTER_PORT          its port (default 29400)
#   NPROC_PER_NODE       workers on this node (default: one a GPU, else 1)
#   MAX_RESTARTS         restarts of the whole worker group after a lost worker (default 3)
#   RDZV_ID              the run's rendezvous id (default: SLURM_JOB_ID, else "interlens")
#   LOCAL_ADDR           this node's address as the others reach it (default: torchrun's lookup)
# What the processes need from the network:
#   the output directory on a file system every node shares (checkpoints are written by every
#   rank and read back by every rank on --resume); GLOO_SOCKET_IFNAME=eth0 (or the interface the
#   nodes reach each other on) for the vote and the world checks, which always ride gloo;
#   NCCL_SOCKET_IFNAME, and NCCL_IB_HCA on InfiniBand, for training on GPUs; NCCL_DEBUG=WARN to
#   see why NCCL could not connect.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # paths in ARGS stay relative to where it was started

NNODES=${NNODES:-${SLURM_NNODES:-}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
if [[ -z "$NNODES" || -z "$NODE_RANK" ]]; then
    echo "multinode.sh: error: set NNODES and NODE_RANK (or run under srun, which sets SLURM_NNODES and SLURM_NODEID)" >&2
    exit 2
fi
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        echo "multinode.sh: error: set MASTER_ADDR to an address of node 0 that every node can reach" >&2
        exit 2
    fi
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
extra=()
if [[ -n "${LOCAL_ADDR:-}" ]]; then
    extra+=(--local-addr "$LOCAL_ADDR")
fi

# a fresh rendezvous store every round: with torchrun's shared one, ranks restarted by different
# nodes' agents disagree on the restart count and wait for each other (distributed.check_restartable)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec python "$here/run.py" \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29400}" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-interlens}}" --max-restarts "${MAX_RESTARTS:-3}" \
    "${extra[@]}" "$here/train_grpo.py" --resume auto "$@"
