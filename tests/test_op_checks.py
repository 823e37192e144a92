"""CPU tests of the op wrappers' argument checks (kdagen/ops.py, kdagen/checks.py).

Contract (seed + DESIGN.md section 3): bad input never reaches a kernel. Wrong rank, shape,
dtype, device, stride / contiguity / alignment, bad cu_seqlens, out-of-range state / conv /
checkpoint indices raise ValueError / TypeError naming the argument, before any launch, and
leave caches untouched; the seed's own state_cache errors are kept verbatim.

There is no GPU here. ``Kernels`` is built with fake ops that record their calls (and
scribble on the fp32 state-like tensors they receive, as a kernel would, so a leaked
launch is visible in the caches too). The wrappers demand GPU tensors: with plain CPU
tensors every shape / dtype / rank / stride error of the leading tensor block is raised
before the device check, and an otherwise valid call fails naming 'must be on a GPU'.
To get past the device check (value checks of cu_seqlens, index ranges, checkpoint
alignment, head params, gate, conv) the ``gpu`` fixture monkeypatches
``kdagen.ops.Kernels._gpu`` to return the tensor's own device, and
``kdagen.ops.num_compute_units`` to return 132 (it reads CUDA device properties); with that
patch a valid CPU call does reach the fake op, and the tests assert it is called exactly
once for a valid call and never for an invalid one.

Every malformed call must raise before the (fake) op runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdagen.ops as kops
from kdagen.checks import ArgumentError
from kdagen.groups import (MAX_GROUPS, chunk_groups, group_start, group_workspace, pass_one_segments,
                           segments_of)
from kdagen.ops import Kernels
from kdagen.render import chunk_plan_for
from kdagen.spec import KernelSpec
from kdagen.varlen import prepare_chunk_indices, prepare_chunk_offsets

D, C = 64, 16  # small variant: head_dim 64, chunk 16, block width 64 (pass blocks 2 / 1)
BASE = {"head_dim": D, "chunk_size": C}
BF, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I32, I64 = torch.int32, torch.int64
SEED_REPLACES = "state_cache replaces initial_state/output_final_state"
SEED_NEEDS = "state_cache needs state_indices and has_initial_state"

# recurrent batch: N sequences, H heads, SLOTS cache rows
RN, RH, SLOTS = 3, 2, 5
# prefill batch (varlen): a zero-length sequence in the middle; chunks = 2 + 0 + 3
LENS = [20, 0, 44]
T = sum(LENS)
PH = 2
N = len(LENS)
NCHUNKS = sum(-(-n // C) for n in LENS)
CU = [0, 20, 20, 64]


# ---- fixtures and helpers -----------------------------------------------------------------


class FakeOp:
    """Records every call; writes +1 into fp32 contiguous tensors (state-like buffers)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)
        for a in args:
            if isinstance(a, torch.Tensor) and a.dtype == F32 and a.is_contiguous() and a.numel():
                a.add_(1.0)


def make_kernels(**spec_over) -> tuple[Kernels, FakeOp]:
    fake = FakeOp()
    spec = KernelSpec.parse({**BASE, **spec_over})
    return Kernels(spec, ops={"recurrent": fake, "prologue": fake, "chunk": fake}), fake


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("KDAGEN_GROUPS", "KDAGEN_CHECK_VALUES", "KDAGEN_POISON"):
        monkeypatch.delenv(var, raising=False)


def _patch_gpu(mp: pytest.MonkeyPatch) -> None:
    # Pretend CPU tensors are on "the GPU": _gpu returns the tensor's device, and the CU
    # count (read from CUDA device properties) is an H100/MI300-like 132.
    mp.setattr(kops.Kernels, "_gpu", staticmethod(lambda op, t, name: t.device))
    mp.setattr(kops, "num_compute_units", lambda dev: 132)


