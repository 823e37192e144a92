"""``kdagen bench``: kdagen's prologue + chunk scan against ``fla.ops.kda.chunk_kda``,
side by side in one process, on the same inputs, with the roofline beside it.

Per token x head (K = V = D, chunk C: ``--chunk-size``, by default the size ``kdagen
tune --chunk-sizes`` recorded for the shape, else 64; bf16), counted for the two-kernel
design with u formed in the scan (``Kernels.prefill``, ``defer_u``):
  bytes  the prologue reads q, k, g (3 D x 2) + beta (2) and writes qg, w, kg_t (3 D x 2),
         aqk, akk (2 C x 2) and the fp32 decay (4 D / C); the scan reads them back, reads
         v (D x 2) and writes o (D x 2); per sequence and head, the fp32 start state read
         and the end state written (2 x D x D x 4).
  FLOPs  4 C D (L, aqk, the triangular solve of w, akk v) + scan 6 D^2
         (S w, S qg, kg v_new) + C D (aqk v_new).
Times are medians of CUDA-event timings over many runs, rotating through several
input sets so the L2 cache does not flatter either side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch

DEFAULT_SHAPES = "1x32768:32,8x4096:32,32x1024:32,1x2048:32,1x131072:8,64x256:32"
D = 128


@dataclass
class Row:
    shape: str
    gate: str
    token_heads: int
    chunk: int
    groups: int
    kdagen_ms: float
    prologue_ms: float
    chunk_ms: float
    fla_ms: float | None
    floor_ms: float
    bytes: float
    flops: float
    err_vs_fla: float | None
    notes: list[str] = field(default_factory=list)
    graph_ms: float | None = None  # kdagen's calls replayed from CUDA graphs: device time


def parse_shapes(text: str, flag: str = "shapes") -> list[tuple[int, int, int]]:
    """``NxT:H,...`` (sequences x tokens each : heads) as (N, T, H) triples; ``flag`` names
    the argument in the error."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+):(\d+)\s*", item)
        if not m or min(int(x) for x in m.groups()) < 1:
            raise ValueError(f"{flag}: {item.strip()!r} is not a shape; write NxT:H (sequences x "
                             "tokens each : heads, positive integers), comma separated, e.g. "
                             "1x32768:32,8x4096:32")
        out.append(tuple(int(x) for x in m.groups()))
    return out


def profile_argv(argv: list[str], default_shapes: str):
    """The ``[shapes] [gate] [chunk] [width]`` arguments of the profiling scripts: the
    shapes, the gate, and that variant loaded for this GPU (chunk 64, width 128 unless
    given)."""
    import kdagen
    from .jit import device_target

    shapes = parse_shapes(argv[1] if len(argv) > 1 else default_shapes)
    gate = argv[2] if len(argv) > 2 else "lower_bound"
    chunk = int(argv[3]) if len(argv) > 3 else 64
    width = int(argv[4]) if len(argv) > 4 else 128
    kern = kdagen.load({"target": device_target(), "gate": gate, "chunk_size": chunk,
                        "block_width": width})
    return shapes, gate, kern


