"""Measured launch choices: an autotuner with a persistent per-device cache.

``groups.groups_for_spec`` guesses the chunk-group count from the grid's shape. The tuner
measures instead: for a shape class (sequences x heads, chunks per sequence, both rounded
down to a power of two) it times the chunk scan for every candidate group count on
synthetic inputs of that class, and, across variants that differ only in block width
(or in chunk size), which one is fastest end to end. Its choices go to
``<cache dir>/tune/<device>.json``; ``fused_kda_chunk`` uses a recorded group count
whenever one exists for its call (``KDAGEN_GROUPS`` and an explicit ``groups=`` still win),
and ``kda_forward`` a recorded chunk size and block width where none is given.

``kdagen tune`` fills the cache ahead of time; with ``KDAGEN_AUTOTUNE=1`` an unseen shape
class is tuned on first use (never while capturing a CUDA graph; it allocates about two
batches of the shape and takes a few hundred milliseconds), with ``KDAGEN_AUTOTUNE=0`` (or
``off``) the cache is ignored. Inside ``torch.compile`` tracing the heuristic decides (no
file is read into a graph), so compiled and eager calls may pick different group counts;
the results agree to rounding. Keys include the templates' digest: a new kernel version
starts from the heuristic again. A damaged cache file is reported with its path and
ignored, never fatal; one written by a newer kdagen is left alone.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

import torch

from .groups import MAX_GROUPS, cuda_index, num_compute_units
from .lock import FileLock

FORMAT = 1


def _say(msg: str) -> None:
    print(f"kdagen: {msg}", file=sys.stderr, flush=True)


def bucket(n: int) -> int:
    """``n`` rounded down to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << (int(n).bit_length() - 1)


@dataclass(frozen=True)
class ShapeClass:
    """What the group choice depends on: grid size and walk length, bucketed."""

    nh: int  # sequences x heads, power of two
    chunks: int  # chunks per sequence, power of two

    @classmethod
    def of(cls, num_seqs: int, num_heads: int, chunks_per_seq: int) -> "ShapeClass":
        return cls(bucket(num_seqs * num_heads), bucket(chunks_per_seq))

    def key(self) -> str:
        return f"nh{self.nh}-c{self.chunks}"


def group_candidates(chunks_per_seq: int, heuristic: int) -> list[int]:
    """1, the heuristic's choice, and powers of two from 2 while a group keeps at least
    two chunks (and at most ``MAX_GROUPS``)."""
    out = {1, max(1, heuristic)}
    g = 2
    while g <= min(MAX_GROUPS, chunks_per_seq // 2):
        out.add(g)
        g *= 2
    return sorted(out)


def device_tag(device: torch.device | None = None) -> str:
    """A file-name-safe name of the GPU model and its compute-unit count."""
    return _device_tag(cuda_index(device))


@lru_cache(maxsize=None)
def _device_tag(index: int) -> str:  # read once per device
    dev = torch.device("cuda", index)
    name = torch.cuda.get_device_name(dev)
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{name}_{num_compute_units(dev)}cu").strip("_")


def cache_path(tag: str) -> Path:
    from .build import cache_root

    return _tune_file(cache_root(), tag)


@lru_cache(maxsize=64)
def _tune_file(root: Path, tag: str) -> Path:
    return root / "tune" / f"{tag}.json"


class CacheUnreadable(Exception):
    """The tune file exists but cannot be read: it must not be overwritten."""


def _valid_entries(data: object) -> dict:
    """``data["entries"]`` if ``data`` is a format-1 tune file, else ValueError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a kdagen autotune file of format 1")
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(
            isinstance(rows, dict) and all(isinstance(r, dict) for r in rows.values())
            for rows in entries.values()):
        raise ValueError("its entries are not {spec: {shape: {...}}}")
    return entries


class TuneCache:
    """The choices recorded for one device: ``entries[spec key][shape key]``."""

    def __init__(self, path: Path):
        self.path = path if isinstance(path, Path) else Path(path)

    def _load(self, *, memo: bool) -> dict:
        """Parsed entries; {} for a missing or damaged file (said once per version of it);
        CacheUnreadable when the file exists but cannot be read."""
        name = str(self.path)
        try:
            st = os.stat(name)  # (every grouped call comes here: os.stat, not Path.stat)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise CacheUnreadable(f"{self.path}: {e}") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        seen = _read_cache.get(name)
        if memo and seen is not None and seen[0] == stamp:
            return seen[1]
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise CacheUnreadable(f"{self.path}: {e}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
            if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] > FORMAT:
                raise CacheUnreadable(f"{self.path} has format {data['format']}, written by a newer "
                                      "kdagen")
            entries = _valid_entries(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            if seen is None or seen[0] != stamp:
                _say(f"autotune cache {self.path} is damaged ({type(e).__name__}: {e}); ignoring "
                     "it (the next `kdagen tune` replaces it)")
            entries = {}
        _read_cache[name] = (stamp, entries)
        return entries

    def read(self) -> dict:
        try:
            return self._load(memo=True)
        except CacheUnreadable as e:
            _say(f"autotune cache unreadable ({e}); using the heuristics")
            return {}

    def get(self, spec_key: str, shape_key: str) -> dict | None:
        row = self.read().get(spec_key, {}).get(shape_key)
        return row if isinstance(row, dict) else None

    def put(self, spec_key: str, shape_key: str, row: dict) -> None:
        """Merge one choice in, under the cache lock (re-reading the file there), with an
        atomic replace. A file that exists but cannot be read is left alone."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(self.path.with_suffix(".lock"), quiet=True):
                entries = json.loads(json.dumps(self._load(memo=False)))  # a private copy
                entries.setdefault(spec_key, {})[shape_key] = row
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1,
                                          sort_keys=True))
                os.replace(tmp, self.path)
                st = self.path.stat()  # this process sees its own write, however coarse mtime is
                _read_cache[str(self.path)] = ((st.st_ino, st.st_mtime_ns, st.st_size), entries)
        except (OSError, CacheUnreadable) as e:
            _say(f"autotune cache {self.path} not written ({e}); the choice holds for this "
                 "process only")
            _memory.setdefault(str(self.path), {}).setdefault(spec_key, {})[shape_key] = row