@pytest.fixture
def gpu(monkeypatch):
    _patch_gpu(monkeypatch)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rnd(*shape: int, dtype: torch.dtype = BF, g: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (an integer view of a dense copy): NaN-safe, exact."""
    flat = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def snapshot(args: dict) -> dict:
    """The bits of every CPU tensor argument, keyed by name, with the object itself."""
    return {k: (v, bits(v)) for k, v in args.items()
            if isinstance(v, torch.Tensor) and v.device.type == "cpu"}


def assert_untouched(args: dict, snap: dict) -> None:
    """Every tensor still passed (same object) keeps its bits: caches are not written."""
    checked = 0
    for k, (obj, b) in snap.items():
        if args.get(k) is obj:
            assert torch.equal(bits(obj), b), f"{k} was modified by a failing call"
            checked += 1
    assert checked > 0


def nc_last(t: torch.Tensor) -> torch.Tensor:
    """Same values, last-dim stride 2."""
    x = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    x[..., ::2] = t
    v = x[..., ::2]
    assert v.stride(-1) == 2
    return v


def nc_rows(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dim contiguous but padded rows: not contiguous."""
    n = t.shape[-1]
    x = torch.zeros(*t.shape[:-1], n + 8, dtype=t.dtype)
    x[..., :n] = t
    v = x[..., :n]
    assert not v.is_contiguous() and v.stride(-1) == 1
    return v


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view at an odd element offset of a buffer: data_ptr not 16-byte aligned."""
    buf = torch.zeros(t.numel() + 16, dtype=t.dtype)
    off = next(i for i in range(1, 16) if (buf.data_ptr() + i * buf.element_size()) % 16)
    v = buf[off:off + t.numel()].view(t.shape)
    v.copy_(t)
    assert v.is_contiguous() and v.data_ptr() % 16 != 0
    return v


def resized(t: torch.Tensor, dim: int, delta: int = 1) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] += delta
    return torch.zeros(shape, dtype=t.dtype)


def names(exc: BaseException, name: str) -> bool:
    return f"'{name}'" in str(exc)


@dataclass
class Bad:
    id: str
    mutate: Callable[[dict], None]
    exc: type[Exception]
    name: str
    pre: bool = False  # raised before the device check (also with plain CPU tensors)


def put(key: str, fn: Callable) -> Callable[[dict], None]:
    def m(a: dict) -> None:
        a[key] = fn(a[key]) if callable(fn) else fn

    return m


def put_value(key: str, value) -> Callable[[dict], None]:
    def m(a: dict) -> None:
        a[key] = value() if callable(value) else value

    return m


def multi(*ms: Callable[[dict], None]) -> Callable[[dict], None]:
    def m(a: dict) -> None:
        for x in ms:
            x(a)

    return m


def tensor_cases(name: str, *, dtype_bad, rank, shape, pre: bool, last=False, contig=False,
                 align=False, nontensor=True, meta=True) -> list[Bad]:
    """The standard malformations of one tensor argument."""
    out = []
    if nontensor:
        out.append(Bad(f"{name}-nontensor", put_value(name, lambda: [[1.0, 2.0]]), TypeError, name, pre))
    out.append(Bad(f"{name}-dtype", put(name, lambda t: t.to(dtype_bad)), TypeError, name, pre))
    out.append(Bad(f"{name}-rank", put(name, rank), ValueError, name, pre))
    for i, s in enumerate(shape):
        out.append(Bad(f"{name}-shape{i}", put(name, s), ValueError, name, pre))
    if last:
        out.append(Bad(f"{name}-last-dim-strided", put(name, nc_last), ValueError, name, pre))
    if contig:
        out.append(Bad(f"{name}-noncontiguous", put(name, nc_rows), ValueError, name, pre))
    if align:
        out.append(Bad(f"{name}-misaligned", put(name, misaligned), ValueError, name, pre))
    if meta:
        out.append(Bad(f"{name}-other-device", put(name, lambda t: t.to("meta")), ValueError, name))
    return out


def params(cases: list[Bad]):
    return [pytest.param(c, id=c.id) for c in cases]


def run_bad(fn: Callable[..., object], fake: FakeOp, args: dict, case: Bad) -> None:
    snap = snapshot(args)  # taken before the mutation: the caches must keep their bits
    case.mutate(args)
    with pytest.raises(case.exc) as ei:
        fn(**args)
    assert names(ei.value, case.name), f"message does not name '{case.name}': {ei.value}"
    if case.exc is ValueError:  # the wrapper's own refusals are ArgumentError (a ValueError)
        assert isinstance(ei.value, ArgumentError), repr(ei.value)
    assert not fake.calls, "a malformed call reached the kernel"
    assert_untouched(args, snap)


def run_ok(fn: Callable[..., object], fake: FakeOp, args: dict):
    res = fn(**args)
    assert len(fake.calls) == 1
    return res


# ---- argument sets ------------------------------------------------------------------------


def rec_args() -> dict:
    g = _gen(1)
    return dict(
        q=rnd(RN, RH, D, g=g), k=rnd(RN, RH, D, g=g), v=rnd(RN, RH, D, g=g),
        raw_g=rnd(RN, RH, D, g=g), raw_beta=rnd(RN, RH, g=g),
        A_log=rnd(RH, dtype=F32, g=g), dt_bias=rnd(RH * D, dtype=F32, g=g),
        scale=None, lower_bound=None,
        state_cache=rnd(SLOTS, RH, D, D, dtype=F32, g=g),
        state_indices=torch.tensor([0, SLOTS - 1, -1], dtype=I32),
        out=None,
    )


def pro_args() -> dict:
    g = _gen(2)
    return dict(
        q=rnd(1, T, PH, D, g=g), k=rnd(1, T, PH, D, g=g), v=rnd(1, T, PH, D, g=g),
        raw_g=rnd(1, T, PH, D, g=g), raw_beta=rnd(1, T, PH, g=g),
        A_log=rnd(PH, dtype=F32, g=g), dt_bias=rnd(PH, D, dtype=F32, g=g),
        scale=None, lower_bound=None, cu_seqlens=torch.tensor(CU, dtype=I32),
    )


CONV_W = 4
CONV_SLOTS = 4


def conv_args() -> dict:
    g = _gen(3)
    a = pro_args()
    a.update(
        conv_weight=rnd(3 * PH * D, CONV_W, dtype=F32, g=g),
        conv_state=rnd(CONV_SLOTS, 3 * PH * D, CONV_W - 1, dtype=F32, g=g),
        conv_state_indices=torch.tensor([1, -1, CONV_SLOTS - 1], dtype=I32),
        conv_has_initial_state=torch.tensor([True, False, True]),
    )
    return a


def chunk_args(**extra) -> dict:
    g = _gen(4)
    a = dict(
        qg=rnd(1, T, PH, D, g=g), w=rnd(1, T, PH, D, g=g), u=rnd(1, T, PH, D, g=g),
        kg_t=rnd(NCHUNKS, PH, D, C, g=g), aqk=rnd(1, T, PH, C, g=g),
        decay=rnd(NCHUNKS, PH, D, dtype=F32, g=g), out=rnd(1, T, PH, D, g=g),
        scale=None, cu_seqlens=torch.tensor(CU, dtype=I32),
        initial_state=None, output_final_state=False,
    )
    a.update(extra)
    return a


def cache_extra() -> dict:
    return dict(
        state_cache=rnd(SLOTS, PH, D, D, dtype=F32, g=_gen(5)),
        state_indices=torch.tensor([2, -1, 0], dtype=I32),
        has_initial_state=torch.tensor([True, False, False]),
    )


def ckpt_extra(indexed: bool = False) -> dict:
    e = dict(checkpoint_state=torch.zeros(4 if indexed else N, PH, D, D),
             checkpoint_offsets=torch.tensor([16, 0, 32], dtype=I32))
    if indexed:
        e["checkpoint_state_indices"] = torch.tensor([3, 0, -1], dtype=I32)
    return e


# ---- recurrent ----------------------------------------------------------------------------

_rq = (RN, RH, D)
REC_BAD: list[Bad] = []
for _n in ("q", "k", "v", "raw_g"):
    REC_BAD += tensor_cases(
        _n, dtype_bad=F16, rank=lambda t: t.unsqueeze(0), pre=True, last=True, meta=_n != "q",
        shape=[lambda t: resized(t, 0), lambda t: resized(t, 1), lambda t: resized(t, 2, -32)]
        if _n != "q" else [lambda t: resized(t, 2, 1)],
    )
REC_BAD += tensor_cases("raw_beta", dtype_bad=F32, rank=lambda t: t.unsqueeze(-1), pre=True,
                        shape=[lambda t: resized(t, 0), lambda t: resized(t, 1)])
REC_BAD += tensor_cases(
    "state_cache", dtype_bad=BF, rank=lambda t: t[0], pre=True, contig=True,
    shape=[lambda t: resized(t, 1), lambda t: resized(t, 2), lambda t: resized(t, 3, -1)],
)
REC_BAD.append(Bad("state_cache-transposed", put("state_cache", lambda t: t.transpose(-1, -2)),
                   ValueError, "state_cache", True))
REC_BAD += [
    Bad("out-nontensor", put_value("out", 1.0), TypeError, "out", True),
    Bad("out-dtype", put_value("out", lambda: torch.zeros(_rq, dtype=F32)), TypeError, "out", True),
    Bad("out-shape", put_value("out", lambda: torch.zeros(RN, RH, D + 1, dtype=BF)), ValueError,
        "out", True),
    Bad("out-rank", put_value("out", lambda: torch.zeros(RN * RH, D, dtype=BF)), ValueError,
        "out", True),
    Bad("out-noncontiguous", put_value("out", lambda: nc_rows(torch.zeros(_rq, dtype=BF))),
        ValueError, "out", True),
    Bad("out-other-device", put_value("out", lambda: torch.zeros(_rq, dtype=BF, device="meta")),
        ValueError, "out"),
]
REC_BAD += tensor_cases("state_indices", dtype_bad=F32, rank=lambda t: t.unsqueeze(0), pre=False,
                        shape=[lambda t: resized(t, 0), lambda t: resized(t, 0, -1)])
REC_BAD += [
    Bad("state_indices-out-of-range", put_value("state_indices", lambda: torch.tensor(
        [0, SLOTS, -1], dtype=I32)), ValueError, "state_indices"),
    Bad("state_indices-far-out-of-range-int64", put_value("state_indices", lambda: torch.tensor(
        [2**40, 0, 1], dtype=I64)), ValueError, "state_indices"),
    # -2^32 + 1 and -2^32 cast to int32 are rows 1 and 0: they must not reach the kernel
    Bad("state_indices-int64-wraps-to-a-row", put_value("state_indices", lambda: torch.tensor(
        [2, -(2**32) + 1, -(2**32)], dtype=I64)), ValueError, "state_indices"),
    Bad("state_indices-bool", put_value("state_indices", lambda: torch.ones(RN, dtype=torch.bool)),
        TypeError, "state_indices"),
]
REC_BAD += tensor_cases("A_log", dtype_bad=I64, rank=lambda t: t, pre=False,
                        shape=[lambda t: resized(t, 0)])[0:2] + [
    Bad("A_log-numel", put("A_log", lambda t: resized(t, 0)), ValueError, "A_log"),
    Bad("A_log-other-device", put("A_log", lambda t: t.to("meta")), ValueError, "A_log"),
    Bad("dt_bias-nontensor", put_value("dt_bias", 0.5), TypeError, "dt_bias"),
    Bad("dt_bias-dtype", put("dt_bias", lambda t: t.to(I32)), TypeError, "dt_bias"),
    Bad("dt_bias-numel", put("dt_bias", lambda t: t[:-1]), ValueError, "dt_bias"),
    Bad("dt_bias-other-device", put("dt_bias", lambda t: t.to("meta")), ValueError, "dt_bias"),
    Bad("lower_bound-given-to-softplus", put_value("lower_bound", -5.0), ValueError, "lower_bound"),
]


@pytest.mark.parametrize("case", params(REC_BAD))
def test_recurrent_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_recurrent_kda, fake, rec_args(), case)


@pytest.mark.parametrize("case", params([c for c in REC_BAD if c.pre]))
def test_recurrent_rejects_before_device_check(case):
    """Without the _gpu patch: the same error, raised before 'must be on a GPU'."""
    kern, fake = make_kernels()
    run_bad(kern.fused_recurrent_kda, fake, rec_args(), case)


def test_recurrent_cpu_tensors_need_gpu():
    kern, fake = make_kernels()
    a = rec_args()
    snap = snapshot(a)
    with pytest.raises(ValueError, match="must be on a GPU") as ei:
        kern.fused_recurrent_kda(**a)
    assert names(ei.value, "q") and not fake.calls
    assert_untouched(a, snap)


@pytest.mark.parametrize("lb", [None, 0.0, 1.0, math.nan, -math.inf, math.inf])
def test_recurrent_lower_bound_spec_needs_negative_finite(gpu, lb):
    kern, fake = make_kernels(gate="lower_bound")
    a = rec_args()
    run_bad(kern.fused_recurrent_kda, fake, a, Bad("lb", put_value("lower_bound", lb), ValueError,
                                                   "lower_bound"))


def test_recurrent_valid(gpu):
    kern, fake = make_kernels()
    a = rec_args()
    out = run_ok(kern.fused_recurrent_kda, fake, a)
    call = fake.calls[0]
    assert out.shape == (RN, RH, D) and out.dtype == BF
    assert call[0] is a["q"] and call[7] is a["state_cache"]
    assert call[8].dtype == I32 and call[8].tolist() == [0, SLOTS - 1, -1]
    assert call[10] == pytest.approx(D ** -0.5) and call[11] == 0.0


def test_recurrent_valid_lower_bound_and_out(gpu):
    kern, fake = make_kernels(gate="lower_bound")
    a = rec_args()
    a.update(lower_bound=-5.0, out=torch.empty(RN, RH, D, dtype=BF), scale=0.25,
             state_indices=torch.tensor([4, 3, 2], dtype=I64))
    out = run_ok(kern.fused_recurrent_kda, fake, a)
    assert out is a["out"] and fake.calls[0][9] is a["out"]
    assert fake.calls[0][10] == 0.25 and fake.calls[0][11] == -5.0


def test_recurrent_accepts_strided_and_misaligned_views(gpu):
    """q/k/v/raw_g need only a contiguous last dim (any token/head strides, and the kernel
    reads them element-wise, so no 16-byte alignment); raw_beta any strides."""
    kern, fake = make_kernels()
    a = rec_args()
    proj = rnd(RN, 4 * RH * D + RH + 1)
    views = {n: proj[:, 1 + i * RH * D:1 + (i + 1) * RH * D].unflatten(-1, (RH, D))
             for i, n in enumerate(("q", "k", "v", "raw_g"))}
    views["raw_beta"] = proj[:, 1 + 4 * RH * D:]
    assert views["q"].data_ptr() % 16 != 0
    a.update(views)
    run_ok(kern.fused_recurrent_kda, fake, a)
    for i, n in enumerate(("q", "k", "v", "raw_g", "raw_beta")):
        got = fake.calls[0][i]
        assert got.data_ptr() == views[n].data_ptr() and got.stride() == views[n].stride()


def test_recurrent_failing_call_leaves_cache(gpu):
    kern, fake = make_kernels()
    a = rec_args()
    before = bits(a["state_cache"])
    a["state_indices"] = torch.tensor([0, 1, SLOTS], dtype=I32)
    with pytest.raises(ValueError):
        kern.fused_recurrent_kda(**a)
    assert torch.equal(bits(a["state_cache"]), before) and not fake.calls


def test_recurrent_missing_op():
    fake = FakeOp()
    kern = Kernels(KernelSpec.parse({**BASE, "ops": ["recurrent"]}), ops={"recurrent": fake})
    with pytest.raises(NotImplementedError):
        kern.fused_kda_chunk(**chunk_args())


# ---- prologue -----------------------------------------------------------------------------

_pq = (1, T, PH, D)
PRO_BAD: list[Bad] = []
for _n in ("q", "k", "v", "raw_g"):
    shapes = [lambda t: resized(t, 1), lambda t: resized(t, 2), lambda t: resized(t, 3, -32)]
    if _n == "q":
        shapes = [lambda t: resized(t, 3, -32), lambda t: resized(t, 0)]  # D; batch != 1
    else:
        shapes.append(lambda t: resized(t, 0))
    PRO_BAD += tensor_cases(_n, dtype_bad=F16, rank=lambda t: t[0], pre=True, last=True,
                            meta=_n != "q", shape=shapes)
PRO_BAD += tensor_cases("raw_beta", dtype_bad=F32, rank=lambda t: t.unsqueeze(-1), pre=True,
                        shape=[lambda t: resized(t, 0), lambda t: resized(t, 1),
                               lambda t: resized(t, 2)])


def _cu(vals, dtype=I32):
    return lambda: torch.tensor(vals, dtype=dtype)


CU_BAD = [
    Bad("cu_seqlens-nontensor", put_value("cu_seqlens", list(CU)), TypeError, "cu_seqlens"),
    Bad("cu_seqlens-float", put_value("cu_seqlens", _cu(CU, F32)), TypeError, "cu_seqlens"),
    Bad("cu_seqlens-bool", put_value("cu_seqlens", _cu([0, 1, 1, 1], torch.bool)), TypeError,
        "cu_seqlens"),
    Bad("cu_seqlens-2d", put_value("cu_seqlens", lambda: torch.tensor([CU], dtype=I32)),
        ValueError, "cu_seqlens"),
    Bad("cu_seqlens-one-entry", put_value("cu_seqlens", _cu([0])), ValueError, "cu_seqlens"),
    Bad("cu_seqlens-not-from-0", put_value("cu_seqlens", _cu([4, 20, 20, 64])), ValueError,
        "cu_seqlens"),
    Bad("cu_seqlens-past-T", put_value("cu_seqlens", _cu([0, 20, 20, 80], I64)), ValueError,
        "cu_seqlens"),
    Bad("cu_seqlens-non-monotone", put_value("cu_seqlens", _cu([0, 40, 20, 64])), ValueError,
        "cu_seqlens"),
    Bad("cu_seqlens-other-device", put("cu_seqlens", lambda t: t.to("meta")), ValueError,
        "cu_seqlens"),
]
HEAD_BAD = [
    Bad("A_log-nontensor", put_value("A_log", [1.0, 2.0]), TypeError, "A_log"),
    Bad("A_log-dtype", put("A_log", lambda t: t.to(I32)), TypeError, "A_log"),
    Bad("A_log-numel", put("A_log", lambda t: resized(t, 0)), ValueError, "A_log"),
    Bad("dt_bias-nontensor", put_value("dt_bias", None), TypeError, "dt_bias"),
    Bad("dt_bias-dtype", put("dt_bias", lambda t: t.to(F64)), TypeError, "dt_bias"),
    Bad("dt_bias-numel", put("dt_bias", lambda t: resized(t, 1)), ValueError, "dt_bias"),
    Bad("dt_bias-other-device", put("dt_bias", lambda t: t.to("meta")), ValueError, "dt_bias"),
]
PRO_BAD += CU_BAD + HEAD_BAD + [
    Bad("lower_bound-given-to-softplus", put_value("lower_bound", -1.0), ValueError, "lower_bound"),
    Bad("conv_weight-given-to-conv_width-0",
        put_value("conv_weight", lambda: torch.zeros(3 * PH * D, CONV_W)), ValueError,
        "conv_weight"),
    Bad("conv_state-needs-conv_weight",
        put_value("conv_state", lambda: torch.zeros(CONV_SLOTS, 3 * PH * D, CONV_W - 1)),
        ValueError, "conv_state"),
    Bad("chunk_indices-nontensor", put_value("chunk_indices", [[0, 0]]), TypeError, "chunk_indices"),
    Bad("chunk_indices-float", put_value("chunk_indices", lambda: torch.zeros(NCHUNKS, 2)),
        TypeError, "chunk_indices"),
    Bad("chunk_indices-rank", put_value("chunk_indices", lambda: torch.zeros(NCHUNKS * 2,
                                                                             dtype=I32)),
        ValueError, "chunk_indices"),
    Bad("chunk_indices-shape", put_value("chunk_indices", lambda: torch.zeros(NCHUNKS, 3,
                                                                              dtype=I32)),
        ValueError, "chunk_indices"),
    Bad("chunk_indices-other-device", put_value("chunk_indices", lambda: torch.zeros(
        NCHUNKS, 2, dtype=I32, device="meta")), ValueError, "chunk_indices"),
]


@pytest.mark.parametrize("case", params(PRO_BAD))
def test_prologue_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_prologue, fake, pro_args(), case)


@pytest.mark.parametrize("case", params([c for c in PRO_BAD if c.pre]))
def test_prologue_rejects_before_device_check(case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_prologue, fake, pro_args(), case)


def test_prologue_cpu_tensors_need_gpu():
    kern, fake = make_kernels()
    with pytest.raises(ValueError, match="must be on a GPU") as ei:
        kern.fused_kda_prologue(**pro_args())
    assert names(ei.value, "q") and not fake.calls


@pytest.mark.parametrize("lb", [None, 0.0, 0.5, math.nan, -math.inf])
def test_prologue_lower_bound_spec_needs_negative_finite(gpu, lb):
    kern, fake = make_kernels(gate="lower_bound")
    run_bad(kern.fused_kda_prologue, fake, pro_args(),
            Bad("lb", put_value("lower_bound", lb), ValueError, "lower_bound"))


def test_prologue_valid(gpu):
    kern, fake = make_kernels()
    a = pro_args()
    ws = run_ok(kern.fused_kda_prologue, fake, a)
    assert {k: tuple(v.shape) for k, v in ws.items()} == {
        "qg": _pq, "w": _pq, "u": _pq, "kg_t": (NCHUNKS, PH, D, C), "aqk": (1, T, PH, C),
        "decay": (NCHUNKS, PH, D)}
    assert list(ws) == ["qg", "w", "u", "kg_t", "aqk", "decay"]  # the seed's order
    assert {k: v.dtype for k, v in ws.items()} == {
        "qg": BF, "w": BF, "u": BF, "kg_t": BF, "aqk": BF, "decay": F32}
    call = fake.calls[0]
    assert call[14].tolist() == prepare_chunk_indices(a["cu_seqlens"], C).tolist()
    assert call[15] is None and call[16] is None and call[20] == 0.0


def test_prologue_valid_lower_bound_int64_cu_and_chunk_indices(gpu):
    kern, fake = make_kernels(gate="lower_bound")
    a = pro_args()
    cu = torch.tensor(CU, dtype=I64)
    a.update(lower_bound=-3.0, cu_seqlens=cu, chunk_indices=prepare_chunk_indices(cu, C).long())
    run_ok(kern.fused_kda_prologue, fake, a)
    call = fake.calls[0]
    assert call[13].dtype == I32 and call[14].dtype == I32 and call[20] == -3.0


def test_prologue_and_chunk_accept_a_padded_tail(gpu):
    """cu_seqlens may end before T (an engine's CUDA-graph padding): the tail tokens belong
    to no sequence, the kernels get the chunk bookkeeping of the sequences alone."""
    pad = [0, 20, 20, 60]  # T = 64: four tokens of padding
    kern, fake = make_kernels()
    a = pro_args()
    a.update(cu_seqlens=torch.tensor(pad, dtype=I32))
    run_ok(kern.fused_kda_prologue, fake, a)
    assert fake.calls[0][14].tolist() == prepare_chunk_indices(torch.tensor(pad), C).tolist()
    kern, fake = make_kernels()
    out, _ = run_ok(kern.fused_kda_chunk, fake, chunk_args(cu_seqlens=torch.tensor(pad, dtype=I64)))
    assert fake.calls[0][7].tolist() == pad
    assert fake.calls[0][8].tolist() == prepare_chunk_offsets(torch.tensor(pad), C).tolist()


def test_prologue_accepts_fused_projection_views(gpu):
    """q/k/v/raw_g/raw_beta as strided last-dim views of one fused projection: accepted, and
    the kernel gets the views themselves (same data_ptr and strides), not copies."""
    kern, fake = make_kernels()
    a = pro_args()
    width = 4 * PH * D + PH + 8
    proj = rnd(1, T, width)
    views = {n: proj[..., i * PH * D:(i + 1) * PH * D].unflatten(-1, (PH, D))
             for i, n in enumerate(("q", "k", "v", "raw_g"))}
    views["raw_beta"] = proj[..., 4 * PH * D:4 * PH * D + PH]
    for n, t in views.items():
        assert not t.is_contiguous() and t.stride(-1) == 1 and t.stride(1) == width
        a[n] = t
    run_ok(kern.fused_kda_prologue, fake, a)
    for i, n in enumerate(("q", "k", "v", "raw_g", "raw_beta")):
        got = fake.calls[0][i]
        assert got is views[n] or (got.data_ptr() == views[n].data_ptr()
                                   and got.stride() == views[n].stride())


def test_prologue_accepts_misaligned_views(gpu):
    """The prologue reads q/k/v/raw_g element-wise (prologue.h 'raw'), so an odd offset is fine."""
    kern, fake = make_kernels()
    a = pro_args()
    a["q"] = misaligned(a["q"])
    run_ok(kern.fused_kda_prologue, fake, a)
    assert fake.calls[0][0].data_ptr() == a["q"].data_ptr()


# -- prologue with the fused conv --

CONV_BAD: list[Bad] = [
    Bad("conv_weight-nontensor", put_value("conv_weight", 1.0), TypeError, "conv_weight"),
    Bad("conv_weight-dtype", put("conv_weight", lambda t: t.to(BF)), TypeError, "conv_weight"),
    Bad("conv_weight-width", put("conv_weight", lambda t: resized(t, 1, -1)), ValueError,
        "conv_weight"),
    Bad("conv_weight-channels", put("conv_weight", lambda t: t[: 2 * PH * D]), ValueError,
        "conv_weight"),
    Bad("conv_weight-rank", put("conv_weight", lambda t: t.unsqueeze(0)), ValueError, "conv_weight"),
    Bad("conv_weight-noncontiguous", put("conv_weight", lambda t: t.t().contiguous().t()),
        ValueError, "conv_weight"),
    Bad("conv_weight-other-device", put("conv_weight", lambda t: t.to("meta")), ValueError,
        "conv_weight"),
    Bad("conv_state-nontensor", put_value("conv_state", "cache"), TypeError, "conv_state"),
    Bad("conv_state-dtype", put("conv_state", lambda t: t.to(BF)), TypeError, "conv_state"),
    Bad("conv_state-width", put("conv_state", lambda t: resized(t, 2)), ValueError, "conv_state"),
    Bad("conv_state-channels", put("conv_state", lambda t: resized(t, 1, -1)), ValueError,
        "conv_state"),
    Bad("conv_state-noncontiguous", put("conv_state", nc_rows), ValueError, "conv_state"),
    Bad("conv_state-other-device", put("conv_state", lambda t: t.to("meta")), ValueError,
        "conv_state"),
    Bad("conv_state_indices-missing", put_value("conv_state_indices", None), ValueError,
        "conv_state_indices"),
    Bad("conv_state_indices-out-of-range", put_value("conv_state_indices", _cu([0, CONV_SLOTS, -1])),
        ValueError, "conv_state_indices"),
    Bad("conv_state_indices-float", put("conv_state_indices", lambda t: t.float()), TypeError,
        "conv_state_indices"),
    Bad("conv_state_indices-shape", put_value("conv_state_indices", _cu([0, 1])), ValueError,
        "conv_state_indices"),
    Bad("conv_state_indices-other-device", put("conv_state_indices", lambda t: t.to("meta")),
        ValueError, "conv_state_indices"),
    Bad("conv_has_initial_state-dtype", put("conv_has_initial_state", lambda t: t.to(I32)),
        TypeError, "conv_has_initial_state"),
    Bad("conv_has_initial_state-shape", put("conv_has_initial_state", lambda t: t[:2]),
        ValueError, "conv_has_initial_state"),
    Bad("conv_has_initial_state-nontensor", put_value("conv_has_initial_state", [True] * 3),
        TypeError, "conv_has_initial_state"),
    Bad("conv_state_indices-without-conv_state",
        multi(put_value("conv_state", None), put_value("conv_has_initial_state", None)),
        ValueError, "conv_state_indices"),
    Bad("conv_has_initial_state-without-conv_state",
        multi(put_value("conv_state", None), put_value("conv_state_indices", None)),
        ValueError, "conv_has_initial_state"),
    Bad("conv-lower_bound-given-to-softplus", put_value("lower_bound", -2.0), ValueError,
        "lower_bound"),
]


@pytest.mark.parametrize("case", params(CONV_BAD))
def test_prologue_conv_rejects(gpu, case):
    kern, fake = make_kernels(conv_width=CONV_W)
    run_bad(kern.fused_kda_prologue, fake, conv_args(), case)


def test_prologue_conv_valid(gpu):
    kern, fake = make_kernels(conv_width=CONV_W)
    a = conv_args()
    run_ok(kern.fused_kda_prologue, fake, a)
    call = fake.calls[0]
    assert call[15] is a["conv_weight"] and call[16] is a["conv_state"]
    assert call[17].tolist() == [1, -1, CONV_SLOTS - 1] and call[18] is a["conv_has_initial_state"]


def test_prologue_conv_failing_call_leaves_conv_state(gpu):
    kern, fake = make_kernels(conv_width=CONV_W)
    a = conv_args()
    before = bits(a["conv_state"])
    a["conv_state_indices"] = torch.tensor([0, 1, CONV_SLOTS], dtype=I32)
    with pytest.raises(ValueError) as ei:
        kern.fused_kda_prologue(**a)
    assert names(ei.value, "conv_state_indices") and not fake.calls
    assert torch.equal(bits(a["conv_state"]), before)


def test_prologue_conv_state_indices_without_conv_weight_named(gpu):
    kern, fake = make_kernels()
    a = pro_args()
    run_bad(kern.fused_kda_prologue, fake, a, Bad(
        "x", put_value("conv_state_indices", _cu([0, 1, 2])), ValueError, "conv_state_indices"))


def test_prologue_conv_has_initial_state_without_conv_weight(gpu):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_prologue, fake, pro_args(), Bad(
        "x", put_value("conv_has_initial_state", lambda: torch.ones(N, dtype=torch.int64)),
        ValueError, "conv_has_initial_state"))


def test_prologue_conv_has_initial_state_noncontiguous(gpu):
    kern, fake = make_kernels(conv_width=CONV_W)
    run_bad(kern.fused_kda_prologue, fake, conv_args(), Bad(
        "x", put_value("conv_has_initial_state",
                       lambda: torch.tensor([True, False, False, True, True, False])[::2]),
        ValueError, "conv_has_initial_state"))


@pytest.mark.parametrize("ci", [
    pytest.param([[0, 0], [0, 1], [N, 0], [2, 1], [2, 2]], id="sequence-out-of-range"),
    pytest.param([[0, 0], [0, 1]], id="too-few-chunks"),
])
def test_prologue_chunk_indices_values(gpu, ci):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_prologue, fake, pro_args(), Bad(
        "x", put_value("chunk_indices", _cu(ci)), ValueError, "chunk_indices"))


# ---- chunk --------------------------------------------------------------------------------

CH_BAD: list[Bad] = []
for _n in ("qg", "w", "u", "out"):
    shapes = [lambda t: resized(t, 3, -32), lambda t: resized(t, 0)]
    if _n != "qg":
        shapes += [lambda t: resized(t, 1), lambda t: resized(t, 2)]
    CH_BAD += tensor_cases(_n, dtype_bad=F16, rank=lambda t: t[0], pre=True, contig=True,
                           align=True, meta=_n != "qg", shape=shapes)
    CH_BAD.append(Bad(f"{_n}-last-dim-strided", put(_n, nc_last), ValueError, _n, True))
CH_BAD += tensor_cases(
    "kg_t", dtype_bad=F32, rank=lambda t: t.flatten(-2), pre=True, contig=True, align=True,
    shape=[lambda t: resized(t, 1), lambda t: resized(t, 2), lambda t: resized(t, 3)])
CH_BAD.append(Bad("kg_t-transposed", put("kg_t", lambda t: t.transpose(-1, -2).contiguous()
                                         .transpose(-1, -2)), ValueError, "kg_t", True))
CH_BAD += tensor_cases(
    "aqk", dtype_bad=F32, rank=lambda t: t[0], pre=True, contig=True, align=True,
    shape=[lambda t: resized(t, 1), lambda t: resized(t, 2), lambda t: resized(t, 3, C)])
CH_BAD += tensor_cases(
    "decay", dtype_bad=BF, rank=lambda t: t.unsqueeze(0), pre=True, contig=True, align=True,
    shape=[lambda t: resized(t, 0, -1), lambda t: resized(t, 1), lambda t: resized(t, 2)])
CH_BAD += CU_BAD
CH_BAD += tensor_cases(
    "initial_state", dtype_bad=BF, rank=lambda t: t[0], pre=False, contig=True,
    shape=[lambda t: resized(t, 0), lambda t: resized(t, 1), lambda t: resized(t, 2),
           lambda t: resized(t, 3)])
for c in CH_BAD[-9:]:  # initial_state cases start from a valid initial_state
    c.mutate = multi(put_value("initial_state", lambda: torch.zeros(N, PH, D, D)), c.mutate)
CH_BAD += [
    Bad("state_indices-without-state_cache", put_value("state_indices", _cu([0, 1, 2])),
        ValueError, "state_indices"),
    Bad("has_initial_state-without-state_cache",
        put_value("has_initial_state", lambda: torch.ones(N, dtype=torch.bool)), ValueError,
        "has_initial_state"),
    Bad("checkpoint_offsets-without-checkpoint_state",
        put_value("checkpoint_offsets", _cu([16, 0, 32])), ValueError, "checkpoint_offsets"),
    Bad("checkpoint_state_indices-without-checkpoint_offsets",
        put_value("checkpoint_state_indices", _cu([0, 1, 2])), ValueError,
        "checkpoint_state_indices"),
    Bad("chunk_offsets-nontensor", put_value("chunk_offsets", [0, 2, 2, 5]), TypeError,
        "chunk_offsets"),
    Bad("chunk_offsets-float", put_value("chunk_offsets", _cu([0, 2, 2, 5], F32)), TypeError,
        "chunk_offsets"),
    Bad("chunk_offsets-shape", put_value("chunk_offsets", _cu([0, 2, 5])), ValueError,
        "chunk_offsets"),
    Bad("chunk_offsets-rank", put_value("chunk_offsets", lambda: torch.tensor([[0, 2, 2, 5]],
                                                                              dtype=I32)),
        ValueError, "chunk_offsets"),
    Bad("chunk_offsets-other-device", put_value("chunk_offsets", lambda: torch.tensor(
        [0, 2, 2, 5], dtype=I32, device="meta")), ValueError, "chunk_offsets"),
    Bad("groups-0", put_value("groups", 0), ValueError, "groups"),
    Bad("groups-negative", put_value("groups", -3), ValueError, "groups"),
]


@pytest.mark.parametrize("case", params(CH_BAD))
def test_chunk_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(), case)


@pytest.mark.parametrize("case", params([c for c in CH_BAD if c.pre]))
def test_chunk_rejects_before_device_check(case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(), case)


def test_chunk_cpu_tensors_need_gpu():
    kern, fake = make_kernels()
    with pytest.raises(ValueError, match="must be on a GPU") as ei:
        kern.fused_kda_chunk(**chunk_args(**cache_extra()))
    assert names(ei.value, "qg") and not fake.calls


CACHE_BAD: list[Bad] = [
    Bad("state_cache-nontensor", put_value("state_cache", "cache"), TypeError, "state_cache"),
    Bad("state_cache-dtype", put("state_cache", lambda t: t.to(BF)), TypeError, "state_cache"),
    Bad("state_cache-rank", put("state_cache", lambda t: t[0]), ValueError, "state_cache"),
    Bad("state_cache-heads", put("state_cache", lambda t: resized(t, 1)), ValueError, "state_cache"),
    Bad("state_cache-V", put("state_cache", lambda t: resized(t, 2)), ValueError, "state_cache"),
    Bad("state_cache-K", put("state_cache", lambda t: resized(t, 3, -1)), ValueError,
        "state_cache"),
    Bad("state_cache-noncontiguous", put("state_cache", nc_rows), ValueError, "state_cache"),
    Bad("state_cache-transposed", put("state_cache", lambda t: t.transpose(-1, -2)), ValueError,
        "state_cache"),
    Bad("state_cache-other-device", put("state_cache", lambda t: t.to("meta")), ValueError,
        "state_cache"),
    Bad("state_indices-out-of-range", put_value("state_indices", _cu([0, -1, SLOTS])), ValueError,
        "state_indices"),
    Bad("state_indices-int64-wraps-to-a-row", put_value("state_indices", _cu([0, -(2**32) + 1, 2], I64)),
        ValueError, "state_indices"),
    Bad("state_indices-float", put("state_indices", lambda t: t.float()), TypeError,
        "state_indices"),
    Bad("state_indices-nontensor", put_value("state_indices", [0, 1, 2]), TypeError,
        "state_indices"),
    Bad("state_indices-shape", put_value("state_indices", _cu([0, 1])), ValueError, "state_indices"),
    Bad("state_indices-rank", put("state_indices", lambda t: t.unsqueeze(0)), ValueError,
        "state_indices"),
    Bad("state_indices-other-device", put("state_indices", lambda t: t.to("meta")), ValueError,
        "state_indices"),
    Bad("has_initial_state-int", put("has_initial_state", lambda t: t.to(I32)), TypeError,
        "has_initial_state"),
    Bad("has_initial_state-shape", put("has_initial_state", lambda t: t[1:]), ValueError,
        "has_initial_state"),
    Bad("has_initial_state-nontensor", put_value("has_initial_state", [True, True, True]),
        TypeError, "has_initial_state"),
    Bad("has_initial_state-other-device", put("has_initial_state", lambda t: t.to("meta")),
        ValueError, "has_initial_state"),
    # cache rows are not guarded by a bad sibling argument either
    Bad("cache-with-bad-cu_seqlens", put_value("cu_seqlens", _cu([0, 40, 20, 64])), ValueError,
        "cu_seqlens"),
    Bad("cache-with-misaligned-qg", put("qg", misaligned), ValueError, "qg"),
]


@pytest.mark.parametrize("case", params(CACHE_BAD))
def test_chunk_state_cache_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(**cache_extra()), case)


CKPT_BAD: list[Bad] = [
    Bad("checkpoint_state-nontensor", put_value("checkpoint_state", 0.0), TypeError,
        "checkpoint_state"),
    Bad("checkpoint_state-dtype", put("checkpoint_state", lambda t: t.to(BF)), TypeError,
        "checkpoint_state"),
    Bad("checkpoint_state-heads", put("checkpoint_state", lambda t: resized(t, 1)), ValueError,
        "checkpoint_state"),
    Bad("checkpoint_state-K", put("checkpoint_state", lambda t: resized(t, 3)), ValueError,
        "checkpoint_state"),
    Bad("checkpoint_state-rank", put("checkpoint_state", lambda t: t.flatten(-2)), ValueError,
        "checkpoint_state"),
    Bad("checkpoint_state-noncontiguous", put("checkpoint_state", nc_rows), ValueError,
        "checkpoint_state"),
    Bad("checkpoint_state-other-device", put("checkpoint_state", lambda t: t.to("meta")),
        ValueError, "checkpoint_state"),
    Bad("checkpoint_state-too-few-rows", put("checkpoint_state", lambda t: t[: N - 1]), ValueError,
        "checkpoint_state"),
    Bad("checkpoint_offsets-float", put("checkpoint_offsets", lambda t: t.float()), TypeError,
        "checkpoint_offsets"),
    Bad("checkpoint_offsets-nontensor", put_value("checkpoint_offsets", [16, 0, 32]), TypeError,
        "checkpoint_offsets"),
    Bad("checkpoint_offsets-shape", put_value("checkpoint_offsets", _cu([16, 0])), ValueError,
        "checkpoint_offsets"),
    Bad("checkpoint_offsets-other-device", put("checkpoint_offsets", lambda t: t.to("meta")),
        ValueError, "checkpoint_offsets"),
    Bad("checkpoint_offsets-not-multiple-of-chunk", put_value("checkpoint_offsets", _cu([8, 0, 32])),
        ValueError, "checkpoint_offsets"),
    Bad("checkpoint_offsets-past-end", put_value("checkpoint_offsets", _cu([32, 0, 32])),
        ValueError, "checkpoint_offsets"),
    Bad("checkpoint_offsets-past-end-of-empty-seq",
        put_value("checkpoint_offsets", _cu([16, 16, 32], I64)), ValueError, "checkpoint_offsets"),
    Bad("checkpoint_offsets-negative", put_value("checkpoint_offsets", _cu([-16, 0, 32])),
        ValueError, "checkpoint_offsets"),
]


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_checkpoint_alignment_is_the_variants_chunk_size(chunk):
    """The stand-in for the wrapper's KDA_CHECKPOINT_ALIGNMENT, per variant."""
    kern, _ = make_kernels(chunk_size=chunk)
    assert kern.checkpoint_alignment == chunk


CKPT_IDX_BAD: list[Bad] = [
    Bad("checkpoint_state_indices-out-of-range",
        put_value("checkpoint_state_indices", _cu([4, 0, -1])), ValueError,
        "checkpoint_state_indices"),
    Bad("checkpoint_state_indices-float", put("checkpoint_state_indices", lambda t: t.double()),
        TypeError, "checkpoint_state_indices"),
    Bad("checkpoint_state_indices-shape", put_value("checkpoint_state_indices", _cu([0])),
        ValueError, "checkpoint_state_indices"),
    Bad("checkpoint_state_indices-other-device",
        put("checkpoint_state_indices", lambda t: t.to("meta")), ValueError,
        "checkpoint_state_indices"),
]


@pytest.mark.parametrize("case", params(CKPT_BAD))
def test_chunk_checkpoint_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(**ckpt_extra()), case)


@pytest.mark.parametrize("case", params(CKPT_IDX_BAD))
def test_chunk_checkpoint_indices_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(**ckpt_extra(indexed=True), **cache_extra()),
            case)


