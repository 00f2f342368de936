"""cpshard.compat.torch_cp in one process: the rank-order indices against the naive per-token reference,
the caller's padded buffer, the document mask, plans from position ids, and every error. Across gloo
ranks, through torch's own shard, unshard and flex attention: tests/test_torch_cp_distributed.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpshard import ShardPlan, shard
from cpshard.compat import torch_cp
from reference import ref_document_mask, ref_rank_order
from strategies import props, torch_cp_batches, torch_cp_documents as documents


# -- the indices -------------------------------------------------------------------------------


@props(60)
@given(torch_cp_batches(fp8=True))
def test_rearrange_indices_equal_the_per_token_reference(batch):
    plans, _ = batch
    got = torch_cp.rearrange_indices(plans)
    back = torch_cp.rearrange_indices(plans, restore=True)
    S = plans[0].total_len
    assert got.shape == back.shape == (len(plans), S) and got.dtype == back.dtype == torch.int64
    for b, plan in enumerate(plans):
        expected = ref_rank_order(plan.input_padded_seqlens_py, plan.order, plan.cp_size, plan.layout)
        assert got[b].tolist() == expected
        assert torch.equal(got[b][back[b]], torch.arange(S)) and torch.equal(back[b][got[b]], torch.arange(S))
    balancer = torch_cp.load_balancer(plans)
    assert isinstance(balancer, torch_cp.torch_names()._LoadBalancer)
    assert torch.equal(balancer._generate_indices(), got)
    assert torch.equal(balancer._generate_indices(restore=True), back)
    assert balancer._generate_indices() is balancer._generate_indices()  # built once per balancer


@props(40)
@given(torch_cp_batches(), st.sampled_from([(), (2,)]))
def test_the_rearranged_buffer_gives_each_rank_its_shard(batch, trailing):
    plans, _ = batch
    docs = documents(plans, trailing)
    buffer = torch_cp.to_buffer(docs, plans, pad_value=-7)
    assert buffer.shape == (len(plans), plans[0].total_len, *trailing)
    index = torch_cp.rearrange_indices(plans).view(len(plans), -1, *(1,) * len(trailing)).expand_as(buffer)
    rearranged = buffer.gather(1, index)
    cp = plans[0].cp_size
    for r, piece in enumerate(rearranged.chunk(cp, dim=1)):
        for b, plan in enumerate(plans):
            assert torch.equal(piece[b], shard(docs[b], plan, r, pad_value=-7))
    restore = torch_cp.rearrange_indices(plans, restore=True).view_as(index[..., 0] if trailing else index)
    restore = restore.view(len(plans), -1, *(1,) * len(trailing)).expand_as(buffer)
    assert torch.equal(rearranged.gather(1, restore), buffer)
    back = torch_cp.from_buffer(buffer, plans)
    assert all(torch.equal(x, y) for row, want in zip(back, docs) for x, y in zip(row, want, strict=True))


@props(30)
@given(torch_cp_batches(extra=False))
def test_document_mask_mod_equals_the_reference(batch):
    plans, _ = batch
    mask_mod = torch_cp.document_mask_mod(plans)
    S = plans[0].total_len
    q = torch.arange(S)
    b = torch.arange(len(plans))[:, None, None, None]
    mask = mask_mod(b, torch.zeros(1, dtype=torch.long), q[:, None], q[None, :])
    assert mask.shape == (len(plans), 1, S, S) and mask.dtype == torch.bool
    for i, plan in enumerate(plans):
        assert mask[i, 0].tolist() == ref_document_mask(plan.input_seqlens_py, plan.input_padded_seqlens_py)


def test_the_docstring_picture():
    plan = ShardPlan.build([5, 3], cp_size=2)
    assert torch_cp.rearrange_indices(plan).tolist() == [[0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10]]
    assert torch_cp.rearrange_indices([plan], restore=True).tolist() == [[0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]]
    assert torch.cat([plan.global_rows(r) for r in range(2)]).tolist() == [0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10]


# -- plans from position ids -------------------------------------------------------------------


def positions_of(rows):
    return torch.tensor([[p for n in lens for p in range(n)] for lens in rows])


@props(40)
@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from(["zigzag", "contiguous"]), st.integers(1, 3), st.data())
def test_plans_from_positions(cp, layout, B, data):
    """Rows of any documents (1-token ones, ones shorter than 2 * cp), either layout: nothing padded."""
    S = cp * data.draw(st.integers(1, 12))
    rows = []
    for _ in range(B):
        lens, left = [], S
        while left:
            n = data.draw(st.sampled_from([1, 2, 2 * cp - 1]) | st.integers(1, left))
            lens.append(min(n, left))
            left -= lens[-1]
        rows.append(lens)
    plans = torch_cp.plans_from_positions(positions_of(rows), cp_size=cp, layout=layout)
    assert torch_cp.document_lengths(positions_of(rows)) == rows
    for plan, lens in zip(plans, rows, strict=True):
        assert plan.input_seqlens_py == tuple(lens) and plan.total_len == S and plan.cp_size == cp
        assert plan.input_padded_seqlens_py == tuple(lens)  # a full row: nothing padded
        balanced = layout == "contiguous" and cp > 1
        assert plan == ShardPlan.build(lens, cp_size=cp, layout=layout,
                                       padding="none" if layout == "zigzag" else "minimal",
                                       reorder="balanced" if balanced else None, total_len=S)
        assert [plan.local_len] * cp == [len(plan.global_rows(r)) for r in range(cp)] == [S // cp] * cp
    one = torch_cp.plans_from_positions(positions_of(rows)[0], cp_size=cp, layout=layout)
    assert one == plans[:1]


def test_plans_from_positions_keep_the_callers_order_on_request():
    plans = torch_cp.plans_from_positions(positions_of([[2, 1, 9, 4]]), cp_size=4, reorder=None)
    assert plans[0].order is None and plans[0].layout.value == "contiguous"
    plans = torch_cp.plans_from_positions(positions_of([[2, 1, 9, 4]]), cp_size=4)
    assert plans[0] == ShardPlan.build([2, 1, 9, 4], cp_size=4, layout="contiguous", padding="minimal",
                                       reorder="balanced", total_len=16)


@pytest.mark.parametrize("positions, kw, match", [
    (torch.tensor([[1, 2, 3, 4]]), {}, r"positions\[0, 0\]=1: must be 0"),
    (torch.tensor([[0, 1, 3, 4]]), {}, r"positions\[0, 2\]=3: must be positions\[0, 1\] \+ 1 = 2 or 0"),
    (torch.tensor([[0, 1, 2, 3], [0, 1, 1, 0]]), {}, r"positions\[1, 2\]=1"),
    (torch.tensor([[0, 1, 2]]), {}, r"S=3 positions.*divide by cp_size \* tp_size = 2"),
    (torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), {"tp_size": 3}, r"cp_size \* tp_size = 6"),
    (torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1]]), {"layout": "zigzag", "padding": "minimal"},
     r"positions\[0\]=document 1 of length 2: every document of a full row must divide by 4 .*padding at its "
     r"default \(zigzag: 'none'"),
    (torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), {"padding": "aligned"}, r"document 0 of length 3: .* divide by 2"),
    (torch.zeros((1, 0), dtype=torch.long), {}, r"must be \(B, S\) with B >= 1, or \(S,\), with S >= 1"),
    # no row at all (B = 0): an IndexError from inside before; a meta tensor: torch's NotImplementedError
    (torch.zeros((0, 8), dtype=torch.long), {}, r"positions=shape \(0, 8\): must be \(B, S\) with B >= 1"),
    (torch.zeros((1, 4), dtype=torch.long, device="meta"), {}, r"positions=a tensor .* on the meta device"),
    (torch.zeros((1, 2, 2), dtype=torch.long), {}, r"must be \(B, S\)"),
    (torch.tensor([[0, 1, 2, 3]]), {"layout": "zigzag", "reorder": "balanced"}, r"reorder='balanced'"),
    # uint64 past int64: before, the cast wrapped it and the error named the value -1
    (np.array([[0, 1, 0, 2**64 - 1]], dtype=np.uint64), {}, r"positions\[0, 3\]=18446744073709551615: is past int64"),
])
def test_plans_from_positions_errors(positions, kw, match):
    with pytest.raises(ValueError, match=match):
        torch_cp.plans_from_positions(positions, cp_size=2, **kw)


def test_positions_must_be_integers():
    with pytest.raises(TypeError, match=r"positions=torch.float32 tensor: must hold integers"):
        torch_cp.plans_from_positions(torch.zeros(1, 4), cp_size=2)
    with pytest.raises(TypeError, match=r"must hold integers"):
        torch_cp.document_lengths([[0.0, 1.0]])
    assert torch_cp.document_lengths([[0, 0, 1]]) == [[1, 2]]


# -- errors ------------------------------------------------------------------------------------


def test_plans_must_share_one_total_and_cp():
    a = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match=r"plans\[1\].total_len=16: must equal plans\[0\].total_len=12"):
        torch_cp.rearrange_indices([a, ShardPlan.build([5, 3], cp_size=2, total_len=16)])
    with pytest.raises(ValueError, match=r"plans\[1\].cp_size=3: must equal plans\[0\].cp_size=2"):
        torch_cp.load_balancer([a, ShardPlan.build([12], cp_size=3)])
    with pytest.raises(TypeError, match=r"plans=list: must be a non-empty list"):
        torch_cp.document_mask_mod([])
    with pytest.raises(TypeError, match=r"plans\[0\]=BshdPlan: must be a ShardPlan"):
        from cpshard import BshdPlan
        torch_cp.rearrange_indices([BshdPlan.build([3], cp_size=2)])


def test_a_mesh_of_another_size_is_refused():
    class Mesh:  # what load_balancer reads of a DeviceMesh
        device_type = "cpu"

        def size(self):
            return 4

    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match=r"mesh=a device mesh of 4 ranks: must have the plans' cp_size=2 ranks"):
        torch_cp.load_balancer(plan, mesh=Mesh())
    assert torch_cp.load_balancer(ShardPlan.build([5, 3], cp_size=4), mesh=Mesh()).device == torch.device("cpu")


def test_buffer_errors():
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(TypeError, match=r"documents=list: must be a list of 1 rows"):
        torch_cp.to_buffer([], [plan])
    with pytest.raises(TypeError, match=r"documents\[0\]=list: must be a list of the row's 2 documents"):
        torch_cp.to_buffer([[torch.zeros(5)]], [plan])
    with pytest.raises(ValueError, match=r"documents\[0\]\[1\]=.*shape \(4,\).*must hold the plan's 3 tokens"):
        torch_cp.to_buffer([[torch.zeros(5), torch.zeros(4)]], [plan])
    with pytest.raises(ValueError, match=r"documents\[0\]\[1\]=torch.int64 tensor.*like the first document"):
        torch_cp.to_buffer([[torch.zeros(5), torch.zeros(3, dtype=torch.long)]], [plan])
    with pytest.raises(ValueError, match=r"buffer=tensor of shape \(1, 11\): must be \(B, S, ...\) = \(1, 12, ...\)"):
        torch_cp.from_buffer(torch.zeros(1, 11), [plan])
    empty = ShardPlan.build([0, 0], cp_size=2, total_len=8)
    buffer = torch_cp.to_buffer([[torch.zeros(0), torch.zeros(0)]], [empty], pad_value=3)
    assert torch.equal(buffer, torch.full((1, 8), 3.0))


def test_ring_sdpa_is_refused():
    """torch's ring SDPA assumes head-tail rows whenever a balancer is set: a cpshard balancer asked
    for indices while its dispatcher is on raises, naming the fix, and serves again once it is off."""
    from torch.distributed.tensor.experimental._attention import (
        _disable_context_parallel_dispatcher,
        _enable_context_parallel_dispatcher,
    )

    balancer = torch_cp.load_balancer(ShardPlan.build([5, 3], cp_size=2))
    assert not torch_cp.ring_sdpa_active()
    _enable_context_parallel_dispatcher()
    try:
        assert torch_cp.ring_sdpa_active()
        with pytest.raises(RuntimeError, match=r"ring-SDPA.*silently wrong.*document_mask_mod"):
            balancer._generate_indices()
    finally:
        _disable_context_parallel_dispatcher()
    assert not torch_cp.ring_sdpa_active()
    assert balancer._generate_indices().shape == (1, 12)


def test_a_torch_without_the_interface_is_named():
    """A torch that lacks the private interface: an ImportError naming the tested version and the way out
    (a fresh interpreter in which torch's module cannot be imported)."""
    code = ("import sys; sys.modules['torch.distributed.tensor.experimental._context_parallel._load_balancer'] = None\n"
            "from cpshard import ShardPlan\nfrom cpshard.compat import torch_cp\n"
            "assert torch_cp.rearrange_indices(ShardPlan.build([3], cp_size=2)).shape == (1, 4)\n"
            "try:\n    torch_cp.load_balancer(ShardPlan.build([3], cp_size=2))\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"tested on torch {torch_cp.TESTED_TORCH}" in out and "_load_balancer" in out
    assert "install torch==2.13.0, or shard by hand with cpshard.compat.torch_cp.rearrange_indices" in out


# -- the edges: pad values, (B, H, S, D) buffers, the mesh, the block mask's length ----------------------


def test_pad_value_must_fit_the_documents_dtype():
    """Before: 1.5 on int64 rows padded with 1 and -1 on uint8 rows with 255, silently (``shard`` refused both)."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match=r"pad_value=1.5: does not fit rows of integer dtype torch.int64"):
        torch_cp.to_buffer([[torch.zeros(5, dtype=torch.long), torch.zeros(3, dtype=torch.long)]], plan, pad_value=1.5)
    with pytest.raises(ValueError, match=r"pad_value=-1: is outside the range of torch.uint8"):
        torch_cp.to_buffer([[torch.zeros(5, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)]], plan,
                           pad_value=-1)
    with pytest.raises(ValueError, match=r"pad_value=1.5"):
        shard(torch.zeros(8, dtype=torch.long), ShardPlan.build([8], cp_size=2), 0, pad_value=1.5)  # the same rule
    ok = torch_cp.to_buffer([[torch.ones(5, dtype=torch.uint8), torch.ones(3, dtype=torch.uint8)]], plan, pad_value=7)
    assert ok.dtype == torch.uint8 and ok[0, 5].item() == 7


@props(30)
@given(torch_cp_batches(), st.sampled_from([(2, 3), (1,)]))
def test_seq_dim_buffers_equal_the_transposed_sequence_first_ones(batch, trailing):
    """``(B, H, S, D)`` buffers (``seq_dim=2``, documents ``(H, n, D)``) are the ``(B, S, H, D)`` ones
    transposed, and ``from_buffer(..., seq_dim=2)`` gives each document back in its own layout."""
    plans, _ = batch
    docs = documents(plans, trailing)  # (n, H, ...) each
    heads_first = [[d.movedim(0, 1) for d in row] for row in docs]  # (H, n, ...)
    want = torch_cp.to_buffer(docs, plans, pad_value=-3).movedim(1, 2)
    got = torch_cp.to_buffer(heads_first, plans, pad_value=-3, seq_dim=2)
    assert got.shape == want.shape and torch.equal(got, want) and got.is_contiguous()
    back = torch_cp.from_buffer(got, plans, seq_dim=2)
    assert all(torch.equal(x, y) for row, mine in zip(back, heads_first) for x, y in zip(row, mine, strict=True))
    with pytest.raises(ValueError, match=r"seq_dim=4: must name a dimension of the 4-dimensional buffer"
                       if len(trailing) == 2 else r"seq_dim=4"):
        torch_cp.from_buffer(got, plans, seq_dim=4)


def test_seq_dim_errors():
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match=r"buffer=tensor of shape \(1, 2, 11, 4\): must be \(B, \.\.\., S, \.\.\.\) = "
                       r"\(1, \.\.\., 12, \.\.\.\)"):
        torch_cp.from_buffer(torch.zeros(1, 2, 11, 4), [plan], seq_dim=2)
    with pytest.raises(ValueError, match=r"seq_dim=0: must be >= 1"):
        torch_cp.from_buffer(torch.zeros(1, 12), [plan], seq_dim=0)
    with pytest.raises(ValueError, match=r"documents\[0\]\[1\]=.*shape \(2, 4\).*along dimension 1 as \(2, 3\)"):
        torch_cp.to_buffer([[torch.zeros(2, 5), torch.zeros(2, 4)]], [plan], seq_dim=2)


def test_positions_given_raggedly_or_not_at_all_are_named():
    """Before: NumPy's "inhomogeneous shape" ValueError, and "dtype object" for None."""
    with pytest.raises(ValueError, match=r"positions=list of rows of lengths \[3, 2\]: must be rectangular"):
        torch_cp.plans_from_positions([[0, 1, 2], [0, 1]], cp_size=1)
    with pytest.raises(TypeError, match=r"positions=None: must be the batch's position ids"):
        torch_cp.plans_from_positions(None, cp_size=1)


def test_a_mesh_that_is_not_a_1d_device_mesh_is_refused():
    class Group:  # what a ProcessGroup offers load_balancer: a size, no device type
        def size(self):
            return 2

    class Mesh2D:
        device_type, ndim, shape = "cpu", 2, (2, 2)

        def size(self):
            return 4

    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(TypeError, match=r"mesh=Group: must be a 1-D DeviceMesh.*DeviceMesh.from_group"):
        torch_cp.load_balancer(plan, mesh=Group())
    with pytest.raises(ValueError, match=r"mesh=a DeviceMesh of 2 dimensions \(2, 2\).*world_mesh\['cp'\]"):
        torch_cp.load_balancer(plan, mesh=Mesh2D(), check=True)


def test_plans_may_be_built_inside_the_balancer():
    """``load_balancer(lambda: ...)``: the plans a function returns (so that with checks on its refusal
    is carried by the agreement: tests/torch_cp_ranks.py)."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    balancer = torch_cp.load_balancer(lambda: torch_cp.plans_from_positions(pos, cp_size=2))
    assert torch.equal(balancer._generate_indices(), torch_cp.rearrange_indices(
        torch_cp.plans_from_positions(pos, cp_size=2)))
    with pytest.raises(ValueError, match=r"positions\[0, 0\]=1: must be 0"):
        torch_cp.load_balancer(lambda: torch_cp.plans_from_positions(pos + 1, cp_size=2))


@pytest.mark.parametrize("total, cp, want", [(1, 1, 128), (256, 2, 256), (300, 2, 512), (1000, 3, 1152)])
def test_block_mask_len_is_the_next_length_torchs_cp_block_mask_takes(total, cp, want):
    got = torch_cp.block_mask_len(total, cp)
    assert got == want and got >= total and got % (cp * torch_cp.BLOCK_SIZE) == 0
    assert got - total < cp * torch_cp.BLOCK_SIZE  # the smallest
    plan = ShardPlan.build([total // 2, total - total // 2], cp_size=cp, layout="contiguous", padding="minimal",
                           total_len=got)
    assert plan.total_len == got
