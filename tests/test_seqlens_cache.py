"""The per-tensor cache of checked cu_seqlens (kdagen/seqlens.py): a hit reads no values,
any in-place change or another tensor is checked afresh, and errors stay the same."""

from __future__ import annotations

import pytest
import torch

from kdagen import checks as ck
from kdagen import seqlens
from kdagen.varlen import prepare_chunk_indices, prepare_chunk_offsets


def _stub_kernels(seen=None):
    from kdagen.ops import Kernels
    from kdagen.spec import KernelSpec

    seen = {} if seen is None else seen
    stub = {"prologue": lambda *a: seen.__setitem__("prologue", a),
            "chunk": lambda *a: seen.__setitem__("chunk", a)}
    return Kernels(KernelSpec.parse({"target": "sm_90"}), stub, device_type="cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    seqlens.clear()
    reads = []
    real = ck.cu_seqlens_values

    def counting(op, t, total):
        reads.append(t)
        return real(op, t, total)

    monkeypatch.setattr(ck, "cu_seqlens_values", counting)
    yield reads
    seqlens.clear()


def test_second_call_reads_nothing_and_derives_the_same(fresh):
    cu = torch.tensor([0, 5, 5, 70, 200], dtype=torch.int64)
    a = seqlens.checked("op", cu, 200, None, 64)
    b = seqlens.checked("op", cu, 200, None, 64)
    assert len(fresh) == 1 and a is b
    assert a.num_chunks == 1 + 0 + 2 + 3
    assert torch.equal(a.chunk_indices, prepare_chunk_indices(cu, 64))
    assert torch.equal(a.chunk_offsets, prepare_chunk_offsets(cu, 64))
    assert a.cu32.dtype == torch.int32 and a.num_seqs == 4


def test_in_place_change_is_checked_again(fresh):
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    seqlens.checked("op", cu, 128, None, 64)
    cu[1] = 100  # bumps the version counter
    info = seqlens.checked("op", cu, 128, None, 64)
    assert len(fresh) == 2 and info.num_chunks == 3
    cu[1] = 200
    with pytest.raises(ValueError, match="non-decreasing"):
        seqlens.checked("op", cu, 128, None, 64)


def test_hit_with_another_token_count_still_fails():
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    seqlens.checked("op", cu, 128, None, 64)
    with pytest.raises(ValueError, match="must end at or before the token count 127, got 128"):
        seqlens.checked("op", cu, 127, None, 64)
    assert seqlens.checked("op", cu, 129, None, 64).total_tokens == 128  # a padded tail


def test_equal_values_in_another_tensor_are_checked(fresh):
    seqlens.checked("op", torch.tensor([0, 64]), 64, None, 64)
    seqlens.checked("op", torch.tensor([0, 64]), 64, None, 64)
    assert len(fresh) == 2


def test_chunk_size_is_part_of_the_key():
    cu = torch.tensor([0, 100], dtype=torch.int32)
    assert seqlens.checked("op", cu, 100, None, 64).num_chunks == 2
    assert seqlens.checked("op", cu, 100, None, 32).num_chunks == 4


def test_switched_off_checks_every_call(fresh, monkeypatch):
    monkeypatch.setenv("KDAGEN_SEQLEN_CACHE", "0")
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    a = seqlens.checked("op", cu, 128, None, 64)
    assert a.chunk_indices is None and a.num_chunks is None
    assert torch.equal(a.chunk_offsets, prepare_chunk_offsets(cu, 64))
    with pytest.raises(ValueError, match="must start at 0"):
        seqlens.checked("op", torch.tensor([1, 64]), 64, None, 64)


def test_values_unreadable_skips_the_cache(monkeypatch):
    monkeypatch.setenv("KDAGEN_CHECK_VALUES", "0")
    cu = torch.tensor([3, 1], dtype=torch.int32)  # wrong, but values cannot be read
    info = seqlens.checked("op", cu, 64, None, 64)
    assert info.chunk_indices is None


def test_bounded_and_no_stale_identity(fresh):
    for _ in range(3 * seqlens.CACHE_ENTRIES):
        seqlens.checked("op", torch.tensor([0, 64], dtype=torch.int32), 64, None, 64)
    assert len(seqlens._entries) <= seqlens.CACHE_ENTRIES
    assert len(fresh) == 3 * seqlens.CACHE_ENTRIES  # a dead tensor's id never hits


def test_ops_read_cu_seqlens_once_per_tensor(fresh):
    """Prologue then chunk scan on one cu_seqlens (kernels stubbed, CPU tensors): one host
    read, and the kernels get the cached int32 offsets and chunk indices."""
    from kdagen.testing import make_inputs

    seen = {}
    kern = _stub_kernels(seen)
    x = make_inputs([100, 0, 64, 3], 2, 128, device="cpu", seed=3)
    for _ in range(3):
        p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
        kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"], None,
                             x.cu_seqlens, None, True, groups=1)
    assert len(fresh) == 1
    cu32, ci = seen["prologue"][13], seen["prologue"][14]
    assert cu32.dtype == torch.int32 and torch.equal(cu32, x.cu_seqlens.to(torch.int32))
    assert torch.equal(ci, prepare_chunk_indices(x.cu_seqlens, 64))
    assert torch.equal(seen["chunk"][8], prepare_chunk_offsets(x.cu_seqlens, 64))
    assert p["kg_t"].shape[0] == 2 + 0 + 1 + 1