# -- the seed's own errors --

SEED_BAD = [
    ("initial_state", dict(initial_state=torch.zeros(N, PH, D, D)), SEED_REPLACES),
    ("output_final_state", dict(output_final_state=True), SEED_REPLACES),
    ("no-state_indices", dict(state_indices=None), SEED_NEEDS),
    ("no-has_initial_state", dict(has_initial_state=None), SEED_NEEDS),
    ("neither", dict(state_indices=None, has_initial_state=None), SEED_NEEDS),
]


@pytest.mark.parametrize("with_gpu_patch", [False, True])
@pytest.mark.parametrize("override,msg", [pytest.param(o, m, id=i) for i, o, m in SEED_BAD])
def test_chunk_seed_state_cache_errors(monkeypatch, with_gpu_patch, override, msg):
    if with_gpu_patch:
        _patch_gpu(monkeypatch)
    kern, fake = make_kernels()
    a = chunk_args(**cache_extra())
    a.update(override)
    snap = snapshot(a)
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$") as ei:
        kern.fused_kda_chunk(**a)
    assert type(ei.value) is ValueError and "state_cache" in str(ei.value)
    assert not fake.calls
    assert_untouched(a, snap)


# -- the seed's signatures --

# The production wrapper's parameters (seed API page), in order, with defaults ("-": none).
SEED_CHUNK = [
    ("qg", "-"), ("w", "-"), ("u", "-"), ("kg_t", "-"), ("aqk", "-"), ("decay", "-"), ("out", "-"),
    ("scale", "-"), ("cu_seqlens", "-"), ("initial_state", "-"), ("output_final_state", "-"),
    ("chunk_offsets", None), ("checkpoint_state", None), ("checkpoint_offsets", None),
    ("checkpoint_state_indices", None), ("state_cache", None), ("state_indices", None),
    ("has_initial_state", None),
]
SEED_PROLOGUE = [
    ("q", "-"), ("k", "-"), ("v", "-"), ("raw_g", "-"), ("raw_beta", "-"), ("A_log", "-"),
    ("dt_bias", "-"), ("scale", "-"), ("lower_bound", "-"), ("cu_seqlens", "-"),
    ("conv_weight", None), ("conv_state", None), ("conv_state_indices", None),
    ("conv_has_initial_state", None), ("chunk_indices", None),
]


