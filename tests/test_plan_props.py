"""ShardPlan against the naive reference (SPEC "Padding (THD)", "Which rows a rank holds")."""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cpshard import Layout, ShardPlan
from reference import (
    ref_alignment,
    ref_alignment_before_fp8,
    ref_cumsum,
    ref_padded_lengths,
    ref_rank_rows,
    ref_row_info,
)
from strategies import PlanCfg, closed_form_padding, plan_cfgs, props, round_up, seqlens_as

# the per-row tests walk every row of every rank through the naive oracle: keep T moderate
ROW_TESTS_MAX_TOTAL = 30000


def _build(cfg: PlanCfg, seqlens=None, layout=None) -> ShardPlan:
    kw = cfg.build_kwargs()
    if layout is not None:
        kw["layout"] = layout
    return ShardPlan.build(cfg.seqlens if seqlens is None else seqlens, **kw)


def _is_int_tuple(t) -> bool:
    return isinstance(t, tuple) and all(type(v) is int for v in t)


def _int32_cpu(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu" and t.dim() == 1


# --------------------------------------------------------------------------------------------------
# the oracle itself
# --------------------------------------------------------------------------------------------------


@given(plan_cfgs())
@props(150)
def test_reference_padding_matches_closed_form(cfg: PlanCfg):
    """The naive while-loop padding agrees with the closed form used by the implementation brief
    (guards the oracle, not the library)."""
    assert cfg.padded() == closed_form_padding(cfg)


def test_reference_worked_example():
    assert ref_padded_lengths([5, 3], 2, 1, "zigzag") == [8, 4]
    assert ref_rank_rows([8, 4], 2, "zigzag", 0) == [0, 1, 6, 7, 8, 11]
    assert ref_rank_rows([8, 4], 2, "zigzag", 1) == [2, 3, 4, 5, 9, 10]


# --------------------------------------------------------------------------------------------------
# the SPEC worked example and the verl data-loss case, verbatim
# --------------------------------------------------------------------------------------------------


def test_spec_worked_example():
    plan = ShardPlan.build([5, 3], cp_size=2, tp_size=1, layout="zigzag")
    assert plan.alignment == 4
    assert plan.padded_seqlens_py == (8, 4)
    assert plan.cu_seqlens_padded_py == (0, 8, 12)
    assert plan.cu_seqlens_py == (0, 5, 8)
    assert plan.total_len == 12
    assert plan.local_len == 6
    assert plan.max_seqlen == 8
    assert plan.global_rows(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert plan.global_rows(1).tolist() == [2, 3, 4, 5, 9, 10]
    # rank 0 : s0p0 s0p1 | pad pad | s1p0 | pad ; rank 1 : s0p2 s0p3 | s0p4 pad | s1p1 | s1p2
    assert plan.position_ids(0).tolist() == [0, 1, 6, 7, 0, 3]
    assert plan.position_ids(1).tolist() == [2, 3, 4, 5, 1, 2]
    assert plan.token_mask(0).tolist() == [True, True, False, False, True, False]
    assert plan.token_mask(1).tolist() == [True, True, True, False, True, True]
    assert plan.sequence_ids(0).tolist() == [0, 0, 0, 0, 1, 1]
    assert plan.sequence_ids(1).tolist() == [0, 0, 0, 0, 1, 1]


def test_spec_worked_example_shard():
    from cpshard import shard, unshard

    x = [torch.tensor([10, 11, 12, 13, 14]), torch.tensor([20, 21, 22])]
    plan = ShardPlan.build([5, 3], cp_size=2)
    assert shard(x, plan, 0, pad_value=-1).tolist() == [10, 11, -1, -1, 20, -1]
    assert shard(x, plan, 1, pad_value=-1).tolist() == [12, 13, 14, -1, 21, 22]
    # next-token labels
    assert shard(x, plan, 0, shift=1, pad_value=-1, fill=-100).tolist() == [11, 12, -1, -1, 21, -1]
    assert shard(x, plan, 1, shift=1, pad_value=-1, fill=-100).tolist() == [13, 14, -100, -1, 22, -100]
    nt = unshard([shard(x, plan, r) for r in range(2)], plan)
    assert nt.values().tolist() == [10, 11, 12, 13, 14, 20, 21, 22]
    assert nt.offsets().tolist() == [0, 5, 8]


def test_verl_three_tokens_min_local_rows():
    """One 3-token sequence at cp=2 with min_local_rows=3: no token is dropped, every rank >= 3 rows."""
    from cpshard import shard, unshard

    for layout in ("zigzag", "contiguous"):
        plan = ShardPlan.build([3], cp_size=2, layout=layout, min_local_rows=3)
        assert plan.local_len >= 3
        assert plan.total_len == 2 * plan.local_len
        x = torch.tensor([101, 102, 103])
        seen = []
        for r in range(2):
            rows = plan.global_rows(r)
            assert rows.numel() == plan.local_len >= 3
            mask = plan.token_mask(r)
            local = shard(x, plan, r, pad_value=-1)
            assert local.shape == (plan.local_len,)
            seen += local[mask].tolist()
            assert (local[~mask] == -1).all()
        assert sorted(seen) == [101, 102, 103]
        nt = unshard([shard(x, plan, r) for r in range(2)], plan)
        assert nt.values().tolist() == [101, 102, 103]
        assert plan.padded_seqlens_py == tuple(ref_padded_lengths([3], 2, 1, layout, min_local_rows=3))


# --------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------


@given(plan_cfgs(), st.data())
@example(PlanCfg([0], 2, 1, "zigzag"), None)
@example(PlanCfg([0, 0, 0], 3, 2, "contiguous", fp8=True), None)
@example(PlanCfg([3], 2, 1, "zigzag", min_local_rows=3), None)
@example(PlanCfg([1], 7, 3, "zigzag", fp8=True, min_local_rows=100, length_bucket=100), None)
@props(150)
def test_plan_fields_match_reference(cfg: PlanCfg, data):
    seqlens = cfg.seqlens if data is None else seqlens_as(data.draw, cfg.seqlens)
    layout = cfg.layout
    if data is not None and data.draw(st.booleans()):
        layout = Layout(cfg.layout)
    plan = _build(cfg, seqlens, layout)

    P = cfg.padded()
    T = sum(P)
    assert plan.cp_size == cfg.cp
    assert plan.tp_size == cfg.tp
    assert plan.layout == cfg.layout
    assert plan.layout == Layout(cfg.layout)
    assert isinstance(plan.layout, Layout)
    assert plan.num_seqs == len(cfg.seqlens)
    assert plan.alignment == ref_alignment(cfg.cp, cfg.tp, cfg.layout, cfg.fp8, cfg.padding)

    assert _is_int_tuple(plan.seqlens_py) and plan.seqlens_py == tuple(cfg.seqlens)
    assert _is_int_tuple(plan.padded_seqlens_py) and plan.padded_seqlens_py == tuple(P)
    assert _is_int_tuple(plan.cu_seqlens_py) and plan.cu_seqlens_py == tuple(ref_cumsum(cfg.seqlens))
    assert _is_int_tuple(plan.cu_seqlens_padded_py) and plan.cu_seqlens_padded_py == tuple(ref_cumsum(P))

    for name, want in [
        ("seqlens", cfg.seqlens),
        ("padded_seqlens", P),
        ("cu_seqlens", ref_cumsum(cfg.seqlens)),
        ("cu_seqlens_padded", ref_cumsum(P)),
    ]:
        t = getattr(plan, name)
        assert _int32_cpu(t), (name, t)
        assert t.tolist() == list(want), name

    assert type(plan.max_seqlen) is int and plan.max_seqlen == max(P)
    assert type(plan.total_len) is int and plan.total_len == T
    assert type(plan.local_len) is int and plan.local_len == T // cfg.cp


@given(plan_cfgs())
@props(150)
def test_plan_invariants(cfg: PlanCfg):
    """SPEC "Padding" invariants, checked on the library's own numbers."""
    plan = _build(cfg)
    P = list(plan.padded_seqlens_py)
    n = list(plan.seqlens_py)
    cp, tp = cfg.cp, cfg.tp
    a = plan.alignment
    T, L = plan.total_len, plan.local_len
    assert T == sum(P)
    assert T % cp == 0
    assert L == T // cp
    assert L % tp == 0
    for i, (p_i, n_i) in enumerate(zip(P, n)):
        assert p_i >= n_i
        assert p_i % a == 0, (i, p_i, a)
        if cfg.layout == "zigzag" and cfg.padding != "none":
            assert p_i % (2 * cp) == 0 or cp == 1
        # only the last sequence may carry more than the minimal padding
        if i < len(P) - 1:
            assert p_i == round_up(n_i, a)
    if cfg.fp8:
        assert T % (ref_alignment_before_fp8(cp, tp, cfg.layout) * 128) == 0
    if cfg.min_local_rows is not None:
        assert L >= cfg.min_local_rows
    if cfg.length_bucket is not None:
        assert T % math.lcm(cfg.length_bucket, cp) == 0


@given(plan_cfgs(), st.booleans())
@props(150)
def test_built_plan_passes_the_hand_built_checks(cfg: PlanCfg, reorder: bool):
    """ShardPlan.build skips __post_init__'s checks (its values are valid by construction): the same
    fields given to the constructor pass every check and make an equal plan, with equal views."""
    import dataclasses

    kwargs = cfg.build_kwargs()
    if reorder:
        kwargs.update(layout="contiguous", reorder="balanced")
    plan = ShardPlan.build(cfg.seqlens, **kwargs)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}
    again = ShardPlan(**fields)
    assert again == plan and hash(again) == hash(plan) and repr(again) == repr(plan)
    assert dataclasses.replace(plan) == plan
    for r in range(plan.cp_size):
        assert torch.equal(again.global_rows(r), plan.global_rows(r))


@given(plan_cfgs(max_total=ROW_TESTS_MAX_TOTAL))
@props(100)
def test_global_rows_partition(cfg: PlanCfg):
    plan = _build(cfg)
    P = cfg.padded()
    T = sum(P)
    L = T // cfg.cp
    every = []
    for r in range(cfg.cp):
        rows = plan.global_rows(r)
        assert rows.dtype == torch.int64 and rows.shape == (L,)
        assert rows.tolist() == ref_rank_rows(P, cfg.cp, cfg.layout, r)
        every += rows.tolist()
    assert sorted(every) == list(range(T))
    if cfg.layout == "zigzag" and cfg.padding != "none":
        # sequence i starts at local row S_i / cp on every rank
        S = ref_cumsum(P)
        for r in range(cfg.cp):
            rows = plan.global_rows(r).tolist()
            for i, p_i in enumerate(P):
                if p_i:
                    assert rows[S[i] // cfg.cp] == S[i] + r * (p_i // (2 * cfg.cp)) or cfg.cp == 1


@given(plan_cfgs(max_total=ROW_TESTS_MAX_TOTAL))
@props(100)
def test_row_metadata(cfg: PlanCfg):
    plan = _build(cfg)
    P = cfg.padded()
    L = sum(P) // cfg.cp
    total_tokens = 0
    for r in range(cfg.cp):
        info = ref_row_info(cfg.seqlens, P, cfg.cp, cfg.layout, r)
        pos = plan.position_ids(r)
        mask = plan.token_mask(r)
        sid = plan.sequence_ids(r)
        assert pos.dtype == torch.int64 and pos.shape == (L,)
        assert mask.dtype == torch.bool and mask.shape == (L,)
        assert sid.dtype == torch.int64 and sid.shape == (L,)
        assert pos.tolist() == [p for (_, _, p, _) in info]
        assert mask.tolist() == [tok for (_, _, _, tok) in info]
        assert sid.tolist() == [i for (_, i, _, _) in info]
        total_tokens += int(mask.sum())
    assert total_tokens == sum(cfg.seqlens)


# --------------------------------------------------------------------------------------------------
# padding="none": zigzag chunks one row apart (SPEC "Zigzag without padding")
# --------------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 9) | st.integers(0, 400), min_size=1, max_size=12), st.integers(1, 8),
       st.booleans())
@props(150)
@example([1, 1, 1], 3, True)  # three 1-token documents: one a rank
@example([0, 5, 3, 1, 7], 2, True)
def test_unpadded_zigzag_chunks_and_balance(lens, cp, full):
    """The reference's chunks (written from the definition) differ by at most one row per sequence and give
    every rank T / cp rows; the plan's rows are the reference's; every rank's causal work lies within the
    rounding bound of the ideal T-th share: each chunk bound is within 2 cp rows of ``j P / (2 cp)``,
    and moving one of a rank's four bounds by d rows changes its work by at most d (P + d + 1)."""
    from reference import ref_rank_order, ref_zigzag_chunks

    if full:  # a full row: the tokens are the rows, nothing padded at all
        lens = lens + [(-sum(lens)) % cp or cp] if sum(lens) % cp or not sum(lens) else lens
    plan = ShardPlan.build(lens, cp_size=cp, padding="none")
    P = list(plan.padded_seqlens_py)
    assert P[:-1] == lens[:-1] and P[-1] >= lens[-1] and sum(P) % cp == 0
    if full:
        assert P == lens and plan.padding_overhead == 0.0
    for sizes, p in zip(ref_zigzag_chunks(P, cp), P):
        assert sum(sizes) == p and max(sizes) - min(sizes) <= 1
    for r in range(cp):
        assert plan.global_rows(r).tolist() == ref_rank_rows(P, cp, "zigzag", r)
        assert len(ref_rank_rows(P, cp, "zigzag", r)) == sum(P) // cp
    rearrange, restore = plan.indices().rank_order()  # the torch balancer's indices, from the held chunks
    assert rearrange.tolist() == ref_rank_order(P, None, cp, "zigzag") and (rearrange[restore] == range(sum(P))).all()
    work = []
    for r in range(cp):
        work.append(sum(p + 1 for (_, _, p, tok) in ref_row_info(plan.seqlens_py, P, cp, "zigzag", r) if tok))
    assert plan.indices().work() == work
    if full and cp > 1:
        ideal = sum(n * (n + 1) // 2 for n in lens) / cp
        slack = sum(4 * (2 * cp) * (n + 2 * cp + 1) for n in lens)
        assert all(abs(w - ideal) <= slack for w in work), (work, ideal, slack)


def test_unpadded_zigzag_is_refused_where_equal_chunks_are_needed():
    """Megatron's PackedSeqParams and ThdCpRoute, verl's Megatron drop-ins, fp8 and the packing refuse a
    zigzag plan with padding="none", naming it; its contiguous twin passes where only the layout matters."""
    import pytest

    import cpshard
    from cpshard.compat import verl as cpverl
    from cpshard.megatron import packed_seq_params
    from cpshard.megatron.route import cp_partition_route

    plan = ShardPlan.build([5, 3, 1, 7], cp_size=2, padding="none")
    assert not plan.equal_chunks and plan.twin("contiguous").equal_chunks
    assert ShardPlan.build([8, 4], cp_size=2, padding="minimal").equal_chunks
    assert not ShardPlan.build([8, 4], cp_size=2, padding="none").equal_chunks  # by the mode, whatever the lengths
    with pytest.raises(ValueError, match=r"plan=ShardPlan\(.*padding='none'.*Megatron's PackedSeqParams .*"
                                         r"padding='minimal'"):
        packed_seq_params(plan)
    with pytest.raises(ValueError, match=r"unequal sizes.*Megatron's ThdCpRoute"):
        cp_partition_route(plan.twin("contiguous"), 0)
    with pytest.raises(ValueError, match=r"unequal sizes.*verl's Megatron drop-ins"):
        cpverl.preprocess_thd_engine(torch.nested.nested_tensor([torch.arange(n) for n in (5, 3, 1, 7)],
                                                                layout=torch.jagged), None, plan=plan,
                                     cp_size=2, cp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"padding='none': pads no sequence, and fp8"):
        ShardPlan.build([5], cp_size=2, padding="none", fp8=True)
    with pytest.raises(ValueError, match=r"padding='none': deals zigzag's extra rows"):
        cpshard.pack([5, 3, 1, 7], max_tokens=64, cp_size=2, padding="none")
    # the closed forms of equal chunks answer None or refuse: the index service reads the segments
    from cpshard.index.closed import thd_restore, thd_restore_by_rank, thd_rows

    assert plan.indices().unequal_chunks() and thd_restore(plan) is None and thd_restore_by_rank(plan) is None
    with pytest.raises(AssertionError, match=r"padding='none'"):
        thd_rows(plan, torch.arange(16).numpy())
