# Sourced by the A/B scripts: set_constants RESOURCES_PY CONST=V ... sets module constants
# in a copy of kdagen/resources.py, and fails on a name that file does not define.
set_constants() {
  local file=$1 kv k v
  shift
  for kv in "$@"; do
    k=${kv%%=*} v=${kv#*=}
    grep -q "^$k = " "$file" || { echo "no constant $k in resources.py"; return 2; }
    sed -i "s/^$k = .*/$k = $v/" "$file"
  done
}