_memory: dict[str, dict] = {}  # choices that could not be written, per cache file
_read_cache: dict[str, tuple[tuple[int, int, int], dict]] = {}  # parsed files by (inode, mtime, size)


def _lookup(path: Path, spec_key: str, shape_key: str) -> dict | None:
    row = TuneCache(path).get(spec_key, shape_key)
    return row if row is not None else _memory.get(str(path), {}).get(spec_key, {}).get(shape_key)


def pick_fastest(candidates: Iterable[int], time_one: Callable[[int], float]) -> tuple[int, dict]:
    """The candidate with the smallest measured time, and every time measured."""
    times = {int(c): float(time_one(int(c))) for c in candidates}
    best = min(times, key=lambda c: (times[c], c))
    return best, times


@lru_cache(maxsize=1)
def _code_version() -> str:
    """Measurements hold for one version of the kernels: the templates' digest."""
    from .render import templates_digest

    return templates_digest()[:12]


def chunk_spec_key(spec) -> str:
    """Group choices depend on the whole variant (block width included) and its code."""
    return f"{spec.name}@{_code_version()}"


def width_spec_key(spec) -> str:
    """Block-width choices compare variants that differ only in block width."""
    return f"{re.sub(r'_bv[0-9]+', '', spec.name)}@{_code_version()}"


def choice_spec_key(spec) -> str:
    """Chunk-size choices compare variants that differ only in chunk size and block width."""
    return f"{re.sub(r'_c[0-9]+_bv[0-9]+', '', spec.name)}@{_code_version()}"


# The chunk-size choice is recorded by chunks of this many tokens per sequence (the same
# shape class whichever chunk size is measured).
CHOICE_CHUNK = 64


