"""The benchmark's counting and its table, on CPU (timing needs a GPU: `kdagen bench`)."""

import pytest

from kdagen import bench


def test_traffic_counts_the_chunk_sized_operands():
    b64, f64 = bench.traffic(1, 64)
    b32, f32 = bench.traffic(1, 32)
    # aqk and akk: each written once and read once, C x 2 bytes; the fp32 decay, D x 4 bytes
    # per chunk, likewise
    assert b64 - b32 == 2 * 2 * 32 * 2 - 2 * 4 * 128 * (1 / 32 - 1 / 64)
    b, _ = bench.traffic(1, 16)  # u formed in the scan: about 2.9 KB per token x head at c16
    assert b == 3 * 128 * 2 + 2 + 2 * (3 * 128 * 2 + 2 * 16 * 2 + 4 * 128 / 16) + 2 * 128 * 2
    assert f64 - f32 == 5 * 32 * 128  # 4 C D (prologue) + C D (aqk v_new)
    assert bench.traffic(1000, 64) == (1000 * b64, 1000 * f64)
    # start states read and end states written: 128 KB per (sequence, head) at D = 128
    b_states, f_states = bench.traffic(1000, 64, state_planes=3)
    assert (b_states - 1000 * b64, f_states) == (3 * 2 * 128 * 128 * 4, 1000 * f64)


def test_table_names_each_rows_chunk_size():
    row = bench.Row("8x4096x32", "softplus", 8 * 4096 * 32, 16, 1, 1.7, 1.1, 0.6, 4.2, 0.9,
                    *bench.traffic(8 * 4096 * 32, 16), 6e-3)
    meta = dict(date="2026-12-03", commit="abc", gpu="GPU", cus=132, torch="2.11", copy_gbps=4200,
                bf16_tflops=795, chunk="auto")
    text = bench.table([row], meta)
    header, sep, line = text.splitlines()[2:]
    assert header.split("|")[3].strip() == "chunk" and line.split("|")[3].strip() == "16"
    assert header.count("|") == line.count("|") == sep.count("|")
    assert "2.47x" in line and "tuned by `kdagen tune --chunk-sizes`" in text
    cols = [c.strip() for c in header.split("|")]
    assert line.split("|")[cols.index("graph ms")].strip() == "n/a"  # no CUDA-graph time
    row.graph_ms = 1.234
    assert bench.table([row], meta).splitlines()[-1].split("|")[cols.index("graph ms")].strip() == "1.234"


def test_results_are_rewritten_whole_after_each_row(tmp_path):
    """`kdagen bench` writes its markdown and JSON after every row (a run cut short keeps
    its finished rows): each write holds all rows so far, not only the newest."""
    import json

    meta = dict(date="2026-12-03", commit="abc", gpu="GPU", cus=132, torch="2.11", copy_gbps=4200,
                bf16_tflops=795, chunk="16")
    rows = [bench.Row(f"{n}x4096x32", "lower_bound", n * 4096 * 32, 16, 1, 1.3, 0.7, 0.5, 4.5, 0.9,
                      *bench.traffic(n * 4096 * 32, 16), 6e-3) for n in (8, 16)]
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    bench.write_results(rows[:1], meta, str(md), str(js))
    assert "8x4096x32" in md.read_text() and len(json.loads(js.read_text())["rows"]) == 1
    bench.write_results(rows, meta, str(md), str(js))
    text = md.read_text()
    assert "8x4096x32" in text and "16x4096x32" in text and text.count("\n| 8x4096x32 |") == 1
    assert [r["shape"] for r in json.loads(js.read_text())["rows"]] == ["8x4096x32", "16x4096x32"]


