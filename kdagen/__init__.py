"""kdagen: a kernel compiler for Kimi Delta Attention (KDA).

    spec = kdagen.KernelSpec(head_dim=128, chunk_size=64, io_dtype="bf16", target="sm_90")
    kern = kdagen.load(spec)          # build if missing, load, return the op handle
    ws = kern.fused_kda_prologue(...) # see kdagen.ops.Kernels
    o, s = kdagen.kda_forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,  # chunk_kda's
                              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              A_log=A_log, dt_bias=dt_bias)

Heavy modules (torch) load on first use, so the CLI's spec and render commands
start fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KernelSpec": ("kdagen.spec", "KernelSpec"),
    "SpecError": ("kdagen.spec", "SpecError"),
    "TARGETS": ("kdagen.targets", "TARGETS"),
    "render": ("kdagen.render", "render"),
    "build": ("kdagen.build", "build"),
    "BuildError": ("kdagen.build", "BuildError"),
    "load": ("kdagen.jit", "load"),
    "Kernels": ("kdagen.ops", "Kernels"),
    "kda_forward": ("kdagen.layer", "kda_forward"),
    "chunk_groups": ("kdagen.groups", "chunk_groups"),
    "prepare_seqlens": ("kdagen.seqlens", "prepare"),
    "SeqLens": ("kdagen.seqlens", "SeqLens"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")
