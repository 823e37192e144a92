"""Run kdagen's prologue and chunk scan a few times on one bench shape, for a profiler:

    KDAGEN_DEVICE_FLAGS=-lineinfo ncu --clock-control none -k regex:prologue \
        --launch-skip 2 --launch-count 1 --set full --import-source yes -o prof \
        python3 scripts/profile_kernels.py 1x32768:32 lower_bound [chunk] [width]

The prologue and the walk in the forms `Kernels.prefill` runs (u formed in the scan, the
akk instances, where the variant can). Also prints each kernel's median time (CUDA events)
when run without a profiler.
"""

from __future__ import annotations

import sys

import torch

from kdagen.bench import profile_argv, time_ms
from kdagen.testing import make_inputs


def main() -> None:
    ((n, t, h),), gate, kern = profile_argv(sys.argv, "1x32768:32")
    x = make_inputs([t] * n, h, 128, gate=gate, seed=1)
    init = torch.randn(n, h, 128, 128, device="cuda") * 0.05
    # the forms Kernels.prefill runs: u formed in the scan (akk, raw v) where the variant can
    defer = kern.scan_forms_u
    p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=defer)
    u = x.v if defer else p["u"]
    out = torch.empty_like(p["w"])

    def prologue(_):
        kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=defer)

    def chunk(_):
        kern.fused_kda_chunk(p["qg"], p["w"], u, p["kg_t"], p["aqk"], p["decay"], out, None,
                             x.cu_seqlens, init, True, akk=p.get("akk"))

    print(f"{n}x{t}x{h} {gate} ({'u from v' if defer else 'u from the prologue'}): "
          f"prologue {time_ms(prologue, 1, 5, 2):.3f} ms, chunk {time_ms(chunk, 1, 5, 2):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
