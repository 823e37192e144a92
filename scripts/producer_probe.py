"""Probe: how fast can R prologue blocks per SM, each walking its chunks one after another,
produce chunks? The question behind the fused pass one (docs/NOTES.md, session 29): its
producer waves (one warpgroup beside the walk's eight waves, ~64-80 registers a lane)
must deliver a chunk of a head as fast as pass one walks one, or the fused kernel is
slower than the two kernels it replaces.

    python3 scripts/producer_probe.py [NxT:H] [R...]     # default 1x32768:32, R = 1 2 3 4 8

Two forms, each with its dynamic LDS padded so that R blocks fit an SM: (a) the prologue
kernel as kdagen launches it (a block per chunk and head; blocks replace each other), and
(b) ``producer_probe``: a block (the prologue's 128 threads and launch bound, so its
registers) runs ``prologue_chunk`` for chunks q, q + Q, q + 2Q, ... of one head, the grid
one wave of R blocks per SM, as a producer warpgroup inside the fused kernel would. Per
(chunk, head) a block then takes  t = time x SMs x R / (chunks x heads).  Prints that
against the prologue kernel as launched by kdagen (8 blocks per SM at c16), and whether
the outputs equal its outputs to the bit. NVIDIA only: nvcc builds the rendered kernels.hip with the probe at
its end into a shared library called through ctypes (the emulation's launch structs).
"""

from __future__ import annotations

import ctypes as ct
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kdagen.bench import time_ms
from kdagen.emulate import PrologueArgs, _ops
from kdagen.ops import Kernels
from kdagen.render import KERNEL_SOURCE, render
from kdagen.spec import KernelSpec
from kdagen.targets import get_target
from kdagen.testing import make_inputs
from kdagen.toolchain import device_compiler

PROBE = r"""
#include <cuda_runtime.h>
namespace kdagen {
// one block walks chunks blockIdx.y, + gridDim.y, ... of head blockIdx.x
template <bool kAkk>
__global__ void KDAGEN_LAUNCH_BOUNDS(Config::kPrologueThreads, Config::kPrologueMinBlocks)
producer_probe(PrologueArgs a) {
  for (int chunk = static_cast<int>(blockIdx.y); chunk < a.num_chunks; chunk += static_cast<int>(gridDim.y)) {
    prologue_chunk<Config, kAkk, 0, 0>(a, static_cast<int>(blockIdx.x), chunk, BlockBarrier{});
    __syncthreads();  // the next chunk reuses the LDS
  }
}
}  // namespace kdagen

static int probe_resident = 1;  // blocks per SM asked for
static int probe_loop = 1;      // 1: producer_probe's blocks walk chunks; 0: prologue_kernel, a block a chunk
static int probe_got = 0;       // blocks per SM the occupancy calculator reports

extern "C" void producer_probe_set(int resident, int loop) { probe_resident = resident; probe_loop = loop; }
extern "C" int producer_probe_got() { return probe_got; }

extern "C" int producer_probe(const kdagen::PrologueArgs* a, void*) {
  int dev = 0, sms = 0, per_sm = 0, reserved = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  const int need = kdagen::PrologueLayout<kdagen::Config>::kBytes;
  int bytes = per_sm / probe_resident - reserved;
  bytes = bytes < need ? need : (bytes / 16) * 16;
  auto kernel = probe_loop ? (a->akk != nullptr ? kdagen::producer_probe<true> : kdagen::producer_probe<false>)
                           : (a->akk != nullptr ? kdagen::prologue_kernel<kdagen::Config, true>
                                                : kdagen::prologue_kernel<kdagen::Config, false>);
  if (int e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)) return e;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&probe_got, kernel, kdagen::Config::kPrologueThreads, bytes);
  const int heads = a->num_heads;
  if (!probe_loop) {  // as kdagen launches it (chunks < 65536), R blocks per SM
    kernel<<<dim3(heads, a->num_chunks), kdagen::Config::kPrologueThreads, bytes>>>(*a);
    return static_cast<int>(cudaGetLastError());
  }
  int rows = (sms * probe_got + heads - 1) / heads;  // blocks per head: one wave of R per SM
  if (rows > a->num_chunks) rows = a->num_chunks;
  kernel<<<dim3(heads, rows), kdagen::Config::kPrologueThreads, bytes>>>(*a);
  return static_cast<int>(cudaGetLastError());
}
"""