@pytest.mark.parametrize("op, seed, extras", [
    ("fused_kda_chunk", SEED_CHUNK, {"groups", "segments", "akk"}),
    ("fused_kda_prologue", SEED_PROLOGUE, {"defer_u"}),
])
def test_prefill_ops_take_the_seeds_positional_parameters(op, seed, extras):
    """A call written for the wrapper binds the same way here: the seed's parameters in its
    order with its defaults, and kdagen's additions keyword-only (so they cannot shift a
    positional call)."""
    import inspect

    params = list(inspect.signature(getattr(Kernels, op)).parameters.values())[1:]  # past self
    positional = [(p.name, "-" if p.default is inspect.Parameter.empty else p.default)
                  for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == seed
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} == extras
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)


def test_chunk_binds_a_call_with_every_argument_by_position(gpu):
    """The wrapper's 18 arguments by position (paged cache and checkpoints given) reach the
    kernel as the same call by keyword does."""
    extra = {**cache_extra(), **ckpt_extra(indexed=True)}
    kern, fake = make_kernels()
    by_name = run_ok(kern.fused_kda_chunk, fake, chunk_args(**extra))
    kern2, fake2 = make_kernels()
    b = chunk_args(**extra)
    by_position = kern2.fused_kda_chunk(*[b.get(name) for name, _ in SEED_CHUNK])
    assert len(fake2.calls) == 1
    assert by_position[0] is b["out"] and by_position[1] is None and by_name[1] is None
    assert len(fake.calls[0]) == len(fake2.calls[0])
    for x, y in zip(fake.calls[0], fake2.calls[0]):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
            if x.dtype in (I32, I64, torch.bool):
                assert torch.equal(x, y)
        else:
            assert x == y


