"""The kernels against the float64 reference, on a GPU (run by scripts/gpu_check.sh).

Every check draws fresh random inputs, poisons outputs before the launch
(KDAGEN_POISON=1 fills every allocated output with NaN) and measures
||out - ref|| / ||ref||.
"""

from __future__ import annotations

import pytest
import torch

from kdagen import reference as ref
from kdagen.testing import BF16_TOL, PROLOGUE_TOL, conv_prologue_reference, make_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

DEV = "cuda"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("KDAGEN_POISON", "1")


def kernels(**fields):
    import kdagen
    from kdagen.jit import device_target

    return kdagen.load({"target": device_target(), **fields})


def lens_varlen(C: int) -> list[int]:
    return [1, C - 1, C, C + 1, 3 * C + 5, 0, 2 * C]


# ---- recurrent (decode) -------------------------------------------------------------------


@pytest.mark.parametrize("D,dtype,io,tol", [
    (128, torch.bfloat16, "bf16", 1e-2), (64, torch.bfloat16, "bf16", 1e-2),
    (128, torch.float32, "fp32", 1e-4), (64, torch.float32, "fp32", 1e-4),
    (256, torch.bfloat16, "bf16", 1e-2), (256, torch.float32, "fp32", 1e-4),
])
@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_recurrent(D, dtype, io, tol, N, gate, record):
    kern = kernels(head_dim=D, io_dtype=io, gate=gate, ops=["recurrent"])
    H, slots = 4, N + 5
    x = make_inputs([1] * N, H, D, dtype=dtype, gate=gate, seed=N * 7 + D)
    cache = torch.randn(slots, H, D, D, device=DEV) * 0.1
    perm = torch.randperm(slots)[:N].to(DEV)
    idx = perm.clone()
    if N > 1:
        idx[N // 2] = -1  # a padding entry: skipped
    before = cache.clone()
    sq = lambda t: t[0]  # [1, N, H, D] -> [N, H, D]
    out = kern.fused_recurrent_kda(sq(x.q), sq(x.k), sq(x.v), sq(x.g), sq(x.beta), x.A_log,
                                   x.dt_bias, None, x.lower_bound, cache, idx)
    init = before[perm.clamp_min(0)]
    o_ref, s_ref, _ = ref.recurrent_kda_reference(
        *x.args(), lower_bound=x.lower_bound, cu_seqlens=torch.arange(N + 1, device=DEV),
        initial_state=init)
    live = (idx >= 0)
    record(out=rel_err(out[live], o_ref[0][live]), state=rel_err(cache[idx[live]], s_ref[live]))
    assert rel_err(out[live], o_ref[0][live]) < tol
    assert torch.all(out[~live] == 0)
    assert rel_err(cache[idx[live]], s_ref[live]) < tol
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[idx[live]] = False
    assert torch.equal(cache[untouched], before[untouched])


# ---- prologue ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,dtype", [
    (dict(head_dim=128, chunk_size=64), torch.bfloat16),
    (dict(head_dim=64, chunk_size=64, io_dtype="fp16"), torch.float16),
    (dict(head_dim=128, chunk_size=32, block_width=64), torch.bfloat16),
])
@pytest.mark.parametrize("gate,strong", [("softplus", False), ("softplus", True),
                                         ("lower_bound", False), ("lower_bound", True)])
def test_prologue(spec, dtype, gate, strong, record):
    kern = kernels(**spec, gate=gate)
    D, C = spec["head_dim"], spec["chunk_size"]
    x = make_inputs(lens_varlen(C), 3, D, dtype=dtype, gate=gate, strong_decay=strong,
                    seed=D + C + strong, fused=True)
    got = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
    want = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=C)
    for name in ("qg", "w", "u", "kg_t", "aqk", "decay"):
        # the best an io-dtype output can be is the reference rounded to that dtype (fp16's
        # exponent range flushes strongly decayed qg rows to zero)
        best = want[name].to(got[name].dtype)
        err = rel_err(got[name], best)
        record(output=name, err=err)
        assert err < PROLOGUE_TOL[name], f"{name}: rel err {err:.3e}"


