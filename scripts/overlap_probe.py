"""Probe: does running the chunk scan of one part of a batch beside the prologue of the
next part beat the two kernels back to back? (docs/NOTES.md, v17.)

    python3 scripts/overlap_probe.py NxT:H GATE SPLITS...    # e.g. 8x4096:32 lower_bound 2 4

The batch is cut into SPLITS parts (whole sequences where N > 1, token ranges of the one
sequence where N == 1, each part's walk starting from the last one's final state). The
prologue of part i runs on the main stream; the walk of part i waits for it on a second,
higher-priority stream, so it overlaps the prologue of part i + 1. Prints the device time
(CUDA events, eager and CUDA graph) against `Kernels.prefill`, and the error against it.
"""

from __future__ import annotations

import sys

import torch

import kdagen
from kdagen.bench import time_ms
from kdagen.jit import device_target
from kdagen.testing import make_inputs, rel_err
from kdagen.varlen import prepare_chunk_indices


def parts_of(n: int, t: int, splits: int) -> list[tuple[int, int, int, int]]:
    """(first sequence, end sequence, first token, end token) of each part."""
    if n > 1:
        if n % splits:
            raise SystemExit(f"{n} sequences do not split into {splits} parts")
        per = n // splits
        return [(i * per, (i + 1) * per, i * per * t, (i + 1) * per * t) for i in range(splits)]
    if t % (16 * splits):
        raise SystemExit(f"{t} tokens do not split into {splits} parts of whole chunks")
    per = t // splits
    return [(0, 1, i * per, (i + 1) * per) for i in range(splits)]


def main() -> None:
    nt, h = sys.argv[1].split(":")
    n, t = (int(v) for v in nt.split("x"))
    h = int(h)
    gate, splits = sys.argv[2], [int(s) for s in sys.argv[3:]] or [2, 4]
    kern = kdagen.load({"target": device_target(), "gate": gate, "chunk_size": 16})
    x = make_inputs([t] * n, h, 128, gate=gate, seed=1)
    init = torch.randn(n, h, 128, 128, device="cuda") * 0.05
    lb = x.lower_bound
    ci = prepare_chunk_indices(x.cu_seqlens, 16)

    def whole():
        return kern.prefill(*x.args(), None, lb, x.cu_seqlens, init, True, chunk_indices=ci)

    o_ref, s_ref = whole()
    rows = [("prefill", whole, 0.0)]
    walk_stream = torch.cuda.Stream(priority=-1)
    for S in splits:
        parts = parts_of(n, t, S)
        args = []
        for s0, s1, t0, t1 in parts:
            cu = (x.cu_seqlens[s0:s1 + 1] - x.cu_seqlens[s0]).to(torch.int32) if n > 1 else \
                torch.tensor([0, t1 - t0], dtype=torch.int32, device="cuda")
            sl = [a[:, t0:t1] for a in x.args()[:5]] + list(x.args()[5:])
            args.append((sl, cu, prepare_chunk_indices(cu, 16), s0, s1, t0, t1))
        out = torch.empty_like(o_ref)  # (args, held by split_call, keeps each part's indices alive)
        groups = [kern._choose_groups((t1 - t0) // (s1 - s0) // 16, s1 - s0, h, out.device)
                  for _, _, _, s0, s1, t0, t1 in args]

        def split_call(args=args, out=out, groups=groups):
            main_stream = torch.cuda.current_stream()
            walk_stream.wait_stream(main_stream)
            states, state, keep = [], None, []
            for (sl, cu, pci, s0, s1, t0, t1), g in zip(args, groups):
                p = kern.fused_kda_prologue(*sl, None, lb, cu, chunk_indices=pci, defer_u=True)
                keep.append(p)
                ready = torch.cuda.Event()
                ready.record(main_stream)
                walk_stream.wait_event(ready)
                with torch.cuda.stream(walk_stream):
                    start = init[s0:s1] if n > 1 or state is None else state
                    _, state = kern.fused_kda_chunk(p["qg"], p["w"], sl[2], p["kg_t"], p["aqk"],
                                                    p["decay"], out[:, t0:t1], None, cu, start,
                                                    True, groups=g, akk=p["akk"])
                    states.append(state)
            main_stream.wait_stream(walk_stream)  # (so `keep` may be freed on return)
            return out, (torch.cat(states) if n > 1 else state)

        o, s = split_call()
        torch.cuda.synchronize()
        err = max(rel_err(o, o_ref), rel_err(s, s_ref))
        rows.append((f"split {S} (groups {groups[0]})", split_call, err))
    print(f"{n}x{t}x{h} {gate}", flush=True)
    for name, fn, err in rows:
        eager = time_ms(lambda _: fn(), 1, 20)
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()  # (the stream priority may not carry into the graph)
        with torch.cuda.graph(graph):
            fn()
        replay = time_ms(lambda _: graph.replay(), 1, 20)
        print(f"  {name}: eager {eager:.3f} ms, graph {replay:.3f} ms, err vs prefill {err:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
