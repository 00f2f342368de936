"""``reorder="balanced"`` (contiguous layout): the plan permutes the sequences, and every path still
takes and returns the caller's order; the reference is the naive one given that permutation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import cpshard
from cpshard import BshdPlan, ShardPlan, shard, shift_exchange, unshard
from cpshard.ops.sharding import unshard_by
from cpshard.index.closed import thd_restore, thd_restore_by_rank, zigzag_by_rank, zigzag_rows
from reference import ref_padded_lengths, ref_shard
from strategies import props
from test_exchange import emulate_shift_sharded


@given(
    lens=st.lists(st.integers(0, 300) | st.integers(0, 5), min_size=1, max_size=24),
    cp=st.integers(1, 6),
    tp=st.integers(1, 3),
    padding=st.sampled_from(["aligned", "minimal"]),
    k=st.integers(0, 3),
    by=st.sampled_from(["runs", "index", "ranks"]),
)
@props(120)
def test_reordered_plan_matches_the_reference(lens, cp, tp, padding, k, by):
    _reordered_plan_matches_the_reference(lens, cp, tp, padding, k, by)  # the restore by runs, by an index, by rank


def _reordered_plan_matches_the_reference(lens, cp, tp, padding, k, by="auto"):
    plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout="contiguous", padding=padding, reorder="balanced")
    order = plan.order if plan.order is not None else tuple(range(len(lens)))
    assert sorted(order) == list(range(len(lens)))
    assert plan.seqlens_py == tuple(lens[i] for i in order) and plan.input_seqlens_py == tuple(lens)
    # the caller's batch padded as SPEC says, then each sequence moved with its padded length
    padded = ref_padded_lengths(lens, cp, tp, "contiguous", padding=padding)
    assert list(plan.padded_seqlens_py) == [padded[i] for i in order]
    seqs = [torch.arange(n) * 10 + i for i, n in enumerate(lens)]
    x = torch.cat(seqs)
    parts = [shard(seqs, plan, r) for r in range(cp)]
    for r in range(cp):
        want = ref_shard(seqs, lens, cp, tp, "contiguous", r, shift=k, fill=-7, order=order, padding=padding)
        assert torch.equal(shard(x, plan, r, shift=k, fill=-7), want)
        assert torch.equal(plan.label_mask(r, max(k, 1)), shard([torch.ones(n, dtype=torch.bool) for n in lens],
                                                                 plan, r, shift=max(k, 1), fill=False))
    back = unshard(parts, plan) if by == "auto" else unshard_by(parts, plan, by)
    assert torch.equal(back.values(), x) and back.offsets().tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert torch.equal(cpshard.shift(x, plan, max(k, 1), fill=-7),
                       cpshard.shift(x, ShardPlan.build(lens, cp_size=1), max(k, 1), fill=-7))
    # the sharded shift's exchange works on the reordered buffer as on any other
    outs, _ = emulate_shift_sharded(parts, plan, k, fill=-7, pad_value=-7)
    for r in range(cp):
        assert torch.equal(outs[r], shard(x, plan, r, shift=k, fill=-7, pad_value=-7))
    assert all(shift_exchange(plan, r, k).total_remote >= 0 for r in range(cp))


def test_reorder_is_part_of_the_value_and_cu_seqlens_follow_it():
    lens = [9000, 10, 4000, 3, 7000, 50]
    plain = ShardPlan.build(lens, cp_size=4, layout="contiguous")
    balanced = ShardPlan.build(lens, cp_size=4, layout="contiguous", reorder="balanced")
    assert balanced.order is not None and balanced != plain
    assert list(balanced.cu_seqlens_py) == [0, *torch.tensor([lens[i] for i in balanced.order]).cumsum(0).tolist()]
    assert ShardPlan(balanced.seqlens_py, balanced.padded_seqlens_py, 4, layout="contiguous",
                     order=balanced.order) == balanced
    assert ShardPlan(lens, plain.padded_seqlens_py, 4, layout="contiguous", order=range(6)) == plain  # identity


def test_reorder_errors():
    import pytest

    with pytest.raises(ValueError, match="reorder='balanced': balances the contiguous layout"):
        ShardPlan.build([5, 3], cp_size=2, reorder="balanced")
    with pytest.raises(ValueError, match=r"reorder='sorted': is not a known order \(or None: the caller's\) "
                                         r"\(valid: 'balanced'\)"):
        ShardPlan.build([5, 3], cp_size=2, layout="contiguous", reorder="sorted")
    with pytest.raises(ValueError, match=r"order=\(0, 0\): must be a permutation of range\(2\)"):
        ShardPlan((5, 3), (6, 4), 2, layout="contiguous", order=(0, 0))
    with pytest.raises(ValueError, match="padding='tight': is not a padding mode"):
        ShardPlan.build([5, 3], cp_size=2, padding="tight")


@props(60)
@given(lens=st.lists(st.integers(0, 90), min_size=1, max_size=12), cp=st.integers(1, 6), tp=st.integers(1, 3),
       layout=st.sampled_from(["zigzag", "contiguous"]), padding=st.sampled_from(["aligned", "minimal"]),
       reorder=st.booleans())
@example(lens=[3, 0, 7, 1], cp=4, tp=1, layout="zigzag", padding="aligned", reorder=False)  # one chunk size: 1
@example(lens=[3, 0, 70, 1], cp=4, tp=2, layout="zigzag", padding="aligned", reorder=False)  # chunks of 2 and 10
@example(lens=[0, 0], cp=3, tp=1, layout="zigzag", padding="minimal", reorder=False)  # no token
def test_restore_index_in_closed_form_equals_the_segments(lens, cp, tp, layout, padding, reorder):
    """The THD restore index computed per token (closed form) is the one every rank's segments give:
    the token's (rank, local row), read from each rank's global rows, in the caller's order."""
    plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=padding,
                           reorder="balanced" if reorder and layout == "contiguous" else None)
    index = plan.indices().unshard(torch.device("cpu")).tolist()
    # naive: global padded row of each token in buffer order -> where it sits in the rank-concatenated buffer
    where = {}
    for r in range(cp):
        for j, g in enumerate(plan.global_rows(r).tolist()):
            where[g] = r * plan.local_len + j
    buffer_of = {caller: j for j, caller in enumerate(plan.order or range(plan.num_seqs))}
    want = [where[plan.cu_seqlens_padded_py[buffer_of[i]] + p] for i, n in enumerate(plan.input_seqlens_py)
            for p in range(n)]
    assert index == want
    assert thd_restore(plan).tolist() == want  # the closed form, whichever path ran


