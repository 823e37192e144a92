"""The generated kernels, run on the CPU through kdagen's emulation (kdagen/emulate.py,
templates/include/kdagen/emulate.h): every thread of a block is a std::thread, the
matrix instructions follow the ISA layouts, shared memory starts as NaN bytes. This is
where CI runs kernels: a wrong index, a missing barrier that the order of threads
exposes, a misaligned cp.async or a miscounted copy group fails here.

Each case compares against the float64 reference on fresh random inputs, with varlen
batches holding lengths 1, C - 1, C, C + 1 and a few chunks. Shapes are small (the
emulation runs about a second per 64-token chunk of a d128 head)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kdagen import reference as ref, resources
from kdagen.checks import rows16_ok
from kdagen.testing import BF16_TOL, PROLOGUE_TOL, conv_prologue_reference, make_inputs, rel_err

pytestmark = pytest.mark.emulate
OPS = ("qg", "w", "u", "kg_t", "aqk", "decay")

try:
    from kdagen.emulate import find_clang

    find_clang()
    HAVE_CLANG = True
except Exception:  # noqa: BLE001
    HAVE_CLANG = False
needs_clang = pytest.mark.skipif(not HAVE_CLANG, reason="no clang++ for the emulation")


@pytest.fixture(scope="module", autouse=True)
def emulate_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("kdagen-emulate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDAGEN_CACHE_DIR", str(root))
        yield root


def emulated(**fields):
    from kdagen.emulate import emulated as build

    return build(fields)


def lens_for(C: int) -> list[int]:
    return [1, C - 1, C, C + 1, 2 * C + 5]


# (spec fields, torch dtype): the kernel paths each target takes
#   sm_90: double-buffered cp.async chunk scan, u / o through LDS, matrix-unit solve
#   gfx90a/gfx942: one stage, per-element u / o; c64: element-built operands and the
#   matrix-unit solve with v staged into the k plane (no q plane); c32: the planar path
PREFILL = [
    (dict(head_dim=128, chunk_size=64, target="sm_90"), torch.bfloat16),
    (dict(head_dim=128, chunk_size=64, gate="lower_bound", target="sm_90"), torch.bfloat16),
    (dict(head_dim=64, chunk_size=64, io_dtype="fp16", target="sm_90"), torch.float16),
    (dict(head_dim=64, chunk_size=32, block_width=16, io_dtype="fp16", target="sm_90"), torch.float16),
    (dict(head_dim=128, chunk_size=64, gate="lower_bound", target="gfx90a"), torch.bfloat16),
    (dict(head_dim=128, chunk_size=64, target="gfx942"), torch.bfloat16),
    (dict(head_dim=64, chunk_size=32, block_width=32, target="gfx942"), torch.bfloat16),
    (dict(head_dim=128, chunk_size=64, block_width=64, target="gfx950"), torch.bfloat16),
    # chunk 16: 128-thread prologue blocks (one diagonal block), 8 resident per SM
    (dict(head_dim=128, chunk_size=16, gate="lower_bound", target="sm_90"), torch.bfloat16),
    (dict(head_dim=64, chunk_size=16, block_width=64, io_dtype="fp16", target="gfx90a"), torch.float16),
]


def _id(case) -> str:
    f, _ = case
    return "-".join(f"{k}{v}" for k, v in f.items() if k != "target") + f"-{f['target']}"


@needs_clang
@pytest.mark.parametrize("case", PREFILL, ids=[_id(c) for c in PREFILL])
def test_prologue_and_chunk_match_the_reference(case):
    check_prefill(*case)


# Tiles of 2, 4, 8 and 16 pieces a row: the shipped c16 d128 / bv128 variant (kg_t, aqk,
# akk 2; w, qg, u 16), bv16 (u 2) with c32 (kg_t 4) and d64 (w 8), c64 (kg_t 8), and CDNA
# (one stage, 64-bit operand reads) with bv32 (u 4) and c16.
OTHER_LAYOUT = [PREFILL[8], PREFILL[3], PREFILL[1], PREFILL[6], PREFILL[9]]


@needs_clang
@pytest.mark.parametrize("case", OTHER_LAYOUT, ids=[_id(c) for c in OTHER_LAYOUT])
def test_the_other_tile_layout_matches_the_reference(case, monkeypatch):
    """The chunk scan with the LDS tile layout its vendor and chunk size do not take by
    default (resources.chunk_swizzle): on NVIDIA rows padded at chunk 16 (CHUNK_SWIZZLE
    off) and the tiles unpadded with their 16-byte pieces swizzled at larger chunks
    (CHUNK_SWIZZLE_MAX_CHUNK raised), on CDNA rows padded (CHUNK_SWIZZLE_CDNA off). Copies
    and every matrix load and store must agree on the placement, or the products read
    another row's piece."""
    from kdagen.render import render

    spec, _ = case
    vendor = "amd" if spec["target"].startswith("gfx") else "nvidia"
    other = not resources.chunk_swizzle(vendor, spec["chunk_size"])
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_CDNA" if vendor == "amd" else "CHUNK_SWIZZLE", other)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_MAX_CHUNK", 64)
    kern = check_prefill(*case)
    assert f"kChunkSwizzle = {'true' if other else 'false'};" in render(kern.spec).files["kernels.hip"]


@needs_clang
def test_walks_with_outputs_swizzled_beside_a_padded_pass_one(monkeypatch):
    """The shipped chunk-16 variant (sm_90) with the tiles of the single walk and pass two
    swizzled and pass one's padded (CHUNK_SWIZZLE on, CHUNK_SWIZZLE_PASS_ONE off), against
    the reference in one group and in three (check_prefill): each walk's copies and
    fragment loads must take its own Config's layout, and pass one keeps its warpgroup
    state update, which reads a padded kg tile (a pass one laid out by kChunkSwizzle stops
    at that static assertion)."""
    from kdagen.render import render

    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", True)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_PASS_ONE", False)
    kern = check_prefill(*PREFILL[8])
    src = render(kern.spec).files["kernels.hip"]
    for want in ("kChunkSwizzle = true;", "kChunkSwizzlePassOne = false;", "kChunkWgUpdate = true;",
                 "kWalkPaired = true;", "kPassOnePaired = true;"):
        assert want in src, want


# The planar prologue's variants: c16 d128, c32 d64 fp16 and c64 d128 on sm_90, c32 d64
# and c16 d64 fp16 on CDNA.
PLANAR = [PREFILL[8], PREFILL[3], PREFILL[1], PREFILL[6], PREFILL[9]]


@needs_clang
@pytest.mark.parametrize("case", PLANAR, ids=[_id(c) for c in PLANAR])
def test_prologue_with_swizzled_planes_matches_the_reference(case, monkeypatch):
    """The planar prologue with its k and q planes unpadded and their 16-byte pieces
    swizzled by row (PROLOGUE_SWIZZLE, PROLOGUE_SWIZZLE_CDNA): the k / q rows staged from
    a layer's fused projection (unaligned: element by element), u and akk forms, then the
    walks (check_prefill); and from contiguous inputs (16-byte pieces, cp.async on sm_90),
    outputs poisoned. The staging, the norms, the exact path's element reads, P4's
    in-place rewrite of both planes, the products' matrix loads of Qa and of b k^ 2^G / b v
    must all take one placement (the Ka / Kb planes beside them stay padded), or a
    product reads another row's piece (LDS starts as NaN here)."""
    from kdagen.render import render

    monkeypatch.setattr(resources, "PROLOGUE_SWIZZLE", True)
    monkeypatch.setattr(resources, "PROLOGUE_SWIZZLE_CDNA", True)
    kern = check_prefill(*case)
    assert "kPrologueSwizzle = true;" in render(kern.spec).files["kernels.hip"]
    monkeypatch.setenv("KDAGEN_POISON", "1")
    C = kern.spec.chunk_size
    x = make_inputs(lens_for(C), 2, kern.spec.head_dim, dtype=case[1], device="cpu",
                    gate=kern.spec.gate, seed=C + 3)
    assert x.k.is_contiguous() and x.q.is_contiguous()
    check_prologue_and_single_walk(kern, x, C)


