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

``prepare`` (``kdagen.prepare_seqlens``) does the check once, explicitly: its result
passes as ``cu_seqlens`` to the ops. ``dense`` makes the bookkeeping of a ``[B, T, ...]``
batch from its shape (kda_forward without ``cu_seqlens``): nothing to check or read back.
"""

from __future__ import annotations

import functools
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

    def indices(self) -> torch.Tensor:
        """The chunk indices: the kept ones, else derived now (a host read of the count)."""
        if self.chunk_indices is not None:
            return self.chunk_indices
        return prepare_chunk_indices(self.cu32, self.chunk_size)


_entries = ck.TensorMemo(CACHE_ENTRIES)


def caching() -> bool:
    """Whether a checked ``cu_seqlens`` may be reused (values readable, cache not off)."""
    return ck.values_checkable() and ck.memo_on()


def prepare(cu_seqlens: torch.Tensor, chunk_size: int) -> SeqLens:
    """Check ``cu_seqlens`` now (one host read) and keep its chunk bookkeeping. Pass the
    result as ``cu_seqlens`` to the ops, for any number of layers: they read nothing back
    and launch nothing for it. For engines whose ``cu_seqlens`` is made under
    ``torch.inference_mode`` (never cached). Not for CUDA-graph capture, where the
    indices must come from the tensor the graph replays with."""
    op = "prepare_seqlens"
    t = ck.tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=ck.INDEX_DTYPES)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ck.ArgumentError(f"{op}: argument 'chunk_size' must be a positive int, got {chunk_size!r}")
    return _derived(t, chunk_size, ck.cu_seqlens_values(op, t, None))


def dense(batch: int, length: int, chunk_size: int, device: torch.device) -> SeqLens:
    """The bookkeeping of ``batch`` sequences of ``length`` tokens each (a ``[B, T, ...]``
    call without ``cu_seqlens``), made on the device from the shape alone: no host read,
    kept per shape (a model's layers share it). Eager calls only: ``caching()``."""
    # per stream too: the tensors were made on one, and an evicted entry's memory must not
    # be handed out on it while another stream's kernels still read them
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _dense(batch, length, chunk_size, device, stream)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _dense(batch: int, length: int, chunk_size: int, device: torch.device, stream: int) -> SeqLens:
    per = -(-length // chunk_size)
    steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
    cu32 = steps * length
    return SeqLens(cu32=cu32, total_tokens=batch * length, chunk_size=chunk_size,
                   chunk_offsets=steps * per, num_chunks=batch * per,
                   chunk_indices=prepare_chunk_indices(cu32, chunk_size, num_chunks=batch * per))


def _derived(t: torch.Tensor, chunk_size: int, vals: list[int] | None,
             total_tokens: int | None = None) -> SeqLens:
    """The bookkeeping of a checked ``t``; with its host values also the chunk count and
    indices (no further host read)."""
    cu32 = t.to(torch.int32).contiguous()
    offsets = prepare_chunk_offsets(cu32, chunk_size)
    if vals is None:
        return SeqLens(cu32=cu32, total_tokens=total_tokens, chunk_size=chunk_size,
                       chunk_offsets=offsets)
    n = sum((b - a + chunk_size - 1) // chunk_size for a, b in zip(vals, vals[1:]))
    return SeqLens(cu32=cu32, total_tokens=vals[-1], chunk_size=chunk_size, chunk_offsets=offsets,
                   num_chunks=n, chunk_indices=prepare_chunk_indices(cu32, chunk_size, num_chunks=n))


def _given(op: str, sl: SeqLens, total_tokens: int, device: torch.device | None,
           chunk_size: int) -> SeqLens:
    """A prepared SeqLens passed as cu_seqlens: checked against this call."""
    if ck.tracing() or ck.capturing():
        raise ck.ArgumentError(f"{op}: argument 'cu_seqlens' is a prepared SeqLens, which cannot be "
                               "used while tracing or capturing a CUDA graph (its indices would not "
                               "follow the replayed tensor): pass the cu_seqlens tensor")
    if sl.chunk_size != chunk_size:
        raise ck.ArgumentError(f"{op}: argument 'cu_seqlens' was prepared for chunk size "
                               f"{sl.chunk_size}, this variant's is {chunk_size}")
    if device is not None and sl.cu32.device != device:
        raise ck.ArgumentError(f"{op}: argument 'cu_seqlens' must be on {device}, got {sl.cu32.device}")
    ck.cu_end(op, sl.total_tokens, total_tokens)
    return sl


def checked(op: str, cu_seqlens: object, total_tokens: int, device: torch.device | None,
            chunk_size: int) -> SeqLens:
    """The checked ``cu_seqlens`` of this call: a prepared SeqLens as given, else from the
    cache when this tensor (same version) was checked before. Uncached (see the module
    text) it is checked as far as values can be read, and carries no host-side chunk
    count or indices."""
    if isinstance(cu_seqlens, SeqLens):
        return _given(op, cu_seqlens, total_tokens, device, chunk_size)
    if not caching():
        return _uncached(op, cu_seqlens, total_tokens, device, chunk_size)
    t = ck.tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=ck.INDEX_DTYPES, device=device)
    if t.is_inference():  # no version counter: an in-place change could not be seen
        return _uncached(op, t, total_tokens, device, chunk_size)
    info = _entries.get(t, chunk_size,
                        lambda: _derived(t, chunk_size, ck.cu_seqlens_values(op, t, total_tokens)))
    ck.cu_end(op, info.total_tokens, total_tokens)  # a hit was checked against another call
    return info


def _uncached(op: str, cu_seqlens: object, total_tokens: int, device: torch.device | None,
              chunk_size: int) -> SeqLens:
    t = ck.cu_seqlens(op, cu_seqlens, total_tokens, device)
    return _derived(t, chunk_size, None, total_tokens)


def clear() -> None:
    """Forget every checked ``cu_seqlens`` (and the dense batches' bookkeeping)."""
    _entries.clear()
    _dense.cache_clear()
