"""The torch op schemas of a rendered binding (binding.cpp.j2), checked on the CPU with
``torch.library.opcheck`` through stand-in implementations: the contract's positional
calls (no ``akk``) and the deferred form (``u`` None and ``akk`` for the prologue, ``akk``
for the chunk scan) must both bind, and every tensor an op writes must be marked mutable.
The real kernels' opcheck runs on the GPU (tests/test_gpu_torch.py)."""

from __future__ import annotations

import re

import torch

from kdagen.render import render
from kdagen.spec import KernelSpec

T, H, D, C = 20, 2, 64, 16
BF, F32, I32 = torch.bfloat16, torch.float32, torch.int32


def schemas() -> dict[str, str]:
    """op -> schema text, as the rendered binding registers it (without the variant name)."""
    spec = KernelSpec.parse({"head_dim": D, "chunk_size": C, "target": "sm_90"})
    src = render(spec).files["binding.cpp"]
    out = {}
    for m in re.finditer(r'm\.def\("' + spec.name + r'_(\w+)\((.*?)\) -> \(\)"\);', src, re.S):
        body = re.sub(r'"\s*"', "", m.group(2))  # the C++ string pieces joined
        out[m.group(1)] = f"{m.group(1)}({body}) -> ()"
    return out


def _library() -> torch.library.Library:
    lib = torch.library.Library("kdagen_schema_test", "FRAGMENT")
    s = schemas()
    for op in ("prologue", "chunk"):
        lib.define(s[op])

    def prologue(q, k, v, g, b, a_log, dt_bias, qg, w, u, kg_t, aqk, decay, cu, ci, cw, cs, csi,
                 chis, scale, lb, akk=None):
        for t in (qg, w, kg_t, aqk, decay):
            t.fill_(1.0)
        (akk if akk is not None else u).fill_(2.0)

    def chunk(qg, w, u, kg_t, aqk, decay, out, cu, co, scale, init, fin, ws, groups, cks, cko, ckx,
              cache, idx, has, akk=None):
        out.fill_(3.0)
        if fin is not None:
            fin.fill_(4.0)

    lib.impl("prologue", prologue, "CPU")
    lib.impl("chunk", chunk, "CPU")
    for op in ("prologue", "chunk"):
        torch.library.register_fake(f"kdagen_schema_test::{op}", lambda *a, **k: None, lib=lib)
    return lib


def e(*shape, dt=BF):
    return torch.empty(*shape, dtype=dt)


def r(*shape, dt=BF):
    return torch.randn(*shape).to(dt)


def test_schemas_bind_both_forms():
    lib = _library()
    ops = torch.ops.kdagen_schema_test
    base = (r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(1, T, H), r(H, dt=F32),
            r(H * D, dt=F32))
    cu = torch.tensor([0, T], dtype=I32)
    ci = torch.tensor([[0, 0], [0, 1]], dtype=I32)
    outs = (e(1, T, H, D), e(1, T, H, D))
    tail = (e(2, H, D, C), e(1, T, H, C), e(2, H, D, dt=F32), cu, ci, None, None, None, None, 0.1, -5.0)
    torch.library.opcheck(ops.prologue.default, (*base, *outs, e(1, T, H, D), *tail))  # contract
    torch.library.opcheck(ops.prologue.default, (*base, *outs, None, *tail, e(1, T, H, C)))  # akk
    co = torch.tensor([0, 2], dtype=I32)
    ch = (r(1, T, H, D), r(1, T, H, D), r(1, T, H, D), r(2, H, D, C), r(1, T, H, C),
          r(2, H, D, dt=F32), e(1, T, H, D), cu, co, 0.1, None, e(1, H, D, D, dt=F32), None, 1,
          None, None, None, None, None, None)
    torch.library.opcheck(ops.chunk.default, ch)
    torch.library.opcheck(ops.chunk.default, (*ch, r(1, T, H, C)))
    del lib
