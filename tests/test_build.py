"""The build cache without real compilers (CPU, fast).

``kdagen.build.device_compiler`` is replaced by a fake compiler script written into
the test's tmp folder: it writes a deterministic object to ``-o`` and a depfile to
``-MF``, appends one line per invocation to a counter file, and, driven by
environment variables, sleeps, writes a partial object first or fails with a
clang / nvcc style diagnostic. Every test runs on its own tmp ``KDAGEN_CACHE_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kdagen.build as kb
from kdagen import cli
from kdagen.build import (
    BuildError,
    build,
    build_many,
    cached_entries,
    clear_cache,
    first_error,
    ninja_text,
    plan,
)
from kdagen.lock import FileLock
from kdagen.render import KERNEL_SOURCE, render
from kdagen.spec import KernelSpec
from kdagen.toolchain import DeviceCompiler

REPO = Path(__file__).resolve().parent.parent
FAKE_VERSION = "fake-cc 1.0 (test)"
GFX = {"target": "gfx90a"}
GFX_LB = {"target": "gfx90a", "gate": "lower_bound"}
OBJ_SIZE = 80 + 4096  # what the fake writes: a digest line padded to 80, then zeros

FAKE_CC = r'''#!{python}
"""A stand-in for hipcc / nvcc: same command line, no real work."""
import hashlib, os, sys, time
args = sys.argv[1:]
def arg(flag):
    return args[args.index(flag) + 1]
out, dep, src = arg("-o"), arg("-MF"), arg("-c")
counter = {counter!r}
with open(counter, "a") as f:
    f.write(f"start {{os.getpid()}} {{out}}\n")
digest = hashlib.sha256(open(src, "rb").read()).hexdigest()
body = (b"FAKEOBJ " + digest.encode()).ljust(80, b" ") + b"\0" * 4096
if os.environ.get("FAKE_CC_PARTIAL"):
    with open(out, "wb") as f:       # a compiler killed half way through its write
        f.write(body[:100])
time.sleep(float(os.environ.get("FAKE_CC_SLEEP") or 0))
line = os.environ.get("FAKE_CC_FAIL")
if line and os.environ.get("FAKE_CC_FAIL_ONLY", "") not in src:  # only sources whose path holds it
    line = None
if line:
    print(f"In file included from {{src}}:1:", file=sys.stderr)
    print(f"{{src}}:3:1: warning: something harmless [-Wfake]", file=sys.stderr)
    if os.environ.get("FAKE_CC_STYLE") == "nvcc":
        print(f"{{src}}({{line}}): error: something bad", file=sys.stderr)
        print(f"{{src}}({{int(line) + 1}}): error: a second error", file=sys.stderr)
        print(f'2 errors detected in the compilation of "{{src}}".', file=sys.stderr)
    else:
        print(f"{{src}}:{{line}}:5: error: something bad", file=sys.stderr)
        print(f"{{src}}:{{int(line) + 1}}:1: error: a second error", file=sys.stderr)
        print("2 errors generated.", file=sys.stderr)
    sys.exit(1)
if os.environ.get("FAKE_CC_CHATTY") and os.environ.get("FAKE_CC_FAIL_ONLY", "") not in src:
    time.sleep(0.5)  # finishes after the other variant failed, with much to say
    for i in range(30):
        print(f"remark: {{src}}: kernel resource usage line {{i}}", file=sys.stderr)
if os.environ.get("FAKE_CC_CRASH") and os.environ.get("FAKE_CC_FAIL_ONLY", "") in src:
    print("the compiler crashed: Segmentation fault (core dumped)", file=sys.stderr)
    sys.exit(139)
with open(out, "wb") as f:
    f.write(body)
with open(dep, "w") as f:
    f.write(f"{{out}}: {{src}}\n")
with open(counter, "a") as f:
    f.write(f"done {{os.getpid()}} {{out}}\n")
'''

# A builder in a separate process, with the same fake compiler patched in.
BUILDER = r'''
import json, os, sys, time
from pathlib import Path
import kdagen.build as kb
from kdagen.spec import KernelSpec
from kdagen.toolchain import DeviceCompiler
fake, version = sys.argv[1], sys.argv[2]
specs = [KernelSpec.parse(d) for d in json.loads(sys.argv[3])]
kb.device_compiler = lambda t, allow_substitute=False: DeviceCompiler(t.vendor, fake, version, t.arch)
go = os.environ.get("BUILDER_GO")
if go:  # start line: every builder waits here until the test says go
    Path(f"{os.environ['BUILDER_READY']}.{os.getpid()}").touch()
    while not os.path.exists(go):
        time.sleep(0.002)
try:
    entries = kb.build_many(specs, "objects")
except kb.BuildError as err:
    print(json.dumps({"error": str(err)}), flush=True)
    sys.exit(3)
print(json.dumps([{"root": str(e.root), "problem": e.problem()} for e in entries]), flush=True)
'''

HOLDER = r'''
import subprocess, sys, time
from kdagen.lock import FileLock
lk = FileLock(sys.argv[1], quiet=True)
lk.acquire()
if "--child" in sys.argv:  # a child that outlives us, as ninja outlives a killed builder
    subprocess.Popen(["sleep", "30"])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
lk.release()
'''

COUNTER = r'''
import sys
from pathlib import Path
from kdagen.lock import FileLock
path, lock, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for _ in range(n):
    with FileLock(lock, quiet=True):
        v = int(path.read_text())
        path.write_text(str(v + 1))
'''


# ---- fixtures -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty cache and a clean environment."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(root))
    for var in ("KDAGEN_REBUILD", "KDAGEN_VERBOSE", "KDAGEN_JOBS", "KDAGEN_ARCH",
                "FAKE_CC_SLEEP", "FAKE_CC_FAIL", "FAKE_CC_FAIL_ONLY", "FAKE_CC_CHATTY", "FAKE_CC_STYLE", "FAKE_CC_PARTIAL",
                "FAKE_CC_CRASH", "BUILDER_GO", "BUILDER_READY"):
        monkeypatch.delenv(var, raising=False)
    return root


class FakeCC:
    def __init__(self, folder: Path):
        self.counter = folder / "fake-cc.calls"
        self.counter.write_text("")
        self.path = folder / "fake-cc"
        self.path.write_text(FAKE_CC.format(python=sys.executable, counter=str(self.counter)))
        self.path.chmod(0o755)

    def compiler(self, target, *, allow_substitute: bool = False) -> DeviceCompiler:
        return DeviceCompiler(target.vendor, str(self.path), FAKE_VERSION, target.arch)

    def _count(self, word: str) -> int:
        return sum(1 for ln in self.counter.read_text().splitlines() if ln.startswith(word + " "))

    @property
    def starts(self) -> int:
        return self._count("start")

    @property
    def dones(self) -> int:
        return self._count("done")


@pytest.fixture
def fake_cc(tmp_path, monkeypatch) -> FakeCC:
    cc = FakeCC(tmp_path)
    monkeypatch.setattr(kb, "device_compiler", cc.compiler)
    return cc


def spec(**fields) -> KernelSpec:
    return KernelSpec.parse({**GFX, **fields})


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def builder(tmp_path: Path, cc: FakeCC, specs: list[dict], *, stderr=subprocess.PIPE,
            new_session: bool = False, **env: str) -> subprocess.Popen:
    script = tmp_path / "builder.py"
    if not script.is_file():
        script.write_text(BUILDER)
    return subprocess.Popen(
        [sys.executable, str(script), str(cc.path), FAKE_VERSION, json.dumps(specs)],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(**env), cwd=tmp_path,
        start_new_session=new_session,
    )


def wait_for(cond, timeout: float, what: str, step: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def killpg(proc: subprocess.Popen) -> None:
    """Kill a process group this test started (its leader's pid is the group id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the ninja file and the cache key ------------------------------------------------------


def _vendor_like():
    """A device_compiler double with real-looking paths (nothing is run)."""

    def dc(target, *, allow_substitute=False):
        name = "nvcc" if target.vendor == "nvidia" else "hipcc"
        return DeviceCompiler(target.vendor, f"/opt/fake/bin/{name}", "v1", target.arch)

    return dc


@pytest.mark.parametrize("target, must", [
    ("sm_90", ["/opt/fake/bin/nvcc", "-x cu", "-std=c++17", "-O3",
               "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
               "-Xcompiler -fPIC"]),
    ("gfx90a", ["/opt/fake/bin/hipcc", "-x hip", "-std=c++17", "-O3",
                "--offload-arch=gfx90a", "-fPIC"]),
])
def test_ninja_text_objects_mode(tmp_path, monkeypatch, cache, target, must):
    monkeypatch.setattr(kb, "device_compiler", _vendor_like())
    e = plan(spec(target=target), "objects")
    text = ninja_text(e)
    rule = next(ln for ln in text.splitlines() if ln.startswith("  command = "))
    for flag in must:
        assert flag in rule, f"{flag!r} missing from the device rule: {rule}"
    assert f"-I{e.root / 'src' / 'include'}" in rule
    assert "-MD -MF $out.d" in rule and rule.endswith("-c $in -o $out")
    assert "  depfile = $out.d" in text and "  deps = gcc" in text
    assert f"build {e.kernels_object}: device {e.root / 'src' / KERNEL_SOURCE}" in text
    assert f"default {e.kernels_object}" in text
    # objects mode: no torch binding, no link, no library
    assert "rule cxx" not in text and "rule link" not in text and ".so" not in text
    other = "--offload-arch" if target == "sm_90" else "-gencode"
    assert other not in text
    assert e.artefacts() == [e.kernels_object]


@pytest.mark.parametrize("target", ["gfx90a", "gfx942", "sm_90"])
def test_ninja_text_real_compilers(cache, target):
    """With the machine's own compilers (skipped where missing): real paths and arch flags."""
    tool = "nvcc" if target == "sm_90" else "hipcc"
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")
    e = plan(spec(target=target), "objects")
    text = ninja_text(e)
    assert e.device.path in text
    if target == "sm_90":
        assert "-gencode=arch=compute_90a,code=sm_90a" in text
    elif target == "gfx90a":
        assert "--offload-arch=gfx90a" in text
    else:  # gfx942 natively, or compile-checked through gfx940 by an older clang
        assert e.device.arch in ("gfx942", "gfx940")
        assert f"--offload-arch={e.device.arch}" in text
        if e.device.arch == "gfx940":
            assert "-DKDAGEN_CHECK_ARCH_SUBSTITUTED=gfx942" in text
            assert "gfx940" in e.device.note


def test_entry_dir_name(fake_cc, cache):
    s = spec()
    e = plan(s, "objects")
    assert re.fullmatch(r"[0-9a-f]{64}", e.key)
    assert e.root.parent == cache
    assert e.root.name == f"{s.name}-{e.key[:12]}"
    assert re.fullmatch(r"kda_d128_c64_bv128_bf16_gfx90a-[0-9a-f]{12}", e.root.name)
    assert e.lock_path == cache / f"{e.root.name}.lock"
    assert plan(KernelSpec.parse(dict(GFX)), "objects").key == e.key  # deterministic


def test_key_changes_with_spec(fake_cc):
    base = plan(spec(), "objects")
    for change in ({"gate": "lower_bound"}, {"chunk_size": 32}, {"io_dtype": "fp16"},
                   {"ops": ["recurrent"]}, {"target": "sm_90"}):
        other = plan(spec(**change), "objects")
        assert other.key != base.key, change
        assert other.root != base.root, change


def test_key_changes_with_templates(fake_cc, monkeypatch):
    base = plan(spec(), "objects")
    monkeypatch.setattr(kb, "templates_digest", lambda: "0" * 64)
    changed = plan(spec(), "objects")
    assert changed.key != base.key
    assert changed.root.name.startswith(spec().name + "-") and changed.root != base.root


@pytest.mark.parametrize("var", ["NVCC_APPEND_FLAGS", "HIPCC_COMPILE_FLAGS_APPEND", "HIP_CLANG_PATH"])
def test_key_changes_with_a_variable_the_compiler_reads(fake_cc, monkeypatch, var):
    """The compilers read these themselves (a build under -lineinfo from NVCC_APPEND_FLAGS
    was reused without it): they are part of the key."""
    monkeypatch.delenv(var, raising=False)
    base = plan(spec(), "objects")
    monkeypatch.setenv(var, "-lineinfo")
    assert plan(spec(), "objects").key != base.key
    monkeypatch.delenv(var)
    assert plan(spec(), "objects").key == base.key


def test_key_changes_with_the_compilers_own_flags(fake_cc, monkeypatch):
    """kdagen's fixed compile flags (-O3, ...) are in the key, not only the extra ones."""
    base = plan(spec(), "objects")
    real = DeviceCompiler.compile_command
    monkeypatch.setattr(DeviceCompiler, "compile_command",
                        lambda self, *a: [x.replace("-O3", "-O1") for x in real(self, *a)])
    assert plan(spec(), "objects").key != base.key


@pytest.mark.parametrize("var, finder", [("KDAGEN_NVCC", "find_nvcc"), ("KDAGEN_HIPCC", "find_hipcc")])
def test_a_named_compiler_that_is_not_there_is_an_error(monkeypatch, var, finder):
    """KDAGEN_NVCC / KDAGEN_HIPCC naming nothing: an error, not another compiler quietly."""
    from kdagen import toolchain
    from kdagen.toolchain import ToolchainError

    getattr(toolchain, finder).cache_clear()
    monkeypatch.setenv(var, "/nonexistent/cc")
    try:
        with pytest.raises(ToolchainError, match=f"{var}=/nonexistent/cc is not a file"):
            getattr(toolchain, finder)()
    finally:
        getattr(toolchain, finder).cache_clear()


def test_key_changes_with_a_resource_constant_that_changes_the_sources(fake_cc, monkeypatch):
    from kdagen import resources

    s = spec(target="sm_90", chunk_size=16)  # where the warpgroup walk fits
    base, default = plan(s, "objects"), resources.CHUNK_WGMMA
    monkeypatch.setattr(resources, "CHUNK_WGMMA", not default)  # renders another Config
    changed = plan(s, "objects")
    assert changed.key != base.key
    monkeypatch.setattr(resources, "CHUNK_WGMMA", default)
    assert plan(s, "objects").key == base.key  # the memo of rendered digests does not go stale


@pytest.mark.parametrize("field, value", [
    ("version", "fake-cc 2.0"), ("path", "/somewhere/else/hipcc"), ("arch", "gfx940"),
    ("flags", ("-DEXTRA=1",)),
])
def test_key_changes_with_compiler(fake_cc, monkeypatch, field, value):
    base = plan(spec(), "objects")

    def changed(target, *, allow_substitute=False):
        dc = fake_cc.compiler(target)
        return DeviceCompiler(**{**dc.__dict__, field: value})

    monkeypatch.setattr(kb, "device_compiler", changed)
    assert plan(spec(), "objects").key != base.key


def test_extra_device_flags_reach_the_compiler_and_the_key(monkeypatch):
    from kdagen import toolchain

    monkeypatch.setenv("KDAGEN_DEVICE_FLAGS", "-lineinfo -DKDAGEN_X='a b'")
    assert toolchain.extra_device_flags() == ("-lineinfo", "-DKDAGEN_X=a b")
    monkeypatch.delenv("KDAGEN_DEVICE_FLAGS")
    assert toolchain.extra_device_flags() == ()


# ---- building with the fake compiler ----------------------------------------------------------


def test_first_build_publishes_manifest(fake_cc, capfd):
    s = spec()
    e = build(s, "objects")
    assert fake_cc.starts == 1
    assert e.problem() is None
    obj = e.kernels_object
    assert obj.is_file() and obj.stat().st_size == OBJ_SIZE
    m = json.loads((e.root / "manifest.json").read_text())
    assert m["key"] == e.key and m["name"] == s.name and m["mode"] == "objects"
    assert m["arch"] == "gfx90a" and m["compiler"] == FAKE_VERSION
    assert m["spec"] == s.canonical()
    assert m["artefacts"] == {"obj/kernels.o": sha(obj)}
    assert (e.root / "src" / KERNEL_SOURCE).read_text() == render(s).files[KERNEL_SOURCE]
    assert e.log.is_file()
    assert not list(e.root.glob(".manifest.json.*")), "temporary manifest left behind"
    err = capfd.readouterr().err
    assert "device code only, no link, no load" in err and "built 1 variant(s)" in err


def test_long_compile_says_it_is_still_running(fake_cc, monkeypatch, capfd):
    """ninja names a step only when it ends: a compile longer than HEARTBEAT_S says every
    HEARTBEAT_S that the build is alive, and a short one stays quiet."""
    monkeypatch.setattr(kb, "HEARTBEAT_S", 0.4)
    monkeypatch.setenv("FAKE_CC_SLEEP", "1.5")
    build(spec(), "objects")
    err = capfd.readouterr().err
    beats = [ln for ln in err.splitlines() if ln.startswith(f"kdagen: still building {spec().name} (")]
    assert 2 <= len(beats) <= 5, err
    monkeypatch.setenv("FAKE_CC_SLEEP", "0")
    build(spec(gate="lower_bound"), "objects")
    assert "still building" not in capfd.readouterr().err


def test_second_build_runs_nothing(fake_cc, tmp_path, capfd):
    e1 = build(spec(), "objects")
    capfd.readouterr()
    e2 = build(spec(), "objects")
    assert fake_cc.starts == 1
    assert e2.root == e1.root and e2.problem() is None
    assert capfd.readouterr().err == "", "a cache hit should say nothing"
    # ... and neither does a fresh process
    p = builder(tmp_path, fake_cc, [GFX])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert json.loads(out)[0]["root"] == str(e1.root)
    assert fake_cc.starts == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupted_artefact_is_detected_and_rebuilt(fake_cc, capfd, damage):
    e = build(spec(), "objects")
    obj = e.kernels_object
    data = obj.read_bytes()
    if damage == "truncate":
        obj.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        obj.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    else:
        obj.write_bytes(b"")
    problem = plan(spec(), "objects").problem()
    assert problem is not None and "does not match its manifest (truncated or corrupted)" in problem
    assert str(obj) in problem
    capfd.readouterr()
    e2 = build(spec(), "objects")
    assert fake_cc.starts == 2
    assert e2.problem() is None and obj.read_bytes() == data
    assert "rebuilding" in capfd.readouterr().err


def test_missing_artefact_is_detected_and_rebuilt(fake_cc):
    e = build(spec(), "objects")
    e.kernels_object.unlink()
    problem = e.problem()
    assert problem == f"{e.kernels_object} is missing"
    e2 = build(spec(), "objects")
    assert fake_cc.starts == 2 and e2.problem() is None


@pytest.mark.parametrize("manifest, problem, compiles", [
    (None, "not built", 1),  # never published: ninja's log says the object is done
    ("{not json", "manifest unreadable", 2), ("[]", "manifest unreadable", 2),
    (json.dumps({"key": "someone else", "artefacts": {}}), "manifest belongs to another build", 2),
])
def test_bad_manifest_is_rebuilt(fake_cc, manifest, problem, compiles):
    e = build(spec(), "objects")
    m = e.root / "manifest.json"
    if manifest is None:
        m.unlink()
    else:
        m.write_text(manifest)
    assert e.problem() == problem
    assert build(spec(), "objects").problem() is None
    assert fake_cc.starts == compiles


def _nonblank_line(s: KernelSpec) -> tuple[int, str]:
    lines = render(s).files[KERNEL_SOURCE].splitlines()
    i = next(i for i, ln in enumerate(lines) if "kChunk" in ln)
    return i + 1, lines[i].strip()


@pytest.mark.parametrize("style", ["clang", "nvcc"])
def test_compile_failure_names_file_line_and_source(fake_cc, monkeypatch, style):
    s = spec()
    line, text = _nonblank_line(s)
    monkeypatch.setenv("FAKE_CC_FAIL", str(line))
    monkeypatch.setenv("FAKE_CC_STYLE", style)
    with pytest.raises(BuildError) as info:
        build(s, "objects")
    e = plan(s, "objects")
    msg = str(info.value)
    src = e.root / "src" / KERNEL_SOURCE
    assert f"{src}:{line}: error: something bad" in msg
    assert "a second error" not in msg and "warning" not in msg  # the first error only
    assert f"{line} | {text}" in msg  # the generated source line
    assert f"full log: {e.log}" in msg
    assert "something bad" in e.log.read_text()
    assert e.problem() == "not built"
    # the failure poisons nothing: fix the "compiler" and build again
    monkeypatch.delenv("FAKE_CC_FAIL")
    assert build(s, "objects").problem() is None


def test_compile_failure_without_diagnostic_shows_log_tail(fake_cc, monkeypatch):
    monkeypatch.setenv("FAKE_CC_CRASH", "1")
    with pytest.raises(BuildError) as info:
        build(spec(), "objects")
    msg = str(info.value)
    assert "failed:" in msg and "Segmentation fault" in msg
    assert f"full log: {plan(spec(), 'objects').log}" in msg


def test_cli_build_failure_is_one_paragraph(fake_cc, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_CC_FAIL", str(_nonblank_line(spec())[0]))
    rc = cli.main(["build", "--arch", "gfx90a", "--compile-only"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "kdagen: error: building kda_d128_c64_bv128_bf16_gfx90a failed:" in err
    assert "Traceback" not in err


def test_cli_build_compile_only(fake_cc, capsys):
    rc = cli.main(["build", str(REPO / "examples" / "default.yaml"), "--compile-only",
                   "--arch", "gfx90a,sm_90"])
    out, err = capsys.readouterr()
    assert rc == 0
    paths = out.split()
    assert len(paths) == 2 and all(Path(p).is_file() for p in paths)
    assert paths[0].endswith("obj/kernels.o") and "_gfx90a-" in paths[0] and "_sm90-" in paths[1]
    assert "nothing was linked or loaded" in err
    assert fake_cc.starts == 2


def _assert_clean_error(info, *words: str) -> None:
    assert type(info.value) is BuildError
    assert info.value.__cause__ is None and info.value.__suppress_context__
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_cache_under_a_regular_file(fake_cc, tmp_path, monkeypatch, capsys):
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    bad = f / "cache"
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(bad))
    with pytest.raises(BuildError) as info:
        build(spec(), "objects")
    _assert_clean_error(info, str(bad), "KDAGEN_CACHE_DIR")
    assert fake_cc.starts == 0
    assert cli.main(["build", "--arch", "gfx90a", "--compile-only"]) == 1
    err = capsys.readouterr().err
    assert f"kdagen: error: cannot create the cache directory {bad}" in err
    assert "Traceback" not in err


def test_cache_under_proc(fake_cc, monkeypatch):
    bad = Path("/proc/kdagen-test-cache")
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(bad))
    with pytest.raises(BuildError) as info:
        build(spec(), "objects")
    _assert_clean_error(info, str(bad))


def test_unwritable_existing_cache_dir(fake_cc, monkeypatch):
    """/sys refuses file creation even to root (EACCES / EPERM)."""
    monkeypatch.setenv("KDAGEN_CACHE_DIR", "/sys")
    with pytest.raises(BuildError) as info:
        build(spec(), "objects")
    _assert_clean_error(info, "/sys/kda_d128_c64_bv128_bf16_gfx90a-", "KDAGEN_CACHE_DIR")


def test_existing_cache_dir_that_refuses_files(fake_cc, monkeypatch):
    """/proc exists but creating a file in it fails with ENOENT."""
    monkeypatch.setenv("KDAGEN_CACHE_DIR", "/proc")
    with pytest.raises(BuildError) as info:
        build(spec(), "objects")
    _assert_clean_error(info, "/proc/kda_d128_c64_bv128_bf16_gfx90a-")


def _readonly_mount_works(folder: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} "
             f"&& ! touch {folder}/probe 2>/dev/null")
    try:
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", probe],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_cache_on_readonly_filesystem(fake_cc, tmp_path):
    ro = tmp_path / "ro-cache"
    ro.mkdir()
    if not _readonly_mount_works(ro):
        pytest.skip("cannot make a private read-only bind mount here (unshare/mount)")
    script = tmp_path / "builder.py"
    script.write_text(BUILDER)
    inner = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec "
             f"{sys.executable} {script} {fake_cc.path} '{FAKE_VERSION}' '{json.dumps([GFX])}'")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                       capture_output=True, text=True, timeout=60,
                       env=_env(KDAGEN_CACHE_DIR=str(ro)))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 3, r.stderr
    assert str(ro) in json.loads(r.stdout)["error"]