def test_inference_tensors_are_checked_every_call(fresh):
    """An inference-mode tensor has no version counter: it works, but is never cached."""
    with torch.inference_mode():
        cu = torch.tensor([0, 64, 100], dtype=torch.int32)
        a = seqlens.checked("op", cu, 100, None, 64)
        b = seqlens.checked("op", cu, 100, None, 64)
        assert torch.equal(b.chunk_offsets, prepare_chunk_offsets(cu, 64))
        cu[1] = 200
        with pytest.raises(ValueError, match="non-decreasing"):
            seqlens.checked("op", cu, 100, None, 64)
    assert a.chunk_indices is None and len(seqlens._entries) == 0


def test_normal_tensor_used_inside_inference_mode_is_cached(fresh):
    cu = torch.tensor([0, 64, 100], dtype=torch.int32)
    with torch.inference_mode():
        seqlens.checked("op", cu, 100, None, 64)
        seqlens.checked("op", cu, 100, None, 64)
    assert len(fresh) == 1


def test_ops_under_inference_mode():
    """A serving engine's forward: everything made and run under inference_mode."""
    from kdagen.testing import make_inputs

    kern = _stub_kernels()
    with torch.inference_mode():
        x = make_inputs([70, 5], 2, 128, device="cpu", seed=2)
        p = kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)
        kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"], None,
                             x.cu_seqlens, None, True, groups=1)
    assert p["kg_t"].shape[0] == 3


def test_prepared_seqlens_read_nothing_in_the_ops(fresh):
    """prepare_seqlens under inference mode (an engine's forward): one read of the values
    for any number of layers, and the kernels get its tensors."""
    from kdagen.testing import make_inputs

    seen = {}
    kern = _stub_kernels(seen)
    with torch.inference_mode():
        x = make_inputs([70, 0, 129], 2, 128, device="cpu", seed=4)
        sl = seqlens.prepare(x.cu_seqlens, 64)
        assert sl.num_chunks == 2 + 0 + 3 and sl.total_tokens == 199
        for _ in range(3):  # three layers
            p = kern.fused_kda_prologue(*x.args(), None, None, sl)
            kern.fused_kda_chunk(p["qg"], p["w"], p["u"], p["kg_t"], p["aqk"], p["decay"], p["u"],
                                 None, sl, None, True, groups=1)
    assert len(fresh) == 1  # prepare's; the ops read nothing
    assert seen["prologue"][14] is sl.chunk_indices and seen["chunk"][8] is sl.chunk_offsets
    with torch.inference_mode():
        kern.fused_kda_prologue(*x.args(), None, None, x.cu_seqlens)  # a plain inference tensor
    assert len(fresh) == 2  # ... is read and checked on every call
    assert torch.equal(sl.chunk_indices, prepare_chunk_indices(x.cu_seqlens, 64))


def test_prepared_seqlens_are_checked_against_the_call():
    from kdagen import checks

    with pytest.raises(ValueError, match="non-decreasing"):
        seqlens.prepare(torch.tensor([0, 9, 3]), 64)
    with pytest.raises(ValueError, match="chunk_size"):
        seqlens.prepare(torch.tensor([0, 9]), 0)
    sl = seqlens.prepare(torch.tensor([0, 64, 100]), 32)
    with pytest.raises(checks.ArgumentError, match="prepared for chunk size 32"):
        seqlens.checked("op", sl, 100, None, 64)
    with pytest.raises(checks.ArgumentError, match="must end at or before the token count 99, got 100"):
        seqlens.checked("op", sl, 99, None, 32)
    assert seqlens.checked("op", sl, 101, None, 32) is sl  # a padded tail
    with pytest.raises(checks.ArgumentError, match="must be on meta"):
        seqlens.checked("op", sl, 100, torch.device("meta"), 32)
    assert seqlens.checked("op", sl, 100, torch.device("cpu"), 32) is sl


