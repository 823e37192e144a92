"""Random KDA inputs for tests and benchmarks (never zeros), and the error measure."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Outputs and end states of the chunk path and the recurrence against the float64
# reference: bf16 operands put them at 2-5e-3 (docs/VALIDATION.md).
BF16_TOL = 2e-2
# The prologue's outputs against the float64 reference, each at about 3x the largest error
# measured (emulated and GPU runs, docs/VALIDATION.md: qg up to 5e-5, the 16-bit w / u /
# kg_t / aqk / akk up to 4e-3, the fp32 decay up to 3.7e-7), so a row off by one in the
# decay or the gate's cumsum (1e-2 to 2e-2) fails even where the outputs hide it.
PROLOGUE_TOL = {"qg": 1e-3, "w": 1e-2, "u": 1e-2, "kg_t": 1e-2, "aqk": 1e-2, "akk": 1e-2,
                "decay": 1e-5}


@dataclass
class KdaInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor  # raw gate input, before dt_bias and the gate function
    beta: torch.Tensor  # raw, before the sigmoid
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    cu_seqlens: torch.Tensor
    lower_bound: float | None

    @property
    def lens(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu, cu[1:])]

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias)


# A probe kernel: the prologue on the waves past the first kFirst threads of a block,
# in the block's LDS from byte kOffset on, behind a named barrier, while the waves before
# it fill the LDS below kOffset with a pattern and, after a block barrier, check that it
# is intact (else they put a NaN into qg): prologue_chunk as a kernel with waves of other
# jobs would run it. Appended to a rendered sm_90 kernels.hip (NamedBarrier is NVIDIA's):
# tests/test_emulated_kernels.py runs it, tests/test_compile.py compiles it with nvcc.
PROLOGUE_GROUP_PROBE = r"""
namespace kdagen {
template <bool kAkk, int kFirst, int kOffset>
__global__ void prologue_group_probe(PrologueArgs a) {
  KDAGEN_DYNAMIC_SHARED(lds);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kFirst) {
    for (int i = tid; i < kOffset; i += kFirst) lds[i] = 0x5a;
  } else {
    const int chunk = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
    prologue_chunk<Config, kAkk, kFirst, kOffset>(a, static_cast<int>(blockIdx.x), chunk,
                                                  NamedBarrier<3, Config::kPrologueThreads>{});
  }
  __syncthreads();
  if (tid < kFirst)
    for (int i = tid; i < kOffset; i += kFirst)
      if (lds[i] != 0x5a) static_cast<uint16_t*>(a.qg)[0] = 0x7fc0;  // a NaN: the test fails
}
}  // namespace kdagen

extern "C" int prologue_group_probe(const kdagen::PrologueArgs* a, void*) {
  constexpr int kFirst = 64, kOffset = 1024;
  const dim3 grid(static_cast<unsigned>(a->num_heads), static_cast<unsigned>(a->num_chunks), 1);
  const dim3 block(kFirst + kdagen::Config::kPrologueThreads);
  const int lds = kOffset + kdagen::PrologueLayout<kdagen::Config>::kBytes;
  if (a->akk != nullptr)
    hipLaunchKernelGGL((kdagen::prologue_group_probe<true, kFirst, kOffset>), grid, block, lds, nullptr, *a);
  else
    hipLaunchKernelGGL((kdagen::prologue_group_probe<false, kFirst, kOffset>), grid, block, lds, nullptr, *a);
  return 0;
}
"""


def make_inputs(
    lens: list[int],
    heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    gate: str = "softplus",
    strong_decay: bool = False,
    lower_bound: float = -5.0,
    seed: int = 0,
    fused: bool = False,
) -> KdaInputs:
    """Varlen batch of ``lens`` tokens. ``strong_decay`` drives the softplus gate to
    -7 .. -30 per step (median about -15) and saturates the lower-bound gate (within 10% of ``lower_bound``
    for nearly every element). ``fused`` returns q, k, v, g and beta as strided last-dim
    views of one projection, as a layer produces them."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, H, D = sum(lens), heads, head_dim

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * s

    if fused:
        proj = rnd(1, T, H * (4 * D + 1))
        q, k, v, g = (proj[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        beta = proj[..., 4 * H * D:]
    else:
        q, k, v, g = rnd(1, T, H, D), rnd(1, T, H, D), rnd(1, T, H, D), rnd(1, T, H, D)
        beta = rnd(1, T, H)
    # Realistic gates: per-channel decay from about -1e-3 to -1 per step, so that many
    # channels remember across several chunks (a test of the cross-chunk state).
    if gate == "softplus":
        A_log = rnd(H, s=0.3) - 3.0
        dt_bias = rnd(H * D, s=1.5) - 2.0
    else:
        A_log = rnd(H, s=0.3)
        dt_bias = rnd(H * D, s=1.5) - 5.0
    if strong_decay:
        if gate == "softplus":
            A_log = torch.full((H,), 1.0)  # exp(1) * softplus(x ~ 5.5) ~ 15
            g = g * 0.5 + 7.5
        else:  # exp(A_log) (x + dt_bias) ~ 5: sigmoid ~ 0.99, the gate at its bound
            g = g * 0.5 + 10.0
    beta = beta * 2.0
    cast = dict(dtype=dtype, device=device)
    if fused:
        # keep views of one buffer: scale in place on the projection, then view again
        proj = torch.cat([x.flatten(-2) for x in (q, k, v, g)] + [beta], dim=-1).to(**cast)
        q, k, v, g = (proj[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        beta = proj[..., 4 * H * D:]
    else:
        q, k, v, g, beta = (x.to(**cast) for x in (q, k, v, g, beta))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    return KdaInputs(q, k, v, g, beta, A_log.to(device), dt_bias.to(device), cu,
                     lower_bound if gate == "lower_bound" else None)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    o, r = out.double(), ref.double().to(out.device)
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def conv_prologue_reference(x: KdaInputs, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                            conv_state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                            chunk_size: int) -> tuple[dict, torch.Tensor]:
    """The prologue's reference with the fused causal conv + SiLU applied to q, k, v first:
    (its outputs, the conv state after the batch). ``conv_state`` is not modified."""
    from . import reference as ref

    H, D = x.q.shape[2], x.q.shape[3]
    raw = torch.cat([x.q.flatten(-2), x.k.flatten(-2), x.v.flatten(-2)], -1)
    y, new_state = ref.causal_conv_reference(raw, conv_weight, cu_seqlens=x.cu_seqlens,
                                             conv_state=conv_state,
                                             conv_state_indices=conv_state_indices,
                                             has_initial_state=has_initial_state)
    HD = H * D
    yq, yk, yv = (y[..., i * HD:(i + 1) * HD].unflatten(-1, (H, D)) for i in range(3))
    want = ref.chunk_prologue_reference(yq, yk, yv, x.g, x.beta, x.A_log, x.dt_bias,
                                        cu_seqlens=x.cu_seqlens, chunk_size=chunk_size)
    return want, new_state
