"""The specification in code: slow, obvious float64 implementations of KDA.

Everything here follows DESIGN.md section 2 literally, in plain torch, on any
device, with all arithmetic in float64; every function returns float64
tensors (``causal_conv_reference`` keeps the dtype of the conv state it
copies). The GPU kernels are tested against these functions, and these
functions are tested against each other (token recurrence vs chunked form vs
chunk groups) in ``tests/test_reference.py``.

Layouts (varlen, batch dimension 1), ``T`` tokens, ``H`` heads, head dims
``K`` (query/key) and ``V`` (value), ``N`` sequences, ``C`` chunk size:

=================  ==========================================================
``q``, ``k``       ``[1, T, H, K]``
``v``              ``[1, T, H, V]``
``raw_g``          ``[1, T, H, K]`` (gate pre-activation)
``raw_beta``       ``[1, T, H]`` (``beta = sigmoid(raw_beta)``)
``A_log``          ``[H]``
``dt_bias``        ``[H * K]`` or ``[H, K]``
``cu_seqlens``     integer ``[N + 1]``; ``None`` means one sequence of ``T``
states             V-first ``[N, H, V, K]``: ``state[n, h, v, k] = S[k, v]``
=================  ==========================================================

Chunk-major tensors (``kg_t``, ``decay``) are numbered as
:func:`kdagen.varlen.prepare_chunk_indices` orders the chunks: sequence by
sequence, chunks in order inside each sequence.

Decays are always formed as ``exp(G_i - G_j)`` (a difference inside the
exponent, masked to ``-inf`` where it is not used), never as a ratio of
``exp(G)`` values.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "l2norm",
    "kda_gate",
    "recurrent_kda_reference",
    "chunk_prologue_reference",
    "chunk_scan_reference",
    "chunk_kda_reference",
    "group_scan_reference",
    "causal_conv_reference",
]

_F64 = torch.float64


# --------------------------------------------------------------------------- #
# elementwise pieces
# --------------------------------------------------------------------------- #


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dim, in float64."""
    x = x.to(_F64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    raw_g: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None
) -> Tensor:
    """Per-token, per-channel log decay ``g`` (natural log), float64 ``[..., H, K]``.

    ``x = raw_g + dt_bias[h, :]``; without ``lower_bound``,
    ``g = -exp(A_log[h]) * softplus(x)`` (``softplus(x) = x`` for ``x > 20``);
    with it, ``g = lower_bound * sigmoid(exp(A_log[h]) * x)``.
    """
    if raw_g.dim() < 2:
        raise ValueError(f"raw_g must be [..., H, K], got shape {tuple(raw_g.shape)}")
    H, K = raw_g.shape[-2], raw_g.shape[-1]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K or dt_bias.dim() not in (1, 2):
        raise ValueError(
            f"dt_bias must be [H*K]={H * K} or [H, K]=[{H}, {K}], got shape {tuple(dt_bias.shape)}"
        )
    x = raw_g.to(_F64) + dt_bias.to(_F64).reshape(H, K)
    a = torch.exp(A_log.to(_F64)).reshape(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return float(lower_bound) * torch.sigmoid(a * x)


# --------------------------------------------------------------------------- #
# argument handling
# --------------------------------------------------------------------------- #


def _bounds(cu_seqlens: Tensor | Sequence[int] | None, T: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` per sequence, after checking ``cu_seqlens``."""
    if cu_seqlens is None:
        return [(0, T)]
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1], got shape {tuple(cu.shape)}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be integer, got {cu.dtype}")
    c = [int(x) for x in cu.tolist()]
    if c[0] != 0 or c[-1] != T or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(
            f"cu_seqlens must be non-decreasing from 0 to T={T}, got {c}"
        )
    return list(zip(c[:-1], c[1:]))


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _initial_states(
    initial_state: Tensor | None, N: int, H: int, K: int, V: int, device: torch.device
) -> Tensor:
    """``[N, H, K, V]`` float64 (K-first, the DESIGN's ``S``) from a V-first state."""
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=_F64, device=device)
    _check_shape("initial_state", initial_state, (N, H, V, K))
    return initial_state.to(device=device, dtype=_F64).transpose(-1, -2).clone()


def _offsets(checkpoint_offsets: Tensor | Sequence[int] | None, N: int) -> list[int] | None:
    if checkpoint_offsets is None:
        return None
    off = torch.as_tensor(checkpoint_offsets)
    if off.dim() != 1 or off.numel() != N:
        raise ValueError(f"checkpoint_offsets must be [N]=[{N}], got shape {list(off.shape)}")
    vals = [int(x) for x in off.tolist()]
    if any(x < 0 for x in vals):
        raise ValueError(f"checkpoint_offsets must be >= 0, got {vals}")
    return vals


def _gated_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound):
    """Validated float64 ``(q_hat, k_hat, v, g, beta)``, each without the batch dim."""
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K], got {getattr(q, 'shape', type(q))}")
    _, T, H, K = q.shape
    _check_shape("k", k, (1, T, H, K))
    if not isinstance(v, Tensor) or v.dim() != 4 or tuple(v.shape[:3]) != (1, T, H):
        raise ValueError(f"v must be [1, T={T}, H={H}, V], got {getattr(v, 'shape', type(v))}")
    _check_shape("raw_g", raw_g, (1, T, H, K))
    _check_shape("raw_beta", raw_beta, (1, T, H))
    dev = q.device
    qh = l2norm(q[0])
    kh = l2norm(k[0].to(dev))
    g = kda_gate(raw_g[0].to(dev), A_log.to(dev), dt_bias.to(dev), lower_bound)
    beta = torch.sigmoid(raw_beta[0].to(device=dev, dtype=_F64))
    return qh, kh, v[0].to(device=dev, dtype=_F64), g, beta


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _scale(scale: float | None, K: int) -> float:
    return K ** -0.5 if scale is None else float(scale)


# --------------------------------------------------------------------------- #
# token recurrence
# --------------------------------------------------------------------------- #


def recurrent_kda_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    raw_g: Tensor,
    raw_beta: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
    checkpoint_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """KDA as a token-by-token recurrence (the definition).

    ``S_t = (I - b k kᵀ) Diag(exp g_t) S_{t-1} + b k vᵀ`` with ``k = l2norm(k_t)``,
    ``b = sigmoid(raw_beta_t)``; ``o_t = scale * S_tᵀ l2norm(q_t)``
    (``scale`` defaults to ``K**-0.5``).

    Returns ``(o [1, T, H, V], final_state [N, H, V, K], checkpoints)``.
    ``checkpoints`` is ``None`` without ``checkpoint_offsets`` (int ``[N]``);
    otherwise ``[N, H, V, K]`` where row ``n`` is the state after the first
    ``checkpoint_offsets[n]`` tokens of sequence ``n``, and zero where the
    offset is 0 or larger than the sequence (no snapshot is taken). A
    zero-length sequence returns its initial state (zeros without one).
    """
    qh, kh, vv, g, beta = _gated_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound)
    T, H, K = qh.shape
    V = vv.shape[-1]
    sc = _scale(scale, K)
    bounds = _bounds(cu_seqlens, T)
    N = len(bounds)
    states = _initial_states(initial_state, N, H, K, V, qh.device)
    offs = _offsets(checkpoint_offsets, N)
    ckpt = None if offs is None else torch.zeros(N, H, K, V, dtype=_F64, device=qh.device)
    o = torch.zeros(T, H, V, dtype=_F64, device=qh.device)
    for n, (bos, eos) in enumerate(bounds):
        S = states[n]  # [H, K, V]
        for t in range(bos, eos):
            S = torch.exp(g[t])[:, :, None] * S  # Diag(exp g_t) S_{t-1}
            kt, bt = kh[t], beta[t][:, None]  # [H, K], [H, 1]
            # (I - b k kᵀ) S' + b k vᵀ  ==  S' + k ⊗ b (v - S'ᵀ k)
            resid = vv[t] - torch.einsum("hkv,hk->hv", S, kt)
            S = S + kt[:, :, None] * (bt * resid)[:, None, :]
            o[t] = sc * torch.einsum("hkv,hk->hv", S, qh[t])
            if ckpt is not None and t - bos + 1 == offs[n]:
                ckpt[n] = S
        states[n] = S
    final = states.transpose(-1, -2).contiguous()
    ckpt_out = None if ckpt is None else ckpt.transpose(-1, -2).contiguous()
    return o.unsqueeze(0), final, ckpt_out


# --------------------------------------------------------------------------- #
# chunked form
# --------------------------------------------------------------------------- #


def _prologue_chunk(qh: Tensor, kh: Tensor, vv: Tensor, g: Tensor, beta: Tensor, scale: float):
    """One chunk of ``n`` valid rows; inputs ``[n, H, *]``. Outputs head-major.

    Returns ``qg [H,n,K], w [H,n,K], u [H,n,V], aqk [H,n,n], kg [H,n,K], decay [H,K],
    akk [H,n,n]``.
    """
    q_, k_, v_, g_ = (x.transpose(0, 1) for x in (qh, kh, vv, g))  # [H, n, *]
    b_ = beta.transpose(0, 1)  # [H, n]
    n = q_.shape[1]
    G = torch.cumsum(g_, dim=1)  # in-chunk inclusive cumsum, [H, n, K]
    diff = G[:, :, None, :] - G[:, None, :, :]  # G_i - G_j, [H, n(i), n(j), K]
    ii = torch.arange(n, device=G.device)
    strict = (ii[:, None] > ii[None, :])[None, :, :, None]
    incl = (ii[:, None] >= ii[None, :])[None, :, :, None]
    neg_inf = torch.tensor(-math.inf, dtype=_F64, device=G.device)
    e_strict = torch.exp(torch.where(strict, diff, neg_inf))
    e_incl = torch.exp(torch.where(incl, diff, neg_inf))
    L = b_[:, :, None] * torch.einsum("hid,hjd,hijd->hij", k_, k_, e_strict)
    aqk = scale * torch.einsum("hid,hjd,hijd->hij", q_, k_, e_incl)
    eye = torch.eye(n, dtype=_F64, device=G.device).expand_as(L)
    IL = eye + L  # unit lower triangular; Akk = IL^{-1}
    w = torch.linalg.solve_triangular(IL, b_[..., None] * k_ * torch.exp(G), upper=False)
    u = torch.linalg.solve_triangular(IL, b_[..., None] * v_, upper=False)
    akk = torch.linalg.solve_triangular(IL, torch.diag_embed(b_), upper=False)  # u = akk v
    G_last = G[:, -1, :]  # [H, K]
    qg = q_ * torch.exp(G)
    kg = k_ * torch.exp(G_last[:, None, :] - G)
    return qg, w, u, aqk, kg, torch.exp(G_last), akk


def chunk_prologue_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    raw_g: Tensor,
    raw_beta: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    chunk_size: int,
    defer_u: bool = False,
) -> dict[str, Tensor]:
    """The operands the GPU prologue produces, in the op contract's shapes (float64).

    With ``G`` the in-chunk inclusive cumsum of ``g`` (chunks never cross a
    sequence boundary; the last one may be partial) and ``i, j`` positions in
    a chunk:

    - ``qg [1,T,H,K] = q_hat * exp(G)`` (no scale);
    - ``w [1,T,H,K] = Akk (beta * k_hat * exp(G))``, ``u [1,T,H,V] = Akk (beta * v)``,
      ``Akk = (I + L)^-1``,
      ``L[i,j] = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])`` for ``j < i``;
    - ``aqk [1,T,H,C]``: row of position ``i`` holds
      ``scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])`` at column ``j <= i``, 0 above;
    - ``kg_t [chunks,H,K,C]``: ``kg_t[c,h,d,j] = k_j[d] exp(G_last[d] - G_j[d])``,
      0 in columns past the end of a partial chunk;
    - ``decay [chunks,H,K] = exp(G_last)``;
    - with ``defer_u`` (as ``fused_kda_prologue(..., defer_u=True)``), ``akk [1,T,H,C]``
      in place of ``u``: row of position ``i`` holds ``Akk[i,j] * beta_j`` at column
      ``j``, so that ``u = akk v`` chunk by chunk; 0 past the chunk's end.
    """
    _check_chunk_size(chunk_size)
    qh, kh, vv, g, beta = _gated_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound)
    T, H, K = qh.shape
    V = vv.shape[-1]
    C = chunk_size
    sc = _scale(scale, K)
    bounds = _bounds(cu_seqlens, T)
    dev = qh.device
    chunks = [(s, min(s + C, eos)) for bos, eos in bounds for s in range(bos, eos, C)]
    nc = len(chunks)
    out = dict(
        qg=torch.zeros(1, T, H, K, dtype=_F64, device=dev),
        w=torch.zeros(1, T, H, K, dtype=_F64, device=dev),
        u=torch.zeros(1, T, H, V, dtype=_F64, device=dev),
        kg_t=torch.zeros(nc, H, K, C, dtype=_F64, device=dev),
        aqk=torch.zeros(1, T, H, C, dtype=_F64, device=dev),
        decay=torch.zeros(nc, H, K, dtype=_F64, device=dev),
        akk=torch.zeros(1, T, H, C, dtype=_F64, device=dev),
    )
    for ci, (s, e) in enumerate(chunks):
        n = e - s
        qg, w, u, aqk, kg, decay, akk = _prologue_chunk(qh[s:e], kh[s:e], vv[s:e], g[s:e], beta[s:e], sc)
        out["akk"][0, s:e, :, :n] = akk.transpose(0, 1)
        out["qg"][0, s:e] = qg.transpose(0, 1)
        out["w"][0, s:e] = w.transpose(0, 1)
        out["u"][0, s:e] = u.transpose(0, 1)
        out["aqk"][0, s:e, :, :n] = aqk.transpose(0, 1)
        out["kg_t"][ci, :, :, :n] = kg.transpose(1, 2)
        out["decay"][ci] = decay
    del out["akk" if not defer_u else "u"]
    return out


def _scan_operands(qg, w, u, kg_t, aqk, decay, cu_seqlens, chunk_size):
    """Validate the chunk-scan operands; return float64 views and chunk bookkeeping."""
    _check_chunk_size(chunk_size)
    if not isinstance(qg, Tensor) or qg.dim() != 4 or qg.shape[0] != 1:
        raise ValueError(f"qg must be [1, T, H, K], got {getattr(qg, 'shape', type(qg))}")
    _, T, H, K = qg.shape
    C = chunk_size
    _check_shape("w", w, (1, T, H, K))
    if not isinstance(u, Tensor) or u.dim() != 4 or tuple(u.shape[:3]) != (1, T, H):
        raise ValueError(f"u must be [1, T={T}, H={H}, V], got {getattr(u, 'shape', type(u))}")
    V = u.shape[-1]
    _check_shape("aqk", aqk, (1, T, H, C))
    bounds = _bounds(cu_seqlens, T)
    first = []  # global index of each sequence's first chunk
    nc = 0
    for bos, eos in bounds:
        first.append(nc)
        nc += -(-(eos - bos) // C)
    _check_shape("kg_t", kg_t, (nc, H, K, C))
    _check_shape("decay", decay, (nc, H, K))
    dev = qg.device
    f = lambda x: x.to(device=dev, dtype=_F64)  # noqa: E731
    ops = dict(qg=f(qg[0]), w=f(w[0]), u=f(u[0]), aqk=f(aqk[0]), kg_t=f(kg_t), decay=f(decay))
    return ops, bounds, first, (T, H, K, V)


def _chunk_ops(ops: dict[str, Tensor], ci: int, s: int, e: int):
    """Head-major operands of global chunk ``ci`` covering tokens ``[s, e)``."""
    n = e - s
    return (
        ops["qg"][s:e].transpose(0, 1),  # [H, n, K]
        ops["w"][s:e].transpose(0, 1),  # [H, n, K]
        ops["u"][s:e].transpose(0, 1),  # [H, n, V]
        ops["kg_t"][ci, :, :, :n],  # [H, K, n]
        ops["aqk"][s:e, :, :n].transpose(0, 1),  # [H, n, n]
        ops["decay"][ci],  # [H, K]
    )


def _chunk_step(S: Tensor, qg, w, u, kgt, aqk, decay, scale: float) -> tuple[Tensor, Tensor]:
    """One chunk: ``v_new = u - w S``; ``o = scale qg S + aqk v_new``;
    ``S <- Diag(decay) S + kgᵀ v_new``. ``S`` is ``[H, K, V]``; returns ``(o [H,n,V], S)``."""
    v_new = u - w @ S
    o = scale * (qg @ S) + aqk @ v_new
    return o, decay[:, :, None] * S + kgt @ v_new


def chunk_scan_reference(
    qg: Tensor,
    w: Tensor,
    u: Tensor,
    kg_t: Tensor,
    aqk: Tensor,
    decay: Tensor,
    *,
    scale: float,
    cu_seqlens: Tensor | None = None,
    chunk_size: int,
    initial_state: Tensor | None = None,
    checkpoint_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The serial chunk walk over the prologue's operands.

    Per sequence, per chunk in order: ``v_new = u - w S``;
    ``o = scale * qg S + aqk v_new``; ``S <- Diag(decay) S + kgᵀ v_new``.
    Returns ``(o [1,T,H,V], final_state [N,H,V,K], checkpoints)``, with
    checkpoints as in :func:`recurrent_kda_reference`; every non-zero
    checkpoint offset must be a multiple of ``chunk_size`` (``ValueError``
    otherwise).
    """
    ops, bounds, first, (T, H, K, V) = _scan_operands(qg, w, u, kg_t, aqk, decay, cu_seqlens, chunk_size)
    C = chunk_size
    N = len(bounds)
    dev = ops["qg"].device
    states = _initial_states(initial_state, N, H, K, V, dev)
    offs = _offsets(checkpoint_offsets, N)
    if offs is not None and any(x % C for x in offs):
        raise ValueError(f"checkpoint_offsets must be multiples of chunk_size={C}, got {offs}")
    ckpt = None if offs is None else torch.zeros(N, H, K, V, dtype=_F64, device=dev)
    o = torch.zeros(T, H, V, dtype=_F64, device=dev)
    for n, (bos, eos) in enumerate(bounds):
        S = states[n]
        for c, s in enumerate(range(bos, eos, C)):
            e = min(s + C, eos)
            oc, S = _chunk_step(S, *_chunk_ops(ops, first[n] + c, s, e), scale)
            o[s:e] = oc.transpose(0, 1)
            if ckpt is not None and offs[n] > 0 and e - bos == offs[n]:
                ckpt[n] = S
        states[n] = S
    final = states.transpose(-1, -2).contiguous()
    ckpt_out = None if ckpt is None else ckpt.transpose(-1, -2).contiguous()
    return o.unsqueeze(0), final, ckpt_out


def chunk_kda_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    raw_g: Tensor,
    raw_beta: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    chunk_size: int,
    initial_state: Tensor | None = None,
    checkpoint_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`chunk_prologue_reference` followed by :func:`chunk_scan_reference`;
    same result as :func:`recurrent_kda_reference` up to rounding."""
    sc = _scale(scale, q.shape[-1])
    ops = chunk_prologue_reference(
        q, k, v, raw_g, raw_beta, A_log, dt_bias,
        scale=sc, lower_bound=lower_bound, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )
    return chunk_scan_reference(
        **ops, scale=sc, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        initial_state=initial_state, checkpoint_offsets=checkpoint_offsets,
    )


def group_scan_reference(
    qg: Tensor,
    w: Tensor,
    u: Tensor,
    kg_t: Tensor,
    aqk: Tensor,
    decay: Tensor,
    *,
    scale: float,
    cu_seqlens: Tensor | None = None,
    chunk_size: int,
    groups: int,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunk walk computed the way the parallel chunk-group kernels do.

    Each sequence's ``nc`` chunks are cut into ``groups`` groups of
    ``ceil(nc / groups)`` consecutive chunks (trailing groups may be empty).
    Pass one: per group, the transfer ``A_g = M_last ... M_first`` with
    ``M_c = Diag(decay_c) - kg_cᵀ w_c`` and the zero-start end state ``B_g``.
    Scan: ``S_start(0) = initial state``, ``S_start(g+1) = A_g S_start(g) + B_g``
    (the last one is the final state). Pass two: walk each group from its
    start state, producing the outputs. Returns ``(o [1,T,H,V], final_state [N,H,V,K])``.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    ops, bounds, first, (T, H, K, V) = _scan_operands(qg, w, u, kg_t, aqk, decay, cu_seqlens, chunk_size)
    C = chunk_size
    N = len(bounds)
    dev = ops["qg"].device
    states = _initial_states(initial_state, N, H, K, V, dev)
    o = torch.zeros(T, H, V, dtype=_F64, device=dev)
    eye = torch.eye(K, dtype=_F64, device=dev).expand(H, K, K)
    for n, (bos, eos) in enumerate(bounds):
        nc = -(-(eos - bos) // C)
        per = -(-nc // groups)
        spans = [range(min(gi * per, nc), min((gi + 1) * per, nc)) for gi in range(groups)]

        def chunk(c: int):
            s = bos + c * C
            return s, min(s + C, eos), _chunk_ops(ops, first[n] + c, s, min(s + C, eos))

        # pass one: transfer and zero-start state of every group (independent)
        transfer, zero_start = [], []
        for span in spans:
            A = eye.clone()
            B = torch.zeros(H, K, V, dtype=_F64, device=dev)
            for c in span:
                _, _, (_, wc, uc, kgt, _, dc) = chunk(c)
                M = torch.diag_embed(dc) - kgt @ wc  # [H, K, K]
                A = M @ A
                B = M @ B + kgt @ uc
            transfer.append(A)
            zero_start.append(B)
        # scan over groups
        starts = [states[n]]
        for A, B in zip(transfer, zero_start):
            starts.append(A @ starts[-1] + B)
        # pass two: each group from its true start state
        for span, S in zip(spans, starts):
            for c in span:
                s, e, chunk_ops = chunk(c)
                oc, S = _chunk_step(S, *chunk_ops, scale)
                o[s:e] = oc.transpose(0, 1)
        states[n] = starts[-1]
    return o.unsqueeze(0), states.transpose(-1, -2).contiguous()


# --------------------------------------------------------------------------- #
# short convolution
# --------------------------------------------------------------------------- #


def causal_conv_reference(
    x: Tensor,
    weight: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    conv_state: Tensor | None = None,
    conv_state_indices: Tensor | None = None,
    has_initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Depthwise causal conv + SiLU per sequence, with an optional rolling state.

    ``x [1, T, Ch]``, ``weight [Ch, W]``:
    ``y[t, c] = silu(sum_j weight[c, j] * x[t - (W-1) + j, c])``. Positions before
    the start of sequence ``n`` come from ``conv_state[idx, c, :]`` (layout
    ``[slots, Ch, W-1]``, oldest first) when ``has_initial_state[n]`` is true,
    and are zero otherwise; ``idx = conv_state_indices[n]`` (default ``n``).
    ``has_initial_state`` defaults to all false.

    Returns ``(y [1, T, Ch] float64, new_conv_state)``. ``new_conv_state`` is
    ``None`` without ``conv_state``; otherwise a copy of it (same dtype) in
    which each addressed row (``idx >= 0``) holds the last ``W-1`` entries of
    ``[prefix ; x of the sequence]``, oldest first. A negative ``idx`` means
    the row is neither read (zeros are used) nor written.
    """
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be [1, T, Ch], got {getattr(x, 'shape', type(x))}")
    _, T, Ch = x.shape
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != Ch or weight.shape[1] < 1:
        raise ValueError(f"weight must be [Ch={Ch}, W>=1], got {getattr(weight, 'shape', type(weight))}")
    W = weight.shape[1]
    bounds = _bounds(cu_seqlens, T)
    N = len(bounds)
    dev = x.device
    xx = x[0].to(_F64)
    wt = weight.to(device=dev, dtype=_F64)
    new_state = None
    if conv_state is not None:
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (Ch, W - 1):
            raise ValueError(
                f"conv_state must be [slots, Ch={Ch}, W-1={W - 1}], got {list(conv_state.shape)}"
            )
        new_state = conv_state.clone()
    if conv_state_indices is None:
        idx = list(range(N))
    else:
        ci = torch.as_tensor(conv_state_indices)
        if ci.dim() != 1 or ci.numel() != N:
            raise ValueError(f"conv_state_indices must be [N]=[{N}], got {list(ci.shape)}")
        idx = [int(i) for i in ci.tolist()]
    if conv_state is not None and any(i >= conv_state.shape[0] for i in idx):
        raise ValueError(f"conv_state_indices must be < slots={conv_state.shape[0]}, got {idx}")
    if has_initial_state is None:
        init = [False] * N
    else:
        hs = torch.as_tensor(has_initial_state)
        if hs.dim() != 1 or hs.numel() != N:
            raise ValueError(f"has_initial_state must be [N]=[{N}], got {list(hs.shape)}")
        init = [bool(b) for b in hs.tolist()]
    y = torch.zeros(T, Ch, dtype=_F64, device=dev)
    for n, (bos, eos) in enumerate(bounds):
        prefix = torch.zeros(W - 1, Ch, dtype=_F64, device=dev)
        if conv_state is not None and idx[n] >= 0 and init[n]:
            prefix = conv_state[idx[n]].to(device=dev, dtype=_F64).transpose(0, 1)  # [W-1, Ch]
        xp = torch.cat([prefix, xx[bos:eos]], dim=0)  # [W-1+L, Ch]
        L = eos - bos
        acc = torch.zeros(L, Ch, dtype=_F64, device=dev)
        for j in range(W):  # tap j reads x[t - (W-1) + j] == xp[t + j]
            acc = acc + wt[:, j] * xp[j : j + L]
        y[bos:eos] = F.silu(acc)
        if new_state is not None and idx[n] >= 0 and W > 1:
            new_state[idx[n]] = xp[xp.shape[0] - (W - 1) :].transpose(0, 1).to(new_state.dtype)
    return y.unsqueeze(0), new_state


def blocked_unit_lower_inverse(L: Tensor, block: int = 16) -> Tensor:
    """(I + L)^-1 for strictly lower-triangular ``L`` [C, C], in the order the prologue's
    matrix-unit solve computes it (prologue.h, phase 6): each diagonal block's inverse by
    forward substitution, then block row by block row
    ``Ainv_ij = -Inv_ii * sum_{k=j}^{i-1} L_ik Ainv_kj``. Only L's strictly lower entries
    are read. A mirror of the kernel's algorithm for the CPU tests, not a fast path."""
    C = L.shape[-1]
    if C % block:
        raise ValueError(f"blocked_unit_lower_inverse: size {C} is not a multiple of {block}")
    nb = C // block
    A = torch.zeros_like(L)
    blk = lambda i, j: (slice(block * i, block * (i + 1)), slice(block * j, block * (j + 1)))
    for b in range(nb):
        Lb = L[blk(b, b)]
        inv = torch.zeros_like(Lb)
        for c in range(block):
            x = torch.zeros(block, dtype=L.dtype, device=L.device)
            for r in range(block):
                x[r] = (1.0 if r == c else 0.0) - (Lb[r, :r] * x[:r]).sum()
            inv[:, c] = x
        A[blk(b, b)] = inv
    for i in range(1, nb):
        for j in range(i):
            t = sum(L[blk(i, k)] @ A[blk(k, j)] for k in range(j, i))
            A[blk(i, j)] = -A[blk(i, i)] @ t
    return A