SWIZZLE_PROPERTIES = r"""
#include "kdagen/numeric.h"
#include <set>
// The 16-byte bank group (of the eight in a 128-byte run) of a 16-bit tile element.
static int group_of(int index) { return (index * 2 / 16) % 8; }
template <int W> static int check() {
  constexpr int P = W / 8, ROWS = 64;
  int bad = 0;
  std::set<int> seen;
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < W; ++c) {
      const int i = kdagen::swizzled<W>(r, c);
      seen.insert(i);
      bad += i / W != r;                                                        // stays in its row
      bad += c % 8 != 0 && i != kdagen::swizzled<W>(r, c - c % 8) + c % 8;      // pieces stay whole
    }
  bad += static_cast<int>(seen.size()) != ROWS * W || *seen.rbegin() != ROWS * W - 1;  // a permutation
  for (int r0 = 0; r0 < ROWS; r0 += 8)  // a matrix load / store phase: 8 rows at one piece
    for (int q = 0; q < P; ++q) {
      std::set<int> g;
      for (int j = 0; j < 8; ++j) g.insert(group_of(kdagen::swizzled<W>(r0 + j, 8 * q)));
      bad += g.size() != 8;
    }
  for (int e0 = 0; e0 < ROWS * P; e0 += 8) {  // a copy phase: 8 pieces in row-major order
    std::set<int> g;
    for (int e = e0; e < e0 + 8; ++e) g.insert(group_of(kdagen::swizzled<W>(e / P, 8 * (e % P))));
    bad += g.size() != 8;
  }
  return bad;
}
int main() {
  const int bad[] = {check<16>(), check<32>(), check<64>(), check<128>(), check<256>()};
  for (int b : bad) std::printf("%d ", b);
  std::printf("\n");
  return 0;
}
"""


@needs_clang
def test_swizzled_layout_is_a_permutation_that_spreads_bank_groups(tmp_path):
    """`swizzled<W>` (numeric.h) for tiles of 2 to 32 pieces a row: a permutation inside
    each row that keeps 16-byte pieces whole (the matrix loads read whole pieces), with
    the eight rows of a matrix load / store phase at one piece, and eight pieces copied
    in row order, in eight different 16-byte bank groups (what the layout is for)."""
    from kdagen.emulate import find_clang
    from kdagen.render import templates_dir

    src, exe = tmp_path / "swz.cpp", tmp_path / "swz"
    src.write_text(SWIZZLE_PROPERTIES)
    subprocess.run([find_clang(), "-std=c++20", "-pthread", "-DKDAGEN_EMULATE", "-DKDAGEN_EMULATE_NVIDIA",
                    f"-I{templates_dir() / 'include'}", str(src), "-o", str(exe)], check=True)
    bad = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert bad == ["0"] * 5, bad


BLOCK_ORDER_PROGRAM = r"""
#include "kdagen/emulate.h"
// Each block writes its index into its own cell and, wrongly, into the next block's: a
// forward run hides that (the next block writes its cell again after), another order not.
int main() {
  constexpr unsigned X = 3, Y = 2, Z = 4, N = X * Y * Z;
  int out[N + 1] = {}, runs[N] = {};
  kdagen_emu::launch(dim3(X, Y, Z), dim3(4), 0, [&] {
    const int b = static_cast<int>(blockIdx.x + X * (blockIdx.y + Y * blockIdx.z));
    if (threadIdx.x == 0) { ++runs[b]; out[b] = b; out[b + 1] = b; }
  });
  int once = 0, hidden = 1;
  for (unsigned b = 0; b < N; ++b) { once += runs[b] == 1; hidden &= out[b] == static_cast<int>(b); }
  std::printf("%d %d\n", once, hidden);
}
"""


@needs_clang
@pytest.mark.parametrize("order, hidden", [("forward", 1), ("reverse", 0), ("shuffle", 0), ("", 0)])
def test_emulated_blocks_run_once_each_in_the_chosen_order(tmp_path, monkeypatch, order, hidden):
    """KDAGEN_EMULATE_BLOCK_ORDER: every block of a grid runs exactly once in each order,
    and only the forward order hides a block that writes into its neighbour's cell (the
    default, shuffle, does not); a name that is no order is refused before a launch."""
    from kdagen.emulate import EmulationError, block_order, find_clang
    from kdagen.render import templates_dir

    src, exe = tmp_path / "order.cpp", tmp_path / "order"
    src.write_text(BLOCK_ORDER_PROGRAM)
    subprocess.run([find_clang(), "-std=c++20", "-pthread", "-DKDAGEN_EMULATE", "-DKDAGEN_EMULATE_NVIDIA",
                    f"-I{templates_dir() / 'include'}", str(src), "-o", str(exe)], check=True)
    env = dict(os.environ, KDAGEN_EMULATE_BLOCK_ORDER=order)
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True, env=env).stdout.split()
    assert got == ["24", str(hidden)], got
    monkeypatch.setenv("KDAGEN_EMULATE_BLOCK_ORDER", "sideways")
    with pytest.raises(EmulationError, match="sideways"):
        block_order()


def check_prefill(fields, dtype):
    """Prologue and chunk scan (one walk, three groups, u formed from v) against the
    float64 reference, outputs poisoned, at a scale other than the default D^-1/2 (the
    prologue's aqk and the scan's o both take it)."""
    kern = emulated(**fields)
    D, C, gate = kern.spec.head_dim, kern.spec.chunk_size, kern.spec.gate
    scale = 0.7 * D ** -0.5
    x = make_inputs(lens_for(C), 2, D, dtype=dtype, device="cpu", gate=gate, seed=D + C, fused=True)
    got = kern.fused_kda_prologue(*x.args(), scale, x.lower_bound, x.cu_seqlens)
    want = ref.chunk_prologue_reference(*x.args(), scale=scale, lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=C)
    for name in OPS:
        err = rel_err(got[name], want[name].to(got[name].dtype))
        assert err < PROLOGUE_TOL[name], f"{name}: rel err {err:.3e}"
    N = len(lens_for(C))
    init = torch.randn(N, 2, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), scale=scale, lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    for groups in (1, 3):
        out = torch.full_like(got["u"], float("nan"))
        o, s = kern.fused_kda_chunk(*(got[k] for k in OPS), out, scale, x.cu_seqlens, init, True,
                                    groups=groups)
        assert rel_err(o, o_ref) < BF16_TOL, (groups, rel_err(o, o_ref))
        assert rel_err(s, s_ref) < BF16_TOL, (groups, rel_err(s, s_ref))
    check_deferred_u(kern, x, init, o_ref, s_ref, scale=scale)
    return kern