# -- valid chunk calls --


def test_chunk_valid(gpu):
    kern, fake = make_kernels()
    a = chunk_args()
    out, final = run_ok(kern.fused_kda_chunk, fake, a)
    assert out is a["out"] and final is None
    call = fake.calls[0]
    assert call[7].dtype == I32 and call[7].tolist() == CU
    assert call[8].tolist() == prepare_chunk_offsets(torch.tensor(CU), C).tolist() == [0, 2, 2, 5]
    assert call[9] == pytest.approx(D ** -0.5)
    assert call[12] is None and call[13] == 1  # 5 chunks / 3 seqs: one group, no workspace


def test_chunk_valid_final_state_and_alias(gpu):
    kern, fake = make_kernels()
    a = chunk_args(initial_state=torch.zeros(N, PH, D, D), output_final_state=True, scale=0.5,
                   cu_seqlens=torch.tensor(CU, dtype=I64), chunk_offsets=_cu([0, 2, 2, 5], I64)())
    a["out"] = a["u"]  # out may alias u
    out, final = run_ok(kern.fused_kda_chunk, fake, a)
    assert out is a["u"] and final.shape == (N, PH, D, D) and final.dtype == F32
    call = fake.calls[0]
    assert call[2] is call[6] and call[8].dtype == I32 and call[11] is final


def test_chunk_valid_state_cache(gpu):
    kern, fake = make_kernels()
    a = chunk_args(**cache_extra())
    out, final = run_ok(kern.fused_kda_chunk, fake, a)
    assert final is None
    call = fake.calls[0]
    assert call[17] is a["state_cache"] and call[18].tolist() == [2, -1, 0]
    assert call[19] is a["has_initial_state"]


def test_chunk_valid_checkpoints(gpu):
    kern, fake = make_kernels()
    # offset == sequence length is allowed; 0 disables; negative rows disable
    cu = torch.tensor([0, 32, 32, 64], dtype=I32)
    a = chunk_args(cu_seqlens=cu, **cache_extra())
    a["kg_t"], a["decay"] = a["kg_t"][:4].clone(), a["decay"][:4].clone()  # 2 + 0 + 2 chunks
    a.update(checkpoint_state=a["state_cache"],  # the paged cache itself
             checkpoint_offsets=torch.tensor([32, 0, 16], dtype=I64),
             checkpoint_state_indices=torch.tensor([SLOTS - 1, -7, 1], dtype=I64))
    run_ok(kern.fused_kda_chunk, fake, a)
    call = fake.calls[0]
    assert call[14] is a["state_cache"] and call[15].tolist() == [32, 0, 16]
    assert call[15].dtype == I32 and call[16].dtype == I32


