"""Chunk groups: how many parallel stretches to cut each sequence into, and their
caller-owned fp32 workspace.

The walk is serial in chunks; with few sequences x heads most of the GPU idles.
Pass one runs ``2 * D / BV`` blocks per (sequence, head, group) (state rows plus
transfer rows) for every group but the last, pass two ``D / BV`` for all. (Paired,
``ChunkPlan.pass_one_paired``, pass one runs half as many blocks, each alone on its
compute unit: the same slots, so the same counts.) A group
count pays while a pass's grid still fits one scheduling batch (``resident`` walk blocks
per compute unit, the launch bound's), or while the groups stay long enough that pass
two's shorter walk is worth a second batch of pass one.
G == 2 only doubles the staging for the same depth, so a split starts at 4.

Measured on the H200 (c16, two resident walk blocks per SM, CUDA-graph end to end,
docs/NOTES.md v16): 1x32768x32 takes 2.03 / 1.91 / 1.98 ms at 4 / 8 / 16 groups (this
rule: 8), 1x131072x8 2.08 / 2.03 ms at 16 / 32 (this rule: 32).
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
    resident: int = 1,
) -> int:
    """The group count for a batch (1: the single walk); ``resident``: walk blocks the
    launch bound keeps on one compute unit."""
    forced = os.environ.get("KDAGEN_GROUPS")
    if forced:
        return max(1, int(forced))
    nh = max(num_seqs * num_heads, 1)
    slots = num_cus * max(resident, 1)
    fill1 = slots // (pass_one_blocks * nh)
    fill2 = slots // (pass_two_blocks * nh)
    cand = fill1
    if fill2 > 0 and chunks_per_seq // fill2 >= DEEP_CHUNKS_PER_GROUP:
        cand = fill2
    cand = min(cand, chunks_per_seq // MIN_CHUNKS_PER_GROUP, MAX_GROUPS)
    return cand if cand >= 4 else 1


def groups_for_spec(spec, chunks_per_seq: int, num_seqs: int, num_heads: int, num_cus: int) -> int:
    """``chunk_groups`` for the chunk scan of ``spec`` (a KernelSpec): its blocks per pass
    from the block width, its resident blocks from the launch bound of its chunk plan."""
    from .render import chunk_plan_for

    D, bv = spec.head_dim, spec.block_width
    return chunk_groups(chunks_per_seq, num_seqs, num_heads, num_cus, pass_one_blocks=2 * D // bv,
                        pass_two_blocks=D // bv, resident=chunk_plan_for(spec).min_blocks)


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
