"""The autotuner's cache and choices, on CPU (timings faked; GPU timing is in `kdagen tune`)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from kdagen import autotune as at
from kdagen.ops import Kernels
from kdagen.spec import KernelSpec

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KDAGEN_AUTOTUNE", raising=False)
    monkeypatch.delenv("KDAGEN_GROUPS", raising=False)
    monkeypatch.setattr(at, "device_tag", lambda device=None: "Fake_GPU_132cu")
    at._memory.clear()
    at._read_cache.clear()
    return at.cache_path("Fake_GPU_132cu")


def spec(**fields):
    return KernelSpec.parse(fields)


@pytest.mark.parametrize("n, want", [(0, 0), (1, 1), (2, 2), (3, 2), (32, 32), (33, 32), (1000, 512)])
def test_bucket(n, want):
    assert at.bucket(n) == want


def test_shape_class_key():
    assert at.ShapeClass.of(1, 32, 512).key() == "nh32-c512"
    assert at.ShapeClass.of(3, 11, 70).key() == "nh32-c64"  # 33 -> 32, 70 -> 64


def test_group_candidates():
    assert at.group_candidates(512, 4) == [1, 2, 4, 8, 16, 32]
    assert at.group_candidates(6, 1) == [1, 2]
    assert at.group_candidates(1, 1) == [1]
    assert 12 in at.group_candidates(512, 12)  # the heuristic's own choice is always timed


def test_pick_fastest_takes_the_minimum_and_reports_every_time():
    fake = {1: 3.0, 2: 2.0, 4: 1.5, 8: 1.5, 16: 4.0}
    best, times = at.pick_fastest(fake, lambda g: fake[g])
    assert best == 4  # ties go to fewer groups (less workspace)
    assert times == fake


def test_tuner_times_device_work_behind_a_spin(monkeypatch):
    """The tuner's timer puts a spin kernel ahead of every timed call (bench.time_ms's
    lead), so a choice is made on device time, not on the host's enqueue of its launches."""
    from kdagen import bench

    seen = []

    def fake_time_ms(fn, sets, reps, warmup=3, lead=False):
        fn(0)
        seen.append((sets, reps, lead))
        return 1.0

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    calls = []
    assert at._time_ms(lambda: calls.append(1), 7) == 1.0
    assert seen == [(1, 7, True)] and calls == [1]


def test_cache_roundtrip_and_merge(cache):
    c = at.TuneCache(cache)
    assert c.get("a", "nh32-c512") is None
    c.put("a", "nh32-c512", {"groups": 4})
    c.put("a", "nh8-c2048", {"groups": 16})
    c.put("b", "nh32-c512", {"groups": 1})
    assert c.get("a", "nh32-c512") == {"groups": 4}
    assert c.get("a", "nh8-c2048") == {"groups": 16}
    data = json.loads(cache.read_text())
    assert data["format"] == 1 and set(data["entries"]) == {"a", "b"}
    c.put("a", "nh32-c512", {"groups": 8})  # replaces
    assert at.TuneCache(cache).get("a", "nh32-c512") == {"groups": 8}


@pytest.mark.parametrize("damage", [b"{not json", b"[]", b'{"format": 0, "entries": {}}',
                                    b'{"format": 1, "entries": []}', b"", b"\xff\xfe\x00garbage",
                                    b"[" * 100000, b'{"format": 1, "entries": {"a": []}}',
                                    b'{"format": 1, "entries": {"a": {"nh32-c512": 4}}}'])
def test_damaged_cache_is_reported_and_ignored(cache, capsys, damage):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_bytes(damage)
    assert at.TuneCache(cache).get("a", "nh32-c512") is None
    assert str(cache) in capsys.readouterr().err
    at.TuneCache(cache).put("a", "nh32-c512", {"groups": 4})  # a new choice replaces the damage
    assert at.TuneCache(cache).get("a", "nh32-c512") == {"groups": 4}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_cache_keeps_the_choice_in_memory(cache, capsys):
    cache.parent.mkdir(parents=True)
    cache.parent.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        at.TuneCache(cache).put("a", "nh32-c512", {"groups": 4})
        assert "not written" in capsys.readouterr().err
        assert at._lookup(cache, "a", "nh32-c512") == {"groups": 4}
    finally:
        cache.parent.chmod(stat.S_IRWXU)


