"""The cases of verl's own CPU tests of ``verl/models/mcore/util.py``, run against the drop-ins.

verl's ``tests/utils/test_megatron_bshd_preprocess.py`` (verl main) loads util.py with a stand-in
``megatron`` package in ``sys.modules``: module objects with no ``__spec__`` and no ``__path__``,
parallel-state getters that return fixed sizes, a ``PackedSeqParams`` that takes any keyword. The
same cases here, in cpshard's words, with the same stand-in (no verl needed): each expected value
is worked out in its comment from verl's layout rules (README, "Differences from verl"). Its one
case not repeated fakes the list form of ``torch.distributed.all_gather`` (how verl's restore
gathers, not what it returns); the gloo tests in ``test_verl_compat.py`` run that restore for real.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cpshard.compat import verl as cv

MAIN = "0.10.0.dev0"  # verl main: the copy a zigzag roll wraps in is padded only to the alignment


@pytest.fixture
def stub_megatron(monkeypatch):
    """Install a stand-in megatron answering ``tp``, ``cp`` and ``rank``; returns the setter."""

    def install(tp=4, cp=1, rank=0):
        megatron = types.ModuleType("megatron")
        core = types.ModuleType("megatron.core")
        state = types.ModuleType("megatron.core.parallel_state")
        psp = types.ModuleType("megatron.core.packed_seq_params")
        state.get_tensor_model_parallel_world_size = lambda: tp
        state.get_context_parallel_world_size = lambda: cp
        state.get_context_parallel_rank = lambda: rank
        state.get_context_parallel_group = lambda: object()
        state.get_dynamic_data_context_parallel_groups = lambda group_size: ("dynamic", group_size)

        class AnyFields:
            def __init__(self, **fields):
                self.__dict__.update(fields)

        psp.PackedSeqParams = AnyFields
        megatron.core, core.parallel_state = core, state
        for name, module in (("megatron", megatron), ("megatron.core", core),
                             ("megatron.core.parallel_state", state), ("megatron.core.packed_seq_params", psp)):
            monkeypatch.setitem(sys.modules, name, module)
        assert megatron.__spec__ is None

    return install


def _batch(*rows):
    return torch.nested.as_nested_tensor([torch.as_tensor(r) for r in rows], layout=torch.jagged)


def test_bshd_keeps_one_dimensional_rows(stub_megatron):
    # tp=4, cp=1: rows of 3 and 2 tokens padded to 4 columns (a multiple of tp), zeros after
    stub_megatron(tp=4)
    x, mask, pos = cv.preprocess_bshd_engine(_batch([11, 12, 13], [21, 22]))
    assert x.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0]]
    assert mask.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_bshd_keeps_dense_trailing_dimensions(stub_megatron, dtype):
    # top-k rows (n, 64): the padding is along the sequence only; the 64 columns stay as they are
    stub_megatron(tp=4)
    a = torch.arange(3 * 64).reshape(3, 64).to(dtype)
    b = (torch.arange(2 * 64).reshape(2, 64) + 1000).to(dtype)
    x, mask, pos = cv.preprocess_bshd_engine(_batch(a, b))
    assert x.shape == (2, 4, 64) and x.dtype == dtype
    assert torch.equal(x[0, :3], a) and torch.equal(x[1, :2], b)
    assert not x[0, 3:].any() and not x[1, 2:].any()
    assert mask.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert pos.tolist() == [[0, 1, 2, 3]] * 2


def test_thd_length_bucket_without_cp(stub_megatron):
    # 513 tokens at tp=cp=1, bucket 512: the total rounds up to 1024
    stub_megatron(tp=1, cp=1)
    rows, psp, _ = cv.preprocess_thd_engine(_batch(torch.arange(513)), pad_to_length_bucket=512)
    assert rows.shape == (1, 1024) and psp.cu_seqlens_q_padded.tolist() == [0, 1024]


def test_thd_min_local_rows_pads_with_zero_positions(stub_megatron):
    # 100 tokens, min_local_rows=128 at cp=1: 28 pad rows, whose values and position ids are 0
    stub_megatron(tp=1, cp=1)
    rows, psp, pos = cv.preprocess_thd_engine(_batch(torch.arange(100)), min_local_rows=128)
    assert rows.shape == (1, 128) and psp.cu_seqlens_q_padded.tolist() == [0, 128]
    assert rows[0].tolist() == list(range(100)) + [0] * 28
    assert pos[0].tolist() == list(range(100)) + [0] * 28


@pytest.mark.parametrize("rank", [0, 1])
def test_thd_router_rows_with_two_trailing_dimensions(stub_megatron, rank):
    # one token whose row is (48, 8), cp=2 zigzag: padded to 2 * cp = 4 rows, 2 per rank; the token
    # is padded position 0, rank 0's first row; every other row is zeros of the same shape
    stub_megatron(tp=1, cp=2, rank=rank)
    route = torch.arange(48 * 8).reshape(1, 48, 8)
    rows, psp, _ = cv.preprocess_thd_engine(_batch(route))
    want = torch.zeros(2, 48, 8, dtype=torch.int64)
    if rank == 0:
        want[0] = route[0]
    assert rows.shape == (1, 2, 48, 8) and torch.equal(rows[0], want)
    assert psp.cu_seqlens_q_padded.tolist() == [0, 4]


@pytest.mark.parametrize("version, rank, want", [
    # tokens 1..7 padded to 8, cp=2: rank 0 holds positions 0,1 | 6,7, rank 1 2,3 | 4,5. Rolled, each
    # row takes the next position's token. verl main copies the 7 tokens unpadded, so the last
    # token (position 6) wraps to the first (1), and position 7 takes the chunk's next row: the
    # wrap again (1). verl 0.9.1 copies the sequence padded to 8: position 6 takes position 7's
    # pad (0) and position 7 wraps (1).
    (MAIN, 0, [2, 3, 1, 1]),
    (MAIN, 1, [4, 5, 6, 7]),
    ("0.9.1", 0, [2, 3, 0, 1]),
    ("0.9.1", 1, [4, 5, 6, 7]),
])
def test_thd_zigzag_roll_wraps_as_each_verl_does(stub_megatron, version, rank, want):
    stub_megatron(tp=1, cp=2, rank=rank)
    rows, psp, _ = cv.preprocess_thd_engine(_batch(torch.arange(1, 8)), need_roll=True, verl_version=version)
    assert psp.cu_seqlens_q_padded.tolist() == [0, 8]
    assert rows[0].tolist() == want


@pytest.mark.parametrize("rank, ids, positions", [
    # contiguous at cp=2 pads to cp * tp = 2 (not zigzag's 4): [5, 3] -> [6, 4], 10 rows, 5 a rank;
    # rank 0 holds global rows 0-4 (sequence 0's tokens), rank 1 rows 5-9: sequence 0's pad row,
    # sequence 1's three tokens, its pad row. Pad rows: value 0, position id 0.
    (0, [10, 11, 12, 13, 14], [0, 1, 2, 3, 4]),
    (1, [0, 20, 21, 22, 0], [0, 0, 1, 2, 0]),
])
def test_thd_contiguous_takes_intervals_of_the_global_buffer(stub_megatron, rank, ids, positions):
    stub_megatron(tp=1, cp=2, rank=rank)
    rows, psp, pos = cv.preprocess_thd_engine(_batch([10, 11, 12, 13, 14], [20, 21, 22]), cp_layout="contiguous")
    assert psp.cu_seqlens_q_padded.tolist() == [0, 6, 10] and psp.cp_partition_mode == "contiguous"
    assert rows[0].tolist() == ids and pos[0].tolist() == positions


def test_thd_contiguous_roll_wraps_inside_each_sequence(stub_megatron):
    # [1..4], [5..8] at cp=2 contiguous: rank 0 holds sequence 0 whole; its last token wraps to 1
    stub_megatron(tp=1, cp=2, rank=0)
    rows, _, pos = cv.preprocess_thd_engine(_batch([1, 2, 3, 4], [5, 6, 7, 8]), need_roll=True,
                                            cp_layout="contiguous")
    assert rows[0].tolist() == [2, 3, 4, 1] and pos[0].tolist() == [1, 2, 3, 0]


def test_unknown_layout_keeps_verls_words(stub_megatron):
    stub_megatron(tp=1, cp=2)
    message = r"Unsupported context parallel layout: interleaved \(cp_layout='interleaved'; valid: 'zigzag', " \
              r"'contiguous'\)\. Fix: "
    with pytest.raises(ValueError, match=message):
        cv.preprocess_thd_engine(_batch([10, 11]), cp_layout="interleaved")
    with pytest.raises(ValueError, match=message):  # checked before post_process, as verl does
        cv.postprocess_thd_engine(torch.empty(1, 1), None, torch.empty(1), 1, post_process=False,
                                  cp_layout="interleaved")


def test_dynamic_cp_rank_from_torch_distributed(stub_megatron, monkeypatch):
    # local_cp_size=2: the group is Megatron's dynamic group (here a tuple: verl only hands it on),
    # the rank comes from torch.distributed.get_rank(group=...). One row of 64 top-k values padded
    # to 4 positions; rank 1 holds positions 1 and 2, both pad: zeros; position ids 1 (first chunk,
    # verl keeps the padded position there) and 0 (second chunk, pad)
    stub_megatron(tp=1, cp=1)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1 if group == ("dynamic", 2) else -1)
    rows, psp, pos = cv.preprocess_thd_engine(_batch(torch.arange(64.0).reshape(1, 64)), local_cp_size=2)
    assert rows.shape == (1, 2, 64) and not rows.any()
    assert pos.tolist() == [[1, 0]]
    assert psp.local_cp_size == 2 and psp.cp_group == ("dynamic", 2)
