#!/usr/bin/env bash
# The Megatron side of a training step on CUDA + NCCL, without the CPU compatibility layer.
# On the lent GPU machine: carry .whl/ (megatron-core and what the image lacks, see ../shared and the
# device tool's README) and run:  bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/.gpu_pkg:$PYTHONPATH
# The source layout maps callbacks/ and datamodules/ into yatt_lightning.*; mirror that without installing.
mkdir -p .gpu_pkg && rm -rf .gpu_pkg/yatt_lightning && cp -r yatt_lightning .gpu_pkg/ \
  && cp -r callbacks .gpu_pkg/yatt_lightning/callbacks && cp -r datamodules .gpu_pkg/yatt_lightning/datamodules
export YATT_CACHE=/tmp/yatt_cache
torchrun --standalone --nproc_per_node=1 bench/gpu_check.py
