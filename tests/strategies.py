"""Hypothesis strategies and small helpers shared by the *_props tests."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from cpshard import ShardPlan
from reference import ref_alignment, ref_padded_lengths

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


# CPSHARD_PROPS_SCALE=10 runs every property with 10x the examples (a deeper, slower search).
_SCALE = float(os.environ.get("CPSHARD_PROPS_SCALE", "1"))


def props(n: int):
    """settings(...) for one property with ``n`` examples (times CPSHARD_PROPS_SCALE)."""
    return settings(max_examples=max(1, int(n * _SCALE)), **SETTINGS)


CPS = [1, 2, 3, 4, 5, 6, 7, 8]
TPS = [1, 2, 3, 4]
LAYOUTS = ["zigzag", "contiguous"]
DTYPES = [torch.int64, torch.bool, torch.float32, torch.bfloat16]

# Buckets: small, powers of two, odd and "awkward" values.
BUCKETS = [1, 2, 3, 5, 7, 8, 12, 16, 64, 96, 100, 128, 256]


def lengths_strategy(a: int, *, batch_max: int = 64, big: bool = True):
    """Lengths around the alignment ``a`` (0, 1, a-1, a, a+1, ...), small ones, and occasionally
    lengths in the thousands (only in small batches)."""
    special = sorted({0, 1, max(a - 1, 0), a, a + 1, 2 * a - 1, 2 * a, 2 * a + 1})
    small = st.sampled_from(special) | st.integers(0, 24)
    if big:
        any_len = small | st.integers(0, 3000) | st.integers(900, 3000)
    else:
        any_len = small
    few = st.integers(1, 4).flatmap(lambda b: st.lists(any_len, min_size=b, max_size=b))
    many = st.sampled_from(sorted({5, 17, 32, batch_max}) + [batch_max]) | st.integers(5, max(5, batch_max))
    many = many.map(lambda b: min(b, batch_max)).flatmap(lambda b: st.lists(small, min_size=b, max_size=b))
    # few sequences, possibly long | up to batch_max short sequences
    return st.one_of(few, many)


@dataclass
class PlanCfg:
    seqlens: list
    cp: int
    tp: int
    layout: str
    fp8: bool = False
    min_local_rows: int | None = None
    length_bucket: int | None = None
    padding: str = "aligned"

    @property
    def ext(self) -> dict:
        return dict(fp8=self.fp8, min_local_rows=self.min_local_rows, length_bucket=self.length_bucket,
                    padding=self.padding)

    def build_kwargs(self) -> dict:
        kw = dict(cp_size=self.cp, tp_size=self.tp, layout=self.layout)
        if self.padding != "aligned":
            kw["padding"] = self.padding
        if self.fp8:
            kw["fp8"] = True
        if self.min_local_rows is not None:
            kw["min_local_rows"] = self.min_local_rows
        if self.length_bucket is not None:
            kw["length_bucket"] = self.length_bucket
        return kw

    def padded(self) -> list:
        return ref_padded_lengths(self.seqlens, self.cp, self.tp, self.layout, **self.ext)


@st.composite
def plan_cfgs(draw, *, big: bool = True, batch_max: int = 64, max_total: int | None = None):
    cp = draw(st.sampled_from(CPS))
    tp = draw(st.sampled_from(TPS))
    layout = draw(st.sampled_from(LAYOUTS))
    padding = draw(st.sampled_from(["aligned", "aligned", "minimal", "none"]))
    fp8 = padding != "none" and draw(st.booleans())  # fp8 pads every sequence: never with "none"
    a = ref_alignment(cp, tp, layout, fp8, padding)
    seqlens = draw(lengths_strategy(a, batch_max=batch_max, big=big))
    min_local_rows = draw(st.none() | st.integers(0, 40) | st.integers(0, 600))
    length_bucket = draw(st.none() | st.sampled_from(BUCKETS))
    cfg = PlanCfg(seqlens, cp, tp, layout, fp8, min_local_rows, length_bucket, padding)
    if max_total is not None:
        # Keep the tensors small: drop extensions that blow the total up, then, if still too
        # large, drop fp8 (its total unit can be 8192 rows). (The closed form is only used to
        # prune here; the tests compare against the naive reference.)
        if _quick_total(cfg) > max_total:
            cfg.length_bucket = None
        if _quick_total(cfg) > max_total:
            cfg.min_local_rows = None
        if _quick_total(cfg) > max_total:
            cfg.fp8 = False
    return cfg


def round_up(n: int, a: int) -> int:
    """Closed-form smallest multiple of ``a`` that is >= ``n``."""
    return -(-n // a) * a


def closed_form_padding(cfg: PlanCfg) -> list[int]:
    """SPEC's padded lengths in closed form: prunes strategies, and cross-checks the naive oracle."""
    a = ref_alignment(cfg.cp, cfg.tp, cfg.layout, False)
    u = ref_alignment(cfg.cp, cfg.tp, cfg.layout, cfg.fp8, cfg.padding)
    F = a * 128 if cfg.fp8 else 1
    K = math.lcm(u, F, cfg.cp * cfg.tp)  # every total keeps the per-sequence unit and cp shares of a multiple of tp
    P = [round_up(n, u) for n in cfg.seqlens]
    T = round_up(sum(P), K)
    if cfg.min_local_rows is not None:
        T = max(T, round_up(cfg.min_local_rows * cfg.cp, K))
    if cfg.length_bucket is not None:
        T = round_up(T, math.lcm(cfg.length_bucket, cfg.cp, K))
    P[-1] += T - sum(P)
    return P


