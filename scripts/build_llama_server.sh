#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama-cpp-python sdist (it vendors llama.cpp) for the
# probe's real-engine tests. The build lives in a cache outside the clone
# ($KVWARDEN_CACHE/engines, default ~/.cache/kvwarden/engines), keyed by version and CMake flags,
# and .engines/llama.cpp links to it. About 10-20 minutes on 2 cores the first time, instant after.
#   LLAMA_CMAKE_ARGS="-DGGML_AVX512=ON"   extra CMake flags, appended after the baseline below
#
# CPU baseline: on x86_64 the build targets x86-64-v3 (SSE4.2, AVX, AVX2, FMA, F16C, BMI2) and nothing
# above it: no -march=native, no AVX-512, AVX-VNNI or AMX. A native build takes whatever the build host
# has, and ggml's AMX / AVX-512 paths for quantized weights (SmolLM2's Q4_1) crashed llama-server with a
# segfault before its first answer on an Intel Xeon with AMX, while the same source ran on an AMD EPYC.
# One baseline build runs on both vendors' CPUs of this kind and gives the same numbers on each, so the
# probe's llama.cpp rows measure the same program everywhere. Other architectures build for their generic
# target (GGML_NATIVE=OFF, ggml's defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/progress.sh
VERSION=0.3.36
BASELINE="-DGGML_NATIVE=OFF"
if [ "$(uname -m)" = x86_64 ]; then
  BASELINE="$BASELINE -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
FLAGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF $BASELINE ${LLAMA_CMAKE_ARGS:-}"
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
stage llama.cpp "CPU baseline: $BASELINE"
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
# The baseline, checked on the binary: no AVX-512 (zmm) or AMX (tmm) register may appear in it.
if [ "$(uname -m)" = x86_64 ] && command -v objdump >/dev/null 2>&1; then
  if objdump -d --no-show-raw-insn "$DEST/build/bin/llama-server" | grep -qE '%(zmm|tmm)[0-9]'; then
    stage llama.cpp "FAILED: $DEST/build/bin/llama-server uses AVX-512 or AMX registers despite the baseline"
    mv "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-server.rejected"
    exit 1
  fi
  stage llama.cpp "checked: no AVX-512 or AMX instruction in the binary"
fi
ln -sfn "$(cd "$SRC" && pwd)" "$DEST/src"
link
stage llama.cpp "built $BIN"