def test_kdagen_rebuild_forces_a_rebuild(fake_cc, monkeypatch):
    build(spec(), "objects")
    monkeypatch.setenv("KDAGEN_REBUILD", "0")
    build(spec(), "objects")
    assert fake_cc.starts == 1
    monkeypatch.setenv("KDAGEN_REBUILD", "1")
    e = build(spec(), "objects")
    assert fake_cc.starts == 2 and e.problem() is None
    monkeypatch.delenv("KDAGEN_REBUILD")
    build(spec(), "objects", force=True)
    assert fake_cc.starts == 3
    build(spec(), "objects")
    assert fake_cc.starts == 3


@pytest.mark.parametrize("env, jobs, message", [
    ("abc", None, "KDAGEN_JOBS='abc': parallel compile jobs must be a whole number"),
    ("-2", None, "KDAGEN_JOBS='-2'"),
    ("", 0, "-j / --jobs 0: parallel compile jobs must be a whole number >= 1"),
    ("", -1, "-j / --jobs -1"),
])
def test_a_bad_job_count_is_refused_before_the_cache_is_touched(fake_cc, monkeypatch, env, jobs, message):
    """A forced rebuild with a bad -j / KDAGEN_JOBS keeps the built entry it would have
    invalidated."""
    e = build(spec(), "objects")
    monkeypatch.setenv("KDAGEN_JOBS", env)
    with pytest.raises(BuildError, match=re.escape(message)):
        build(spec(), "objects", force=True, jobs=jobs)
    assert e.problem() is None and fake_cc.starts == 1
    monkeypatch.setenv("KDAGEN_JOBS", "0")  # ninja's own default
    build(spec(), "objects", force=True)
    assert fake_cc.starts == 2


