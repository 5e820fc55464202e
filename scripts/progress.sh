# Sourced by the install scripts: one line per stage with the elapsed time, and a cache
# directory outside the clone so that a fresh clone on the same machine reuses engine builds.
# shellcheck shell=bash
KVWARDEN_CACHE=${KVWARDEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvwarden}
_T0=${_T0:-$(date +%s)}

stage() {  # stage TAG MESSAGE...: "[TAG +mm:ss] MESSAGE"
  local tag=$1; shift
  local s=$(( $(date +%s) - _T0 ))
  printf '[%s +%02d:%02d] %s\n' "$tag" $((s / 60)) $((s % 60)) "$*"
}

# run_logged TAG LOG CMD...: run CMD with its output in LOG; every 60 s print the log's last
# progress line, so a 20-minute build is never silent; on failure print the log's tail.
run_logged() {
  local tag=$1 log=$2; shift 2
  "$@" >>"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      stage "$tag" "  ... $(tr '\r' '\n' <"$log" | grep -v '^\s*$' | tail -n 1 | cut -c1-110)"
    fi
  done
  if ! wait "$pid"; then
    stage "$tag" "FAILED: $* (last lines of $log below)"
    tail -n 40 "$log" >&2
    return 1
  fi
}
