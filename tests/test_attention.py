"""cpshard.attention against a naive per-token attention written from its definition.

Every rank is emulated in one process (the gathered keys are the concatenation of every rank's
shard), in float64: the outputs, restored with ``unshard``, and the gradients of q, k and v equal the
oracle's to rounding. The layout-naive variant is shown right under contiguous and wrong under
zigzag. One small gloo test checks the collective and its backward across real ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from cpshard import BshdPlan, Layout, ShardPlan, shard, unshard
from cpshard.attention import (
    attend_blocks,
    attend_gathered,
    attention,
    attention_mask,
    attention_work,
    contiguous_twin,
    naive_attention,
    naive_attention_mask,
)
from cpshard.spawn import CollectiveCounter, run_ranks
from strategies import props

F64 = torch.float64
H, D = 2, 3
BATCHES = [[5, 3], [1], [0, 7, 1, 2], [13, 1, 6]]


def oracle(q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    """Per sequence, per token ``p``: softmax over keys ``0..p`` of ``q . k / sqrt(D)``, times ``v``."""
    out = []
    for qs, ks, vs in zip(q, k, v):
        for p in range(qs.shape[0]):
            w = torch.softmax(torch.einsum("hd,khd->hk", qs[p], ks[:p + 1]) / math.sqrt(D), -1)
            out.append(torch.einsum("hk,khd->hd", w, vs[:p + 1]))
    return torch.stack(out) if out else torch.zeros(0, H, D, dtype=F64)


def _inputs(lens: list[int], seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, H, D, generator=g, dtype=F64).requires_grad_(True) for n in lens] for _ in range(3)]


def _emulated(q, k, v, plan, *, naive=False):
    """Every rank's output in one process, restored per sequence: ``(num_tokens, H, D)``."""
    qs, ks, vs = ([shard(x, plan, r) for r in range(plan.cp_size)] for x in (q, k, v))
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    masks = naive_attention_mask if naive else attention_mask
    outs = [attend_gathered(qs[r], k_all, v_all, masks(plan, r)) for r in range(plan.cp_size)]
    return unshard(outs, plan).values()


def _grads(out: torch.Tensor, leaves: list[list[torch.Tensor]], weight: torch.Tensor) -> list[torch.Tensor]:
    flat = [t for group in leaves for t in group]
    got = torch.autograd.grad((out * weight).sum(), flat, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, flat)]


@pytest.mark.parametrize("lens", BATCHES, ids=str)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_matches_per_token_oracle_with_gradients(lens, layout):
    q, k, v = _inputs(lens, seed=sum(lens))
    want = oracle(q, k, v)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    want_grads = _grads(want, [q, k, v], weight)
    variants = [{}, {"padding": "minimal"}, {"padding": "none"}] + (
        [{"reorder": "balanced"}] if layout is Layout.CONTIGUOUS else [])
    for cp in (1, 2, 3, 4):
        for tp in (1, 2):
            for extra in variants:
                plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, **extra)
                got = _emulated(q, k, v, plan)
                assert torch.allclose(got, want, rtol=1e-13, atol=1e-14), (cp, tp, extra)
                for g, w in zip(_grads(got, [q, k, v], weight), want_grads):
                    assert torch.allclose(g, w, rtol=1e-12, atol=1e-13), (cp, tp, extra)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
def test_blocks_of_query_rows_match_the_oracle_with_gradients(layout):
    """attend_blocks (what attention runs) at budgets that cut sequences into blocks of one row, of a
    few rows, and put several sequences in one block, and at the default (one block here)."""
    lens = [13, 0, 1, 6, 2, 9]
    q, k, v = _inputs(lens, seed=11)
    want = oracle(q, k, v)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    want_grads = _grads(want, [q, k, v], weight)
    for cp, extra in ((1, {}), (2, {}), (3, {"padding": "minimal"}), (2, {"tp_size": 2}), (4, {"padding": "none"})):
        plan = ShardPlan.build(lens, cp_size=cp, layout=layout, **extra)
        for budget in (1, 7, 40, None):
            qs, ks, vs = ([shard(x, plan, r) for r in range(cp)] for x in (q, k, v))
            k_all, v_all = torch.cat(ks), torch.cat(vs)
            outs = [attend_blocks(qs[r], k_all, v_all, plan, r, max_scores=budget) for r in range(cp)]
            got = unshard(outs, plan).values()
            assert torch.allclose(got, want, rtol=1e-13, atol=1e-14), (cp, extra, budget)
            for g, w in zip(_grads(got, [q, k, v], weight), want_grads):
                assert torch.allclose(g, w, rtol=1e-12, atol=1e-13), (cp, extra, budget)
            with torch.no_grad():  # no checkpointing without autograd: the same values
                assert torch.equal(torch.cat([attend_blocks(qs[r], k_all, v_all, plan, r, max_scores=budget)
                                              for r in range(cp)]), torch.cat(outs).detach())


def test_naive_kernel_is_right_under_contiguous_and_wrong_under_zigzag():
    lens = [13, 1, 6]
    q, k, v = _inputs(lens, seed=5)
    want = oracle(q, k, v)
    contiguous = ShardPlan.build(lens, cp_size=2, layout="contiguous")
    assert torch.allclose(_emulated(q, k, v, contiguous, naive=True), want, rtol=1e-13, atol=1e-14)
    zigzag = ShardPlan.build(lens, cp_size=2, layout="zigzag")
    assert (_emulated(q, k, v, zigzag, naive=True) - want).abs().max() > 0.1
    assert contiguous_twin(zigzag).layout is Layout.CONTIGUOUS
    assert contiguous_twin(zigzag).padded_seqlens_py == zigzag.padded_seqlens_py
    assert contiguous_twin(contiguous) is contiguous
    minimal = ShardPlan.build(lens, cp_size=2, layout="zigzag", padding="minimal")
    assert (_emulated(q, k, v, minimal, naive=True) - want).abs().max() > 0.1


