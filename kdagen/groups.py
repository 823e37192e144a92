"""Chunk groups: how many parallel stretches to cut each sequence into, and their
caller-owned fp32 workspace.

The walk is serial in chunks; with few sequences x heads most of the GPU idles.
Pass one runs ``2 * D / BV`` blocks per (sequence, head, group) (state rows plus
transfer rows) for every group but the last, pass two ``D / BV`` for all. (Paired,
``ChunkPlan.pass_one_paired``, pass one runs half as many blocks, each alone on its
compute unit at bv128: the same slots, so the same group counts; its segments count its
own blocks, of ``ChunkPlan.pass_one_width`` rows, and their residency.) A group
count pays while a pass's grid still fits one scheduling batch (``resident`` walk blocks
per compute unit, the launch bound's), or while the groups stay long enough that pass
two's shorter walk is worth a second batch of pass one.
G == 2 only doubles the staging for the same depth, so a split starts at 4.

Pass one walks the chunks before the last group's start in segments of its own
(``pass_one_segments``): one per group would take 1x32768x32's 7 x 32 pass-one blocks
through the 132 SMs in two batches (1.7 full), four segments per head take 128 blocks in
one batch of 448 chunks each, where two batches of one group each walk 512. Pass one then
also stores its state at the group starts inside a segment, and the scan forms each
group's start from its segment's (chunk.h).

Measured on the H200 (c16, two resident walk blocks per SM, CUDA-graph end to end,
docs/NOTES.md v16): 1x32768x32 takes 2.03 / 1.91 / 1.98 ms at 4 / 8 / 16 groups (this
rule: 8), 1x131072x8 2.08 / 2.03 ms at 16 / 32 (this rule: 32).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .resources import ChunkPlan
    from .spec import KernelSpec

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


def _plan(spec: KernelSpec, plan: ChunkPlan | None) -> ChunkPlan:
    from .render import chunk_plan_for

    return plan if plan is not None else chunk_plan_for(spec)


def planned_residency(spec: KernelSpec, plan: ChunkPlan | None = None) -> tuple[int, int]:
    """Walk blocks one compute unit holds as the chunk plan of ``spec`` (a KernelSpec)
    intends them: (the walks with outputs, pass one), from the launch bound and the LDS
    alone. ``Kernels.walk_residency`` has the device's own, as compiled. ``plan``: the
    variant's chunk plan where the caller keeps it (else worked out here)."""
    plan = _plan(spec, plan)
    return plan.min_blocks, plan.pass_one_resident(spec.block_width)


def segments_for_spec(spec: KernelSpec, groups: int, num_seqs: int, num_heads: int, num_cus: int,
                      resident: int | None = None, plan: ChunkPlan | None = None) -> int:
    """``pass_one_segments`` for the chunk scan of ``spec`` (a KernelSpec); ``resident``:
    pass-one blocks per compute unit (default: the plan's); ``plan`` as in
    ``planned_residency``."""
    if groups <= 1:  # the single walk: no pass one (and no chunk plan to work out per call)
        return 0
    plan = _plan(spec, plan)
    D, bv1 = spec.head_dim, plan.width_of_pass_one(spec.block_width)
    return pass_one_segments(groups, num_seqs, num_heads, num_cus,
                             pass_one_blocks=(1 if plan.pass_one_paired else 2) * D // bv1,
                             resident=resident or plan.pass_one_resident(spec.block_width))


def groups_for_spec(spec: KernelSpec, chunks_per_seq: int, num_seqs: int, num_heads: int, num_cus: int,
                    resident: int | None = None, plan: ChunkPlan | None = None) -> int:
    """``chunk_groups`` for the chunk scan of ``spec`` (a KernelSpec): its blocks per pass
    from the block width; ``resident``: walk blocks per compute unit (default: the
    launch bound of its chunk plan); ``plan`` as in ``planned_residency``."""
    D, bv = spec.head_dim, spec.block_width
    return chunk_groups(chunks_per_seq, num_seqs, num_heads, num_cus, pass_one_blocks=2 * D // bv,
                        pass_two_blocks=D // bv,
                        resident=resident or _plan(spec, plan).min_blocks)


