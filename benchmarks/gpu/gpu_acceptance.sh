#!/usr/bin/env bash
# benchmarks/gpu/gpu_acceptance.py on the device tool's GPU machine, from the repo root.
#   bash benchmarks/gpu/gpu_wheels.sh                      # here, once: deepspeed, bitsandbytes, datasets into .whl/
# First on every GPU lent, before any other part: finetune.py as users run it (benchmarks/gpu/gpu_user.py: 11 cases,
# ~8 minutes, a guess; cases that would end past the budget are left out and listed):
#   run(command="BUDGET_S=480 bash benchmarks/gpu/gpu_acceptance.sh user", carry=[".whl"], timeout_s=540)
#   then commit benchmarks/gpu/user.json; the yardstick (TRL's SFTTrainer, 200 steps) fills in the rest of its checks:
#   run(command="BUDGET_S=480 bash benchmarks/gpu/gpu_acceptance.sh yardstick", carry=[".whl"], timeout_s=540)
# The image-text case alone (issue 73: the Qwen2.5-VL-3B shape, then TRL's SFTTrainer on the same images, its defaults
# and its best; ~4 minutes, a guess: the 3.75B model is built and saved first):
#   run(command="GPU_USER_CASES=vlm BUDGET_S=480 bash benchmarks/gpu/gpu_acceptance.sh user,yardstick", carry=[".whl"], timeout_s=540)
# The GRPO comparison alone (finetune.py --objective grpo, then TRL's GRPOTrainer with generate and with
# continuous batching; ~6 minutes, a guess):
#   run(command="GPU_USER_CASES=grpo BUDGET_S=480 bash benchmarks/gpu/gpu_acceptance.sh user,yardstick", carry=[".whl"], timeout_s=540)
# Runs as long as a user's (one epoch of GSM8K, default / --compile / --no-compile, and 30 steps), a call each:
#   run(command="BUDGET_S=540 bash benchmarks/gpu/gpu_acceptance.sh epoch_lora", carry=[".whl"], timeout_s=600)   # ~6 min?
#   run(command="BUDGET_S=540 bash benchmarks/gpu/gpu_acceptance.sh epoch_full", carry=[".whl"], timeout_s=600)   # ~6 min?
# The speed checks, three calls back to back (the machine stays warm ~30 s after a call, and
# then the next call reuses the models built in /tmp/gpu_acceptance_work); each starts no run that would
# end past BUDGET_S (default 450 s) and kills what runs 30 s past it, so a call ends inside 9 minutes.
# The arithmetic is in gpu_acceptance.py's docstring:
#   run(command="bash benchmarks/gpu/gpu_acceptance.sh throughput_full", carry=[".whl"], timeout_s=600)   # ~8 min
#   run(command="bash benchmarks/gpu/gpu_acceptance.sh throughput_lora", carry=[".whl"], timeout_s=600)   # ~8 min
#   run(command="BUDGET_S=500 bash benchmarks/gpu/gpu_acceptance.sh packing,chunked_loss,epoch_boundary", carry=[".whl"], timeout_s=600)  # ~9 min
#   give_back()                                     # ~27 of the session's 30 device minutes, start included
# liger_kernel and cut_cross_entropy are not in the machine's image: without their wheels in .whl/ the
# Trainer-best and toolkit-best arms run without Liger, --loss liger/cce are skipped, and the JSON says so.
# flash_attn's wheel is too large to carry: --attn flash is skipped likewise.
# The other parts, a call each:
#   run(command="MEMORY_GRID=small bash benchmarks/gpu/gpu_acceptance.sh memory", carry=[".whl"], timeout_s=600)  # and large
#   run(command="bash benchmarks/gpu/gpu_acceptance.sh pipeline,deepspeed", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu/gpu_acceptance.sh launchers", carry=[".whl"], timeout_s=600)   # ~270 s on one H100
#   run(command="bash benchmarks/gpu/gpu_acceptance.sh models", carry=[".whl"], timeout_s=600)   # never run yet: ~6 min?
# (seen on one H100: a launch there costs 30-80 s, mostly imports: peft alone took 17-22 s;
# a part writes OUT/<part>.json when it ends, launchers after every form; log.txt holds every run's line)
# Each call's JSON, README.md and log come back from $OUT: copy the JSON into benchmarks/gpu/ here,
# run `python -m benchmarks.gpu.gpu_acceptance --render`, and commit.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-/tmp/gpu_acceptance_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m benchmarks.gpu.gpu_acceptance --parts "${1:-all}" --out "$out" --work /tmp/gpu_acceptance_work \
  --budget-s "${BUDGET_S:-450}" 2>&1 | tee "$out/log.txt"
