"""Host (Python) time of one Kernels.prefill and of each op's wrapper, with the kernels
stubbed out: the argument checks, the cu_seqlens lookup, the allocations and the group
choice, which an eager call pays before the GPU runs anything. Runs on the CPU.

    python3 scripts/host_overhead.py [tokens] [heads]
"""

from __future__ import annotations

import sys
import time

import torch

from kdagen.ops import Kernels
from kdagen.spec import KernelSpec
from kdagen.testing import make_inputs


def best_us(fn, reps: int = 400, rounds: int = 5) -> float:
    """The best of ``rounds`` means over ``reps`` calls, in microseconds."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e6)
    return best


def main(tokens: int = 64, heads: int = 4) -> None:
    stub = {name: (lambda *a: None) for name in ("prologue", "chunk", "recurrent")}
    spec = KernelSpec.parse({"target": "sm_90", "chunk_size": 16, "gate": "lower_bound"})
    kern = Kernels(spec, stub, device_type="cpu")
    x = make_inputs([tokens], heads, 128, device="cpu", gate="lower_bound", seed=1)
    init = torch.zeros(1, heads, 128, 128)
    args = (*x.args(), None, x.lower_bound, x.cu_seqlens)
    p = kern.fused_kda_prologue(*args, defer_u=True)
    out = torch.empty_like(x.v)
    calls = {
        "prefill": lambda: kern.prefill(*args, init, True, groups=4),
        "fused_kda_prologue": lambda: kern.fused_kda_prologue(*args, defer_u=True),
        "fused_kda_chunk": lambda: kern.fused_kda_chunk(
            p["qg"], p["w"], x.v, p["kg_t"], p["aqk"], p["decay"], out, None, x.cu_seqlens, init,
            True, groups=4, akk=p["akk"]),
    }
    for name, fn in calls.items():
        print(f"{name}: {best_us(fn):.1f} us")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