@pytest.mark.parametrize("spec,dtype", [
    (dict(head_dim=128, chunk_size=64), torch.bfloat16),
    (dict(head_dim=64, chunk_size=64, io_dtype="fp16"), torch.float16),
    (dict(head_dim=128, chunk_size=32, block_width=64), torch.bfloat16),
    (dict(head_dim=128, chunk_size=16), torch.bfloat16),
])
@pytest.mark.parametrize("gate,strong", [("softplus", True), ("lower_bound", False)])
def test_prologue_deferred_u(spec, dtype, gate, strong, record):
    """defer_u: akk = (I + L)^-1 Diag(beta) in place of u, and v never read (NaN here)."""
    kern = kernels(**spec, gate=gate)
    D, C = spec["head_dim"], spec["chunk_size"]
    x = make_inputs(lens_varlen(C), 3, D, dtype=dtype, gate=gate, strong_decay=strong,
                    seed=D + C + 5 * strong, fused=True)
    args = list(x.args())
    args[2] = torch.full_like(x.v, float("nan"))
    got = kern.fused_kda_prologue(*args, None, x.lower_bound, x.cu_seqlens, defer_u=True)
    want = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound,
                                        cu_seqlens=x.cu_seqlens, chunk_size=C, defer_u=True)
    assert "u" not in got
    for name in ("qg", "w", "akk", "kg_t", "aqk", "decay"):
        err = rel_err(got[name], want[name].to(got[name].dtype))
        record(output=name, err=err)
        assert err < PROLOGUE_TOL[name], f"{name}: rel err {err:.3e}"


# ---- chunk scan ---------------------------------------------------------------------------------


def _prologue_ref(x, C, dtype):
    p = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound, cu_seqlens=x.cu_seqlens,
                                     chunk_size=C)
    return {k: (v.float() if k == "decay" else v.to(dtype)).contiguous() for k, v in p.items()}


@pytest.mark.parametrize("spec,dtype", [
    (dict(head_dim=128, chunk_size=64), torch.bfloat16),
    (dict(head_dim=64, chunk_size=64, io_dtype="fp16"), torch.float16),
    (dict(head_dim=128, chunk_size=32, block_width=64), torch.bfloat16),
    (dict(head_dim=128, chunk_size=64, block_width=32), torch.bfloat16),
    (dict(head_dim=64, chunk_size=32, block_width=16, io_dtype="fp16"), torch.float16),
])
@pytest.mark.parametrize("groups", [1, 4])
def test_chunk_against_reference(spec, dtype, groups, record):
    kern = kernels(**spec)
    D, C = spec["head_dim"], spec["chunk_size"]
    x = make_inputs(lens_varlen(C) + [9 * C + 3], 2, D, dtype=dtype, seed=groups + D)
    p = _prologue_ref(x, C, dtype)
    N = x.cu_seqlens.numel() - 1
    init = torch.randn(N, 2, D, D, device=DEV) * 0.1
    out = torch.full_like(p["u"], float("nan"))
    o, fin = kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], out,
                                  None, x.cu_seqlens, init, True, groups=groups)
    o_ref, s_ref, _ = ref.chunk_scan_reference(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                               scale=D ** -0.5, cu_seqlens=x.cu_seqlens,
                                               chunk_size=C, initial_state=init)
    record(out=rel_err(o, o_ref), state=rel_err(fin, s_ref))
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(fin, s_ref) < BF16_TOL