def test_cache_under_a_regular_file_keeps_the_choice_in_memory(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = blocker / "tune" / "Fake.json"
    at._memory.clear()
    at.TuneCache(path).put("a", "nh32-c512", {"groups": 4})
    assert str(path) in capsys.readouterr().err
    assert at._lookup(path, "a", "nh32-c512") == {"groups": 4}


def test_recorded_groups(cache, monkeypatch):
    s = spec()
    assert at.recorded_groups(s, 1, 32, 512, CUDA0) is None
    at.TuneCache(cache).put(at.chunk_spec_key(s), "nh32-c512", {"groups": 8})
    assert at.recorded_groups(s, 1, 32, 512, CUDA0) == 8
    assert at.recorded_groups(s, 1, 32, 600, CUDA0) == 8  # same class: 600 -> 512
    assert at.recorded_groups(s, 1, 32, 1024, CUDA0) is None
    assert at.recorded_groups(spec(block_width=64), 1, 32, 512, CUDA0) is None  # other variant
    assert at.recorded_groups(s, 1, 32, 512, torch.device("cpu")) is None
    for off in ("off", "0"):
        monkeypatch.setenv("KDAGEN_AUTOTUNE", off)
        assert at.recorded_groups(s, 1, 32, 512, CUDA0) is None


@pytest.mark.parametrize("bad", [0, 33, "4", None, 2.5, True])
def test_recorded_groups_out_of_range_is_ignored(cache, bad):
    s = spec()
    at.TuneCache(cache).put(at.chunk_spec_key(s), "nh32-c512", {"groups": bad})
    assert at.recorded_groups(s, 1, 32, 512, CUDA0) is None


def test_recorded_block_width_is_shared_across_widths(cache):
    assert at.width_spec_key(spec(block_width=32)) == at.width_spec_key(spec(block_width=128))
    assert at.width_spec_key(spec(gate="lower_bound")) != at.width_spec_key(spec())
    at.TuneCache(cache).put(at.width_spec_key(spec()), "nh32-c512", {"block_width": 64})
    assert at.recorded_block_width(spec(block_width=32), 1, 32, 512, CUDA0) == 64


@pytest.mark.parametrize("bad", [48, 0, -16, 256, True, "64"])
def test_recorded_block_width_the_validator_refuses_is_ignored(cache, bad):
    at.TuneCache(cache).put(at.width_spec_key(spec()), "nh32-c512", {"block_width": bad})
    assert at.recorded_block_width(spec(), 1, 32, 512, CUDA0) is None


def test_recorded_chunk_size_is_shared_across_chunks_and_widths(cache):
    assert at.choice_spec_key(spec(chunk_size=32, block_width=64)) == at.choice_spec_key(spec())
    assert at.choice_spec_key(spec(gate="lower_bound")) != at.choice_spec_key(spec())
    assert at.choice_shape(1, 32, 32768).key() == "nh32-c512"  # by 64-token chunks
    at.TuneCache(cache).put(at.choice_spec_key(spec()), "nh32-c512", {"chunk_size": 32})
    assert at.recorded_chunk_size(spec(chunk_size=16), 1, 32, 32768, CUDA0) == 32
    assert at.recorded_chunk_size(spec(), 1, 32, 32768 + 100, CUDA0) == 32  # same class
    assert at.recorded_chunk_size(spec(), 1, 32, 30000, CUDA0) is None  # 469 chunks: 256
    assert at.recorded_chunk_size(spec(), 1, 32, 32768, torch.device("cpu")) is None


@pytest.mark.parametrize("bad", [48, 0, 128, True, "32", None])
def test_recorded_chunk_size_the_validator_refuses_is_ignored(cache, bad):
    at.TuneCache(cache).put(at.choice_spec_key(spec()), "nh32-c512", {"chunk_size": bad})
    assert at.recorded_chunk_size(spec(), 1, 32, 32768, CUDA0) is None


class _FakeKernels:
    def __init__(self, **fields):
        self.spec = spec(**fields)


def test_tune_chunk_size_records_the_fastest(cache, monkeypatch):
    ms = {16: 1.8, 32: 1.9, 64: 2.6}
    seen = []

    def fake(kern, n, h, chunks, reps, quiet, dev):
        seen.append((kern.spec.chunk_size, chunks))
        return ms[kern.spec.chunk_size]

    monkeypatch.setattr(at, "_end_to_end_ms", fake)
    kerns = [_FakeKernels(chunk_size=c) for c in (16, 32, 64)]
    row = at.tune_chunk_size(kerns, 8, 32, 4096, quiet=True, device=CUDA0)
    assert row["chunk_size"] == 16 and seen == [(16, 256), (32, 128), (64, 64)]
    assert at.recorded_chunk_size(spec(), 8, 32, 4096, CUDA0) == 16
    seen.clear()  # 100 tokens: every size walks the same 128
    at.tune_chunk_size(kerns, 8, 32, 100, quiet=True, device=CUDA0)
    assert seen == [(16, 8), (32, 4), (64, 2)]


def test_tune_chunk_size_refuses_variants_that_differ_otherwise(cache):
    with pytest.raises(ValueError, match="differ in chunk_size"):
        at.tune_chunk_size([_FakeKernels(chunk_size=32), _FakeKernels(gate="lower_bound")],
                           1, 32, 4096, device=CUDA0)
    with pytest.raises(ValueError, match="differ in chunk_size"):
        at.tune_chunk_size([_FakeKernels(), _FakeKernels(block_width=64)], 1, 32, 4096, device=CUDA0)


class _Stop(Exception):
    pass


@pytest.fixture
def chunk_asked(monkeypatch):
    """The chunk sizes kda_forward asks for_inputs for (the call stops there)."""
    from kdagen import layer

    asked = []

    def for_inputs(*a, chunk_size, **k):
        asked.append(chunk_size)
        raise _Stop

    monkeypatch.setattr(layer, "for_inputs", for_inputs)
    return asked


def test_kda_forward_takes_the_recorded_chunk_size(monkeypatch, chunk_asked):
    from kdagen import layer
    from kdagen.seqlens import prepare

    monkeypatch.setattr(layer, "spec_for_inputs", lambda *a, **k: spec())
    monkeypatch.setattr(at, "recorded_chunk_size", lambda s, n, h, t, dev: 32 if t == 4096 else None)
    x = torch.randn(2, 4096, 1, 64)
    raw = dict(A_log=torch.zeros(1), dt_bias=torch.zeros(64), use_qk_l2norm_in_kernel=True,
               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    for chunk_size, want in ((None, 32), (16, 16)):
        with pytest.raises(_Stop):
            layer.kda_forward(x, x, x, x, x[..., 0], chunk_size=chunk_size, **raw)
        assert chunk_asked.pop() == want
    with pytest.raises(_Stop):  # nothing recorded for the shape: 64
        layer.kda_forward(x[:, :100], x[:, :100], x[:, :100], x[:, :100], x[:, :100, :, 0], **raw)
    assert chunk_asked.pop() == 64
    sl = prepare(torch.tensor([0, 4096, 8192], dtype=torch.int32), 64)
    flat = [t.reshape(1, 8192, *t.shape[2:]) for t in (x, x[..., 0])]
    with pytest.raises(_Stop):  # prepared for chunk 64: that one, not the tuned 32
        layer.kda_forward(flat[0], flat[0], flat[0], flat[0], flat[1], cu_seqlens=sl, **raw)
    assert chunk_asked.pop() == 64


def test_kda_forward_defaults_to_the_largest_valid_chunk(monkeypatch, chunk_asked):
    from kdagen import layer

    monkeypatch.setattr("kdagen.jit.device_target", lambda device=None: "gfx90a")
    monkeypatch.setattr(at, "recorded_chunk_size", lambda *a: None)
    x = torch.randn(1, 64, 1, 256).bfloat16()  # d256: chunk 64 does not fit gfx90a's LDS, 32 does
    with pytest.raises(_Stop):
        layer.kda_forward(x, x, x, x, x[..., 0], A_log=torch.zeros(1), dt_bias=torch.zeros(256),
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True)
    assert chunk_asked == [32]


def test_keys_carry_the_kernel_version():
    assert at.chunk_spec_key(spec()).endswith("@" + at._code_version())
    assert at.width_spec_key(spec()).endswith("@" + at._code_version())


def test_unreadable_cache_is_not_overwritten(cache, monkeypatch, capsys):
    c = at.TuneCache(cache)
    c.put("a", "nh32-c512", {"groups": 4})
    c.put("a", "nh8-c2048", {"groups": 16})
    real = type(cache).read_bytes

    def eacces(self):
        if self == cache:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(type(cache), "read_bytes", eacces)
    at._read_cache.clear()
    c.put("b", "nh32-c512", {"groups": 1})
    assert "not written" in capsys.readouterr().err
    monkeypatch.setattr(type(cache), "read_bytes", real)
    at._read_cache.clear()
    assert at.TuneCache(cache).get("a", "nh8-c2048") == {"groups": 16}  # nothing was lost


def test_a_newer_format_is_left_alone(cache, capsys):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text('{"format": 2, "entries": {"x": {}}}')
    at.TuneCache(cache).put("a", "nh32-c512", {"groups": 4})
    assert json.loads(cache.read_text())["format"] == 2
    assert "newer kdagen" in capsys.readouterr().err
    assert at._lookup(cache, "a", "nh32-c512") == {"groups": 4}  # held in memory


def test_another_process_write_with_the_same_size_and_mtime_is_seen(cache):
    c = at.TuneCache(cache)
    c.put("a", "nh32-c512", {"groups": 4})
    st = cache.stat()
    other = cache.with_suffix(".other")
    other.write_text(cache.read_text().replace('"groups": 4', '"groups": 8'))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, cache)  # same size, same mtime, new inode
    assert at.TuneCache(cache).get("a", "nh32-c512") == {"groups": 8}


def test_cache_clear_keeps_tune_choices(cache):
    from kdagen.build import clear_cache

    at.TuneCache(cache).put("a", "nh32-c512", {"groups": 4})
    clear_cache()
    assert cache.is_file()


def _kernels(monkeypatch) -> Kernels:
    monkeypatch.setattr("kdagen.ops.num_compute_units", lambda dev: 132)
    return Kernels(spec(), {})


def test_chunk_op_uses_the_recorded_group_count(cache, monkeypatch):
    k = _kernels(monkeypatch)
    heuristic = k._choose_groups(512, 1, 32, CUDA0)
    at.TuneCache(cache).put(at.chunk_spec_key(k.spec), "nh32-c512", {"groups": 16})
    assert heuristic != 16 and k._choose_groups(512, 1, 32, CUDA0) == 16
    monkeypatch.setenv("KDAGEN_GROUPS", "3")  # the test override still wins
    assert k._choose_groups(512, 1, 32, CUDA0) == 3


def test_autotune_on_first_use_tunes_unseen_shapes_once(cache, monkeypatch):
    k = _kernels(monkeypatch)
    calls = []

    def fake_tune(kern, n, h, chunks, **kw):
        assert kw.get("device") == CUDA0  # tuned on the call's device
        calls.append((n, h, chunks))
        at.TuneCache(at.cache_path(at.device_tag())).put(at.chunk_spec_key(kern.spec),
                                            at.ShapeClass.of(n, h, chunks).key(), {"groups": 8})
        return {"groups": 8}

    monkeypatch.setattr(at, "tune_groups", fake_tune)
    monkeypatch.setattr(at, "capturing", lambda: False)
    assert k._choose_groups(512, 1, 32, CUDA0) != 8 and calls == []  # off by default
    monkeypatch.setenv("KDAGEN_AUTOTUNE", "1")
    assert k._choose_groups(512, 1, 32, CUDA0) == 8
    assert k._choose_groups(512, 1, 32, CUDA0) == 8
    assert calls == [(1, 32, 512)]  # the second call found the recorded choice
    monkeypatch.setattr(at, "capturing", lambda: True)
    assert k._choose_groups(64, 1, 32, CUDA0) != 8 and len(calls) == 1  # never while capturing


class _FormRecorder:
    """A stand-in for a variant's ops that records which u form tune_groups hands over."""

    def __init__(self, kern_spec: KernelSpec, forms_u: bool):
        self.spec, self.scan_forms_u, self.calls = kern_spec, forms_u, []

    def fused_kda_prologue(self, q, k, v, *rest, defer_u=False):
        self.calls.append(("prologue", defer_u))
        planes = {n: torch.zeros_like(k) for n in ("qg", "w", "kg_t", "decay", "aqk")}
        # as the real prologue: akk in place of u when it defers u (ops.py)
        return {**planes, **({"akk": torch.zeros(1)} if defer_u else {"u": torch.full_like(v, 7.0)})}

    def fused_kda_chunk(self, qg, w, u, *rest, groups=None, akk=None):
        self.calls.append(("chunk", "u" if u.eq(7.0).all() else "v", akk is not None))

    def heuristic_groups(self, chunks_per_seq, N, H, dev):
        return 4


@pytest.mark.parametrize("target, chunk, forms_u", [("sm_90", 16, True), ("gfx90a", 64, False)])
def test_group_tuning_times_the_u_form_prefill_uses(cache, monkeypatch, target, chunk, forms_u):
    """tune_groups times the chunk scan in the form Kernels.prefill runs on the variant:
    u formed in the scan (v and akk) where it stages u / o, the prologue's u elsewhere."""
    import contextlib

    kern = _FormRecorder(spec(target=target, chunk_size=chunk), forms_u)
    monkeypatch.setattr(at, "_gpu", lambda device: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(at, "num_compute_units", lambda device: 132)
    monkeypatch.setattr(at, "device_tag", lambda device=None: "fake-gpu")
    monkeypatch.setattr(at, "_time_ms", lambda fn, reps: (fn(), 1.0)[1])
    at.tune_groups(kern, 1, 2, 4, quiet=True)
    assert kern.calls[0] == ("prologue", forms_u)
    chunk_calls = set(kern.calls[1:])
    assert chunk_calls == {("chunk", "v", True) if forms_u else ("chunk", "u", False)}


def test_cli_tune_without_a_gpu_is_a_clear_error(capsys):
    from kdagen.cli import main

    assert main(["tune", "--show"]) == 1
    assert "no GPU" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--reps", "0"], "--reps"),
    (["--block-widths", "32,x"], "--block-widths"),
    (["--gates", "lower_bound, sigmoid"], "gate"),
    (["--block-widths", "48"], "block_width"),
    (["--chunk-sizes", "16,x"], "--chunk-sizes"),
    (["--chunk-sizes", "32"], "two or more"),
    (["--chunk-sizes", "32,32"], "two or more"),
    (["--chunk-sizes", "16,48"], "chunk_size"),
    (["--chunk-sizes", "16,32", "--block-widths", "64,128"], "separate runs"),
])
def test_cli_tune_refuses_bad_arguments_before_timing(monkeypatch, capsys, args, message):
    from kdagen import cli

    monkeypatch.setattr("kdagen.jit.device_target", lambda device=None: "sm_90")
    monkeypatch.setattr(at, "tune_groups", lambda *a, **k: pytest.fail("timed a bad request"))
    monkeypatch.setattr(at, "tune_block_width", lambda *a, **k: pytest.fail("timed a bad request"))
    monkeypatch.setattr(at, "tune_chunk_size", lambda *a, **k: pytest.fail("timed a bad request"))
    assert cli.main(["tune", *args]) == 1
    assert message in capsys.readouterr().err


