"""CPU tests of the float64 reference (``kdagen.reference``) and the varlen helpers.

The token recurrence, the chunked form (prologue + scan) and the chunk-group
form are independent formulations of the same map; they must agree to float64
rounding on random, non-trivial inputs (varlen batches with edge lengths,
initial states, strong decay, both gate forms).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdagen.reference import (
    causal_conv_reference,
    chunk_kda_reference,
    chunk_prologue_reference,
    chunk_scan_reference,
    group_scan_reference,
    kda_gate,
    l2norm,
    recurrent_kda_reference,
)
from kdagen.varlen import chunk_counts, prepare_chunk_indices, prepare_chunk_offsets

F64 = torch.float64
TOL = 1e-9


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``|a - b| / |b|``; ``b`` must not be zero."""
    nb = b.norm().item()
    assert nb > 0, "reference tensor is zero: the comparison would be vacuous"
    return (a - b).norm().item() / nb


def cu_from_lens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def make_inputs(
    lens: list[int],
    *,
    H: int = 2,
    K: int = 16,
    V: int = 16,
    seed: int = 0,
    gate: str = "softplus",
    strong: bool = False,
) -> dict:
    """Random KDA layer inputs for a varlen batch (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*shape, s=1.0):
        return s * torch.randn(*shape, generator=gen, dtype=F64)

    if strong and gate == "extreme":
        # softplus form with exp(A_log) = 3: g ~ -60 per step, so exp(G) underflows
        # float64 inside a 16-row chunk; only exp(G_i - G_j) as a difference survives.
        raw_g = 20.5 + r(1, T, H, K, s=0.3)
        A_log = torch.full((H,), math.log(3.0), dtype=F64)
        dt_bias = r(H * K, s=0.05)
    elif strong and gate == "softplus":
        # A_log = 0 and x = raw_g + dt_bias ~ 20..21: g ~ -20 per step; some x > 20
        # take softplus's linear branch.
        raw_g = 20.5 + r(1, T, H, K, s=0.3)
        A_log = torch.zeros(H, dtype=F64)
        dt_bias = r(H * K, s=0.05)
    elif strong:
        # lower_bound form saturated: g ~ lower_bound = -5 per step
        raw_g = 3.0 + r(1, T, H, K, s=0.3)
        A_log = torch.full((H,), 1.0, dtype=F64)
        dt_bias = r(H * K, s=0.05)
    else:
        raw_g = r(1, T, H, K)
        A_log = r(H, s=0.5)
        dt_bias = r(H * K, s=0.5)
    return dict(
        q=r(1, T, H, K),
        k=r(1, T, H, K),
        v=r(1, T, H, V),
        raw_g=raw_g,
        raw_beta=r(1, T, H),
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=-5.0 if gate == "lower_bound" else None,
        cu_seqlens=cu_from_lens(lens),
    )


def rand_state(N: int, H: int, V: int, K: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(N, H, V, K, generator=gen, dtype=F64)


def edge_lens(C: int) -> list[int]:
    return [1, C - 1, C, C + 1, 0, 2 * C + 3]


# --------------------------------------------------------------------------- #
# varlen helpers
# --------------------------------------------------------------------------- #


def brute_chunks(lens: list[int], C: int):
    counts = [-(-n // C) for n in lens]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    indices = [(n, c) for n, cnt in enumerate(counts) for c in range(cnt)]
    return counts, offsets, indices


def test_varlen_helpers_explicit():
    C = 8
    cu = cu_from_lens([0, 1, 7, 8, 9, 0, 19])
    assert chunk_counts(cu, C).tolist() == [0, 1, 1, 1, 2, 0, 3]
    off = prepare_chunk_offsets(cu, C)
    assert off.dtype == torch.int32 and off.tolist() == [0, 0, 1, 2, 3, 5, 5, 8]
    idx = prepare_chunk_indices(cu, C)
    assert idx.dtype == torch.int32 and idx.shape == (8, 2)
    assert [tuple(r) for r in idx.tolist()] == [
        (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (6, 0), (6, 1), (6, 2)
    ]
    assert torch.equal(prepare_chunk_indices(cu, C, num_chunks=8), idx)
    assert chunk_counts(cu, C).dtype == torch.int32


@pytest.mark.parametrize("seed", range(4))
def test_varlen_helpers_random(seed):
    gen = torch.Generator().manual_seed(seed)
    C = [4, 8, 16, 64][seed]
    lens = torch.randint(0, 3 * C, (7,), generator=gen).tolist()
    lens[seed % 7] = 0
    cu = cu_from_lens(lens).to(torch.int64)
    counts, offsets, indices = brute_chunks(lens, C)
    assert chunk_counts(cu, C).tolist() == counts
    assert prepare_chunk_offsets(cu, C).tolist() == offsets
    assert [tuple(r) for r in prepare_chunk_indices(cu, C).tolist()] == indices


def test_varlen_helpers_empty():
    for cu in (torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)):
        n = cu.numel() - 1
        assert chunk_counts(cu, 8).tolist() == [0] * n
        assert prepare_chunk_offsets(cu, 8).tolist() == [0] * (n + 1)
        assert prepare_chunk_indices(cu, 8).shape == (0, 2)


def test_varlen_helpers_reject_bad_args():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_counts(cu, bad)
    with pytest.raises(TypeError, match="cu_seqlens"):
        prepare_chunk_offsets(torch.tensor([0.0, 3.0]), 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prepare_chunk_indices(torch.zeros(2, 2, dtype=torch.int32), 8)


# --------------------------------------------------------------------------- #
# elementwise pieces
# --------------------------------------------------------------------------- #


def test_l2norm():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=F64)
    y = l2norm(x)
    assert torch.allclose(y[0], torch.tensor([3.0, 4.0], dtype=F64) / math.sqrt(25 + 1e-6))
    assert torch.equal(y[1], torch.zeros(2, dtype=F64))
    assert l2norm(x.float()).dtype == F64


def test_kda_gate_forms():
    H, K = 2, 3
    raw = torch.tensor([[[-3.0, 0.5, 19.0], [25.0, -40.0, 1.0]]], dtype=F64)  # [1, H, K]
    A_log = torch.tensor([0.3, -0.7], dtype=F64)
    dt_bias = torch.tensor([[0.1, 0.2, 0.5], [-1.0, 0.0, 2.0]], dtype=F64)
    x = raw + dt_bias
    a = torch.exp(A_log)[:, None]
    g = kda_gate(raw, A_log, dt_bias, None)
    sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert torch.allclose(g, -a * sp, rtol=1e-14, atol=0)
    assert g[0, 1, 0].item() == -math.exp(-0.7) * 24.0  # linear branch, exactly
    assert torch.equal(kda_gate(raw, A_log, dt_bias.reshape(-1), None), g)
    gl = kda_gate(raw, A_log, dt_bias, -5.0)
    assert torch.allclose(gl, -5.0 / (1 + torch.exp(-a * x)), rtol=1e-14, atol=0)
    assert bool((gl < 0).all() and (gl > -5).all() and (g < 0).all())
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(raw, A_log, torch.zeros(5, dtype=F64), None)


# --------------------------------------------------------------------------- #
# the recurrence itself, against dense matrices
# --------------------------------------------------------------------------- #


def test_recurrence_against_dense_matrices():
    """Two sequences, K != V: the recurrence written with explicit K x K matrices."""
    inp = make_inputs([3, 2], H=2, K=8, V=4, seed=7)
    h0 = rand_state(2, 2, 4, 8, seed=7)
    scale = 0.37
    o, final, _ = recurrent_kda_reference(
        **{k: inp[k] for k in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")},
        scale=scale, lower_bound=None, cu_seqlens=inp["cu_seqlens"], initial_state=h0,
    )
    assert o.shape == (1, 5, 2, 4) and final.shape == (2, 2, 4, 8) and o.dtype == F64
    g = kda_gate(inp["raw_g"][0], inp["A_log"], inp["dt_bias"], None)
    for n, (bos, eos) in enumerate([(0, 3), (3, 5)]):
        for h in range(2):
            S = h0[n, h].T.clone()  # K x V
            for t in range(bos, eos):
                kk = inp["k"][0, t, h] / torch.sqrt((inp["k"][0, t, h] ** 2).sum() + 1e-6)
                qq = inp["q"][0, t, h] / torch.sqrt((inp["q"][0, t, h] ** 2).sum() + 1e-6)
                b = torch.sigmoid(inp["raw_beta"][0, t, h])
                P = torch.eye(8, dtype=F64) - b * torch.outer(kk, kk)
                S = P @ torch.diag(torch.exp(g[t, h])) @ S + b * torch.outer(kk, inp["v"][0, t, h])
                assert torch.allclose(o[0, t, h], scale * S.T @ qq, rtol=1e-12, atol=1e-14)
            assert torch.allclose(final[n, h], S.T, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- #
# chunked form == recurrence
# --------------------------------------------------------------------------- #

ARGS = ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias")


def run_both(inp, C, h0=None, scale=None, offsets=None):
    a = {k: inp[k] for k in ARGS}
    kw = dict(scale=scale, lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"],
              initial_state=h0, checkpoint_offsets=offsets)
    rec = recurrent_kda_reference(**a, **kw)
    chk = chunk_kda_reference(**a, **kw, chunk_size=C)
    return rec, chk


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("C", [8, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(gate, C, with_state):
    lens = edge_lens(C)
    inp = make_inputs(lens, gate=gate, seed=C + with_state)
    h0 = rand_state(len(lens), 2, 16, 16, seed=C) if with_state else None
    (o_r, s_r, _), (o_c, s_c, _) = run_both(inp, C, h0)
    assert rel(o_c, o_r) < TOL
    assert rel(s_c, s_r) < TOL
    # zero-length sequence (index 4) returns its initial state unchanged
    expect = h0[4] if with_state else torch.zeros(2, 16, 16, dtype=F64)
    assert torch.equal(s_c[4], expect) and torch.equal(s_r[4], expect)


def test_chunk_matches_recurrent_k_ne_v_and_scale():
    lens = [5, 0, 17, 8]
    inp = make_inputs(lens, H=3, K=32, V=16, seed=11)
    h0 = rand_state(4, 3, 16, 32, seed=11)
    (o_r, s_r, _), (o_c, s_c, _) = run_both(inp, 8, h0, scale=0.7)
    assert o_r.shape == (1, 30, 3, 16) and s_r.shape == (4, 3, 16, 32)
    assert rel(o_c, o_r) < TOL and rel(s_c, s_r) < TOL


@pytest.mark.parametrize("gate", ["softplus", "lower_bound", "extreme"])
def test_strong_decay(gate):
    C = 16
    lens = [C + 1, 2 * C, 3]
    inp = make_inputs(lens, gate=gate, strong=True, seed=3)
    g = kda_gate(inp["raw_g"][0], inp["A_log"], inp["dt_bias"], inp["lower_bound"])
    if gate == "softplus":
        assert g.max().item() < -19.0 and g.min().item() > -23.0  # ~ -20 per step
    elif gate == "extreme":
        assert g.max().item() < -57.0  # 16 steps: exp(G) < 1e-390 underflows float64
    else:
        assert g.max().item() < -4.5  # saturated near lower_bound = -5
    h0 = rand_state(3, 2, 16, 16, seed=3)
    ops = chunk_prologue_reference(**{k: inp[k] for k in ARGS}, scale=None,
                                   lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"],
                                   chunk_size=C)
    for name, t in ops.items():
        assert torch.isfinite(t).all(), name
    (o_r, s_r, _), (o_c, s_c, _) = run_both(inp, C, h0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel(o_c, o_r) < TOL and rel(s_c, s_r) < TOL


def test_float32_inputs_give_float64():
    inp = make_inputs([5, 9], seed=5)
    a32 = {k: inp[k].float() for k in ARGS}
    o, s, _ = chunk_kda_reference(**a32, lower_bound=None, cu_seqlens=inp["cu_seqlens"], chunk_size=8)
    o2, _, _ = recurrent_kda_reference(**{k: v.double() for k, v in a32.items()},
                                       cu_seqlens=inp["cu_seqlens"])
    assert o.dtype == F64 and s.dtype == F64 and rel(o, o2) < TOL


# --------------------------------------------------------------------------- #
# indexing: sequences are independent and in order
# --------------------------------------------------------------------------- #


def split_seq(x: torch.Tensor, cu: list[int], n: int) -> torch.Tensor:
    return x[:, cu[n]:cu[n + 1]]


def test_swapping_initial_states_changes_output():
    C = 8
    lens = [9, 12, 5]
    inp = make_inputs(lens, seed=21)
    h0 = rand_state(3, 2, 16, 16, seed=21)
    h0_sw = h0[[1, 0, 2]]
    cu = inp["cu_seqlens"].tolist()
    for fn in (recurrent_kda_reference, chunk_kda_reference):
        extra = {} if fn is recurrent_kda_reference else {"chunk_size": C}
        kw = dict(lower_bound=None, cu_seqlens=inp["cu_seqlens"], **extra)
        o, s, _ = fn(**{k: inp[k] for k in ARGS}, initial_state=h0, **kw)
        o2, s2, _ = fn(**{k: inp[k] for k in ARGS}, initial_state=h0_sw, **kw)
        for n in (0, 1):
            assert rel(split_seq(o2, cu, n), split_seq(o, cu, n)) > 1e-3
            assert rel(s2[n], s[n]) > 1e-3
        assert torch.equal(split_seq(o2, cu, 2), split_seq(o, cu, 2))
        assert torch.equal(s2[2], s[2])


def test_batch_equals_sequences_run_alone():
    """Each sequence of a varlen batch gives the same result as when run alone."""
    C = 8
    lens = [C + 3, 0, 1, 2 * C]
    inp = make_inputs(lens, seed=31)
    h0 = rand_state(4, 2, 16, 16, seed=31)
    cu = inp["cu_seqlens"].tolist()
    o, s, _ = chunk_kda_reference(**{k: inp[k] for k in ARGS}, lower_bound=None,
                                  cu_seqlens=inp["cu_seqlens"], chunk_size=C, initial_state=h0)
    for n in range(4):
        one = {k: (split_seq(inp[k], cu, n) if inp[k].dim() >= 3 else inp[k]) for k in ARGS}
        o1, s1, _ = recurrent_kda_reference(**one, cu_seqlens=torch.tensor([0, lens[n]]),
                                            initial_state=h0[n : n + 1])
        assert torch.allclose(split_seq(o, cu, n), o1, rtol=1e-10, atol=1e-12)
        assert rel(s[n], s1[0]) < TOL


def test_chunk_numbering_follows_prepare_chunk_indices():
    C = 8
    lens = [C + 1, 0, 3, 2 * C + 2]
    inp = make_inputs(lens, seed=41)
    cu = inp["cu_seqlens"]
    ops = chunk_prologue_reference(**{k: inp[k] for k in ARGS}, lower_bound=None,
                                   cu_seqlens=cu, chunk_size=C)
    idx = prepare_chunk_indices(cu, C)
    assert ops["kg_t"].shape[0] == idx.shape[0] == ops["decay"].shape[0]
    cl = cu.tolist()
    for row, (n, c) in enumerate(idx.tolist()):
        one = {k: (split_seq(inp[k], cl, n) if inp[k].dim() >= 3 else inp[k]) for k in ARGS}
        alone = chunk_prologue_reference(**one, lower_bound=None, chunk_size=C)
        assert torch.allclose(ops["kg_t"][row], alone["kg_t"][c], rtol=1e-13, atol=0)
        assert torch.allclose(ops["decay"][row], alone["decay"][c], rtol=1e-13, atol=0)


# --------------------------------------------------------------------------- #
# prologue structure
# --------------------------------------------------------------------------- #


def test_prologue_structure():
    C = 8
    lens = [C + 3, C, 5]
    scale = 0.41
    inp = make_inputs(lens, seed=51)
    cu = inp["cu_seqlens"]
    ops = chunk_prologue_reference(**{k: inp[k] for k in ARGS}, scale=scale, lower_bound=None,
                                   cu_seqlens=cu, chunk_size=C)
    T, H, K = 24, 2, 16
    assert ops["qg"].shape == (1, T, H, K) and ops["w"].shape == (1, T, H, K)
    assert ops["u"].shape == (1, T, H, 16) and ops["aqk"].shape == (1, T, H, C)
    assert ops["kg_t"].shape == (4, H, K, C) and ops["decay"].shape == (4, H, K)
    qh, kh = l2norm(inp["q"][0]), l2norm(inp["k"][0])
    g = kda_gate(inp["raw_g"][0], inp["A_log"], inp["dt_bias"], None)
    chunks = [(0, 8), (8, 11), (11, 19), (19, 24)]
    for ci, (s, e) in enumerate(chunks):
        n = e - s
        G = g[s:e].cumsum(0)  # [n, H, K]
        # partial chunks: kg_t columns past the end are exactly zero, the others are not
        assert torch.equal(ops["kg_t"][ci, :, :, n:], torch.zeros(H, K, C - n, dtype=F64))
        assert (ops["kg_t"][ci, :, :, :n].abs().sum(1) > 0).all()
        assert torch.allclose(ops["kg_t"][ci, :, :, n - 1], kh[e - 1], rtol=1e-14, atol=0)
        assert torch.allclose(ops["decay"][ci], torch.exp(G[-1]), rtol=1e-13, atol=0)
        assert torch.allclose(ops["qg"][0, s:e], qh[s:e] * torch.exp(G), rtol=1e-13, atol=0)
        for i in range(n):
            row = ops["aqk"][0, s + i]  # [H, C]
            assert torch.equal(row[:, i + 1 :], torch.zeros(H, C - i - 1, dtype=F64))
            diag = scale * (qh[s + i] * kh[s + i]).sum(-1)
            assert torch.allclose(row[:, i], diag, rtol=1e-12, atol=1e-15)
            if i > 0:
                assert (row[:, :i] != 0).all()
        # chunks restart at sequence boundaries: qg of a chunk's first row = q_hat exp(g)
        assert torch.allclose(ops["qg"][0, s], qh[s] * torch.exp(g[s]), rtol=1e-14, atol=0)
        # w and u solve (I + L) X = beta * (k exp G | v)
        b = torch.sigmoid(inp["raw_beta"][0, s:e])  # [n, H]
        for h in range(H):
            L = torch.zeros(n, n, dtype=F64)
            for i in range(n):
                for j in range(i):
                    L[i, j] = b[i, h] * (kh[s + i, h] * kh[s + j, h] * torch.exp(G[i, h] - G[j, h])).sum()
            A = torch.eye(n, dtype=F64) + L
            assert torch.allclose(A @ ops["w"][0, s:e, h], b[:, h, None] * kh[s:e, h] * torch.exp(G[:, h]),
                                  rtol=1e-12, atol=1e-14)
            assert torch.allclose(A @ ops["u"][0, s:e, h], b[:, h, None] * inp["v"][0, s:e, h],
                                  rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- #
# chunk groups
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_group_scan_matches_single_walk(groups):
    C = 8
    lens = [5 * C, 0, 3 * C - 2, 1, 2 * C + 1]
    inp = make_inputs(lens, seed=61)
    h0 = rand_state(len(lens), 2, 16, 16, seed=61)
    cu = inp["cu_seqlens"]
    ops = chunk_prologue_reference(**{k: inp[k] for k in ARGS}, lower_bound=None,
                                   cu_seqlens=cu, chunk_size=C)
    scale = 16 ** -0.5
    o1, s1, _ = chunk_scan_reference(**ops, scale=scale, cu_seqlens=cu, chunk_size=C, initial_state=h0)
    og, sg = group_scan_reference(**ops, scale=scale, cu_seqlens=cu, chunk_size=C, groups=groups,
                                  initial_state=h0)
    assert rel(og, o1) < TOL and rel(sg, s1) < TOL
    assert torch.equal(sg[1], h0[1])


# --------------------------------------------------------------------------- #
# checkpoints
# --------------------------------------------------------------------------- #


def prefix_state(inp, h0, n: int, upto: int) -> torch.Tensor:
    """Final state of sequence n truncated to its first `upto` tokens, run alone."""
    cu = inp["cu_seqlens"].tolist()
    one = {k: (inp[k][:, cu[n] : cu[n] + upto] if inp[k].dim() >= 3 else inp[k]) for k in ARGS}
    _, s, _ = recurrent_kda_reference(**one, lower_bound=inp["lower_bound"],
                                      cu_seqlens=torch.tensor([0, upto]),
                                      initial_state=None if h0 is None else h0[n : n + 1])
    return s[0]


def test_checkpoints_chunked():
    C = 8
    lens = [3 * C + 2, C, 2 * C + 5, 5, 0, 2 * C]
    offsets = torch.tensor([2 * C, C, C, 0, 0, 3 * C], dtype=torch.int32)  # last: past the end
    inp = make_inputs(lens, gate="lower_bound", seed=71)
    h0 = rand_state(len(lens), 2, 16, 16, seed=71)
    (o_r, s_r, ck_r), (o_c, s_c, ck_c) = run_both(inp, C, h0, offsets=offsets)
    assert ck_c.shape == (6, 2, 16, 16)
    for n in range(3):
        expect = prefix_state(inp, h0, n, int(offsets[n]))
        assert rel(ck_c[n], expect) < TOL and rel(ck_r[n], expect) < TOL
    assert rel(ck_c[1], s_c[1]) < TOL  # offset == length: the final state
    for n in (3, 4, 5):  # offset 0, and offset past the end: no snapshot
        assert torch.equal(ck_c[n], torch.zeros(2, 16, 16, dtype=F64))
        assert torch.equal(ck_r[n], torch.zeros(2, 16, 16, dtype=F64))
    assert rel(o_c, o_r) < TOL and rel(s_c, s_r) < TOL
    (_, _, none_r), (_, _, none_c) = run_both(inp, C, h0)
    assert none_r is None and none_c is None


def test_checkpoints_recurrent_any_offset():
    lens = [11, 6]
    inp = make_inputs(lens, seed=81)
    offsets = torch.tensor([3, 6])
    _, s, ck = recurrent_kda_reference(**{k: inp[k] for k in ARGS}, cu_seqlens=inp["cu_seqlens"],
                                       checkpoint_offsets=offsets)
    assert rel(ck[0], prefix_state(inp, None, 0, 3)) < TOL
    assert torch.equal(ck[1], s[1])


def test_checkpoint_offsets_must_be_chunk_multiples():
    C = 8
    inp = make_inputs([20, 9], seed=91)
    ops = chunk_prologue_reference(**{k: inp[k] for k in ARGS}, cu_seqlens=inp["cu_seqlens"], chunk_size=C)
    with pytest.raises(ValueError, match="multiples"):
        chunk_scan_reference(**ops, scale=0.25, cu_seqlens=inp["cu_seqlens"], chunk_size=C,
                             checkpoint_offsets=torch.tensor([C, 3]))
    with pytest.raises(ValueError, match="checkpoint_offsets"):
        chunk_scan_reference(**ops, scale=0.25, cu_seqlens=inp["cu_seqlens"], chunk_size=C,
                             checkpoint_offsets=torch.tensor([-C, 0]))


def test_reference_rejects_bad_arguments():
    inp = make_inputs([4, 4], seed=1)
    a = {k: inp[k] for k in ARGS}
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent_kda_reference(**a, cu_seqlens=torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent_kda_reference(**a, cu_seqlens=torch.tensor([0, 5, 4, 8]))
    with pytest.raises(ValueError, match="raw_beta"):
        recurrent_kda_reference(**{**a, "raw_beta": inp["raw_beta"][..., None]}, cu_seqlens=inp["cu_seqlens"])
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda_reference(**a, cu_seqlens=inp["cu_seqlens"], initial_state=torch.zeros(2, 2, 16, 8))
    ops = chunk_prologue_reference(**a, cu_seqlens=inp["cu_seqlens"], chunk_size=8)
    with pytest.raises(ValueError, match="kg_t"):
        chunk_scan_reference(**ops, scale=0.25, cu_seqlens=torch.tensor([0, 1, 2, 8]), chunk_size=8)


# --------------------------------------------------------------------------- #
# causal conv
# --------------------------------------------------------------------------- #


def conv_expected(x, weight, lens, state, idx, init):
    """Per sequence: torch conv1d over [prefix ; x], and the explicit state slice."""
    W = weight.shape[1]
    Ch = x.shape[-1]
    ys, new = [], None if state is None else state.clone()
    start = 0
    for n, L in enumerate(lens):
        xs = x[0, start : start + L].to(F64)
        start += L
        use = state is not None and idx[n] >= 0 and init[n]
        prefix = state[idx[n]].to(F64).T if use else torch.zeros(W - 1, Ch, dtype=F64)
        full = torch.cat([prefix, xs], 0)  # [W-1+L, Ch]
        if L > 0:  # conv1d refuses an output of length 0
            y = F.conv1d(full.T[None], weight.to(F64)[:, None, :], groups=Ch)[0].T  # [L, Ch]
            ys.append(F.silu(y))
        if new is not None and idx[n] >= 0:
            new[idx[n]] = full[-(W - 1) :].T
    return torch.cat(ys, 0)[None], new


@pytest.mark.parametrize("W", [2, 4])
def test_causal_conv_with_state(W):
    gen = torch.Generator().manual_seed(W)
    Ch, slots = 6, 7
    lens = [W - 1, 1, 0, 10, 1, 0, 5]
    idx = [4, -1, 2, 0, 5, 3, 1]  # row 6 (= -1 wrapped) is never addressed
    init = [True, True, False, True, True, True, True]
    x = torch.randn(1, sum(lens), Ch, generator=gen, dtype=F64)
    weight = torch.randn(Ch, W, generator=gen, dtype=F64)
    state = torch.randn(slots, Ch, W - 1, generator=gen, dtype=F64)
    before = state.clone()
    y, new = causal_conv_reference(
        x, weight, cu_seqlens=cu_from_lens(lens), conv_state=state,
        conv_state_indices=torch.tensor(idx, dtype=torch.int32),
        has_initial_state=torch.tensor(init),
    )
    y_ref, new_ref = conv_expected(x, weight, lens, state, idx, init)
    assert y.dtype == F64 and y.shape == x.shape
    assert torch.allclose(y, y_ref, rtol=1e-13, atol=1e-15)
    assert torch.equal(new, new_ref)
    assert torch.equal(state, before)  # the input state is not modified
    assert torch.equal(new[6], state[6])  # only the negative index points here
    assert torch.equal(new[3], state[3])  # zero-length sequence with its state: unchanged
    assert torch.equal(new[2], torch.zeros(Ch, W - 1, dtype=F64))  # zero length, no initial state
    # W-1 tokens replace the whole state; one token shifts the state left by one
    assert torch.equal(new[4], x[0, : W - 1].T)
    t4 = sum(lens[:4])
    assert torch.equal(new[5], torch.cat([state[5][:, 1:], x[0, t4 : t4 + 1].T], 1))


def test_causal_conv_without_state():
    gen = torch.Generator().manual_seed(9)
    Ch, W = 5, 4
    lens = [7, 0, 1, 3]
    x = torch.randn(1, 11, Ch, generator=gen, dtype=torch.float32)
    weight = torch.randn(Ch, W, generator=gen, dtype=torch.float32)
    y, new = causal_conv_reference(x, weight, cu_seqlens=cu_from_lens(lens))
    y_ref, _ = conv_expected(x, weight, lens, None, [-1] * 4, [False] * 4)
    assert new is None and y.dtype == F64
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-14)
    # has_initial_state false: the state is not read, but still written
    state = torch.randn(4, Ch, W - 1, generator=gen)
    y2, new2 = causal_conv_reference(x, weight, cu_seqlens=cu_from_lens(lens), conv_state=state,
                                     has_initial_state=torch.zeros(4, dtype=torch.bool))
    assert torch.equal(y2, y) and new2.dtype == state.dtype
    assert torch.equal(new2[2], torch.cat([torch.zeros(Ch, W - 2), x[0, 7:8].T], 1))
    assert torch.equal(new2[0], x[0, 4:7].T)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_blocked_unit_lower_inverse_matches_the_inverse(C):
    from kdagen.reference import blocked_unit_lower_inverse

    gen = torch.Generator().manual_seed(C)
    L = torch.randn(C, C, generator=gen, dtype=torch.float64) * 0.2
    garbage = torch.triu(torch.randn(C, C, generator=gen, dtype=torch.float64) * 100)
    A = blocked_unit_lower_inverse(torch.tril(L, -1) + garbage)  # upper part must not be read
    want = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + torch.tril(L, -1))
    assert torch.allclose(A, want, atol=1e-12, rtol=0)
    assert torch.equal(torch.triu(A, 1), torch.zeros_like(A))


def test_blocked_unit_lower_inverse_refuses_a_partial_block():
    from kdagen.reference import blocked_unit_lower_inverse

    with pytest.raises(ValueError, match="multiple of 16"):
        blocked_unit_lower_inverse(torch.zeros(24, 24))


@pytest.mark.parametrize("gate, low, high", [("softplus", -30.0, -7.0), ("lower_bound", -5.0001, -4.5)])
def test_kernel_test_inputs_with_strong_decay_reach_the_gates_extremes(gate, low, high):
    """kdagen.testing.make_inputs(strong_decay=True), the kernel tests' strong decay: the
    softplus gate at -7 to -30 per step (median about -15), the lower-bound gate saturated
    at its bound, for 95% of the elements."""
    from kdagen.testing import make_inputs as kernel_inputs

    x = kernel_inputs([40, 70], 4, 64, device="cpu", dtype=torch.float32, gate=gate,
                      strong_decay=True, seed=12)
    g = kda_gate(x.g[0].double(), x.A_log.double(), x.dt_bias.double(), x.lower_bound)
    inside = ((g > low) & (g < high)).double().mean().item()
    assert inside > 0.95, (gate, inside, g.median().item())
