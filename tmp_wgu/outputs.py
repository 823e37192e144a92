"""Outputs of one A/B variant (its kdagen on PYTHONPATH) on fixed inputs, saved for comparison;
with --compare, each variant against base and against the float64 recurrence (small case)."""
import sys, torch
from kdagen.testing import make_inputs, rel_err

def run(kern, x, init, groups, segments):
    d = kern.fused_kda_prologue(*x.args(), None, x.lower_bound, x.cu_seqlens, defer_u=True)
    out = torch.full_like(x.v, float("nan"))
    o, s = kern.fused_kda_chunk(d["qg"], d["w"], x.v, d["kg_t"], d["aqk"], d["decay"], out, None,
                                x.cu_seqlens, init, True, groups=groups, akk=d["akk"], segments=segments)
    torch.cuda.synchronize()
    return o.float().cpu(), s.float().cpu()

CASES = [("walk", [4096 + 17, 1000, 5], 4, 1, 0), ("seg", [16384 + 9], 4, 8, 4),
         ("group", [8192 + 3, 300], 4, 8, 0), ("strong", [2048 + 7, 33], 2, 4, 2)]

if sys.argv[1] == "--compare":
    base = torch.load(sys.argv[2])
    for path in sys.argv[3:]:
        other = torch.load(path)
        for k in base:
            print(path, k, "vs base: out %.2e state %.2e" % (rel_err(other[k][0], base[k][0]), rel_err(other[k][1], base[k][1])),
                  "vs ref: out %.2e state %.2e" % other[k][2] if other[k][2] else "")
    sys.exit(0)
import kdagen
from kdagen import reference as ref
kern = kdagen.load(dict(target="sm_90", head_dim=128, chunk_size=16, block_width=128, gate="lower_bound"))
res = {}
for name, lens, H, g, p in CASES:
    x = make_inputs(lens, H, 128, device="cuda", gate="lower_bound", seed=len(lens) + H, strong_decay=name == "strong")
    N = len(lens)
    init = torch.randn(N, H, 128, 128, generator=torch.Generator().manual_seed(3)).cuda() * 0.1
    o, s = run(kern, x, init, g, p)
    r = None
    if name == "strong":
        xc = make_inputs(lens, H, 128, device="cpu", gate="lower_bound", seed=len(lens) + H, strong_decay=True)
        o_ref, s_ref, _ = ref.recurrent_kda_reference(*xc.args(), lower_bound=xc.lower_bound,
                                                      cu_seqlens=xc.cu_seqlens, initial_state=init.cpu())
        r = (rel_err(o, o_ref), rel_err(s, s_ref))
    assert torch.isfinite(o).all() and torch.isfinite(s).all(), name
    res[name] = (o, s, r)
torch.save(res, sys.argv[1])
print("saved", sys.argv[1], {k: v[2] for k, v in res.items()})