def test_cli_tune_show_prints_every_recorded_choice(cache, monkeypatch, capsys):
    from kdagen.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    at.TuneCache(cache).put(at.choice_spec_key(spec()), "nh256-c64", {"chunk_size": 16, "ms": {"16": 1.6}})
    at.TuneCache(cache).put(at.chunk_spec_key(spec()), "nh256-c64", {"groups": 1})
    assert main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "chunk_size 16" in out and "groups 1" in out and str(cache) in out


def test_compute_units_while_tracing_skip_the_cache(monkeypatch):
    """Under torch.compile tracing the SM count is read from the device's properties, not
    through the lru_cache (Dynamo warned that it ignores the cache wrapper)."""
    from types import SimpleNamespace

    from kdagen import groups

    reads = []

    def props(index):
        reads.append(index)
        return SimpleNamespace(multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(groups, "_cus", lambda index: pytest.fail("the cache was used while tracing"))
    assert groups.num_compute_units(torch.device("cuda", 1)) == 132 and reads == [1]


def test_load_of_a_loaded_variant_plans_and_builds_nothing(monkeypatch):
    """kdagen.load of a spec this process loaded (kda_forward does it every forward pass)
    returns the loaded handle without planning, hashing or rebuilding; another spec, or
    the same one under other resource constants, goes through the build."""
    import types

    from kdagen import jit, resources

    builds = []

    def fake_build(spec, mode, **kw):
        builds.append(spec.uri)
        return types.SimpleNamespace(key=f"key-{len(builds)}", library="/none.so")

    class Ops:
        def __getattr__(self, name):
            return lambda *a: None

    monkeypatch.setattr(jit, "build", fake_build)
    monkeypatch.setattr(jit, "_dlopen", lambda entry, verbose=None: None)
    monkeypatch.setattr(jit, "_register_fakes", lambda spec: None)
    monkeypatch.setattr(jit, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(kdagen=Ops())))
    monkeypatch.setattr(jit, "_loaded", {})
    monkeypatch.setattr(jit, "_loaded_specs", {})
    monkeypatch.setenv("KDAGEN_REBUILD", "1")
    a = jit.load(spec())
    assert jit.load(spec()) is a and jit.load(spec()) is a and len(builds) == 1
    jit.load(spec(chunk_size=32))
    assert len(builds) == 2
    monkeypatch.setattr(resources, "PASS_ONE_LEAD", resources.PASS_ONE_LEAD + 1)
    with pytest.raises(RuntimeError, match="already loaded from another build"):
        jit.load(spec())  # other constants: a new build, whose ops cannot replace the loaded ones
    assert len(builds) == 3
