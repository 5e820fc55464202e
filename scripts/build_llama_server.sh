#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama-cpp-python sdist (it vendors llama.cpp) into
# .engines/llama.cpp. Recipe from ../shared/ENGINES.md; about 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.engines/llama.cpp
BIN="$DEST/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "llama-server already built: $BIN"; exit 0; fi
mkdir -p "$DEST"
PY=${PYTHON:-.venv/bin/python}
if ! ls "$DEST"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$DEST"
fi
tar -xzf "$DEST"/llama_cpp_python-*.tar.gz -C "$DEST"
SRC=$(ls -d "$DEST"/llama_cpp_python-*/vendor/llama.cpp | head -1)
GEN=""
command -v ninja >/dev/null 2>&1 && GEN="-G Ninja"
cmake -S "$SRC" -B "$DEST/build" $GEN -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >/dev/null
cmake --build "$DEST/build" --target llama-server -j"$(nproc)" >/dev/null
ln -sfn "$(cd "$SRC" && pwd)" "$DEST/src"
echo "built $BIN"
