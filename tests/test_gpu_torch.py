"""torch integration on a GPU: opcheck, torch.compile without graph breaks, CUDA-graph
capture and replay with changing cu_seqlens contents, prefill then decode through one
paged state cache."""

from __future__ import annotations

import pytest
import torch

from kdagen import reference as ref
from kdagen.testing import BF16_TOL, make_inputs, rel_err
from kdagen.varlen import prepare_chunk_indices

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


def test_opcheck_every_op():
    kern = kernels(head_dim=128, gate="lower_bound")
    rec = kernels(head_dim=128, ops=["recurrent"], gate="lower_bound")
    name = kern.spec.name
    x = make_inputs([70, 5], 2, 128, gate="lower_bound", seed=1)
    ci = prepare_chunk_indices(x.cu_seqlens, 64)
    T, H = 75, 2
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device=DEV)
    pro_args = (x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, e(1, T, H, 128), e(1, T, H, 128),
                e(1, T, H, 128), e(3, H, 128, 64), e(1, T, H, 64), e(3, H, 128, dt=torch.float32),
                x.cu_seqlens, ci, None, None, None, None, 0.1, -5.0)
    torch.library.opcheck(getattr(torch.ops.kdagen, f"{name}_prologue").default, pro_args)
    p = kern.fused_kda_prologue(*x.args(), None, -5.0, x.cu_seqlens)
    co = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEV)
    fin = torch.empty(2, H, 128, 128, device=DEV)
    chunk_args = (*(p[k] for k in OPS), e(1, T, H, 128), x.cu_seqlens, co, 0.1, None, fin, None, 1,
                  None, None, None, None, None, None)
    torch.library.opcheck(getattr(torch.ops.kdagen, f"{name}_chunk").default, chunk_args)
    # the deferred form: the prologue writes akk in place of u, the scan forms u from v
    deferred = (*pro_args[:9], None, *pro_args[10:], e(1, T, H, 64))
    torch.library.opcheck(getattr(torch.ops.kdagen, f"{name}_prologue").default, deferred)
    d = kern.fused_kda_prologue(*x.args(), None, -5.0, x.cu_seqlens, defer_u=True)
    chunk_akk = (d["qg"], d["w"], x.v, d["kg_t"], d["aqk"], d["decay"], *chunk_args[6:], d["akk"])
    torch.library.opcheck(getattr(torch.ops.kdagen, f"{name}_chunk").default, chunk_akk)
    cache = torch.randn(4, H, 128, 128, device=DEV)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    y = make_inputs([1, 1], H, 128, gate="lower_bound", seed=2)
    rec_args = (y.q[0], y.k[0], y.v[0], y.g[0], y.beta[0], y.A_log, y.dt_bias, cache, idx,
                e(2, H, 128), 0.1, -5.0)
    torch.library.opcheck(getattr(torch.ops.kdagen, f"{rec.spec.name}_recurrent").default, rec_args)


def test_torch_compile_fullgraph():
    kern = kernels(head_dim=128)
    x = make_inputs([300, 64, 7], 2, 128, seed=3)
    ci = prepare_chunk_indices(x.cu_seqlens, 64)
    init = torch.randn(3, 2, 128, 128, device=DEV) * 0.1

    def layer(q, k, v, g, beta, cu, ci, init):
        p = kern.fused_kda_prologue(q, k, v, g, beta, x.A_log, x.dt_bias, None, None, cu,
                                    chunk_indices=ci)
        return kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"],
                                    None, cu, init, True)

    compiled = torch.compile(layer, fullgraph=True)
    o1, s1 = compiled(x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, ci, init)
    o2, s2 = layer(x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, ci, init)
    assert rel_err(o1, o2) < 1e-6 and rel_err(s1, s2) < 1e-6


