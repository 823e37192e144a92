"""kda_forward's own argument rules (CPU: they fire before any variant is chosen)."""

import pytest
import torch

from kdagen.layer import kda_forward


def _x():
    q = torch.randn(1, 8, 2, 64)
    return q, q, q, q, torch.randn(1, 8, 2)


@pytest.mark.parametrize("flag", ["use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                  "use_beta_sigmoid_in_kernel"])
def test_out_of_kernel_options_are_refused(flag):
    with pytest.raises(ValueError, match=flag):
        kda_forward(*_x(), A_log=torch.zeros(2), dt_bias=torch.zeros(128), **{flag: False})


def test_k_first_state_layout_is_an_error_not_a_transpose():
    with pytest.raises(ValueError, match="state_v_first"):
        kda_forward(*_x(), state_v_first=False, A_log=torch.zeros(2), dt_bias=torch.zeros(128))


def test_cu_seqlens_needs_batch_one():
    q = torch.randn(2, 8, 2, 64)
    with pytest.raises(ValueError, match="batch must be 1"):
        kda_forward(q, q, q, q, torch.randn(2, 8, 2), cu_seqlens=torch.tensor([0, 8]),
                    A_log=torch.zeros(2), dt_bias=torch.zeros(128))


def test_initial_state_must_be_fp32():
    with pytest.raises(TypeError, match="initial_state"):
        kda_forward(*_x(), initial_state=torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16),
                    A_log=torch.zeros(2), dt_bias=torch.zeros(128))