@pytest.mark.parametrize("spec,dtype", [
    (dict(head_dim=128, chunk_size=64), torch.bfloat16),
    (dict(head_dim=64, chunk_size=64, io_dtype="fp16"), torch.float16),
    (dict(head_dim=128, chunk_size=64, block_width=32), torch.bfloat16),
    (dict(head_dim=128, chunk_size=16), torch.bfloat16),
])
@pytest.mark.parametrize("groups", [1, 4])
def test_chunk_forms_u_from_v(spec, dtype, groups, record):
    """The scan with akk: u = akk v per chunk, v a strided view (head stride D + 8)."""
    kern = kernels(**spec)
    D, C = spec["head_dim"], spec["chunk_size"]
    x = make_inputs(lens_varlen(C) + [9 * C + 3], 2, D, dtype=dtype, seed=groups + D + 1)
    p = _prologue_ref(x, C, dtype)
    a = ref.chunk_prologue_reference(*x.args(), lower_bound=x.lower_bound, cu_seqlens=x.cu_seqlens,
                                     chunk_size=C, defer_u=True)["akk"].to(dtype)
    buf = torch.full((*x.v.shape[:-1], D + 8), float("nan"), dtype=dtype, device=DEV)
    buf[..., :D] = x.v
    v = buf[..., :D]
    N = x.cu_seqlens.numel() - 1
    init = torch.randn(N, 2, D, D, device=DEV) * 0.1
    out = torch.full_like(p["u"], float("nan"))
    o, fin = kern.fused_kda_chunk(p["qg"], p["w"], v, p["kg_t"], p["aqk"], p["decay"], out,
                                  None, x.cu_seqlens, init, True, groups=groups, akk=a)
    o_ref, s_ref, _ = ref.chunk_scan_reference(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                               scale=D ** -0.5, cu_seqlens=x.cu_seqlens,
                                               chunk_size=C, initial_state=init)
    record(out=rel_err(o, o_ref), state=rel_err(fin, s_ref))
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(fin, s_ref) < BF16_TOL



@pytest.mark.parametrize("spec", [dict(head_dim=128), dict(head_dim=128, chunk_size=32, block_width=128),
                                  dict(head_dim=128, chunk_size=16, block_width=128)])
@pytest.mark.parametrize("gate,strong", [("softplus", False), ("softplus", True),
                                         ("lower_bound", True)])
@pytest.mark.parametrize("deferred", [False, True])
def test_end_to_end_against_token_recurrence(spec, gate, strong, deferred, record):
    """deferred: Kernels.prefill on aligned inputs (the prologue with defer_u, the scan
    forming u from v); else the contract's ops, with out aliasing u."""
    from kdagen.checks import rows16_ok

    kern = kernels(**spec, gate=gate)
    x = make_inputs(lens_varlen(64), 2, 128, gate=gate, strong_decay=strong, seed=11 + strong)
    N = x.cu_seqlens.numel() - 1
    init = torch.randn(N, 2, 128, 128, device=DEV) * 0.1
    if deferred:
        assert rows16_ok(x.v) and kern.scan_forms_u  # so prefill defers u
        o, fin = kern.prefill(*x.args(), None, x.lower_bound, x.cu_seqlens, init, True)
    else:
        p = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens)
        o, fin = kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"],
                                      None, x.cu_seqlens, init, True)  # out aliases u
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    assert torch.isfinite(o).all() and torch.isfinite(fin).all()
    record(out=rel_err(o, o_ref), state=rel_err(fin, s_ref))
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(fin, s_ref) < BF16_TOL


@pytest.mark.parametrize("groups", [1, 4])
def test_padded_tail_is_left_alone(groups, record, monkeypatch):
    """cu_seqlens ending before T (CUDA-graph padding): the sequences exact, the tail's
    output never written (poisoned), the tail's inputs (1e4) never read into a sequence."""
    monkeypatch.setenv("KDAGEN_POISON", "1")
    kern = kernels(head_dim=128, chunk_size=16, block_width=128, gate="lower_bound")
    x = make_inputs([16 * 40 + 5, 300, 7], 2, 128, gate="lower_bound", seed=21)
    T, pad = x.q.shape[1], 16 * 3 + 9
    grow = lambda t: torch.cat([t, torch.full((1, pad, *t.shape[2:]), 1e4, dtype=t.dtype, device=DEV)], 1)
    q, k, v, g, beta = (grow(t) for t in (x.q, x.k, x.v, x.g, x.beta))
    init = torch.randn(3, 2, 128, 128, device=DEV) * 0.1
    o, fin = kern.prefill(q, k, v, g, beta, x.A_log, x.dt_bias, None, x.lower_bound, x.cu_seqlens,
                          init, True, groups=groups)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    record(out=rel_err(o[:, :T], o_ref), state=rel_err(fin, s_ref))
    assert rel_err(o[:, :T], o_ref) < BF16_TOL and rel_err(fin, s_ref) < BF16_TOL
    assert o[:, T:].isnan().all()


