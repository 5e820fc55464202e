#!/usr/bin/env bash
# Put one part of a file too large for one device call (64 MiB of carry) into .gpu/, with its sha256.
# scripts/gpu_check.sh copies .gpu/ to /tmp/kvw-carry on the device machine at the start of each call;
# the machine keeps /tmp while it stays warm, so the parts of consecutive calls meet there, and the
# 'smollm2' stage joins them and checks the whole file's sha256 before anything reads it.
#
#   scripts/gpu_carry.sh FILE PART PARTS     # e.g. the SmolLM2 GGUF (98 MB) in 2 parts:
#   scripts/gpu_carry.sh "$(.venv/bin/python -c 'from kvwarden.models.sources import smollm2_path; print(smollm2_path())')" 1 2
#   then: device run with carry [".gpu"] and scripts/gpu_check.sh full ...; then the same with part 2
set -euo pipefail
FILE=$1 PART=$2 PARTS=$3
[ -f "$FILE" ] || { echo "gpu_carry: no file $FILE" >&2; exit 2; }
[ "$PART" -ge 1 ] && [ "$PART" -le "$PARTS" ] || { echo "gpu_carry: PART must be 1..$PARTS" >&2; exit 2; }
cd "$(dirname "$0")/.."
NAME=$(basename "$FILE")
rm -rf .gpu && mkdir -p .gpu
SIZE=$(stat -c %s "$FILE")
CHUNK=$(( (SIZE + PARTS - 1) / PARTS ))
dd if="$FILE" of=".gpu/$NAME.part$PART-of-$PARTS" bs=1M iflag=skip_bytes,count_bytes \
  skip=$(( (PART - 1) * CHUNK )) count="$CHUNK" status=none
( cd "$(dirname "$FILE")" && sha256sum "$NAME" ) > ".gpu/$NAME.sha256"
ls -la .gpu
