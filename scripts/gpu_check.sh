#!/usr/bin/env bash
# One call on a GPU machine: install the carried wheels, build every variant the GPU
# tests need (one ninja graph, in parallel), run the GPU tests, run the benchmark,
# and print a short table last.
#
#   bash scripts/gpu_check.sh [quick|bench|sanitize]
#     quick: build, GPU tests and sanitizers; bench: the bench's variants, tune + benchmark;
#     sanitize: only the variants scripts/sanitize_ops.py loads (examples/sanitize_grid.yaml)
#     and compute-sanitizer over every op (a few minutes: no tests, no bench)
#
# KDAGEN_GPU_TESTS narrows the test files, KDAGEN_SANITIZE=0 skips compute-sanitizer,
# KDAGEN_SANITIZE_TOOLS picks its tools, KDAGEN_BENCH_REPS / _GATES / _SHAPES shape the
# benchmark, KDAGEN_BENCH_CHUNK fixes its chunk size (no chunk-size tuning). `bench` builds
# only the bench's variants (examples/bench_grid.yaml; with KDAGEN_BENCH_CHUNK only that chunk
# size's, for KDAGEN_BENCH_GATES). A bench too long for one call goes
# in parts (KDAGEN_BENCH_GATES=lower_bound, then softplus), each part's $OUT/bench.json
# joined after by `kdagen bench --merge a.json,b.json --markdown ... --plot ...`.
# The autotune choices made on the way come back as $OUT/tune/<device>.json.
#
# .whl/ (git-ignored) holds those wheels: `pip download -d .whl --no-deps pydantic
# pydantic-core annotated-types typing-inspection fla-core==0.6.0`, plus pydantic-core for
# the device's Python if it is not this machine's (`--only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64`; scripts/carried_wheels.sh installs the one that fits).
# On the device tool: run with carry [".whl"] (pydantic & co, fla-core wheels), and pass
# KDAGEN_COMMIT=<local HEAD>: the device's copy of .git can be older than its files, and
# the benchmark table names the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  quick|bench|sanitize|"") ;;
  *) echo "gpu_check: unknown mode '$1' (quick, bench, sanitize or none)"; exit 2 ;;
esac
OUT=${OUT:-/tmp/kdagen-out}
LOGS=${LOGS:-/tmp/kdagen-logs}
mkdir -p "$OUT" "$LOGS"; rm -f "$OUT/errors.jsonl"
# the logs come back as $OUT/logs.tgz also when the device call's time limit stops this
# script (SIGTERM): a run cut short still says how far it got
trap 'tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null' EXIT
trap 'echo "gpu_check: stopped (SIGTERM)"; exit 143' TERM
source scripts/carried_wheels.sh
export PYTHONUNBUFFERED=1
export KDAGEN_CACHE_DIR=${KDAGEN_CACHE_DIR:-/tmp/kdagen-cache}
export KDAGEN_JOBS=${KDAGEN_JOBS:-$(nproc)}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

t0=$(date +%s)
grid=examples/gpu_grid.yaml; [ "${1:-}" = bench ] && grid=examples/bench_grid.yaml
[ "${1:-}" = sanitize ] && grid=examples/sanitize_grid.yaml
if [ "${1:-}" = bench ] && [ -n "${KDAGEN_BENCH_CHUNK:-}" ]; then
  # a fixed chunk size: build only the variants this bench part loads
  grid=$LOGS/bench_grid.yaml
  printf 'grids:\n  - grid:\n      head_dim: [128]\n      chunk_size: [%s]\n      gate: [%s]\n' \
    "$KDAGEN_BENCH_CHUNK" "${KDAGEN_BENCH_GATES:-lower_bound,softplus}" > "$grid"
