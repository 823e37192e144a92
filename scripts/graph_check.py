"""Each step of the bench's CUDA-graph timing for one shape, with a line before each, so a
fault names its step (run under CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer):

    python3 scripts/graph_check.py GATE NxTxH GROUPS [SETS]
"""

from __future__ import annotations

import sys

import torch

import kdagen
from kdagen.bench import graph_ms
from kdagen.jit import device_target
from kdagen.testing import make_inputs
from kdagen.varlen import prepare_chunk_indices


def step(name: str) -> None:
    print(f"graph_check: {name}", flush=True)


def main() -> None:
    gate, shape, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nsets = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    n, t, h = (int(v) for v in shape.split("x"))
    kern = kdagen.load({"target": device_target(), "gate": gate, "chunk_size": 16})
    sets = [make_inputs([t] * n, h, 128, gate=gate, seed=s) for s in range(nsets)]
    inits = [torch.randn(n, h, 128, 128, device="cuda") * 0.05 for _ in range(nsets)]
    lb = sets[0].lower_bound
    for i, (x, init) in enumerate(zip(sets, inits)):
        step(f"set {i}: eager prefill, groups {groups}")
        kern.prefill(*x.args(), None, lb, x.cu_seqlens, init, True, groups=groups)
        torch.cuda.synchronize()
        step(f"set {i}: eager prefill with chunk indices")
        ci = prepare_chunk_indices(x.cu_seqlens, 16)
        kern.prefill(*x.args(), None, lb, x.cu_seqlens, init, True, groups=groups, chunk_indices=ci)
        torch.cuda.synchronize()
    step("graphs (the bench's graph_ms, its own group choice)")
    print(f"graph_check: graph ms {graph_ms(kern, sets, inits, lb, 5)}", flush=True)
    torch.cuda.synchronize()
    step("done")


if __name__ == "__main__":
    main()