def profiled_kernels(fn: Callable[[], object], reps: int = 1) -> list:
    """The device (CUDA) events of ``reps`` calls of ``fn`` under the torch profiler, after
    one call outside it (the profiling scripts' kernel times and timelines)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


def kernel_traffic(token_heads: int, C: int = 64, covered: float = 0.0) -> dict[str, float]:
    """Bytes each kernel of the two-kernel design moves for ``token_heads`` at chunk ``C``
    (the module text's count, split by kernel; the start / end states left out):
    ``prologue`` (reads q, k, g, beta, writes qg, w, kg_t, aqk, akk, decay), ``walk`` (the
    single walk or pass two: reads those but q's and g's, and v, writes o) and, for the
    grouped walk, ``pass_one``: w, kg_t, akk, decay and v read again over the ``covered``
    share of the tokens (the chunks before the last group's start, (G - 1) / G)."""
    inter = 3 * D * 2 + 2 * C * 2 + 4 * D / C  # qg, w, kg_t; aqk, akk; the fp32 decay
    out = {"prologue": (3 * D * 2 + 2 + inter) * token_heads,
           "walk": (inter + D * 2 + D * 2) * token_heads}
    if covered:
        out["pass_one"] = (2 * D * 2 + C * 2 + 4 * D / C + D * 2) * token_heads * covered
    return out


def traffic(token_heads: int, C: int = 64, state_planes: int = 0) -> tuple[float, float]:
    """Bytes and FLOPs of the two-kernel design for ``token_heads`` at chunk ``C``, with
    ``state_planes`` (sequences x heads) fp32 start states read and end states written
    (D x D x 4 bytes each way: at 64x256x32 that adds 17% to the bytes)."""
    per_bytes = sum(kernel_traffic(1, C).values())  # the prologue's and the walk's
    per_flops = 4 * C * D + 6 * D * D + C * D
    return per_bytes * token_heads + state_planes * 2 * D * D * 4, per_flops * token_heads


# GPU clock cycles of the spin enqueued ahead of each timed call (``time_ms(lead=True)``):
# about 0.5 ms at the H200's 1.98 GHz, longer than the host takes to enqueue a prefill.
LEAD_CYCLES = 1_000_000


def time_ms(fn, sets: int, reps: int, warmup: int = 3, lead: bool = False) -> float:
    """Median ms between CUDA events around ``fn(i % sets)``. With ``lead`` a spin kernel
    runs ahead of the start event, so the host enqueues ``fn``'s launches while the GPU
    is busy and the events measure device time alone; without it, the host's time to
    the first launch (Python, the graph launch) counts when the stream was idle."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(LEAD_CYCLES)
        a.record()
        fn(i % sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(kern, sets: list, inits: list, lower_bound: float | None, reps: int) -> float | None:
    """Device time of kdagen's prologue + chunk scan: one CUDA graph per input set (its
    chunk indices passed, so nothing is read back while capturing), replayed in rotation,
    each replay behind a spin kernel (``time_ms(lead=True)``: the graph launch's host
    latency is not inside the events).
    None, with the reason printed, where a capture fails."""
    from .varlen import prepare_chunk_indices

    if os.environ.get("KDAGEN_BENCH_GRAPH", "1") == "0":
        return None
    graphs, held = [], []
    try:
        for x, init in zip(sets, inits):
            ci = prepare_chunk_indices(x.cu_seqlens, kern.spec.chunk_size)
            held.append(ci)  # a graph reads its inputs at every replay: each lives as long as it

            def call(x=x, init=init, ci=ci):
                return kern.prefill(*x.args(), None, lower_bound, x.cu_seqlens, init, True,
                                    chunk_indices=ci)

            call()  # the group choice and the allocations, outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            graphs.append(g)
        return time_ms(lambda i: graphs[i].replay(), len(graphs), reps, lead=True)
    except RuntimeError as e:
        print(f"kdagen bench: no CUDA-graph time ({type(e).__name__}: {e})"[:300], flush=True)
        return None


def ceilings() -> tuple[float, float]:
    """Measured copy bandwidth (bytes/s, read + write) and bf16 matrix rate (FLOP/s)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda i: y.copy_(x), 1, 20)
    bw = 2 * x.numel() / (ms * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda i: a @ b, 1, 10)
    return bw, 2 * 8192 ** 3 / (ms * 1e-3)


