"""A Kimi-Linear-style KDA layer in plain torch on kdagen's ops: projections, short
causal conv (fused into the prologue), KDA, gated output RMS norm, output projection.

    python examples/kda_layer.py        # on a GPU: runs a varlen batch through the layer
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import kdagen
from kdagen.jit import device_target


class KDALayer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int = 128, conv_width: int = 4):
        super().__init__()
        self.h, self.d = heads, head_dim
        hd = heads * head_dim
        self.qkv = nn.Linear(hidden, 3 * hd, bias=False)
        self.g_proj = nn.Sequential(nn.Linear(hidden, head_dim, bias=False),
                                    nn.Linear(head_dim, hd, bias=False))  # low-rank gate input
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.out_gate = nn.Sequential(nn.Linear(hidden, head_dim, bias=False),
                                      nn.Linear(head_dim, hd, bias=True))
        self.o_proj = nn.Linear(hd, hidden, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(3 * hd, conv_width) * 0.3)
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3 - 3.0)
        self.dt_bias = nn.Parameter(torch.randn(hd) * 1.5 - 2.0)
        self.norm_weight = nn.Parameter(torch.ones(head_dim))
        self.kern = kdagen.load({"head_dim": head_dim, "conv_width": conv_width,
                                 "target": device_target()})

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor | None = None):
        """x [1, T, hidden] (varlen); returns (y [1, T, hidden], final state [N, H, V, K])."""
        T = x.shape[1]
        qkv = self.qkv(x).view(1, T, 3, self.h, self.d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # strided views, not copies
        g = self.g_proj(x).view(1, T, self.h, self.d)
        beta = self.b_proj(x)
        ws = self.kern.fused_kda_prologue(q, k, v, g, beta, self.A_log, self.dt_bias, None, None,
                                          cu_seqlens, conv_weight=self.conv_weight.float())
        o, final = self.kern.fused_kda_chunk(ws["qg"], ws["w"], ws["u"], ws["kg_t"], ws["aqk"],
                                             ws["decay"], ws["u"], None, cu_seqlens, state, True)
        o = F.rms_norm(o.float(), (self.d,), self.norm_weight.float(), 1e-6)
        o = o * torch.sigmoid(self.out_gate(x).view(1, T, self.h, self.d).float())
        return self.o_proj(o.to(x.dtype).reshape(1, T, -1)), final


if __name__ == "__main__":
    torch.manual_seed(0)
    layer = KDALayer(hidden=1024, heads=8).cuda().to(torch.bfloat16)
    lens = [700, 64, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    x = torch.randn(1, sum(lens), 1024, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        y, s = layer(x, cu)
    print("y", tuple(y.shape), y.dtype, "finite:", bool(torch.isfinite(y).all()),
          "state", tuple(s.shape))