def test_build_many_one_graph(fake_cc, cache):
    a, b = spec(), spec(gate="lower_bound")
    ea, eb = build_many([a, b, a], "objects")[:2]
    assert fake_cc.starts == 2  # the duplicate is built once
    assert ea.problem() is None and eb.problem() is None
    sets = list((cache / "sets").glob("*/build.ninja"))
    assert len(sets) == 1
    text = sets[0].read_text()
    assert f"subninja {ea.root / 'build.ninja'}" in text
    assert f"subninja {eb.root / 'build.ninja'}" in text
    assert ea.log.is_file() and eb.log.is_file()
    # a set where one variant is cached builds only the other
    c = spec(chunk_size=32)
    build_many([a, c], "objects")
    assert fake_cc.starts == 3


# ---- concurrency ------------------------------------------------------------------------------


def test_eight_processes_build_once(fake_cc, tmp_path):
    go, ready = tmp_path / "go", tmp_path / "ready"
    procs = [builder(tmp_path, fake_cc, [GFX], FAKE_CC_SLEEP="1", BUILDER_GO=str(go),
                     BUILDER_READY=str(ready)) for _ in range(8)]
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready.*"))) == 8, 120, "8 builders at the start")
        go.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "Traceback" not in err
    roots = {json.loads(out)[0]["root"] for out, _ in results}
    assert len(roots) == 1
    assert all(json.loads(out)[0]["problem"] is None for out, _ in results)
    assert fake_cc.starts == 1, fake_cc.counter.read_text()
    assert sum("waiting for" in err for _, err in results) >= 1
    assert plan(spec(), "objects").problem() is None


