"""Cold index paths: what a plan's index service answers without building every rank's segments.

The count of held segments (``PlanIndices.held``, the closed form ``cpshard.index.segments.held_segments``) is what
``runs`` asks before it decides to build the restore's runs; it must equal the count of the
non-empty segments the ranks' lists really hold (``rank_segments`` is itself checked against the
per-row reference in ``test_shard_props``)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from cpshard import BshdPlan, ShardPlan, unshard
from cpshard.distributed import plan_fingerprint
from reference import ref_bshd_columns
from strategies import props


def _counted(plan) -> int:
    ix = plan.indices()
    return sum(int((ix.segments(r).length > 0).sum()) for r in range(plan.cp_size))


@given(lens=st.lists(st.integers(0, 300) | st.integers(0, 5), min_size=1, max_size=24), cp=st.integers(1, 9),
       tp=st.integers(1, 3), layout=st.sampled_from(["zigzag", "contiguous"]),
       padding=st.sampled_from(["aligned", "minimal"]), extra=st.integers(0, 3), reorder=st.booleans())
@props(150)
def test_held_segments_in_closed_form_count_the_built_ones(lens, cp, tp, layout, padding, extra, reorder):
    plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=padding,
                           min_local_rows=extra or None,
                           reorder="balanced" if reorder and layout == "contiguous" else None)
    assert plan.indices().held() == _counted(plan)


@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=8), cp=st.integers(1, 5),
       layout=st.sampled_from(["zigzag", "contiguous"]))
@props(60)
def test_held_segments_of_a_bshd_plan(lens, cp, layout):
    plan = BshdPlan.build(lens, cp_size=cp, layout=layout)
    assert plan.indices().held() == _counted(plan)


def test_a_restore_of_short_pieces_builds_no_segments_of_every_rank():
    """100,000 short sequences at cp = 64 hold 12.8M zigzag chunks: deciding that the runs are too
    short to use, and gathering by the closed-form index, builds none of them, and the result is the
    one the segments give (the small plan below checks the same path against the segments)."""
    lens = [1 + (7 * i) % 64 for i in range(100_000)]
    for layout in ("zigzag", "contiguous"):
        plan = ShardPlan.build(lens, cp_size=64, layout=layout)
        ix = plan.indices()
        assert ix.runs() is None
        parts = [torch.arange(plan.local_len, dtype=torch.int32) + r * plan.local_len for r in range(64)]
        got = unshard(parts, plan).values()
        assert got.numel() == sum(lens)
        kept = ix.kept()
        assert "every" not in kept and "segments" not in kept and "restore" not in kept, kept
        # the gathered rows are the tokens' rows of the rank-concatenated buffer: spot-check against segments
        small = ShardPlan.build(lens[:50], cp_size=64, layout=layout)
        want = []
        for r in range(64):
            seg = small.indices().segments(r)
            for s, p, _n, t, start in zip(seg.seq.tolist(), seg.pos.tolist(), seg.length.tolist(),
                                         seg.tokens.tolist(), seg.start.tolist()):
                want += [(s, p + j, r * small.local_len + start + j) for j in range(t)]
        want = [row for _, _, row in sorted(want)]
        parts = [torch.arange(small.local_len, dtype=torch.int32) + r * small.local_len for r in range(64)]
        assert unshard(parts, small).values().tolist() == want


def test_each_plan_kind_answers_how_it_is_split():
    """The index service asks the plan kind, not a flag: a THD plan splits its whole buffer over the
    ranks, a BSHD plan each padded row alone; the fingerprint's kind word (0 THD, 1 BSHD) follows."""
    thd, bshd = ShardPlan.build([5, 3], cp_size=2), BshdPlan.build([5, 3], cp_size=2)
    padded, alone = thd.indices().split()
    assert padded.tolist() == [8, 4] and not alone and plan_fingerprint(thd)[0] == 0
    padded, alone = bshd.indices().split()
    assert padded.tolist() == [8, 8] and alone and plan_fingerprint(bshd)[0] == 1


@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=8), cp=st.integers(1, 6), tp=st.integers(1, 2),
       layout=st.sampled_from(["zigzag", "contiguous"]))
@props(80)
def test_bshd_restore_index_in_closed_form(lens, cp, tp, layout):
    """A BSHD plan's restore index, per token in closed form (no segments of every rank), is the row of
    the rank-concatenated buffer holding each token: rank r's local column j of row b is buffer row
    r * B * L + b * L + j (SPEC "BSHD", the naive columns)."""
    plan = BshdPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
    where = {}
    for r in range(cp):
        for j, col in enumerate(ref_bshd_columns(plan.max_seqlen, cp, layout, r)):
            where[col] = (r, j)
    b_rows, local = len(lens), plan.local_len
    want = [where[p][0] * b_rows * local + b * local + where[p][1] for b, n in enumerate(lens) for p in range(n)]
    assert plan.indices().unshard(torch.device("cpu")).tolist() == want
    chunks = len(lens) * cp * (2 if layout == "zigzag" and cp > 1 else 1)
    if 16 * chunks > sum(lens):  # segments of fewer than 16 tokens on average: the closed form, no segments
        assert "every" not in plan.indices().kept()
