#!/usr/bin/env bash
# One device call that narrows down the CUDA-graph fault of v16 (docs/BENCHMARKS.md,
# "Open bug"): each part of the c16 prefill captured and replayed alone, per gate and
# shape, several times, in processes of their own (a fault ends the CUDA context), with
# a GPU core dump on the first exception (kernel and PC; -lineinfo maps the PC to a
# template line), then synccheck / racecheck over the full graph replay. Logs and core
# dumps come back as $OUT/graph_fault.tgz.
#
#   bash scripts/graph_fault.sh [REPS]     # run with carry [".whl"]; logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carried_wheels.sh
export PYTHONUNBUFFERED=1 KDAGEN_CACHE_DIR=${KDAGEN_CACHE_DIR:-/tmp/kdagen-cache}
export KDAGEN_DEVICE_FLAGS=-lineinfo
OUT=${OUT:-/tmp/kdagen-out}; LOGS=/tmp/graph_fault; mkdir -p "$OUT" "$LOGS"
reps=${1:-2}  # 24 processes at 2: about 5 minutes, the sanitizers 2-3 more
python3 -c "import kdagen; [kdagen.load(dict(target='sm_90', gate=g, chunk_size=16)) for g in ('lower_bound', 'softplus')]" | tail -n 1
for gate in lower_bound softplus; do
  for sg in "1x2048x32 4" "64x256x32 1"; do
    read -r shape groups <<< "$sg"
    for part in prologue chunk prefill; do
      faults=0
      for r in $(seq "$reps"); do  # (each a fresh process: import, load, capture)
        timeout 90 env CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 \
          CUDA_COREDUMP_FILE="$LOGS/core_${gate}_${shape}_${part}_%p" \
          python3 scripts/graph_check.py "$gate" "$shape" "$groups" 4 "$part" \
          > "$LOGS/log_${gate}_${shape}_${part}_$r.txt" 2>&1 || faults=$((faults + 1))
      done
      echo "$gate $shape groups $groups $part: $faults of $reps runs faulted"
    done
  done
done
for tool in synccheck racecheck; do
  timeout 150 compute-sanitizer --tool "$tool" python3 scripts/graph_check.py lower_bound 1x2048x32 4 4 prefill \
    2>&1 | grep -v 'Host Frame' | tail -n 4
done
ls "$LOGS" | grep -c '^core_' | sed 's/^/core dumps: /'
tar czf "$OUT/graph_fault.tgz" -C "$LOGS" .  # (the device tool returns at most 8 files)