def test_cuda_graph_replay_with_new_cu_seqlens():
    kern = kernels(head_dim=128)
    H = 2
    x = make_inputs([128, 64], H, 128, seed=4)
    cu = x.cu_seqlens.clone()
    ci = prepare_chunk_indices(cu, 64)
    init = torch.randn(2, H, 128, 128, device=DEV) * 0.1

    def step():
        p = kern.fused_kda_prologue(*x.args(), None, None, cu, chunk_indices=ci)
        return kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"],
                                    None, cu, init, True, groups=1)

    step()  # build, load, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = step()
    for lens in ([64, 128], [0, 192], [192, 0], [128, 64]):  # 3 chunks each
        new_cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=DEV)
        cu.copy_(new_cu)
        ci.copy_(prepare_chunk_indices(new_cu, 64))
        graph.replay()
        o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=new_cu,
                                                      initial_state=init)
        assert rel_err(o_g, o_ref) < BF16_TOL, lens
        assert rel_err(s_g, s_ref) < BF16_TOL, lens


@pytest.mark.parametrize("gate,shape,groups", [
    ("softplus", "64x256x32", 1), ("softplus", "1x2048x32", 4),
    ("lower_bound", "64x256x32", 1), ("lower_bound", "1x2048x32", 4),
])
def test_cuda_graph_of_prefill_at_chunk_16(gate, shape, groups):
    """The bench's CUDA-graph timing of ``Kernels.prefill`` (chunk 16, u formed in the scan):
    one capture replayed against its eager result, then graph_ms's four captures in
    rotation. In a subprocess, since a device fault ends the CUDA context: v16's graph_ms
    let the chunk indices of all but its last capture be freed, and the lower-bound rows
    hit "an illegal instruction" in the replays (docs/BENCHMARKS.md, "Fixed")."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "graph_check.py"
    run = subprocess.run([sys.executable, str(script), gate, shape, str(groups), "4"],
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-2000:]
    err = [line for line in log.splitlines() if "replay against eager" in line]
    assert err and float(err[0].split()[-1]) < 1e-6, log[-2000:]
    assert "graph ms None" not in log and "graph_check: done" in log, log[-2000:]


def test_prefill_then_decode_one_state_cache():
    kern = kernels(head_dim=128, gate="lower_bound")
    rec = kernels(head_dim=128, ops=["recurrent"], gate="lower_bound")
    H, steps = 2, 4
    lens = [150, 64]
    full = make_inputs([n + steps for n in lens], H, 128, gate="lower_bound", seed=6)
    # rows 3 and 1 start as NaN: has_initial_state is False, so the walk must not read them
    cache = torch.randn(5, H, 128, 128, device=DEV) * 0.1
    idx = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    cache[idx.long()] = float("nan")
    others = cache[[0, 2, 4]].clone()
    starts = full.cu_seqlens[:-1].tolist()
    pre = [torch.cat([t[:, s:s + n] for s, n in zip(starts, lens)], 1) for t in full.args()[:5]]
    cu_pre = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=DEV)
    p = kern.fused_kda_prologue(*pre, full.A_log, full.dt_bias, None, -5.0, cu_pre)
    o_pre, _ = kern.fused_kda_chunk(*(p[k] for k in OPS), p["u"], None, cu_pre, None, False,
                                    state_cache=cache, state_indices=idx,
                                    has_initial_state=torch.zeros(2, dtype=torch.bool, device=DEV))
    outs = []
    for t in range(steps):
        tok = [torch.stack([x[0, s + n + t] for s, n in zip(starts, lens)]) for x in full.args()[:5]]
        outs.append(rec.fused_recurrent_kda(*tok, full.A_log, full.dt_bias, None, -5.0, cache, idx))
    o_ref, s_ref, _ = ref.recurrent_kda_reference(*full.args(), lower_bound=-5.0,
                                                  cu_seqlens=full.cu_seqlens)
    ref_pre = torch.cat([o_ref[:, s:s + n] for s, n in zip(starts, lens)], 1)
    assert rel_err(o_pre, ref_pre) < BF16_TOL
    ref_dec = torch.stack([torch.stack([o_ref[0, s + n + t] for s, n in zip(starts, lens)])
                           for t in range(steps)])
    assert rel_err(torch.stack(outs), ref_dec) < BF16_TOL
    assert rel_err(cache[idx.long()], s_ref) < BF16_TOL
    assert torch.equal(cache[[0, 2, 4]], others)  # the other rows untouched
