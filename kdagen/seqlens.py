"""``cu_seqlens`` checked once, with its chunk bookkeeping, per tensor.

The ops read ``cu_seqlens`` on the host to validate it, and derive the chunk indices
and offsets from it; each read synchronises with the device, and each derived tensor
costs a few launches. A model runs every KDA layer of a forward pass on the same
``cu_seqlens`` tensor, so the result is kept, keyed by the tensor's identity and its
version counter (which every in-place torch op bumps), like FLA's ``tensor_cache``: the
second and later calls on one tensor read nothing back and launch nothing.

Not cached: while tracing or capturing a CUDA graph (values cannot be read then, and a
graph must derive its indices from the tensor it replays with), a tensor made under
``torch.inference_mode`` (it has no version counter, so an in-place change would go
unseen: make ``cu_seqlens`` outside it to keep the cache), with
``KDAGEN_CHECK_VALUES=0``, or with ``KDAGEN_SEQLEN_CACHE=0``. A caller that rewrites a
``cu_seqlens`` buffer outside torch (its own kernel, DLPack) must set the latter.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import checks as ck
from .varlen import prepare_chunk_indices, prepare_chunk_offsets

CACHE_ENTRIES = 16


@dataclass(frozen=True)
class SeqLens:
    """One checked ``cu_seqlens`` and what the chunked ops derive from it."""

    cu32: torch.Tensor  # int32, contiguous, on the device
    total_tokens: int
    chunk_size: int
    chunk_offsets: torch.Tensor  # int32 [N + 1]
    num_chunks: int | None = None  # None where the values were not read (uncached)
    chunk_indices: torch.Tensor | None = None  # int32 [num_chunks, 2], likewise

    @property
    def num_seqs(self) -> int:
        return self.cu32.numel() - 1


_entries: OrderedDict[tuple, tuple[weakref.ref, SeqLens]] = OrderedDict()


def caching() -> bool:
    """Whether a checked ``cu_seqlens`` may be reused (values readable, cache not off)."""
    return ck.values_checkable() and os.environ.get("KDAGEN_SEQLEN_CACHE", "1") != "0"


def checked(op: str, cu_seqlens: object, total_tokens: int, device: torch.device | None,
            chunk_size: int) -> SeqLens:
    """The checked ``cu_seqlens`` of this call, from the cache when this tensor (same
    version) was checked before. Uncached (see the module text) it is checked as far as
    values can be read, and carries no host-side chunk count or indices."""
    if not caching():
        return _uncached(op, cu_seqlens, total_tokens, device, chunk_size)
    t = ck.tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=ck.INDEX_DTYPES, device=device)
    if t.is_inference():  # no version counter: an in-place change could not be seen
        return _uncached(op, t, total_tokens, device, chunk_size)
    key = (id(t), t._version, t.data_ptr(), t.dtype, chunk_size)
    hit = _entries.get(key)
    if hit is not None and hit[0]() is t:
        _entries.move_to_end(key)
        info = hit[1]
        if info.total_tokens != total_tokens:
            ck.cu_values(op, [0, info.total_tokens], total_tokens)  # raises: the end differs
        return info
    vals = ck.cu_seqlens_values(op, t, total_tokens)
    counts = [(b - a + chunk_size - 1) // chunk_size for a, b in zip(vals, vals[1:])]
    cu32 = t.to(torch.int32).contiguous()
    info = SeqLens(cu32=cu32, total_tokens=total_tokens, chunk_size=chunk_size,
                   chunk_offsets=prepare_chunk_offsets(cu32, chunk_size), num_chunks=sum(counts),
                   chunk_indices=prepare_chunk_indices(cu32, chunk_size, num_chunks=sum(counts)))
    _entries[key] = (weakref.ref(t), info)
    while len(_entries) > CACHE_ENTRIES:
        _entries.popitem(last=False)
    return info


def _uncached(op: str, cu_seqlens: object, total_tokens: int, device: torch.device | None,
              chunk_size: int) -> SeqLens:
    t = ck.cu_seqlens(op, cu_seqlens, total_tokens, device)
    cu32 = t.to(torch.int32).contiguous()
    return SeqLens(cu32=cu32, total_tokens=total_tokens, chunk_size=chunk_size,
                   chunk_offsets=prepare_chunk_offsets(cu32, chunk_size))


def clear() -> None:
    """Forget every checked ``cu_seqlens``."""
    _entries.clear()
