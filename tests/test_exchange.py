"""The sharded-shift exchange is pure index math: check it for all ranks in one process.

Each rank's ``ShiftExchange`` is applied to its shard (``ShiftExchange.apply``), with the all-to-all
run in one process (``_exchange.all_to_all_in_process``); the result must equal the naive
reference's shifted shard.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpshard import BshdPlan, Layout, ShardPlan, shard, shift_exchange
from cpshard.index.shift import all_to_all_in_process
from reference import ref_bshd_shard, ref_shard


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
)
def test_emulated_exchange_equals_shifted_shard(lens, cp, tp, layout, k, bshd):
    """THD and BSHD plans (each row of a padded batch is one sequence) take the same exchange."""
    if bshd:
        lens, cp = lens[:6], min(cp, 5)  # a padded batch of B rows of max(lens): keep it small
    plan = (BshdPlan if bshd else ShardPlan).build(lens, cp_size=cp, tp_size=tp, layout=layout)
    reference = ref_bshd_shard if bshd else ref_shard
    seqs = [torch.arange(n) * 10 + i for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r) for r in range(cp)]
    outs, exs = emulate_shift_sharded(shards, plan, k, fill=-7, pad_value=-1)
    for r in range(cp):
        expected = reference(seqs, lens, cp, tp, layout.value, r, shift=k, pad_value=-1, fill=-7)
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
