"""Where the end-to-end time of the bench shapes goes: each call as the bench times it
(eager, host work included), the same two calls replayed from a CUDA graph (device time
alone), and every kernel's device time from the torch profiler.

    python3 scripts/profile_breakdown.py [shapes] [gate] [chunk] [width]
        e.g. 1x32768:32,8x4096:32 lower_bound 32 128

Prints one line per shape: eager ms, graph ms, host overhead, and the kernels' times, the
prologue's and the walks' with the bandwidth their bytes take at that time
(``bench.kernel_traffic``: what each must move, not what it measured moving).
"""

from __future__ import annotations

import collections
import sys

import torch

from kdagen.bench import kernel_traffic, profile_argv, profiled_kernels, time_ms
from kdagen.groups import group_start
from kdagen.testing import make_inputs
from kdagen.varlen import prepare_chunk_indices

DEFAULT = "1x32768:32,8x4096:32,32x1024:32,1x2048:32,1x131072:8,64x256:32"


# chunk_kernel's mode (chunk.h: kWalkSingle, kWalkPassOne, kWalkPassTwo, kWalkPassOneSegments)
WALKS = {"0": "single walk", "1": "pass one", "2": "pass two", "3": "pass one"}


def kernel_times(fn, reps: int) -> dict[str, float]:
    """Device ms per call of every kernel ``fn`` launches (profiler, ``reps`` calls); the
    chunk scan's launches named by their walk, e.g. ``chunk_kernel[pass two: mode 2 akk]``."""
    out: dict[str, float] = collections.defaultdict(float)
    for ev in profiled_kernels(fn, reps):
        name = ev.name.split("<")[0].split("(")[0].replace("void ", "").replace("kdagen::", "")
        if "<" in ev.name and "chunk_kernel" in ev.name:  # chunk_kernel<Config, mode[, akk]>
            targs = [a.strip() for a in ev.name.split("<", 1)[1].split(">")[0].split(",")]
            name += (f"[{WALKS.get(targs[1], 'walk')}: mode {targs[1]}"
                     + (" akk" if targs[2:] == ["true"] else "") + "]")
        out[name] += ev.device_time_total / 1000.0 / reps
    return dict(out)


def kernel_rates(times: dict[str, float], n: int, t: int, h: int, C: int, groups: int) -> dict[str, float]:
    """GB/s of each kernel in ``times`` (``kernel_times``' names) whose bytes
    ``kernel_traffic`` counts, for n sequences of t tokens and h heads in ``groups``."""
    covered = group_start(-(-t // C), groups, groups - 1) * C / t if groups > 1 else 0.0
    traffic = kernel_traffic(n * t * h, C, min(covered, 1.0))
    which = lambda name: ("prologue" if name.startswith("prologue_kernel")  # noqa: E731
                          else "pass_one" if "[pass one" in name
                          else "walk" if "[pass two" in name or "[single walk" in name else None)
    return {k: traffic[which(k)] / (ms * 1e-3) / 1e9 for k, ms in times.items()
            if which(k) in traffic and ms > 0}


def main() -> None:
    shapes, gate, kern = profile_argv(sys.argv, DEFAULT)
    C = kern.spec.chunk_size
    for n, t, h in shapes:
        x = make_inputs([t] * n, h, 128, gate=gate, seed=1)
        init = torch.randn(n, h, 128, 128, device="cuda") * 0.05
        ci = prepare_chunk_indices(x.cu_seqlens, C)
        groups = kern._choose_groups((t + C - 1) // C, n, h, torch.device("cuda"))

        def e2e(chunk_indices=None):  # u formed in the scan (Kernels.prefill)
            return kern.prefill(*x.args(), None, x.lower_bound, x.cu_seqlens, init, True,
                                groups=groups, chunk_indices=chunk_indices)

        eager = time_ms(lambda _: e2e(), 1, 20)
        e2e(ci)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            e2e(ci)
        replay = time_ms(lambda _: graph.replay(), 1, 20)
        led = time_ms(lambda _: e2e(ci), 1, 20, lead=True), time_ms(lambda _: graph.replay(), 1, 20, lead=True)
        ks = kernel_times(lambda: e2e(ci), 10)
        rates = kernel_rates(ks, n, t, h, C, groups)
        parts = ", ".join(f"{k} {v:.3f}" + (f" ({rates[k]:.0f} GB/s)" if k in rates else "")
                          for k, v in sorted(ks.items(), key=lambda kv: -kv[1]))
        print(f"{kern.spec.name} {n}x{t}x{h} {gate} groups {groups}: eager {eager:.3f} ms, graph {replay:.3f} ms, "
              f"host {eager - replay:+.3f} ms, busy stream: eager {led[0]:.3f} graph {led[1]:.3f}, "
              f"kernels {sum(ks.values()):.3f} | {parts}", flush=True)


if __name__ == "__main__":
    main()
