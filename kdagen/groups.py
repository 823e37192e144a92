"""Chunk groups: how many parallel stretches to cut each sequence into, and their
caller-owned fp32 workspace.

The walk is serial in chunks; with few sequences x heads most of the GPU idles.
Pass one runs ``D / BV`` blocks per (sequence, head) for group 0 (the single walk over
its chunks, with outputs) and ``2 * D / BV`` (state rows plus transfer rows) for every
later group but the last; pass two ``D / BV`` for groups 1 .. G - 1. A group
count pays while a pass's grid still fits one scheduling batch (one block per compute unit), or while the groups stay
long enough that pass two's shorter walk is worth a second batch of pass one.
G == 2 only doubles the staging for the same depth, so a split starts at 4.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable

import torch

MAX_GROUPS = 32
MIN_CHUNKS_PER_GROUP = 8
DEEP_CHUNKS_PER_GROUP = 32


def chunk_groups(
    chunks_per_seq: int,
    num_seqs: int,
    num_heads: int,
    num_cus: int,
    *,
    pass_one_blocks: int,
    pass_two_blocks: int,
) -> int:
    """The group count for a batch (1: the single walk)."""
    forced = os.environ.get("KDAGEN_GROUPS")
    if forced:
        return max(1, int(forced))
    nh = max(num_seqs * num_heads, 1)
    fill1 = num_cus // (pass_one_blocks * nh)
    fill2 = num_cus // (pass_two_blocks * nh)
    cand = fill1
    if fill2 > 0 and chunks_per_seq // fill2 >= DEEP_CHUNKS_PER_GROUP:
        cand = fill2
    cand = min(cand, chunks_per_seq // MIN_CHUNKS_PER_GROUP, MAX_GROUPS)
    return cand if cand >= 4 else 1


def workspace_floats(groups: int, nh: int, head_dim: int) -> int:
    """bg [G][NH][V][K] | rg [G][NH][K][K] | sin [G][NH][V][K], fp32 (see chunk.h)."""
    return 3 * groups * nh * head_dim * head_dim


def group_workspace(groups: int, nh: int, head_dim: int, device: torch.device,
                    alloc: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor | None:
    """One fp32 buffer from ``alloc`` (the caching allocator, so memory profilers see it;
    the ops pass theirs, which poisons under KDAGEN_POISON)."""
    if groups <= 1:
        return None
    return alloc(workspace_floats(groups, nh, head_dim), dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def _cus(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_compute_units(device: torch.device) -> int:
    """CUs (AMD) or SMs (NVIDIA) of ``device``, read from the device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cus(index)