def test_killed_builder_does_not_block_or_poison(fake_cc, tmp_path, monkeypatch):
    """kill -9 of the builder alone: its ninja and compiler live on as orphans."""
    p = builder(tmp_path, fake_cc, [GFX], new_session=True, FAKE_CC_SLEEP="5")
    try:
        wait_for(lambda: fake_cc.starts == 1, 60, "the compiler to start")
        time.sleep(1)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        t0 = time.monotonic()
        e = build(spec(), "objects")  # no sleep in this compiler
        took = time.monotonic() - t0
        assert took < 3.0, f"the next build waited {took:.1f} s: did the lock outlive its owner?"
        assert e.problem() is None and fake_cc.starts == 2
        m = e.manifest()
        assert m is not None and m["artefacts"]["obj/kernels.o"] == sha(e.kernels_object)
        # the orphan compiler finishes later; what it leaves must not spoil the entry
        wait_for(lambda: fake_cc.dones == 2, 15, "the orphan compiler to finish")
        time.sleep(0.5)
        assert plan(spec(), "objects").problem() is None
        build(spec(), "objects")
        assert fake_cc.starts == 2
        build(spec(), "objects", force=True)  # ninja's own state is still usable
        assert fake_cc.starts == 3
    finally:
        killpg(p)


def test_killed_build_group_leaves_partial_object(fake_cc, tmp_path, monkeypatch):
    """kill -9 of builder, ninja and compiler at once, with half an object written."""
    p = builder(tmp_path, fake_cc, [GFX], new_session=True, FAKE_CC_SLEEP="5",
                FAKE_CC_PARTIAL="1")
    try:
        wait_for(lambda: fake_cc.starts == 1, 60, "the compiler to start")
        time.sleep(1)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        killpg(p)
    e0 = plan(spec(), "objects")
    assert e0.kernels_object.is_file() and e0.kernels_object.stat().st_size == 100
    assert e0.problem() == "not built"
    t0 = time.monotonic()
    e = build(spec(), "objects")
    assert time.monotonic() - t0 < 3.0
    assert e.problem() is None and fake_cc.starts == 2
    assert e.kernels_object.stat().st_size == OBJ_SIZE