def commit() -> str:
    if os.environ.get("KDAGEN_COMMIT"):
        return os.environ["KDAGEN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except OSError:
        return "?"


def run(shapes: list[tuple[int, int, int]], reps: int,
        gates: tuple[str, ...] = ("lower_bound", "softplus"),
        chunk_size: int | str = "auto",
        on_row: Callable[[list[Row], dict], None] | None = None) -> tuple[list[Row], dict]:
    """Time every (gate, shape); ``on_row(rows so far, meta)`` after each row (so a run cut
    short still leaves its finished rows written)."""
    import kdagen
    from .autotune import recorded_chunk_size
    from .groups import num_compute_units
    from .jit import device_target
    from .testing import make_inputs, rel_err

    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 - report, still time kdagen
        print(f"kdagen bench: fla.ops.kda unavailable ({type(e).__name__}: {e}); kdagen only")
        chunk_kda = None
    bw, rate = ceilings()
    target = device_target()
    rows: list[Row] = []
    meta = dict(
        date=time.strftime("%Y-%m-%d"), commit=commit(), gpu=torch.cuda.get_device_name(),
        torch=torch.__version__, copy_gbps=bw / 1e9, bf16_tflops=rate / 1e12,
        cus=num_compute_units(torch.device("cuda")), chunk=str(chunk_size),
    )
    for gate in gates:
        base = kdagen.KernelSpec.parse({"target": target, "gate": gate})
        for n, t, h in shapes:
            C = (int(chunk_size) if chunk_size != "auto"
                 else recorded_chunk_size(base, n, h, t, torch.device("cuda")) or 64)
            kern = kdagen.load({"target": target, "gate": gate, "chunk_size": C})
            th = n * t * h
            nsets = max(2, min(4, int(3e9 // (th * 3000)) or 2))
            sets = [make_inputs([t] * n, h, D, gate=gate, seed=s) for s in range(nsets)]
            inits = [torch.randn(n, h, D, D, device="cuda") * 0.05 for _ in range(nsets)]
            lb = sets[0].lower_bound
            defer = kern.scan_forms_u  # the per-kernel columns time the form prefill uses
            pro = [kern.fused_kda_prologue(*x.args(), None, lb, x.cu_seqlens, defer_u=defer)
                   for x in sets]
            outs = [torch.empty_like(p["w"]) for p in pro]

            def ours(i):  # u formed in the scan where the variant does (scan_forms_u)
                x = sets[i]
                return kern.prefill(*x.args(), None, lb, x.cu_seqlens, inits[i], True)

            def prologue_only(i):
                x = sets[i]
                kern.fused_kda_prologue(*x.args(), None, lb, x.cu_seqlens, defer_u=defer)

            def chunk_only(i):
                p = pro[i]
                u = sets[i].v if defer else p["u"]
                kern.fused_kda_chunk(p["qg"], p["w"], u, p["kg_t"], p["aqk"], p["decay"], outs[i],
                                     None, sets[i].cu_seqlens, inits[i], True, akk=p.get("akk"))

            groups = kern._choose_groups((t + C - 1) // C, n, h, torch.device("cuda"))  # as used
            row = Row(f"{n}x{t}x{h}", gate, th, C, groups, time_ms(ours, nsets, reps),
                      time_ms(prologue_only, nsets, reps), time_ms(chunk_only, nsets, reps), None,
                      0.0, *traffic(th, C, n * h), None)
            row.graph_ms = graph_ms(kern, sets, inits, lb, reps)
            if chunk_kda is not None:
                cus = [x.cu_seqlens.long() for x in sets]

                def theirs(i):
                    x = sets[i]
                    return chunk_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=inits[i],
                                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                     lower_bound=lb, state_v_first=True, cu_seqlens=cus[i],
                                     A_log=x.A_log, dt_bias=x.dt_bias)

                try:
                    o_f, _ = theirs(0)
                    o_k, _ = ours(0)
                    row.err_vs_fla = rel_err(o_k, o_f)
                    row.fla_ms = time_ms(theirs, nsets, reps)
                except Exception as e:  # noqa: BLE001
                    row.notes.append(f"fla failed: {type(e).__name__}: {e}"[:200])
            row.floor_ms = max(row.bytes / bw, row.flops / rate) * 1e3
            rows.append(row)
            print(_line(row), flush=True)
            if on_row is not None:
                on_row(rows, meta)
            del sets, pro, outs, inits
            torch.cuda.empty_cache()
    return rows, meta


HEADER = ("| shape N x T x H | gate | chunk | groups | kdagen ms | graph ms | prologue ms | chunk ms | "
          "FLA ms | speed-up | floor ms | kdagen GB/s | kdagen TFLOP/s | err vs FLA |")


def _line(r: Row) -> str:
    fla = f"{r.fla_ms:.3f}" if r.fla_ms else "n/a"
    sp = f"{r.fla_ms / r.kdagen_ms:.2f}x" if r.fla_ms else "n/a"
    err = f"{r.err_vs_fla:.1e}" if r.err_vs_fla is not None else "n/a"
    graph = f"{r.graph_ms:.3f}" if r.graph_ms else "n/a"
    return (f"| {r.shape} | {r.gate} | {r.chunk} | {r.groups} | {r.kdagen_ms:.3f} | {graph} | {r.prologue_ms:.3f} | "
            f"{r.chunk_ms:.3f} | {fla} | {sp} | {r.floor_ms:.3f} | "
            f"{r.bytes / r.kdagen_ms / 1e6:.0f} | {r.flops / r.kdagen_ms / 1e9:.1f} | {err} |")


def _chunk_note(chunk: str) -> str:
    return "tuned by `kdagen tune --chunk-sizes`, else 64" if chunk == "auto" else f"fixed: {chunk}"


def table(rows: list[Row], meta: dict) -> str:
    head = (f"{meta['date']}, commit {meta['commit']}, {meta['gpu']} ({meta['cus']} SMs), torch "
            f"{meta['torch']}; measured copy {meta['copy_gbps']:.0f} GB/s, bf16 matmul "
            f"{meta['bf16_tflops']:.0f} TFLOP/s. bf16, K = V = 128, kdagen's chunk size per row ("
            f"{_chunk_note(meta.get('chunk', 'auto'))}), FLA's 64, fp32 initial "
            "state in, final state out; median of CUDA-event timings (\"kdagen ms\", \"FLA ms\": eager "
            "calls, host work inside; \"graph ms\": kdagen's calls replayed from CUDA graphs behind a "
            "spin kernel, device time).")
    sep = "|" + "---|" * (HEADER.count("|") - 1)
    return "\n".join([head, "", HEADER, sep, *(_line(r) for r in rows)])


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gates = sorted({r.gate for r in rows})
    fig, axes = plt.subplots(1, len(gates), figsize=(7 * len(gates), 4.5), squeeze=False)
    for ax, gate in zip(axes[0], gates):
        rs = [r for r in rows if r.gate == gate]
        x = range(len(rs))
        graph = any(r.graph_ms for r in rs)  # kdagen's device time beside its eager time
        bars = [("kdagen (eager)", [r.kdagen_ms for r in rs])]
        if graph:
            bars.append(("kdagen (CUDA graph)", [r.graph_ms or 0 for r in rs]))
        bars += [("FLA chunk_kda", [r.fla_ms or 0 for r in rs]),
                 ("floor (roofline)", [r.floor_ms for r in rs])]
        w = 0.8 / len(bars)
        for j, (label, ys) in enumerate(bars):
            ax.bar([i + (j - (len(bars) - 1) / 2) * w for i in x], ys, w, label=label)
        ax.set_xticks(list(x), [r.shape for r in rs], rotation=20)
        ax.set_ylabel("ms")
        ax.set_title(f"KDA prefill forward, {gate} gate")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(rows: list[Row], meta: dict, markdown: str | None = None,
                  json_path: str | None = None, plot_path: str | None = None) -> None:
    """The table as markdown, rows and meta as JSON, the plot as a PNG (each where a path
    is given); rewritten whole each time, so the files always hold every finished row."""
    if markdown:
        with open(markdown, "w") as f:
            f.write(table(rows, meta) + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    if plot_path:
        plot(rows, plot_path)


# the run facts two bench runs must share for their rows to stand in one table
SAME_RUN_KEYS = ("gpu", "commit", "torch", "chunk")
META_KEYS = ("date", "commit", "gpu", "cus", "torch", "copy_gbps", "bf16_tflops")  # the table's head


def _merge_file(path: str) -> tuple[dict, list[Row]]:
    """One ``--json`` file's meta and rows; ValueError naming what is missing or wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a `kdagen bench --json` file (not JSON: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) \
            or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a `kdagen bench --json` file (no meta / rows)")
    missing = [k for k in META_KEYS if k not in data["meta"]]
    if missing:
        raise ValueError(f"{path}: meta lacks {', '.join(missing)}: not a `kdagen bench --json` file")
    for k in META_KEYS:
        want = (int, float) if k in ("cus", "copy_gbps", "bf16_tflops") else str
        v = data["meta"][k]
        if isinstance(v, bool) or not isinstance(v, want):
            raise ValueError(f"{path}: meta {k} = {v!r} is not a {'number' if want != str else 'string'}")
    rows = []
    for i, r in enumerate(data["rows"]):
        try:
            rows.append(Row(**r))
        except TypeError as e:  # a missing or unknown field
            raise ValueError(f"{path}: row {i}: {e}") from None
        bad = _row_type_error(rows[-1])
        if bad:
            raise ValueError(f"{path}: row {i}: {bad}")
    return data["meta"], rows


def _row_type_error(row: Row) -> str | None:
    """What in a row read back from JSON has the wrong type (None: nothing)."""
    for f in fields(Row):
        v = getattr(row, f.name)
        kind = str(f.type)
        if v is None and "None" in kind:
            continue
        if f.name == "notes":
            ok = isinstance(v, list) and all(isinstance(n, str) for n in v)
        elif kind.startswith("str"):
            ok = isinstance(v, str)
        else:  # int / float fields
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            return f"{f.name} = {v!r} is not a {kind}"
    return None


def merge_results(paths: list[str]) -> tuple[list[Row], dict]:
    """The rows of several ``--json`` files of ``kdagen bench`` as one table (a bench split
    over device calls, e.g. one gate a call): rows in file order, a later file's row
    replacing an earlier one of the same shape and gate. The files must name the same GPU,
    commit, torch and chunk setting (ValueError otherwise); the table's copy bandwidth and
    matrix rate are the first file's, and each row keeps the floor its own run measured."""
    if not paths:
        raise ValueError("--merge needs one or more bench JSON files")
    merged: dict[tuple[str, str], Row] = {}
    meta: dict | None = None
    for path in paths:
        other, rows = _merge_file(path)
        if meta is None:
            meta = dict(other)
        else:
            differ = [f"{k} {other.get(k)!r} vs {meta.get(k)!r}" for k in SAME_RUN_KEYS
                      if other.get(k) != meta.get(k)]
            if differ:
                raise ValueError(f"{path}: not the run of {paths[0]} ({', '.join(differ)}): "
                                 "rows of different runs do not go in one table")
            if other.get("date") not in meta["date"].split(" / "):
                meta["date"] = f"{meta['date']} / {other.get('date')}"
        for row in rows:
            merged[(row.shape, row.gate)] = row
    assert meta is not None
    return list(merged.values()), meta


def _need_matplotlib(plot_path: str | None) -> None:
    """--plot draws with matplotlib, not a kdagen dependency: refuse before any timing."""
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RuntimeError(f"--plot {plot_path}: the plot needs matplotlib, which is not "
                               "installed (pip install matplotlib), or leave --plot out") from None


def main(ns: argparse.Namespace) -> int:
    _need_matplotlib(ns.plot)
    if getattr(ns, "merge", None):
        rows, meta = merge_results([p.strip() for p in ns.merge.split(",") if p.strip()])
        print(table(rows, meta))
        write_results(rows, meta, ns.markdown, ns.json, ns.plot)
        return 0
    from .spec import parse_gates

    gates = tuple(parse_gates(ns.gates or "lower_bound,softplus"))
    shapes = parse_shapes(ns.shapes or DEFAULT_SHAPES, flag="--shapes")
    if ns.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {ns.reps}")
    if not torch.cuda.is_available():
        raise RuntimeError("bench needs a GPU (torch.cuda.is_available() is False)")
    rows, meta = run(shapes, ns.reps, gates,
                     getattr(ns, "chunk_size", "auto"),
                     on_row=lambda rs, m: write_results(rs, m, ns.markdown, ns.json, ns.plot))
    print()
    print(table(rows, meta))
    write_results(rows, meta, ns.markdown, ns.json, ns.plot)
    return 0