def test_every_group_count_matches_single_walk(record):
    kern = kernels(head_dim=128)
    x = make_inputs([40 * 64 + 17, 64 * 9, 5], 2, 128, seed=5)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    init = torch.randn(3, 2, 128, 128, device=DEV) * 0.1
    base_o, base_s = kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                          torch.empty_like(p["u"]), None, x.cu_seqlens, init, True,
                                          groups=1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens,
                                                  initial_state=init)
    assert rel_err(base_o, o_ref) < BF16_TOL
    # (segments: pass one's, the heuristic's (None), one per group (0), fewer that end
    # between group starts)
    for g, seg in ((2, None), (3, None), (4, None), (5, None), (8, None), (8, 0), (8, 3), (16, None),
                   (16, 5), (32, None), (32, 1)):
        o = torch.full_like(p["u"], float("nan"))
        o, s = kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                    o, None, x.cu_seqlens, init, True, groups=g, segments=seg)
        record(groups=g, segments=seg, out_vs_single=rel_err(o, base_o), state_vs_single=rel_err(s, base_s),
               out_vs_ref=rel_err(o, o_ref), state_vs_ref=rel_err(s, s_ref))
        assert rel_err(o, base_o) < 1e-2, (g, seg)
        assert rel_err(s, base_s) < 1e-2, (g, seg)
        assert rel_err(o, o_ref) < BF16_TOL, (g, seg)
        assert rel_err(s, s_ref) < BF16_TOL, (g, seg)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_group_scan_rows_of_every_plane_count(heads, record):
    """The group scan's rows per block follow the N x H planes (resources.scan_rows_for:
    on 132 SMs 3 x 2 planes take 8 rows, 3 x 4 take 16, 3 x 8 take 32): grouped walks
    against the single walk and the token recurrence at each, outputs poisoned."""
    from kdagen import resources
    from kdagen.groups import num_compute_units

    kern = kernels(head_dim=128)
    x = make_inputs([64 * 12 + 17, 64 * 5, 5], heads, 128, seed=29 + heads)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    init = torch.randn(3, heads, 128, 128, device=DEV) * 0.1
    walk = lambda g, seg=None: kern.fused_kda_chunk(
        *(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")), torch.full_like(p["u"], float("nan")),
        None, x.cu_seqlens, init, True, groups=g, segments=seg)
    base_o, base_s = walk(1)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, initial_state=init)
    rows = resources.scan_rows_for(resources.scan_plans(128), 128, 3 * heads, num_compute_units(torch.device(DEV)))
    for g, seg in ((4, None), (8, 3)):
        o, s = walk(g, seg)
        record(heads=heads, scan_rows=rows, groups=g, out_vs_single=rel_err(o, base_o),
               state_vs_single=rel_err(s, base_s), out_vs_ref=rel_err(o, o_ref))
        assert rel_err(o, base_o) < 1e-2 and rel_err(s, base_s) < 1e-2, (rows, g, seg)
        assert rel_err(o, o_ref) < BF16_TOL and rel_err(s, s_ref) < BF16_TOL, (rows, g, seg)