# ---- FileLock ---------------------------------------------------------------------------------


def _holder(tmp_path: Path, lock: Path, hold: float, *extra: str) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    p = subprocess.Popen([sys.executable, str(script), str(lock), str(hold), *extra],
                         stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    return p


def test_filelock_is_exclusive_between_processes(tmp_path):
    lock, value = tmp_path / "x.lock", tmp_path / "value"
    value.write_text("0")
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    procs = [subprocess.Popen([sys.executable, str(script), str(value), str(lock), "100"],
                              env=_env()) for _ in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    assert value.read_text() == "400"  # no lost update: no two held it at once


def test_filelock_blocks_and_names_holder(tmp_path, capsys):
    lock = tmp_path / "sub" / "x.lock"  # the parent folder is created
    p = _holder(tmp_path, lock, 60)
    try:
        assert lock.read_text() == str(p.pid)
        with pytest.raises(TimeoutError):
            FileLock(lock, timeout=0.3).acquire()
        assert f"waiting for x.lock (held by pid {p.pid})" in capsys.readouterr().err
        with pytest.raises(TimeoutError):
            FileLock(lock, timeout=0.2, quiet=True).acquire()
        assert capsys.readouterr().err == ""
    finally:
        killpg(p)


def test_filelock_released_when_holder_killed(tmp_path):
    """Even though the killed holder's child (think: ninja) lives on."""
    lock = tmp_path / "x.lock"
    p = _holder(tmp_path, lock, 60, "--child")
    try:
        with pytest.raises(TimeoutError):
            FileLock(lock, timeout=0.2, quiet=True).acquire()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        t0 = time.monotonic()
        with FileLock(lock, timeout=5, quiet=True) as lk:
            assert time.monotonic() - t0 < 1.0
            assert lock.read_text() == str(os.getpid())
            assert lk._fd is not None
        assert lk._fd is None
    finally:
        killpg(p)  # the orphaned `sleep` is in the holder's process group


def test_filelock_release_is_idempotent(tmp_path):
    lk = FileLock(tmp_path / "y.lock")
    lk.acquire()
    lk.release()
    lk.release()
    with FileLock(tmp_path / "y.lock", timeout=1):
        pass


# ---- first_error --------------------------------------------------------------------------------


@pytest.mark.parametrize("log, want", [
    ('/c/e/src/kernels.hip(123): error: identifier "x" is undefined',
     ("/c/e/src/kernels.hip", 123, 'identifier "x" is undefined')),
    ("/c/e/src/kernels.hip:12:5: error: something bad",
     ("/c/e/src/kernels.hip", 12, "something bad")),
    ("kernels.hip:7:10: fatal error: 'kdagen/nope.h' file not found",
     ("kernels.hip", 7, "'kdagen/nope.h' file not found")),
    ("kernels.hip:7: error: no column", ("kernels.hip", 7, "no column")),
    ("[1/1] compile x/kernels.hip for gfx90a\n"
     "FAILED: /c/e/obj/kernels.o\n"
     "/usr/bin/hipcc -x hip -c /c/e/src/kernels.hip -o /c/e/obj/kernels.o\n"
     "In file included from /c/e/src/kernels.hip:40:\n"
     "/c/e/src/include/kdagen/chunk.h:3:1: warning: unused [-Wunused]\n"
     "/c/e/src/include/kdagen/chunk.h:88:14: error: no member named 'foo'\n"
     "/c/e/src/kernels.hip:41:1: error: later\n",
     ("/c/e/src/include/kdagen/chunk.h", 88, "no member named 'foo'")),
    ("  /c/e/src/kernels.hip(9): error: indented\n", ("/c/e/src/kernels.hip", 9, "indented")),
])
def test_first_error(log, want):
    assert first_error(log) == want


@pytest.mark.parametrize("log", [
    "", "ninja: build stopped: subcommand failed.",
    "/c/e/src/kernels.hip:3:1: warning: error-prone code",
    "ptxas error   : Entry function uses too much shared data",
    "ld.lld: error: undefined symbol: foo",
])
def test_first_error_none(log):
    assert first_error(log) is None


# ---- cache list / clear ------------------------------------------------------------------------


def test_cached_entries_and_clear_cache(fake_cc, cache):
    assert cached_entries() == [] and clear_cache() == 0  # no cache folder yet
    a, b = build(spec(), "objects"), build(spec(gate="lower_bound"), "objects")
    (cache / "kda_incomplete-000000000000").mkdir()  # a folder without a manifest
    listed = cached_entries()
    assert sorted(x["path"] for x in listed) == sorted([str(a.root), str(b.root)])
    for x in listed:
        assert x["mode"] == "objects" and x["arch"] == "gfx90a" and x["bytes"] > OBJ_SIZE
        assert x["key"] in (a.key, b.key)
    assert (cache / f"{a.root.name}.lock").is_file()
    assert clear_cache() == 3
    assert cached_entries() == []
    # no entry and no sets left; lock files stay (a waiting builder may hold one)
    assert [p for p in cache.iterdir() if p.suffix != ".lock"] == []
    build(spec(), "objects")
    assert fake_cc.starts == 3


def test_clear_cache_waits_for_a_running_build(fake_cc, tmp_path):
    e = build(spec(), "objects")
    p = _holder(tmp_path, e.lock_path, 1.5)
    try:
        t0 = time.monotonic()
        assert clear_cache() == 1
        assert time.monotonic() - t0 > 0.8
        assert not e.root.exists()
    finally:
        killpg(p)


def test_cli_cache_list_and_clear(fake_cc, cache, capsys):
    a, b = build(spec(), "objects"), build(spec(gate="lower_bound"), "objects")
    capsys.readouterr()
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"cache: {cache} (2 entries)"
    assert a.root.name in out and b.root.name in out and "objects" in out and "gfx90a" in out
    assert cli.main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 2 entries from {cache}"
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr().out.strip() == f"cache: {cache} (0 entries)"


CLEARER = r'''
import os, shutil, sys, time
import kdagen.build as kb
real = shutil.rmtree
def slow_rmtree(path, *a, **k):  # hold the entry lock until the test says go
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    return real(path, *a, **k)
kb.shutil.rmtree = slow_rmtree
print(kb.clear_cache(), flush=True)
'''


def test_clear_cache_keeps_builds_exclusive(fake_cc, tmp_path):
    e = build(spec(), "objects")
    (e.root / "manifest.json").unlink()  # an incomplete entry: builders will want the lock
    proceed = tmp_path / "proceed"
    script = tmp_path / "clearer.py"
    script.write_text(CLEARER)
    clearer = subprocess.Popen([sys.executable, str(script), str(proceed)],
                               stdout=subprocess.PIPE, text=True, env=_env())
    b_err = tmp_path / "b.err"
    procs = [clearer]
    try:
        wait_for(lambda: e.lock_path.is_file() and e.lock_path.read_text() == str(clearer.pid),
                 30, "clear_cache to hold the entry lock")
        with open(b_err, "w") as f:
            b = builder(tmp_path, fake_cc, [GFX], stderr=f, FAKE_CC_SLEEP="3")
        procs.append(b)
        wait_for(lambda: "waiting for" in b_err.read_text(), 30, "builder B to wait")
        proceed.touch()
        assert clearer.wait(timeout=30) == 0
        wait_for(lambda: fake_cc.starts == 2, 30, "builder B's compiler")
        c = builder(tmp_path, fake_cc, [GFX])  # starts while B is compiling
        procs.append(c)
        out_c, err_c = c.communicate(timeout=60)
        out_b, _ = b.communicate(timeout=60)
        assert b.returncode == 0 and c.returncode == 0, err_c
        assert fake_cc.starts == 2, "two builders compiled the same entry at once"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


CLEARER_SETS_FIRST = r"""
import pathlib
import kdagen.build as kb
real = pathlib.Path.iterdir
# Directory order is the file system's to choose; take the one where sets/ comes first.
pathlib.Path.iterdir = lambda self: iter(sorted(real(self), key=lambda p: p.name != "sets"))
print(kb.clear_cache(), flush=True)
"""


def test_clear_cache_during_a_set_build(fake_cc, tmp_path):
    p = builder(tmp_path, fake_cc, [GFX, GFX_LB], FAKE_CC_SLEEP="2")
    try:
        wait_for(lambda: fake_cc.starts >= 1, 60, "the set build's first compile")
        script = tmp_path / "clear_sets_first.py"
        script.write_text(CLEARER_SETS_FIRST)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60, env=_env())
        assert r.returncode == 0, r.stderr
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"the running set build failed: {out}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_dollar_in_the_cache_path_is_escaped_for_ninja(fake_cc, monkeypatch, tmp_path):
    """ninja expands $x in a command: a cache path with a $ must reach the compiler whole."""
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache sp$x"))
    text = ninja_text(plan(spec(), "objects"))
    commands = [line for line in text.splitlines() if line.strip().startswith("command =")]
    assert commands and any("sp$$x" in c for c in commands)
    assert not any(re.search(r"sp\$x", c.replace("$$", "")) for c in commands)


@pytest.mark.parametrize("text", ["[]", "{\"artefacts\": []}", "3"])
def test_a_manifest_of_the_wrong_shape_is_not_built(fake_cc, cache, text):
    """Valid JSON that is not a manifest: the entry counts as not built (rebuilt), and
    `cache list` skips it; no traceback."""
    e = plan(spec(), "objects")
    e.root.mkdir(parents=True)
    (e.root / "manifest.json").write_text(text)
    assert e.manifest() is None and e.problem() == "manifest unreadable"
    assert kb.cached_entries() == [] or all(isinstance(x, dict) for x in kb.cached_entries())


def test_a_broken_template_is_one_line_with_its_file_and_line(monkeypatch, capsys):
    from jinja2 import TemplateSyntaxError

    def broken(*a, **k):
        raise TemplateSyntaxError("unexpected '}'", 6, name="kernels.hip.j2", filename="kernels.hip.j2")

    monkeypatch.setattr(kb, "build_many", broken)
    assert cli.main(["build", "--compile-only"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "kdagen: error: template kernels.hip.j2:6: unexpected '}'"


def test_a_variant_set_resumes_after_one_variant_failed(fake_cc, monkeypatch):
    """One variant of a set fails to compile: the others' finished objects are kept, and
    the next build of the set compiles only the one that failed (ninja's log decides)."""
    ok, bad = spec(), spec(gate="lower_bound")
    line, _ = _nonblank_line(bad)
    monkeypatch.setenv("FAKE_CC_FAIL", str(line))
    monkeypatch.setenv("FAKE_CC_FAIL_ONLY", plan(bad, "objects").root.name)
    with pytest.raises(BuildError):
        build_many([ok, bad], "objects", jobs=1)
    done = fake_cc.dones
    monkeypatch.delenv("FAKE_CC_FAIL")
    entries = build_many([ok, bad], "objects", jobs=1)
    assert all(e.problem() is None for e in entries)
    assert fake_cc.dones == done + 1  # only the failed variant compiled again


def test_a_crash_in_a_set_shows_the_failed_command_not_the_log_end(fake_cc, monkeypatch):
    """No file:line error: the message starts at ninja's FAILED line (the variant that
    failed), not at the end of the log (another variant's output)."""
    bad = spec(gate="lower_bound")
    monkeypatch.setenv("FAKE_CC_CRASH", "1")
    monkeypatch.setenv("FAKE_CC_FAIL_ONLY", plan(bad, "objects").root.name)
    monkeypatch.setenv("FAKE_CC_CHATTY", "1")
    with pytest.raises(BuildError) as info:
        build_many([spec(), bad], "objects", jobs=2)
    msg = str(info.value)
    assert "FAILED:" in msg and "Segmentation fault" in msg


def test_clear_cache_does_not_count_what_it_could_not_remove(fake_cc, cache, monkeypatch):
    """An entry rmtree could not remove (a read-only folder, say) is an error naming it,
    not one more in 'removed N entries'."""
    build(spec(), "objects")
    monkeypatch.setattr(kb.shutil, "rmtree", lambda path, ignore_errors=False: None)
    with pytest.raises(BuildError, match="cannot remove .*; 0 entries were removed"):
        clear_cache()


CUOBJDUMP_RES = """
Resource usage:
 Common:
  GLOBAL:0
 Function _ZN6kdagen12chunk_kernelINS_6ConfigELi2ELb0EEEvNS_9ChunkArgsE:
  REG:213 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:728 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN6kdagen15prologue_kernelINS_6ConfigELb1EEEvNS_12PrologueArgsE:
  REG:64 STACK:8 SHARED:1024 LOCAL:152 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

AMD_NOTES = """Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x00001ca9	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     0
    .group_segment_fixed_size: 42492
    .name:           _ZN6kdagen17group_scan_kernelINS_6ConfigELi32ELi3EEEvNS_9ChunkArgsE
    .private_segment_fixed_size: 0
    .vgpr_count:     170
  - .group_segment_fixed_size: 0
    .name:           _ZN6kdagen12chunk_kernelINS_6ConfigELi3ELb1EEEvNS_9ChunkArgsE
    .private_segment_fixed_size: 104
    .vgpr_count:     256
amdhsa.target:   amdgcn-amd-amdhsa--gfx90a
...
"""


def test_resource_report_reads_both_vendors_tables():
    from kdagen.resource_report import format_report, parse_amd_notes, parse_cuobjdump

    nv = parse_cuobjdump(CUOBJDUMP_RES)
    assert [(r.kernel, r.registers, r.spill_bytes, r.static_shared) for r in nv] == [
        ("chunk_kernel<Config, 2, false>", 213, 0, 1024), ("prologue_kernel<Config, true>", 64, 160, 1024)]
    amd = parse_amd_notes(AMD_NOTES)
    assert [(r.kernel, r.registers, r.spill_bytes, r.static_shared) for r in amd] == [
        ("group_scan_kernel<Config, 32, 3>", 170, 0, 42492), ("chunk_kernel<Config, 3, true>", 256, 104, 0)]
    text = format_report("v", nv + amd)
    assert text.count("<- spills") == 2 and "prologue_kernel<Config, true>" in text
