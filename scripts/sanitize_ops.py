"""Run every op once on small varlen inputs with partial chunks, for compute-sanitizer
(memcheck, racecheck, synccheck): recurrent, prologue (with and without the fused conv),
chunk with 1 and 4 groups, paged cache, checkpoints; the deferred form (the prologue's akk,
the scan forming u from a strided v) at c64 and c16, with 4 groups also in 2 and 1 pass-one
segments; the lower-bounded gate's prologue
(diagonal blocks on the matrix units) and chunk with 1 and 3 groups."""

from __future__ import annotations

import torch

import kdagen
from kdagen.jit import device_target
from kdagen.testing import make_inputs

OPS = ("qg", "w", "u", "kg_t", "aqk", "decay")


def main() -> None:
    t = device_target()
    kern = kdagen.load({"head_dim": 128, "target": t})
    conv = kdagen.load({"head_dim": 128, "conv_width": 4, "target": t})
    rec = kdagen.load({"head_dim": 128, "ops": ["recurrent"], "target": t})
    H = 2
    x = make_inputs([1, 63, 64, 65, 300], H, 128, seed=0)
    N = 5
    p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
    for groups in (1, 4):
        kern.fused_kda_chunk(*(p[k] for k in OPS), torch.empty_like(p["u"]), None, x.cu_seqlens,
                             torch.randn(N, H, 128, 128, device="cuda"), True, groups=groups)
        cache = torch.randn(8, H, 128, 128, device="cuda")
        ck = torch.zeros(3, H, 128, 128, device="cuda")
        kern.fused_kda_chunk(*(p[k] for k in OPS), p["u"], None, x.cu_seqlens, None, False,
                             state_cache=cache,
                             state_indices=torch.tensor([7, 1, 0, 3, 5], dtype=torch.int32, device="cuda"),
                             has_initial_state=torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool, device="cuda"),
                             checkpoint_state=ck,
                             checkpoint_offsets=torch.tensor([0, 0, 64, 64, 256], dtype=torch.int32, device="cuda"),
                             checkpoint_state_indices=torch.tensor([-1, -1, 0, 1, 2], dtype=torch.int32, device="cuda"),
                             groups=groups)
    state = torch.randn(6, 3 * H * 128, 3, device="cuda")
    conv.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens,
                            conv_weight=torch.randn(3 * H * 128, 4, device="cuda"), conv_state=state,
                            conv_state_indices=torch.tensor([0, 2, -1, 4, 5], dtype=torch.int32, device="cuda"),
                            conv_has_initial_state=torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool, device="cuda"))
    # u formed in the scan (defer_u / akk), from a strided v, at c64 and at c16
    c16 = kdagen.load({"head_dim": 128, "chunk_size": 16, "gate": "lower_bound", "target": t})
    vbuf = torch.randn(1, x.v.shape[1], H, 136, dtype=x.v.dtype, device="cuda")
    v = vbuf[..., :128]
    v.copy_(x.v)
    for k, lbd in ((kern, None), (c16, -5.0)):
        d = k.fused_kda_prologue(*x.args(), None, lbd, x.cu_seqlens, defer_u=True)
        for groups, segments in ((1, None), (4, None), (4, 2), (4, 1)):  # (pass one's segments)
            k.fused_kda_chunk(d["qg"], d["w"], v, d["kg_t"], d["aqk"], d["decay"],
                              torch.empty_like(d["w"]), None, x.cu_seqlens, None, True,
                              groups=groups, segments=segments, akk=d["akk"])
    # the lower-bounded gate: diagonal blocks on the matrix units
    lb = kdagen.load({"head_dim": 128, "gate": "lower_bound", "target": t})
    z = make_inputs([1, 63, 64, 65, 300], H, 128, gate="lower_bound", seed=2)
    pz = lb.fused_kda_prologue(*z.args(), None, z.lower_bound, z.cu_seqlens)
    for groups in (1, 3):
        lb.fused_kda_chunk(*(pz[k] for k in OPS), torch.empty_like(pz["u"]), None, z.cu_seqlens,
                           None, True, groups=groups)
    y = make_inputs([1] * N, H, 128, seed=1)
    cache = torch.randn(8, H, 128, 128, device="cuda")
    rec.fused_recurrent_kda(*(a[0] for a in y.args()[:5]), y.A_log, y.dt_bias, None, None, cache,
                            torch.tensor([3, -1, 0, 7, 1], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    print("sanitize_ops: all ops ran")


if __name__ == "__main__":
    main()