def test_merge_joins_the_rows_of_runs_split_over_calls(tmp_path):
    """`kdagen bench --merge`: one gate a device call, then one table; a later file's row
    replaces the same (shape, gate); runs of another commit or GPU are refused."""
    import argparse
    import json

    meta = dict(date="2026-12-05", commit="abc", gpu="GPU", cus=132, torch="2.11", copy_gbps=4200,
                bf16_tflops=744, chunk="16")

    def run_file(name, gate, shapes, kdagen_ms, **meta_change):
        rows = [bench.Row(s, gate, 1 << 20, 16, 1, kdagen_ms, 0.6, 0.5, 4.4, 0.75,
                          *bench.traffic(1 << 20, 16), 6e-3) for s in shapes]
        path = tmp_path / name
        bench.write_results(rows, meta | meta_change, json_path=str(path))
        return str(path)

    lb = run_file("lb.json", "lower_bound", ["8x4096x32", "1x32768x32"], 1.1)
    sp = run_file("sp.json", "softplus", ["8x4096x32"], 1.2, date="2026-12-06")
    again = run_file("again.json", "lower_bound", ["1x32768x32"], 1.5)
    rows, merged = bench.merge_results([lb, sp, again])
    assert [(r.shape, r.gate, r.kdagen_ms) for r in rows] == [
        ("8x4096x32", "lower_bound", 1.1), ("1x32768x32", "lower_bound", 1.5),
        ("8x4096x32", "softplus", 1.2)]
    assert merged["date"] == "2026-12-05 / 2026-12-06" and merged["commit"] == "abc"
    md, js = tmp_path / "m.md", tmp_path / "m.json"
    ns = argparse.Namespace(merge=f"{lb},{sp}", markdown=str(md), json=str(js), plot=None)
    assert bench.main(ns) == 0
    assert md.read_text().count("\n| 8x4096x32 |") == 2 and len(json.loads(js.read_text())["rows"]) == 3
    other = run_file("other.json", "softplus", ["1x2048x32"], 0.2, commit="def")
    with pytest.raises(ValueError, match="commit 'def' vs 'abc'"):
        bench.merge_results([lb, other])
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a `kdagen bench --json` file"):
        bench.merge_results([str(tmp_path / "bad.json")])
    (tmp_path / "no_date.json").write_text(json.dumps({"meta": {"gpu": "x"}, "rows": []}))
    with pytest.raises(ValueError, match="meta lacks date"):
        bench.merge_results([str(tmp_path / "no_date.json")])
    short_row = json.loads(open(lb).read())
    del short_row["rows"][1]["kdagen_ms"]
    (tmp_path / "short_row.json").write_text(json.dumps(short_row))
    with pytest.raises(ValueError, match="row 1: .*kdagen_ms"):
        bench.merge_results([str(tmp_path / "short_row.json")])


def test_profile_argv_loads_the_named_variant(monkeypatch):
    import kdagen
    from kdagen import jit
    asked = []
    monkeypatch.setattr(jit, "device_target", lambda: "sm_90")
    monkeypatch.setattr(kdagen, "load", lambda fields: asked.append(fields) or "kern")
    shapes, gate, kern = bench.profile_argv(["x", "8x4096:32,1x2048:32", "softplus", "16", "64"], "1x1:1")
    assert (shapes, gate, kern) == ([(8, 4096, 32), (1, 2048, 32)], "softplus", "kern")
    assert asked[-1] == {"target": "sm_90", "gate": "softplus", "chunk_size": 16, "block_width": 64}
    assert bench.profile_argv(["x"], "1x32768:32")[:2] == ([(1, 32768, 32)], "lower_bound")
    assert asked[-1]["chunk_size"] == 64 and asked[-1]["block_width"] == 128


def test_graph_timing_keeps_every_captured_graphs_inputs_alive(monkeypatch):
    """A CUDA graph reads its input tensors at every replay: graph_ms must hold each set's
    chunk indices until its last replay. (v16 dropped all but the last set's with the
    closure that held them; their memory was reused and the replays faulted.)"""
    import contextlib
    import weakref

    import torch

    made: list = []

    def chunk_indices(cu_seqlens, chunk_size):
        t = torch.zeros(4, 2, dtype=torch.int32)
        made.append(weakref.ref(t))
        return t

    class Graph:
        def replay(self):
            pass

    def timing(fn, sets, reps, lead=False):
        assert all(r() is not None for r in made), "a captured graph's chunk indices were freed"
        assert lead, "graph replays are timed behind a spin kernel (device time only)"
        return 1.0

    class Kern:
        spec = type("S", (), {"chunk_size": 16})()

        def prefill(self, *args, **kw):
            return None

    class Set:
        cu_seqlens = torch.tensor([0, 64])

        def args(self):
            return ()

    monkeypatch.setattr("kdagen.varlen.prepare_chunk_indices", chunk_indices)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "time_ms", timing)
    monkeypatch.setenv("KDAGEN_BENCH_GRAPH", "1")
    assert bench.graph_ms(Kern(), [Set() for _ in range(3)], [None] * 3, -5.0, 4) == 1.0
    assert len(made) == 3


