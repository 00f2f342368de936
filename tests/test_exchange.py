"""The sharded-shift exchange is pure index math: check it for all ranks in one process.

Each rank's ``ShiftExchange`` is applied to its shard (``ShiftExchange.apply``), with the all-to-all
run in one process (``_exchange.all_to_all_in_process``); the result must equal the naive
reference's shifted shard.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cpshard import BshdPlan, Layout, ShardPlan, halo_exchange, shard, shift_exchange
from cpshard.index.shift import all_to_all_in_process, build_shift_exchange, reach
from reference import ref_bshd_shard, ref_crossing_rows, ref_shard


def emulate_shift_sharded(shards, plan, k, fill, pad_value):
    cp = plan.cp_size
    exs = [shift_exchange(plan, r, k) for r in range(cp)]
    shards = [s.reshape(s.shape[0] * s.shape[1]) if isinstance(plan, BshdPlan) else s for s in shards]
    for r, ex in enumerate(exs):
        assert sum(ex.send_splits) == ex.send_rows.numel()
        assert ex.send_splits[r] == 0 and ex.recv_splits[r] == 0
        assert all(exs[s].send_splits[r] == ex.recv_splits[s] for s in range(cp))  # senders and receiver agree
    received = all_to_all_in_process(shards, [ex.send_rows for ex in exs], [ex.send_splits for ex in exs])
    return [ex.apply(shards[d], received[d], pad_value, fill) for d, ex in enumerate(exs)], exs


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=12),
    cp=st.integers(1, 8),
    tp=st.integers(1, 3),
    layout=st.sampled_from(list(Layout)),
    k=st.integers(-5, 5),
    bshd=st.booleans(),
    unpadded=st.booleans(),
)
def test_emulated_exchange_equals_shifted_shard(lens, cp, tp, layout, k, bshd, unpadded):
    """THD and BSHD plans (each row of a padded batch is one sequence) take the same exchange; THD
    plans also with ``padding="none"`` (zigzag chunks of unequal sizes)."""
    if bshd:
        lens, cp = lens[:6], min(cp, 5)  # a padded batch of B rows of max(lens): keep it small
    padding = "none" if unpadded and not bshd else "aligned"
    kw = dict(padding=padding) if padding == "none" else {}
    plan = (BshdPlan if bshd else ShardPlan).build(lens, cp_size=cp, tp_size=tp, layout=layout, **kw)
    reference = ref_bshd_shard if bshd else ref_shard
    seqs = [torch.arange(n) * 10 + i for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r) for r in range(cp)]
    outs, exs = emulate_shift_sharded(shards, plan, k, fill=-7, pad_value=-1)
    for r in range(cp):
        expected = reference(seqs, lens, cp, tp, layout.value, r, shift=k, pad_value=-1, fill=-7, **kw)
        assert torch.equal(outs[r].view(expected.shape), expected), (r, outs[r], expected)
    if cp == 1 or k == 0:
        assert all(ex.total_remote == 0 for ex in exs)


def test_zigzag_moves_only_boundary_rows():
    """Long sequences: only the k last rows of chunks whose successor is on another rank travel."""
    lens = [4000, 3001, 2500, 1200]
    plan = ShardPlan.build(lens, cp_size=4, layout="zigzag")
    for k in (1, 3):
        exs = [shift_exchange(plan, r, k) for r in range(4)]
        moved = sum(ex.send_rows.numel() for ex in exs)
        # per sequence, 2cp - 1 chunk boundaries, of which the middle one (chunk cp-1 -> cp) stays local
        assert moved == len(lens) * (2 * 4 - 2) * k
        assert moved < 0.01 * plan.total_len


def test_contiguous_moves_one_boundary_per_rank():
    plan = ShardPlan.build([5000, 3000], cp_size=4, layout="contiguous")
    exs = [shift_exchange(plan, r, 1) for r in range(4)]
    assert [ex.send_splits for ex in exs] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0)]


def _padded(plan):
    return [plan.max_seqlen] if isinstance(plan, BshdPlan) else list(plan.padded_seqlens_py)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 9) | st.integers(0, 70), min_size=1, max_size=10),
    cp=st.integers(1, 9),
    tp=st.integers(1, 3),
    layout=st.sampled_from(list(Layout)),
    k=st.integers(-12, 12),
    kind=st.sampled_from(["aligned", "minimal", "none", "balanced", "bshd"]),
)
def test_crossing_rows_counted_in_closed_form(lens, cp, tp, layout, k, kind):
    """Every rank's ``total_remote`` (a closed form over the sequences, no segment built) is the naive
    count of token rows whose source sits on another rank; the ranks' receives add up to it."""
    if kind == "bshd":
        lens = lens[:6]
        plan = BshdPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
    else:
        balanced = kind == "balanced" and layout is Layout.CONTIGUOUS
        plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=kind if kind in ("minimal", "none")
                               else "aligned", reorder="balanced" if balanced else None)
    want = ref_crossing_rows(plan.seqlens_py, _padded(plan), cp, layout, k, bshd=kind == "bshd")
    exs = [shift_exchange(plan, r, k) for r in range(cp)]
    assert [ex.total_remote for ex in exs] == [want] * cp
    assert sum(sum(ex.recv_splits) for ex in exs) == want


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 6) | st.integers(0, 200), min_size=1, max_size=40),
    cp=st.sampled_from([2, 3, 4, 8, 12]),
    layout=st.sampled_from(list(Layout)),
    k=st.integers(-9, 9),
    bshd=st.booleans(),
    padding=st.sampled_from(["aligned", "none"]),
)
def test_one_ranks_exchange_reads_only_the_ranks_it_reaches(lens, cp, layout, k, bshd, padding):
    """A rank's exchange is built from its own segments and those of the ranks within reach of its
    rows: field for field the exchange every rank's segments give, and no more ranks' segments kept."""
    kw = {} if bshd else dict(padding=padding)
    plan = (BshdPlan if bshd else ShardPlan).build(lens[:8] if bshd else lens, cp_size=cp, layout=layout, **kw)
    ix = plan.indices()
    for r in range(cp):
        ex = shift_exchange(plan, r, k)
        whole = build_shift_exchange(ix.every(), ix.segments(r), r, k, cp, ex.total_remote)
        for name in ("source", "send_rows", "recv_rows", "pad_rows", "fill_rows"):
            assert torch.equal(getattr(ex, name), getattr(whole, name)), (r, name)
        assert (ex.send_splits, ex.recv_splits) == (whole.send_splits, whole.recv_splits)
    if bshd:
        return
    fresh = ShardPlan.build(lens, cp_size=cp, layout=layout, **kw)
    shift_exchange(fresh, 0, k)
    assert "every" not in fresh.indices().kept()
    assert fresh.indices().kept()["segments"] == len(fresh.indices().near(0, abs(k)).ranks)