fi
python3 -m kdagen.cli variants "$grid" 2>&1 | tail -n 5 | tee "$LOGS/build.log"
build_rc=${PIPESTATUS[0]}
t1=$(date +%s)
tests_rc=1; [ "${1:-}" = bench ] || [ "${1:-}" = sanitize ] && tests_rc=skipped
if [ "$build_rc" = 0 ] && [ "$tests_rc" != skipped ]; then
  KDAGEN_RECORD="$OUT/errors.jsonl" python3 -m pytest ${KDAGEN_GPU_TESTS:-tests/test_gpu_kernels.py tests/test_gpu_torch.py tests/test_gpu_stress.py tests/test_gpu_builds.py} -m gpu -q -rfEs --durations=8 -p no:cacheprovider 2>&1 | tee "$LOGS/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
  python3 examples/prefill_decode.py 2>&1 | tee "$LOGS/examples.log"; python3 examples/kda_layer.py 2>&1 | tee -a "$LOGS/examples.log"
  [ -f "$OUT/errors.jsonl" ] && python3 scripts/summarize_errors.py "$OUT/errors.jsonl" > "$OUT/validation.md"
fi
t2=$(date +%s)
san_rc=skipped
if [ "${1:-}" = sanitize ] && ! command -v compute-sanitizer >/dev/null; then
  echo "gpu_check: sanitize asked for, but compute-sanitizer is not on PATH"; san_rc=missing
fi
if [ "${KDAGEN_SANITIZE:-1}" = 1 ] && [ "$build_rc" = 0 ] && [ "${1:-}" != bench ] && command -v compute-sanitizer >/dev/null; then
  san_rc=""
  for tool in ${KDAGEN_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    timeout 110 compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
      python3 scripts/sanitize_ops.py > "$LOGS/sanitizer_$tool.log" 2>&1
    rc=$?; san_rc="$san_rc $tool=$rc"
    tail -n 3 "$LOGS/sanitizer_$tool.log"
  done
fi
bench_rc=skipped
tune_rc=skipped
if [ "${1:-}" != quick ] && [ "${1:-}" != sanitize ] && [ "$build_rc" = 0 ]; then
  # measured chunk sizes (and each one's group counts) for the bench shapes into this
  # GPU's autotune cache (used below)
  # (KDAGEN_BENCH_CHUNK=16 fixes the chunk size instead: no chunk-size tuning, each shape's
  # group count tuned on first use; the bench then fits one 10-minute device call)
  bench_chunk=auto
  if [ -n "${KDAGEN_BENCH_CHUNK:-}" ]; then
    bench_chunk=$KDAGEN_BENCH_CHUNK; export KDAGEN_AUTOTUNE=1
  else
    python3 -m kdagen.cli tune --gates lower_bound,softplus --chunk-sizes "${KDAGEN_TUNE_CHUNKS:-16,32,64}" \
      --reps 10 2>&1 | tee "$LOGS/tune.log"
    tune_rc=${PIPESTATUS[0]}
  fi
  python3 -m kdagen.cli bench --reps "${KDAGEN_BENCH_REPS:-30}" --gates "${KDAGEN_BENCH_GATES:-lower_bound,softplus}" \
    ${KDAGEN_BENCH_SHAPES:+--shapes "$KDAGEN_BENCH_SHAPES"} --chunk-size "$bench_chunk" --markdown "$OUT/bench.md" \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$LOGS/bench.log"
  bench_rc=${PIPESTATUS[0]}
  mkdir -p "$OUT/tune"; cp "$KDAGEN_CACHE_DIR"/tune/*.json "$OUT/tune/" 2>/dev/null || true
fi
t3=$(date +%s)
echo
echo "== kdagen GPU check =="
echo "build: rc=$build_rc ($((t1 - t0)) s); tests: rc=$tests_rc ($((t2 - t1)) s); sanitizer:$san_rc; tune: rc=$tune_rc; bench: rc=$bench_rc ($((t3 - t2)) s)"
grep -E "passed|failed|error" "$LOGS/gpu_tests.log" 2>/dev/null | tail -n 3
[ -f "$OUT/validation.md" ] && cat "$OUT/validation.md"
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
exit 0
