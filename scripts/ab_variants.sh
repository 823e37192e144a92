#!/usr/bin/env bash
# A/B of kdagen/resources.py constants in one GPU call: each variant is a copy of this
# tree with its constants set, all built in parallel (own cache each), then timed one
# after another by scripts/profile_breakdown.py (CUDA-graph replay and per-kernel device
# times from the profiler).
#
#   bash scripts/ab_variants.sh "shapes gate chunk width" NAME:CONST=V[,CONST=V] ...
#   e.g. bash scripts/ab_variants.sh "8x4096:32 lower_bound 16 128" \
#          mma:CHUNK_WGMMA=False wgmma:CHUNK_WGMMA=True wg4:CHUNK_WGMMA=True,CHUNK_STAGES=4
#
# NAME@TREE:... takes kdagen/, templates/ and scripts/ from TREE instead of this checkout
# (an older commit: `git worktree add` or `git archive` it under build/ and carry it), so
# a code change can be timed against its parent in the same call; ':' alone sets nothing.
# NAME+PATCH[+PATCH2...]:... (after any @TREE) applies each PATCH in turn (a `git diff`,
# e.g. one of docs/wip/; its changes outside those three folders are left out) to the
# variant's copy, so kept patches are timed against this checkout, alone and stacked,
# without preparing a tree:
#   base: p+docs/wip/a.patch: pq+docs/wip/a.patch+docs/wip/b.patch:
# Prints one line per variant and shape; the constants must exist in resources.py.
# KDAGEN_GROUPS (a chunk-group count for every shape) reaches profile_breakdown.py.
# KDAGEN_AB_DRY=1 prepares the variants' copies (constants set, patches applied) in
# KDAGEN_AB_ROOT (default /tmp/kdagen-ab) and stops: a call's arguments checked on the CPU
# before any device time is spent.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/carried_wheels.sh
source scripts/set_constants.sh
export PYTHONUNBUFFERED=1
read -r shapes gate chunk width <<< "$1"; shift
root=${KDAGEN_AB_ROOT:-/tmp/kdagen-ab}
# KDAGEN_AB_KEEP=1 keeps the variants built by an earlier invocation of this call (another
# KDAGEN_GROUPS, other shapes): their build caches are then hits.
[ -n "${KDAGEN_AB_KEEP:-}" ] || rm -rf "$root"
mkdir -p "$root"
names=()
for v in "$@"; do
  name=${v%%:*}; sets=${v#*:}; tree=.; patches=()
  if [[ $name == *+* ]]; then IFS=+ read -r -a patches <<< "${name#*+}"; name=${name%%+*}; fi
  if [[ $name == *@* ]]; then tree=${name#*@}; name=${name%%@*}; fi
  d=$root/$name; names+=("$name")
  mkdir -p "$d"; cp -r "$tree/kdagen" "$tree/templates" "$tree/scripts" "$d/" || exit 2
  for patch in "${patches[@]}"; do  # in the order given, each on the last
    patch=$(realpath "$patch")
    (cd "$d" && git apply --include='kdagen/*' --include='templates/*' --include='scripts/*' "$patch") \
      || { echo "patch $patch does not apply to $name"; exit 2; }
  done
  set_constants "$d/kdagen/resources.py" ${sets//,/ } || exit 2
  [ -n "${KDAGEN_AB_DRY:-}" ] && { echo "$name: prepared in $d"; continue; }
  (cd "$d" && KDAGEN_CACHE_DIR="$d/cache" PYTHONPATH="$d:$PYTHONPATH" python3 -c "
import kdagen
kdagen.load(dict(target='sm_90', head_dim=128, chunk_size=$chunk, block_width=$width, gate='$gate'))
" > "$d/build.log" 2>&1 || echo "build of $name failed: $(tail -n 3 "$d/build.log")") &
done
wait
[ -n "${KDAGEN_AB_DRY:-}" ] && exit 0
for name in "${names[@]}"; do
  d=$root/$name
  (cd "$d" && KDAGEN_CACHE_DIR="$d/cache" PYTHONPATH="$d:$PYTHONPATH" timeout 120 \
    python3 scripts/profile_breakdown.py "$shapes" "$gate" "$chunk" "$width" 2>&1 \
    | grep "^kda_" | sed "s/^/$name /; s/, at::native.*//")
done
