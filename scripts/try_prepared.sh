#!/usr/bin/env bash
# One device call for the walk changes prepared on the CPU and not yet timed (docs/NOTES.md,
# "Next after v20"): the swizzled 16-column tiles (docs/wip/chunk16-swizzled-tiles.patch)
# and the paired pass one (resources.PASS_ONE_PAIRED), each alone and both together.
#
#   bash scripts/try_prepared.sh time [shapes]  # A/B against this checkout, two rounds
#                                               # (default shapes 8x4096:32,1x32768:32)
#   bash scripts/try_prepared.sh test           # GPU tests + memcheck / racecheck with both on
#
# Each mode fits one 10-minute device call (carry [".whl"]). Results are appended to
# $OUT/prepared_time.txt and $OUT/prepared_test.log as they come, so a call cut short still
# returns what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen-out}; mkdir -p "$OUT"
mode=${1:-time}
tree=/tmp/kdagen-swizzled
rm -rf "$tree"; mkdir -p "$tree"
cp -r kdagen templates scripts tests examples "$tree/" || exit 2
[ -d .whl ] && ln -s "$PWD/.whl" "$tree/.whl"
patch -p1 -s -d "$tree" < docs/wip/chunk16-swizzled-tiles.patch || { echo "the swizzle patch does not apply"; exit 2; }

case "$mode" in
  time)
    shapes=${2:-8x4096:32,1x32768:32}
    bash scripts/ab_variants.sh "$shapes lower_bound 16 128" \
      base: sw@"$tree": pr:PASS_ONE_PAIRED=True swpr@"$tree":PASS_ONE_PAIRED=True \
      base2: sw2@"$tree": pr2:PASS_ONE_PAIRED=True swpr2@"$tree":PASS_ONE_PAIRED=True \
      2>&1 | tee -a "$OUT/prepared_time.txt"
    ;;
  test)
    sed -i "s/^PASS_ONE_PAIRED = .*/PASS_ONE_PAIRED = True/" "$tree/kdagen/resources.py"
    grep -q "^PASS_ONE_PAIRED = True" "$tree/kdagen/resources.py" || exit 2
    (cd "$tree" && LOGS="$OUT/logs_prepared" KDAGEN_SANITIZE_TOOLS="${KDAGEN_SANITIZE_TOOLS:-memcheck racecheck}" \
      KDAGEN_CACHE_DIR=/tmp/kdagen-cache-prepared bash scripts/gpu_check.sh quick) 2>&1 \
      | tee -a "$OUT/prepared_test.log" | tail -n 25
    ;;
  *) echo "usage: $0 time [shapes] | test"; exit 2 ;;
esac
