"""Run kdagen's prologue and chunk scan a few times on one bench shape, for a profiler:

    KDAGEN_DEVICE_FLAGS=-lineinfo ncu --clock-control none -k regex:prologue \
        --launch-skip 2 --launch-count 1 --set full --import-source yes -o prof \
        python3 scripts/profile_kernels.py 1x32768:32 lower_bound [chunk] [width]

Also prints each kernel's median time (CUDA events) when run without a profiler.
"""

from __future__ import annotations

import sys

import torch

import kdagen
from kdagen.bench import parse_shapes, time_ms
from kdagen.jit import device_target
from kdagen.testing import make_inputs


def main() -> None:
    (n, t, h), = parse_shapes(sys.argv[1] if len(sys.argv) > 1 else "1x32768:32")
    gate = sys.argv[2] if len(sys.argv) > 2 else "lower_bound"
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    width = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    kern = kdagen.load({"target": device_target(), "gate": gate, "chunk_size": chunk,
                        "block_width": width})
    x = make_inputs([t] * n, h, 128, gate=gate, seed=1)
    init = torch.randn(n, h, 128, 128, device="cuda") * 0.05
    p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    out = torch.empty_like(p["u"])

    def prologue(_):
        kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)

    def chunk(_):
        kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], out, None,
                             x.cu_seqlens, init, True)

    print(f"{n}x{t}x{h} {gate}: prologue {time_ms(prologue, 1, 5, 2):.3f} ms, "
          f"chunk {time_ms(chunk, 1, 5, 2):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