def test_lead_spins_the_gpu_before_each_start_event(monkeypatch):
    """time_ms(lead=True) enqueues a spin kernel ahead of every timed call's start event, so
    the host's enqueueing happens while the GPU is busy; without it, none."""
    import torch

    from kdagen import bench

    calls: list[str] = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            calls.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"sleep {cycles}"))
    assert bench.time_ms(lambda i: calls.append("call"), 1, 2, warmup=0, lead=True) == 2.0
    spin = f"sleep {bench.LEAD_CYCLES}"
    assert calls == [spin, "record", "call", "record"] * 2
    calls.clear()
    bench.time_ms(lambda i: calls.append("call"), 1, 2, warmup=0)
    assert calls == ["record", "call", "record"] * 2


def test_kernel_traffic_splits_the_two_kernel_count():
    """The per-kernel bytes add up to ``traffic`` (no states), and pass one reads w, kg_t,
    akk, the decay and v again over the covered tokens: 832 bytes per token x head at c16."""
    for C in (16, 32, 64):
        k = bench.kernel_traffic(1000, C)
        assert set(k) == {"prologue", "walk"}
        assert k["prologue"] + k["walk"] == pytest.approx(bench.traffic(1000, C)[0])
    k = bench.kernel_traffic(8, 16, covered=7 / 8)
    assert k["prologue"] == 8 * 1634 and k["walk"] == 8 * 1376 and k["pass_one"] == pytest.approx(7 * 832)


