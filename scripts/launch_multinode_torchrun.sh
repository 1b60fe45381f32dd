#!/usr/bin/env bash
# Two nodes with torchrun (c10d rendezvous). Run on every node; NODE_RANK is optional with c10d.
#   MAIN_IP=10.0.0.1 GPUS_PER_NODE=8 bash scripts/launch_multinode_torchrun.sh --dataset data.jsonl --fsdp
set -euo pipefail
: "${MAIN_IP:?set MAIN_IP to the main node's address}"
exec torchrun --nnodes "${NNODES:-2}" --nproc_per_node "${GPUS_PER_NODE:-8}" \
  --rdzv_backend c10d --rdzv_endpoint "$MAIN_IP:${MAIN_PORT:-29500}" --rdzv_id "${RUN_ID:-finetune}" \
  "$(dirname "$0")/../finetune.py" "$@"
