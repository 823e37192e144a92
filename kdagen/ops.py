"""The op wrappers of one variant, with the production wrapper's contracts.

``Kernels`` holds a variant's spec and its registered torch ops. Its methods check
every argument (kdagen/checks.py), allocate outputs and workspaces from the
caching allocator, and launch on the current stream without synchronising.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from typing import Callable, Mapping, Sequence

import torch

from . import checks as ck
from . import autotune
from . import resources, seqlens
from .groups import (cuda_index, group_workspace, groups_for_spec, num_compute_units,
                     planned_residency, segments_for_spec)
from .spec import KernelSpec

IO_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Kernels:
    """A loaded variant. ``ops`` maps op names (recurrent, prologue, chunk) to callables."""

    def __init__(self, spec: KernelSpec, ops: Mapping[str, Callable[..., None]], library: str = "",
                 device_type: str = "cuda",
                 residency: Callable[[], Sequence[int]] | None = None):
        self.spec = spec
        self.ops = dict(ops)
        self.library = library
        self.dtype = IO_DTYPES[spec.io_dtype]
        self.device_type = device_type  # "cpu" for the emulated kernels (kdagen/emulate.py)
        # the chunk op's occupancy query on the current device: (walks with outputs, pass
        # one) blocks per compute unit, 0 where the runtime cannot tell; per device index
        # the residency walk_residency made of it
        self._residency_query = residency
        self._residency: dict[int, tuple[int, int]] = {}

    def __repr__(self) -> str:
        return f"Kernels({self.spec.name}, ops={sorted(self.ops)})"

    @property
    def checkpoint_alignment(self) -> int:
        """What a non-zero checkpoint offset must be a multiple of: the chunk size (the
        production wrapper's ``KDA_CHECKPOINT_ALIGNMENT``, per variant here)."""
        return self.spec.chunk_size

    @functools.cached_property
    def scan_forms_u(self) -> bool:
        """Whether ``prefill`` leaves u to the chunk scan (``defer_u``) on this variant:
        where the scan stages u / o through LDS, with the akk tile beside them. Elsewhere
        (CDNA at chunk 64, u / o per element: the akk operand would be read per element
        too, and the walk spills more) the prologue forms u."""
        from .render import chunk_plan_for

        return chunk_plan_for(self.spec).stage_uo

    # ---- helpers -------------------------------------------------------------------------

    def _op(self, name: str) -> Callable[..., None]:
        if name not in self.ops:
            raise NotImplementedError(
                f"{self.spec.name} was built without the {name} op (ops: {', '.join(self.spec.ops)})"
            )
        return self.ops[name]

    def _gate(self, op: str, lower_bound: float | None) -> float:
        if self.spec.gate == "lower_bound":
            if lower_bound is None or not math.isfinite(lower_bound) or lower_bound >= 0:
                raise ck.ArgumentError(
                    f"{op}: argument 'lower_bound' must be a finite negative float for the "
                    f"lower-bound gate of {self.spec.name}, got {lower_bound!r}"
                )
            return float(lower_bound)
        if lower_bound is not None:
            raise ck.ArgumentError(
                f"{op}: argument 'lower_bound' = {lower_bound!r}, but {self.spec.name} uses the "
                "softplus gate; pass None, or load a spec with gate: lower_bound"
            )
        return 0.0

    def _gpu(self, op: str, t: torch.Tensor, name: str) -> torch.device:
        if t.device.type != self.device_type:
            where = "a GPU" if self.device_type == "cuda" else "the CPU (emulated kernels)"
            raise ck.ArgumentError(f"{op}: argument '{name}' must be on {where}, got {t.device}")
        return t.device

    def _head_params(self, op: str, A_log: object, dt_bias: object, H: int, dev: torch.device):
        D = self.spec.head_dim
        a = ck.tensor(op, "A_log", A_log, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                      device=dev)
        b = ck.tensor(op, "dt_bias", dt_bias, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                      device=dev)
        if a.numel() != H:
            raise ck.ArgumentError(f"{op}: argument 'A_log' must hold H = {H} values, got shape "
                                   f"{tuple(a.shape)}")
        if b.numel() != H * D:
            raise ck.ArgumentError(f"{op}: argument 'dt_bias' must hold H * K = {H * D} values, got "
                                   f"shape {tuple(b.shape)}")
        b = b.reshape(-1).float().contiguous()
        if not ck.tracing() and b.data_ptr() % 16 != 0:
            b = b.clone()  # the kernels read dt_bias as float4
        return a.reshape(-1).float().contiguous(), b

    @functools.cached_property
    def chunk_plan(self) -> resources.ChunkPlan:
        """The variant's chunk plan (``render.chunk_plan_for``), worked out once, at its first
        use, and kept: the group and segment heuristics read it on every call (working it
        out took ~9 us a grouped call). The kernels were compiled under the same resource
        constants."""
        from .render import chunk_plan_for

        return chunk_plan_for(self.spec)

    def walk_residency(self, dev: torch.device) -> tuple[int, int]:
        """Walk blocks one compute unit of ``dev`` holds at once: (the walks with outputs,
        pass one), from the runtime's occupancy calculator for the kernels as compiled
        (registers, LDS, launch bounds; asked once per device, the answer kept). Where the
        runtime cannot tell (0: the emulation, unless KDAGEN_EMULATE_RESIDENT), while
        tracing before it was asked, or without the chunk op: the chunk plan's
        (``groups.planned_residency``), which counts no registers."""
        key = cuda_index(dev) if dev.type == "cuda" else (dev.index or 0)
        got = self._residency.get(key)
        if got is not None:
            return got
        planned = planned_residency(self.spec, self.chunk_plan)
        if self._residency_query is None or ck.tracing():
            return planned
        on_dev = torch.cuda.device(key) if dev.type == "cuda" else contextlib.nullcontext()
        with on_dev:
            told = [int(n) for n in self._residency_query()]
        got = (told[0] or planned[0], told[1] or planned[1])
        self._residency[key] = got
        return got

    def heuristic_groups(self, chunks_per_seq: int, N: int, H: int, dev: torch.device) -> int:
        """``groups.groups_for_spec`` on ``dev``, with the walks' residency as compiled."""
        return groups_for_spec(self.spec, chunks_per_seq, N, H, num_compute_units(dev),
                               resident=self.walk_residency(dev)[0], plan=self.chunk_plan)

    def heuristic_segments(self, groups: int, N: int, H: int, dev: torch.device) -> int:
        """``groups.segments_for_spec`` on ``dev``, with pass one's residency as compiled."""
        return segments_for_spec(self.spec, groups, N, H, num_compute_units(dev),
                                 resident=self.walk_residency(dev)[1], plan=self.chunk_plan)

    def _choose_groups(self, chunks_per_seq: int, N: int, H: int, dev: torch.device) -> int:
        """KDAGEN_GROUPS, else a tuned choice from the autotune cache (tuned now with
        KDAGEN_AUTOTUNE=1 if none is recorded), else the heuristic of groups.py."""

        def heuristic() -> int:
            return self.heuristic_groups(chunks_per_seq, N, H, dev)

        if os.environ.get("KDAGEN_GROUPS") or ck.tracing():
            return heuristic()
        g = autotune.recorded_groups(self.spec, N, H, chunks_per_seq, dev)
        if g is None and autotune.autotune_on_first_use() and not autotune.capturing():
            try:
                g = autotune.tune_groups(self, N, H, chunks_per_seq, device=dev)["groups"]
            except RuntimeError as e:  # e.g. out of memory for the synthetic batch
                print(f"kdagen: autotuning {self.spec.name} failed ({e}); using the heuristic",
                      file=sys.stderr, flush=True)
        return g if g is not None else heuristic()

    # ---- decode ----------------------------------------------------------------------------

    def fused_recurrent_kda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float | None,
        lower_bound: float | None,
        state_cache: torch.Tensor,
        state_indices: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step for N sequences: q, k, v, raw_g ``[N, H, D]`` (last dim
        contiguous, any token / head strides), raw_beta ``[N, H]``. Reads and writes the
        fp32 ``state_cache [slots, H, V, K]`` rows ``state_indices [N]``; a negative index
        skips its sequence (zero output, no state touched). Returns ``out [N, H, V]``."""
        op = "fused_recurrent_kda"
        fn = self._op("recurrent")
        D, dt = self.spec.head_dim, self.dtype
        q = ck.tensor(op, "q", q, ndim=3, dtypes=(dt,), last_contiguous=True)
        N, H = q.shape[0], q.shape[1]
        shp = (N, H, D)
        ck.tensor(op, "q", q, shape=shp)
        for name, t in (("k", k), ("v", v), ("raw_g", raw_g)):
            ck.tensor(op, name, t, shape=shp, dtypes=(dt,), last_contiguous=True)
        ck.tensor(op, "raw_beta", raw_beta, shape=(N, H), dtypes=(dt,))
        ck.tensor(op, "state_cache", state_cache, shape=(None, H, D, D), dtypes=(torch.float32,),
                  contiguous=True)
        ck.optional(op, "out", out, shape=shp, dtypes=(dt,), contiguous=True)
        dev = self._gpu(op, q, "q")
        ck.same_device(op, q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, state_cache=state_cache,
                       out=out)
        idx = ck.indices(op, "state_indices", state_indices, N, state_cache.shape[0], dev)
        a_log, bias = self._head_params(op, A_log, dt_bias, H, dev)
        lb = self._gate(op, lower_bound)
        if out is None:
            out = _empty(N, H, D, dtype=dt, device=dev)
        fn(q, k, v, raw_g, raw_beta, a_log, bias, state_cache,
           idx.to(torch.int32).contiguous(), out, _scale(scale, D), lb)
        return out

    # ---- prefill: prologue -----------------------------------------------------------------

    def fused_kda_prologue(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float | None,
        lower_bound: float | None,
        cu_seqlens: torch.Tensor | seqlens.SeqLens,
        conv_weight: torch.Tensor | None = None,
        conv_state: torch.Tensor | None = None,
        conv_state_indices: torch.Tensor | None = None,
        conv_has_initial_state: torch.Tensor | None = None,
        chunk_indices: torch.Tensor | None = None,
        *,
        defer_u: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The whole chunk-path prologue in one launch (plus one for the conv-state
        update). q/k/v/raw_g ``[1, T, H, D]`` may be strided last-dim views of one fused
        projection; raw_beta ``[1, T, H]`` any strides. Returns ``qg, w, u`` ``[1, T, H, D]``,
        ``kg_t [chunks, H, D, C]``, ``aqk [1, T, H, C]`` (scale folded in) and fp32
        ``decay [chunks, H, D]``. With ``conv_weight [3*H*D, W]`` the raw bands first go
        through the causal depthwise conv + SiLU, and ``conv_state [slots, 3*H*D, W-1]``
        rows ``conv_state_indices`` are updated in place; a sequence reads its row's
        history only where ``conv_has_initial_state`` is true (None: none does, as in
        vLLM's causal conv). ``scale`` (None: D^-1/2) is folded into ``aqk``: give
        ``fused_kda_chunk`` the same one, which applies it to the state's term.

        ``defer_u=True`` leaves u to the chunk scan: v is not read, and ``akk
        [1, T, H, C]`` = (I + L)^-1 Diag(beta) takes u's place in the result (pass it
        to ``fused_kda_chunk(..., akk=akk)`` with the raw v as ``u``). Fewer bytes move
        (C in place of D values per token and head, twice) and the prologue does less."""
        return self._prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound,
                              cu_seqlens, conv_weight, conv_state, conv_state_indices,
                              conv_has_initial_state, chunk_indices, defer_u)[0]

    def _prologue(self, q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                  conv_weight, conv_state, conv_state_indices, conv_has_initial_state,
                  chunk_indices, defer_u: bool,
                  check: Callable[[seqlens.SeqLens, int, torch.device, int], None] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], seqlens.SeqLens]:
        """``fused_kda_prologue``, also returning the checked ``cu_seqlens`` (for prefill);
        ``check(cu_seqlens, H, device, chunks)`` runs after its own checks, before any
        launch."""
        op = "fused_kda_prologue"
        fn = self._op("prologue")
        D, C, dt = self.spec.head_dim, self.spec.chunk_size, self.dtype
        q = ck.tensor(op, "q", q, ndim=4, dtypes=(dt,), last_contiguous=True)
        if q.shape[0] != 1:
            raise ck.ArgumentError(f"{op}: argument 'q' must have batch 1 (varlen layout "
                                   f"[1, T, H, D]), got shape {tuple(q.shape)}")
        T, H = q.shape[1], q.shape[2]
        shp = (1, T, H, D)
        ck.tensor(op, "q", q, shape=shp)
        for name, t in (("k", k), ("v", v), ("raw_g", raw_g)):
            ck.tensor(op, name, t, shape=shp, dtypes=(dt,), last_contiguous=True)
        ck.tensor(op, "raw_beta", raw_beta, shape=(1, T, H), dtypes=(dt,))
        dev = self._gpu(op, q, "q")
        ck.same_device(op, q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta)
        sl = seqlens.checked(op, cu_seqlens, T, dev, C)
        N = sl.num_seqs
        a_log, bias = self._head_params(op, A_log, dt_bias, H, dev)
        lb = self._gate(op, lower_bound)
        if conv_weight is not None:
            W = self.spec.conv_width
            if W == 0:
                raise ck.ArgumentError(f"{op}: argument 'conv_weight' given, but {self.spec.name} "
                                       "was built without the fused conv (conv_width: 0)")
            ck.tensor(op, "conv_weight", conv_weight, shape=(3 * H * D, W), dtypes=(torch.float32,),
                      device=dev, contiguous=True)
            if conv_state is not None:
                ck.tensor(op, "conv_state", conv_state, shape=(None, 3 * H * D, W - 1),
                          dtypes=(torch.float32,), device=dev, contiguous=True)
                if conv_state_indices is None:
                    raise ck.ArgumentError(f"{op}: argument 'conv_state_indices' is required with "
                                           "conv_state")
                conv_state_indices = ck.indices(op, "conv_state_indices", conv_state_indices, N,
                                                conv_state.shape[0], dev).to(torch.int32).contiguous()
                if conv_has_initial_state is not None:
                    ck.flags(op, "conv_has_initial_state", conv_has_initial_state, N, dev)
            elif conv_state_indices is not None or conv_has_initial_state is not None:
                raise ck.ArgumentError(f"{op}: argument 'conv_state_indices' / "
                                       "'conv_has_initial_state' need conv_state")
            if defer_u:
                raise ck.ArgumentError(f"{op}: argument 'defer_u' needs the raw v, but conv_weight "
                                       "makes v a convolution: the chunk scan cannot form u from it; "
                                       "pass defer_u=False with conv_weight")
        else:
            for name, t in (("conv_state", conv_state), ("conv_state_indices", conv_state_indices),
                            ("conv_has_initial_state", conv_has_initial_state)):
                if t is not None:
                    raise ck.ArgumentError(f"{op}: argument '{name}' needs conv_weight")
        if chunk_indices is None:
            ci = sl.indices()
        else:  # the caller's indices must be the ones cu_seqlens implies
            ci = ck.tensor(op, "chunk_indices", chunk_indices, ndim=2, dtypes=ck.INDEX_DTYPES,
                           device=dev)
            if ci.shape[1] != 2:
                raise ck.ArgumentError(f"{op}: argument 'chunk_indices' must be [chunks, 2], got "
                                       f"{tuple(ci.shape)}")
            if ck.values_checkable():
                ck.same_values(op, "chunk_indices", ci, sl.indices(), "the rows")
        ci = ci.to(torch.int32).contiguous()
        nchunks = ci.shape[0]
        if check is not None:
            check(sl, H, dev, nchunks)

        empty = _allocator()

        def like(last: int) -> torch.Tensor:
            return empty(1, T, H, last, dtype=dt, device=dev)

        ws = dict(
            qg=like(D), w=like(D), **({"akk": like(C)} if defer_u else {"u": like(D)}),
            kg_t=empty(nchunks, H, D, C, dtype=dt, device=dev),
            aqk=like(C),
            decay=empty(nchunks, H, D, dtype=torch.float32, device=dev),
        )
        fn(q, k, v, raw_g, raw_beta, a_log, bias, ws["qg"], ws["w"], ws.get("u"), ws["kg_t"],
           ws["aqk"], ws["decay"], sl.cu32, ci, conv_weight, conv_state,
           conv_state_indices, conv_has_initial_state, _scale(scale, D), lb, ws.get("akk"))
        return ws, sl

    # ---- prefill: both ----------------------------------------------------------------------

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        scale: float | None,
        lower_bound: float | None,
        cu_seqlens: torch.Tensor | seqlens.SeqLens,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        *,
        groups: int | None = None,
        chunk_indices: torch.Tensor | None = None,
        scan: "Callable[[int, int], Kernels] | None" = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prologue and the chunk scan of one prefill, ``(o [1, T, H, V], final_state)``.
        u is formed inside the scan from the raw v (``defer_u``: fewer bytes, a lighter
        prologue) where v's rows can be copied as 16-byte pieces, else by the prologue (the
        same result up to rounding). ``scan(num_seqs, chunks_per_seq)`` may name the variant
        that walks (this spec at another block width); default this one."""
        op = "prefill"
        D = self.spec.head_dim
        defer = self.scan_forms_u and ck.rows16_ok(v)
        walk = self

        def check_walk(sl: seqlens.SeqLens, H: int, dev: torch.device, chunks: int) -> None:
            """What the scan takes from the caller, checked before the prologue launches."""
            nonlocal walk
            ck.optional(op, "initial_state", initial_state, shape=(sl.num_seqs, H, D, D),
                        dtypes=(torch.float32,), device=dev, contiguous=True)
            if groups is not None:
                ck.group_count(op, groups)
            if scan is not None:
                walk = scan(sl.num_seqs, chunks // max(sl.num_seqs, 1))
                if (walk.spec.head_dim, walk.spec.chunk_size, walk.dtype) != (D, self.spec.chunk_size,
                                                                              self.dtype):
                    raise ck.ArgumentError(f"{op}: argument 'scan' gave {walk.spec.name}, whose head "
                                           f"dim, chunk size or dtype is not {self.spec.name}'s")

        p, sl = self._prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, scale, lower_bound,
                               cu_seqlens, None, None, None, None, chunk_indices, defer, check_walk)
        if defer:
            u, out = v, _empty(*p["w"].shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
        else:  # the scan reads each chunk's u before it writes that chunk's output: o takes u's place
            u = out = p["u"]
        # The prologue's outputs and the cu_seqlens it checked go to the walk as they are;
        # what the caller gave (v as u, the initial state, groups) was checked before the
        # prologue's launch.
        return walk._walk(p["qg"], p["w"], u, p["kg_t"], p["aqk"], p["decay"], out, scale, sl,
                          sl.chunk_offsets, initial_state, output_final_state, None, None, None,
                          None, None, None, groups, None, p.get("akk"), q.device)

    # ---- prefill: chunk scan ---------------------------------------------------------------

    def fused_kda_chunk(
        self,
        qg: torch.Tensor,
        w: torch.Tensor,
        u: torch.Tensor,
        kg_t: torch.Tensor,
        aqk: torch.Tensor,
        decay: torch.Tensor,
        out: torch.Tensor,
        scale: float | None,
        cu_seqlens: torch.Tensor | seqlens.SeqLens,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        chunk_offsets: torch.Tensor | None = None,
        checkpoint_state: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
        checkpoint_state_indices: torch.Tensor | None = None,
        state_cache: torch.Tensor | None = None,
        state_indices: torch.Tensor | None = None,
        has_initial_state: torch.Tensor | None = None,
        *,
        groups: int | None = None,
        segments: int | None = None,
        akk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk recurrence and the output projection. States are fp32 V-first
        ``[N, H, V, K]``. ``state_cache [slots, H, V, K]`` with ``state_indices`` /
        ``has_initial_state`` replaces ``initial_state`` / ``output_final_state``: each
        sequence's row is read (or zero) and its final state written back in place, and
        the returned final state is None. ``checkpoint_offsets [N]`` (multiples of the
        chunk size, ``checkpoint_alignment``; 0 = none) snapshot the state after that many
        tokens into ``checkpoint_state`` row n, or row ``checkpoint_state_indices[n]``
        (negative = none). An offset off the alignment or past its sequence is an error
        here, where the production wrapper's kernel skips it silently (the kernels here
        skip it too where values cannot be read: CUDA-graph capture, torch.compile,
        ``KDAGEN_CHECK_VALUES=0``). ``out`` may alias ``u``. ``groups`` overrides the chunk-group heuristic,
        ``segments`` (1 .. groups - 1) the count of pass one's segments (groups.py).

        ``akk`` (from ``fused_kda_prologue(..., defer_u=True)``): ``u`` is then the raw v
        ``[1, T, H, V]`` (a strided last-dim view is fine, rows 16-byte aligned) and the
        scan forms u = akk v chunk by chunk."""
        op = "fused_kda_chunk"
        self._op("chunk")  # (a variant built without the op says so first)
        if state_cache is not None:
            if initial_state is not None or output_final_state:
                raise ValueError("state_cache replaces initial_state/output_final_state")
            if state_indices is None or has_initial_state is None:
                raise ValueError("state_cache needs state_indices and has_initial_state")
        D, C, dt = self.spec.head_dim, self.spec.chunk_size, self.dtype
        qg = ck.tensor(op, "qg", qg, ndim=4, dtypes=(dt,), contiguous=True, aligned=16)
        T, H = qg.shape[1], qg.shape[2]
        shp = (1, T, H, D)
        ck.tensor(op, "qg", qg, shape=shp)
        for name, t in (("w", w), ("out", out)) + ((("u", u),) if akk is None else ()):
            ck.tensor(op, name, t, shape=shp, dtypes=(dt,), contiguous=True, aligned=16)
        if akk is not None:  # u is the raw v, read as 16-byte pieces of its rows
            ck.tensor(op, "u", u, shape=shp, dtypes=(dt,), last_contiguous=True)
            ck.rows16(op, "u", u, "(with akk, u is the raw v, read as 16-byte pieces)")
            ck.tensor(op, "akk", akk, shape=(1, T, H, C), dtypes=(dt,), contiguous=True, aligned=16)
        kg = ck.tensor(op, "kg_t", kg_t, ndim=4, dtypes=(dt,), contiguous=True, aligned=16)
        nchunks = kg.shape[0]
        ck.tensor(op, "kg_t", kg_t, shape=(nchunks, H, D, C))
        ck.tensor(op, "aqk", aqk, shape=(1, T, H, C), dtypes=(dt,), contiguous=True, aligned=16)
        ck.tensor(op, "decay", decay, shape=(nchunks, H, D), dtypes=(torch.float32,), contiguous=True,
                  aligned=16)  # read as 16-byte copies
        dev = self._gpu(op, qg, "qg")
        ck.same_device(op, qg, w=w, u=u, kg_t=kg_t, aqk=aqk, decay=decay, out=out, akk=akk)
        sl = seqlens.checked(op, cu_seqlens, T, dev, C)
        N = sl.num_seqs
        st = (N, H, D, D)
        ck.optional(op, "initial_state", initial_state, shape=st, dtypes=(torch.float32,),
                    device=dev, contiguous=True)
        if state_cache is not None:
            ck.tensor(op, "state_cache", state_cache, shape=(None, H, D, D), dtypes=(torch.float32,),
                      device=dev, contiguous=True)
            state_indices = ck.indices(op, "state_indices", state_indices, N, state_cache.shape[0],
                                       dev).to(torch.int32).contiguous()
            ck.flags(op, "has_initial_state", has_initial_state, N, dev)
        elif state_indices is not None or has_initial_state is not None:
            raise ck.ArgumentError(f"{op}: argument 'state_indices' / 'has_initial_state' need "
                                   "state_cache")
        if checkpoint_offsets is not None:
            if checkpoint_state is None:
                raise ck.ArgumentError(f"{op}: argument 'checkpoint_offsets' needs checkpoint_state")
            ck.tensor(op, "checkpoint_state", checkpoint_state, shape=(None, H, D, D),
                      dtypes=(torch.float32,), device=dev, contiguous=True)
            offs = ck.tensor(op, "checkpoint_offsets", checkpoint_offsets, shape=(N,),
                             dtypes=ck.INDEX_DTYPES, device=dev)
            if checkpoint_state_indices is not None:
                checkpoint_state_indices = ck.indices(
                    op, "checkpoint_state_indices", checkpoint_state_indices, N,
                    checkpoint_state.shape[0], dev,
                    distinct=False,  # a sequence whose offset is 0 writes no row
                ).to(torch.int32).contiguous()
            elif checkpoint_state.shape[0] < N:
                raise ck.ArgumentError(f"{op}: argument 'checkpoint_state' needs a row per sequence "
                                       f"({N}) without checkpoint_state_indices, got "
                                       f"{checkpoint_state.shape[0]}")
            if ck.values_checkable():
                _check_checkpoints(op, offs, sl.cu32, C)
            checkpoint_offsets = offs.to(torch.int32).contiguous()
        else:
            if checkpoint_state_indices is not None:
                raise ck.ArgumentError(f"{op}: argument 'checkpoint_state_indices' needs "
                                       "checkpoint_offsets")
            ck.optional(op, "checkpoint_state", checkpoint_state, shape=(None, H, D, D),
                        dtypes=(torch.float32,), device=dev, contiguous=True)
        cu32, want = sl.cu32, sl.chunk_offsets
        if chunk_offsets is None:
            co = want
        else:
            co = ck.tensor(op, "chunk_offsets", chunk_offsets, shape=(N + 1,),
                           dtypes=ck.INDEX_DTYPES, device=dev).to(torch.int32).contiguous()
            if ck.values_checkable():
                ck.same_values(op, "chunk_offsets", co, want, "offsets")
        if ck.values_checkable():
            made = sl.num_chunks if sl.num_chunks is not None else int(want[-1])
            if made != nchunks:
                raise ck.ArgumentError(f"{op}: argument 'kg_t' holds {nchunks} chunks, but "
                                       f"cu_seqlens makes {made} chunks of {C}")

        return self._walk(qg, w, u, kg_t, aqk, decay, out, scale, sl, co, initial_state,
                          output_final_state, checkpoint_state, checkpoint_offsets, checkpoint_state_indices,
                          state_cache, state_indices, has_initial_state, groups, segments, akk, dev)

    def _walk(self, qg, w, u, kg_t, aqk, decay, out, scale, sl: seqlens.SeqLens,
              chunk_offsets: torch.Tensor, initial_state, output_final_state: bool, checkpoint_state,
              checkpoint_offsets, checkpoint_state_indices, state_cache, state_indices,
              has_initial_state, groups: int | None, segments: int | None, akk,
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk scan's launch on checked arguments (``fused_kda_chunk``'s, or
        ``prefill``'s: the prologue's outputs as they came): the group and segment
        counts, the final state and the workspace (one allocator), the op."""
        op = "fused_kda_chunk"
        fn = self._op("chunk")
        N, H, D, nchunks = sl.num_seqs, qg.shape[2], self.spec.head_dim, kg_t.shape[0]
        empty = _allocator()
        final_state = empty(N, H, D, D, dtype=torch.float32, device=dev) if output_final_state else None
        if groups is None:
            groups = self._choose_groups(nchunks // max(N, 1), N, H, dev)
        groups = ck.group_count(op, groups)
        if segments is None:  # (0, one per group, where no compute units can be read: the emulation)
            segments = self.heuristic_segments(groups, N, H, dev) if dev.type == "cuda" else 0
        segments = ck.segment_count(op, segments, groups)
        workspace = group_workspace(groups, N * H, D, dev, alloc=empty, segments=segments)
        fn(qg, w, u, kg_t, aqk, decay, out, sl.cu32, chunk_offsets, _scale(scale, D), initial_state,
           final_state, workspace, int(groups), checkpoint_state, checkpoint_offsets,
           checkpoint_state_indices, state_cache, state_indices, has_initial_state, akk,
           int(segments))
        return out, final_state


def _poisoned(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _allocator() -> Callable[..., torch.Tensor]:
    """torch.empty, or a NaN-filled allocation with KDAGEN_POISON=1 so tests see unwritten
    elements (decided once per call of an op: the environment is read once)."""
    if not ck.tracing() and os.environ.get("KDAGEN_POISON", "") not in ("", "0"):
        return _poisoned
    return torch.empty


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``_allocator()``'s allocation."""
    return _allocator()(*shape, dtype=dtype, device=device)


def _scale(scale: float | None, head_dim: int) -> float:
    return float(head_dim ** -0.5 if scale is None else scale)


def _check_checkpoints(op: str, offs: torch.Tensor, cu: torch.Tensor, C: int) -> None:
    n = offs.numel()  # the offsets and the sequence lengths in one host read
    both = torch.cat([offs.to(torch.int64), (cu[1:] - cu[:-1]).to(torch.int64)]).tolist()
    o, lens = both[:n], both[n:]
    for n, (x, ln) in enumerate(zip(o, lens)):
        if x == 0:
            continue
        if x < 0 or x % C != 0:
            raise ck.ArgumentError(f"{op}: argument 'checkpoint_offsets' [{n}] = {x} must be 0 or a "
                                   f"positive multiple of the chunk size {C}")
        if x > ln:
            raise ck.ArgumentError(f"{op}: argument 'checkpoint_offsets' [{n}] = {x} is past the end "
                                   f"of its sequence (length {ln})")
