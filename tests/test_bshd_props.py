"""BshdPlan and BSHD shard / unshard against the naive reference (SPEC "BSHD")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from cpshard import BshdPlan, Layout, shard, unshard
from reference import (
    ref_alignment_before_fp8,
    ref_bshd_alignment,
    ref_bshd_columns,
    ref_bshd_seq_len,
    ref_bshd_shard,
    ref_shift_seqs,
)
from strategies import (
    CPS,
    LAYOUTS,
    TPS,
    DataCfg,
    as_form,
    assert_jagged_equals,
    data_cfgs,
    lengths_strategy,
    make_seqs,
    props,
    seqlens_as,
)

MAX_ELEMS = 40000  # B * M cap for the data tests


@dataclass
class BCfg:
    seqlens: list
    cp: int
    tp: int
    layout: str
    fp8: bool = False
    max_seqlen: int | None = None

    def kwargs(self) -> dict:
        kw = dict(cp_size=self.cp, tp_size=self.tp, layout=self.layout)
        if self.fp8:
            kw["fp8"] = True
        if self.max_seqlen is not None:
            kw["max_seqlen"] = self.max_seqlen
        return kw

    def M(self) -> int:
        return ref_bshd_seq_len(self.seqlens, self.cp, self.tp, self.layout, self.fp8, self.max_seqlen)


@st.composite
def bshd_cfgs(draw, *, max_elems=None):
    cp = draw(st.sampled_from(CPS))
    tp = draw(st.sampled_from(TPS))
    layout = draw(st.sampled_from(LAYOUTS))
    fp8 = draw(st.booleans())
    a = ref_alignment_before_fp8(cp, tp, layout)
    seqlens = draw(lengths_strategy(a))
    # A forced maximum is at least the longest sequence (the library rejects a smaller one with a
    # ValueError; SPEC does not say what a smaller one would mean).
    extra = draw(st.none() | st.integers(0, 64) | st.integers(0, 3000))
    max_seqlen = None if extra is None else max(seqlens) + extra
    cfg = BCfg(seqlens, cp, tp, layout, fp8, max_seqlen)
    if max_elems is not None:
        if len(seqlens) * cfg.M() > max_elems:
            cfg.max_seqlen = None
        if len(seqlens) * cfg.M() > max_elems:
            cfg.fp8 = False
    return cfg


@given(bshd_cfgs(), st.data())
@example(BCfg([0], 2, 1, "zigzag"), None)
@example(BCfg([5, 3], 2, 1, "zigzag"), None)
@example(BCfg([5, 3, 0], 3, 2, "contiguous", fp8=True, max_seqlen=7), None)
@props(150)
def test_bshd_plan_matches_reference(cfg: BCfg, data):
    seqlens = cfg.seqlens if data is None else seqlens_as(data.draw, cfg.seqlens)
    plan = BshdPlan.build(seqlens, **cfg.kwargs())
    B = len(cfg.seqlens)
    M = cfg.M()
    a = ref_bshd_alignment(B, cfg.cp, cfg.tp, cfg.layout, cfg.fp8)
    assert M % a == 0 and M % cfg.cp == 0 and (M // cfg.cp) % cfg.tp == 0
    if cfg.layout == "zigzag" and cfg.cp > 1:
        assert M % (2 * cfg.cp) == 0

    assert plan.max_seqlen == M and plan.total_len == M
    assert plan.local_len == M // cfg.cp
    assert plan.num_seqs == B
    assert tuple(plan.seqlens_py) == tuple(cfg.seqlens)
    assert plan.cp_size == cfg.cp
    assert plan.tp_size == cfg.tp
    assert plan.layout == cfg.layout and plan.layout == Layout(cfg.layout)

    every = []
    for r in range(cfg.cp):
        cols = plan.columns(r)
        want = ref_bshd_columns(M, cfg.cp, cfg.layout, r)
        assert cols.dtype == torch.int64 and cols.shape == (M // cfg.cp,)
        assert cols.tolist() == want
        every += want
        mask = plan.token_mask(r)
        assert mask.dtype == torch.bool and mask.shape == (B, M // cfg.cp)
        assert mask.tolist() == [[j < n for j in want] for n in cfg.seqlens]
        pos = plan.position_ids(r)
        assert pos.dtype == torch.int64 and pos.shape == (B, M // cfg.cp)
        assert pos.tolist() == [list(want) for _ in cfg.seqlens]
    assert sorted(every) == list(range(M))


def _padded_form(seqs, seqlens, d: DataCfg, extra: int):
    """(B, S, ...) right-padded batch with S = max n + extra; garbage in the padding."""
    B = len(seqs)
    S = max(int(n) for n in seqlens) + extra
    g = torch.Generator().manual_seed(d.seed + 1)
    if d.dtype == torch.bool:
        x = torch.randint(0, 2, (B, S, *d.trailing), generator=g).bool()
    elif d.dtype == torch.int64:
        x = torch.randint(-(10**6), -1000, (B, S, *d.trailing), generator=g)
    else:
        x = (torch.randn((B, S, *d.trailing), generator=g) * 1000).to(d.dtype)
    for b, s in enumerate(seqs):
        x[b, : s.shape[0]] = s
    return x


# For a BshdPlan a plain tensor is read as the right-padded (B, S, ...) batch (shard's docstring);
# packed rows come as a jagged nested tensor or a list. The flat (sum n, ...) form is THD-only.
BSHD_FORMS = ["jagged", "list", "padded"]


def _bform(form, seqs, cfg: BCfg, d: DataCfg, extra: int = 0):
    if form == "padded":
        return _padded_form(seqs, cfg.seqlens, d, extra)
    return as_form(form, seqs, cfg.seqlens, d.trailing, d.dtype)


@given(bshd_cfgs(max_elems=MAX_ELEMS), data_cfgs(), st.sampled_from(BSHD_FORMS), st.integers(0, 5))
@example(BCfg([0, 0], 2, 1, "zigzag"), DataCfg(torch.int64, (), 0, -1, -100, 1), "list", 0)
@example(BCfg([5, 3], 2, 1, "zigzag", max_seqlen=9), DataCfg(torch.bool, (2,), 1, True, False, 2), "padded", 3)
@example(BCfg([1, 2999], 7, 3, "contiguous", fp8=True), DataCfg(torch.float32, (), 2, -1.5, 0.5, 3), "jagged", 0)
@props(150)
def test_bshd_shard_matches_reference(cfg: BCfg, d: DataCfg, form: str, extra: int):
    seqs = make_seqs(cfg.seqlens, d)
    x = _bform(form, seqs, cfg, d, extra)
    plan = BshdPlan.build(cfg.seqlens, **cfg.kwargs())
    B = len(cfg.seqlens)
    Mc = cfg.M() // cfg.cp
    for r in range(cfg.cp):
        got = shard(x, plan, r, shift=d.shift, pad_value=d.pad_value, fill=d.fill)
        want = ref_bshd_shard(
            seqs, cfg.seqlens, cfg.cp, cfg.tp, cfg.layout, r,
            shift=d.shift, pad_value=d.pad_value, fill=d.fill,
            max_seqlen=cfg.max_seqlen, fp8=cfg.fp8,
        )
        assert got.dtype == d.dtype
        assert got.shape == (B, Mc, *d.trailing), (got.shape, (B, Mc, *d.trailing))
        assert torch.equal(got, want), (r, form, got, want)


@given(bshd_cfgs(max_elems=MAX_ELEMS), data_cfgs(), st.sampled_from(BSHD_FORMS))
@example(BCfg([0, 0], 2, 1, "zigzag"), DataCfg(torch.int64, (), 0, -1, -100, 1), "list")
@example(BCfg([5, 3], 2, 1, "zigzag", max_seqlen=9), DataCfg(torch.bool, (2,), 1, True, False, 2), "padded")
@example(BCfg([1, 2999], 7, 3, "contiguous", fp8=True), DataCfg(torch.float32, (), 2, -1.5, 0.5, 3), "jagged")
@props(100)
def test_bshd_unshard_roundtrip(cfg: BCfg, d: DataCfg, form: str):
    seqs = make_seqs(cfg.seqlens, d)
    x = _bform(form, seqs, cfg, d, 2)
    plan = BshdPlan.build(cfg.seqlens, **cfg.kwargs())
    parts = [shard(x, plan, r, shift=d.shift, pad_value=d.pad_value, fill=d.fill) for r in range(cfg.cp)]
    nt = unshard(parts, plan)
    want = seqs if d.shift == 0 else ref_shift_seqs(seqs, d.shift, d.fill)
    assert_jagged_equals(nt, want, cfg.seqlens, d.trailing, d.dtype)


@given(bshd_cfgs(max_elems=MAX_ELEMS), data_cfgs())
@props(60)
def test_bshd_input_forms_identical(cfg: BCfg, d: DataCfg):
    seqs = make_seqs(cfg.seqlens, d)
    plan = BshdPlan.build(cfg.seqlens, **cfg.kwargs())
    forms = BSHD_FORMS
    for r in range(cfg.cp):
        outs = [
            shard(_bform(f, seqs, cfg, d, 3), plan, r, shift=d.shift, pad_value=d.pad_value, fill=d.fill)
            for f in forms
        ]
        for o in outs[1:]:
            assert o.dtype == outs[0].dtype and o.shape == outs[0].shape
            assert torch.equal(o, outs[0])
