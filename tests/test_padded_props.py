"""from_padded / to_padded against the naive reference."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from cpshard import from_padded, to_padded
from reference import ref_from_padded, ref_to_padded
from strategies import DataCfg, as_jagged, assert_jagged_equals, data_cfgs, make_seqs, props

LENGTHS = st.one_of(
    st.lists(st.integers(0, 12), min_size=1, max_size=64),
    st.lists(st.integers(0, 3000), min_size=1, max_size=3),
)


@given(LENGTHS, data_cfgs(with_shift=False), st.sampled_from(["right", "left"]), st.integers(0, 4), st.booleans())
@props(120)
def test_to_padded_matches_reference(seqlens, d: DataCfg, side, extra, give_length):
    seqs = make_seqs(seqlens, d)
    nt = as_jagged(seqs, seqlens, d.trailing, d.dtype)
    length = max(seqlens) + extra if give_length else None
    pad_value = 0 if d.pad_value is None else d.pad_value
    kw = dict(padding_side=side, pad_value=pad_value)
    if length is not None:
        kw["length"] = length
    x, mask = to_padded(nt, **kw)
    wx, wm = ref_to_padded(seqs, side, length, pad_value)
    assert x.dtype == d.dtype and mask.dtype == torch.bool
    assert x.shape == wx.shape and mask.shape == wm.shape, (x.shape, wx.shape)
    assert torch.equal(x, wx)
    assert torch.equal(mask, wm)
    # and back
    assert_jagged_equals(from_padded(x, mask), seqs, seqlens, d.trailing, d.dtype)


@given(LENGTHS, data_cfgs(with_shift=False))
@props(40)
def test_to_padded_defaults(seqlens, d: DataCfg):
    seqs = make_seqs(seqlens, d)
    nt = as_jagged(seqs, seqlens, d.trailing, d.dtype)
    x, mask = to_padded(nt)
    wx, wm = ref_to_padded(seqs, "right", None, 0)
    assert torch.equal(x, wx) and torch.equal(mask, wm)


@given(LENGTHS, data_cfgs(with_shift=False), st.sampled_from(["right", "left"]), st.integers(0, 4))
@props(120)
def test_from_padded_matches_naive_extraction(seqlens, d: DataCfg, side, extra):
    """A left- or right-padded batch with garbage in the padding: from_padded equals the naive
    per-row extraction of the True entries."""
    B = len(seqlens)
    S = max(seqlens) + extra
    g = torch.Generator().manual_seed(d.seed)
    if d.dtype == torch.bool:
        x = torch.randint(0, 2, (B, S, *d.trailing), generator=g).bool()
    elif d.dtype == torch.int64:
        x = torch.randint(-(10**9), 10**9, (B, S, *d.trailing), generator=g)
    else:
        x = (torch.randn((B, S, *d.trailing), generator=g) * 100).to(d.dtype)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(seqlens):
        if side == "right":
            mask[b, :n] = True
        else:
            mask[b, S - n :] = True
    want = ref_from_padded(x, mask)
    got = from_padded(x, mask)
    assert_jagged_equals(got, want, seqlens, d.trailing, d.dtype)