def test_cu_seqlens_one_step_back_is_refused_and_equal_steps_are_not():
    """The boundary of the non-decreasing check: a step back of one token is refused and
    named; an equal step (a sequence of length 0) is accepted (scripts/mutants.py
    cu-seqlens-decreasing: a check off by one passed every test before this one)."""
    from kdagen import checks

    assert checks.cu_seqlens_values("op", torch.tensor([0, 64, 64, 128]), 128) == [0, 64, 64, 128]
    with pytest.raises(ValueError, match=r"non-decreasing, but \[1\] = 65 > \[2\] = 64"):
        checks.cu_seqlens_values("op", torch.tensor([0, 65, 64, 128]), 128)
    with pytest.raises(ValueError, match="non-decreasing"):
        seqlens.checked("op", torch.tensor([0, 65, 64, 128], dtype=torch.int32), 128, None, 64)


def test_index_ranges_are_read_once_per_tensor_version(monkeypatch):
    """state_indices and the like: their range is read back once per tensor and version
    (every layer of a forward pass shares one), again after an in-place change, and on
    every call for an inference-mode tensor or with KDAGEN_SEQLEN_CACHE=0."""
    reads = []
    real = torch.aminmax

    def counting(x):
        reads.append(x)
        return real(x)

    monkeypatch.setattr(torch, "aminmax", counting)
    idx = torch.tensor([3, -1, 7], dtype=torch.int32)
    for _ in range(3):
        assert ck.indices("op", "state_indices", idx, 3, 8, None) is idx
    assert len(reads) == 1
    idx[0] = 8  # in place: a new version, checked afresh, and now out of range
    with pytest.raises(ValueError, match="holds row 8"):
        ck.indices("op", "state_indices", idx, 3, 8, None)
    assert len(reads) == 2
    with torch.inference_mode():
        frozen = torch.tensor([1, 2, 3], dtype=torch.int32)
    ck.indices("op", "state_indices", frozen, 3, 8, None)
    ck.indices("op", "state_indices", frozen, 3, 8, None)
    assert len(reads) == 4
    monkeypatch.setenv("KDAGEN_SEQLEN_CACHE", "0")
    other = torch.tensor([0, 1, 2], dtype=torch.int64)
    ck.indices("op", "state_indices", other, 3, 8, None)
    ck.indices("op", "state_indices", other, 3, 8, None)
    assert len(reads) == 6


@pytest.mark.parametrize("B,T,C", [(1, 64, 16), (3, 37, 16), (2, 0, 32), (4, 100, 64)])
def test_dense_batch_bookkeeping_reads_nothing_back(fresh, B, T, C):
    """seqlens.dense: B sequences of T tokens from the shape alone (kda_forward without
    cu_seqlens), equal to what a checked cu_seqlens tensor of that batch derives, with no
    host read; kept per shape."""
    sl = seqlens.dense(B, T, C, torch.device("cpu"))
    assert not fresh  # no cu_seqlens value was read
    cu = torch.arange(B + 1) * T
    want = seqlens.prepare(cu, C)
    assert sl.cu32.dtype == torch.int32 and sl.cu32.tolist() == cu.tolist()
    assert sl.chunk_offsets.tolist() == want.chunk_offsets.tolist()
    assert sl.chunk_indices.tolist() == want.chunk_indices.tolist()
    assert (sl.num_chunks, sl.total_tokens, sl.chunk_size) == (want.num_chunks, B * T, C)
    assert seqlens.dense(B, T, C, torch.device("cpu")) is sl
    assert seqlens.dense(B, T + 1, C, torch.device("cpu")) is not sl


@pytest.mark.parametrize("values, dup", [([3, 1, 3], 3), ([0, -1, -1, 0], 0), ([2, -1, -1, 5], None)])
def test_a_row_named_twice_is_refused(values, dup):
    """Two sequences on one cache / checkpoint / conv row would write it at once: refused
    (negative entries, 'none', may repeat), from the same one read back as the range."""
    idx = torch.tensor(values, dtype=torch.int32)
    if dup is None:
        assert ck.indices("op", "state_indices", idx, len(values), 8, None) is idx
    else:
        with pytest.raises(ValueError, match=f"names row {dup} for two sequences"):
            ck.indices("op", "state_indices", idx, len(values), 8, None)


def test_checkpoint_rows_may_repeat():
    """checkpoint_state_indices may name a row twice: a sequence whose offset is 0 writes
    none, so only the caller knows whether two would."""
    idx = torch.tensor([3, 3], dtype=torch.int32)
    assert ck.indices("op", "checkpoint_state_indices", idx, 2, 8, None, distinct=False) is idx
