"""THD shard / unshard against the naive reference (SPEC "What a sharded row contains", "Shifts",
"Restoring outputs")."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

import cpshard
from cpshard import ShardPlan, shard, unshard
from cpshard.ops.sharding import unshard_by
from reference import ref_locate, ref_rank_rows, ref_shard, ref_shift_seqs
from strategies import (
    FORMS,
    DataCfg,
    PlanCfg,
    as_form,
    assert_jagged_equals,
    data_cfgs,
    make_seqs,
    plan_cfgs,
    props,
    seqlens_as,
)

MAX_TOTAL = 9000
EDGE_CASES = [  # (plan, data, form) every shard and round-trip test runs first
    (PlanCfg([0, 0], 2, 1, "zigzag"), DataCfg(torch.int64, (), 0, -1, -100, 1), "list"),
    (PlanCfg([0], 3, 1, "contiguous", min_local_rows=3), DataCfg(torch.bool, (2,), 1, True, False, 2), "jagged"),
    (PlanCfg([3], 2, 1, "zigzag", min_local_rows=3), DataCfg(torch.float32, (), 2, -1.5, 0.5, 1), "flat"),
    (PlanCfg([5, 3], 2, 1, "zigzag"), DataCfg(torch.bfloat16, (3,), 3, 2.25, -3.0, 3), "flat"),
    (PlanCfg([1, 2999], 7, 3, "contiguous", fp8=True), DataCfg(torch.int64, (), 4, 7, 5, 2), "jagged"),
]


def edge_cases(test):
    """``test`` with an ``@example`` for each of :data:`EDGE_CASES`."""
    for case in reversed(EDGE_CASES):
        test = example(*case)(test)
    return test


def _plan(cfg: PlanCfg, seqlens=None) -> ShardPlan:
    return ShardPlan.build(cfg.seqlens if seqlens is None else seqlens, **cfg.build_kwargs())


def _shard(x, plan, r, d: DataCfg):
    return shard(x, plan, r, shift=d.shift, pad_value=d.pad_value, fill=d.fill)


@given(plan_cfgs(max_total=MAX_TOTAL), data_cfgs(), st.sampled_from(FORMS))
@edge_cases
# many trailing empty sequences: every one of their pad segments points past the input (clamped at once)
@example(PlanCfg([5] + [0] * 12, 2, 1, "zigzag"), DataCfg(torch.int64, (), 5, -1, -100, 1), "flat")
@example(PlanCfg([7, 3] + [0] * 10, 3, 2, "contiguous"), DataCfg(torch.bool, (), 6, False, True, 1), "list")
@props(150)
def test_shard_matches_reference(cfg: PlanCfg, d: DataCfg, form: str):
    seqs = make_seqs(cfg.seqlens, d)
    x = as_form(form, seqs, cfg.seqlens, d.trailing, d.dtype)
    plan = _plan(cfg)
    L = plan.local_len
    for r in range(cfg.cp):
        got = _shard(x, plan, r, d)
        want = ref_shard(
            seqs, cfg.seqlens, cfg.cp, cfg.tp, cfg.layout, r,
            shift=d.shift, pad_value=d.pad_value, fill=d.fill, **cfg.ext,
        )
        assert got.dtype == d.dtype, (got.dtype, d.dtype)
        assert got.shape == (L, *d.trailing), (got.shape, L, d.trailing)
        assert want.shape == got.shape
        assert torch.equal(got, want), (r, got, want)


@given(plan_cfgs(max_total=MAX_TOTAL, batch_max=16), data_cfgs(with_shift=False))
@props(60)
def test_shard_defaults(cfg: PlanCfg, d: DataCfg):
    """Defaults: shift=0, pad_value=0, fill=0."""
    seqs = make_seqs(cfg.seqlens, d)
    plan = _plan(cfg)
    for r in range(cfg.cp):
        got = shard(seqs, plan, r)
        want = ref_shard(seqs, cfg.seqlens, cfg.cp, cfg.tp, cfg.layout, r, pad_value=0, fill=0, **cfg.ext)
        assert torch.equal(got, want)


@given(plan_cfgs(max_total=MAX_TOTAL, batch_max=16), st.integers(1, 3) | st.integers(-3, -1))
@props(60)
def test_shifted_pad_rows_default_to_fill(cfg: PlanCfg, k: int):
    """SPEC: a shifted tensor's pad rows hold ``fill`` unless ``pad_value`` is given, so labels
    filled with an ignore index never train on padding; ``label_mask`` marks exactly the rest."""
    seqs = [torch.arange(n) + 1 for n in cfg.seqlens]  # token ids >= 1: no row holds -100 by accident
    plan = _plan(cfg)
    for r in range(cfg.cp):
        labels = shard(seqs, plan, r, shift=k, fill=-100)
        want = ref_shard(seqs, cfg.seqlens, cfg.cp, cfg.tp, cfg.layout, r, shift=k, pad_value=-100, fill=-100,
                         **cfg.ext)
        assert torch.equal(labels, want)
        assert torch.equal(plan.label_mask(r, k), labels != -100)
        assert torch.equal(plan.token_mask(r), plan.label_mask(r, 0))
        bools = shard([torch.ones(n, dtype=torch.bool) for n in cfg.seqlens], plan, r, shift=k, fill=False)
        assert torch.equal(bools, plan.label_mask(r, k))  # a sharded loss mask is the label mask


@given(plan_cfgs(max_total=MAX_TOTAL), data_cfgs(), st.sampled_from(FORMS))
@edge_cases
@props(120)
def test_unshard_roundtrip(cfg: PlanCfg, d: DataCfg, form: str):
    """unshard(shard(x)) == x exactly; with a shift, unshard gives the shifted sequences."""
    seqs = make_seqs(cfg.seqlens, d)
    x = as_form(form, seqs, cfg.seqlens, d.trailing, d.dtype)
    plan = _plan(cfg)
    parts = [_shard(x, plan, r, d) for r in range(cfg.cp)]
    nt = unshard(parts, plan)
    want = seqs if d.shift == 0 else ref_shift_seqs(seqs, d.shift, d.fill)
    assert_jagged_equals(nt, want, cfg.seqlens, d.trailing, d.dtype)


@given(plan_cfgs(max_total=MAX_TOTAL), data_cfgs(), st.data())
@props(80)
def test_input_forms_identical(cfg: PlanCfg, d: DataCfg, data):
    """Jagged nested tensor, list of tensors and flat tensor give identical shards, whatever form
    the lengths were given in."""
    seqs = make_seqs(cfg.seqlens, d)
    plan_a = _plan(cfg)
    plan_b = _plan(cfg, seqlens_as(data.draw, cfg.seqlens))
    assert plan_b.padded_seqlens_py == plan_a.padded_seqlens_py
    for r in range(cfg.cp):
        outs = [
            _shard(as_form(f, seqs, cfg.seqlens, d.trailing, d.dtype), p, r, d)
            for f in FORMS
            for p in (plan_a, plan_b)
        ]
        for o in outs[1:]:
            assert o.dtype == outs[0].dtype and o.shape == outs[0].shape
            assert torch.equal(o, outs[0])


@given(plan_cfgs(max_total=MAX_TOTAL), st.sampled_from([(), (2,), (3,)]),
       st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.int8]),
       st.sampled_from(["runs", "index", "ranks"]))
@example(PlanCfg([3000, 7, 2500], 2, 1, "contiguous"), (), torch.float32, "auto")  # the default: runs
@example(PlanCfg([0], 1, 1, "zigzag", min_local_rows=1), (), torch.float32, "runs")  # no tokens, a pad row
@props(100)
def test_unshard_arbitrary_outputs(cfg: PlanCfg, trailing, dtype, by):
    """unshard picks exactly the token rows of arbitrary local outputs, in sequence order, whether
    it copies runs (``PlanIndices.runs``, here forced wherever there are any) or gathers by an index
    (from each rank's part where a row is 1, 2, 4 or 8 bytes, ``PlanIndices.unshard_by_rank``, else
    from the parts concatenated)."""
    _unshard_arbitrary_outputs(cfg, trailing, dtype, by)


def _unshard_arbitrary_outputs(cfg: PlanCfg, trailing, dtype, by="auto"):
    plan = _plan(cfg)
    P = cfg.padded()
    cp = cfg.cp
    L = sum(P) // cp
    k = 1
    for t in trailing:
        k *= t
    # y_r[l] encodes (rank, local row) uniquely
    parts = []
    for r in range(cp):
        base = torch.arange(L * k, dtype=torch.int64) + r * L * k
        parts.append((base * 2 + 1).reshape(L, *trailing).to(dtype))
    # oracle: where does global row S_i + p live?
    where = {}
    for r in range(cp):
        for local, g in enumerate(ref_rank_rows(P, cp, cfg.layout, r)):
            where[g] = (r, local)
    want = []
    start = 0
    for i, n in enumerate(cfg.seqlens):
        rows = []
        for p in range(n):
            g = start + p
            assert ref_locate(P, g) == (i, p)
            r, local = where[g]
            rows.append(parts[r][local])
        want.append(torch.stack(rows) if rows else torch.empty((0, *trailing), dtype=dtype))
        start += P[i]
    nt = unshard(parts, plan) if by == "auto" else unshard_by(parts, plan, by)
    assert_jagged_equals(nt, want, cfg.seqlens, trailing, dtype)


@props(80)
@given(
    seqlens=st.lists(st.integers(0, 40), min_size=1, max_size=16),
    cp=st.integers(1, 4),
    d=data_cfgs(),
    form=st.sampled_from(FORMS),
)
def test_unsharded_shift_matches_reference(seqlens, cp, d, form):
    """``cpshard.shift`` (no sharding) equals the naive shift for every plan it is given."""
    plan = ShardPlan.build(seqlens, cp_size=cp)
    seqs = make_seqs(seqlens, d)
    k = d.shift or 1
    got = cpshard.shift(as_form(form, seqs, seqlens, d.trailing, d.dtype), plan, k, fill=d.fill)
    want = ref_shift_seqs(seqs, k, d.fill)
    if form == "jagged":
        assert_jagged_equals(got, want, seqlens, d.trailing, d.dtype)
    elif form == "list":  # the form it was given
        assert isinstance(got, list) and len(got) == len(want)
        assert all(g.dtype == d.dtype and torch.equal(g, w) for g, w in zip(got, want))
    else:
        assert not got.is_nested and torch.equal(got, torch.cat(want).reshape(-1, *d.trailing))