def test_profile_breakdown_names_walks_and_rates_them():
    """scripts/profile_breakdown.py names the chunk scan's launches by their walk and gives
    the prologue and the walks the bandwidth of their bytes (session 32's H200 times at
    1x32768x32 in 8 groups: the prologue 2.9 TB/s, pass one 1.7, pass two 3.25)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_breakdown.py"
    spec = importlib.util.spec_from_file_location("profile_breakdown", path)
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)

    class Event:
        def __init__(self, name):
            self.name, self.device_time_total = name, 1000.0

    names = [f"void kdagen::chunk_kernel<kdagen::Config, {m}, true>(kdagen::ChunkArgs)" for m in (2, 3, 0)]
    names.append("void kdagen::group_scan_kernel<kdagen::Config, 32, 3>(kdagen::ChunkArgs)")
    pb.profiled_kernels = lambda fn, reps: [Event(n) for n in names]
    assert set(pb.kernel_times(None, 1)) == {"chunk_kernel[pass two: mode 2 akk]", "chunk_kernel[pass one: mode 3 akk]",
                                             "chunk_kernel[single walk: mode 0 akk]", "group_scan_kernel"}
    times = {"prologue_kernel": 0.587, "chunk_kernel[pass one: mode 3 akk]": 0.443,
             "chunk_kernel[pass two: mode 2 akk]": 0.444, "group_scan_kernel": 0.048}
    rates = pb.kernel_rates(times, 1, 32768, 32, 16, 8)
    assert set(rates) == set(times) - {"group_scan_kernel"}
    assert rates["prologue_kernel"] == pytest.approx(1634 * 32768 * 32 / 0.587e-3 / 1e9)
    assert rates["chunk_kernel[pass one: mode 3 akk]"] == pytest.approx(832 * 28672 * 32 / 0.443e-3 / 1e9)
    assert rates["chunk_kernel[pass two: mode 2 akk]"] == pytest.approx(1376 * 32768 * 32 / 0.444e-3 / 1e9)
    assert pb.kernel_rates({"chunk_kernel[single walk: mode 0 akk]": 0.451}, 8, 4096, 32, 16, 1) == {
        "chunk_kernel[single walk: mode 0 akk]": pytest.approx(1376 * 8 * 4096 * 32 / 0.451e-3 / 1e9)}


def _bench_file(tmp_path, name="lb.json", **meta_change):
    meta = dict(date="2026-12-05", commit="abc", gpu="GPU", cus=132, torch="2.11", copy_gbps=4200,
                bf16_tflops=744, chunk="16") | meta_change
    row = bench.Row("8x4096x32", "lower_bound", 1 << 20, 16, 1, 1.1, 0.6, 0.5, 4.4, 0.75,
                    *bench.traffic(1 << 20, 16), 6e-3)
    path = tmp_path / name
    bench.write_results([row], meta, json_path=str(path))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: "not json {", r"bad\.json: not a `kdagen bench --json` file \(not JSON"),
    (lambda d: d | {"meta": d["meta"] | {"date": 5}}, r"bad\.json: meta date = 5 is not a string"),
    (lambda d: d | {"meta": d["meta"] | {"copy_gbps": "x"}}, r"bad\.json: meta copy_gbps = 'x' is not a number"),
    (lambda d: d | {"rows": [d["rows"][0] | {"kdagen_ms": "1.1"}]}, r"bad\.json: row 0: kdagen_ms = '1\.1' is not a float"),
    (lambda d: d | {"rows": [d["rows"][0] | {"notes": "x"}]}, r"bad\.json: row 0: notes = 'x'"),
    (lambda d: d | {"rows": [d["rows"][0] | {"fla_ms": True}]}, r"bad\.json: row 0: fla_ms = True"),
])
def test_merge_refuses_a_damaged_file_by_name(tmp_path, edit, message):
    """A file --merge cannot use is named with what is wrong (no later format error)."""
    import json

    good = _bench_file(tmp_path)
    data = edit(json.loads(good.read_text()))
    (tmp_path / "bad.json").write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ValueError, match=message):
        bench.merge_results([str(good), str(tmp_path / "bad.json")])


def test_a_row_read_back_keeps_its_none_fields(tmp_path):
    path = _bench_file(tmp_path)
    rows, _ = bench.merge_results([str(path)])
    assert rows[0].graph_ms is None and rows[0].notes == []


@pytest.mark.parametrize("text", ["1x2", "ax2:3", "1x2:0", "1x2:3,", "2:3", "1x2:3:4"])
def test_shapes_that_are_not_nxt_h_are_refused_by_flag(text):
    with pytest.raises(ValueError, match=r"^--shapes: .* is not a shape; write NxT:H"):
        bench.parse_shapes(text, flag="--shapes")


def test_shapes_parse():
    assert bench.parse_shapes(" 1x32768:32, 8x4096:32") == [(1, 32768, 32), (8, 4096, 32)]


@pytest.mark.parametrize("argv, message", [
    (["--gates", ","], "--gates ','"),
    (["--gates", "lower_bound,sigmoid"], "--gates 'lower_bound,sigmoid'"),
    (["--shapes", "1x2"], "--shapes: '1x2' is not a shape"),
    (["--reps", "0"], "--reps must be >= 1"),
    ([], "bench needs a GPU"),
])
def test_cli_bench_refuses_bad_arguments_on_stderr(monkeypatch, capsys, argv, message):
    """Before anything is timed, and on stderr like every other command's errors."""
    import torch

    from kdagen.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("timed a bad request"))
    assert main(["bench", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kdagen: error: ") and message in err


def test_cli_bench_plot_without_matplotlib_is_refused_first(tmp_path, monkeypatch, capsys):
    import builtins

    from kdagen.cli import main

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = _bench_file(tmp_path)
    assert main(["bench", "--merge", str(path), "--plot", str(tmp_path / "p.png"),
                 "--markdown", str(tmp_path / "m.md")]) == 1
    err = capsys.readouterr().err
    assert "the plot needs matplotlib" in err and "pip install matplotlib" in err
    assert not (tmp_path / "m.md").exists()  # refused before anything was written