def test_chunk_valid_checkpoint_rows(gpu):
    kern, fake = make_kernels()
    a = chunk_args(**ckpt_extra())
    run_ok(kern.fused_kda_chunk, fake, a)
    assert fake.calls[0][16] is None


def test_chunk_failing_call_leaves_caches(gpu):
    kern, fake = make_kernels()
    a = chunk_args(**cache_extra(), **ckpt_extra(indexed=True))
    before = {k: bits(a[k]) for k in ("state_cache", "checkpoint_state")}
    a["checkpoint_offsets"] = torch.tensor([16, 0, 40], dtype=I32)
    with pytest.raises(ValueError) as ei:
        kern.fused_kda_chunk(**a)
    assert names(ei.value, "checkpoint_offsets") and not fake.calls
    for k, b in before.items():
        assert torch.equal(bits(a[k]), b)


def test_chunk_groups_forced_by_env(gpu, monkeypatch):
    monkeypatch.setenv("KDAGEN_GROUPS", "4")
    kern, fake = make_kernels()
    run_ok(kern.fused_kda_chunk, fake, chunk_args())
    ws, g = fake.calls[0][12], fake.calls[0][13]
    assert g == 4 and ws.dtype == F32 and ws.numel() == 3 * workspace_slots(fake.calls[0]) * N * PH * D * D


def workspace_slots(call) -> int:
    """The workspace slots a chunk call's groups and segments (argument 21) take."""
    g, p = call[13], segments_of(call[13], call[21])
    assert 1 <= p <= g - 1
    return g + p - 2 if 1 < p < g - 1 else g


def test_chunk_groups_kwarg(gpu):
    kern, fake = make_kernels()
    run_ok(kern.fused_kda_chunk, fake, dict(chunk_args(), groups=5))
    assert fake.calls[0][13] == 5 and fake.calls[0][12].numel() == 3 * workspace_slots(fake.calls[0]) * N * PH * D * D
    for segments, slots in ((1, 5), (2, 5), (3, 6), (4, 5)):
        fake.calls.clear()
        run_ok(kern.fused_kda_chunk, fake, dict(chunk_args(), groups=5, segments=segments))
        assert fake.calls[0][21] == segments
        assert fake.calls[0][12].numel() == 3 * slots * N * PH * D * D
    for bad in (5, -1):
        with pytest.raises(ArgumentError, match="segments"):
            kern.fused_kda_chunk(**dict(chunk_args(), groups=5, segments=bad))
    with pytest.raises(ArgumentError, match="groups"):
        kern.fused_kda_chunk(**dict(chunk_args(), groups=129))


@pytest.mark.parametrize("bv,want", [(64, 8), (32, 8)])
def test_chunk_groups_heuristic_in_wrapper(gpu, bv, want):
    """1 sequence of 64 chunks x 8 heads on 132 CUs; the wrapper passes pass blocks 2*D/BV and
    D/BV (2 / 1 for BV = 64, 4 / 2 for BV = 32), heads = H, chunks per sequence and the
    chunk plan's 2 resident blocks (chunk 16 on sm_90: 264 slots; BV = 32 fills 8 groups of
    pass one where one resident block would fill 4)."""
    kern, fake = make_kernels(block_width=bv)
    nc, h = 64, 8
    t = nc * C
    g = _gen(7)
    a = dict(qg=rnd(1, t, h, D, g=g), w=rnd(1, t, h, D, g=g), u=rnd(1, t, h, D, g=g),
             kg_t=rnd(nc, h, D, C, g=g), aqk=rnd(1, t, h, C, g=g),
             decay=rnd(nc, h, D, dtype=F32, g=g), out=rnd(1, t, h, D, g=g), scale=None,
             cu_seqlens=torch.tensor([0, t], dtype=I32), initial_state=None,
             output_final_state=False)
    run_ok(kern.fused_kda_chunk, fake, a)
    assert want == chunk_groups(nc, 1, h, 132, pass_one_blocks=2 * D // bv,
                                pass_two_blocks=D // bv,
                                resident=chunk_plan_for(kern.spec).min_blocks)
    assert fake.calls[0][13] == want
    assert fake.calls[0][12].numel() == 3 * workspace_slots(fake.calls[0]) * h * D * D


# -- value checks can be turned off --


def test_check_values_off_skips_value_checks(gpu, monkeypatch):
    monkeypatch.setenv("KDAGEN_CHECK_VALUES", "0")
    kern, fake = make_kernels()
    a = chunk_args(cu_seqlens=torch.tensor([0, 40, 20, 64], dtype=I32), **cache_extra())
    a["state_indices"] = torch.tensor([0, SLOTS + 3, 1], dtype=I32)
    run_ok(kern.fused_kda_chunk, fake, a)
    kern2, fake2 = make_kernels()
    b = rec_args()
    b["state_indices"] = torch.tensor([SLOTS, 0, 0], dtype=I32)
    run_ok(kern2.fused_recurrent_kda, fake2, b)
    kern3, fake3 = make_kernels()
    run_ok(kern3.fused_kda_chunk, fake3, chunk_args(
        **dict(ckpt_extra(), checkpoint_offsets=torch.tensor([8, 0, 33], dtype=I32))))


def test_check_values_off_keeps_shape_checks(gpu, monkeypatch):
    monkeypatch.setenv("KDAGEN_CHECK_VALUES", "0")
    kern, fake = make_kernels()
    a = chunk_args(cu_seqlens=torch.tensor([0, 40, 20, 64], dtype=I32))
    run_bad(kern.fused_kda_chunk, fake, a, Bad("x", put("decay", lambda t: t.to(BF)), TypeError,
                                               "decay"))


# -- known gaps (real bugs, documented) --


def test_chunk_kg_t_chunk_count_must_match_cu_seqlens(gpu):
    kern, fake = make_kernels()
    a = chunk_args()
    a["kg_t"], a["decay"] = a["kg_t"][: NCHUNKS - 1].clone(), a["decay"][: NCHUNKS - 1].clone()
    run_bad(kern.fused_kda_chunk, fake, a, Bad("x", lambda a: None, ValueError, "kg_t"))


def test_chunk_chunk_offsets_values(gpu):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(), Bad(
        "x", put_value("chunk_offsets", _cu([0, 2, 9, 12])), ValueError, "chunk_offsets"))


def test_chunk_has_initial_state_noncontiguous(gpu):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(**cache_extra()), Bad(
        "x", put_value("has_initial_state",
                       lambda: torch.tensor([True, False, False, True, True, False])[::2]),
        ValueError, "has_initial_state"))


@pytest.mark.parametrize("value", [
    pytest.param(lambda: torch.zeros(N, PH, D, D, dtype=BF), id="bf16"),
    pytest.param(lambda: "not a tensor", id="nontensor"),
])
def test_chunk_checkpoint_state_without_offsets_checked(gpu, value):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(), Bad(
        "x", put_value("checkpoint_state", value), TypeError, "checkpoint_state"))


@pytest.mark.parametrize("groups", [2.5, "4"])
def test_chunk_groups_non_int(gpu, groups):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, chunk_args(), Bad(
        "x", put_value("groups", groups), TypeError, "groups"))


# ---- groups and varlen helpers --------------------------------------------------------------


def _cg(cps, ns, nh, cus=132):
    return chunk_groups(cps, ns, nh, cus, pass_one_blocks=2, pass_two_blocks=1)


def test_chunk_groups_short_or_many_heads():
    assert _cg(1, 1, 8) == 1
    assert _cg(16, 1, 8) == 1
    assert _cg(2048, 64, 8) == 1
    assert _cg(2048, 1, 132) == 1
    assert _cg(0, 0, 0) == 1


def test_group_starts_are_spans_of_ceil_chunks_over_groups():
    """As chunk.h's start_of_group: 2048 chunks in 8 groups start every 256, pass one
    covering 1792; 10 chunks in 4 groups at 0, 3, 6, 9; past the end, the end."""
    assert [group_start(2048, 8, g) for g in range(8)] == list(range(0, 2048, 256))
    assert [group_start(10, 4, g) for g in range(5)] == [0, 3, 6, 9, 10]
    assert group_start(5, 8, 7) == 5


def test_chunk_groups_long_single_sequence():
    g = _cg(2048, 1, 8)
    assert 4 <= g <= MAX_GROUPS


def test_chunk_groups_count_resident_walk_blocks():
    """Two resident walk blocks per SM (chunk 16 on the H200): the measured best counts
    (docs/NOTES.md v16) - 8 groups for 1x32768x32, 32 for 1x131072x8; 4 and 16 with one."""
    two = dict(pass_one_blocks=2, pass_two_blocks=1, resident=2)
    assert chunk_groups(2048, 1, 32, 132, **two) == 8
    assert chunk_groups(8192, 1, 8, 132, **two) == 32
    assert chunk_groups(256, 8, 32, 132, **two) == 1  # 8x4096x32: the single walk
    assert _cg(2048, 1, 32) == 4 and _cg(8192, 1, 8) == 16


def test_groups_for_spec_reads_the_chunk_plan():
    from kdagen.groups import groups_for_spec
    from kdagen.spec import KernelSpec

    c16 = KernelSpec.parse(dict(target="sm_90", chunk_size=16, gate="lower_bound"))
    c64 = KernelSpec.parse(dict(target="sm_90", chunk_size=64))
    assert chunk_plan_for(c16).min_blocks == 2 and chunk_plan_for(c64).min_blocks == 1
    assert groups_for_spec(c16, 2048, 1, 32, 132) == 8
    assert groups_for_spec(c64, 512, 1, 32, 132) == 4


def test_chunk_groups_capped():
    assert _cg(10**6, 1, 1, cus=10**5) == MAX_GROUPS


@settings(max_examples=200, deadline=None, database=None)
@given(cps=st.integers(0, 10**5), ns=st.integers(0, 64), nh=st.integers(0, 128),
       cus=st.integers(1, 512), p1=st.sampled_from([1, 2, 4]), p2=st.sampled_from([1, 2]))
def test_chunk_groups_range(cps, ns, nh, cus, p1, p2):
    g = chunk_groups(cps, ns, nh, cus, pass_one_blocks=p1, pass_two_blocks=p2)
    assert g == 1 or 4 <= g <= MAX_GROUPS
    assert g == 1 or cps // g >= 8  # groups stay at least MIN_CHUNKS_PER_GROUP long


