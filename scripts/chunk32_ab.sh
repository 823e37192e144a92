#!/usr/bin/env bash
# Device calls on chunk-32 steps for pass one (docs/NOTES.md, sessions 22-23), one part each:
#  1. (part merge) pass one over merged chunk pairs (resources.PASS_ONE_MERGE, off by default) against
#     the chunk-16 pass one, at 1x32768x32 (8 groups, as tuned) and 1x131072x8, then its
#     GPU test (both u forms, strong decay);
#  2. (part lead) with the merge on, the lead segment's length (PASS_ONE_LEAD, eighths of a
#     segment: 11 was balanced for chunk-16 steps; a merged step is relatively cheaper for
#     the lead: static SASS 539 against 772, at chunk 16 256 against 440) at 1x32768x32;
#  3. (part native) the native chunk-32 walks: the kernels' device times at chunk 16 (8 groups at
#     1x32768x32) and at chunk 32 (4 and 8 groups; the single walk at 8x4096x32), built
#     from this tree. The prologue column at 32 is the native chunk-32 prologue's.
#
#   bash scripts/chunk32_ab.sh [merge|lead|native]   (default merge; one part per device
#   call; appends to $OUT/chunk32_ab.log as it goes)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/chunk32_ab.log
run() { echo "== $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
part=${1:-merge}
case $part in merge|lead|native) ;; *) echo "usage: $0 [merge|lead|native]"; exit 2 ;; esac
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$log"
if [ "$part" = lead ]; then
  run env KDAGEN_GROUPS=8 bash scripts/ab_variants.sh "1x32768:32 lower_bound 16 128" c16g8: \
    m11:PASS_ONE_MERGE=True m9:PASS_ONE_MERGE=True,PASS_ONE_LEAD=9 m10:PASS_ONE_MERGE=True,PASS_ONE_LEAD=10 \
    m12:PASS_ONE_MERGE=True,PASS_ONE_LEAD=12
  exit 0
fi
if [ "$part" = merge ]; then
run env KDAGEN_GROUPS=8 bash scripts/ab_variants.sh "1x32768:32 lower_bound 16 128" c16g8: \
  merge:PASS_ONE_MERGE=True
run env KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "1x131072:8 lower_bound 16 128" c16g8: \
  merge:PASS_ONE_MERGE=True
# (the merged variant as the A/B built it: its cache holds the same build)
run bash -c "source scripts/carried_wheels.sh && KDAGEN_CACHE_DIR=/tmp/kdagen-ab/merge/cache \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k merged_chunk_pairs"
exit 0
fi
run env KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "8x4096:32 lower_bound 16 128" c16g8:
for g in 4 8; do
  run env KDAGEN_AB_KEEP=1 KDAGEN_GROUPS=$g bash scripts/ab_variants.sh "1x32768:32 lower_bound 32 128" c32:
done
run env KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "8x4096:32 lower_bound 32 128" c32:
