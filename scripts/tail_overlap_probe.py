"""Probe (no kernel change): how much of a long sequence's prologue could hide behind
pass one. Pass one walks only the chunks before the last group's start, so the prologue
of the last group's chunks is not needed until pass two. Timed, one sequence of T tokens:

  serial   the prologue over all T tokens, then the chunk scan (as Kernels.prefill)
  split    the prologue over the tokens before the last group's start, then the chunk scan
  overlap  split, and on a second, lower-priority stream the prologue over the last
           group's tokens, ready once the split prologue is done (beside pass one); the
           streams join before the end event

Each is captured once as a CUDA graph (the overlap's two streams as a fork and a join)
and replayed behind a spin kernel (device time), median of many runs; the eager calls are
timed too. The ``cu_seqlens`` of each token range is made once, so after the first call
the ops find it checked and launch only their kernels. The probe's scan reads the serial
run's prologue outputs throughout (the second stream writes buffers of its own): only
times are compared, never values. The profiler's kernel timeline of one overlap run
then says whether the last group's prologue ended before pass two began, which a real
version would need (pass two reads it).

    python3 scripts/tail_overlap_probe.py [shapes] [gate] [chunk] [width]
        e.g. 1x32768:32 lower_bound 16 128 (shapes of one sequence; chunk 64 unless given)
"""

from __future__ import annotations

import sys

import torch

from kdagen.bench import profile_argv, profiled_kernels, time_ms
from kdagen.groups import group_start
from kdagen.testing import make_inputs
from kdagen.varlen import prepare_chunk_indices

def kernel_spans(fn) -> list[tuple[str, float, float]]:
    """(kernel, start us, end us) of every kernel one call of ``fn`` runs, in start order."""
    spans = []
    for ev in profiled_kernels(fn):
        if "kernel" in ev.name:
            # e.g. prologue_kernel<Config, true> (the template's arguments kept, not the call's)
            name = ev.name.replace("void ", "").replace("kdagen::", "").split("(")[0]
            spans.append((name, ev.time_range.start, ev.time_range.end))
    spans.sort(key=lambda s: s[1])
    t0 = spans[0][1] if spans else 0.0
    return [(n, a - t0, b - t0) for n, a, b in spans]


def main() -> None:
    shapes, gate, kern = profile_argv(sys.argv, "1x32768:32")
    C, dev = kern.spec.chunk_size, torch.device("cuda")
    side = torch.cuda.Stream()
    main_stream = torch.cuda.Stream(priority=-1)
    for n, t, h in shapes:
        if n != 1:
            print(f"tail_overlap_probe: {n}x{t}x{h} skipped (one sequence only)")
            continue
        x = make_inputs([t], h, 128, gate=gate, seed=1)
        q, k, v, g, beta, a_log, dt_bias = x.args()
        init = torch.randn(1, h, 128, 128, device="cuda") * 0.05
        nc = -(-t // C)
        groups = kern._choose_groups(nc, 1, h, dev)
        cut = min(t, group_start(nc, groups, groups - 1) * C)  # the last group's first token
        if groups < 2 or cut >= t:
            print(f"tail_overlap_probe: {n}x{t}x{h} walks in one group: nothing to overlap")
            continue

        # one cu_seqlens and its chunk indices per token range, made once: eager calls
        # then find it checked, and a capture reads nothing back
        ranges = {}
        for a, b in ((0, t), (0, cut), (cut, t)):
            cu = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
            ranges[a, b] = (cu, prepare_chunk_indices(cu, C))

        def prologue(a: int, b: int) -> dict:
            cu, ci = ranges[a, b]
            return kern.fused_kda_prologue(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                           a_log, dt_bias, None, x.lower_bound, cu,
                                           chunk_indices=ci, defer_u=True)

        full = prologue(0, t)
        out = torch.empty_like(full["w"])

        def scan() -> None:
            kern.fused_kda_chunk(full["qg"], full["w"], v, full["kg_t"], full["aqk"], full["decay"],
                                 out, None, x.cu_seqlens, init, True, groups=groups,
                                 akk=full["akk"])

        # Everything but the tail runs on a high-priority stream: when pass one and the
        # tail's prologue are both ready (the tail waits for the split prologue only), the
        # block scheduler places pass one's blocks first and the tail takes what is left.
        def serial(_=None) -> None:
            prologue(0, t)
            scan()

        def split(_=None) -> None:
            prologue(0, cut)
            scan()

        def overlap(_=None) -> None:
            prologue(0, cut)
            side.wait_stream(torch.cuda.current_stream())  # (an event recorded here, before the scan)
            scan()
            with torch.cuda.stream(side):
                prologue(cut, t)
            torch.cuda.current_stream().wait_stream(side)

        def tail(_=None) -> None:
            prologue(cut, t)

        variants = (("serial", serial), ("split", split), ("overlap", overlap), ("tail", tail))
        with torch.cuda.stream(main_stream):
            for name, fn in variants:
                fn()  # the checked cu_seqlens, the group choice and the allocations
            torch.cuda.synchronize()
            graphs = {}
            for name, fn in variants:
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name], stream=main_stream):
                    fn()
            for label, timed in (("graph", {n: (lambda _, g=g: g.replay()) for n, g in graphs.items()}),
                                 ("eager", dict(variants))):
                res = {name: time_ms(fn, 1, 30, lead=True) for name, fn in timed.items()}
                print(f"{kern.spec.name} 1x{t}x{h} {gate} groups {groups}, last group from token "
                      f"{cut}, {label}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in res.items())
                      + f" | hidden {res['serial'] - res['overlap']:+.3f} ms of the tail's "
                      f"{res['tail']:.3f}", flush=True)
        with torch.cuda.stream(main_stream):
            spans = kernel_spans(graphs["overlap"].replay)
        print("  timeline of one overlap graph replay (us from the first kernel's start): "
              + "; ".join(f"{nm} {a:.0f}-{b:.0f}" for nm, a, b in spans), flush=True)


if __name__ == "__main__":
    main()
