"""Argument checks for the op wrappers: bad input never reaches a kernel.

Shape, dtype, device and stride checks cost nothing and always run. Value checks
(monotone ``cu_seqlens``, index ranges, checkpoint alignment) read small index
tensors back to the host, so they are skipped while a CUDA graph is captured or
torch.compile traces (the kernels still skip out-of-range rows there), and can be
turned off with ``KDAGEN_CHECK_VALUES=0``.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Sequence

import torch

# Chunk groups an op takes: a group-scan block keeps a table of at most P - 1 + G - 1 <= 253
# products (chunk.h kMaxScanItems, P <= G - 1 segments).
MAX_OP_GROUPS = 128

INDEX_DTYPES = (torch.int32, torch.int64)


class ArgumentError(ValueError):
    """A bad argument, named."""


def _fail(op: str, name: str, msg: str, exc: type[Exception] = ArgumentError) -> None:
    raise exc(f"{op}: argument '{name}' {msg}")


def tensor(
    op: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = False,
    contiguous: bool = False,
    aligned: int = 0,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        _fail(op, name, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    assert isinstance(t, torch.Tensor)
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(op, name, f"must have dtype {allowed}, got {str(t.dtype).removeprefix('torch.')}",
              TypeError)
    want_ndim = len(shape) if shape is not None else ndim
    if want_ndim is not None and t.dim() != want_ndim:
        _fail(op, name, f"must have {want_ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                expect = tuple("*" if s is None else s for s in shape)
                _fail(op, name, f"must have shape {expect}, got {tuple(t.shape)} (dim {i})")
    if device is not None and t.device != device:
        _fail(op, name, f"must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        _fail(op, name, f"must be contiguous, got strides {t.stride()}")
    if last_contiguous and t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        _fail(op, name, f"must have a contiguous last dim, got strides {t.stride()}")
    if aligned and t.numel() > 0 and not tracing() and t.data_ptr() % aligned != 0:
        _fail(op, name, f"must start on a {aligned}-byte boundary (a view at an odd offset?)")
    return t


def _rows16_problem(t: torch.Tensor, check_address: bool) -> str | None:
    """Why a kernel may not copy the rows of ``t [1, T, H, D]`` as 16-byte pieces (None:
    it may): the data and its token / head strides 16-byte aligned, and a chunk's row
    offsets inside 32 bits."""
    step = 16 // t.element_size()
    if check_address and t.numel() > 0 and t.data_ptr() % 16 != 0:
        return "must start on a 16-byte boundary"
    if t.stride(1) % step != 0 or t.stride(2) % step != 0:
        return (f"must have token / head strides that are multiples of {step} elements, got "
                f"strides {t.stride()}")
    if t.stride(1) * 64 >= 2 ** 31:
        return (f"has a token stride of {t.stride(1)} elements, too large for the kernels' 32-bit "
                "offsets inside a chunk")
    return None


def rows16_ok(t: torch.Tensor) -> bool:
    """Whether a kernel may copy the rows of ``t [1, T, H, D]`` (16-bit, last dim
    contiguous) as 16-byte pieces; False while tracing, where the address is unknown."""
    if tracing() or t.dim() != 4 or t.element_size() != 2 or (t.size(-1) > 1 and t.stride(-1) != 1):
        return False
    return _rows16_problem(t, check_address=True) is None


def rows16(op: str, name: str, t: torch.Tensor, why: str) -> None:
    """Refuse ``t [1, T, H, D]`` unless a kernel may copy its rows as 16-byte pieces (the
    address is not checked while tracing)."""
    problem = _rows16_problem(t, check_address=not tracing())
    if problem is not None:
        _fail(op, name, f"{problem} {why}")


def optional(op: str, name: str, t: object, **kw: object) -> torch.Tensor | None:
    return None if t is None else tensor(op, name, t, **kw)  # type: ignore[arg-type]


def tracing() -> bool:
    """True inside torch.compile / export tracing (tensors may be fake there)."""
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - old torch
        return False


def values_checkable() -> bool:
    """False while capturing a CUDA graph or tracing, where reading values would sync."""
    if tracing():
        return False
    if os.environ.get("KDAGEN_CHECK_VALUES", "1") == "0":
        return False
    return not capturing()


def capturing() -> bool:
    """True while the current stream captures a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cu_seqlens(op: str, cu: object, total_tokens: int, device: torch.device | None) -> torch.Tensor:
    t = tensor(op, "cu_seqlens", cu, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if values_checkable():
        cu_seqlens_values(op, t, total_tokens)
    elif t.numel() < 2:
        _fail(op, "cu_seqlens", f"must hold at least 2 offsets (N + 1), got {t.numel()}")
    return t


def cu_seqlens_values(op: str, t: torch.Tensor, total_tokens: int | None) -> list[int]:
    """The values of a checked-shape ``cu_seqlens`` (one host read), after checking them:
    at least two, from 0, never decreasing, ending at or before ``total_tokens`` (any end
    if None)."""
    if t.numel() < 2:
        _fail(op, "cu_seqlens", f"must hold at least 2 offsets (N + 1), got {t.numel()}")
    vals = t.tolist()
    if vals[0] != 0:
        _fail(op, "cu_seqlens", f"must start at 0, got {vals[0]}")
    bad = next((i for i in range(1, len(vals)) if vals[i] < vals[i - 1]), None)
    if bad is not None:
        _fail(op, "cu_seqlens", f"must be non-decreasing, but [{bad - 1}] = {vals[bad - 1]} > "
                                f"[{bad}] = {vals[bad]}")
    if total_tokens is not None:
        cu_end(op, vals[-1], total_tokens)
    return vals


def cu_end(op: str, end: int, total_tokens: int) -> None:
    """``cu_seqlens`` must end at or before the token count: tokens past its end (a padded
    tail, as an engine's CUDA-graph padding leaves) belong to no sequence and are left
    alone, as the production wrapper's kernels leave them."""
    if end > total_tokens:
        _fail(op, "cu_seqlens", f"must end at or before the token count {total_tokens}, got {end}")


def indices(op: str, name: str, t: object, n: int, rows: int, device: torch.device | None,
            distinct: bool = True) -> torch.Tensor:
    """An int index per sequence into ``rows`` rows; negative entries mean 'none'. The
    kernels take int32: an int64 entry below -2^31 would wrap to a row when cast. With
    ``distinct`` (rows every sequence writes) no row may be named twice."""
    x = tensor(op, name, t, shape=(n,), dtypes=INDEX_DTYPES, device=device)
    if values_checkable() and n > 0:
        lo, hi, dup = index_facts(x)
        if hi >= rows:
            _fail(op, name, f"holds row {hi}, but the target has only {rows} rows")
        if lo < -(2 ** 31):
            _fail(op, name, f"holds {lo}, outside int32 (the kernels' index type): it would wrap "
                            "to a row when cast; use -1 for 'none'")
        if distinct and dup is not None:
            _fail(op, name, f"names row {dup} for two sequences: both would write it at once; "
                            "give each sequence its own row (or -1 for 'none')")
    return x


def memo_on() -> bool:
    """Whether values read back from index tensors may be kept (``KDAGEN_SEQLEN_CACHE``)."""
    return os.environ.get("KDAGEN_SEQLEN_CACHE", "1") != "0"


class TensorMemo:
    """What was read back from (or derived from the contents of) a small tensor, kept per
    tensor and version counter (which every in-place torch op bumps), like FLA's
    ``tensor_cache``: a hit reads nothing back. Not kept for inference-mode tensors (no
    version counter), nor with ``KDAGEN_SEQLEN_CACHE=0``; at most ``size`` entries."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[weakref.ref, object]] = OrderedDict()

    def get(self, t: torch.Tensor, extra: object, compute):
        """``compute()``, or what it gave for this tensor, version and ``extra`` before."""
        if t.is_inference() or not memo_on():
            return compute()
        key = (id(t), t._version, t.data_ptr(), t.dtype, extra)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is t:
            self._entries.move_to_end(key)
            return hit[1]
        value = compute()
        self._entries[key] = (weakref.ref(t), value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_index_memo = TensorMemo(32)  # index_facts per tensor version


def index_facts(x: torch.Tensor) -> tuple[int, int, int | None]:
    """``(min, max, a row named twice or None)`` of an index tensor (negative entries,
    'none', may repeat): one host read, kept per tensor version (``TensorMemo``), so every
    layer of a forward pass on one ``state_indices`` tensor reads it back once."""

    def read() -> tuple[int, int, int | None]:
        lo, hi, *vals = (int(v) for v in torch.cat([torch.stack(torch.aminmax(x)), x.reshape(-1)]).tolist())
        seen: set[int] = set()
        for v in vals:
            if v >= 0:
                if v in seen:
                    return lo, hi, v
                seen.add(v)
        return lo, hi, None

    return _index_memo.get(x, x.numel(), read)


def flags(op: str, name: str, t: object, n: int, device: torch.device | None) -> torch.Tensor:
    return tensor(op, name, t, shape=(n,), dtypes=(torch.bool,), device=device, contiguous=True)


def same_values(op: str, name: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A caller-given index tensor must equal what cu_seqlens implies (value check)."""
    if not values_checkable():
        return
    if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.to(want.dtype), want):
        _fail(op, name, f"does not match cu_seqlens: expected {what} {want.tolist()}")


def group_count(op: str, groups: object) -> int:
    if isinstance(groups, bool) or not isinstance(groups, int):
        _fail(op, "groups", f"must be an int >= 1, got {groups!r}", TypeError)
    assert isinstance(groups, int)
    if groups < 1 or groups > MAX_OP_GROUPS:
        _fail(op, "groups", f"must be in 1 .. {MAX_OP_GROUPS}, got {groups}")
    return groups


def segment_count(op: str, segments: object, groups: int) -> int:
    """Pass one's segments: 1 .. groups - 1 with chunk groups, 0 = one per group."""
    if isinstance(segments, bool) or not isinstance(segments, int):
        _fail(op, "segments", f"must be an int >= 0, got {segments!r}", TypeError)
    assert isinstance(segments, int)
    top = max(groups - 1, 0)
    if segments < 0 or segments > top:
        _fail(op, "segments", f"must be in 0 .. groups - 1 = {top}, got {segments}")
    return segments


def same_device(op: str, ref: torch.Tensor, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            _fail(op, name, f"must be on {ref.device} like the other inputs, got {t.device}")
