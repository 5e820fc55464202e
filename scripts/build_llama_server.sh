#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama-cpp-python sdist (it vendors llama.cpp) for the
# probe's real-engine tests. The build lives in a cache outside the clone
# ($KVWARDEN_CACHE/engines, default ~/.cache/kvwarden/engines), keyed by version and CMake flags,
# and .engines/llama.cpp links to it. About 10-20 minutes on 2 cores the first time, instant after.
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF"   extra CMake flags (e.g. to turn optional CPU features off)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh
VERSION=0.3.36
FLAGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF ${LLAMA_CMAKE_ARGS:-}"
KEY=$(printf '%s %s' "$VERSION" "$FLAGS" | sha256sum | cut -c1-10)
DEST="$KVWARDEN_CACHE/engines/llama.cpp-$VERSION-$KEY"
BIN="$DEST/build/bin/llama-server"
LOG="$DEST/build.log"
link() { mkdir -p .engines && ln -sfn "$DEST" .engines/llama.cpp; }
if [ -x "$BIN" ]; then
  link; stage llama.cpp "llama-server cached: $BIN"; exit 0
fi
mkdir -p "$DEST"
: >"$LOG"
stage llama.cpp "building llama-server $VERSION into $DEST (first time: 10-20 min on 2 cores)"
stage llama.cpp "build log: $LOG"
PY=${PYTHON:-.venv/bin/python}
if ! ls "$DEST"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  stage llama.cpp "downloading the llama-cpp-python $VERSION sdist"
  # Only this package as a source distribution: with --no-binary :all: pip would also build its build
  # dependencies (CMake itself) from source just to read its metadata.
  run_logged llama.cpp "$LOG" "$PY" -m pip download --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d "$DEST"
fi
rm -rf "$DEST"/llama_cpp_python-*/ "$DEST/build"
tar -xzf "$DEST"/llama_cpp_python-*.tar.gz -C "$DEST"
SRC=$(ls -d "$DEST"/llama_cpp_python-*/vendor/llama.cpp | head -1)
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
stage llama.cpp "configuring (cmake)"
# shellcheck disable=SC2086
run_logged llama.cpp "$LOG" cmake -S "$SRC" -B "$DEST/build" "${GEN[@]}" $FLAGS
stage llama.cpp "compiling (progress every minute)"
run_logged llama.cpp "$LOG" cmake --build "$DEST/build" --target llama-server -j"$(nproc)"
ln -sfn "$(cd "$SRC" && pwd)" "$DEST/src"
link
stage llama.cpp "built $BIN"