@props(60)
@given(chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=10),
       h=st.integers(1, 5), cp=st.integers(2, 6))
def test_zigzag_rows_by_one_chunk_size_equals_by_each(chunks, h, cp):
    """``zigzag_rows`` given one chunk size (an int: one division by a number) places every position
    where the same size given per position does (the division element by element)."""
    pos = np.array([min(p, 2 * cp * h - 1) for p, _ in chunks], dtype=np.int32)
    base = np.array([b * 2 * h for _, b in chunks], dtype=np.int32)
    each = zigzag_rows(pos.copy(), np.full(pos.shape, h, dtype=np.int32), base.copy(), cp, 100)
    assert zigzag_rows(pos.copy(), h, base.copy(), cp, 100).tolist() == each.tolist()


@props(80)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=12), cp=st.integers(2, 5), tp=st.integers(1, 2),
       bshd=st.booleans())
@example(lens=[0, 0], cp=2, tp=1, bshd=False)  # no token
@example(lens=[9, 0, 3], cp=2, tp=1, bshd=True)  # second chunks
def test_restore_by_position_equals_the_restore_index(lens, cp, tp, bshd):
    """The restore grouped by rank without a sort (``zigzag_by_rank``: one chunk size, grouped by rank,
    position, then the caller's order) gathers each token from where the restore index says it is."""
    if bshd:
        plan = BshdPlan.build(lens, cp_size=cp, tp_size=tp)
        rows, base = plan.num_seqs * plan.local_len, [b * plan.local_len for b in range(plan.num_seqs)]
        h = plan.max_seqlen // (2 * cp)
    else:
        lens = [min(n, 2 * cp * tp) for n in lens]  # at most the alignment: one padded length, 2 cp tp
        plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp)
        rows, base = plan.local_len, [c // cp for c in plan.cu_seqlens_padded_py[:-1]]
        h = tp
    local, bounds, back = zigzag_by_rank(np.array(lens, dtype=np.int64), np.array(base, dtype=np.int64), h, cp)
    assert [len(r) for r in local] == np.diff(bounds).tolist()
    grouped = [(r, row) for r, part in enumerate(local) for row in part.tolist()]
    flat = plan.indices().unshard(torch.device("cpu")).tolist()
    assert [grouped[j][0] * rows + grouped[j][1] for j in back.tolist()] == flat
    by_rank_rows, by_rank_bounds, by_rank_back = plan.indices().unshard_by_rank()  # whichever way the plan takes
    grouped = [(r, row) for r, part in enumerate(by_rank_rows) for row in part.tolist()]
    assert [grouped[j][0] * rows + grouped[j][1] for j in by_rank_back.tolist()] == flat


@pytest.mark.parametrize("cp,tp,bshd", [(2, 1, False), (4, 2, False), (3, 1, True)])
def test_a_large_plan_restores_by_position(cp, tp, bshd):
    """A plan large enough for the restore by position (``by_position_pays``) takes it, and the gather by
    rank equals the gather by the restore index (every row distinct)."""
    gen = torch.Generator().manual_seed(cp)
    lens = torch.randint(0, 2 * cp * tp + 1, (6000,), generator=gen).tolist()
    plan = (BshdPlan if bshd else ShardPlan).build(lens, cp_size=cp, tp_size=tp)
    if not bshd:
        assert thd_restore_by_rank(plan) is not None
    parts = [torch.arange(math.prod(plan.local_shape), dtype=torch.float64).view(plan.local_shape) + r * 1e6
             for r in range(cp)]  # rows of one 8-byte number: the gather by rank takes them
    by_rank, by_index = unshard_by(parts, plan, "ranks"), unshard_by(parts, plan, "index")
    assert torch.equal(by_rank.values(), by_index.values()) and by_rank.values().shape[0] == sum(lens)