PASS_ONE_SWITCHES = r"""
import json, sys, torch
import kdagen
from kdagen import reference as ref, resources
from kdagen.jit import device_target
from kdagen.render import render
from kdagen.testing import make_inputs, rel_err

width, vnew = int(sys.argv[1]), sys.argv[2] == "1"
resources.PASS_ONE_WIDTH, resources.PASS_ONE_WG_VNEW = width, vnew
kern = kdagen.load({"target": device_target(), "head_dim": 128, "chunk_size": 16,
                    "gate": "lower_bound"})
src = render(kern.spec).files["kernels.hip"]
assert ("struct ConfigPassOne" in src) == bool(width), "ConfigPassOne"
assert ("kPassOneWgVnew = true;" in src) == (vnew and kern.spec.target == "sm_90"), "kPassOneWgVnew"
x = make_inputs([16 * 300 + 9, 16 * 41, 7], 2, 128, gate="lower_bound", seed=37)
d = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=True)
init = torch.randn(3, 2, 128, 128, device="cuda") * 0.1
walk = lambda g, seg=None: kern.fused_kda_chunk(
    d["qg"], d["w"], x.v, d["kg_t"], d["aqk"], d["decay"], torch.full_like(x.v, float("nan")), None,
    x.cu_seqlens, init, True, groups=g, akk=d["akk"], segments=seg)
base_o, base_s = walk(1)
o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                              cu_seqlens=x.cu_seqlens, initial_state=init)
for g, seg in ((4, 0), (8, None), (8, 3)):
    o, s = walk(g, seg)
    print(json.dumps(dict(groups=g, segments=seg, out_vs_single=rel_err(o, base_o),
                          state_vs_single=rel_err(s, base_s), out_vs_ref=rel_err(o, o_ref),
                          state_vs_ref=rel_err(s, s_ref))), flush=True)
"""


