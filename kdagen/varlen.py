"""Chunk bookkeeping for variable-length ("varlen") batches.

A varlen batch packs ``N`` sequences along one token axis of length ``T``;
``cu_seqlens`` (integer, ``[N + 1]``, non-decreasing, ``cu_seqlens[0] == 0``,
``cu_seqlens[N] <= T``: tokens past it, a padded tail, belong to no sequence) marks
where each sequence starts and ends. The chunked
kernels cut every sequence into chunks of ``chunk_size`` tokens that never
cross a sequence boundary; the last chunk of a sequence may be partial and a
zero-length sequence has no chunks at all.

The helpers are plain torch, stay on the device of ``cu_seqlens`` and, except
for :func:`prepare_chunk_indices` (whose output size is data dependent), never
synchronise with the host. They do not check that ``cu_seqlens`` is monotone:
that would need a host read; the op layer validates its arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_counts", "prepare_chunk_offsets", "prepare_chunk_indices"]


def _check(cu_seqlens: Tensor, chunk_size: int) -> None:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one element ([N + 1]), "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def chunk_counts(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """Number of chunks of each sequence, ``ceil(len / chunk_size)``.

    Returns int32 ``[N]`` on the device of ``cu_seqlens``; a zero-length
    sequence counts 0 chunks. No host synchronisation.
    """
    _check(cu_seqlens, chunk_size)
    lens = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    return torch.div(lens + (chunk_size - 1), chunk_size, rounding_mode="floor").to(torch.int32)


def prepare_chunk_offsets(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """Global index of each sequence's first chunk, plus the total at the end.

    Returns int32 ``[N + 1]``: ``offsets[0] == 0`` and
    ``offsets[n + 1] - offsets[n] == chunk_counts(...)[n]``, so
    ``offsets[N]`` is the total number of chunks. No host synchronisation.
    """
    counts = chunk_counts(cu_seqlens, chunk_size).to(torch.int64)
    zero = torch.zeros(1, dtype=torch.int64, device=cu_seqlens.device)
    return torch.cat([zero, torch.cumsum(counts, 0)]).to(torch.int32)


def prepare_chunk_indices(
    cu_seqlens: Tensor, chunk_size: int, *, num_chunks: int | None = None
) -> Tensor:
    """One row ``(sequence index, chunk index inside that sequence)`` per chunk.

    Returns int32 ``[num_chunks, 2]``; chunks are listed sequence by sequence,
    in order, so row ``prepare_chunk_offsets(...)[n] + c`` is ``(n, c)``. This
    is the global chunk numbering every chunk-major tensor (``kg_t``,
    ``decay``) uses.

    The output size depends on the data, so this reads the total chunk count
    back to the host unless the caller passes it as ``num_chunks`` (which must
    then be exact).
    """
    counts = chunk_counts(cu_seqlens, chunk_size).to(torch.int64)
    dev = cu_seqlens.device
    offsets = torch.cumsum(counts, 0) - counts  # exclusive prefix sum
    seq = torch.repeat_interleave(
        torch.arange(counts.numel(), dtype=torch.int64, device=dev), counts, output_size=num_chunks
    )
    local = torch.arange(seq.numel(), dtype=torch.int64, device=dev) - offsets[seq]
    return torch.stack([seq, local], dim=1).to(torch.int32)