def test_mask_of_spec_example_and_work():
    plan = ShardPlan.build([5, 3], cp_size=2)  # SPEC's worked example
    # buffer: rank 0 rows s0p0 s0p1 s0p6 s0p7 s1p0 s1p3 | rank 1 rows s0p2 s0p3 s0p4 s0p5 s1p1 s1p2
    m1 = attention_mask(plan, 1)
    assert m1[2].tolist() == [True, True, False, False, False, False, True, True, True, False, False, False]  # s0p4
    assert m1[5].tolist() == [False] * 4 + [True, False] + [False] * 4 + [True, True]  # s1p2
    assert not m1[3].any()  # s0p5 is a pad row: it sees nothing
    work = attention_work(plan)
    assert work == [int(attention_mask(plan, r).sum()) for r in range(2)] == [1 + 2 + 1, 3 + 4 + 5 + 2 + 3]


def test_bshd_plan_and_empty_sequence():
    lens = [4, 0, 2]
    plan = BshdPlan.build(lens, cp_size=2)
    q, k, v = _inputs(lens, seed=3)
    want = oracle(q, k, v)
    qs, ks, vs = ([shard(x, plan, r) for r in range(2)] for x in (q, k, v))
    flat = [x.reshape(-1, H, D) for x in ks], [x.reshape(-1, H, D) for x in vs]
    outs = [attend_gathered(qs[r].reshape(-1, H, D), torch.cat(flat[0]), torch.cat(flat[1]),
                            attention_mask(plan, r)).view(qs[r].shape) for r in range(2)]
    assert torch.allclose(unshard(outs, plan).values(), want, rtol=1e-13, atol=1e-14)
    assert torch.isfinite(torch.cat(outs)).all()


def test_errors_name_the_argument():
    plan = ShardPlan.build([5, 3], cp_size=1)
    x = torch.zeros(plan.local_len, H, D, dtype=F64)
    with pytest.raises(ValueError, match=r"q=tensor of shape \(8, 6\): must be plan.local_shape"):
        attention(x.view(8, 6), x, x, plan, None)
    with pytest.raises(ValueError, match="no grouped-query heads"):
        attention(x, x[:, :1], x[:, :1], plan, None)
    with pytest.raises(TypeError, match="plan=list"):
        attention(x, x, x, [5, 3], None)


# -- across real gloo ranks -----------------------------------------------------------------------


def _across_ranks(rank, world):
    """Forward and q/k/v gradients on real ranks equal the emulated ones; one collective each way."""
    lens = [13, 1, 6]
    q, k, v = _inputs(lens, seed=7)
    checked = []
    for layout in Layout:
        plan = ShardPlan.build(lens, cp_size=world, layout=layout)
        want = _emulated(q, k, v, plan)
        weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
        per_seq = _grads(want, [q, k, v], weight)  # q's sequences, then k's, then v's
        n = len(lens)
        want_grads = [shard(per_seq[i * n:(i + 1) * n], plan, rank) for i in range(3)]
        local = [shard(x, plan, rank).detach().requires_grad_(True) for x in (q, k, v)]
        for fn, right in ((attention, True), (naive_attention, layout is Layout.CONTIGUOUS)):
            with CollectiveCounter() as comm:
                out = fn(*local, plan, dist.group.WORLD)
            assert comm.calls == ["allgather_base"], comm.calls
            w_local = shard(list(weight.split(lens)), plan, rank)
            with CollectiveCounter() as comm:
                grads = torch.autograd.grad((out * w_local).sum(), local)
            assert comm.calls == ["allreduce"], comm.calls
            everyone = [torch.zeros_like(out) for _ in range(world)]
            dist.all_gather(everyone, out.detach())
            close = torch.allclose(unshard(everyone, plan).values(), want, rtol=1e-13, atol=1e-14)
            assert close is right, (layout, fn.__name__)
            if right:
                for g, w in zip(grads, want_grads):
                    assert torch.allclose(g, w, rtol=1e-12, atol=1e-13), (layout, fn.__name__)
            checked.append(f"{layout.value}/{fn.__name__}")
    return checked


def test_across_two_gloo_ranks():
    for checked in run_ranks(_across_ranks, 2):
        assert checked == ["zigzag/attention", "zigzag/naive_attention", "contiguous/attention",
                           "contiguous/naive_attention"]


@props(150)
@given(lens=st.lists(st.integers(0, 60), min_size=1, max_size=10), cp=st.integers(1, 6), tp=st.integers(1, 3),
       layout=st.sampled_from(["zigzag", "contiguous"]), padding=st.sampled_from(["aligned", "minimal", "none"]),
       reorder=st.booleans(), bshd=st.booleans())
def test_attention_work_counts_every_rank_s_pairs(lens, cp, tp, layout, padding, reorder, bshd):
    """The one work model, in closed form for THD plans, equals a naive count over every rank's rows:
    ``sum(position + 1)`` over its token rows (from the plan's own per-rank views)."""
    if bshd:
        plan = BshdPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
    else:
        plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=padding,
                               reorder="balanced" if reorder and layout == "contiguous" else None)
    naive = []
    for r in range(cp):
        pos, tok = plan.position_ids(r).reshape(-1).tolist(), plan.token_mask(r).reshape(-1).tolist()
        naive.append(sum(p + 1 for p, t in zip(pos, tok) if t))
    assert attention_work(plan) == naive
