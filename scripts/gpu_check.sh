#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, the invariance matrix, agreement with transformers and a
# first throughput table, with a summary table printed last. Made for the device tool (no network
# there): kvwarden runs from src/ (PYTHONPATH), packages the image lacks come from wheels in .whl/.
#
#   scripts/gpu_check.sh quick        # tests; matrix and agreement on the small presets (~4 min)
#   scripts/gpu_check.sh full         # tests; matrix, agreement and throughput on the 0.6b presets (~15 min)
#   scripts/gpu_check.sh full tests matrix            # only these stages of a mode (each call < 10 min)
#   scripts/gpu_check.sh full agreement throughput
#   scripts/gpu_check.sh full hosttier                # host-tier tests on the GPU, TTFT by tier, multi-turn
#   scripts/gpu_check.sh full speed                   # the whole table (dense + both hybrids), one kvwarden bench gpu run
#                                                     # (SPEED_ARGS replaces its flags; parts past the deadline skip)
#   scripts/gpu_check.sh full tests profile           # GPU tests, then where a decode step's time goes
#   scripts/gpu_check.sh full gemm                    # the GEMM's fixed splits of K against the unsplit kernel
#   scripts/gpu_check.sh full gemv                    # narrower output tiles for 1-64 rows: time and bits
#                                                     # (GEMV_WRITE=1: record them; later stages use the table)
#   scripts/gpu_check.sh full attntiles               # the attention kernel's tile candidates, decode and prefill
#   scripts/gpu_check.sh full qtiles                  # 1-position decode tiles vs 128-row prefill tiles: bits, speed
#   scripts/gpu_check.sh full overlap                 # async scheduling vs serial steps: a decode step's wall time
#   scripts/gpu_check.sh full tune speedoffline       # GEMM tiles measured, then the offline rows only
#   scripts/gpu_check.sh full speedrows               # decode by batch and TTFT only (the other half of speed)
#   scripts/gpu_check.sh full serving                 # kvwarden serve at concurrency 1/16/64; shared-prefix offline
#                                                     # (SERVING_ARGS="--online" or "--shared-prefix": one of them)
#   scripts/gpu_check.sh full pd                      # disaggregated prefill/decode on one GPU (needs NIXL in .whl/)
#   scripts/gpu_check.sh full tests fla hybridspeed hybridprofile   # the hybrid family: kernels, fla, rows, profile
#   scripts/gpu_check.sh full hybridmatrix truth      # (a)-(j) on both hybrids; bf16 error against float32 truth
#   scripts/gpu_check.sh full sweep                   # the published configurations (bench/configs/), f32 and bf16
#   scripts/gpu_check.sh full scale                   # real sizes, dummy FP8 weights (SCALE_MODELS="qwen3-next-80b-a3b:fp8"
#                                                     # on an H200; "large/glm-5:fp8:6" its first layers)
#   scripts/gpu_check.sh full smollm2                 # the real SmolLM2 GGUF (parts carried by scripts/gpu_carry.sh)
#   scripts/gpu_check.sh full mtptrain                # train qwen3_next-small on the bundled text, fit MTP, k=2 vs off
#   scripts/gpu_check.sh full families specprofile    # the families' agreement/invariance/truth; a spec step's phases
#   scripts/gpu_check.sh full dsa                     # sparse attention (GLM-5, DeepSeek-V3.2): kernels, agreement,
#                                                     # invariance, the top-k against torch.topk, prefill/decode rows
#
# Stages: tests, matrix, agreement, throughput, spec, hosttier, tune, gemm, gemv, qtiles, attntiles, speed, speedoffline, speedrows, serving, overlap, profile, pd,
# fla, hybridspeed, hybridprofile, hybridmatrix, truth, sweep, scale, smollm2, mtptrain, families, specprofile, diag, granite, dsa
# (throughput, spec, speed* and pd in full mode only). `tune` writes $OUT/gemm_tuned.json and later stages of the call use it
# (KVWARDEN_GEMM_TABLE); copy it to src/kvwarden/layers/kernels/ to record it. Logs and JSON results go to $OUT
# (default /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
shift || true
STAGES=" ${*:-tests matrix agreement throughput spec hosttier} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false KVWARDEN_HOME=${KVWARDEN_HOME:-/tmp/kvwarden-home}
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
WHEELS=$(ls .whl/*.whl 2>/dev/null | grep -v '/transformers-' || true)
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# A newer transformers wheel in .whl/ is the reference only where a stage asks for it (with_reference):
# the image's own version stays everyone else's.
REFPATH=$PYTHONPATH
if ls .whl/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf \
    .whl/transformers-*.whl && REFPATH="/tmp/site-tf:$PYTHONPATH"
fi
with_reference() { PYTHONPATH="$REFPATH" "$@"; }
# Files too large for one call arrive in parts (scripts/gpu_carry.sh, carry [".gpu"]); /tmp outlives a call
# while the machine stays warm, so the parts of consecutive calls meet in /tmp/kvw-carry.
CARRY=/tmp/kvw-carry
mkdir -p "$CARRY"
[ -d .gpu ] && cp -r .gpu/. "$CARRY"/
T0=$(date +%s)
declare -a SUMMARY
stage() { echo; echo "=== [+$(( $(date +%s) - T0 ))s] $*"; }
record() { SUMMARY+=("$(printf '%-44s %s' "$1" "$2")"); }

stage "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

if want tests; then
  stage "kernel and engine tests on the GPU (float32 and bfloat16)"
  timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -o addopts="" ${TESTS_ARGS:-tests/test_kernels.py tests/test_hybrid_kernels.py \
    tests/test_triton_engine.py tests/test_topk.py tests/test_gemm_few_rows.py} \
    2>&1 | tee "$OUT/tests.log" | tail -n 25
  record "GPU tests (kernels + engine properties)" "$(tail -n 1 "$OUT/tests.log")"
fi

if [ "$MODE" = quick ]; then
  MODELS=(--model builtin:llama-small --model builtin:qwen3_next-small --model builtin:granite_hybrid-small)
  AGREE=(--model builtin:llama-small --model builtin:qwen3_next-small)
  PROMPT=200
else
  MODELS=(--model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b --model builtin:granite_hybrid-small)
  AGREE=(--model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b --model builtin:granite_hybrid-small)
  PROMPT=300
fi

if want matrix; then
  stage "invariance matrix, bfloat16 (${MODELS[*]})"
  timeout 480 python3 -m kvwarden bench invariance --device cuda --dtype bfloat16 --prompt-len "$PROMPT" "${MODELS[@]}" \
    --spec ngram:3 --spec mtp:2 \
    2>&1 | tee "$OUT/invariance.log" | grep -v '^{' | tail -n 20
  tail -n 1 "$OUT/invariance.log" > "$OUT/invariance.json"
  record "invariance: canonical all identical" "$(python3 -c "import json; print(json.load(open('$OUT/invariance.json'))['canonical_all_identical'])" 2>&1 | tail -n 1)"
  record "invariance: fast path runs differing" "$(python3 -c "import json; print(json.load(open('$OUT/invariance.json'))['fast_path_differing'])" 2>&1 | tail -n 1)"
fi

if want agreement; then
  for DT in float32 bfloat16; do
    stage "agreement with transformers, $DT"
    timeout 300 python3 -m kvwarden bench agreement --device cuda --dtype "$DT" --numerics canonical --numerics shape-dependent \
      "${AGREE[@]}" 2>&1 | tee "$OUT/agreement-$DT.log" | grep '^|'
    tail -n 1 "$OUT/agreement-$DT.log" > "$OUT/agreement-$DT.json"
    record "agreement $DT (equal prompts, median |Δ| likely)" "$(python3 -c "import json; d=json.load(open('$OUT/agreement-$DT.json'))['models']; print({m: (s['all_tokens_equal'], s['prompts'], round(s['median_max_abs_dlogprob_likely'], 4)) for m, s in d.items()})" 2>&1 | tail -n 1)"
  done
fi

if [ "$MODE" = full ] && want throughput; then
  stage "throughput: kvwarden canonical, kvwarden fast path, transformers generate (bfloat16)"
  timeout 400 python3 -m kvwarden bench offline --device cuda --dtype bfloat16 --models builtin:qwen3-0.6b \
    --num-requests 64 --min-input 100 --max-input 512 --min-output 64 --max-output 256 \
    --max-num-seqs 64 --max-num-batched-tokens 4096 --hf-batch 64 2>&1 | tee "$OUT/offline.log" | tail -n 14
  tail -n 1 "$OUT/offline.log" > "$OUT/offline.json"
  record "throughput (output tok/s)" "$(python3 -c "import json; print({r['engine']: r['output_tok_s'] for r in json.load(open('$OUT/offline.json'))['results']})" 2>&1 | tail -n 1)"
fi

if [ "$MODE" = full ] && want spec; then
  stage "speculative decoding: acceptance and tok/s per proposer and k, batch 1 and 16 (bfloat16)"
  timeout 420 python3 -m kvwarden bench spec --device cuda --dtype bfloat16 --model builtin:qwen3-0.6b \
    --model builtin:qwen3_next-0.6b --ks 2,4 --batches 1,16 --max-tokens 32 --repeats 1 2>&1 | tee "$OUT/spec.log" | tail -n 30
  tail -n 1 "$OUT/spec.log" > "$OUT/spec.json"
  record "spec: output equal to speculation off" "$(python3 -c "import json; print(all(r['identical_to_off'] for r in json.load(open('$OUT/spec.json'))['rows']))" 2>&1 | tail -n 1)"
fi

if want tune; then
  stage "GEMM tiles: every candidate per weight shape of the 0.6b presets, timed at 1..4096 rows"
  timeout "${TUNE_TIMEOUT:-300}" python3 -m kvwarden bench tune_gemm ${TUNE_ARGS:---model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b} \
    --out "$OUT/gemm_tuned.json" 2>&1 | tee "$OUT/tune_gemm.log" | grep -v '^{' | tail -n 30
  [ -s "$OUT/gemm_tuned.json" ] && export KVWARDEN_GEMM_TABLE="$OUT/gemm_tuned.json"
  record "GEMM tuning (shapes, all candidates invariant)" "$(python3 -c "import json; d=json.loads(open('$OUT/tune_gemm.log').read().splitlines()[-1])['shapes']; print(len(d), all(v['all_invariant'] for v in d.values()))" 2>&1 | tail -n 1)"
fi

if want gemm; then  # the canonical GEMM's fixed splits of K against the unsplit kernel, per weight shape
  stage "GEMM: fixed splits of K (walked, parallel) against the unsplit kernel, 1..2048 rows, bitwise checks"
  timeout "${GEMM_TIMEOUT:-240}" python3 -m kvwarden bench gemm_split ${GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm_split.log" | grep -v '^{' | tail -n 60
  tail -n 1 "$OUT/gemm_split.log" > "$OUT/gemm_split.json"
  record "GEMM splits: bitwise; b1 chosen vs unsplit (0.6b)" "$(python3 -c "import json; d=json.load(open('$OUT/gemm_split.json')); print(d['bitwise'], [(r['name'].split()[-1], round(r['unsplit_us'] / r['chosen_us'], 2)) for r in d['rows'] if r['rows'] == 1 and r['name'].startswith('qwen3-0.6b')])" 2>&1 | tail -n 1)"
fi

if want gemv; then  # narrower output tiles for GEMV-shaped launches: time, and the bits against the table's tiles
  stage "GEMV: BLOCK_N / stages variants of each weight's configuration at 1-64 rows, bitwise against 2,048 rows"
  # GEMV_WRITE=1: record this GPU's few-rows entries into $OUT/gemm_tuned.json; later stages of the call use it
  timeout "${GEMV_TIMEOUT:-400}" python3 -m kvwarden bench gemv ${GEMV_WRITE:+--write "$OUT/gemm_tuned.json" --rows 1,16,64} \
    ${GEMV_ARGS:-} 2>&1 | tee "$OUT/gemv.log" | grep -v '^{' | tail -n 150
  [ -n "${GEMV_WRITE:-}" ] && [ -s "$OUT/gemm_tuned.json" ] && export KVWARDEN_GEMM_TABLE="$OUT/gemm_tuned.json"
  tail -n 1 "$OUT/gemv.log" > "$OUT/gemv.json"
  record "GEMV: b1 base -> best same-bits us" "$(python3 -c "import json; d=json.load(open('$OUT/gemv.json')); print([(r['name'], round(r['base_us'], 1), round(r['best_us'], 1)) for r in d['best'] if r['rows'] == 1])" 2>&1 | tail -n 1)"
fi

if want qtiles; then  # #29 item 2: may decode tiles of one position share the bits of the prefill's large tiles?
  # QTILES_SHAPES: "Hq,Hkv,D:DECODE,PREFILL[:dtype]" - real checkpoints' heads (Qwen3-0.6B GQA 2, Llama-3-8B /
  # Qwen3-8B GQA 4, Qwen3-Next GQA 8 x 256, Qwen2.5-0.5B GQA 7 x 64, SmolLM2 GQA 3 x 64, Llama-3-70B GQA 8),
  # prefill tiles of 128 rows (positions x the padded group) on 8 warps, decode tiles of one position
  stage "query tiles: 1-position decode tiles against 128-row prefill tiles, bitwise per row, per head shape"
  for SPEC in ${QTILES_SHAPES:-16,8,128:1,64 32,8,128:1,32 16,2,256:1,16 14,2,64:1,16 9,3,64:1,32 64,8,128:1,16 16,8,128:1,64:float32}; do
    IFS=: read -r H QT DT <<< "$SPEC"
    L="qtiles-${H//,/-}-${DT:-bfloat16}"
    timeout "${QTILES_TIMEOUT:-100}" python3 -m kvwarden bench attention_tiles --heads "$H" --query-tiles "$QT" --dtype "${DT:-bfloat16}" \
      ${QTILES_CANDIDATES:---candidate 32,1,2 --candidate 64,1,2} --prefill-warps 8 --base-warps "${QTILES_BASE_WARPS:-4}" 2>&1 | tee "$OUT/$L.log" | grep -v '^{' | tail -n 5
    record "$L $QT: (tiles, dec=pre rows, pre=16-tile pre, dec us, pre us)" "$(python3 -c "import json; d=json.loads(open('$OUT/$L.log').read().splitlines()[-1]); print([(r['tiles'][0], '%s/%s' % (r['query_tiles']['positions'] - r['query_tiles']['decode_rows_differ'], r['query_tiles']['positions']), r['query_tiles']['prefill_equals_default'], [round(v) for v in r['query_tiles']['us'].values()], round(r['query_tiles']['prefill_us']), [round(v) for v in r['us'].values()], round(r['prefill_us'])) for r in d['rows'] if 'positions' in r.get('query_tiles', {})])" 2>&1 | tail -n 1)"
  done
fi

if want attntiles; then  # the attention kernel's key tile, warps and stages on decode and prefill shapes
  stage "attention tiles: (BLOCK_N, warps, stages) candidates, decode b1/b64/b256 and a 2,048-token prefill"
  timeout "${ATTN_TIMEOUT:-200}" python3 -m kvwarden bench attention_tiles ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attention_tiles.log" | grep -v '^{' | tail -n 20
  tail -n 1 "$OUT/attention_tiles.log" > "$OUT/attention_tiles.json"
  record "attention tiles: (tiles, decode=prefill, us)" "$(python3 -c "import json; d=json.load(open('$OUT/attention_tiles.json')); print([(tuple(r['tiles']), r['decode_equals_prefill'], [round(v) for v in r['us'].values()], round(r['prefill_us'])) for r in d['rows']])" 2>&1 | tail -n 1)"
fi

speed() {  # $1: log name, then kvwarden bench gpu flags; the JSON is saved after every part (a timeout keeps it)
  local name=$1; shift
  local limit=${SPEED_TIMEOUT:-585}
  # CALL_BUDGET_S: the device call's whole limit; this run gets what the earlier stages left of it
  [ -n "${CALL_BUDGET_S:-}" ] && limit=$(( CALL_BUDGET_S - ($(date +%s) - T0) - 15 ))
  rm -f "$OUT/$name.json"
  timeout "$limit" python3 -m kvwarden bench gpu --save "$OUT/$name.json" --deadline-s "${SPEED_DEADLINE:-$(( limit - 75 ))}" \
    "$@" 2>&1 | tee "$OUT/$name.log" | grep -v '^{' | tail -n 80
}
# before 'speed': a call of 'mtptrain speed' measures MTP on the trained model inside the speed run
if [ "$MODE" = full ] && want mtptrain; then  # acceptance that means something: a trained target, a fitted head
  TRAINED="$KVWARDEN_HOME/qwen3_next-small-trained"
  stage "MTP on a trained target: qwen3_next-small trained ${TRAIN_STEPS:-400} steps on the bundled text, head fitted, k=2 vs off"
  rm -rf "$TRAINED"
  timeout 300 python3 -m kvwarden.cli make-model --arch qwen3_next --preset small --out "$TRAINED" \
    --train-steps "${TRAIN_STEPS:-400}" --fit-mtp --device cuda 2>&1 | grep -v -e Loading -e Writing | tee "$OUT/mtptrain.log" | tail -n 8
  want speed || SPEED_TIMEOUT=240 speed gpu_mtp --model "$TRAINED" --hybrid none --skip-offline --skip-rows --spec-model "$TRAINED"
  want speed || record "MTP k=2 on trained small (b: off/on tok/s, accept, equal)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_mtp.json')); print([(r['batch'], round(r['off_tok_s']), round(r['on_tok_s']), round(r['accept_length'], 2), r['identical']) for r in d['spec']])" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want speed; then  # the whole table: dense and both hybrids, one kvwarden bench gpu run
  stage "speed: offline (${SPEED_REQUESTS:-256} sequences), decode by batch, TTFT; dense, Qwen3-Next and Granite styles"
  # MTP k=2 against speculation off in the same run, on a trained model: SPEED_SPEC_MODEL, or the one the
  # mtptrain stage of this call made
  SPEC=${SPEED_SPEC_MODEL:-$([ -d "$KVWARDEN_HOME/qwen3_next-small-trained" ] && echo "$KVWARDEN_HOME/qwen3_next-small-trained")}
  speed gpu_speed --num-requests "${SPEED_REQUESTS:-256}" ${SPEED_ARGS:---skip-transformers --row-engines canonical,fast} \
    ${SPEC:+--spec-model "$SPEC"}
  record "speed: offline tok/s (model: canonical|fast), floor" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed.json')); o={}; [o.setdefault(r.get('model', 'dense').split(':')[-1], []).append(round(r['output_tok_s'])) for r in d['offline']['rows'] + d['offline_hybrid']]; print(o, round(d['offline']['floor_tok_s']))" 2>&1 | tail -n 1)"
  for KIND in canonical fast; do
    record "speed: decode $KIND tok/s (model: b1..b256)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed.json')); o={}; [o.setdefault(r['model'].split(':')[-1], []).append(round(r['decode_tok_s'])) for r in d['decode'] if r['engine'] == '$KIND']; print(o)" 2>&1 | tail -n 1)"
  done
  record "speed: TTFT canonical 4K|16K cold/warm s" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed.json')); o={}; [o.setdefault(r['model'].split(':')[-1], []).append((round(r['cold_s'], 3), round(r['warm_s'], 4))) for r in d['ttft'] if r['engine'] == 'canonical' and r['prompt'] >= 4096]; print(o)" 2>&1 | tail -n 1)"
  [ -n "$SPEC" ] && record "speed: MTP k=2 (b: off/on tok/s, accept, equal)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed.json')); print([(r['batch'], round(r['off_tok_s']), round(r['on_tok_s']), round(r['accept_length'], 2), r['identical']) for r in d.get('spec', [])])" 2>&1 | tail -n 1)"
  record "speed: parts skipped past the deadline" "$(python3 -c "import json; print(json.load(open('$OUT/gpu_speed.json'))['skipped'] or 'none')" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want speedoffline; then
  stage "speed, offline half: nano-vllm's workload (${SPEED_REQUESTS:-256} sequences) and the kernel profile"
  speed gpu_speed_offline --num-requests "${SPEED_REQUESTS:-256}" --skip-rows ${SPEED_OFFLINE_ARGS:-}
  record "speed: offline tok/s (engine: tok/s) and floor" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed_offline.json')); print({r['engine']: round(r['output_tok_s']) for r in d['offline']['rows']}, round(d['offline']['floor_tok_s']))" 2>&1 | tail -n 1)"
  record "speed: hybrid offline tok/s" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed_offline.json')); print({r['engine']: round(r['output_tok_s']) for r in d.get('offline_hybrid', [])})" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want speedrows; then
  stage "speed, rows half: decode by batch (graphs vs eager), TTFT cold and warm, dense and hybrid"
  speed gpu_speed_rows --skip-offline ${SPEED_ROWS_ARGS:-}
  record "speed: decode canonical tok/s, by batch" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_speed_rows.json')); print([round(r['decode_tok_s']) for r in d['decode'] if r['engine'] == 'canonical'])" 2>&1 | tail -n 1)"
fi
# serving: the image lacks the server's packages; carry their wheels (fastapi, starlette, uvicorn, h11, click,
# anyio, sniffio, pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions,
# prometheus_client, opentelemetry_api and annotated_doc (fastapi >= 0.16x imports them), httpx, httpcore,
# certifi, idna; `pip download --no-deps --only-binary=:all: --python-version 3.12` into .whl/)
if [ "$MODE" = full ] && want serving; then  # #29: the server under load; prefix caching on shared system prompts
  stage "serving: kvwarden serve at concurrency 1/16/64 (canonical, fast path); shared-prefix workload offline"
  python3 -c "import kvwarden.server.app, uvicorn, httpx" 2>&1 | tail -n 3 \
    | sed 's/^/  server import check (a wheel to carry in .whl\/?): /'
  speed gpu_serving --skip-offline --skip-rows --hybrid none ${SERVING_ARGS:---online --shared-prefix}
  record "online c1/c16/c64 tok/s canonical|fast" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_serving.json')); print([(r['concurrency'], r['engine'][:4], round(r['output_tok_s']), round(r['tpot_ms_mean'] or 0, 2)) for r in d.get('online', [])])" 2>&1 | tail -n 1)"
  record "shared vs unshared prompts, output tok/s (cached share)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_serving.json')); print([(r['engine'][:4], r['workload'], round(r['output_tok_s']), round(r['cached_share'], 2)) for r in d.get('shared', [])])" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want overlap; then  # #29: async scheduling against serial steps, alternating on one card
  stage "async scheduling A/B: a steady decode step's wall time, serial vs overlapped (kvwarden bench host_profile)"
  for ROUND in ${OVERLAP_ROUNDS:-1 2}; do
    for KIND in serial async; do
      timeout 150 python3 -m kvwarden bench host_profile --steps 64 --top 12 ${OVERLAP_ARGS:---batch 1 --batch 64 --batch 256} \
        $([ $KIND = serial ] && echo --serial) 2>&1 | tee "$OUT/overlap-$KIND-$ROUND.log" | grep '^batch'
      tail -n 1 "$OUT/overlap-$KIND-$ROUND.log" > "$OUT/overlap-$KIND-$ROUND.json"
      record "overlap $KIND round $ROUND: step ms|kernels ms" "$(python3 -c "import json; d=json.load(open('$OUT/overlap-$KIND-$ROUND.json')); print([(r['batch'], round(r['step_s'] * 1e3, 2), round(r['gpu_busy_s'] * 1e3, 2)) for r in d['rows']])" 2>&1 | tail -n 1)"
    done
  done
fi
if [ "$MODE" = full ] && want profile; then
  stage "where time goes: one prefill chunk and one decode step, kernel groups beside their ceilings"
  timeout 200 python3 -m kvwarden bench gpu_profile 2>&1 | tee "$OUT/gpu_profile.log" | grep -v -e '^{' -e USDT | tail -n 30
  tail -n 1 "$OUT/gpu_profile.log" > "$OUT/gpu_profile.json"
  record "profile: decode step ms (eager, graph)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_profile.json')); print(round(d['decode_step_s_eager'] * 1e3, 2), round(d['decode_step_s_graph'] * 1e3, 2))" 2>&1 | tail -n 1)"
fi

if [ "$MODE" = full ] && want pd; then  # disaggregated prefill/decode: three servers sharing the one GPU
  stage "disaggregated prefill/decode on one GPU: single vs prefill + decode instances (NIXL over UCX, CUDA IPC)"
  timeout 300 python3 -m kvwarden bench pd --device cuda --dtype bfloat16 --model builtin:qwen3-0.6b --num-requests 32 \
    --concurrency 8 --long-prompt 2048,4096 --short-prompt 64,128 --short-output 16 --long-output 256 \
    --server-arg=--num-blocks=4096 2>&1 | tee "$OUT/pd.log" | grep -v '^{' | tail -n 25
  tail -n 1 "$OUT/pd.log" > "$OUT/pd.json"
  record "pd: identical text, transfers done/failed" "$(python3 -c "import json; d=json.load(open('$OUT/pd.json')); print(d['identical_text'], d['disaggregated']['transfers'], d['disaggregated']['transfers_failed'])" 2>&1 | tail -n 1)"
  record "pd: alone overhead ms p50, bytes/request" "$(python3 -c "import json; d=json.load(open('$OUT/pd.json'))['alone']; print(d['overhead_p50_ms'], d['bytes_per_request'])" 2>&1 | tail -n 1)"
fi

if want fla; then  # what the field maintains: flash-linear-attention's kernels (fla-core from .whl/) against ours
  stage "gated DeltaNet kernels: kvwarden vs flash-linear-attention (speed and invariance, Qwen3-Next-80B's shape)"
  timeout "${FLA_TIMEOUT:-240}" python3 -m kvwarden bench fla_compare 2>&1 | tee "$OUT/fla.log" | grep -v '^{' | tail -n 20
  tail -n 1 "$OUT/fla.log" > "$OUT/fla.json"
  record "fla: bitwise (two calls, decode, partner)" "$(python3 -c "import json; d=json.load(open('$OUT/fla.json')); print({k: list(v.values()) for k, v in d['invariance'].items()})" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want hybridspeed; then  # the hybrid's rows only (the dense ones come with 'speed')
  stage "hybrid speed: decode b1..b256 (graphs), TTFT 1K/4K/16K cold and warm, canonical and fast"
  SPEED_TIMEOUT=${HYBRID_TIMEOUT:-360} speed gpu_hybrid --skip-offline --skip-dense-rows ${HYBRID_ARGS:-}
  for KIND in $(python3 -c "import json; print(' '.join(sorted({r['engine'] for r in json.load(open('$OUT/gpu_hybrid.json'))['decode']})))" 2>/dev/null); do
    record "hybrid: decode $KIND tok/s (model: by batch)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_hybrid.json')); o={}; [o.setdefault(r['model'].split(':')[-1], []).append(round(r['decode_tok_s'])) for r in d['decode'] if r['engine'] == '$KIND']; print(o)" 2>&1 | tail -n 1)"
    record "hybrid: TTFT $KIND cold/warm s (model: by prompt)" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_hybrid.json')); o={}; [o.setdefault(r['model'].split(':')[-1], []).append((round(r['cold_s'], 3), round(r['warm_s'], 4))) for r in d['ttft'] if r['engine'] == '$KIND']; print(o)" 2>&1 | tail -n 1)"
  done
fi
if [ "$MODE" = full ] && want hybridprofile; then
  stage "hybrid profile: one prefill chunk and one decode step by kernel group (eager), the graph step's time"
  timeout "${PROFILE_TIMEOUT:-200}" python3 -m kvwarden bench gpu_profile --model "${PROFILE_MODEL:-builtin:qwen3_next-0.6b}" ${PROFILE_ARGS:-} \
    2>&1 | tee "$OUT/hybrid_profile.log" | grep -v -e '^{' -e USDT | tail -n 40
  tail -n 1 "$OUT/hybrid_profile.log" > "$OUT/hybrid_profile.json"
  record "hybrid profile: decode step ms (eager, graph)" "$(python3 -c "import json; d=json.load(open('$OUT/hybrid_profile.json')); print(round(d['decode_step_s_eager'] * 1e3, 2), round(d['decode_step_s_graph'] * 1e3, 2))" 2>&1 | tail -n 1)"
fi
if [ "$MODE" = full ] && want hybridmatrix; then
  stage "invariance matrix, hybrids only, canonical, greedy and seeded, speculation on and off (bfloat16)"
  timeout "${MATRIX_TIMEOUT:-480}" python3 -m kvwarden bench invariance --device cuda --dtype bfloat16 --numerics canonical \
    ${MATRIX_ARGS:---prompt-len 300 --model builtin:qwen3_next-0.6b --model builtin:granite_hybrid-small --spec ngram:3 --spec mtp:2} \
    2>&1 | tee "$OUT/hybrid_invariance.log" | grep -v '^{' | tail -n 20
  tail -n 1 "$OUT/hybrid_invariance.log" > "$OUT/hybrid_invariance.json"
  record "hybrid invariance: canonical all identical" "$(python3 -c "import json; print(json.load(open('$OUT/hybrid_invariance.json'))['canonical_all_identical'])" 2>&1 | tail -n 1)"
fi
if want truth; then  # bfloat16 error of kvwarden and of transformers against transformers in float32, same weights
  stage "bfloat16 error against float32 truth on the same bf16-rounded weights (kvwarden vs transformers)"
  timeout "${TRUTH_TIMEOUT:-300}" python3 -m kvwarden bench agreement --device cuda --dtype bfloat16 --truth \
    ${TRUTH_ARGS:---prompts 16 --model builtin:qwen3_next-0.6b --model builtin:qwen3-0.6b} 2>&1 | tee "$OUT/truth.log" | grep '^|'
  tail -n 1 "$OUT/truth.log" > "$OUT/truth.json"
  record "truth: median|max first-token error (kvwarden, hf)" "$(python3 -c "import json; d=json.load(open('$OUT/truth.json'))['models']; print({m: s.get('truth') for m, s in d.items()})" 2>&1 | tail -n 1)"
fi

if [ "$MODE" = full ] && want sweep; then  # every published configuration, both dtypes from one checkpoint each
  stage "sweep over published configurations on the GPU, float32 (bound 1e-3) and bfloat16 (0.25), experts <= ${SWEEP_EXPERTS:-64}"
  timeout "${SWEEP_TIMEOUT:-420}" python3 -m kvwarden bench sweep --device cuda --dtype float32:1e-3 --dtype bfloat16:0.25 \
    --max-experts "${SWEEP_EXPERTS:-64}" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | grep -e '^|' -e '^\[sweep\]'
  tail -n 1 "$OUT/sweep.log" > "$OUT/sweep.json"
  record "sweep: rows agreeing or refused (f32, bf16)" "$(python3 -c "import json; r=json.load(open('$OUT/sweep.json'))['rows']; print(*(f\"{d}: {sum(x['status'] in ('agrees', 'refused') for x in r if x['dtype'] == d)} of {sum(x['dtype'] == d for x in r)}\" for d in ('float32', 'bfloat16')))" 2>&1 | tail -n 1)"
fi

if want fp8; then  # #60: the FP8 GEMM, SwiGLU and MoE kernels compiled, f32 and bf16, against their dequantized twin
  stage "FP8 (W8A16) kernels: bits of the dequantized twin, rows alone = in a batch"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels.py -k fp8 2>&1 \
    | tee "$OUT/fp8_tests.log" | tail -n 5
  record "FP8 kernel tests" "$(tail -n 1 "$OUT/fp8_tests.log")"
fi

if [ "$MODE" = full ] && want scale; then  # #60 item 4: the seeds' models at real size, dummy weights (FP8)
  # CONFIG[:fp8[:LAYERS]] each; Qwen3-Next-80B-A3B-FP8 (~81 GB) needs an H200 (run it alone, needs_h200)
  for SPEC in ${SCALE_MODELS:-qwen3-30b-a3b:fp8}; do
    IFS=: read -r CFG FP8 LAYERS <<< "$SPEC"
    NAME=$(basename "$CFG")
    stage "scale: $CFG${FP8:+ as FP8}${LAYERS:+, first $LAYERS layers}, dummy weights, bfloat16: load, offline, (b)(e)(f), c=1/8/64"
    timeout "${SCALE_TIMEOUT:-560}" python3 -m kvwarden bench scale --config "bench/configs/$CFG.json" --device cuda \
      --dtype bfloat16 ${FP8:+--fp8} ${LAYERS:+--num-layers $LAYERS} --out "$OUT/scale-$NAME.json" ${SCALE_ARGS:-} \
      2>&1 | tee "$OUT/scale-$NAME.log" | grep -v '^{' | tail -n 12
    record "scale $NAME: layers, load s, offline tok/s, [c, tok/s, TPOT ms], b/e/f" "$(python3 -m kvwarden bench scale --summarize "$OUT/scale-$NAME.json" 2>&1 | tail -n 1)"
  done
fi

if want smollm2; then  # the real model: its GGUF joined from the carried parts, checked against its sha256
  GGUF="$CARRY/SmolLM2-135M-Instruct.Q4_1.gguf"
  stage "SmolLM2-135M (real weights, GGUF dequantized on load): agreement with transformers and a speed line"
  if [ ! -f "$GGUF" ] && ls "$CARRY"/SmolLM2-135M-Instruct.Q4_1.gguf.part*-of-* >/dev/null 2>&1; then
    N=$(ls "$CARRY"/SmolLM2-135M-Instruct.Q4_1.gguf.part1-of-* | sed 's/.*-of-//')
    if [ "$(ls "$CARRY"/SmolLM2-135M-Instruct.Q4_1.gguf.part*-of-"$N" | wc -l)" = "$N" ]; then
      for K in $(seq 1 "$N"); do cat "$CARRY/SmolLM2-135M-Instruct.Q4_1.gguf.part$K-of-$N"; done > "$GGUF.tmp"
      mv "$GGUF.tmp" "$GGUF"
    fi
  fi
  if [ -f "$GGUF" ] && (cd "$CARRY" && sha256sum -c SmolLM2-135M-Instruct.Q4_1.gguf.sha256); then
    for DT in float32 bfloat16; do
      timeout 240 python3 -m kvwarden bench agreement --device cuda --dtype "$DT" --model "$GGUF" --prompts 8 \
        2>&1 | tee "$OUT/smollm2-agreement-$DT.log" | grep '^|'
      tail -n 1 "$OUT/smollm2-agreement-$DT.log" > "$OUT/smollm2-agreement-$DT.json"
      record "smollm2 agreement $DT (equal, prompts, median)" "$(python3 -c "import json; d=json.load(open('$OUT/smollm2-agreement-$DT.json'))['models']; print([(s['all_tokens_equal'], s['prompts'], round(s['median_max_abs_dlogprob_likely'], 4)) for s in d.values()])" 2>&1 | tail -n 1)"
    done
    SPEED_TIMEOUT=${SMOLLM2_TIMEOUT:-300} speed gpu_smollm2 --model "$GGUF" --hybrid none --skip-transformers \
      --num-requests 256 --batches 1,16,64,256 --prompts 1024,4096 --row-engines canonical,fast
    record "smollm2: offline tok/s, decode b1..b256 canonical" "$(python3 -c "import json; d=json.load(open('$OUT/gpu_smollm2.json')); print({r['engine']: round(r['output_tok_s']) for r in d['offline']['rows']}, [round(r['decode_tok_s']) for r in d['decode'] if r['engine'] == 'canonical'])" 2>&1 | tail -n 1)"
  else
    record "smollm2" "GGUF parts incomplete or sha256 mismatch: $(ls "$CARRY" | tr '\n' ' ')"
  fi
fi


if want diag; then  # which side is off when the engines disagree: both on the CPU and on the GPU
  stage "reference diagnosis: transformers and kvwarden, CPU and GPU, float32 (${DIAG_MODELS:-builtin:granite_hybrid_moe-small})"
  DM=(); for M in ${DIAG_MODELS:-builtin:granite_hybrid_moe-small builtin:granite_hybrid-small}; do DM+=(--model "$M"); done
  timeout "${DIAG_TIMEOUT:-180}" python3 -m kvwarden bench diag_reference "${DM[@]}" 2>&1 | tee "$OUT/diag.log" | grep -v -e '^{' -e Loading -e falling | tail -n 30
fi

if want dsa; then  # sparse attention (#30); transformers 5.17 lacks GlmMoeDsa / DeepseekV32: the carried wheel is the reference
  DSA=(--model builtin:glm_moe_dsa-small --model builtin:deepseek_v32-small)
  DSA_BIG=${DSA_BIG:-builtin:glm_moe_dsa-0.6b}  # GLM-5's attention dimensions (latent 512 + rotary 64, top-k 2,048)
  DSAPARTS=" ${DSA_PARTS:-tests float32 bfloat16 invariance topk sink} "  # a subset, e.g. DSA_PARTS="tests topk"
  dsa_part() { [[ "$DSAPARTS" == *" $1 "* ]]; }
  if dsa_part tests; then
  stage "sparse attention kernels compiled (indexer scores, latent attention, radix-select top-k)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_dsa_kernels.py tests/test_topk.py \
    2>&1 | tee "$OUT/dsa-tests.log" | tail -n 5
  record "DSA kernel tests" "$(tail -n 1 "$OUT/dsa-tests.log")"
  fi
  for DT in float32 bfloat16; do
    dsa_part $DT || continue
    # bfloat16: a selection flip moves a logprob by nats, so each engine is also measured against float32 truth
    TRUTH=$([ "$DT" = bfloat16 ] && echo --truth)
    stage "sparse attention against the carried transformers, $DT $TRUTH"
    with_reference timeout 300 python3 -m kvwarden bench agreement --device cuda --dtype "$DT" --numerics canonical $TRUTH \
      "${DSA[@]}" --model "$DSA_BIG" 2>&1 | tee "$OUT/dsa-agreement-$DT.log" | grep '^|'
    tail -n 1 "$OUT/dsa-agreement-$DT.log" > "$OUT/dsa-agreement-$DT.json"
    record "DSA agreement $DT (equal, prompts, median, truth)" "$(python3 -c "import json; d=json.load(open('$OUT/dsa-agreement-$DT.json'))['models']; print({m.split(':')[-1].split(' ')[0]: (s['all_tokens_equal'], s['prompts'], round(s['median_max_abs_dlogprob_likely'], 4), s.get('truth')) for m, s in d.items()})" 2>&1 | tail -n 1)"
  done
  if dsa_part invariance; then
  stage "sparse attention invariance (a)-(j), canonical, bfloat16"
  timeout 240 python3 -m kvwarden bench invariance --device cuda --dtype bfloat16 --numerics canonical --prompt-len 200 "${DSA[@]}" \
    2>&1 | tee "$OUT/dsa-invariance.log" | grep -v '^{' | tail -n 8
  tail -n 1 "$OUT/dsa-invariance.log" > "$OUT/dsa-invariance.json"
  record "DSA invariance: canonical all identical" "$(python3 -c "import json; print(json.load(open('$OUT/dsa-invariance.json'))['canonical_all_identical'])" 2>&1 | tail -n 1)"
  fi
  if dsa_part topk; then
  stage "key selection vs torch.topk (4K-64K keys, 1-256 rows); $DSA_BIG prefill/decode at 4K beside qwen3-0.6b"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader  # nothing should hold the GPU now
  timeout 400 python3 -m kvwarden bench topk --device cuda --rows 1 16 64 256 2048 ${TOPK_ARGS:-} --variants --dsa-model "$DSA_BIG" \
    --dense-model builtin:qwen3-0.6b --prompt-len 4096 --decode-tokens 33 2>&1 | tee "$OUT/topk.log" | grep -v '^{' | tail -n 56
  tail -n 1 "$OUT/topk.log" > "$OUT/topk.json"
  record "top-k: torch.topk / triton at 8K-64K keys" "$(python3 -c "import json; d=json.load(open('$OUT/topk.json'))['selection']; print([(r['keys'], r['rows'], round(r['torch_topk_ms'] / r['triton_ms'], 2)) for r in d if r['keys'] >= 8192])" 2>&1 | tail -n 1)"
  record "top-k device time: topk / best shape (8K+)" "$(python3 -c "import json; d=json.load(open('$OUT/topk.json'))['selection']; print([(r['keys'], r['rows'], b[1], round(r['gpu_ms']['torch.topk'] / b[0], 2)) for r in d if r['keys'] >= 8192 for b in [min((v, n) for n, v in r['gpu_ms'].items() if n not in ('torch.topk', 'default') and not n.endswith('eager') and v == v)]])" 2>&1 | tail -n 1)"
  record "top-k device time: torch.topk / default (8K+)" "$(python3 -c "import json; d=json.load(open('$OUT/topk.json')); print('graphs' if d['graphs'] else 'eager', [(r['keys'], r['rows'], round(r['gpu_ms']['torch.topk'] / r['gpu_ms']['default'], 2)) for r in d['selection'] if r['keys'] >= 8192])" 2>&1 | tail -n 1)"
  record "DSA vs dense prefill|decode tok/s at 4K" "$(python3 -c "import json; print([(r['model'][:40], round(r['prefill_tok_s']), round(r['decode_tok_s'], 1)) for r in json.load(open('$OUT/topk.json'))['models']])" 2>&1 | tail -n 1)"
  fi
  if dsa_part sink; then  # the bucket shortcut's worst case: one far larger score per row (the passes over the row)
  stage "key selection with an attention sink (one score of 1000 per row), 16K-64K keys x 256-2,048 rows"
  timeout 200 python3 -m kvwarden bench topk --device cuda --no-models --sink --keys 16384 65536 --rows 256 2048 --variants \
    2>&1 | tee "$OUT/topk-sink.log" | grep -v '^{' | tail -n 20
  tail -n 1 "$OUT/topk-sink.log" > "$OUT/topk-sink.json"
  record "top-k with a sink: torch.topk / triton" "$(python3 -c "import json; d=json.load(open('$OUT/topk-sink.json'))['selection']; print([(r['keys'], r['rows'], round(r['torch_topk_ms'] / r['triton_ms'], 2)) for r in d])" 2>&1 | tail -n 1)"
  fi
fi

if want granite; then  # GraniteMoeHybrid with n_groups > 1 needs transformers >= 5.23 as the reference
  for DT in float32 bfloat16; do
    stage "Granite presets against the carried transformers ($(with_reference python3 -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -n 1)), $DT"
    with_reference timeout 200 python3 -m kvwarden bench agreement --device cuda --dtype "$DT" --numerics canonical \
      --model builtin:granite_hybrid_moe-small --model builtin:granite_hybrid-small \
      2>&1 | tee "$OUT/granite-agreement-$DT.log" | grep '^|'
    tail -n 1 "$OUT/granite-agreement-$DT.log" > "$OUT/granite-agreement-$DT.json"
    record "granite agreement $DT (equal, prompts, median)" "$(python3 -c "import json; d=json.load(open('$OUT/granite-agreement-$DT.json'))['models']; print({m.split(':')[-1].split(' ')[0]: (s['all_tokens_equal'], s['prompts'], round(s['median_max_abs_dlogprob_likely'], 4)) for m, s in d.items()})" 2>&1 | tail -n 1)"
  done
fi

if want specprofile; then  # where a speculative step's time goes, phase by phase (#27 item 1)
  stage "speculative step phases: MTP k=2 vs off, ${SPECPROF_MODEL:-builtin:qwen3_next-small}, bfloat16"
  timeout "${SPECPROF_TIMEOUT:-200}" python3 -m kvwarden bench spec_profile --device cuda --dtype bfloat16 \
    --model "${SPECPROF_MODEL:-builtin:qwen3_next-small}" ${SPECPROF_ARGS:-} 2>&1 | tee "$OUT/spec_profile.log" | grep -v '^{' | tail -n 45
  tail -n 1 "$OUT/spec_profile.log" > "$OUT/spec_profile.json"
  record "spec profile: ms/step (off b1, on b1, on b16)" "$(python3 -c "import json; d=json.load(open('$OUT/spec_profile.json'))['rows']; print({k: round(1e3 * r['wall_s'] / r['steps'], 2) for k, r in d.items()})" 2>&1 | tail -n 1)"
fi

if want families; then  # the families users bring (#28): agreement both dtypes, invariance, bf16 error vs truth
  FAM=(--model builtin:qwen2-small --model builtin:mistral-small --model builtin:llama3-small \
    --model builtin:qwen3_moe-small --model builtin:qwen3_5-small --model builtin:granite_hybrid_moe-small)
  FAMPARTS=" ${FAMILY_PARTS:-agreement invariance truth} "
  for DT in float32 bfloat16; do
    [[ "$FAMPARTS" == *" agreement "* ]] || break
    stage "families: agreement with transformers, $DT (${FAM[*]})"
    timeout 200 python3 -m kvwarden bench agreement --device cuda --dtype "$DT" --numerics canonical "${FAM[@]}" \
      2>&1 | tee "$OUT/families-agreement-$DT.log" | grep '^|'
    tail -n 1 "$OUT/families-agreement-$DT.log" > "$OUT/families-agreement-$DT.json"
    record "families agreement $DT (equal, prompts, median)" "$(python3 -c "import json; d=json.load(open('$OUT/families-agreement-$DT.json'))['models']; print({m.split(':')[-1].split(' ')[0]: (s['all_tokens_equal'], s['prompts'], round(s['median_max_abs_dlogprob_likely'], 4)) for m, s in d.items()})" 2>&1 | tail -n 1)"
  done
  if [[ "$FAMPARTS" == *" invariance "* ]]; then
  stage "families: invariance (a)-(j), canonical, bfloat16, greedy and seeded"
  timeout 240 python3 -m kvwarden bench invariance --device cuda --dtype bfloat16 --numerics canonical --prompt-len 200 \
    "${FAM[@]}" 2>&1 | tee "$OUT/families-invariance.log" | grep -v '^{' | tail -n 16
  tail -n 1 "$OUT/families-invariance.log" > "$OUT/families-invariance.json"
  record "families invariance: canonical all identical" "$(python3 -c "import json; print(json.load(open('$OUT/families-invariance.json'))['canonical_all_identical'])" 2>&1 | tail -n 1)"
  fi
  [[ "$FAMPARTS" == *" truth "* ]] || TRUTH_CONFIGS=" "
  for CFG in ${TRUTH_CONFIGS:-granite-4.0-h-tiny}; do
    stage "bfloat16 error against float32 truth: $CFG cut to 2 layers (kvwarden vs transformers)"
    rm -rf "/tmp/truth-$CFG"
    python3 -m kvwarden.cli make-model --config "bench/configs/$CFG.json" --num-layers 2 --dtype bfloat16 \
      --out "/tmp/truth-$CFG" >/dev/null 2>&1
    timeout 240 python3 -m kvwarden bench agreement --device cuda --dtype bfloat16 --truth --prompts 16 --model "/tmp/truth-$CFG" \
      2>&1 | tee "$OUT/truth-$CFG.log" | grep '^|'
    tail -n 1 "$OUT/truth-$CFG.log" > "$OUT/truth-$CFG.json"
    record "truth $CFG: median|max (kvwarden, hf)" "$(python3 -c "import json; d=json.load(open('$OUT/truth-$CFG.json'))['models']; print([s.get('truth') for s in d.values()])" 2>&1 | tail -n 1)"
  done
fi

if want hosttier; then
  stage "host tier on the GPU: invariance (k) and the re-created race (pinned memory, a copy stream)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_host_tier.py -k "not probe and not server" \
    2>&1 | tee "$OUT/host_tier_tests.log" | tail -n 15
  record "host tier tests on the GPU" "$(tail -n 1 "$OUT/host_tier_tests.log")"
  if [ "$MODE" = full ]; then
    HT=(--model builtin:qwen3-0.6b --prefixes 4096,16384,32768 --turn-pool-tokens 16384 --turn-tokens 512)
  else
    HT=(--model builtin:llama-small --prefixes 1024,3584 --turn-pool-tokens 2048)
  fi
  stage "host tier: TTFT by tier and a multi-turn workload 4x the device pool (bfloat16; ${HT[*]})"
  timeout 420 python3 -m kvwarden bench host_tier --device cuda --dtype bfloat16 --budget 8192 "${HT[@]}" --repeats 2 \
    2>&1 | tee "$OUT/host_tier.log" | tail -n 24
  tail -n 1 "$OUT/host_tier.log" > "$OUT/host_tier.json"
  record "host tier TTFT s (prefix: recompute/device/host)" "$(python3 -c "import json; print({r['prefix']: (round(r['recompute_s'], 3), round(r['device_s'], 3), round(r['host_s'], 3)) for r in json.load(open('$OUT/host_tier.json'))['ttft']})" 2>&1 | tail -n 1)"
  record "host tier multi-turn turns/s (off, on)" "$(python3 -c "import json; print([round(r['turns_per_s'], 2) for r in json.load(open('$OUT/host_tier.json'))['multi_turn']])" 2>&1 | tail -n 1)"
fi

echo
echo "=== summary ($MODE, $(( $(date +%s) - T0 )) s)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