@pytest.mark.parametrize("width, vnew", [(64, False), (0, True)])
def test_pass_one_switches_match_the_single_walk(width, vnew, record):
    """Pass one's prepared forms, off by default (docs/NOTES.md, session 25): blocks of 64
    rows (resources.PASS_ONE_WIDTH) and v_new per warpgroup (PASS_ONE_WG_VNEW, Hopper), in
    the shipped chunk-16 lower-bound variant with u formed from v: grouped walks (pass one
    per group and in segments with its lead) against the single walk and the token
    recurrence, outputs and workspace poisoned. In a process of its own: the variant's
    name is the shipped one's, whose ops this process may have loaded already (torch ops
    cannot be replaced in a process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, KDAGEN_POISON="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", PASS_ONE_SWITCHES, str(width), str(int(vnew))],
                         capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 3, run.stdout[-2000:]
    for r in rows:
        record(width=width, vnew=vnew, **r)
        assert r["out_vs_single"] < 1e-2 and r["state_vs_single"] < 1e-2, r
        assert r["out_vs_ref"] < BF16_TOL and r["state_vs_ref"] < BF16_TOL, r


# ---- paged state cache and checkpoints --------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 4])
def test_paged_state_cache(groups):
    kern = kernels(head_dim=128)
    C = 64
    x = make_inputs([C * 12 + 3, C, 5, C * 20], 2, 128, seed=21)
    N, slots = 4, 9
    cache = torch.randn(slots, 2, 128, 128, device=DEV) * 0.1
    before = cache.clone()
    idx = torch.tensor([7, 2, 4, 0], dtype=torch.int32, device=DEV)
    has = torch.tensor([True, False, True, True], device=DEV)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    out, fin = kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                                    torch.empty_like(p["u"]), None, x.cu_seqlens, None, False,
                                    state_cache=cache, state_indices=idx, has_initial_state=has,
                                    groups=groups)
    assert fin is None
    init = before[idx.long()] * has[:, None, None, None]
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens,
                                                  initial_state=init)
    assert rel_err(out, o_ref) < BF16_TOL
    assert rel_err(cache[idx.long()], s_ref) < BF16_TOL
    others = [i for i in range(slots) if i not in idx.tolist()]
    assert torch.equal(cache[others], before[others])


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_checkpoints(groups, paged):
    kern = kernels(head_dim=128)
    C = 64
    x = make_inputs([C * 10 + 7, C * 3, C * 16], 2, 128, seed=31)
    offs = torch.tensor([C * 4, 0, C * 16], dtype=torch.int32, device=DEV)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    rows = 6
    ck = torch.full((rows, 2, 128, 128), float("nan"), device=DEV)
    ck_idx = torch.tensor([5, 1, 2], dtype=torch.int32, device=DEV) if paged else None
    kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                         torch.empty_like(p["u"]), None, x.cu_seqlens, None, True,
                         checkpoint_state=ck, checkpoint_offsets=offs,
                         checkpoint_state_indices=ck_idx, groups=groups)
    _, _, ck_ref = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens,
                                               checkpoint_offsets=offs)
    r = [5, 1, 2] if paged else [0, 1, 2]
    assert rel_err(ck[r[0]], ck_ref[0]) < BF16_TOL
    assert rel_err(ck[r[2]], ck_ref[2]) < BF16_TOL
    assert torch.isnan(ck[r[1]]).all()  # offset 0: no export


def test_misaligned_checkpoint_refused_before_launch():
    kern = kernels(head_dim=128)
    x = make_inputs([200], 2, 128, seed=3)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    ck = torch.zeros(1, 2, 128, 128, device=DEV)
    with pytest.raises(ValueError, match="checkpoint_offsets"):
        kern.fused_kda_chunk(*(p[k] for k in ("qg", "w", "u", "kg_t", "aqk", "decay")),
                             torch.empty_like(p["u"]), None, x.cu_seqlens, None, True,
                             checkpoint_state=ck,
                             checkpoint_offsets=torch.tensor([65], dtype=torch.int32, device=DEV))
    assert torch.all(ck == 0)


# ---- fused conv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("has_state", [False, True, None], ids=["no-history", "history", "flags-none"])
def test_fused_conv(has_state):
    """None for conv_has_initial_state: no sequence reads its row's history (vLLM's
    convention), and every addressed row is still updated."""
    W, D, H = 4, 128, 2
    kern = kernels(head_dim=D, conv_width=W)
    x = make_inputs([1, 2, 63, 130], H, D, seed={False: 41, True: 42, None: 43}[has_state])
    N, slots = 4, 6
    wgt = torch.randn(3 * H * D, W, device=DEV) * 0.5
    state = torch.randn(slots, 3 * H * D, W - 1, device=DEV)
    before = state.clone()
    idx = torch.tensor([3, 0, -1, 5], dtype=torch.int32, device=DEV)
    has = None if has_state is None else torch.full((N,), has_state, device=DEV)
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens, conv_weight=wgt,
                                conv_state=state, conv_state_indices=idx,
                                conv_has_initial_state=has)
    want, new_state = conv_prologue_reference(x, wgt, before, idx, has, 64)
    for name in ("qg", "w", "u", "kg_t", "aqk"):
        assert rel_err(p[name], want[name]) < BF16_TOL, name
    assert rel_err(state, new_state) < 1e-2
    assert torch.equal(state[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("fields", [dict(chunk_size=16, gate="lower_bound"), dict(chunk_size=64),
                                    dict(block_width=32), dict(chunk_size=32, block_width=64)],
                         ids=["c16", "c64", "bv32", "c32-bv64"])
def test_walk_residency_is_the_runtimes_and_meets_the_plan(fields):
    """The chunk op's occupancy query (the torch binding's chunk_residency): blocks of the
    walks with outputs and of pass one one SM holds, as compiled. On NVIDIA the launch
    bound makes ptxas fit the plan's blocks, so the runtime's count is at least the plan's."""
    from kdagen.groups import planned_residency

    kern = kernels(head_dim=128, **fields)
    got = kern.walk_residency(torch.device(DEV))
    raw = tuple(int(n) for n in kern._residency_query())  # the binding's op, on this device
    assert all(n > 0 for n in raw), raw  # the runtime told, for both walks
    planned = planned_residency(kern.spec)
    print(f"{kern.spec.name}: runtime {raw}, plan {planned}")
    assert got == raw and all(r >= p for r, p in zip(raw, planned)), (raw, planned)


