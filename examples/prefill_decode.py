"""Prefill a batch of prompts, then decode tokens, through one paged fp32 state cache,
the way an inference engine drives kdagen: the chunk op reads and writes each
sequence's cache row in place, the recurrent op continues from it one token at a time.

    python examples/prefill_decode.py   # on a GPU; checks itself against the reference
"""

from __future__ import annotations

import torch

import kdagen
from kdagen import reference as ref
from kdagen.jit import device_target
from kdagen.testing import make_inputs, rel_err


def main() -> None:
    target = device_target()
    prefill = kdagen.load({"head_dim": 128, "target": target})
    decode = kdagen.load({"head_dim": 128, "ops": ["recurrent"], "target": target})
    H, steps, prompts = 4, 8, [513, 77, 1]
    x = make_inputs([n + steps for n in prompts], H, 128, seed=0)  # prompt + future tokens
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device="cuda")  # cache rows by sequence
    cache = torch.zeros(8, H, 128, 128, device="cuda")
    starts = x.cu_seqlens[:-1].tolist()

    # prefill: the prompts only, as one varlen batch
    pick = lambda t, off, n: torch.cat([t[:, s + off:s + off + m] for s, m in zip(starts, n)], 1)
    lens = prompts
    q, k, v, g, b = (pick(t, 0, lens) for t in x.args()[:5])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ws = prefill.fused_kda_prologue(q, k, v, g, b, x.A_log, x.dt_bias, None, None, cu)
    o_prefill, _ = prefill.fused_kda_chunk(
        ws["qg"], ws["w"], ws["u"], ws["kg_t"], ws["aqk"], ws["decay"], ws["u"], None, cu, None,
        False, state_cache=cache, state_indices=slots,
        has_initial_state=torch.zeros(3, dtype=torch.bool, device="cuda"))

    # decode: one token per sequence per step
    outs = []
    for t in range(steps):
        tok = [torch.stack([a[0, s + n + t] for s, n in zip(starts, prompts)]) for a in x.args()[:5]]
        outs.append(decode.fused_recurrent_kda(*tok, x.A_log, x.dt_bias, None, None, cache, slots))

    o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=x.cu_seqlens)
    dec_ref = torch.stack([torch.stack([o_ref[0, s + n + t] for s, n in zip(starts, prompts)])
                           for t in range(steps)])
    print(f"prefill output rel err {rel_err(o_prefill, pick(o_ref, 0, prompts)):.2e}")
    print(f"decode output rel err  {rel_err(torch.stack(outs), dec_ref):.2e}")
    print(f"final state rel err    {rel_err(cache[slots.long()], s_ref):.2e}")


if __name__ == "__main__":
    main()
