"""Per-kernel resource footprints (threads, LDS / shared memory, registers).

The kernels' shared-memory plans live in the headers under ``templates/include``;
these functions count the same buffers so that the spec validator can refuse a
variant before any compiler sees it. The padding constants are rendered into the
kernels' config, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

IO_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Row padding (elements) of the shared-memory tiles, to spread a wave's fragment
# loads over the banks: 16 bytes for 16-bit tiles, 16 bytes for fp32 tiles.
PAD_16BIT = 8
PAD_FP32 = 4

PROLOGUE_THREADS = 256  # per prologue block; 128 at chunk 16 (prologue_threads)
RECURRENT_ROWS_PER_BLOCK = 16
RECURRENT_WAVES = 4
SCAN_THREADS = 256
# The group scan streams the transfer planes through a ring of SCAN_STAGES LDS tiles of
# SCAN_TILE_BYTES each (fp32 rows of R), beside its state rows: at most SCAN_SHARED_LIMIT.
SCAN_STAGES = 4
SCAN_TILE_BYTES = 8192
# State rows per group-scan block: each variant builds the scan for every count here that
# fits (scan_plans), and each call takes one by its N x H planes (scan_rows_for): a block
# reads every transfer plane of its head once, so more rows read less, fewer rows run
# more blocks (session 20, H100: about one block per SM was fastest at 8 and 32 planes).
SCAN_ROWS_CHOICES = (32, 16, 8)
# The scan's table of products per sequence (chunk.h ScanItem: 6 bytes, kMaxScanItems) and
# its two counts (num_items, num_lead), in static shared memory beside the ring and the rows.
MAX_SCAN_ITEMS = 254  # launch_args.h kMaxScanItems
SCAN_TABLE_BYTES = 6 * MAX_SCAN_ITEMS + 8
SCAN_SHARED_LIMIT = 42 * 1024  # within CDNA's 64 KB of LDS and NVIDIA's 48 KB of static shared memory


@dataclass(frozen=True)
class ScanPlan:
    """The group scan's block: state rows per block, rows of R per ring tile, tiles."""

    rows: int
    tile: int
    stages: int

    def shared_bytes(self, head_dim: int) -> int:
        return 4 * head_dim * (self.stages * self.tile + self.rows) + SCAN_TABLE_BYTES


def scan_plans(head_dim: int) -> tuple[ScanPlan, ...]:
    """The group scan's blocks a variant builds, most rows first: each count of
    SCAN_ROWS_CHOICES that SCAN_THREADS threads tile (4 columns a thread), with ring tiles
    of SCAN_TILE_BYTES (32 rows of R at D = 64, 16 at 128, 8 at 256) and the most stages,
    up to SCAN_STAGES and at least 2, that keep it within SCAN_SHARED_LIMIT."""
    tile = SCAN_TILE_BYTES // (4 * head_dim)
    row_groups = SCAN_THREADS // (head_dim // 4)
    plans = []
    for rows in SCAN_ROWS_CHOICES:
        if rows % row_groups:
            continue
        for stages in range(SCAN_STAGES, 1, -1):
            plan = ScanPlan(rows=rows, tile=tile, stages=stages)
            if plan.shared_bytes(head_dim) <= SCAN_SHARED_LIMIT:
                plans.append(plan)
                break
    return tuple(plans)


