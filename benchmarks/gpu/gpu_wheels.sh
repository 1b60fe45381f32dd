#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, into .whl/ (git-ignored), at the versions installed here (what CI
# tests): deepspeed (built here from its sdist: pure Python, its ops compile at run time), the pydantic
# and hjson it needs, bitsandbytes for QLoRA, and datasets with the dill and multiprocess it needs
# (finetune.py tokenizes through it; the image has its other needs); liger-kernel and cut-cross-entropy
# (pure Python on the image's Triton: --kernels liger, --loss liger|cce), at the [gpu] extra's versions
# (they are not installed here: they need Triton), and TRL for the yardstick part's SFTTrainer; about 60 MB of
# the 64 MiB one device call may carry.
# and GSM8K's alpaca file for the user part. Then: the device tool's run(command="bash benchmarks/gpu/gpu_acceptance.sh
# PARTS", carry=[".whl"]), the user part first.
set -euo pipefail
cd "$(dirname "$0")/../.."
v() { python3 -c "from importlib.metadata import version; print(version('$1'))"; }
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  "pydantic==$(v pydantic)" "pydantic-core==$(v pydantic-core)" "annotated-types==$(v annotated-types)" \
  "typing-inspection==$(v typing-inspection)" "hjson==$(v hjson)" "bitsandbytes==$(v bitsandbytes)" \
  "datasets==$(v datasets)" "dill==$(v dill)" "multiprocess==$(v multiprocess)" \
  "liger-kernel==0.8.5" "cut-cross-entropy==25.1.1" "trl==$(v trl)"
sdist=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$(v deepspeed)" -d "$sdist"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "$sdist"/deepspeed-*.tar.gz -w .whl
rm -rf "$sdist"
# the user part's data (benchmarks/gpu/gpu_user.py): the GPU machine has no ../shared
if [ -f ../shared/data/gsm8k_train_alpaca.json ]; then cp ../shared/data/gsm8k_train_alpaca.json .whl/; fi
du -ch .whl/* | tail -1
