#!/usr/bin/env bash
# One call on a GPU machine: the stages of scripts/gpu_stages.txt (kvwarden bench runs, the GPU tests),
# each writing its result under $OUT, then a summary read from those files, printed last. Made for the
# device tool (no network there): kvwarden runs from src/ (PYTHONPATH); packages the image lacks come from
# wheels in .whl/ (carry [".whl"]).
#
#   scripts/gpu_check.sh quick                 # tests, invariance matrix, agreement on the small presets
#   scripts/gpu_check.sh full                  # the same on the 0.6b presets, throughput, spec, host tier
#   scripts/gpu_check.sh full STAGE...         # only these (names in scripts/gpu_stages.txt; `dsa` = dsa/*)
#   SCALE_CONFIG=qwen3-next-80b-a3b scripts/gpu_check.sh full scale       # 80B FP8, dummy weights (H200)
#   SCALE_CONFIG=large/glm-5 SCALE_LAYERS=8 scripts/gpu_check.sh full scale
#   BENCH="attention_tiles --heads 16,8,128" scripts/gpu_check.sh full bench   # any other bench
#   scripts/gpu_check.sh list                  # the stages
#
# Each row's variables (SCALE_ARGS, TESTS_ARGS, ...) are in the table. Results: $OUT/LABEL.json (the
# result shape of `kvwarden bench --result`), $OUT/LABEL.xml (pytest), $OUT/LABEL.log, $OUT/summary.txt
# (default OUT=/tmp/gpu_check). A row's SECONDS is its timeout; ROW_TIMEOUT caps them all. `tune` (and
# `gemv` with GEMV_WRITE=1) write $OUT/gemm_tuned.json, which later rows of the call use.
set -uo pipefail
cd "$(dirname "$0")/.."
TABLE=scripts/gpu_stages.txt
MODE=${1:-quick}
shift || true
if [ "$MODE" = list ]; then grep -v '^#' "$TABLE" | awk '{printf "%-16s %-5s %s\n", $1, $2, $4}'; exit 0; fi
[[ "$MODE" == quick || "$MODE" == full ]] || { echo "gpu_check: MODE must be quick, full or list, not '$MODE'" >&2; exit 2; }
STAGES=" ${*:-tests matrix agreement throughput spec hosttier} "
for S in $STAGES; do
  grep -v '^#' "$TABLE" | awk '{print $1}' | grep -qx -e "$S" -e "$S/.*" \
    || { echo "gpu_check: no stage '$S' in $TABLE (scripts/gpu_check.sh list)" >&2; exit 2; }