def _quick_total(cfg: PlanCfg) -> int:
    return sum(closed_form_padding(cfg))


def seqlens_as(draw, seqlens):
    """The same lengths as list, tuple, or 1-D int32/int64 tensor."""
    kind = draw(st.sampled_from(["list", "tuple", "int32", "int64"]))
    if kind == "list":
        return list(seqlens)
    if kind == "tuple":
        return tuple(seqlens)
    return torch.tensor(list(seqlens), dtype=getattr(torch, kind))


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


@dataclass
class DataCfg:
    dtype: torch.dtype
    trailing: tuple
    seed: int
    pad_value: object = 0
    fill: object = 0
    shift: int = 0


@st.composite
def data_cfgs(draw, *, with_shift: bool = True):
    dtype = draw(st.sampled_from(DTYPES))
    trailing = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    seed = draw(st.integers(0, 2**31 - 1))
    if dtype == torch.bool:
        pad_value = draw(st.booleans())
        fill = draw(st.booleans())
    elif dtype == torch.int64:
        pad_value = draw(st.sampled_from([-1, 7, -100, 0]))
        fill = draw(st.sampled_from([-100, 5, 3, 0]))
    else:
        pad_value = draw(st.sampled_from([-1.5, 2.25, 0.0, -100.0]))
        fill = draw(st.sampled_from([0.5, -3.0, 0.0]))
    shift = draw(st.integers(-3, 3)) if with_shift else 0  # negative: a look-back (SPEC, Shifts)
    if draw(st.integers(0, 3)) == 0:
        pad_value = None  # SPEC's default: fill when shifted, else 0
    return DataCfg(dtype, trailing, seed, pad_value, fill, shift)


def make_seqs(seqlens, dcfg: DataCfg):
    """Per-sequence tensors (n_i, *trailing); int64 values are globally unique per element."""
    g = torch.Generator().manual_seed(dcfg.seed)
    seqs = []
    offset = 0
    k = 1
    for d in dcfg.trailing:
        k *= d
    for n in seqlens:
        n = int(n)
        shape = (n, *dcfg.trailing)
        if dcfg.dtype == torch.int64:
            t = (torch.arange(n * k, dtype=torch.int64) + offset + 1000).reshape(shape)
            # scramble a little so values are not monotone
            t = t * 3 + torch.randint(0, 3, shape, generator=g)
            offset += n * k
        elif dcfg.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        elif dcfg.dtype == torch.float32:
            t = torch.randn(shape, generator=g) * 10
        else:
            t = (torch.randn(shape, generator=g) * 10).to(dcfg.dtype)
        seqs.append(t)
    return seqs


