# Sourced by the GPU scripts (from the repository root): install the wheels carried in
# .whl/ (pydantic & co, fla-core; the device has no network) into /tmp/kdagen-site and put
# them, then this checkout, on PYTHONPATH. .whl/ may hold a compiled wheel (pydantic-core)
# for several Pythons; only the pure ones and those built for this interpreter's tag
# (cpXY) are installed.
if ls .whl/*.whl >/dev/null 2>&1; then
  tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheels=()
  for w in .whl/*.whl; do
    case $w in *-py3-none-any.whl|*-py2.py3-none-any.whl|*-$tag-*) wheels+=("$w") ;; esac
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kdagen-site "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/kdagen-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
