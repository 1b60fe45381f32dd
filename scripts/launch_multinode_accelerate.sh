#!/usr/bin/env bash
# Two nodes with accelerate. Run on every node with its own MACHINE_RANK (0 on the main node).
#   MAIN_IP=10.0.0.1 MACHINE_RANK=0 GPUS_PER_NODE=8 bash scripts/launch_multinode_accelerate.sh --dataset data.jsonl --zero-stage 3
# Rehearse on one CPU host: MAIN_IP=127.0.0.1 GPUS_PER_NODE=1, start MACHINE_RANK=0 and 1 in two shells.
set -euo pipefail
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
: "${MAIN_IP:?set MAIN_IP to the main node's address}" "${MACHINE_RANK:?set MACHINE_RANK (0..NNODES-1)}"
# --multi_gpu selects accelerate's torchrun-based launcher; on CPU-only hosts the toolkit joins the
# ranks over gloo (see README). --zero-stage/--fsdp are the toolkit's flags, passed after finetune.py.
exec accelerate launch --multi_gpu --num_machines "$NNODES" --machine_rank "$MACHINE_RANK" \
  --num_processes $((NNODES * GPUS_PER_NODE)) --main_process_ip "$MAIN_IP" --main_process_port "${MAIN_PORT:-29500}" \
  --mixed_precision no --dynamo_backend no \
  "$(dirname "$0")/../finetune.py" "$@"
