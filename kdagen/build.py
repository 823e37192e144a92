"""Build variants with ninja into a content-addressed cache.

An entry is ``<cache>/<variant-name>-<key>``, the key a hash of everything that
changes the binary: canonical spec, templates and headers, compiler identity, its
command line and the environment variables it reads (``toolchain.COMPILER_ENV``), arch,
torch and kdagen versions, and the build mode. Building follows
check, lock, check again: a complete entry (its manifest lists every artefact with
a sha256) is used as it is; otherwise, under a file lock, ninja brings the entry up
to date (incrementally, so a killed or failed build, of one variant or a set, resumes
where ninja's log says it stopped) and the manifest is written last,
by atomic rename. A library is linked to a temporary name and renamed into place,
so no reader ever sees half of one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from . import __version__
from .lock import FileLock
from .render import KERNEL_SOURCE, BINDING_SOURCE, render, templates_digest
from .spec import KernelSpec
from .toolchain import DeviceCompiler, TorchToolchain, compiler_env, device_compiler, torch_toolchain

Mode = Literal["full", "objects"]
MANIFEST = "manifest.json"


class BuildError(RuntimeError):
    """A compiler failure, with the generated file, line and first error."""


def cache_root() -> Path:
    """KDAGEN_CACHE_DIR, else ~/.cache/kdagen (read on every call: tests and tools change it;
    the path made once per value, since the autotune lookup of every grouped call needs it)."""
    return _cache_root(os.environ.get("KDAGEN_CACHE_DIR") or "", os.environ.get("HOME") or "")


@functools.lru_cache(maxsize=16)
def _cache_root(env: str, home: str) -> Path:
    return Path(env) if env else Path.home() / ".cache" / "kdagen"


def verbose_default() -> bool:
    return os.environ.get("KDAGEN_VERBOSE", "") not in ("", "0")


def _say(msg: str) -> None:
    print(f"kdagen: {msg}", file=sys.stderr, flush=True)


@dataclass
class Entry:
    """One variant's build: where it lives and how it is built."""

    spec: KernelSpec
    mode: Mode
    device: DeviceCompiler
    torch_tc: TorchToolchain | None
    key: str
    root: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def library(self) -> Path:
        return self.root / f"{self.spec.name}.so"

    @property
    def kernels_object(self) -> Path:
        return self.root / "obj" / "kernels.o"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def lock_path(self) -> Path:
        return self.root.parent / f"{self.root.name}.lock"

    def artefacts(self) -> list[Path]:
        return [self.library] if self.mode == "full" else [self.kernels_object]

    # ---- completeness ------------------------------------------------------------------

    def manifest(self) -> dict | None:
        """The entry's manifest; None if missing, unreadable or not a manifest's shape."""
        try:
            m = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return m if isinstance(m, dict) and isinstance(m.get("artefacts", {}), dict) else None

    def problem(self) -> str | None:
        """Why this entry cannot be used as it is (None: complete and intact)."""
        m = self.manifest()
        if m is None:  # never published (ninja's log keeps what finished), or damaged
            return "manifest unreadable" if (self.root / MANIFEST).exists() else "not built"
        if m.get("key") != self.key:
            return "manifest belongs to another build"
        for rel, digest in m.get("artefacts", {}).items():
            p = self.root / rel
            if not p.is_file():
                return f"{p} is missing"
            if _sha256(p) != digest:
                return f"{p} does not match its manifest (truncated or corrupted)"
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_DIGESTS: dict[tuple, str] = {}


def resource_constants() -> tuple:
    """kdagen's resource constants (resources.py) as they are now: the rendered Config
    follows them, so they are part of what a build is. (Their names are found once; their
    values are read on every call: tests and A/B tools change them.)"""
    from . import resources

    return tuple((k, getattr(resources, k)) for k in _constant_names())


@functools.lru_cache(maxsize=1)
def _constant_names() -> tuple[str, ...]:
    from . import resources

    return tuple(sorted(k for k, v in vars(resources).items()
                        if k.isupper() and isinstance(v, (bool, int, float, str))))


def sources_digest(spec: KernelSpec, templates: str) -> str:
    """Digest of ``spec``'s rendered sources (`Rendered.digest`), rendered once per spec,
    template set (``templates``: their digest) and value of kdagen's resource constants
    (every load plans its build)."""
    key = (spec.uri, templates, resource_constants())
    if key not in _DIGESTS:
        _DIGESTS[key] = render(spec).digest()
    return _DIGESTS[key]