def aligned_view(t: torch.Tensor, pad: int = 8) -> torch.Tensor:
    """``t`` as a strided view (head stride D + pad) of a wider buffer, the strides not the
    contiguous ones: with a pad of 8 16-bit values rows stay 16-byte aligned."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]]


def check_deferred_u(kern, x, init, o_ref, s_ref, groups=(1, 3), scale=None):
    """The prologue with defer_u (akk in place of u, v not read: poisoned in the
    prologue's call) and the scan forming u = akk v from a strided v."""
    C = kern.spec.chunk_size
    v = aligned_view(x.v.contiguous())
    args = list(x.args())
    args[2] = torch.full_like(v, float("nan"))  # the prologue must not read v
    got = kern.fused_kda_prologue(*args, scale, x.lower_bound, x.cu_seqlens, defer_u=True)
    assert "u" not in got
    want = ref.chunk_prologue_reference(*x.args(), scale=scale, lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=C, defer_u=True)
    for name in ("qg", "w", "kg_t", "aqk", "decay", "akk"):
        err = rel_err(got[name], want[name].to(got[name].dtype))
        assert err < PROLOGUE_TOL[name], f"deferred {name}: rel err {err:.3e}"
    for g in groups:
        out = torch.full_like(got["w"], float("nan"))
        o, s = kern.fused_kda_chunk(got["qg"], got["w"], v, got["kg_t"], got["aqk"], got["decay"],
                                    out, scale, x.cu_seqlens, init, True, groups=g, akk=got["akk"])
        assert rel_err(o, o_ref) < BF16_TOL, ("deferred", g, rel_err(o, o_ref))
        assert rel_err(s, s_ref) < BF16_TOL, ("deferred", g, rel_err(s, s_ref))


WARPGROUP = r"""
import sys, torch
from kdagen import reference as ref, resources
from kdagen.emulate import emulated
from kdagen.render import render
from kdagen.testing import make_inputs, rel_err
resources.CHUNK_WGMMA = True  # off by default: this run forces the warpgroup walk
resources.CHUNK_SWIZZLE = True  # ... which keeps its core-matrix tiles all the same
C = int(sys.argv[1])
kern = emulated(dict(head_dim=64, chunk_size=C, block_width=64, gate="lower_bound", target="sm_90"))
src = render(kern.spec).files["kernels.hip"]
assert "kChunkWgmma = true;" in src and "kChunkSwizzle = false;" in src
x = make_inputs([1, C - 1, C, C + 1, 2 * C + 5, 7 * C + 3], 2, 64, device="cpu", gate="lower_bound", seed=C)
p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
N = x.cu_seqlens.numel() - 1
init = torch.randn(N, 2, 64, 64, generator=torch.Generator().manual_seed(2)) * 0.1
o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                              cu_seqlens=x.cu_seqlens, initial_state=init)
errs = []
d = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=True)
for groups in (1, 3):
    out = torch.full_like(p["u"], float("nan"))
    o, s = kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")), out, None,
                                x.cu_seqlens, init, True, groups=groups)
    errs += [rel_err(o, o_ref), rel_err(s, s_ref)]
    out = torch.full_like(p["u"], float("nan"))  # u formed from v in the walk
    o, s = kern.fused_kda_chunk(d["qg"], d["w"], x.v, d["kg_t"], d["aqk"], d["decay"], out, None,
                                x.cu_seqlens, init, True, groups=groups, akk=d["akk"])
    errs += [rel_err(o, o_ref), rel_err(s, s_ref)]
print(*errs)
"""


@needs_clang
@pytest.mark.parametrize("C,late", [(16, True), (32, False)])
def test_warpgroup_chunk_scan_matches_the_reference(C, late, emulate_cache):
    """The sm_90a chunk scan with its products per warpgroup (wgmma: K-major core-matrix
    tiles read through descriptors, v_new and -S qg from one product of 2 C columns), off
    by default (resources.CHUNK_WGMMA) and kept checked here, in a process of its own: the
    emulation runs each product at the wait that retires it and stops the run when an
    accumulator is written while in flight or a product is never waited for. Copies land
    as late as cp.async allows (a miscounted copy wait reads stale data) or at once (a
    stage refilled while a product still reads it gives it the next chunk's tile)."""
    env = dict(os.environ, KDAGEN_CACHE_DIR=str(emulate_cache))
    env.pop("KDAGEN_EMULATE_LATE_COPIES", None)
    if late:
        env["KDAGEN_EMULATE_LATE_COPIES"] = "1"
    r = subprocess.run([sys.executable, "-c", WARPGROUP, str(C)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = list(map(float, r.stdout.split()))
    assert len(errs) == 8 and max(errs) < BF16_TOL, errs


WG_UPDATE = r"""
import sys, torch
from kdagen import reference as ref, resources
from kdagen.emulate import emulated
from kdagen.render import render
from kdagen.testing import make_inputs, rel_err
mode = sys.argv[1]  # off, on; p1: pass one's alone; vnew: pass one's v_new per warpgroup too; vnew64: and its blocks 64 rows
resources.CHUNK_WG_UPDATE = mode != "off"
resources.CHUNK_WG_UPDATE_OUTPUTS = mode != "p1"
resources.PASS_ONE_WG_VNEW = mode.startswith("vnew")
resources.PASS_ONE_WIDTH = 64 if mode == "vnew64" else 0
outputs_update = mode not in ("off", "p1")  # the walks with outputs' update per warpgroup too
if outputs_update:
    resources.CHUNK_SWIZZLE = False  # (beside padded tiles only)
D = int(sys.argv[2])
kern = emulated(dict(head_dim=D, chunk_size=16, block_width=D, gate="lower_bound", target="sm_90"))
src = render(kern.spec).files["kernels.hip"]
assert f"kChunkWgUpdate = {'true' if mode != 'off' else 'false'};" in src
assert f"kPassOneWgVnew = {'true' if mode.startswith('vnew') else 'false'};" in src
assert f"kChunkWgUpdateOutputs = {'true' if outputs_update else 'false'};" in src
x = make_inputs([1, 15, 17, 37, 115], 2, D, device="cpu", gate="lower_bound", seed=16)
init = torch.randn(5, 2, D, D, generator=torch.Generator().manual_seed(2)) * 0.1
o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                              cu_seqlens=x.cu_seqlens, initial_state=init)
d = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=True)
errs = []
for groups, segments in ((1, 0), (3, 0), (4, 2)):
    out = torch.full_like(x.v, float("nan"))
    o, s = kern.fused_kda_chunk(d["qg"], d["w"], x.v, d["kg_t"], d["aqk"], d["decay"], out, None,
                                x.cu_seqlens, init, True, groups=groups, akk=d["akk"], segments=segments)
    errs += [rel_err(o, o_ref), rel_err(s, s_ref)]
print(*errs)
"""


@needs_clang
@pytest.mark.parametrize("mode,head_dim", [("on", 128), ("on", 64), ("p1", 128), ("off", 128),
                                           ("vnew", 128), ("vnew", 64), ("vnew64", 128)])
def test_warpgroup_state_update_matches_the_reference(mode, head_dim, emulate_cache):
    """The sm_90 walks at chunk 16 with their state update as warpgroup products
    (resources.CHUNK_WG_UPDATE, on: in every walk, CHUNK_WG_UPDATE_OUTPUTS, whose tiles
    are then padded; p1: in pass one alone, the default, beside the swizzled tiles of the
    walks with outputs) and without (off), and with pass one's v_new products
    per warpgroup too (PASS_ONE_WG_VNEW; vnew64: in blocks of 64 rows, PASS_ONE_WIDTH),
    in a process of its own, copies landing as late as cp.async allows, workspace
    poisoned: the single walk, pass one per
    group and in segments with its lead, pass two (at d128 / bv128 every walk's blocks are
    whole warpgroups; at d64 / bv64 only pass one's, the paired walks keep the per-wave
    update). The emulation runs each product at the wait that retires it and stops on an
    accumulator changed while its product is in flight; the core-matrix kg tile's copy
    misplaced, or the update left in flight into the next step, fail here."""
    env = dict(os.environ, KDAGEN_CACHE_DIR=str(emulate_cache), KDAGEN_EMULATE_LATE_COPIES="1",
               KDAGEN_POISON="1")
    r = subprocess.run([sys.executable, "-c", WG_UPDATE, str(mode), str(head_dim)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = list(map(float, r.stdout.split()))
    assert len(errs) == 6 and max(errs) < BF16_TOL, errs


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx90a"])
def test_prefill_matches_the_reference(target, monkeypatch):
    """Kernels.prefill, which hands the prologue's outputs to the scan unchecked: u formed
    in the scan from v (rows 16-byte pieces) and by the prologue (v at an odd token
    stride), one walk and three groups, outputs poisoned, a non-default scale."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = emulated(head_dim=64, chunk_size=32, block_width=32, gate="softplus", target=target)
    x = make_inputs(lens_for(32), 2, 64, device="cpu", seed=13)
    init = torch.randn(len(lens_for(32)), 2, 64, 64, generator=torch.Generator().manual_seed(3)) * 0.1
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), scale=0.1, cu_seqlens=x.cu_seqlens,
                                                  initial_state=init)
    odd = aligned_view(x.v, pad=3)  # head stride D + 3: rows not in 16-byte pieces
    assert rows16_ok(x.v) and not rows16_ok(odd)
    for v in (x.v, odd):
        args = list(x.args())
        args[2] = v
        for groups in (1, 3, None):  # None: the heuristic's, for KDAGEN_EMULATE_CUS units
            o, s = kern.prefill(*args, 0.1, None, x.cu_seqlens, init, True, groups=groups)
            assert rel_err(o, o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL, (v.stride(), groups)


@needs_clang
def test_kda_forward_dense_batch_matches_the_reference(monkeypatch):
    """kda_forward on [B, T, ...] without cu_seqlens (the batch's bookkeeping made from the
    shape, seqlens.dense) through the emulated kernels: equal to the same call on the
    packed batch with cu_seqlens, and to the reference."""
    from kdagen import layer

    kern = emulated(head_dim=64, chunk_size=32, block_width=32, gate="softplus", target="sm_90")
    monkeypatch.setattr(layer, "for_inputs", lambda *a, **k: kern)
    B, T = 3, 37
    x = make_inputs([T] * B, 2, 64, device="cpu", seed=17)
    init = torch.randn(B, 2, 64, 64, generator=torch.Generator().manual_seed(4)) * 0.1
    raw = dict(A_log=x.A_log, dt_bias=x.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
               use_beta_sigmoid_in_kernel=True, state_v_first=True, initial_state=init,
               output_final_state=True, chunk_size=32, groups=1)
    batch = lambda t: t.reshape(B, T, *t.shape[2:])
    o, s = layer.kda_forward(*(batch(t) for t in (x.q, x.k, x.v, x.g, x.beta)), **raw)
    o_packed, s_packed = layer.kda_forward(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=x.cu_seqlens, **raw)
    assert torch.equal(o.reshape(o_packed.shape), o_packed) and torch.equal(s, s_packed)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
    assert rel_err(o_packed, o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL


@needs_clang
@pytest.mark.parametrize("state_v_first", [True, False])
def test_kda_forward_of_no_tokens(state_v_first, monkeypatch):
    """A dense batch of T = 0: an empty output of the right shape, and each sequence's
    final state its initial state, in the layout asked for."""
    from kdagen import layer

    kern = emulated(head_dim=64, chunk_size=32, block_width=32, gate="softplus", target="sm_90")
    monkeypatch.setattr(layer, "for_inputs", lambda *a, **k: kern)
    B, H, D = 2, 2, 64
    x = make_inputs([1], H, D, device="cpu", seed=18)
    empty = lambda t: t[:, :0].expand(B, 0, *t.shape[2:])  # noqa: E731
    init = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(6)) * 0.1
    o, s = layer.kda_forward(*(empty(t) for t in (x.q, x.k, x.v, x.g, x.beta)), initial_state=init,
                             output_final_state=True, state_v_first=state_v_first, A_log=x.A_log,
                             dt_bias=x.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, chunk_size=32)
    assert o.shape == (B, 0, H, D) and o.dtype == x.q.dtype
    assert s.shape == (B, H, D, D) and torch.equal(s, init)


@needs_clang
@pytest.mark.parametrize("defer_u", [True, False], ids=["akk", "u"])
def test_prologue_on_a_group_of_waves_equals_the_prologue_kernel(defer_u, monkeypatch):
    """prologue_chunk run by a later group of a block's waves (from thread 64), in LDS
    1024 bytes in (the first waves keep a pattern below it), behind a named barrier
    (sm_90's bar.sync): every output equal, to the bit, to prologue_kernel's on the same
    inputs (varlen, partial chunks, lower-bound gate), as the fused walk will run it."""
    import ctypes as ct
    import functools

    from kdagen.emulate import PrologueArgs
    from kdagen.emulate import emulated as build
    from kdagen.testing import PROLOGUE_GROUP_PROBE

    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = build(dict(head_dim=64, chunk_size=16, gate="lower_bound", target="sm_90"),
                 extra_source=PROLOGUE_GROUP_PROBE)
    probe = getattr(ct.CDLL(kern.library), "prologue_group_probe")
    probe.restype, probe.argtypes = ct.c_int, [ct.POINTER(PrologueArgs), ct.c_void_p]
    x = make_inputs([1, 15, 16, 17, 37], 2, 64, device="cpu", gate="lower_bound", seed=21)
    args = (*x.args(), None, x.lower_bound, x.cu_seqlens)
    want = kern.fused_kda_prologue(*args, defer_u=defer_u)
    kern.ops["prologue"] = functools.partial(kern.ops["prologue"], f=probe)
    got = kern.fused_kda_prologue(*args, defer_u=defer_u)
    assert set(got) == set(want)
    for name in want:  # outputs poisoned (NaN) before each launch: an unwritten one differs
        assert not want[name].isnan().any(), name
        assert torch.equal(got[name], want[name]), name


@needs_clang
def test_walk_residency_comes_from_the_occupancy_query(monkeypatch):
    """Kernels.walk_residency: the runtime's occupancy (the emulation's is
    KDAGEN_EMULATE_RESIDENT) where it tells, asked once per device; the chunk plan's where
    it cannot (0); and the group heuristic counts those slots."""
    from kdagen.groups import groups_for_spec, num_compute_units, planned_residency

    fields = dict(head_dim=64, chunk_size=32, block_width=32, gate="softplus", target="sm_90")
    cpu = torch.device("cpu")
    monkeypatch.delenv("KDAGEN_EMULATE_RESIDENT", raising=False)
    kern = emulated(**fields)
    planned = planned_residency(kern.spec)
    assert kern.walk_residency(cpu) == planned
    monkeypatch.setenv("KDAGEN_EMULATE_RESIDENT", "3")
    assert kern.walk_residency(cpu) == planned  # asked once per device
    fresh = emulated(**fields)
    assert planned != (3, 3) and fresh.walk_residency(cpu) == (3, 3)
    # 1 x 1 heads of 256 chunks on the emulated 8 units: three blocks per unit hold more groups
    cus = num_compute_units(cpu)
    more, fewer = (groups_for_spec(kern.spec, 256, 1, 1, cus, resident=r) for r in (3, planned[0]))
    assert more > fewer
    assert fresh.heuristic_groups(256, 1, 1, cpu) == more and kern.heuristic_groups(256, 1, 1, cpu) == fewer


@needs_clang
@pytest.mark.parametrize("target,groups", [("sm_90", 1), ("sm_90", 3), ("gfx90a", 1)])
def test_padded_tail_is_left_alone(target, groups):
    """cu_seqlens ending before T (an engine's CUDA-graph padding, accepted as the
    production wrapper accepts it): the sequences' outputs and states are exact, and the
    tail's output is never written (it keeps the poison) and its tokens do not reach the
    sequences (tail inputs at 1e4 would swamp any read of them)."""
    C = 32
    kern = emulated(head_dim=64, chunk_size=C, block_width=32, gate="lower_bound", target=target)
    x = make_inputs([C + 5, 2 * C + 3], 2, 64, device="cpu", gate="lower_bound", seed=11)
    pad = 2 * C - 5  # the last chunk of the last sequence is partial, the tail spans chunks
    grow = lambda t, fill: torch.cat([t, torch.full((1, pad, *t.shape[2:]), fill, dtype=t.dtype)], 1)
    q, k, v, g, beta = (grow(t, 1e4) for t in (x.q, x.k, x.v, x.g, x.beta))
    init = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(5)) * 0.1
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    p = kern.fused_kda_prologue(q, k, v, g, beta, x.A_log, x.dt_bias, None, x.lower_bound,
                                x.cu_seqlens)
    T = x.q.shape[1]
    assert p["qg"].shape[1] == T + pad and p["kg_t"].shape[0] == 2 + 3
    out = torch.full_like(v, float("nan"))
    o, s = kern.fused_kda_chunk(*(p[n] for n in OPS), out, None, x.cu_seqlens, init, True,
                                groups=groups)
    assert rel_err(o[:, :T], o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL
    assert o[:, T:].isnan().all()


@needs_clang
@pytest.mark.parametrize("target,gate", [("sm_90", "lower_bound"), ("gfx90a", "lower_bound"),
                                         ("sm_90", "softplus")])
def test_strong_decay_stays_finite_and_exact(target, gate):
    kern = emulated(head_dim=64, chunk_size=32, gate=gate, target=target)
    x = make_inputs(lens_for(32), 2, 64, device="cpu", gate=gate, strong_decay=True, seed=7)
    got = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    o, s = kern.fused_kda_chunk(*(got[k] for k in OPS), torch.empty_like(got["u"]), None,
                                x.cu_seqlens, None, True, groups=1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens)
    assert rel_err(o, o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL


def faint_gate_where(x, faint) -> None:
    """Make x's strong softplus gate faint (softplus(-6) e^1: ~7e-3 per step) at the
    tokens whose position i in their sequence has faint(i)."""
    H, D = x.g.shape[2], x.g.shape[3]
    for a, b in zip(x.cu_seqlens.tolist(), x.cu_seqlens.tolist()[1:]):
        for t in range(a, b):
            if faint(t - a):
                x.g[0, t] = -6.0 - x.dt_bias.view(H, D)


def check_prologue(kern, x, C: int) -> dict:
    """Every prologue output against the reference; returns the outputs."""
    got = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    want = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=C)
    for name in OPS:
        err = rel_err(got[name], want[name].to(got[name].dtype))
        assert err < PROLOGUE_TOL[name], f"{name}: rel err {err:.3e}"
    return got


def check_prologue_and_single_walk(kern, x, C: int) -> None:
    """Every prologue output against the reference, then the single walk's output and
    final state against the token recurrence."""
    got = check_prologue(kern, x, C)
    o, s = kern.fused_kda_chunk(*(got[k] for k in OPS), torch.empty_like(got["u"]), None,
                                x.cu_seqlens, None, True, groups=1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens)
    assert rel_err(o, o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_prologue_of_one_sequence(target, monkeypatch):
    """A lone sequence (every long prefill; docs/wip's one-sequence and sequence-guess
    patches take its chunks' bounds without the chunk_indices round trip): six chunks of
    16 and a partial seventh, strong decay, every output against the reference and
    poisoned before the launch, then the walk."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    C, D = 16, 128
    kern = emulated(head_dim=D, chunk_size=C, gate="lower_bound", target=target)
    x = make_inputs([6 * C + 5], 2, D, device="cpu", gate="lower_bound", strong_decay=True, seed=32)
    check_prologue_and_single_walk(kern, x, C)


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx950"])
def test_diagonal_blocks_take_both_paths_in_one_chunk(target):
    """Planar prologue: a softplus gate that is strong in the first 16 rows of every
    chunk and faint in the rest, so that one chunk sends one diagonal block through the
    exact per-pair path (span far past kDiagSpan) and the other through the matrix units."""
    C = 32
    kern = emulated(head_dim=64, chunk_size=C, target=target)
    x = make_inputs(lens_for(C), 2, 64, device="cpu", strong_decay=True, seed=11)
    faint_gate_where(x, lambda i: i % C >= 16)
    check_prologue_and_single_walk(kern, x, C)


@needs_clang
@pytest.mark.parametrize("target, swizzle", [("sm_90", False), ("gfx950", False), ("sm_90", True)])
def test_chunk_16_diagonal_block_both_ways(target, swizzle, monkeypatch):
    """Planar prologue at chunk 16, where a chunk is one diagonal block: a softplus gate
    strong in every other chunk (span past kDiagSpan: the exact per-pair path, Kb scaled
    against the block's last row) and faint in the rest (the matrix units, Kb scaled
    against its first row in P4 and divided back for kg_t). Every output against the
    reference, outputs poisoned."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    monkeypatch.setattr(resources, "PROLOGUE_SWIZZLE", swizzle)  # the exact path's element reads too
    C = 16
    kern = emulated(head_dim=64, chunk_size=C, target=target)
    x = make_inputs(lens_for(C) + [5 * C + 3], 2, 64, device="cpu", strong_decay=True, seed=29)
    faint_gate_where(x, lambda i: (i // C) % 2 == 1)
    check_prologue_and_single_walk(kern, x, C)


@needs_clang
@pytest.mark.parametrize("stagger_us", [20000, -20000])
def test_prologue_with_waves_leaving_barriers_far_apart(stagger_us, monkeypatch):
    """The chunk-16 d128 prologue (one cumsum run per column; wave 0 alone checks every
    column's diagonal span) with its waves leaving each barrier 20 ms apart, first to last
    and last to first (KDAGEN_EMULATE_STAGGER_US), so that a wave runs its whole phase
    before the next starts: a barrier missing between a write and another wave's read
    then reads stale data, which free-running threads rarely do. The gate is strong in
    every other chunk (the exact per-pair path) and faint in the rest (the matrix units),
    and faint everywhere in channels 0-31, whose cumulative sums wave 0 makes itself, so
    that its span check depends on the other waves' sums; every output against the
    reference, outputs poisoned."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    C, D = 16, 128
    kern = emulated(head_dim=D, chunk_size=C, target="sm_90")
    x = make_inputs([C + 1, 3 * C], 1, D, device="cpu", strong_decay=True, seed=31)
    faint_gate_where(x, lambda i: (i // C) % 2 == 1)
    x.g[0, :, :, :32] = -6.0 - x.dt_bias.view(1, D)[:, :32]  # wave 0's own channels faint
    monkeypatch.setenv("KDAGEN_EMULATE_STAGGER_US", str(stagger_us))
    check_prologue(kern, x, C)


def paged_walk(kern, x, p, slots, idx, has, offs, groups):
    """The chunk scan of prologue outputs ``p`` on a paged cache of ``slots`` random rows
    (sequence n at row idx[n], started from it where has[n]) with a checkpoint after
    offs[n] tokens (0: none), output and checkpoints poisoned. Returns the output, the
    returned final state, the cache after and before, the checkpoints, and the float64
    reference's (output, final states, checkpoints)."""
    N, H, D = len(idx), x.q.shape[2], x.q.shape[3]
    cache = torch.randn(slots, H, D, D, generator=torch.Generator().manual_seed(3)) * 0.1
    before = cache.clone()
    ck = torch.full((N, H, D, D), float("nan"))
    out, fin = kern.fused_kda_chunk(*(p[k] for k in OPS), torch.full_like(p["u"], float("nan")), None,
                                    x.cu_seqlens, None, False, state_cache=cache, state_indices=idx,
                                    has_initial_state=has, checkpoint_state=ck, checkpoint_offsets=offs,
                                    groups=groups)
    init = before[idx.long()] * has[:, None, None, None]
    want = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound, cu_seqlens=x.cu_seqlens,
                                       initial_state=init, checkpoint_offsets=offs)
    return out, fin, cache, before, ck, want


@needs_clang
@pytest.mark.parametrize("target,D,C", [("sm_90", 64, 32), ("gfx942", 64, 32), ("sm_90", 128, 16)])
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_paged_cache_and_checkpoints(target, D, C, groups, monkeypatch):
    """Paged start / end states and a mid-prefill checkpoint, in the single walk and in
    the grouped walks (3 groups: the checkpoint in group 0, one-chunk sequences that end
    in group 0; 4 groups: the checkpoint in group 1); at chunk 16 with the paired walks
    (two tiles of state rows a wave)."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = emulated(head_dim=D, chunk_size=C, target=target)
    H = 2
    x = make_inputs([C * 3 + 3, C, 5], H, D, device="cpu", seed=21)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32)
    has = torch.tensor([True, False, True])
    offs = torch.tensor([C * 2, 0, 0], dtype=torch.int32)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    out, fin, cache, before, ck, (o_ref, s_ref, ck_ref) = paged_walk(kern, x, p, 6, idx, has, offs,
                                                                     groups)
    assert fin is None
    assert rel_err(out, o_ref) < BF16_TOL
    assert rel_err(cache[idx.long()], s_ref) < BF16_TOL
    others = [i for i in range(cache.shape[0]) if i not in idx.tolist()]
    assert torch.equal(cache[others], before[others])
    assert rel_err(ck[0], ck_ref[0]) < BF16_TOL
    assert torch.isnan(ck[1]).all() and torch.isnan(ck[2]).all()  # offset 0: no export


@needs_clang
@pytest.mark.parametrize("groups", [1, 3])
def test_checkpoint_rows_by_index(groups, monkeypatch):
    """Checkpoints into rows named by checkpoint_state_indices (the seed's paged form):
    each sequence's snapshot lands in its own row, a negative row disables the export of a
    sequence whose offset is set, and the rows nobody names stay as they were."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    C, D, H = 32, 64, 2
    kern = emulated(head_dim=D, chunk_size=C, target="sm_90")
    x = make_inputs([C * 3 + 3, 2 * C + 7, C + 1], H, D, device="cpu", seed=23)
    offs = torch.tensor([C * 2, C * 2, C], dtype=torch.int32)
    rows = torch.tensor([3, -1, 0], dtype=torch.int32)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    ck = torch.full((5, H, D, D), float("nan"))
    out, fin = kern.fused_kda_chunk(*(p[k] for k in OPS), torch.full_like(p["u"], float("nan")), None,
                                    x.cu_seqlens, None, True, checkpoint_state=ck,
                                    checkpoint_offsets=offs, checkpoint_state_indices=rows,
                                    groups=groups)
    o_ref, s_ref, ck_ref = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                       cu_seqlens=x.cu_seqlens,
                                                       checkpoint_offsets=offs)
    assert rel_err(out, o_ref) < BF16_TOL and rel_err(fin, s_ref) < BF16_TOL
    assert rel_err(ck[3], ck_ref[0]) < BF16_TOL
    assert rel_err(ck[0], ck_ref[2]) < BF16_TOL
    assert torch.isnan(ck[[1, 2, 4]]).all()  # sequence 1's row is -1: no export anywhere


@needs_clang
@pytest.mark.parametrize("target,D,C,flags", [("sm_90", 64, 32, "given"), ("gfx90a", 64, 32, "given"),
                                               ("gfx942", 128, 64, "given"), ("sm_90", 64, 32, "none")])
def test_fused_conv(target, D, C, flags):
    """The fused conv against the reference, with conv_has_initial_state given, and left
    out: then no sequence reads its row's history (vLLM's convention), and every addressed
    row is still updated."""
    W, H = 4, 2
    kern = emulated(head_dim=D, chunk_size=C, conv_width=W, target=target)
    x = make_inputs([1, 2, C - 1, C + 5], H, D, device="cpu", seed=41)
    gen = torch.Generator().manual_seed(5)
    wgt = torch.randn(3 * H * D, W, generator=gen) * 0.5
    state = torch.randn(5, 3 * H * D, W - 1, generator=gen)
    before = state.clone()
    idx = torch.tensor([3, 0, -1, 4], dtype=torch.int32)
    has = torch.tensor([True, False, True, True]) if flags == "given" else None
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens, conv_weight=wgt,
                                conv_state=state, conv_state_indices=idx,
                                conv_has_initial_state=has)
    want, new_state = conv_prologue_reference(x, wgt, before, idx, has, C)
    for name in ("qg", "w", "u", "kg_t", "aqk"):
        tol = 1e-2 if name == "qg" else PROLOGUE_TOL[name]  # q rounded to the io dtype after the conv
        assert rel_err(p[name], want[name].to(p[name].dtype)) < tol, name
    assert rel_err(state, new_state) < 1e-2
    assert torch.equal(state[[1, 2]], before[[1, 2]])


@needs_clang
@pytest.mark.parametrize("target,io,dtype,tol", [("sm_90", "bf16", torch.bfloat16, 1e-2),
                                                 ("gfx90a", "fp32", torch.float32, 1e-4)])
def test_recurrent(target, io, dtype, tol):
    kern = emulated(head_dim=64, io_dtype=io, ops=["recurrent"], target=target)
    N, H, D, slots = 5, 2, 64, 8
    x = make_inputs([1] * N, H, D, dtype=dtype, device="cpu", seed=3)
    cache = torch.randn(slots, H, D, D, generator=torch.Generator().manual_seed(2)) * 0.1
    idx = torch.tensor([6, 0, -1, 3, 5], dtype=torch.int32)
    before = cache.clone()
    sq = lambda t: t[0]
    scale = 0.6 * D ** -0.5  # not the default: the decode step must use the one given
    out = kern.fused_recurrent_kda(sq(x.q), sq(x.k), sq(x.v), sq(x.g), sq(x.beta), x.A_log,
                                   x.dt_bias, scale, None, cache, idx)
    live = idx >= 0
    init = before[idx.clamp_min(0).long()]
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), scale=scale, cu_seqlens=torch.arange(N + 1),
                                                  initial_state=init)
    assert rel_err(out[live], o_ref[0][live]) < tol
    assert torch.all(out[~live] == 0)
    assert rel_err(cache[idx[live].long()], s_ref[live]) < tol


LATE = r"""
import torch, sys
from kdagen.emulate import emulated
from kdagen import reference as ref, resources
resources.CHUNK_U_APART = sys.argv[1] == "1"
from kdagen.testing import conv_prologue_reference, make_inputs, rel_err
kern = emulated(dict(head_dim=64, chunk_size=32, block_width=32, target="sm_90"))
x = make_inputs([1, 31, 32, 33, 165], 2, 64, device="cpu", seed=9)  # a walk of 6 chunks
p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens)
d = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens, defer_u=True)
v = x.v.contiguous()
errs = []
for groups in (1, 3):  # 3: walks that start past chunk 0 (pass one, scan, pass two)
    o, s = kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                torch.empty_like(p["u"]), None, x.cu_seqlens, None, True, groups=groups)
    errs += [rel_err(o, o_ref), rel_err(s, s_ref)]
    o, s = kern.fused_kda_chunk(d["qg"], d["w"], v, d["kg_t"], d["aqk"], d["decay"],  # u from v
                                torch.empty_like(p["u"]), None, x.cu_seqlens, None, True,
                                groups=groups, akk=d["akk"])
    errs += [rel_err(o, o_ref), rel_err(s, s_ref)]
print(*errs)
"""


@needs_clang
@pytest.mark.parametrize("apart", [True, False])
def test_copies_landing_as_late_as_cp_async_allows(emulate_cache, apart):
    """cp.async groups land only at the wait that must have landed them: a miscounted
    wait_group in the double-buffered scan would read NaN or the previous chunk (single
    walk and chunk groups, whose walks start past chunk 0), both forms of the walk's u =
    akk v (resources.CHUNK_U_APART) among them."""
    env = dict(os.environ, KDAGEN_EMULATE_LATE_COPIES="1", KDAGEN_CACHE_DIR=str(emulate_cache))
    r = subprocess.run([sys.executable, "-c", LATE, "1" if apart else "0"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = list(map(float, r.stdout.split()))
    assert len(errs) == 8 and max(errs) < BF16_TOL, errs


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_state_planes_16_byte_aligned_or_not(target, monkeypatch):
    """The walks read start states and write end states as vector pieces where a plane is
    16-byte aligned (whole sectors; the emulation aborts on a misaligned one) and element
    by element where the caller's tensor is a 4-byte aligned view: start states and a paged
    cache at both alignments, in the single walk and in chunk groups (whose pass two reads
    its start states from the workspace), against the reference."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = emulated(head_dim=64, chunk_size=32, target=target)
    C, D, H = 32, 64, 2
    x = make_inputs([C * 3 + 3, C, 5, 0, 40], H, D, device="cpu", seed=31)
    N, slots, gen = 5, 6, torch.Generator().manual_seed(4)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    idx = torch.tensor([4, 1, 2, 0, 5], dtype=torch.int32)
    for shift in (0, 1):  # 1: every plane 4-byte aligned only
        init = (torch.randn(N * H * D * D + 1, generator=gen) * 0.1)[shift:shift + N * H * D * D].view(N, H, D, D)
        o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
        for groups in (1, 3):
            out, fin = kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None,
                                            x.cu_seqlens, init, True, groups=groups)
            assert rel_err(out, o_ref) < BF16_TOL, (shift, groups, rel_err(out, o_ref))
            assert rel_err(fin, s_ref) < BF16_TOL, (shift, groups, rel_err(fin, s_ref))
        cache = (torch.randn(slots * H * D * D + 1, generator=gen) * 0.1)[shift:shift + slots * H * D * D]
        cache = cache.view(slots, H, D, D)
        before = cache.clone()
        o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens,
                                                      initial_state=before[idx.long()])
        out, fin = kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None,
                                        x.cu_seqlens, None, False, state_cache=cache,
                                        state_indices=idx, has_initial_state=torch.ones(N, dtype=torch.bool),
                                        groups=1)
        assert fin is None and rel_err(out, o_ref) < BF16_TOL
        assert rel_err(cache[idx.long()], s_ref) < BF16_TOL, (shift, rel_err(cache[idx.long()], s_ref))
        assert torch.equal(cache[3], before[3])  # the slot nobody names


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx90a"])
def test_lower_bound_diagonal_blocks_survive_huge_raw_inputs(target):
    """The matrix-unit diagonal blocks scale their operands by up to 2^(8 |bound| / ln 2);
    with raw q, k of 1e10 that must not overflow bf16 (the norms come first)."""
    kern = emulated(head_dim=64, chunk_size=32, gate="lower_bound", target=target)
    x = make_inputs(lens_for(32), 2, 64, device="cpu", gate="lower_bound", lower_bound=-8.0, seed=13)
    x.g.fill_(60.0)  # the gate saturated at its bound: -8 per step
    x.q.mul_(3e10)
    x.k.mul_(3e10)
    got = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    want = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=32)
    for name in ("w", "u", "aqk"):
        err = rel_err(got[name], want[name].to(got[name].dtype))
        assert err < BF16_TOL, f"{name}: rel err {err:.3e}"


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx950"])
def test_softplus_gate_over_its_whole_input_range(target):
    """The prologue's softplus gate in log2 units (max(y, 0) + log2(1 + 2^-|y|)) against
    torch's softplus with FLA's threshold, for x + bias from -60 to 60: past x = 20 the
    gate is x itself, far below 0 it vanishes. The chunk decay (fp32) to 1e-5 and the
    16-bit outputs to BF16_TOL; a dropped max(y, 0) or a lost sign fails both."""
    C = 16
    kern = emulated(head_dim=64, chunk_size=C, target=target)
    x = make_inputs([C + 3, 2 * C + 5], 2, 64, device="cpu", seed=37)
    x.A_log.fill_(-3.0)  # a_exp 0.05: at most -3 per step, so chunks keep their decay
    x.dt_bias.zero_()
    gen = torch.Generator().manual_seed(5)
    x.g.copy_((torch.rand(x.g.shape, generator=gen) * 120.0 - 60.0).to(x.g.dtype))
    got = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    want = ref.chunk_prologue_reference(*x.args(), cu_seqlens=x.cu_seqlens, chunk_size=C)
    assert rel_err(got["decay"], want["decay"]) < 1e-5, rel_err(got["decay"], want["decay"])
    for name in ("qg", "w", "u", "kg_t", "aqk"):
        err = rel_err(got[name], want[name].to(got[name].dtype))
        assert err < BF16_TOL, f"{name}: rel err {err:.3e}"


@needs_clang
@pytest.mark.parametrize("target, pass_one_stages, paired, swizzle, lead", [
    ("sm_90", 0, False, False, 12), ("sm_90", 3, False, False, 12), ("gfx942", 0, False, False, 12),
    ("sm_90", 3, True, False, 11), ("gfx942", 0, True, False, 11), ("sm_90", 3, True, True, 12),
    ("gfx942", 0, False, True, 12), ("gfx942", 0, True, True, 12),
    ("sm_90", 3, True, False, 0), ("gfx942", 0, False, False, 0), ("sm_90", 3, True, False, 40)])
def test_every_group_count_matches_the_single_walk(target, pass_one_stages, paired, swizzle, lead, monkeypatch):
    """The two-pass group scan against the single walk, for group counts that split
    one long walk evenly, unevenly and into groups of one chunk, with pass one in one
    segment per group and in fewer segments that end between group starts (pass one
    storing at the group starts inside them, empty segments in the short sequence;
    workspace poisoned: a plane read before it is written shows as NaN); on sm_90 also with pass one
    buffered three chunks deep (resources.PASS_ONE_STAGES) where the walk takes two,
    with pass one's state and transfer rows paired in one block (PASS_ONE_PAIRED), and
    with swizzled tiles (CHUNK_SWIZZLE, CHUNK_SWIZZLE_CDNA: set here on both vendors, pass
    one's as the others'); pass one's lead segment (PASS_ONE_LEAD: segment 0 from the
    true start, no transfer rows) at 11 / 8 (the default), 1.5 and 5 times a segment's
    length, and off."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    monkeypatch.setattr(resources, "PASS_ONE_LEAD", lead)
    monkeypatch.setattr(resources, "PASS_ONE_STAGES", pass_one_stages)
    monkeypatch.setattr(resources, "PASS_ONE_PAIRED", paired)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", swizzle)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_PASS_ONE", None)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_MAX_CHUNK", 32)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_CDNA", swizzle)
    if pass_one_stages:
        from kdagen.render import chunk_plan_for
        from kdagen.spec import KernelSpec
        plan = chunk_plan_for(KernelSpec(head_dim=64, chunk_size=32, block_width=32, target=target))
        assert (plan.stages, plan.stages_of_pass_one) == (2, pass_one_stages)
    kern = emulated(head_dim=64, chunk_size=32, block_width=32, target=target)
    x = make_inputs([32 * 9 + 7, 40], 2, 64, device="cpu", seed=17)  # walks of 10 and 2 chunks
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    init = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(4)) * 0.1
    run = lambda g, s=None: kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None,
                                                 x.cu_seqlens, init, True, groups=g, segments=s)
    o1, s1 = run(1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
    assert rel_err(o1, o_ref) < BF16_TOL and rel_err(s1, s_ref) < BF16_TOL
    for g, segments in ((2, None), (3, None), (3, 1), (4, None), (4, 2), (10, None), (10, 1), (10, 4)):
        og, sg = run(g, segments)
        assert rel_err(og, o1) < 1e-2 and rel_err(sg, s1) < 1e-2, (g, segments)
        assert rel_err(og, o_ref) < BF16_TOL and rel_err(sg, s_ref) < BF16_TOL, (g, segments)


def launched_grids(kern) -> list[tuple[int, int, int]]:
    """The grids the emulated variant launched since the last read (emulate.h)."""
    import ctypes as ct

    out = (ct.c_uint * 48)()
    n = ct.CDLL(kern.library).kdagen_emulate_grids(out, 16)
    return [tuple(out[3 * i:3 * i + 3]) for i in range(min(n, 16))]


@needs_clang
@pytest.mark.parametrize("target, head_dim", [("sm_90", 64), ("gfx90a", 128)])
def test_every_group_scan_block_matches_the_single_walk(target, head_dim, monkeypatch):
    """Each group-scan block the variant builds (resources.scan_plans: 32 / 16 rows at
    D = 64, 32 / 16 / 8 at D = 128), picked at run time by the compute units
    (KDAGEN_EMULATE_CUS, so that 2 x D / rows x N x H just reaches them): the launch has
    D / rows blocks per (n, h), and outputs and end states match the single walk, in one
    segment per group and in fewer (workspace poisoned)."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = emulated(head_dim=head_dim, chunk_size=32, block_width=32, target=target)
    x = make_inputs([32 * 6 + 7, 40], 2, head_dim, device="cpu", seed=23)  # walks of 7 and 2 chunks
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    init = torch.randn(2, 2, head_dim, head_dim, generator=torch.Generator().manual_seed(5)) * 0.1
    run = lambda g, s=None: kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None,
                                                 x.cu_seqlens, init, True, groups=g, segments=s)
    o1, s1 = run(1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
    assert rel_err(o1, o_ref) < BF16_TOL and rel_err(s1, s_ref) < BF16_TOL
    planes = 2 * 2
    plans = resources.scan_plans(head_dim)
    assert len(plans) >= 2
    for plan in plans:
        cus = 2 * (head_dim // plan.rows) * planes
        assert resources.scan_rows_for(plans, head_dim, planes, cus) == plan.rows
        monkeypatch.setenv("KDAGEN_EMULATE_CUS", str(cus))
        for g, segments in ((3, None), (4, 2)):
            launched_grids(kern)
            og, sg = run(g, segments)
            grids = launched_grids(kern)
            assert len(grids) == 3 and grids[1] == (head_dim // plan.rows, 2, 2), (plan, grids)
            assert rel_err(og, o1) < 1e-2 and rel_err(sg, s1) < 1e-2, (plan.rows, g, segments)
            assert rel_err(og, o_ref) < BF16_TOL and rel_err(sg, s_ref) < BF16_TOL, (plan.rows, g, segments)


@needs_clang
@pytest.mark.parametrize("target, head_dim, swizzle, width_one", [
    ("sm_90", 128, False, 0), ("sm_90", 128, True, 0), ("gfx950", 64, False, 0),
    ("sm_90", 128, False, 64), ("gfx950", 64, False, 32)])
def test_paired_pass_one_at_chunk_16(target, head_dim, swizzle, width_one, monkeypatch):
    """Pass one with its state and transfer rows in one block (PASS_ONE_PAIRED) in the
    shipped chunk-16 form (u formed from v with akk; on sm_90 the d128 / bv128 variant,
    also with its tiles swizzled as the walks with outputs' are), and in blocks narrower
    than the other walks' (PASS_ONE_WIDTH): outputs and end states against the reference at 3 and 4 groups,
    outputs and the workspace poisoned."""
    from kdagen.render import render

    monkeypatch.setenv("KDAGEN_POISON", "1")
    monkeypatch.setattr(resources, "PASS_ONE_PAIRED", True)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", swizzle)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_PASS_ONE", None)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_CDNA", swizzle)
    monkeypatch.setattr(resources, "PASS_ONE_WIDTH", width_one)
    C, D, H = 16, head_dim, 1
    kern = emulated(head_dim=D, chunk_size=C, gate="lower_bound", target=target)
    src = render(kern.spec).files["kernels.hip"]
    assert "kPassOnePaired = true;" in src
    assert (f"kBlockV = {width_one};" in src) == bool(width_one) and kern.spec.block_width != width_one
    x = make_inputs([C * 6 + 5, C * 3, 7], H, D, device="cpu", gate="lower_bound", seed=43)
    init = torch.randn(3, H, D, D, generator=torch.Generator().manual_seed(6)) * 0.1
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    check_deferred_u(kern, x, init, o_ref, s_ref, groups=(3, 4))


@needs_clang
@pytest.mark.parametrize("head_dim, block_width, swizzle, paired", [
    (128, 128, True, True), (64, 32, False, True), (128, 128, False, False)])
def test_paired_walk_rows_at_chunk_16(head_dim, block_width, swizzle, paired, monkeypatch):
    """The single walk and pass two with two 16-row tiles of V per wave (WALK_PAIRED, the
    default at chunk 16 on wave32) and with one (the form every other variant takes), in
    the chunk-16 form (sm_90; the shipped d128 / bv128 swizzled, d64 / bv32 padded): outputs
    and end states against the float64 reference in one walk and in 3 groups, u read and
    u formed from v, then a paged cache and a mid-prefill checkpoint; outputs and
    checkpoints poisoned. A second tile that reads the first tile's u, stores over its
    o, or starts from its rows of the state fails here."""
    from kdagen.render import render

    monkeypatch.setenv("KDAGEN_POISON", "1")
    monkeypatch.setattr(resources, "WALK_PAIRED", paired)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", swizzle)
    C, D, H = 16, head_dim, 2
    kern = emulated(head_dim=D, chunk_size=C, block_width=block_width, gate="lower_bound", target="sm_90")
    src = render(kern.spec).files["kernels.hip"]
    assert f"kWalkPaired = {'true' if paired else 'false'};" in src
    assert f"kChunkSwizzle = {'true' if swizzle else 'false'};" in src
    x = make_inputs([1, C - 1, C + 1, 5 * C + 3], H, D, device="cpu", gate="lower_bound", seed=D + 5)
    N = x.cu_seqlens.numel() - 1
    init = torch.randn(N, H, D, D, generator=torch.Generator().manual_seed(8)) * 0.1
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    for g in (1, 3):
        o, st = kern.fused_kda_chunk(*(p[k] for k in OPS), torch.full_like(p["u"], float("nan")), None,
                                     x.cu_seqlens, init, True, groups=g)
        assert rel_err(o, o_ref) < BF16_TOL and rel_err(st, s_ref) < BF16_TOL, (g, rel_err(o, o_ref))
    check_deferred_u(kern, x, init, o_ref, s_ref, groups=(1, 3))
    idx = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    has = torch.tensor([True, False, True, True])
    offs = torch.tensor([0, 0, 0, 2 * C], dtype=torch.int32)
    out, _, cache, _, ck, (o_ref, s_ref, ck_ref) = paged_walk(kern, x, p, 6, idx, has, offs, 1)
    assert rel_err(out, o_ref) < BF16_TOL and rel_err(cache[idx.long()], s_ref) < BF16_TOL
    assert rel_err(ck[3], ck_ref[3]) < BF16_TOL


@needs_clang
@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_group_scan_at_head_dim_128(target, monkeypatch):
    """The shipped head dim's group scan (16 rows of R per ring tile, two 16-byte pieces
    per thread, two state rows per thread; four wave64s on CDNA): six groups, so the ring
    of four tiles wraps several times across group boundaries. Against the single walk,
    workspace poisoned."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = emulated(head_dim=128, chunk_size=64, block_width=64, target=target)
    x = make_inputs([64 * 6 - 5], 1, 128, device="cpu", seed=23)  # one walk of 6 chunks
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    init = torch.randn(1, 1, 128, 128, generator=torch.Generator().manual_seed(5)) * 0.1
    run = lambda g: kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None,
                                         x.cu_seqlens, init, True, groups=g)
    o1, s1 = run(1)
    og, sg = run(6)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
    assert rel_err(og, o1) < 1e-2 and rel_err(sg, s1) < 1e-2
    for o, st in ((o1, s1), (og, sg)):
        assert rel_err(o, o_ref) < BF16_TOL and rel_err(st, s_ref) < BF16_TOL