def choice_shape(num_seqs: int, num_heads: int, tokens_per_seq: int) -> "ShapeClass":
    """The shape class a chunk-size choice is recorded under."""
    return ShapeClass.of(num_seqs, num_heads, -(-tokens_per_seq // CHOICE_CHUNK))


def _disabled() -> bool:
    return os.environ.get("KDAGEN_AUTOTUNE", "").strip().lower() in ("0", "off", "no", "false")


def _recorded(spec_key: str, field: str, num_seqs: int, num_heads: int, chunks_per_seq: int,
              device: torch.device) -> int | None:
    """An int ``field`` of the row recorded for this call's shape class, if any."""
    if _disabled() or device.type != "cuda":
        return None
    shape = ShapeClass.of(num_seqs, num_heads, chunks_per_seq)
    row = _lookup(cache_path(device_tag(device)), spec_key, shape.key())
    value = row.get(field) if row else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def recorded_groups(spec, num_seqs: int, num_heads: int, chunks_per_seq: int,
                    device: torch.device) -> int | None:
    """The tuned group count for this call's shape class, if one is recorded."""
    g = _recorded(chunk_spec_key(spec), "groups", num_seqs, num_heads, chunks_per_seq, device)
    return g if g is not None and 1 <= g <= MAX_GROUPS else None


def recorded_block_width(spec, num_seqs: int, num_heads: int, chunks_per_seq: int,
                         device: torch.device) -> int | None:
    """The tuned block width for variants like ``spec``, if one is recorded."""
    bv = _recorded(width_spec_key(spec), "block_width", num_seqs, num_heads, chunks_per_seq, device)
    return _valid_for(spec, "block_width", bv)


def _valid_for(spec, field: str, value: int | None) -> int | None:
    """``value`` if the validator takes it as ``field`` of ``spec``; a refused one is
    ignored, never fatal."""
    if value is None:
        return None
    try:
        type(spec).parse({**spec.canonical(), field: value})
    except ValueError:
        return None
    return value


def recorded_chunk_size(spec, num_seqs: int, num_heads: int, tokens_per_seq: int,
                        device: torch.device) -> int | None:
    """The tuned chunk size for variants like ``spec``, if one is recorded (its shape
    class counts chunks of ``CHOICE_CHUNK`` tokens: see ``choice_shape``)."""
    c = _recorded(choice_spec_key(spec), "chunk_size", num_seqs, num_heads,
                  -(-tokens_per_seq // CHOICE_CHUNK), device)
    return _valid_for(spec, "chunk_size", c)


def autotune_on_first_use() -> bool:
    return os.environ.get("KDAGEN_AUTOTUNE", "").strip().lower() in ("1", "on", "yes", "true")


def capturing() -> bool:
    """True while the current stream captures a CUDA graph (no timing runs then)."""
    from .checks import capturing as stream_capturing

    return stream_capturing()


# ---- measuring on a GPU ------------------------------------------------------------------------


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median device time of ``fn``: the benchmark's timer on one input set, each call
    behind a spin kernel (``lead``) so the host's enqueue is not inside the events. Timed
    from an idle stream, a choice of fewer launches won on host time alone (1x2048x32,
    session 21: 1 group at 0.257 ms eager against 4 at 0.269, where the device took
    0.232 ms for 1 group and 0.195 for 4)."""
    from .bench import time_ms

    return time_ms(lambda _: fn(), 1, reps, warmup=1, lead=True)


def _synthetic(kern, num_seqs: int, num_heads: int, chunks_per_seq: int, device: torch.device,
               seed: int = 0):
    """Inputs of the shape class, from a private generator (the caller's RNG state is
    left alone)."""
    from .testing import make_inputs

    spec = kern.spec
    D, C = spec.head_dim, spec.chunk_size
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.io_dtype]
    return make_inputs([chunks_per_seq * C] * num_seqs, num_heads, D, dtype=dtype, gate=spec.gate,
                       seed=seed, device=device)


def _gpu(device: torch.device | None) -> torch.device:
    return torch.device("cuda", cuda_index(device))


def tune_groups(kern, num_seqs: int, num_heads: int, chunks_per_seq: int, *, reps: int = 10,
                quiet: bool = False, device: torch.device | None = None) -> dict:
    """Time the chunk scan of ``kern`` for every candidate group count on synthetic inputs
    of this shape class, on ``device`` (default: the current GPU); record and return the
    choice. Allocates about two batches of that shape while it runs."""
    spec = kern.spec
    dev = _gpu(device)
    shape = ShapeClass.of(num_seqs, num_heads, chunks_per_seq)
    x = _synthetic(kern, num_seqs, num_heads, chunks_per_seq, dev)
    defer = kern.scan_forms_u  # the form ``prefill`` uses on this variant
    p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=defer)
    u = x.v if defer else p["u"]  # the prologue returns akk only when it defers u
    out = torch.empty_like(p["w"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = (torch.randn(num_seqs, num_heads, spec.head_dim, spec.head_dim, generator=gen) * 0.05).to(dev)
    heuristic = kern.heuristic_groups(chunks_per_seq, num_seqs, num_heads, dev)

    def run(g: int) -> float:
        return _time_ms(lambda: kern.fused_kda_chunk(
            p["qg"], p["w"], u, p["kg_t"], p["aqk"], p["decay"], out, None, x.cu_seqlens,
            init, True, groups=g, akk=p.get("akk")), reps)

    with torch.cuda.device(dev):
        best, times = pick_fastest(group_candidates(chunks_per_seq, heuristic), run)
    row = {"groups": best, "heuristic": heuristic, "ms": {str(g): round(t, 4) for g, t in times.items()},
           "shape": [num_seqs, num_heads, chunks_per_seq], "date": time.strftime("%Y-%m-%d")}
    TuneCache(cache_path(device_tag(dev))).put(chunk_spec_key(spec), shape.key(), row)
    if not quiet:
        _say(f"tuned {spec.name} {shape.key()}: groups {best} "
             f"({', '.join(f'{g}: {t:.3f} ms' for g, t in times.items())}; heuristic {heuristic})")
    return row


def _end_to_end_ms(kern, num_seqs: int, num_heads: int, chunks_per_seq: int, reps: int,
                   quiet: bool, dev: torch.device) -> float:
    """Prologue + chunk scan of ``kern`` (at its tuned group count) on synthetic inputs."""
    g = tune_groups(kern, num_seqs, num_heads, chunks_per_seq, reps=reps, quiet=quiet,
                    device=dev)["groups"]
    x = _synthetic(kern, num_seqs, num_heads, chunks_per_seq, dev, seed=1)

    def end_to_end():
        return kern.prefill(*x.args(), None, x.lower_bound, x.cu_seqlens, None, True, groups=g)

    with torch.cuda.device(dev):
        return _time_ms(end_to_end, reps)


def _record_fastest(field: str, tag: str, times: dict[int, float], spec_key: str, shape: ShapeClass,
                    shape_list: list[int], dev: torch.device, quiet: bool) -> dict:
    """Record the fastest of ``times`` (ties: the larger value) as ``field``; return the row."""
    best = min(times, key=lambda v: (times[v], -v))
    row = {field: best, "ms": {str(v): round(t, 4) for v, t in times.items()},
           "shape": shape_list, "date": time.strftime("%Y-%m-%d")}
    TuneCache(cache_path(device_tag(dev))).put(spec_key, shape.key(), row)
    if not quiet:
        _say(f"tuned {field.replace('_', ' ')} for {shape.key()}: {best} "
             f"({', '.join(f'{tag}{v}: {t:.3f} ms' for v, t in times.items())})")
    return row


def tune_chunk_size(kerns: list, num_seqs: int, num_heads: int, tokens_per_seq: int, *,
                    reps: int = 10, quiet: bool = False, device: torch.device | None = None) -> dict:
    """End-to-end (prologue + chunk, each at its tuned group count) across variants that
    differ only in chunk size (and block width), on ``tokens_per_seq`` tokens a sequence;
    record and return the choice (``kda_forward`` uses it when no chunk size is given)."""
    keys = {choice_spec_key(k.spec) for k in kerns}
    if len(keys) != 1 or len({k.spec.chunk_size for k in kerns}) != len(kerns):
        raise ValueError(f"tune_chunk_size: the variants must differ in chunk_size (and at most "
                         f"block_width), got {sorted(k.spec.name for k in kerns)}")
    dev = _gpu(device)
    shape = choice_shape(num_seqs, num_heads, tokens_per_seq)
    tokens = -(-tokens_per_seq // CHOICE_CHUNK) * CHOICE_CHUNK  # the same tokens for every size
    times = {}
    for kern in kerns:
        C = kern.spec.chunk_size
        times[C] = _end_to_end_ms(kern, num_seqs, num_heads, tokens // C, reps, quiet, dev)
    return _record_fastest("chunk_size", "c", times, keys.pop(), shape,
                           [num_seqs, num_heads, tokens_per_seq], dev, quiet)


def tune_block_width(kerns: list, num_seqs: int, num_heads: int, chunks_per_seq: int, *,
                     reps: int = 10, quiet: bool = False, device: torch.device | None = None) -> dict:
    """End-to-end (prologue + chunk, each at its tuned group count) across variants that
    differ only in block width; record and return the choice."""
    keys = {width_spec_key(k.spec) for k in kerns}
    if len(keys) != 1:
        raise ValueError(f"tune_block_width: the variants must differ only in block_width, got "
                         f"{sorted(k.spec.name for k in kerns)}")
    dev = _gpu(device)
    shape = ShapeClass.of(num_seqs, num_heads, chunks_per_seq)
    times = {kern.spec.block_width: _end_to_end_ms(kern, num_seqs, num_heads, chunks_per_seq,
                                                   reps, quiet, dev) for kern in kerns}
    return _record_fastest("block_width", "bv", times, keys.pop(), shape,
                           [num_seqs, num_heads, chunks_per_seq], dev, quiet)