def plan(spec: KernelSpec, mode: Mode = "full") -> Entry:
    """Work out the entry of ``spec`` (finds compilers; builds nothing)."""
    dev = device_compiler(spec.target_info, allow_substitute=(mode == "objects"))
    tc = torch_toolchain(spec.target_info) if mode == "full" else None
    templates = templates_digest()
    ident = {
        "spec": spec.canonical(),
        "templates": templates,
        "sources": sources_digest(spec, templates),  # the Config follows resources.py constants too
        "mode": mode,
        "device_compiler": [dev.path, dev.version, dev.arch, list(dev.flags),
                            dev.compile_command("S", "O", "I", "D")],  # its own flags too
        "compiler_env": compiler_env(),
        "torch": None if tc is None else [tc.torch_version, tc.cxx, list(tc.defines), list(tc.libraries)],
        "kdagen": __version__,
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return Entry(spec, mode, dev, tc, key, cache_root() / f"{spec.name}-{key[:12]}")


# ---- ninja file ------------------------------------------------------------------------


def _q(p: Path | str) -> str:
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _cmd(args: list[str]) -> str:
    """Shell-quote a command for a ninja rule: ninja's $in / $out variables bare, any
    other ``$`` (a path's) escaped as ``$$``."""
    return " ".join(a if a.startswith("$") else shlex.quote(a).replace("$", "$$") for a in args)


def ninja_text(e: Entry) -> str:
    """A self-contained build.ninja with absolute paths (so sets can subninja it)."""
    src, inc, obj = e.root / "src", e.root / "src" / "include", e.root / "obj"
    dev_cmd = e.device.compile_command("$in", "$out", str(inc), "$out.d")
    lines = [
        f"# kdagen {__version__}: {e.name} ({e.mode}), key {e.key}",
        "ninja_required_version = 1.5",
        "",
        "rule device",
        f"  command = {_cmd(dev_cmd)}",
        "  depfile = $out.d",
        "  deps = gcc",
        f"  description = compile {e.name}/{KERNEL_SOURCE} for {e.device.arch}",
        "",
        f"build {_q(obj / 'kernels.o')}: device {_q(src / KERNEL_SOURCE)}",
    ]
    if e.mode == "full":
        tc = e.torch_tc
        assert tc is not None
        cxx_flags = ["-std=c++17", "-O2", "-fPIC", *tc.defines, f"-I{inc}"]
        cxx_flags += [f"-isystem{d}" for d in tc.include_dirs]
        link = [f"-L{d}" for d in tc.library_dirs] + [f"-Wl,-rpath,{d}" for d in tc.library_dirs]
        link += [f"-l{lib}" for lib in tc.libraries]
        lines += [
            "",
            "rule cxx",
            f"  command = {_cmd([tc.cxx, *cxx_flags])} -MD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            f"  description = compile {e.name}/{BINDING_SOURCE} (torch binding)",
            "",
            "rule link",
            f"  command = {_cmd([tc.cxx])} -shared $in -o $out.partial {_cmd(link)}"
            " && mv -f $out.partial $out",
            f"  description = link {e.name}.so",
            "",
            f"build {_q(obj / 'binding.o')}: cxx {_q(src / BINDING_SOURCE)}",
            f"build {_q(e.library)}: link {_q(obj / 'kernels.o')} {_q(obj / 'binding.o')}",
        ]
    lines += ["", "default " + " ".join(_q(a) for a in e.artefacts()), ""]
    return "\n".join(lines)


def _prepare(e: Entry) -> None:
    """Render sources and the ninja file into the entry (idempotent)."""
    try:
        e.root.mkdir(parents=True, exist_ok=True)
        render(e.spec).write(e.root / "src")
        (e.root / "obj").mkdir(exist_ok=True)
        text = ninja_text(e)
        nf = e.root / "build.ninja"
        if not nf.is_file() or nf.read_text() != text:
            nf.write_text(text)
    except PermissionError as err:
        raise BuildError(
            f"cache directory {e.root.parent} is not writable ({err.strerror}); "
            "set KDAGEN_CACHE_DIR to a writable folder"
        ) from None
    except OSError as err:
        raise BuildError(f"cannot write the cache entry {e.root}: {err}") from None


def _publish(e: Entry, seconds: float) -> None:
    for a in e.artefacts():
        if not a.is_file() or a.stat().st_size == 0:
            raise BuildError(f"ninja finished but {a} is missing or empty; see {e.log}")
    manifest = {
        "key": e.key,
        "name": e.name,
        "mode": e.mode,
        "spec": e.spec.canonical(),
        "arch": e.device.arch,
        "note": e.device.note,
        "compiler": e.device.version,
        "artefacts": {str(a.relative_to(e.root)): _sha256(a) for a in e.artefacts()},
        "build_seconds": round(seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = e.root / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, e.root / MANIFEST)


def _invalidate(e: Entry) -> None:
    """Drop the manifest and any damaged artefact so ninja rebuilds it."""
    (e.root / MANIFEST).unlink(missing_ok=True)
    for a in e.artefacts():
        a.unlink(missing_ok=True)


# ---- running ninja ------------------------------------------------------------------------

_ERR_RE = re.compile(
    r"^(?P<file>[^\s:()][^:()]*?)(?:\((?P<l1>\d+)\)|:(?P<l2>\d+)(?::\d+)?):\s*(?:fatal\s+)?error\b[:\s]*(?P<msg>.*)$"
)


def first_error(log: str) -> tuple[str, int, str] | None:
    """(file, line, message) of the first compiler error in a log."""
    for ln in log.splitlines():
        m = _ERR_RE.match(ln.strip())
        if m:
            return m["file"], int(m["l1"] or m["l2"]), m["msg"].strip()
    return None


def _failure(log_path: Path, log: str, what: str) -> BuildError:
    err = first_error(log)
    if err is None:  # no file:line error (a crash, a kill): from ninja's FAILED line on
        lines = log.strip().splitlines()
        failed = next((i for i, ln in enumerate(lines) if ln.startswith("FAILED:")), None)
        tail = "\n".join(lines[failed:failed + 15] if failed is not None else lines[-15:])
        return BuildError(f"{what} failed:\n{tail}\nfull log: {log_path}")
    file, line, msg = err
    src_line = ""
    try:
        src_line = Path(file).read_text().splitlines()[line - 1].strip()
    except (OSError, IndexError):
        pass
    shown = f"\n    {line} | {src_line}" if src_line else ""
    return BuildError(f"{what} failed: {file}:{line}: error: {msg}{shown}\nfull log: {log_path}")


def _ninja() -> str:
    path = shutil.which("ninja")
    if path is None:
        try:
            import ninja  # the PyPI package ships the binary

            path = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            pass
    if path is None:
        raise BuildError("ninja not found: `pip install ninja`")
    return path


# Seconds without a line from ninja after which a build says it is still running.
HEARTBEAT_S = 20.0


def parallel_jobs(jobs: int | None) -> int:
    """Ninja's -j: ``jobs`` (``-j`` / ``--jobs``, >= 1), else KDAGEN_JOBS, else 0 (ninja's
    own default); a BuildError for a setting that is not a whole number."""
    if jobs is not None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise BuildError(f"-j / --jobs {jobs!r}: parallel compile jobs must be a whole number >= 1")
        return jobs
    text = os.environ.get("KDAGEN_JOBS", "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise BuildError(f"KDAGEN_JOBS={text!r}: parallel compile jobs must be a whole number "
                         "(unset or 0: ninja's default)")
    return int(text)


def run_ninja(ninja_file: Path, log_path: Path, *, verbose: bool, jobs: int, what: str) -> None:
    """``jobs``: ninja's -j as ``parallel_jobs`` resolved it (0: ninja's own default)."""
    cmd = [_ninja(), "-f", str(ninja_file)]
    if verbose:
        cmd.append("-v")
    if jobs:
        cmd += ["-j", str(jobs)]
    env = dict(os.environ)
    env.setdefault("HIP_PLATFORM", "amd")
    env["NINJA_STATUS"] = "[%f/%t] "
    chunks: list[str] = []
    start = time.monotonic()
    last = [start]  # when a line was last shown
    done = threading.Event()

    def heartbeat() -> None:
        # ninja names a step when it ends (its output is a pipe): say that the build is
        # alive while a long compile runs (a kernels object takes a minute or more)
        while not done.wait(HEARTBEAT_S / 4):
            now = time.monotonic()
            if now - last[0] >= HEARTBEAT_S:
                last[0] = now
                _say(f"still {what} ({now - start:.0f} s)")

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ninja_file.parent, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            for line in proc.stdout:
                log.write(line)
                chunks.append(line)
                if verbose or line.startswith("["):
                    last[0] = time.monotonic()
                    print(f"kdagen: {line.rstrip()}", file=sys.stderr, flush=True)
            rc = proc.wait()
        finally:
            done.set()
            beat.join()
    if rc != 0:
        raise _failure(log_path, "".join(chunks), what)


# ---- public entry points ------------------------------------------------------------------


def build(spec: KernelSpec, mode: Mode = "full", *, verbose: bool | None = None,
          force: bool | None = None, jobs: int | None = None) -> Entry:
    """Build one variant (or find it built) and return its entry."""
    return build_many([spec], mode, verbose=verbose, force=force, jobs=jobs)[0]


def build_many(specs: Iterable[KernelSpec], mode: Mode = "full", *, verbose: bool | None = None,
               force: bool | None = None, jobs: int | None = None) -> list[Entry]:
    """Build several variants through one ninja graph, in parallel."""
    verbose = verbose_default() if verbose is None else verbose
    if force is None:
        force = os.environ.get("KDAGEN_REBUILD", "") not in ("", "0")
    jobs = parallel_jobs(jobs)  # a bad setting refused before any entry is touched
    entries = [plan(s, mode) for s in specs]
    todo = [e for e in entries if force or e.problem() is not None]
    if not todo:
        return entries
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuildError(f"cannot create the cache directory {cache_root()}: {err.strerror}; "
                         "set KDAGEN_CACHE_DIR") from None
    locks = []
    unique = {e.root: e for e in todo}
    try:
        for e in sorted(unique.values(), key=lambda x: str(x.root)):
            lk = FileLock(e.lock_path)
            try:
                lk.acquire()
            except OSError as err:
                raise BuildError(f"cannot lock {e.lock_path}: {err.strerror or err}; "
                                 "set KDAGEN_CACHE_DIR to a writable folder") from None
            locks.append(lk)
        # Check again under the lock: another process may have finished meanwhile.
        todo = [e for e in unique.values() if force or e.problem() is not None]
        if not todo:
            return entries
        for e in todo:
            problem = e.problem()
            if problem not in (None, "not built"):
                _say(f"rebuilding {e.name}: {problem}")
            if force or problem not in (None, "not built"):
                _invalidate(e)
            else:  # never finished: ninja's log keeps what a stopped or failed build completed
                (e.root / MANIFEST).unlink(missing_ok=True)
            _prepare(e)
            if e.device.note:
                _say(e.device.note)
        names = ", ".join(e.name for e in todo)
        steps = "device code only, no link, no load" if mode == "objects" else "compile, link"
        _say(f"building {names} ({steps})")
        start = time.monotonic()
        if len(todo) == 1:
            ninja_file, log = todo[0].root / "build.ninja", todo[0].log
            run_ninja(ninja_file, log, verbose=verbose, jobs=jobs, what=f"building {names}")
        else:
            ninja_file, log = _set_ninja(todo)
            with FileLock(ninja_file.parent.with_suffix(".lock"), quiet=True):
                run_ninja(ninja_file, log, verbose=verbose, jobs=jobs, what=f"building {names}")
        seconds = time.monotonic() - start
        if len(todo) > 1:
            for e in todo:
                shutil.copyfile(log, e.log)
        for e in todo:
            _publish(e, seconds)
        _say(f"built {len(todo)} variant(s) in {seconds:.1f} s")
    finally:
        for lk in locks:
            lk.release()
    return entries


def _set_ninja(entries: list[Entry]) -> tuple[Path, Path]:
    ident = hashlib.sha256("".join(sorted(e.key for e in entries)).encode()).hexdigest()[:12]
    root = cache_root() / "sets" / ident
    root.mkdir(parents=True, exist_ok=True)
    lines = [f"# kdagen variant set of {len(entries)}", "ninja_required_version = 1.5", ""]
    lines += [f"subninja {_q(e.root / 'build.ninja')}" for e in entries]
    lines += ["", "default " + " ".join(_q(a) for e in entries for a in e.artefacts()), ""]
    nf = root / "build.ninja"
    nf.write_text("\n".join(lines))
    return nf, root / "build.log"


def cached_entries() -> list[dict]:
    """Every complete entry in the cache, as its manifest plus path and size."""
    out = []
    root = cache_root()
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        m = d / MANIFEST
        if d.is_dir() and m.is_file():
            try:
                info = json.loads(m.read_text())
            except ValueError:
                continue
            if not isinstance(info, dict):  # not a manifest: not a complete entry
                continue
            size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            out.append({**info, "path": str(d), "bytes": size})
    return out


def clear_cache() -> int:
    """Remove every build entry (and stale locks of no running build); return how many.
    The autotuner's ``tune/`` folder stays."""
    root = cache_root()
    if not root.is_dir():
        return 0
    n = 0
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name == "tune":  # tune/: measured choices, not builds
            continue
        if d.name == "sets":
            for s in sorted(d.iterdir()):
                if s.is_dir():
                    with FileLock(s.with_suffix(".lock")):  # not under a running set build
                        shutil.rmtree(s, ignore_errors=True)
            continue
        # Lock files stay: a builder may be waiting on this very file, and a new file at the
        # same path would let a second builder in beside it.
        with FileLock(root / f"{d.name}.lock"):  # never pull an entry from under a build
            shutil.rmtree(d, ignore_errors=True)
        if d.exists():  # a file it could not remove: say so, do not count it
            raise BuildError(f"cannot remove {d} (permissions?); {n} entries were removed")
        n += 1
    return n
