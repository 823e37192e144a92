"""Each step of the bench's CUDA-graph timing for one shape, with a line before each, so a
fault names its step (run under CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer):

    python3 scripts/graph_check.py GATE NxTxH GROUPS [SETS] [PART]

PART: prefill (default: the bench's graph_ms), prologue or chunk (one op captured and
replayed alone, its inputs from eager calls).
"""

from __future__ import annotations

import sys

import torch

import kdagen
from kdagen.bench import graph_ms
from kdagen.jit import device_target
from kdagen.testing import make_inputs, rel_err
from kdagen.varlen import prepare_chunk_indices


def step(name: str) -> None:
    print(f"graph_check: {name}", flush=True)


def replay_alone(fn, reps: int = 5):
    """Capture ``fn`` (after one eager call) and replay it ``reps`` times; returns the
    eager call's result and the captured one's (its tensors hold the last replay's)."""
    eager = fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fn()
    step("captured")
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    step("replayed")
    return eager, captured


def main() -> None:
    gate, shape, groups = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nsets = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    part = sys.argv[5] if len(sys.argv) > 5 else "prefill"
    n, t, h = (int(v) for v in shape.split("x"))
    kern = kdagen.load({"target": device_target(), "gate": gate, "chunk_size": 16})
    sets = [make_inputs([t] * n, h, 128, gate=gate, seed=s) for s in range(nsets)]
    inits = [torch.randn(n, h, 128, 128, device="cuda") * 0.05 for _ in range(nsets)]
    lb = sets[0].lower_bound
    for i, (x, init) in enumerate(zip(sets, inits)):
        ci = prepare_chunk_indices(x.cu_seqlens, 16)
        if part == "prologue":
            step(f"set {i}: prologue alone")
            replay_alone(lambda: kern.fused_kda_prologue(*x.args(), None, lb, x.cu_seqlens,
                                                         chunk_indices=ci, defer_u=True))
        elif part == "chunk":
            step(f"set {i}: chunk alone")
            p = kern.fused_kda_prologue(*x.args(), None, lb, x.cu_seqlens, defer_u=True)
            out = torch.empty_like(p["w"])
            replay_alone(lambda: kern.fused_kda_chunk(p["qg"], p["w"], x.v, p["kg_t"], p["aqk"],
                                                      p["decay"], out, None, x.cu_seqlens, init,
                                                      True, groups=groups, akk=p["akk"]))
        else:
            step(f"set {i}: eager prefill, groups {groups}")
            kern.prefill(*x.args(), None, lb, x.cu_seqlens, init, True, groups=groups)
            torch.cuda.synchronize()
            step(f"set {i}: eager prefill with chunk indices")
            kern.prefill(*x.args(), None, lb, x.cu_seqlens, init, True, groups=groups,
                         chunk_indices=ci)
            torch.cuda.synchronize()
    if part == "prefill":
        x, init = sets[0], inits[0]
        ci = prepare_chunk_indices(x.cu_seqlens, 16)
        step("one prefill captured, replayed against its eager result")
        (o_e, s_e), (o_g, s_g) = replay_alone(lambda: kern.prefill(
            *x.args(), None, lb, x.cu_seqlens, init, True, groups=groups, chunk_indices=ci), reps=1)
        err = max(rel_err(o_g, o_e), rel_err(s_g, s_e))
        print(f"graph_check: replay against eager {err:.2e}", flush=True)
        step("graphs (the bench's graph_ms, its own group choice)")
        print(f"graph_check: graph ms {graph_ms(kern, sets, inits, lb, 5)}", flush=True)
        torch.cuda.synchronize()
    step("done")


if __name__ == "__main__":
    main()
