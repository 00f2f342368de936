"""``cpshard.compat.verl.local_padding_mask``: verl main's dynamic-CP router padding mask, from the plan.

Against the naive per-row reference (``tests/reference.py``) over the padded lengths the drop-in's
``thd_plan`` gives; against verl main's own ``_local_padding_mask`` by hand
(``scripts/upstream/compare_dcp_mask.py``: verl 0.9.1, which CI installs, has no dynamic CP).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import ref_row_info

try:
    import verl_fakes  # noqa: F401  (verl 0.9.1 and megatron-core, for patch())
except ImportError as exc:
    pytest.skip(f"verl 0.9.1 / megatron-core cannot be imported ({exc}); run scripts/setup.sh",
                allow_module_level=True)

from cpshard.compat import verl as cv


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=5), st.sampled_from([1, 2, 3, 4, 8]),
       st.sampled_from([1, 2, 4]), st.sampled_from(["zigzag", "contiguous"]),
       st.one_of(st.none(), st.integers(1, 60)))
def test_the_mask_marks_each_ranks_pad_rows(lens, cp, tp, layout, min_local_rows):
    plan = cv.thd_plan(lens, min_local_rows=min_local_rows, cp_layout=layout, tp_size=tp, cp_size=cp)
    padded = [b - a for a, b in zip(plan.cu_seqlens_padded_py, plan.cu_seqlens_padded_py[1:])]
    for r in range(cp):
        got = cv.local_padding_mask(lens, cp_size=cp, cp_rank=r, tp_size=tp, cp_layout=layout,
                                    min_local_rows=min_local_rows)
        want = [not is_token for _, _, _, is_token in ref_row_info(lens, padded, cp, layout, r)]
        assert got.dtype == torch.bool and got.tolist() == want
        assert torch.equal(cv.local_padding_mask(torch.tensor(lens), cp_size=cp, cp_rank=r, tp_size=tp,
                                                 cp_layout=layout, min_local_rows=min_local_rows, plan=plan), got)
    # every token is real on exactly one rank (verl's own loses some where its padding breaks the layout)
    assert sum(int((~cv.local_padding_mask(lens, cp_size=cp, cp_rank=r, tp_size=tp, cp_layout=layout,
                                            min_local_rows=min_local_rows)).sum()) for r in range(cp)) == sum(lens)


def test_where_verls_padding_drops_a_token():
    """README, "Differences from verl", 2: ``[7, 8, 9]`` at cp=2 with ``min_local_rows=3``. verl pads to 6
    rows, which zigzag cannot split into 4 chunks; its mask has one real row a rank (token 9 is lost).
    cpshard pads to 8: rank 0 holds rows 0-1 and 6-7 (tokens 7, 8, two pads), rank 1 rows 2-5 (9, three pads)."""
    kw = dict(cp_size=2, tp_size=1, cp_layout="zigzag", min_local_rows=3)
    assert cv.local_padding_mask([3], cp_rank=0, **kw).tolist() == [False, False, True, True]
    assert cv.local_padding_mask([3], cp_rank=1, **kw).tolist() == [False, True, True, True]


def test_errors_are_verls_and_clear():
    kw = dict(cp_size=2, tp_size=1)
    with pytest.raises(ValueError, match="Unsupported context parallel layout: ring"):
        cv.local_padding_mask([4], cp_rank=0, cp_layout="ring", **kw)
    with pytest.raises(ValueError, match=r"min_local_rows=0: must be positive"):
        cv.local_padding_mask([4], cp_rank=0, min_local_rows=0, **kw)
    with pytest.raises(ValueError, match=r"cp_rank=2: must be below cp_size=2"):
        cv.local_padding_mask([4], cp_rank=2, **kw)
    with pytest.raises(ValueError, match=r"is for seqlens \[5\], not \[4\]"):
        cv.local_padding_mask([4], cp_rank=0, plan=cv.thd_plan([5], cp_size=2, tp_size=1), **kw)


def _scheduler_module(monkeypatch, fn):
    """A stand-in ``verl.utils.dynamic_cp_scheduler`` (verl main's module; 0.9.1 has none)."""
    module = types.ModuleType("verl.utils.dynamic_cp_scheduler")
    module._local_padding_mask = fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_patch_binds_verl_mains_site_and_undoes_it(monkeypatch):
    def verls(seq_lens, *, cp_size, cp_rank, tp_size, cp_layout="zigzag", min_local_rows=None):
        raise AssertionError("verl's own was called")

    module = _scheduler_module(monkeypatch, verls)
    with cv.patch() as p:
        assert module._local_padding_mask is cv.local_padding_mask
        assert "verl.utils.dynamic_cp_scheduler._local_padding_mask" in p.bound
    assert module._local_padding_mask is verls


def test_patch_leaves_a_changed_site_alone(monkeypatch, caplog):
    def changed(seq_lens, *, cp_size, cp_rank):
        return None

    module = _scheduler_module(monkeypatch, changed)
    with caplog.at_level(logging.WARNING, logger="cpshard.compat.verl"), cv.patch() as p:
        assert module._local_padding_mask is changed
        assert not any("dynamic_cp_scheduler" in name for name in p.replaced)
        assert p.refused["verl.utils.dynamic_cp_scheduler._local_padding_mask"].startswith(
            "takes (seq_lens, cp_size, cp_rank), not verl's (seq_lens, cp_size, cp_rank, tp_size, cp_layout, ")
    assert "refused verl.utils.dynamic_cp_scheduler._local_padding_mask: takes (seq_lens, cp_size, cp_rank)" \
        in caplog.text



def test_a_given_plan_is_checked_against_every_size():
    """``plan=`` built for tp_size=1 or without min_local_rows returned its 6 rows where the call
    asks 16; seq_lens=5 gave "'int' object is not iterable"."""
    args = {"cp_size": 2, "cp_rank": 0, "tp_size": 2, "min_local_rows": 16}
    assert cv.local_padding_mask([5, 3], **args).shape == (16,)
    with pytest.raises(ValueError, match=r"^plan=ShardPlan\(.*tp_size=1.*\): is for tp_size=1, not tp_size=2"):
        cv.local_padding_mask([5, 3], plan=cv.thd_plan([5, 3], tp_size=1, cp_size=2), **args)
    with pytest.raises(ValueError, match=r"^plan=.*: has 8 rows a rank, fewer than min_local_rows=16"):
        cv.local_padding_mask([5, 3], plan=cv.thd_plan([5, 3], tp_size=2, cp_size=2), **args)
    same = cv.thd_plan([5, 3], tp_size=2, cp_size=2, min_local_rows=16)
    assert torch.equal(cv.local_padding_mask([5, 3], plan=same, **args), cv.local_padding_mask([5, 3], **args))
    with pytest.raises(TypeError, match=r"^seq_lens=5: must be a sequence of ints or a 1-D integer tensor\. "
                                        r"Fix: pass e\.g\. seq_lens=\[5, 3\]"):
        cv.local_padding_mask(5, **args)
