"""``kda_forward``: the whole KDA layer op with the signature and defaults of
``fla.ops.kda.chunk_kda``, so one can stand in for the other."""

from __future__ import annotations

import torch

from . import autotune, seqlens
from .jit import for_inputs, spec_for_inputs
from .seqlens import SeqLens


def kda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | SeqLens | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: object | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    groups: int | None = None,
    block_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H, K]`` (before the
    gate), beta ``[B, T, H]`` (before the sigmoid) -> ``(o [B, T, H, V], final_state)``.

    The signature, argument order and defaults are ``chunk_kda``'s (fla-core 0.6.0), so a
    call means the same to both. kdagen's prologue always applies the l2 norms, the gate
    and the beta sigmoid, so ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` and
    ``use_beta_sigmoid_in_kernel`` must be passed True (False, FLA's default for
    pre-processed inputs, is an error). The gate is ``-exp(A_log) softplus(g + dt_bias)``,
    or with ``lower_bound`` ``lower_bound sigmoid(exp(A_log) (g + dt_bias))`` (``A_log``
    may then be None: ``lower_bound sigmoid(g + dt_bias)``); ``dt_bias`` None is zero.
    ``safe_gate`` needs ``lower_bound`` in [-5, 0), as in FLA (kdagen's lower-bound gate is
    that gate). ``initial_state`` and the final state are fp32 ``[N, H, K, V]`` (FLA's
    default), or ``[N, H, V, K]`` with ``state_v_first=True`` (vLLM's layout, the one the
    kernels keep: the K-first layout costs a transposed copy of the state each way).
    ``cu_seqlens`` needs B == 1 (a ``kdagen.prepare_seqlens`` result works too, and then
    nothing is read back to the host); it may end before T (a padded tail: those tokens'
    outputs are left unwritten); ``cu_seqlens_cpu`` and ``disable_recompute`` change
    nothing here (forward only). Refused with a ValueError: ``allow_neg_eigval``,
    ``return_intermediate_states`` (the chunk op's checkpoints do this),
    ``cp_context`` and ``use_graph`` (capture the ops themselves: README).

    Where a call means something else than in FLA (each refused with an error, but the
    padded tail): forward only (an input that requires grad while grad mode is on is
    refused, where FLA would differentiate); the padded tail's outputs are left unwritten
    (FLA's Triton path zeroes them); ``g`` and ``beta`` must have q's dtype, and fp32
    inputs need a spec kdagen cannot build (the matrix units take 16-bit operands); v has
    q's heads and head dim (no GVA, V == K); ``lower_bound`` must be finite and negative;
    keywords FLA would swallow through ``**kwargs`` are a TypeError.

    kdagen's own keywords: ``chunk_size`` and ``block_width`` pick the variant; left out,
    the ones tuned for this shape (``kdagen tune --chunk-sizes``, ``--block-widths``) are
    used where recorded, else the largest valid chunk (64 where the target's LDS allows)
    and the spec's width. A ``prepare_seqlens`` result keeps the chunk size it was
    prepared for; under ``torch.compile`` no tune file is read, so the default chunk is
    used unless ``chunk_size`` is given. ``groups`` forces the chunk-group count.
    """
    for flag, name in ((use_qk_l2norm_in_kernel, "use_qk_l2norm_in_kernel"),
                       (use_gate_in_kernel, "use_gate_in_kernel"),
                       (use_beta_sigmoid_in_kernel, "use_beta_sigmoid_in_kernel")):
        if not flag:
            raise ValueError(f"kda_forward: {name}=False (FLA's default) is not supported: kdagen's "
                             f"prologue always applies it; pass {name}=True with the raw tensors")
    for on, name, why in ((allow_neg_eigval, "allow_neg_eigval", "beta is sigmoid(beta)"),
                          (return_intermediate_states, "return_intermediate_states",
                           "use fused_kda_chunk's checkpoint_offsets for mid-prefill states"),
                          (cp_context is not None, "cp_context", "no context parallelism"),
                          (use_graph, "use_graph", "capture kdagen's ops with chunk_indices (README)")):
        if on:
            raise ValueError(f"kda_forward: {name} is not supported: {why}")
    if torch.is_grad_enabled():
        needs = [name for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                      ("initial_state", initial_state), ("A_log", A_log),
                                      ("dt_bias", dt_bias))
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs:
            raise ValueError(f"kda_forward: forward only, but {', '.join(needs)} require grad: the "
                             "output would carry no gradient (FLA's chunk_kda is differentiable); "
                             "call it under torch.no_grad() or torch.inference_mode(), or detach them")
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"kda_forward: safe_gate=True needs lower_bound in [-5, 0), got {lower_bound}")
    if A_log is None and lower_bound is None:
        raise ValueError("kda_forward: A_log must be given when lower_bound is not set")
    if q.dim() != 4:
        raise ValueError(f"kda_forward: argument 'q' must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    dense = cu_seqlens is None  # B sequences of T tokens: cu_seqlens made below
    if not dense:
        if B != 1:
            raise ValueError(f"kda_forward: with cu_seqlens the batch must be 1, got B = {B}")
    elif B > 1:
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, beta.shape[-1])
    N = B if dense else cu_seqlens.num_seqs if isinstance(cu_seqlens, SeqLens) else cu_seqlens.numel() - 1
    if initial_state is not None:
        if initial_state.dim() != 4 or initial_state.shape[:2] != (N, H):
            raise ValueError(f"kda_forward: argument 'initial_state' must be [{N}, {H}, *, *], got "
                             f"{tuple(initial_state.shape)}")
        if initial_state.dtype != torch.float32:
            raise TypeError(f"kda_forward: argument 'initial_state' must be float32, got "
                            f"{initial_state.dtype}")
        # the kernels keep the state V-first; FLA's default layout is K-first
        initial_state = (initial_state if state_v_first else initial_state.transpose(-1, -2)).contiguous()
    if A_log is None:  # lower_bound sigmoid(g + dt_bias): exp(A_log) = 1
        A_log = torch.zeros(H, dtype=torch.float32, device=q.device)
    if dt_bias is None:
        dt_bias = torch.zeros(H * K, dtype=torch.float32, device=q.device)
    if chunk_size is None and isinstance(cu_seqlens, SeqLens):
        chunk_size = cu_seqlens.chunk_size  # prepared for one chunk size: that one
    if chunk_size is None:
        spec = _default_spec(K, q.dtype, q.device, lower_bound, block_width)
        chunk_size = spec.chunk_size
        if not torch.compiler.is_compiling():  # the chunk size tuned for this shape, if any
            total = q.shape[1]
            tuned = autotune.recorded_chunk_size(spec, N, H, -(-total // max(N, 1)), q.device)
            chunk_size = tuned or chunk_size
    kern = for_inputs(K, q.dtype, q.device, lower_bound=lower_bound, chunk_size=chunk_size,
                      block_width=block_width)
    if dense:  # eager: from the shape, no host read (a tensor would be read back, each call)
        cu_seqlens = (seqlens.dense(B, T, chunk_size, q.device) if seqlens.caching() else
                      torch.arange(B + 1, dtype=torch.int32, device=q.device) * T)

    def scan(num_seqs: int, chunks_per_seq: int):
        # the prologue is the same for every block width; the chunk scan may take a tuned one
        if block_width is not None or torch.compiler.is_compiling():
            return kern
        tuned = autotune.recorded_block_width(kern.spec, num_seqs, H, chunks_per_seq, q.device)
        if tuned is None or tuned == kern.spec.block_width:
            return kern
        return for_inputs(K, q.dtype, q.device, lower_bound=lower_bound, chunk_size=chunk_size,
                          block_width=tuned)

    # u is formed in the chunk scan from v where v's rows allow it (Kernels.prefill)
    o, final = kern.prefill(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                            initial_state, output_final_state, groups=groups, scan=scan)
    if final is not None and not state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o.reshape(B, T, H, v.shape[-1]), final


def _default_spec(head_dim: int, dtype: torch.dtype, device: torch.device,
                  lower_bound: float | None, block_width: int | None):
    """The spec of the largest chunk size (64, 32, 16) the validator takes for this call."""
    errors = []
    for c in (64, 32, 16):
        try:
            return spec_for_inputs(head_dim, dtype, device, lower_bound=lower_bound,
                                   chunk_size=c, block_width=block_width)
        except ValueError as e:
            errors.append(e)
    raise errors[0]