def concat(seqs, trailing, dtype):
    if len(seqs) == 0:
        return torch.empty((0, *trailing), dtype=dtype)
    return torch.cat(seqs, dim=0)


def offsets_of(seqlens):
    out = [0]
    for n in seqlens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int64)


def as_jagged(seqs, seqlens, trailing, dtype):
    values = concat(seqs, trailing, dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets_of(seqlens))


def as_form(form: str, seqs, seqlens, trailing, dtype):
    """The batch in one of the accepted input forms."""
    if form == "jagged":
        return as_jagged(seqs, seqlens, trailing, dtype)
    if form == "list":
        return list(seqs)
    if form == "flat":
        return concat(seqs, trailing, dtype)
    raise AssertionError(form)


FORMS = ["jagged", "list", "flat"]


def assert_jagged_equals(nt, seqs, seqlens, trailing, dtype):
    """``nt`` is a jagged nested tensor whose values/offsets are exactly those of ``seqs``."""
    assert isinstance(nt, torch.Tensor) and nt.is_nested, type(nt)
    assert nt.layout == torch.jagged, nt.layout
    want_values = concat(seqs, trailing, dtype)
    got_values = nt.values()
    assert got_values.dtype == dtype, (got_values.dtype, dtype)
    assert got_values.shape == want_values.shape, (got_values.shape, want_values.shape)
    assert torch.equal(got_values, want_values)
    want_off = offsets_of(seqlens)
    got_off = nt.offsets()
    assert got_off.dtype == torch.int64, got_off.dtype
    assert torch.equal(got_off, want_off), (got_off, want_off)


@st.composite
def torch_cp_batches(draw, *, cps=(1, 2, 3, 4), fp8: bool = False, extra: bool = True, total: int | None = None,
                     longest: int = 12):
    """``(plans, rows)`` for cpshard.compat.torch_cp: B >= 1 plans of one cp (from ``cps``), layout and
    padding, one ``total_len`` S (``total`` where given, else the longest row's total, sometimes one
    unit more); lengths with 0, 1 and those below ``2 * cp``, up to ``longest``; sometimes a balanced
    order."""
    cp = draw(st.sampled_from(list(cps)))
    tp = draw(st.sampled_from([1, 1, 2]))
    layout = draw(st.sampled_from(LAYOUTS))
    padding = draw(st.sampled_from(["aligned", "minimal", "none"]))
    use_fp8 = fp8 and padding != "none" and draw(st.booleans())
    reorder = draw(st.sampled_from([None, "balanced"])) if layout == "contiguous" else None
    a = ref_alignment(cp, tp, layout, use_fp8, padding)
    length = st.sampled_from(sorted({0, 1, max(a - 1, 0), a, a + 1, 2 * cp - 1})) | st.integers(0, longest)
    rows = draw(st.lists(st.lists(length, min_size=1, max_size=5), min_size=1, max_size=3))
    kw = dict(cp_size=cp, tp_size=tp, layout=layout, padding=padding, fp8=use_fp8)
    unit = math.lcm(a, cp * tp, 128 * ref_alignment(cp, tp, layout) if use_fp8 else 1)  # what a total keeps
    natural = max(ShardPlan.build(r, **kw).total_len for r in rows) or unit  # a batch of empty rows: one unit
    if total is not None:
        assume(natural <= total)
        S = total
    else:
        S = natural + (draw(st.sampled_from([0, 0, 1])) * unit if extra else 0)
    return [ShardPlan.build(r, **kw, reorder=reorder, total_len=S) for r in rows], rows


def torch_cp_documents(plans, trailing=(), dtype=torch.int64, seed=0, high=1000):
    """Per plan, its documents in the caller's order: ``(n, *trailing)`` random tensors."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [[torch.randn((n, *trailing), generator=g, dtype=dtype) for n in plan.input_seqlens_py]
                for plan in plans]
    return [[torch.randint(1, high, (n, *trailing), generator=g).to(dtype) for n in plan.input_seqlens_py]
            for plan in plans]
