"""kda_forward's own argument rules (CPU: they fire before any variant is chosen), and
its stand-in rules for ``fla.ops.kda.chunk_kda`` (signature, defaults, state layout)."""

import inspect

import pytest
import torch

from kdagen import layer
from kdagen.layer import kda_forward

IN_KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
RAW = dict(A_log=torch.zeros(2), dt_bias=torch.zeros(128))

# fla-core 0.6.0's chunk_kda, its parameters before **kwargs, in order, with defaults
FLA_CHUNK_KDA = [
    ("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
    ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False), ("safe_gate", False), ("lower_bound", None),
    ("disable_recompute", False), ("return_intermediate_states", False), ("state_v_first", False),
    ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False),
    ("max_num_seqs", None),
]


def _x():
    q = torch.randn(1, 8, 2, 64)
    return q, q, q, q, torch.randn(1, 8, 2)


def test_positional_parameters_and_defaults_are_fla_chunk_kdas():
    """A call to chunk_kda means the same to kda_forward: same order, same defaults (the
    K-first state and the out-of-kernel flags included); A_log / dt_bias by keyword."""
    params = inspect.signature(kda_forward).parameters.values()
    positional = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                  for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLA_CHUNK_KDA
    keyword = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    assert {"A_log", "dt_bias", "chunk_size"} <= keyword


@pytest.mark.parametrize("flag", ["use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                  "use_beta_sigmoid_in_kernel"])
def test_out_of_kernel_options_are_refused(flag):
    with pytest.raises(ValueError, match=f"{flag}=False"):
        kda_forward(*_x(), **RAW, **{**IN_KERNEL, flag: False})


@pytest.mark.parametrize("option, value, message", [
    ("allow_neg_eigval", True, "allow_neg_eigval is not supported"),
    ("return_intermediate_states", True, "checkpoint_offsets"),
    ("cp_context", object(), "cp_context is not supported"),
    ("use_graph", True, "use_graph is not supported"),
    ("safe_gate", True, r"safe_gate=True needs lower_bound in \[-5, 0\), got None"),
])
def test_fla_options_kdagen_lacks_are_refused_by_name(option, value, message):
    with pytest.raises(ValueError, match=message):
        kda_forward(*_x(), **RAW, **IN_KERNEL, **{option: value})


def test_safe_gate_bound_outside_fla_range_is_refused():
    with pytest.raises(ValueError, match="got -8"):
        kda_forward(*_x(), **RAW, **IN_KERNEL, safe_gate=True, lower_bound=-8.0)


def test_a_log_is_needed_without_a_lower_bound():
    with pytest.raises(ValueError, match="A_log must be given"):
        kda_forward(*_x(), dt_bias=torch.zeros(128), **IN_KERNEL)


class _Prefill:
    """A stand-in variant: records what kda_forward hands the kernels; its final state is
    the V-first start state plus one."""

    def __init__(self):
        self.got = {}

    def prefill(self, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                initial_state, output_final_state, groups=None, scan=None):
        self.got = dict(A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, q=q,
                        cu_seqlens=cu_seqlens)
        final = initial_state + 1.0 if output_final_state else None
        return torch.zeros_like(v), final


@pytest.fixture
def fake(monkeypatch):
    kern = _Prefill()
    monkeypatch.setattr(layer, "for_inputs", lambda *a, **k: kern)
    return kern


@pytest.mark.parametrize("v_first", [False, True])
def test_state_layout_k_first_by_default_v_first_on_request(fake, v_first):
    """FLA's default state is [N, H, K, V]: kdagen hands its kernels the V-first transpose
    and returns the final state K-first again; state_v_first=True passes it as it is."""
    s = torch.randn(1, 2, 64, 64)
    _, final = kda_forward(*_x(), initial_state=s, output_final_state=True, state_v_first=v_first,
                           chunk_size=16, **RAW, **IN_KERNEL)
    want_in = s if v_first else s.transpose(-1, -2)
    assert torch.equal(fake.got["initial_state"], want_in) and fake.got["initial_state"].is_contiguous()
    assert torch.equal(final, s + 1.0) and final.is_contiguous()


def test_a_log_and_dt_bias_left_out_are_zeros(fake):
    """With lower_bound, A_log may be None (FLA: lower_bound sigmoid(g + dt_bias), i.e.
    exp(A_log) = 1); dt_bias None is a zero bias."""
    kda_forward(*_x(), lower_bound=-5.0, chunk_size=16, **IN_KERNEL)
    assert torch.equal(fake.got["A_log"], torch.zeros(2))
    assert torch.equal(fake.got["dt_bias"], torch.zeros(128))


def test_cu_seqlens_needs_batch_one():
    q = torch.randn(2, 8, 2, 64)
    with pytest.raises(ValueError, match="batch must be 1"):
        kda_forward(q, q, q, q, torch.randn(2, 8, 2), cu_seqlens=torch.tensor([0, 8]), **RAW,
                    **IN_KERNEL)


def test_initial_state_must_be_fp32():
    with pytest.raises(TypeError, match="initial_state"):
        kda_forward(*_x(), initial_state=torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16), **RAW,
                    **IN_KERNEL)


def test_dense_batch_needs_no_cu_seqlens_read_back(fake, monkeypatch):
    """[B, T, ...] without cu_seqlens: the kernels get the batch as B sequences of T
    tokens (a prepared SeqLens made from the shape), with no host read of any values."""
    from kdagen import checks, seqlens

    reads = []
    monkeypatch.setattr(checks, "cu_seqlens_values", lambda *a: reads.append(a))
    q = torch.randn(3, 40, 2, 64)
    kda_forward(q, q, q, q, torch.randn(3, 40, 2), chunk_size=16, **RAW, **IN_KERNEL)
    sl = fake.got["cu_seqlens"]
    assert isinstance(sl, seqlens.SeqLens) and not reads
    assert sl.cu32.tolist() == [0, 40, 80, 120] and sl.chunk_size == 16 and sl.num_chunks == 9
    assert tuple(fake.got["q"].shape) == (1, 120, 2, 64)


@pytest.mark.parametrize("which", ["q", "g", "A_log", "initial_state"])
def test_inputs_that_require_grad_are_refused_in_grad_mode(which):
    """Forward only: FLA's chunk_kda would differentiate, so a call that expects gradients
    is refused by name rather than run without them; under no_grad it goes on (to the
    next check here: there is no GPU)."""
    q, k, v, g, beta = _x()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=torch.zeros(2), dt_bias=torch.zeros(128),
                initial_state=torch.zeros(1, 2, 64, 64))
    args[which] = args[which].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=f"forward only, but {which} require grad"):
        kda_forward(**args, **IN_KERNEL)
    with torch.no_grad():
        with pytest.raises(Exception) as exc:
            kda_forward(**args, **IN_KERNEL)
    assert "require grad" not in str(exc.value)