done
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false KVWARDEN_HOME=${KVWARDEN_HOME:-/tmp/kvwarden-home}
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
WHEELS=$(ls .whl/*.whl 2>/dev/null | grep -v '/transformers-' || true)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# A newer transformers wheel in .whl/ is the reference only for `ref` rows: the image's own version stays
# everyone else's.
REFPATH=$PYTHONPATH
if ls .whl/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf \
    .whl/transformers-*.whl && REFPATH="/tmp/site-tf:$PYTHONPATH"
fi
# Files too large for one call arrive in parts (scripts/gpu_carry.sh, carry [".gpu"]); /tmp outlives a call
# while the machine stays warm, so the parts of consecutive calls meet in /tmp/kvw-carry.
CARRY=/tmp/kvw-carry
mkdir -p "$CARRY"
[ -d .gpu ] && cp -r .gpu/. "$CARRY"/

join_carried() {  # FILE: its parts joined in $CARRY, checked against the carried sha256
  local name=$1 n
  if [ ! -f "$CARRY/$name" ] && ls "$CARRY/$name".part1-of-* >/dev/null 2>&1; then
    n=$(ls "$CARRY/$name".part1-of-* | sed 's/.*-of-//')
    [ "$(ls "$CARRY/$name".part*-of-"$n" | wc -l)" = "$n" ] || { echo "parts missing: $(ls "$CARRY")"; return 1; }
    for k in $(seq 1 "$n"); do cat "$CARRY/$name.part$k-of-$n"; done > "$CARRY/$name.tmp" && mv "$CARRY/$name.tmp" "$CARRY/$name"
  fi
  (cd "$CARRY" && sha256sum -c "$name.sha256")
}

# What the rows' commands read: models by mode, the families, the sparse-attention presets.
if [ "$MODE" = quick ]; then
  MODELS="--model builtin:llama-small --model builtin:qwen3_next-small --model builtin:granite_hybrid-small"
  AGREE="--model builtin:llama-small --model builtin:qwen3_next-small" PROMPT=200
  HOSTTIER="--model builtin:llama-small --prefixes 1024,3584 --turn-pool-tokens 2048"
else
  MODELS="--model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b --model builtin:granite_hybrid-small"
  AGREE=$MODELS PROMPT=300
  HOSTTIER="--model builtin:qwen3-0.6b --prefixes 4096,16384,32768 --turn-pool-tokens 16384 --turn-tokens 512"
fi
FAMILIES="--model builtin:qwen2-small --model builtin:mistral-small --model builtin:llama3-small --model \
builtin:qwen3_moe-small --model builtin:qwen3_5-small --model builtin:granite_hybrid_moe-small"
DSA="--model builtin:glm_moe_dsa-small --model builtin:deepseek_v32-small"
DSA_BIG=${DSA_BIG:-builtin:glm_moe_dsa-0.6b}  # GLM-5's attention dimensions (latent 512 + rotary 64, top-k 2,048)
QTILES=${QTILES:---candidate 32,1,2 --candidate 64,1,2 --prefill-warps 8 --base-warps 4}
TRAINED="$KVWARDEN_HOME/qwen3_next-small-trained"

T0=$(date +%s)
declare -a RESULTS
run_row() {  # LIMIT LABEL COMMAND (one line of the table, after its stage and mode)
  local limit=$1 label=$2 line=$3
  limit=$(( ${ROW_TIMEOUT:-$limit} < limit ? ${ROW_TIMEOUT:-$limit} : limit ))
  echo; echo "=== [+$(( $(date +%s) - T0 ))s] $label (timeout $limit s): $line"
  rm -f "$OUT/$label.json" "$OUT/$label.xml"
  if [ "${line%% *}" = sh ]; then
    eval "${line#sh }" 2>&1 | tee "$OUT/$label.log" | tail -n 8
    return
  fi
  local -a words
  eval "words=($line)"
  local -a run=(timeout -k 30 "$limit" python3)
  RESULTS+=("$OUT/$label.$([ "${words[0]}" = pytest ] && echo xml || echo json)")
  if [ "${words[0]}" = pytest ]; then
    "${run[@]}" -m pytest -q -p no:cacheprovider -o addopts="" --junitxml="$OUT/$label.xml" "${words[@]:1}"
  else
    [ "${words[0]}" = ref ] && words=("${words[@]:1}") && run=(env PYTHONPATH="$REFPATH" "${run[@]}")
    "${run[@]}" -m kvwarden bench --result "$OUT/$label.json" "${words[@]}"
  fi 2>&1 | tee "$OUT/$label.log" | grep -v '^{' | tail -n "${TAIL:-30}"
  [ -s "$OUT/gemm_tuned.json" ] && export KVWARDEN_GEMM_TABLE="$OUT/gemm_tuned.json"
}

echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip list 2>/dev/null | grep -E '^(torch|triton|transformers) ' | tee -a "$OUT/gpu.txt"
while read -r -u 3 stage mode limit label line; do  # fd 3: the rows' commands may read stdin
  [[ -z "$stage" || "$stage" == \#* ]] && continue
  [[ "$STAGES" == *" $stage "* || "$STAGES" == *" ${stage%%/*} "* ]] || continue
  [[ "$mode" == full && "$MODE" != full ]] && continue
  run_row "$limit" "$label" "$line"
done 3< "$TABLE"

echo
echo "=== summary ($MODE, $(( $(date +%s) - T0 )) s; $(head -n 1 "$OUT/gpu.txt"))"
[ ${#RESULTS[@]} -gt 0 ] && python3 -m kvwarden bench --summarize "${RESULTS[@]}" 2>&1 | tee "$OUT/summary.txt"