def test_the_first_exchange_of_a_large_plan_builds_a_few_ranks_segments():
    """100,000 short sequences at cp = 64 hold 12.8M zigzag chunks: rank 5's shift by one reads its
    own chunks and its two neighbours' (ranks 4 and 6); its halo for shifts 1..3 those of ranks 2..8."""
    lens = [1 + (7 * i) % 64 for i in range(100_000)]
    plan = ShardPlan.build(lens, cp_size=64)
    ex = shift_exchange(plan, 5, 1)
    assert plan.indices().kept()["segments"] == 3 and "every" not in plan.indices().kept()
    assert ex.total_remote == sum(max(n - 1, 0) for n in lens)  # one-row chunks: every pair of neighbours crosses
    halo_exchange(plan, 5, (1, 2, 3))
    assert plan.indices().kept()["segments"] == 7 and "every" not in plan.indices().kept()


def _reach_by_chunks(plan, rank, span):
    """``reach`` as the zigzag layout defines it, checked chunk by chunk (at most ``2 cp``): the ranks
    of the chunks within ``ceil(span / c)`` chunks of one of ``rank``'s two (``c`` the shortest chunk
    of a sequence holding a token)."""
    cp = plan.cp_size
    chunks = [p // (2 * cp) for p, n in zip(plan.padded_seqlens_py, plan.seqlens_py) if n > 0]
    w = -(-span // max(min(chunks, default=1), 1))
    near = [j for j in range(2 * cp) if min(abs(j - rank), abs(j - (2 * cp - 1 - rank))) <= w]
    return sorted({min(j, 2 * cp - 1 - j) for j in near})


_LARGE = st.integers(2**20, 2**31 - 1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    cp=st.integers(1, 6),
    layout=st.sampled_from(list(Layout)),
    k=st.integers(-12, 12) | _LARGE | _LARGE.map(lambda k: -k),
)
@example(lens=[9, 30, 4], cp=4, layout=Layout.ZIGZAG, k=2**31 - 1)
@example(lens=[9, 30, 4], cp=4, layout=Layout.ZIGZAG, k=-(2**31 - 1))
def test_a_shift_by_any_k_takes_closed_forms(lens, cp, layout, k):
    """Shifts by up to 2**31 - 1 (accepted since 0.2): the exchange and the halo equal the naive
    shifted shard, and a rank's reach equals its definition over the 2 cp chunks. Before, the zigzag
    reach looped over 2 |k| / c chunk offsets in Python: minutes at |k| near 2**31, for nothing."""
    plan = ShardPlan.build(lens, cp_size=cp, layout=layout)
    if layout is Layout.ZIGZAG:
        padded, seqlens = plan.indices().split()[0], plan.indices().lengths()
        for r in range(cp):
            assert reach(padded, seqlens, cp, layout, False, r, abs(k)) == _reach_by_chunks(plan, r, abs(k))
    seqs = [torch.arange(n) * 10 + i for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r) for r in range(cp)]
    outs, _ = emulate_shift_sharded(shards, plan, k, fill=-7, pad_value=-1)
    hxs = [halo_exchange(plan, r, (k, 1, -1)) for r in range(cp)]
    received = all_to_all_in_process(shards, [h.send_rows for h in hxs], [h.send_splits for h in hxs])
    halos = [h.apply(shards[r], received[r], -1, -7) for r, h in enumerate(hxs)]
    for r in range(cp):
        expected = ref_shard(seqs, lens, cp, 1, layout.value, r, shift=k, pad_value=-1, fill=-7)
        assert torch.equal(outs[r], expected) and torch.equal(halos[r][0], expected), (r, k)