# Pass one in segments that end between group starts stops at each group start inside
# them: measured on the H200 (c16, session 18) +5% per chunk step against one segment per
# group at the same work (1x32768x32: 0.532 -> 0.561 ms) and G + P - 2 scan products in
# place of G - 1. So segments are taken only where they save at least SEGMENT_GAIN of pass
# one's chunk steps (1x32768x32: two batches of 256 chunks -> one of 448, 0.532 -> 0.493 ms).
SEGMENT_GAIN = 0.10


def pass_one_segments(groups: int, num_seqs: int, num_heads: int, num_cus: int, *,
                      pass_one_blocks: int, resident: int = 1) -> int:
    """Pass one's segments per sequence for ``groups`` groups (0 where there is no pass
    one): groups - 1 (one per group), or the count P whose blocks take the fewest chunk
    steps end to end, batches x (chunks / P) with batches = ceil(P x blocks / slots), where
    that saves SEGMENT_GAIN of one per group's (the smaller P on a tie: fewer scan
    products). ``KDAGEN_SEGMENTS`` forces one (clamped; 0: one per group)."""
    if groups <= 1:
        return 0
    top = groups - 1
    forced = os.environ.get("KDAGEN_SEGMENTS")
    if forced:
        return top if int(forced) < 1 else min(int(forced), top)
    per_seg = pass_one_blocks * max(num_seqs * num_heads, 1)
    slots = num_cus * max(resident, 1)
    steps = lambda p: -(-p * per_seg // slots) / p  # noqa: E731  (in units of the chunks before the last group)
    best = min(range(1, top + 1), key=lambda p: (steps(p), p))
    return best if steps(best) <= (1.0 - SEGMENT_GAIN) * steps(top) else top


def group_start(chunks: int, groups: int, g: int) -> int:
    """The chunk where group ``g`` of a sequence of ``chunks`` chunks starts (chunk.h's
    start_of_group: spans of ceil(chunks / groups) chunks); pass one covers the chunks
    before ``group_start(chunks, groups, groups - 1)``."""
    return min(g * -(-chunks // groups), chunks)


def segments_of(groups: int, segments: int) -> int:
    """The segments the kernels run for an op's ``segments`` argument: 0 means one per
    group (groups - 1), as the op's default."""
    return segments if segments >= 1 else max(groups - 1, 1)


def workspace_floats(groups: int, nh: int, head_dim: int, segments: int = 0) -> int:
    """bg [Q][NH][V][K] | rg [Q][NH][K][K] | sin [Q][NH][V][K], fp32, Q = G + P - 2 slots
    for 2 <= P < G - 1 segments (their ends between group starts), else G (chunk.h's
    workspace_slots)."""
    p = segments_of(groups, segments)
    slots = groups + p - 2 if 1 < p < groups - 1 else groups
    return 3 * slots * nh * head_dim * head_dim


def group_workspace(groups: int, nh: int, head_dim: int, device: torch.device,
                    alloc: Callable[..., torch.Tensor] = torch.empty,
                    segments: int = 0) -> torch.Tensor | None:
    """One fp32 buffer from ``alloc`` (the caching allocator, so memory profilers see it;
    the ops pass theirs, which poisons under KDAGEN_POISON)."""
    if groups <= 1:
        return None
    return alloc(workspace_floats(groups, nh, head_dim, segments), dtype=torch.float32,
                 device=device)


@lru_cache(maxsize=None)
def _cus(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_index(device: torch.device | None) -> int:
    """The index of the GPU ``device`` names: its own, else the current device's."""
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def num_compute_units(device: torch.device) -> int:
    """CUs (AMD) or SMs (NVIDIA) of ``device``, read from the device (once per device;
    while torch.compile traces, straight from its properties, a constant to the tracer,
    which would otherwise warn that it ignores the cache). The CPU emulation's device has
    KDAGEN_EMULATE_CUS (8 unless set), as its launchers see (emulate.h)."""
    if device.type != "cuda":
        return int(os.environ.get("KDAGEN_EMULATE_CUS", "") or 8)
    index = cuda_index(device)
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_properties(index).multi_processor_count
    return _cus(index)
