#!/usr/bin/env bash
# Set up a fresh machine for kdagen: Debian's ROCm toolchain (hipcc, for AMD targets),
# the LLVM tools that read AMD device code, clang (the kernels' CPU emulation), torch, and kdagen itself with its test
# extra. nvcc (NVIDIA targets) comes from the CUDA toolkit already on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v hipcc >/dev/null || need+=(hipcc libamdhip64-dev rocm-device-libs)
command -v llvm-objdump-15 >/dev/null || need+=(llvm-15)
command -v clang-offload-bundler-15 >/dev/null || need+=(clang-tools-15)
command -v objcopy >/dev/null || need+=(binutils)
command -v clang++-15 >/dev/null || need+=(clang-15)  # the CPU emulation of the kernels
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
# cuobjdump + nvdisasm read the sm_90 SASS in the compile checks (HMMA present)
command -v cuobjdump >/dev/null || [ -x /usr/local/cuda/bin/cuobjdump ] ||
  python3 -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
command -v nvcc >/dev/null || echo "setup: note: nvcc not found; sm_90 compile checks will be skipped"
