#!/usr/bin/env bash
# Profile the prologue and the chunk scan with Nsight Compute on one bench shape
# (built with -lineinfo so the source page maps SASS to template lines).
#   bash scripts/profile.sh [shape] [gate] [chunk] [width]   e.g. 1x32768:32 lower_bound 32 128
# Writes $OUT/details_{prologue,chunk}.txt, sass_*.csv.gz (the SASS page), lines_*.txt
# (stall samples and instructions per template line: scripts/ncu_lines.py) and mem_*.txt
# (shared wavefronts and L2 sectors per line, whole launch: ncu_lines.py --memory); the reports
# stay in /tmp/kdagen-ncu (few files come back from the device tool).
# KDAGEN_NCU_KERNELS (default "prologue_kernel chunk_kernel") picks the kernels and
# KDAGEN_NCU_SKIP (default 1) how many of each kernel's launches to skip: at a grouped shape
# the chunk scan launches pass one then pass two per call, so 2 profiles the second call's
# pass one and 1 the first call's pass two.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen-out}; mkdir -p "$OUT"
source scripts/carried_wheels.sh
export KDAGEN_CACHE_DIR=${KDAGEN_CACHE_DIR:-/tmp/kdagen-cache} KDAGEN_DEVICE_FLAGS=-lineinfo
shape=${1:-1x32768:32}; gate=${2:-lower_bound}; chunk=${3:-64}; width=${4:-128}
python3 scripts/profile_kernels.py "$shape" "$gate" "$chunk" "$width" || exit 1
REP=/tmp/kdagen-ncu; mkdir -p "$REP"
python3 scripts/ncu_lines.py --listing "$REP/listing.sass" "$shape" "$gate" "$chunk" "$width" > /dev/null || exit 1
for k in ${KDAGEN_NCU_KERNELS:-prologue_kernel chunk_kernel}; do
  name=${k%_kernel}
  ncu --clock-control none -k "regex:$k" --launch-skip "${KDAGEN_NCU_SKIP:-1}" --launch-count 1 --set full \
    --import-source yes -f -o "$REP/$name" python3 scripts/profile_kernels.py "$shape" "$gate" "$chunk" "$width" \
    > "$REP/ncu_$name.log" 2>&1 || tail -n 20 "$REP/ncu_$name.log"
  ncu -i "$REP/$name.ncu-rep" --page details > "$OUT/details_$name.txt" 2>&1
  ncu -i "$REP/$name.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/sass_$name.csv.gz"
  python3 scripts/ncu_lines.py "$OUT/sass_$name.csv.gz" "$REP/listing.sass" "$k" 30 > "$OUT/lines_$name.txt" 2>&1
  python3 scripts/ncu_lines.py --memory "$OUT/sass_$name.csv.gz" "$REP/listing.sass" "$k" 30 > "$OUT/mem_$name.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|Compute \(SM\)|Shared Memory Configuration Size|Block Limit" "$OUT/details_$name.txt" | head -n 20
  head -n 25 "$OUT/lines_$name.txt"
done
