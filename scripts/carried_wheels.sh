# Sourced by the GPU scripts (from the repository root): install the wheels carried in
# .whl/ (pydantic & co, fla-core; the device has no network) into /tmp/kdagen-site and put
# them, then this checkout, on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kdagen-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kdagen-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