@pytest.mark.parametrize("forced,want", [("7", 7), ("1", 1), ("0", 1), ("-3", 1), ("64", 64)])
def test_chunk_groups_env(monkeypatch, forced, want):
    monkeypatch.setenv("KDAGEN_GROUPS", forced)
    assert _cg(2048, 1, 8) == want
    assert _cg(1, 64, 64) == want


def test_group_workspace():
    assert group_workspace(1, 16, 64, torch.device("cpu")) is None
    assert group_workspace(0, 16, 64, torch.device("cpu")) is None
    ws = group_workspace(4, 6, 64, torch.device("cpu"))  # one segment per group: 4 slots
    assert ws.dtype == F32 and ws.numel() == 3 * 4 * 6 * 64 * 64
    for groups, segments, slots in ((4, 1, 4), (4, 2, 4), (4, 3, 4), (8, 3, 9), (8, 6, 12), (8, 7, 8)):
        ws = group_workspace(groups, 6, 64, torch.device("cpu"), segments=segments)
        assert ws.numel() == 3 * slots * 6 * 64 * 64, (groups, segments)


def test_pass_one_segments_fill_the_compute_units_once(monkeypatch):
    two = dict(pass_one_blocks=2, resident=2)  # d128 / bv128, c16: 264 slots on 132 SMs
    assert pass_one_segments(1, 8, 32, 132, **two) == 0  # the single walk has no pass one
    assert pass_one_segments(8, 1, 32, 132, **two) == 4  # 1x32768x32: 128 blocks, not 224
    # 1x131072x8: 16 segments would save 3% of the chunk steps (one batch of 496 chunks
    # against two of 256), under SEGMENT_GAIN: one per group
    assert pass_one_segments(32, 1, 8, 132, **two) == 31
    assert pass_one_segments(4, 1, 32, 132, **two) == 3  # 1x2048x32: one per group fits
    assert pass_one_segments(8, 4, 64, 132, **two) == 7  # two batches at any count
    for forced, want in (("2", 2), ("99", 7), ("0", 7)):  # 0: one per group
        monkeypatch.setenv("KDAGEN_SEGMENTS", forced)
        assert pass_one_segments(8, 1, 32, 132, **two) == want