def build(spec: KernelSpec, where: Path) -> ct.CDLL:
    """nvcc: the spec's rendered kernels.hip with PROBE at its end, as a shared library."""
    src = where / "src"
    render(spec).write(src, PROBE)
    cc = device_compiler(get_target(spec.target))
    obj, lib = where / "k.o", where / "k.so"
    logs = []
    for cmd in (cc.compile_command(str(src / KERNEL_SOURCE), str(obj), str(src / "include"), str(where / "k.d")),
                [cc.path, "-shared", str(obj), "-o", str(lib)]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{r.stderr[-3000:]}")
        logs.append(r.stdout + r.stderr)
    # ptxas -v: each kernel's registers / spills follow its "Compiling entry function" line
    for entry, usage in re.findall(r"Compiling entry function '(\S+)'.*?\n(.*?registers.*?)\n", logs[0], flags=re.S):
        if "producer_probe" in entry or "prologue_kernel" in entry:
            print(entry[:60], usage.strip())
    return ct.CDLL(str(lib))


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "1x32768:32"
    residents = [int(r) for r in sys.argv[2:]] or [1, 2, 3, 4, 8]
    nt, h = shape.split(":")
    n, t = (int(v) for v in nt.split("x"))
    H = int(h)
    spec = KernelSpec.parse(dict(head_dim=128, chunk_size=16, gate="lower_bound", target="sm_90",
                                 ops=["prologue"]))
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(spec, Path(tmp))
    probe = lib.producer_probe
    probe.restype, probe.argtypes = ct.c_int, [ct.POINTER(PrologueArgs), ct.c_void_p]
    lib.producer_probe_set.argtypes = [ct.c_int, ct.c_int]
    ops = _ops(lib, spec)
    kern = Kernels(spec, ops, device_type="cuda")
    probed = Kernels(spec, {"prologue": functools.partial(ops["prologue"], f=probe)}, device_type="cuda")
    sets = [make_inputs([t] * n, H, 128, gate="lower_bound", seed=s) for s in range(3)]
    chunks = sum((t + 15) // 16 for _ in range(n))
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def call(k: Kernels, i: int) -> dict:
        x = sets[i]
        return k.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=True)

    print(f"{torch.cuda.get_device_name()}, {shape}, c16 lower bound, {sms} SMs, {chunks} chunks x {H} heads")
    base = time_ms(functools.partial(call, kern), 3, 20)
    want = call(kern, 0)
    per = base * 1e3 * sms / (chunks * H)
    spec_blocks = int(re.search(r"kPrologueMinBlocks = (\d+)", render(spec).files[KERNEL_SOURCE])[1])
    print(f"| launch | blocks per SM | ms | us per (chunk, head) per block | SM-us per (chunk, head) | bitwise equal |")
    print("|---|---|---|---|---|---|")
    print(f"| prologue_kernel | {spec_blocks} (launch bound) | {base:.3f} | {per * spec_blocks:.2f} | {per:.3f} | - |")
    for loop, r in [(loop, r) for loop in (0, 1) for r in residents]:
        lib.producer_probe_set(r, loop)
        ms = time_ms(functools.partial(call, probed), 3, 10)
        got = lib.producer_probe_got()
        out = call(probed, 0)
        equal = all(torch.equal(out[k], want[k]) for k in want)
        per = ms * 1e3 * sms / (chunks * H)
        name = "producer_probe (a block walks its chunks)" if loop else "prologue_kernel, padded LDS"
        print(f"| {name} | {got} (asked {r}) | {ms:.3f} | {per * got:.2f} | {per:.3f} | {equal} |")


if __name__ == "__main__":
    main()