# ---- the whole layer against FLA ------------------------------------------------------------------


def test_kda_forward_dense_batch_equals_the_packed_call(record):
    """[B, T, ...] without cu_seqlens (the bookkeeping from the shape, no host read) gives
    what the packed batch with cu_seqlens gives, bit for bit."""
    import kdagen

    B, T = 4, 1000
    x = make_inputs([T] * B, 4, 128, gate="lower_bound", seed=52)
    init = torch.randn(B, 4, 128, 128, device=DEV) * 0.1
    kw = dict(initial_state=init, output_final_state=True, lower_bound=x.lower_bound, state_v_first=True,
              A_log=x.A_log, dt_bias=x.dt_bias, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    batch = lambda t: t.reshape(B, T, *t.shape[2:])
    o, s = kdagen.kda_forward(*(batch(t) for t in (x.q, x.k, x.v, x.g, x.beta)), **kw)
    o_p, s_p = kdagen.kda_forward(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=x.cu_seqlens, **kw)
    assert torch.equal(o.reshape(o_p.shape), o_p) and torch.equal(s, s_p)
    o_ref, _, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=x.lower_bound,
                                              cu_seqlens=x.cu_seqlens, initial_state=init)
    record(out=rel_err(o_p, o_ref))
    assert rel_err(o_p, o_ref) < BF16_TOL


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_kda_forward_matches_fla(gate, record):
    fla_kda = pytest.importorskip("fla.ops.kda")
    import kdagen

    x = make_inputs([1000, 64, 63, 2048], 4, 128, gate=gate, seed=51)
    N = 4
    init = torch.randn(N, 4, 128, 128, device=DEV) * 0.1
    in_kernel = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True)
    scale = 0.7 * 128 ** -0.5  # not the default: every kernel must use the one given
    o, s = kdagen.kda_forward(x.q, x.k, x.v, x.g, x.beta, scale, initial_state=init, output_final_state=True,
                              lower_bound=x.lower_bound, state_v_first=True, cu_seqlens=x.cu_seqlens,
                              A_log=x.A_log, dt_bias=x.dt_bias, **in_kernel)
    # FLA's default K-first state: the same call with the state transposed both ways
    o_kf, s_kf = kdagen.kda_forward(x.q, x.k, x.v, x.g, x.beta, scale, initial_state=init.transpose(-1, -2),
                                    output_final_state=True, lower_bound=x.lower_bound,
                                    cu_seqlens=x.cu_seqlens, A_log=x.A_log, dt_bias=x.dt_bias,
                                    **in_kernel)
    assert torch.equal(o_kf, o) and torch.equal(s_kf, s.transpose(-1, -2))
    of, sf = fla_kda.chunk_kda(x.q, x.k, x.v, x.g, x.beta, scale, initial_state=init,
                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               lower_bound=x.lower_bound, state_v_first=True,
                               cu_seqlens=x.cu_seqlens.long(), A_log=x.A_log, dt_bias=x.dt_bias)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), scale=scale, lower_bound=x.lower_bound,
                                                  cu_seqlens=x.cu_seqlens, initial_state=init)
    e_ours, e_fla = rel_err(o, o_ref), rel_err(of, o_ref)
    print(f"\n[{gate}] kdagen vs ref {e_ours:.2e}, fla vs ref {e_fla:.2e}, kdagen vs fla "
          f"{rel_err(o, of):.2e}, state {rel_err(s, s_ref):.2e} / {rel_err(sf, s_ref):.2e}")
    record(kdagen_vs_ref=e_ours, fla_vs_ref=e_fla, kdagen_vs_fla=rel_err(o, of),
           state_kdagen=rel_err(s, s_ref), state_fla=rel_err(sf, s_ref))
    assert e_ours < BF16_TOL
    assert rel_err(o, of) < 3e-2
    assert rel_err(s, sf) < 3e-2
