#!/usr/bin/env bash
# One device call that narrows down the CUDA-graph fault of v16 (docs/BENCHMARKS.md,
# "Open bug"): each part of the lower-bound c16 prefill captured and replayed alone at the
# failing shapes, in processes of their own (a fault ends the CUDA context), with a GPU
# core dump on the first exception decoded by cuda-gdb where it is installed (kernel, PC
# and, through -lineinfo, the source line), then synccheck over one graph replay. Every
# line goes straight to $OUT/graph_fault.txt, so a run cut short still reports.
#
#   bash scripts/graph_fault.sh [REPS]     # run with carry [".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carried_wheels.sh
export PYTHONUNBUFFERED=1 KDAGEN_CACHE_DIR=${KDAGEN_CACHE_DIR:-/tmp/kdagen-cache}
export KDAGEN_DEVICE_FLAGS=-lineinfo
OUT=${OUT:-/tmp/kdagen-out}; LOGS=/tmp/graph_fault; mkdir -p "$OUT" "$LOGS"
LOG=$OUT/graph_fault.txt
reps=${1:-1}
say() { echo "$*" | tee -a "$LOG"; }
say "tools: $(command -v cuda-gdb || echo 'no cuda-gdb') $(command -v compute-sanitizer || echo 'no compute-sanitizer')"
start=$(date +%s)
python3 -c "import kdagen; kdagen.load(dict(target='sm_90', gate='lower_bound', chunk_size=16))" 2>&1 | tail -n 2 >> "$LOG"
say "build: $(( $(date +%s) - start )) s"
for sg in "1x2048x32 4" "64x256x32 1" "1x2048x32 1"; do
  read -r shape groups <<< "$sg"
  for part in prefill chunk prologue; do
    for r in $(seq "$reps"); do
      core="$LOGS/core_${shape}_${groups}_${part}_$r"
      timeout 60 env CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 \
        CUDA_COREDUMP_FILE="$core" \
        python3 scripts/graph_check.py lower_bound "$shape" "$groups" 2 "$part" \
        > "$LOGS/log.txt" 2>&1
      rc=$?
      say "== $shape groups $groups $part run $r: rc $rc, $(( $(date +%s) - start )) s"
      grep -E 'graph_check|Error|error' "$LOGS/log.txt" | tail -n 4 >> "$LOG"
      if [ -s "$core" ] && command -v cuda-gdb > /dev/null; then
        timeout 60 cuda-gdb -batch -ex "target cudacore $core" -ex "info cuda kernels" \
          -ex "x/6i \$pc - 32" -ex "info line *\$pc" -ex "bt" 2>&1 | tail -n 20 >> "$LOG"
      fi
    done
  done
done
say "== synccheck over the graph replay (1x2048x32, 4 groups)"
timeout 120 compute-sanitizer --tool synccheck python3 scripts/graph_check.py lower_bound 1x2048x32 4 2 prefill \
  2>&1 | grep -v 'Host Frame' | tail -n 6 >> "$LOG"
say "done: $(( $(date +%s) - start )) s"
