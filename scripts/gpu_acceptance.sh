#!/usr/bin/env bash
# scripts/gpu_acceptance.py on the device tool's GPU machine, from the repo root:
#   bash scripts/gpu_wheels.sh                      # here, once: deepspeed, bitsandbytes, datasets into .whl/
#   run(command="bash scripts/gpu_acceptance.sh throughput_135m,memory", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_acceptance.sh throughput_1b", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_acceptance.sh chunked_loss,packing,pipeline,deepspeed", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_acceptance.sh launchers", carry=[".whl"], timeout_s=600)   # ~270 s on one H100
# (seen on one H100, 2026-11-25: a launch there costs 30-80 s, mostly imports: peft alone took 17-22 s;
# a part writes OUT/<part>.json only when it ends, except launchers, which writes after every form)
# Each call's JSON, README.md and log come back from $OUT: copy the JSON into benchmarks/gpu/ here,
# run `python scripts/gpu_acceptance.py --render`, and commit.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-/tmp/gpu_acceptance_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 scripts/gpu_acceptance.py --parts "${1:-all}" --out "$out" 2>&1 | tee "$out/log.txt"