def scan_rows_for(plans: tuple[ScanPlan, ...], head_dim: int, planes: int, compute_units: int) -> int:
    """The rows per block of the group scan of ``planes`` (N x H) state planes: the most
    rows whose blocks reach half the compute units, else the fewest. The launcher
    (kernels.hip.j2, scan_rows_for) takes the same choice at run time."""
    for plan in plans:
        if 2 * (head_dim // plan.rows) * planes >= compute_units:
            return plan.rows
    return plans[-1].rows


# Most fp32 state values one lane may hold across the chunk walk.
MAX_STATE_REGS_PER_LANE = 64
MAX_THREADS_PER_BLOCK = 1024
# Most waves of a chunk-scan block on CDNA (wave64): a CU's four SIMDs share a block's
# waves, and each SIMD's 512 registers a lane (VGPRs and AGPRs) go to its waves, so 8
# waves get 256 each and 16 only 128, too few beside a 64-value state (d256 bv256 on
# gfx90a spilled 88-816 bytes a lane in every chunk kernel; session 26 review).
MAX_CHUNK_WAVES_WAVE64 = 8


@dataclass(frozen=True)
class Footprint:
    threads: int
    shared_mem: int


def prologue_threads(chunk_size: int) -> int:
    """Threads of a prologue block: 256, or 128 for a 16-row chunk (one block pair: half
    the waves would idle in its products and solve; twice the blocks share an SM)."""
    return 128 if chunk_size == 16 else PROLOGUE_THREADS


def prologue_footprint(head_dim: int, chunk_size: int, io_dtype: str,
                       stage_q: bool = False, planar: bool = False, swizzle: bool = False) -> Footprint:
    """G (fp32, later reused for L) + k (io dtype) [+ q] + three per-row fp32 vectors;
    ``planar`` adds the two operand planes, 2^G of each block's first row, its kg_t
    factor 2^(G_last - G_l), the block-pair scales and the diagonal choices (16 bytes),
    and implies the q plane; ``swizzle`` (planar only) leaves the k and q planes' rows
    unpadded (their 16-byte pieces swizzled by row, ``prologue_swizzle``)."""
    c, d = chunk_size, head_dim
    g_plane = c * (d + PAD_FP32) * 4
    row_plane = c * (d + PAD_16BIT) * IO_BYTES[io_dtype]
    if planar:
        nb = c // 16
        scales = nb * (nb - 1) // 2 + nb
        kq_plane = c * d * IO_BYTES[io_dtype] if swizzle else row_plane
        return Footprint(prologue_threads(c), g_plane + 2 * kq_plane + 2 * row_plane + 3 * c * 4
                         + 2 * nb * d * 4 + scales * d * 4 + 16)
    return Footprint(prologue_threads(c), g_plane + (2 if stage_q else 1) * row_plane + 3 * c * 4)


def prologue_stages_q(head_dim: int, chunk_size: int, io_dtype: str, shared_mem: int) -> bool:
    """Whether the target's LDS also holds the chunk's q rows (then q is read once)."""
    return prologue_footprint(head_dim, chunk_size, io_dtype, True).shared_mem <= shared_mem


def prologue_planar(head_dim: int, chunk_size: int, io_dtype: str, shared_mem: int) -> bool:
    """Whether the prologue builds its L / aqk operands as LDS planes (and solves on the
    matrix units): the planar footprint fits, L (fp32) with its bf16 inverse fits in
    the G plane, and the chunk's 16-byte pieces spread evenly over the block's threads
    (d64/c16 at 256 threads would leave half of them without one)."""
    c, d = chunk_size, head_dim
    in_g = c * (c + PAD_FP32) * 4 + c * (c + PAD_16BIT) * 2 <= c * (d + PAD_FP32) * 4
    # its elementwise passes take the chunk's 16-byte pieces evenly, every thread busy
    even = (c * d // 8) % prologue_threads(c) == 0
    return in_g and even and prologue_footprint(d, c, io_dtype, planar=True).shared_mem <= shared_mem


def prologue_shared_mem(head_dim: int, chunk_size: int, io_dtype: str, shared_mem: int,
                        swizzle: bool = False) -> int:
    """Bytes of LDS the prologue of this variant uses on a target with ``shared_mem``
    (``swizzle``: its planes as ``prologue_swizzle`` lays them out)."""
    planar = prologue_planar(head_dim, chunk_size, io_dtype, shared_mem)
    stage_q = prologue_stages_q(head_dim, chunk_size, io_dtype, shared_mem)
    return prologue_footprint(head_dim, chunk_size, io_dtype, stage_q, planar, swizzle).shared_mem


# The planar prologue's k and q LDS planes (and what later takes their place: b k^ 2^G,
# Qa, b v) stored unpadded with their 16-byte pieces swizzled by row (templates:
# `swizzled`, PrologueLayout::kidx), in place of rows padded by PAD_16BIT. The k / q rows
# arrive by 16-byte cp.async copies, 16 threads a row: into rows of 272 bytes a warp copy
# spans six or seven 128-byte runs of banks where four would do (ncu, H200, c16,
# docs/NOTES.md v19: 168 shared wavefronts per (chunk, head) for these copies, 64 ideal;
# about 7% of the prologue's 1406). Every reader and writer of the two planes (16-byte
# pieces, 32-bit pairs, elements, ldmatrix) takes the same placement; the operand planes
# Ka / Kb, filled by 16-byte stores (no excess in padded rows) and read element by element
# for kg_t, stay padded. NVIDIA: off. Timed on an H100 (session 39, c16 lb, one-call A/B,
# docs/NOTES.md v34): prologue 0.612-0.617 ms swizzled against 0.612-0.615 padded, no
# change where the prologue moves 96% of the copy bandwidth; the H200, where it ran at
# 70%, has not timed it. CDNA: off (untimed; there the k / q rows are staged by plain
# loads and 16-byte LDS stores, not cp.async).
PROLOGUE_SWIZZLE = False
PROLOGUE_SWIZZLE_CDNA = False


def prologue_swizzle(vendor: str, head_dim: int, chunk_size: int, io_dtype: str,
                     shared_mem: int) -> bool:
    """Whether the prologue of this variant swizzles its k and q planes (PROLOGUE_SWIZZLE
    on NVIDIA, PROLOGUE_SWIZZLE_CDNA on AMD): the planar path only."""
    on = PROLOGUE_SWIZZLE_CDNA if vendor == "amd" else PROLOGUE_SWIZZLE
    return on and prologue_planar(head_dim, chunk_size, io_dtype, shared_mem)


def prologue_min_blocks(shared_mem_bytes: int, cu_smem: int, reserve: int,
                        threads: int = PROLOGUE_THREADS) -> int:
    """Prologue workgroups the launch bound asks to keep resident per compute unit: as
    many as its LDS lets share one, up to 1024 threads (64 registers a lane on sm_90,
    128 VGPRs on CDNA), never below 2 (the hint of every variant before)."""
    return max(2, min(1024 // threads, cu_smem // (shared_mem_bytes + reserve)))


def chunk_footprint(
    head_dim: int, chunk_size: int, block_width: int, io_dtype: str, wave_size: int,
    stages: int = 1, stage_uo: bool = False, wgmma: bool = False, swizzle: bool = False,
) -> Footprint:
    """Per stage: w, qg (C x K), kg_t (K x C), aqk (C x C) tiles (rows padded for
    ldmatrix; unpadded core-matrix tiles with ``wgmma``; unpadded rows of swizzled 16-byte
    pieces with ``swizzle``), [the u / o tile (C x block_width) and the akk tile (C x C)
    of the walk that forms u from v], and the fp32 chunk decay; ``stages`` such buffers
    (the largest walk's: pass one of the chunk groups stages no qg / aqk tiles)."""
    return _walk_footprint(head_dim, chunk_size, block_width, io_dtype, wave_size, stages,
                           stage_uo, wgmma, swizzle, outputs=True)


def pass_one_footprint(
    head_dim: int, chunk_size: int, block_width: int, io_dtype: str, wave_size: int,
    stages: int = 1, stage_uo: bool = False, wgmma: bool = False, swizzle: bool = False,
) -> Footprint:
    """``chunk_footprint`` of the grouped walk's pass one: no qg / aqk tiles."""
    return _walk_footprint(head_dim, chunk_size, block_width, io_dtype, wave_size, stages,
                           stage_uo, wgmma, swizzle, outputs=False)


def _walk_footprint(head_dim: int, chunk_size: int, block_width: int, io_dtype: str,
                    wave_size: int, stages: int, stage_uo: bool, wgmma: bool, swizzle: bool,
                    outputs: bool) -> Footprint:
    c, d = chunk_size, head_dim
    swizzle = swizzle and not wgmma  # (the warpgroup walk's tiles are core-matrix tiles)
    pad = 0 if wgmma or swizzle else PAD_16BIT
    pad_uo = 0 if swizzle else PAD_16BIT
    elems = (2 if outputs else 1) * c * (d + pad) + d * (c + pad) + (c * (c + pad) if outputs else 0)
    if stage_uo:
        elems += c * (block_width + pad_uo) + c * (c + pad)
    waves = block_width // 16
    return Footprint(waves * wave_size, stages * (elems * IO_BYTES[io_dtype] + d * 4))


# Chunks the scan buffers where it has asynchronous copies: 2 (one in flight ahead of the
# one walked). The kernel takes any count; on the H200 3 and 4 measured no faster (c16 walk
# 0.586 / 0.594 / 0.595 ms for 2 / 3 / 4, docs/NOTES.md v11) and took more registers (c32:
# 170 -> 206); on the H100, where the walks with outputs run near the copy bandwidth, 3
# measured slower too (c16 single walk 0.562 -> 0.582 ms, pass one 0.552 -> 0.572; v28).
CHUNK_STAGES = 2

# Stages of the grouped walk's pass one (state and transfer rows only: no qg / aqk tiles,
# so a stage is about half the walk's), the most that fit up to this; 0: the walk's count.
# Its steps are shorter than the walk's (304 against 666 SASS in the c16 loop body). On the
# H200 at c16 (docs/NOTES.md, v18) pass one took 0.642 / 0.625 / 0.680 ms for 2 / 3 / 4 at
# 1x32768x32 in 8 groups (0.701 / 0.680 / 0.723 at 1x131072x8 in 32): 3.
PASS_ONE_STAGES = 3

# The grouped walk's lead segment: pass one's first segment (or group) starts at chunk 0,
# where the true start state X_0 (the initial state) is known, so it walks the state from
# X_0 and no transfer rows (its B is then the true state; the scan takes it without a
# product). Its length against each other segment's, in eighths (0: off, segment 0 walks
# from zero with its transfer like the others). Only segments (pass_one_segments < groups
# - 1) move their boundaries; one segment per group keeps equal groups and only drops
# group 0's transfer rows. H200, c16 lower bound, 1x32768x32 (8 groups, 4 segments), one-
# call A/Bs (docs/NOTES.md v25): pass one 0.489-0.494 ms off -> 0.498 (8) / 0.465 (10) /
# 0.452 (11) / 0.476 (12) / 0.568 (16), the scan 0.062 -> 0.049; busy graph 1.615 ->
# 1.564 ms at 11. A lead step costs ~0.72 of a paired one, so the balance is 8 / 0.72: 11.
PASS_ONE_LEAD = 11

# Pass one's blocks: this many state rows each (paired, as many transfer rows too) where it
# divides the head dimension in 16-row tiles; 0: the spec's block width, as the other walks.
# 0: at 64 (two blocks of four waves per SM in place of one of eight) pass one took 10%
# longer (H100, session 27, c16 lower bound, 1x32768x32, two rounds: 0.442 -> 0.485 ms; at
# 1x131072x8 0.544 -> 0.553).
PASS_ONE_WIDTH = 0


def pass_one_width(head_dim: int, block_width: int) -> int:
    """Pass one's block width (PASS_ONE_WIDTH where it divides ``head_dim`` in 16-row
    tiles, else ``block_width``)."""
    w = PASS_ONE_WIDTH
    return w if 0 < w <= head_dim and w % 16 == 0 and head_dim % w == 0 else block_width


@dataclass(frozen=True)
class ChunkPlan:
    """How the chunk scan buffers its operands on one target."""

    stages: int  # > 1: stages - 1 chunks' tiles load (asynchronously) ahead of the one walked
    stage_uo: bool  # u read and o written through LDS (16-byte accesses) instead of per element
    min_blocks: int = 1  # blocks the launch bound keeps resident per compute unit
    wgmma: bool = False  # products as warpgroup instructions (B operands read from LDS by the tensor cores)
    pass_one_stages: int = 0  # the grouped walk's pass one; 0 (one stage, no async copies): ``stages``
    pass_one_paired: bool = False  # pass one's state and transfer rows in one block (pass_one_paired)
    swizzle: bool = False  # 16-bit tiles unpadded with swizzled 16-byte pieces (chunk_swizzle)
    walk_paired: bool = False  # the single walk and pass two with two 16-row tiles a wave (walk_paired)
    wg_update: bool = False  # the per-wave walks' state update per warpgroup (chunk_wg_update)
    wg_update_outputs: bool = False  # with wg_update, in the walks with outputs too (CHUNK_WG_UPDATE_OUTPUTS)
    pass_one_width: int = 0  # pass one's state rows per block (pass_one_width); 0: the block width
    pass_one_wg_vnew: bool = False  # with wg_update, pass one's v_new products per warpgroup (PASS_ONE_WG_VNEW)
    pass_one_lds_blocks: int = 8  # pass-one blocks whose LDS one compute unit holds
    pass_one_swizzle: bool = False  # ``swizzle`` for pass one's tiles (pass_one_swizzle)

    @property
    def stages_of_pass_one(self) -> int:
        return self.pass_one_stages or self.stages

    def width_of_pass_one(self, block_width: int) -> int:
        """Pass one's state rows per block for a spec of ``block_width``."""
        return self.pass_one_width or block_width

    def pass_one_resident(self, block_width: int) -> int:
        """Pass-one blocks resident per compute unit: the launch bound's, or for paired
        blocks (up to 255 registers a lane) eight waves' worth: one block of eight waves
        (bv128), two of four (bv64); at most as many as the compute unit's LDS holds
        (gfx90a / gfx942 chunk 64 at bv64: one, 2 x 33 KB > 64 KB)."""
        if not self.pass_one_paired:
            return self.min_blocks
        waves = max(1, 8 // max(1, self.width_of_pass_one(block_width) // 16))
        return max(1, min(waves, self.pass_one_lds_blocks))


# Whether the chunk scan may issue its products per warpgroup (wgmma) where the target
# and the block allow it (chunk_wgmma). Off: on the H200 the wgmma walk measured slower
# than the per-wave mma.sync walk (c16, 8x4096x32: 0.625 against 0.584 ms; with 4 stages
# 0.636, with an L2 prefetch 0.698; docs/NOTES.md v12). The path is kept and checked by
# the CPU emulation (tests/test_emulated_kernels.py forces it on).
CHUNK_WGMMA = False

# The per-wave walks (mma.sync products) with their state update alone as warpgroup
# products (wgmma, sm_90a): D x 16 products of four waves' state rows at once, at twice
# mma.sync's rate, the state staying in its registers (the same accumulator layout), each
# chunk's update retired in its step; the v_new and o products stay per wave (N = C is
# small for a warpgroup). At chunk 16 only (chunk_wg_update). Where a walk's blocks are not
# whole warpgroups, that walk keeps the per-wave update. On: H200, c16 lower bound,
# one-call A/B (docs/NOTES.md v26): pass
# one 0.454 -> 0.439 ms, pass two 0.441 -> 0.434 (1x32768x32, busy graph 1.573 -> 1.551),
# the single walk 0.450 -> 0.443 (8x4096x32, 1.082 -> 1.075); outputs equal to the
# per-wave update's. Retiring an update after the next chunk's barrier instead took a
# stage more and ptxas serialised the products (C7515): pass one 0.546 ms. Since session 27
# the walks with outputs take it only with CHUNK_WG_UPDATE_OUTPUTS (off: slower on the H100).
CHUNK_WG_UPDATE = True

# With CHUNK_WG_UPDATE, whether the walks with outputs (the single walk, pass two) update
# per warpgroup too (True), or pass one alone does (False). Off: on the H100 (session 27,
# c16 lower bound, one-call A/Bs, three calls alike) the walks with outputs take 6% longer
# with it (single walk 0.562 -> 0.597 ms at 8x4096x32, pass two 0.551 -> 0.582 at
# 1x32768x32; busy graph 1.233 -> 1.271 and 1.722 -> 1.743) while pass one gains 3%
# (0.453 -> 0.439). On the H200 (session 24, one A/B) all three walks gained with it,
# the walks with outputs 1.6% (0.450 -> 0.443, 0.441 -> 0.434): +0.007 ms there against
# -0.035 ms on the H100 with it off. Pass one keeps it (it gains on both).
CHUNK_WG_UPDATE_OUTPUTS = False


# With the state update per warpgroup (CHUNK_WG_UPDATE), pass one's v_new^T = (-S^T) w^T
# per warpgroup too: m64 x 16 x 16 products of four waves' state rows per k-slice, -S^T in
# registers, the w tile copied K-major in core matrices; u = akk v stays per wave. Off:
# pass one took 21% longer with it (H100, session 27, c16 lower bound, 1x32768x32, two
# rounds: 0.442 -> 0.533-0.539 ms; at 1x131072x8 0.544 -> 0.605; with 64-row blocks too
# 0.627 / 0.687). Kept, checked by the CPU emulation.
PASS_ONE_WG_VNEW = False


def chunk_wg_update(chunk_size: int, warpgroup_mma: bool, wgmma: bool, swizzle: bool) -> bool:
    """Whether the per-wave walks update their state per warpgroup (CHUNK_WG_UPDATE): at
    chunk 16, where it was timed (at chunk 64 pass two spilled 8 bytes with it), on targets
    with warpgroup products, beside padded (not swizzled) tiles, not in the warpgroup walk
    (whose products all are)."""
    return (CHUNK_WG_UPDATE and chunk_size == 16 and warpgroup_mma and not wgmma
            and not swizzle)


# The walk that forms u = akk v (mma.sync): u^T in accumulators of its own, a chain of
# products beside the (-S^T) w^T one, added at the end (True), or v_new^T's accumulators
# start from it (False). H200, c16, lower bound (docs/NOTES.md v15): the single walk the
# same (0.536 / 0.538 ms at 8x4096x32), the grouped 1x32768x32 pass one 0.703 against
# 0.725, pass two 0.643 against 0.663 ms. (u^T added after the (-S^T) w^T products
# spilled 20 bytes at c16: not timed.)
CHUNK_U_APART = True

# The grouped walk's pass one with a block's state rows and transfer rows together (each
# wave 16 of each: the w / kg_t fragments, the decay and each chunk's copies shared by the
# pair, the block alone on its compute unit with up to 255 registers) instead of separate
# blocks. On: H200, c16, lower bound, busy-stream graph (docs/NOTES.md v21): pass one
# 0.614-0.620 -> 0.532-0.537 ms at 1x32768x32 in 8 groups (e2e 1.833-1.871 -> 1.741-1.754),
# 1x131072x8 1.977 -> 1.839; 8 groups stay the best count (4: 1.827, 5: 1.917, 6: 2.075,
# 16: 1.800 ms); with the swizzled tiles as well, slower (0.550). CDNA takes it on the same
# evidence (its reads per row halve there too; gfx90a / gfx942 c64 bv128: pass one
# 174-204 VGPRs, its segments kernel 204-236, no scratch (session 26); untimed).
PASS_ONE_PAIRED = True


def pass_one_paired(chunk_size: int, wave_size: int) -> bool:
    """Whether pass one pairs state and transfer rows (PASS_ONE_PAIRED) for this chunk
    size: where a lane's two state tiles and the chunk's fragments fit its registers -
    chunks up to 32 on wave32 (sm_90a c16 / c32: 214-236 registers, no spills; c64 spilled
    32 bytes at bv128, 76 at bv64), every chunk on wave64 (half the state per lane)."""
    return PASS_ONE_PAIRED and (wave_size == 64 or chunk_size <= 32)

# The per-wave walks' 16-bit LDS tiles (w, qg, kg_t, aqk, akk, u / o) stored unpadded with
# their 16-byte pieces swizzled by row (templates: `swizzled`, `lds_index`) instead of
# rows padded by PAD_16BIT; the warpgroup walk keeps its core-matrix tiles.
# NVIDIA: off. ncu on pass one (H200, c16, 1x32768x32, docs/NOTES.md v20) put L1 / shared
# at 78% of peak with 28M of its 130M LDS wavefronts excess, all in the copies into padded
# rows; timed in v21 (c16 lb): the single walk and pass two unchanged (0.526 / 0.522 ms
# against 0.525 / 0.523), the unpaired pass one 0.614 -> 0.565, but the paired one (on)
# 0.532 -> 0.550: no gain where it runs. On since session 37 for the walks with outputs
# at chunk 16 (pass one apart, below): H100, c16 lb, one-call A/B (docs/NOTES.md v33):
# pass two 0.550 / 0.552 -> 0.522 ms at 1x32768x32, the single walk 0.559 / 0.558 -> 0.528
# at 8x4096x32; busy-stream graph 1.666 / 1.664 -> 1.635 and 1.185 / 1.190 -> 1.162.
CHUNK_SWIZZLE = True
# NVIDIA: the largest chunk CHUNK_SWIZZLE reaches (the one chunk size it was timed at);
# larger chunks keep padded rows (untimed swizzled; at chunk 64 sm_90a's pass two with akk
# goes 248 registers -> 255 and 8 bytes of spills).
CHUNK_SWIZZLE_MAX_CHUNK = 16
# Pass one's tiles (NVIDIA), where they should differ from the walks with outputs': None
# takes CHUNK_SWIZZLE. Swizzled, pass one loses its warpgroup state update (CHUNK_WG_UPDATE
# reads a padded kg tile). The walks with outputs' copies ask the L2 for 1.5x the ideal
# sectors into padded rows (ncu, H100, session 35: 24 sectors per 16-byte cp.async warp
# copy against 16; DRAM moves each byte once, L2 81% busy), which the swizzled tiles
# avoid; pass one is a register-bound chain there and keeps its update (padded, off).
CHUNK_SWIZZLE_PASS_ONE = False
# CDNA: on (untimed: no AMD GPU here), on compile evidence (Debian hipcc, gfx90a and gfx942
# through gfx940, d128 / bv128, docs/BENCHMARKS.md "AMD"): at chunk 64, the CDNA default,
# the padded walks take 255-256 VGPRs and 20-120 bytes / lane of scratch, the swizzled
# ones 212-238 VGPRs and none; at chunk 16 the swizzled walks take 2-10 VGPRs fewer.
CHUNK_SWIZZLE_CDNA = True


# The walks with outputs (single walk, pass two) with two 16-row tiles of V per wave (S and
# S1, rows row0 .. row0 + 31), as PASS_ONE_PAIRED does for pass one: the w, qg, kg_t, aqk
# and akk fragments and the decay read once for both tiles, blocks of half the waves. On:
# H200, c16 lower bound, two rounds (docs/NOTES.md v22): single walk 0.527 -> 0.453 ms at
# 8x4096x32, 0.552 -> 0.502 at 32x1024x32, pass two 0.526 -> 0.443-0.445 at 1x32768x32;
# busy-stream graph 1.156-1.159 -> 1.084-1.089, 1.184 -> 1.133, 1.744 -> 1.661-1.670.
WALK_PAIRED = True


def walk_paired(chunk_size: int, block_width: int, wave_size: int, wgmma: bool = False) -> bool:
    """Whether the single walk and pass two pair their rows (WALK_PAIRED): chunk 16 on
    wave32 (two tiles of state and their fragments within 255 registers at two blocks of
    half the waves per SM), blocks of whole 32-row pairs, the per-wave products."""
    return (WALK_PAIRED and not wgmma and wave_size == 32 and chunk_size == 16
            and block_width % 32 == 0)


def chunk_swizzle(vendor: str, chunk_size: int) -> bool:
    """Whether the per-wave chunk scan of a ``vendor`` ("nvidia", "amd") target swizzles
    its LDS tiles instead of padding their rows (the single walk, pass two; pass one:
    ``pass_one_swizzle``): CHUNK_SWIZZLE_CDNA on AMD, CHUNK_SWIZZLE up to
    CHUNK_SWIZZLE_MAX_CHUNK on NVIDIA."""
    if vendor == "amd":
        return CHUNK_SWIZZLE_CDNA
    return CHUNK_SWIZZLE and chunk_size <= CHUNK_SWIZZLE_MAX_CHUNK


def pass_one_swizzle(vendor: str, chunk_size: int) -> bool:
    """``chunk_swizzle`` for the grouped walk's pass one (CHUNK_SWIZZLE_PASS_ONE on NVIDIA,
    where it is not None, up to CHUNK_SWIZZLE_MAX_CHUNK)."""
    if vendor == "amd" or CHUNK_SWIZZLE_PASS_ONE is None:
        return chunk_swizzle(vendor, chunk_size)
    return CHUNK_SWIZZLE_PASS_ONE and chunk_size <= CHUNK_SWIZZLE_MAX_CHUNK


def chunk_wgmma(head_dim: int, block_width: int, warpgroup_mma: bool) -> bool:
    """Whether the chunk scan issues its products per warpgroup: where the target has them,
    for blocks of whole 64-row warpgroups and a head dimension the generated shapes cover
    (N = chunk size and N = head_dim: 16, 32, 64, 128)."""
    return CHUNK_WGMMA and warpgroup_mma and block_width % 64 == 0 and head_dim in (64, 128)


def chunk_min_blocks(chunk_size: int, block_width: int, wave_size: int) -> int:
    """Chunk-scan blocks to keep resident per compute unit: two for the 16-row chunk on
    wave32 with blocks of at most 256 lanes (at d128 / bv128 its walk fits 128 registers,
    half the register file: 120-128 by ptxas, 64 of them the state; narrower blocks are
    not capped by it), else one (the walk keeps its registers)."""
    threads = (block_width // 16) * wave_size
    return 2 if wave_size == 32 and chunk_size == 16 and threads <= 256 else 1


def chunk_plan(head_dim: int, chunk_size: int, block_width: int, io_dtype: str, wave_size: int,
               shared_mem: int, async_copy: bool, cu_shared_mem: int = 0,
               block_smem_reserve: int = 0, warpgroup_mma: bool = False,
               swizzle: bool = False, pass_one_swizzle: bool | None = None) -> ChunkPlan:
    """The richest buffering that fits: up to ``CHUNK_STAGES`` stages (the most that fit,
    at least 2; at least 3 for the warpgroup walk, else it is dropped) with u / o staged
    where the target has asynchronous copies, with
    ``chunk_min_blocks`` resident blocks where their share of the compute unit's LDS holds
    those stages (else 1), and warpgroup products where ``chunk_wgmma`` allows them;
    otherwise one stage, with u / o staged if they fit. ``swizzle``: the per-wave walk's
    tiles unpadded with swizzled pieces (``chunk_swizzle``); ``pass_one_swizzle`` pass
    one's (None: as ``swizzle``). Pass one's blocks take ``pass_one_width`` rows."""
    swizzle_one = swizzle if pass_one_swizzle is None else pass_one_swizzle
    footprint = lambda st, uo, w=False: chunk_footprint(head_dim, chunk_size, block_width, io_dtype,
                                                        wave_size, st, uo, w, swizzle).shared_mem
    # the warpgroup walk refills one stage later (its state update runs on): 3 stages or none
    wg = (chunk_wgmma(head_dim, block_width, warpgroup_mma) and async_copy
          and footprint(3, True, True) <= shared_mem)
    # (pass one's; the walks with outputs' only beside their own padded tiles)
    wgu = chunk_wg_update(chunk_size, warpgroup_mma, wg, swizzle_one) and async_copy
    # (the warpgroup walk's blocks are whole warpgroups: pass one keeps the block width there)
    width_one = block_width if wg else pass_one_width(head_dim, block_width)
    one_bytes = lambda st, uo, w: pass_one_footprint(head_dim, chunk_size, width_one, io_dtype,
                                                     wave_size, st, uo, w, swizzle_one).shared_mem
    # pass-one blocks whose LDS one compute unit holds
    lds_blocks = lambda st, uo, w: max(1, (cu_shared_mem or shared_mem)
                                       // max(1, one_bytes(st, uo, w) + block_smem_reserve))
    least = 3 if wg else 2
    if async_copy and footprint(least, True, wg) <= shared_mem:
        blocks = chunk_min_blocks(chunk_size, block_width, wave_size)
        share = (cu_shared_mem or shared_mem) // blocks - block_smem_reserve
        if footprint(least, True, wg) > share:
            blocks, share = 1, shared_mem
        limit = min(share, shared_mem)
        fits = lambda st: footprint(st, True, wg) <= limit
        stages = max(st for st in range(least, max(least, CHUNK_STAGES) + 1) if fits(st))
        one = lambda st: one_bytes(st, True, wg) <= limit
        one_stages = max(st for st in range(stages, max(stages, PASS_ONE_STAGES) + 1) if one(st))
        # pairing and swizzled tiles take the per-wave products (the warpgroup walk has neither)
        return ChunkPlan(stages, True, blocks, wg, one_stages,
                         pass_one_paired(chunk_size, wave_size) and not wg, swizzle and not wg,
                         walk_paired(chunk_size, block_width, wave_size, wg), wgu,
                         wgu and CHUNK_WG_UPDATE_OUTPUTS and not swizzle, width_one,
                         wgu and PASS_ONE_WG_VNEW, lds_blocks(one_stages, True, wg),
                         swizzle_one and not wg)
    uo = footprint(1, True) <= shared_mem
    return ChunkPlan(1, uo, 1, pass_one_paired=pass_one_paired(chunk_size, wave_size), swizzle=swizzle,
                     pass_one_width=width_one, pass_one_lds_blocks=lds_blocks(1, uo, False),
                     pass_one_swizzle=swizzle_one)


def chunk_state_regs_per_lane(head_dim: int, wave_size: int) -> int:
    """Each wave holds 16 state rows x head_dim fp32 values in registers."""
    return 16 * head_dim // wave_size
