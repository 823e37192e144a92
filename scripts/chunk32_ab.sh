#!/usr/bin/env bash
# One device call that decides whether chunk-32 walks are worth a prologue that emits
# chunk-32 operands from its chunk-16 machinery (docs/NOTES.md, session 22): the kernels'
# device times at chunk 16 (tuned group counts as the bench has them: 8 at 1x32768x32)
# and at chunk 32 (4 and 8 groups at 1x32768x32; the single walk at 8x4096x32), built
# from this tree. Compare pass one + scan + pass two, and the single walk; the prologue
# column at 32 is the native chunk-32 prologue's, not the proposed one.
# Ran in session 23 (H200): chunk 32 is slower in every kernel (docs/BENCHMARKS.md).
#
#   bash scripts/chunk32_ab.sh     (on the GPU; appends to $OUT/chunk32_ab.log as it goes)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/chunk32_ab.log
run() { echo "== $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$log"
run env KDAGEN_GROUPS=8 bash scripts/ab_variants.sh "1x32768:32 lower_bound 16 128" c16g8:
run env KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "8x4096:32 lower_bound 16 128" c16g8:
for g in 4 8; do
  run env KDAGEN_AB_KEEP=1 KDAGEN_GROUPS=$g bash scripts/ab_variants.sh "1x32768:32 lower_bound 32 128" c32:
done
run env KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "8x4096:32 lower_bound 32 128" c32:
