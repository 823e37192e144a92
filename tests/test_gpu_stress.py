"""Numerics under stress on a GPU (issue 6): extreme but valid inputs stay finite and
match the float64 reference; a NaN stays inside its own sequence.

Written after the session's device time was spent: not yet run on a GPU."""

from __future__ import annotations

import pytest
import torch

from kdagen import reference as ref
from kdagen.testing import BF16_TOL, make_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
DEV = "cuda"
OPS = ("qg", "w", "u", "kg_t", "aqk", "decay")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output the ops allocate starts as NaN (an unwritten element shows)."""
    monkeypatch.setenv("KDAGEN_POISON", "1")


def kernels(**fields):
    import kdagen
    from kdagen.jit import device_target

    return kdagen.load({"target": device_target(), **fields})


def run(kern, x, init=None, lower_bound=None, groups=None):
    p = kern.fused_kda_prologue(*x.args(), None, lower_bound, x.cu_seqlens)
    return kern.fused_kda_chunk(*(p[k] for k in OPS), torch.full_like(p["u"], float("nan")), None, x.cu_seqlens,
                                init, True, groups=groups)


@pytest.mark.parametrize("case", ["tiny", "huge", "beta_low", "beta_high", "gate_bound"])
def test_extreme_inputs_match_reference(case):
    gate = "lower_bound" if case == "gate_bound" else "softplus"
    kern = kernels(head_dim=128, gate=gate)
    x = make_inputs([0, 1, 63, 64, 65, 700], 2, 128, gate=gate, seed=["tiny", "huge", "beta_low", "beta_high", "gate_bound"].index(case))
    if case == "tiny":
        x.q.mul_(1e-3), x.k.mul_(1e-3), x.v.mul_(1e-3)
    elif case == "huge":
        x.q.mul_(1e3), x.k.mul_(1e3), x.v.mul_(1e3)
    elif case == "beta_low":
        x.beta.fill_(-30.0)  # sigmoid ~ 1e-13
    elif case == "beta_high":
        x.beta.fill_(30.0)   # sigmoid ~ 1
    else:
        x.g.fill_(60.0)      # lower-bound gate at its bound, -5 per step
    lb = -5.0 if gate == "lower_bound" else None
    o, s = run(kern, x, lower_bound=lb)
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), lower_bound=lb, cu_seqlens=x.cu_seqlens)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(s, s_ref) < BF16_TOL


@pytest.mark.parametrize("groups", [1, 8])
def test_very_long_sequence(groups):
    kern = kernels(head_dim=128)
    x = make_inputs([65536 + 17], 1, 128, seed=9)
    o, s = run(kern, x, groups=groups)
    o_ref, s_ref, _ = ref.chunk_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens, chunk_size=64)
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(s, s_ref) < BF16_TOL


@pytest.mark.parametrize("groups", [1, 4])
def test_nan_stays_in_its_sequence(groups):
    kern = kernels(head_dim=128)
    lens = [300, 129, 64, 500]
    x = make_inputs(lens, 2, 128, seed=10)
    clean_o, clean_s = run(kern, x, groups=groups)
    bad = 1  # poison one token of sequence 1
    t = int(x.cu_seqlens[bad]) + 70
    x.v[0, t, 0, 5] = float("nan")
    o, s = run(kern, x, groups=groups)
    cu = x.cu_seqlens.tolist()
    for n in range(len(lens)):
        rows = slice(cu[n], cu[n + 1])
        if n == bad:
            assert torch.isnan(s[n]).any()
        else:
            assert torch.equal(o[:, rows], clean_o[:, rows]), n
            assert torch.equal(s[n], clean_s[n]), n
