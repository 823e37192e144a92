#!/usr/bin/env bash
# One device call for the walk changes prepared on the CPU and not yet timed (docs/NOTES.md,
# "Next after v20"): the swizzled tiles (resources.CHUNK_SWIZZLE) and the paired pass one
# (resources.PASS_ONE_PAIRED), each alone and both together, against this checkout; and
# the K-split single walk (resources.WALK_SPLIT_K) for few long sequences. `time` also
# runs the tree before the walk's fixed-count o stores (prev: landed untimed in session 17).
#
#   bash scripts/try_prepared.sh time [shapes]  # A/B, two rounds
#                                               # (default shapes 8x4096:32,1x32768:32)
#   bash scripts/try_prepared.sh test           # GPU tests + memcheck / racecheck with both on
#   bash scripts/try_prepared.sh groups [counts] # 1x32768x32 at forced group counts (default
#                                               # 5 6 8), this checkout and both on: paired
#                                               # pass-one blocks run one per SM, so 5 groups
#                                               # (128 blocks) fill one wave where 8 take 1.7
#   bash scripts/try_prepared.sh profile [paired] # ncu on pass one (1x32768x32, 8 groups) with the
#                                               # swizzled tiles (and the paired pass one):
#                                               # $OUT/profile_prepared/ (profile.sh's files)
#   bash scripts/try_prepared.sh split [shapes] # the K-split single walk (resources.WALK_SPLIT_K)
#                                               # at bv32 / bv16, one group, against the unsplit
#                                               # bv32 walk and this checkout's bv128 grouped walk
#                                               # (default shapes 1x32768:32,1x131072:8)
#
# Each mode fits one 10-minute device call (carry [".whl"]). Results are appended to
# $OUT/prepared_time.txt and $OUT/prepared_test.log as they come, so a call cut short still
# returns what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen-out}; mkdir -p "$OUT"
mode=${1:-time}
sw=CHUNK_SWIZZLE=True pr=PASS_ONE_PAIRED=True

source scripts/set_constants.sh

# A copy of this checkout in $tree with the given CONST=V set in its resources.py.
tree=/tmp/kdagen-prepared
prepared_tree() {
  rm -rf "$tree"; mkdir -p "$tree"
  cp -r kdagen templates scripts tests examples "$tree/" || return 2
  [ -d .whl ] && ln -s "$PWD/.whl" "$tree/.whl"
  set_constants "$tree/kdagen/resources.py" "$@"
}

# This checkout without the walk's fixed-count o stores (landed in session 17 untimed:
# docs/wip/walk-store-o-fixed-count.patch, reversed), for the `time` A/B.
prev=/tmp/kdagen-prev
prev_tree() {
  rm -rf "$prev"; mkdir -p "$prev"
  cp -r kdagen templates scripts "$prev/" || return 2
  patch -s -R -p1 -d "$prev" < docs/wip/walk-store-o-fixed-count.patch
}

case "$mode" in
  time)
    shapes=${2:-8x4096:32,1x32768:32}
    prev_tree || echo "no prev tree (patch failed): the prev rows will be missing"
    bash scripts/ab_variants.sh "$shapes lower_bound 16 128" \
      base: prev@$prev: sw:$sw pr:$pr swpr:$sw,$pr base2: prev2@$prev: sw2:$sw pr2:$pr swpr2:$sw,$pr \
      2>&1 | tee -a "$OUT/prepared_time.txt"
    ;;
  test)
    prepared_tree $sw $pr || exit 2
    (cd "$tree" && LOGS="$OUT/logs_prepared" KDAGEN_SANITIZE_TOOLS="${KDAGEN_SANITIZE_TOOLS:-memcheck racecheck}" \
      KDAGEN_CACHE_DIR=/tmp/kdagen-cache-prepared bash scripts/gpu_check.sh quick) 2>&1 \
      | tee -a "$OUT/prepared_test.log" | tail -n 25
    ;;
  groups)
    for g in ${2:-5 6 8}; do
      echo "groups $g" | tee -a "$OUT/prepared_time.txt"
      KDAGEN_GROUPS=$g KDAGEN_AB_KEEP=1 bash scripts/ab_variants.sh "1x32768:32 lower_bound 16 128" \
        base: swpr:$sw,$pr 2>&1 | tee -a "$OUT/prepared_time.txt"
    done
    ;;
  profile)
    if [ "${2:-}" = paired ]; then prepared_tree $sw $pr || exit 2; else prepared_tree $sw || exit 2; fi
    (cd "$tree" && OUT="$OUT/profile_prepared" KDAGEN_NCU_KERNELS=chunk_kernel KDAGEN_NCU_SKIP=2 \
      KDAGEN_GROUPS=8 bash scripts/profile.sh 1x32768:32 lower_bound 16 128) 2>&1 | tee -a "$OUT/prepared_profile.log"
    ;;
  split)
    shapes=${2:-1x32768:32,1x131072:8}
    echo "bv128, the tuned groups (this checkout)" | tee -a "$OUT/prepared_time.txt"
    bash scripts/ab_variants.sh "$shapes lower_bound 16 128" base: 2>&1 | tee -a "$OUT/prepared_time.txt"
    echo "bv32, one group: unsplit / split in 2, 4, 8 waves" | tee -a "$OUT/prepared_time.txt"
    KDAGEN_GROUPS=1 bash scripts/ab_variants.sh "$shapes lower_bound 16 32" \
      bv32: ks2:WALK_SPLIT_K=2 ks4:WALK_SPLIT_K=4 ks8:WALK_SPLIT_K=8 2>&1 | tee -a "$OUT/prepared_time.txt"
    echo "bv16, one group: split in 4, 8 waves" | tee -a "$OUT/prepared_time.txt"
    KDAGEN_GROUPS=1 bash scripts/ab_variants.sh "$shapes lower_bound 16 16" \
      ks4w16:WALK_SPLIT_K=4 ks8w16:WALK_SPLIT_K=8 2>&1 | tee -a "$OUT/prepared_time.txt"
    ;;
  *) echo "usage: $0 time [shapes] | test | groups [counts] | profile [paired] | split [shapes]"; exit 2 ;;
esac