@pytest.mark.parametrize("width, blocks, resident", [(0, 1, 1), (64, 2, 2)])
def test_pass_one_segments_count_pass_ones_own_blocks(width, blocks, resident, monkeypatch):
    """The segments of a spec count pass one's blocks at its own width
    (resources.PASS_ONE_WIDTH): paired blocks of 128 rows alone on an SM, of 64 rows two
    a SM; both take 1x32768x32's 128 or 256 blocks in one batch of 4 segments."""
    from kdagen import resources
    from kdagen.groups import segments_for_spec
    from kdagen.render import chunk_plan_for, render
    from kdagen.spec import KernelSpec

    monkeypatch.setattr(resources, "PASS_ONE_WIDTH", width)
    spec = KernelSpec(head_dim=128, chunk_size=16, block_width=128, gate="lower_bound", target="sm_90")
    plan = chunk_plan_for(spec)
    assert plan.pass_one_paired and plan.pass_one_width == (width or 128)
    assert (128 // plan.pass_one_width, plan.pass_one_resident(128)) == (blocks, resident)
    assert segments_for_spec(spec, 8, 1, 32, 132) == 4
    src = render(spec).files["kernels.hip"]
    assert ("struct ConfigPassOne : Config" in src) == bool(width)
    assert f"static constexpr int kBlockV = {width};" in src or not width


def test_kernels_work_out_their_chunk_plan_once(monkeypatch):
    """The group and segment heuristics of a loaded variant read the chunk plan it keeps
    (worked out at the first call, ~9 us a grouped call before), with the answers of the
    groups.py functions that work it out themselves."""
    from kdagen import render
    from kdagen.groups import groups_for_spec, segments_for_spec
    from kdagen.ops import Kernels
    from kdagen.spec import KernelSpec

    spec = KernelSpec(head_dim=128, chunk_size=16, block_width=128, gate="lower_bound", target="sm_90")
    kern = Kernels(spec, {}, device_type="cpu")
    real, calls = render.chunk_plan_for, []
    monkeypatch.setattr(render, "chunk_plan_for", lambda s: calls.append(s) or real(s))
    cpu = torch.device("cpu")
    for _ in range(3):
        got = (kern.heuristic_groups(2048, 1, 32, cpu), kern.heuristic_segments(8, 1, 32, cpu))
    assert calls == [spec]
    cus, resident = 8, kern.walk_residency(cpu)
    assert got == (groups_for_spec(spec, 2048, 1, 32, cus, resident=resident[0]),
                   segments_for_spec(spec, 8, 1, 32, cus, resident=resident[1]))
    assert len(calls) == 2  # (segments_for_spec's own; groups_for_spec, told the residency, needs none)


def test_varlen_zero_length_sequence():
    z = torch.tensor([0, 0], dtype=I32)
    assert prepare_chunk_offsets(z, C).tolist() == [0, 0]
    ci = prepare_chunk_indices(z, C)
    assert ci.shape == (0, 2) and ci.dtype == I32
    cu = torch.tensor([0, 0, 16, 16, 20], dtype=I64)
    off = prepare_chunk_offsets(cu, C)
    assert off.dtype == I32 and off.tolist() == [0, 0, 1, 1, 2]
    assert prepare_chunk_indices(cu, C).tolist() == [[1, 0], [3, 0]]
    assert prepare_chunk_indices(cu, C, num_chunks=2).tolist() == [[1, 0], [3, 0]]


# ---- hypothesis: fuzz the chunk op's arguments ---------------------------------------------

ALIGNED = ("qg", "w", "u", "out", "kg_t", "aqk", "decay")
CONTIG = ALIGNED + ("initial_state", "state_cache", "checkpoint_state")
ALLOWED = {**{n: (BF,) for n in ALIGNED}, "decay": (F32,), "initial_state": (F32,),
           "state_cache": (F32,), "checkpoint_state": (F32,), "has_initial_state": (torch.bool,),
           **{n: (I32, I64) for n in ("cu_seqlens", "state_indices", "checkpoint_offsets",
                                      "checkpoint_state_indices", "chunk_offsets")}}
ALL_DTYPES = (BF, F16, F32, F64, I32, I64, torch.int16, torch.uint8, torch.bool)
FREE_DIMS = {"state_cache": (0,), "checkpoint_state": (0,)}  # any row count is fine there


def _build_chunk(lens, H, mode, ckpt, with_co, int64, g):
    t = sum(lens)
    n = len(lens)
    nch = sum(-(-x // C) for x in lens)
    it = I64 if int64 else I32
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=it)
    a = dict(qg=rnd(1, t, H, D, g=g), w=rnd(1, t, H, D, g=g), u=rnd(1, t, H, D, g=g),
             kg_t=rnd(nch, H, D, C, g=g), aqk=rnd(1, t, H, C, g=g),
             decay=rnd(nch, H, D, dtype=F32, g=g), out=rnd(1, t, H, D, g=g), scale=None,
             cu_seqlens=cu, initial_state=None, output_final_state=mode == "final")
    if mode == "initial":
        a["initial_state"] = rnd(n, H, D, D, dtype=F32, g=g)
    if mode == "cache":
        slots = n + 2
        a.update(state_cache=rnd(slots, H, D, D, dtype=F32, g=g),
                 state_indices=torch.tensor([(i * 3) % slots for i in range(n)], dtype=it),
                 has_initial_state=torch.tensor([i % 2 == 0 for i in range(n)]))
    if ckpt:
        rows = n + 1 if ckpt == "indexed" else n
        a.update(checkpoint_state=torch.zeros(rows, H, D, D),
                 checkpoint_offsets=torch.tensor([(x // C) * C for x in lens], dtype=it))
        if ckpt == "indexed":
            a["checkpoint_state_indices"] = torch.tensor([rows - 1 - i for i in range(n)], dtype=it)
    if with_co:
        a["chunk_offsets"] = prepare_chunk_offsets(cu, C).to(it)
    return a


def _corruptions(a: dict, family: str) -> list[tuple[str, str]]:
    """(argument, kind) pairs that make this valid call malformed.

    ``structure``: non-tensor, dtype, rank, size, stride, alignment, device of one tensor
    argument; ``value``: bad cu_seqlens / row indices / checkpoint offsets, and the argument
    combinations the wrapper (and the seed) refuse."""
    out = []
    for k, v in a.items():
        if not isinstance(v, torch.Tensor):
            continue
        if family == "value":
            if k in ("cu_seqlens", "state_indices", "checkpoint_state_indices",
                     "checkpoint_offsets"):
                out.append((k, "value"))
            continue
        out += [(k, "nontensor"), (k, "dtype"), (k, "rank")]
        if any(i not in FREE_DIMS.get(k, ()) for i in range(v.dim())) and k != "cu_seqlens":
            out.append((k, "size"))
        if k in CONTIG:
            out.append((k, "noncontig"))
        if k in ALIGNED:
            out.append((k, "misaligned"))
        if k != "qg":
            out.append((k, "meta"))
    if family == "structure":
        return out
    if "state_cache" in a:
        out += [("state_cache", c) for c in ("+initial_state", "+final", "-state_indices",
                                             "-has_initial_state")]
    else:
        out += [("state_indices", "+"), ("has_initial_state", "+")]
    if "checkpoint_offsets" in a:
        out.append(("checkpoint_state", "-"))
        if "checkpoint_state_indices" not in a:
            out.append(("checkpoint_state", "rows"))
    else:
        out.append(("checkpoint_state_indices", "+"))
    out.append(("groups", "bad"))
    return out


def _corrupt(data, a: dict, lens, H, key: str, kind: str) -> None:
    n = len(lens)
    v = a.get(key)
    if kind == "nontensor":
        a[key] = data.draw(st.sampled_from(["x", 3.0, [1, 2], (0,)]), label="nontensor")
    elif kind == "dtype":
        dt = data.draw(st.sampled_from([d for d in ALL_DTYPES if d not in ALLOWED[key]]),
                       label="dtype")
        a[key] = v.to(dt)
    elif kind == "rank":
        how = data.draw(st.sampled_from(["unsqueeze0", "unsqueeze-1", "flatten"]
                                        if v.dim() >= 2 else ["unsqueeze0", "unsqueeze-1"]))
        a[key] = v.unsqueeze(0) if how == "unsqueeze0" else (
            v.unsqueeze(-1) if how == "unsqueeze-1" else v.flatten(-2))
    elif kind == "size":
        dims = [i for i in range(v.dim()) if i not in FREE_DIMS.get(key, ())]
        dim = data.draw(st.sampled_from(dims), label="dim")
        delta = data.draw(st.sampled_from([d for d in (-2, -1, 1, 3) if v.shape[dim] + d >= 0]),
                          label="delta")
        a[key] = resized(v, dim, delta)
    elif kind == "noncontig":
        a[key] = data.draw(st.sampled_from([nc_rows, nc_last]), label="how")(v)
    elif kind == "misaligned":
        a[key] = misaligned(v)
    elif kind == "meta":
        a[key] = v.to("meta")
    elif kind == "value":
        vals = v.tolist()
        if key == "cu_seqlens":
            opts = ["start", "end"] + (["nonmono"] if n >= 2 else [])
            how = data.draw(st.sampled_from(opts), label="cu")
            if how == "start":
                vals[0] = data.draw(st.sampled_from([-1, 1, 5]))
            elif how == "end":  # past T (an end before T is a padded tail: accepted)
                vals[-1] += data.draw(st.sampled_from([1, 7]))
            else:
                i = data.draw(st.integers(1, n - 1))
                vals[i] = vals[i + 1] + 1
        elif key == "checkpoint_offsets":
            i = data.draw(st.integers(0, n - 1))
            how = data.draw(st.sampled_from(["unaligned", "past", "negative"]))
            vals[i] = {"unaligned": C * (lens[i] // C) + data.draw(st.integers(1, C - 1)),
                       "past": C * (lens[i] // C + data.draw(st.sampled_from([1, 1, 4]))),
                       "negative": -C * data.draw(st.sampled_from([1, 2]))}[how]
        else:  # row indices
            rows = a["state_cache" if key == "state_indices" else "checkpoint_state"].shape[0]
            i = data.draw(st.integers(0, n - 1))
            vals[i] = rows + data.draw(st.sampled_from([0, 0, 1, 2**20]))
        a[key] = torch.tensor(vals, dtype=v.dtype)
    elif key == "state_cache":
        if kind == "+initial_state":
            a["initial_state"] = torch.zeros(n, H, D, D)
        elif kind == "+final":
            a["output_final_state"] = True
        else:
            a[kind[1:]] = None
    elif kind == "+":
        a[key] = torch.zeros(n, dtype=torch.bool if key == "has_initial_state" else I32)
    elif key == "checkpoint_state" and kind == "-":
        a.pop("checkpoint_state")
    elif key == "checkpoint_state" and kind == "rows":
        a[key] = a[key][: n - 1]
    elif key == "groups":
        a["groups"] = data.draw(st.sampled_from([0, -1, -32]))
    else:  # pragma: no cover
        raise AssertionError((key, kind))


_FUZZ_CFG = dict(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=3).filter(lambda l: sum(l) > 0),
    H=st.integers(2, 3), mode=st.sampled_from(["plain", "initial", "final", "cache"]),
    ckpt=st.sampled_from([None, "rows", "indexed"]), with_co=st.booleans(), int64=st.booleans())


def _fuzz_chunk(family, data, lens, H, mode, ckpt, with_co, int64):
    with pytest.MonkeyPatch.context() as mp:
        _patch_gpu(mp)
        for var in ("KDAGEN_GROUPS", "KDAGEN_CHECK_VALUES"):
            mp.delenv(var, raising=False)
        kern, fake = make_kernels()
        a = _build_chunk(lens, H, mode, ckpt, with_co, int64, _gen(len(lens) * 7 + H))
        kern.fused_kda_chunk(**a)  # the uncorrupted call is valid and reaches the op once
        assert len(fake.calls) == 1
        key, kind = data.draw(st.sampled_from(_corruptions(a, family)), label="corruption")
        snap = snapshot(a)
        _corrupt(data, a, lens, H, key, kind)
        try:
            kern.fused_kda_chunk(**a)
        except (ValueError, TypeError) as e:  # any other exception type fails the test
            msg = str(e)
            assert msg.startswith("fused_kda_chunk: argument '") or msg in (
                SEED_REPLACES, SEED_NEEDS), msg
        else:
            raise AssertionError(f"malformed call ({key}, {kind}) was accepted")
        assert len(fake.calls) == 1, "a malformed call reached the kernel"
        assert_untouched(a, snap)


@settings(max_examples=160, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), **_FUZZ_CFG)
def test_fuzz_chunk_malformed_structure_never_reaches_kernel(data, lens, H, mode, ckpt, with_co,
                                                             int64):
    _fuzz_chunk("structure", data, lens, H, mode, ckpt, with_co, int64)


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), **_FUZZ_CFG)
def test_fuzz_chunk_malformed_values_never_reach_kernel(data, lens, H, mode, ckpt, with_co,
                                                        int64):
    _fuzz_chunk("value", data, lens, H, mode, ckpt, with_co, int64)


# ---- u formed in the chunk scan (defer_u / akk) ---------------------------------------------


def test_prologue_defer_u_returns_akk_in_place_of_u(gpu):
    kern, fake = make_kernels()
    ws = run_ok(kern.fused_kda_prologue, fake, {**pro_args(), "defer_u": True})
    assert "u" not in ws and tuple(ws["akk"].shape) == (1, T, PH, C) and ws["akk"].dtype == BF
    call = fake.calls[0]
    assert call[9] is None and call[-1] is ws["akk"]  # u slot empty, akk last


def test_prologue_defer_u_refused_with_the_fused_conv(gpu):
    kern, fake = make_kernels(conv_width=CONV_W)
    run_bad(kern.fused_kda_prologue, fake, conv_args(),
            Bad("defer-conv", put_value("defer_u", True), ValueError, "defer_u"))


def akk_args(**extra) -> dict:
    a = chunk_args(**extra)
    a["u"] = nc_rows(a["u"])  # the raw v: strided rows (head stride D + 8) are fine
    a["akk"] = rnd(1, T, PH, C, g=_gen(6))
    return a


def test_chunk_with_akk_takes_a_strided_v(gpu):
    kern, fake = make_kernels()
    a = akk_args()
    run_ok(kern.fused_kda_chunk, fake, a)
    call = fake.calls[0]
    assert call[2] is a["u"] and call[20] is a["akk"]


def _odd_token_stride(t: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(1, T, PH * D + 4, dtype=t.dtype)
    v = buf[..., :PH * D].unflatten(-1, (PH, D))
    v.copy_(t)
    return v


AKK_BAD: list[Bad] = [
    Bad("v-misaligned", put("u", misaligned), ValueError, "u"),
    Bad("v-token-stride", put("u", _odd_token_stride), ValueError, "u"),
    Bad("v-strided-last", put("u", nc_last), ValueError, "u"),
    Bad("akk-shape", put("akk", lambda t: resized(t, 3)), ValueError, "akk"),
    Bad("akk-dtype", put("akk", lambda t: t.float()), TypeError, "akk"),
    Bad("akk-noncontiguous", put("akk", nc_rows), ValueError, "akk"),
]


@pytest.mark.parametrize("case", params(AKK_BAD))
def test_chunk_with_akk_rejects(gpu, case):
    kern, fake = make_kernels()
    run_bad(kern.fused_kda_chunk, fake, akk_args(), case)


def test_rows16_ok_says_when_the_scan_can_read_v():
    from kdagen.checks import rows16_ok

    v = rnd(1, T, PH, D)
    assert rows16_ok(v) and rows16_ok(nc_rows(v))
    assert not rows16_ok(misaligned(v)) and not rows16_ok(_odd_token_stride(v))
    assert not rows16_ok(nc_last(v)) and not rows16_ok(v.float())


@pytest.mark.parametrize("aligned", [True, False])
def test_prefill_forms_u_in_the_scan_where_v_allows(gpu, aligned):
    """Kernels.prefill: defer_u (the prologue gets no u, the scan akk and the raw v) where
    v's rows are 16-byte pieces; else the contract's path (u written, out aliasing it)."""
    kern, fake = make_kernels()
    a = pro_args()
    if not aligned:
        a["v"] = _odd_token_stride(a["v"])
    o, fin = kern.prefill(**a)
    assert len(fake.calls) == 2 and fin is None
    pro, scan = fake.calls
    if aligned:
        assert pro[9] is None and pro[-1] is not None  # akk in place of u
        assert scan[2] is a["v"] and scan[20] is pro[-1] and o is scan[6]
    else:
        assert pro[9] is not None and pro[-1] is None
        assert scan[2] is pro[9] and scan[6] is pro[9] and scan[20] is None


def test_prefill_passes_its_state_and_workspace_to_the_scan(gpu):
    """Kernels.prefill hands the prologue's outputs and checked cu_seqlens to the scan
    (no second check of its own outputs); the caller's initial state and a final state
    reach the scan."""
    kern, fake = make_kernels()
    init = torch.zeros(N, PH, D, D)
    o, fin = kern.prefill(**pro_args(), initial_state=init, output_final_state=True, groups=2)
    pro, scan = fake.calls
    assert scan[0] is pro[7] and scan[1] is pro[8] and scan[3] is pro[10] and scan[5] is pro[12]
    assert scan[7] is pro[13]  # the cu_seqlens the prologue took
    assert scan[8].tolist() == prepare_chunk_offsets(torch.tensor(CU), C).tolist()
    assert scan[10] is init and fin is scan[11] and tuple(fin.shape) == (N, PH, D, D)
    assert scan[13] == 2 and scan[12] is not None  # two groups: a workspace


@pytest.mark.parametrize("case", [
    Bad("initial_state-shape", put_value("initial_state", lambda: torch.zeros(N + 1, PH, D, D)),
        ValueError, "initial_state"),
    Bad("initial_state-dtype", put_value("initial_state", lambda: torch.zeros(N, PH, D, D,
                                                                            dtype=BF)),
        TypeError, "initial_state"),
    Bad("groups-zero", put_value("groups", 0), ValueError, "groups"),
    Bad("scan-other-chunk", put_value("scan", lambda: lambda n, c: make_kernels(chunk_size=32)[0]),
        ValueError, "scan"),
], ids=lambda c: c.id)
def test_prefill_refuses_before_any_launch(gpu, case):
    """What the scan takes from the caller is checked before the prologue launches."""
    kern, fake = make_kernels()
    run_bad(kern.prefill, fake, pro_args(), case)


def test_scan_forms_u_where_u_and_o_are_staged():
    assert make_kernels(target="sm_90")[0].scan_forms_u
    assert make_kernels(target="gfx90a", chunk_size=32)[0].scan_forms_u
    # CDNA at d128 / c64: u / o per element (no LDS for the tiles): the prologue forms u
    assert not make_kernels(target="gfx90a", head_dim=128, chunk_size=64)[0].scan_forms_u
