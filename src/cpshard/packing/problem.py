"""The packing problem: a batch's lengths under a padded token budget, checked, as NumPy arrays.

What :func:`cpshard.pack` (``packing.pack``), its bound (``packing.bound``), its search (``packing.search``)
and verl's drop-in (``compat``) share: each sequence's padded rows, its causal work, a micro-batch's
row multiple and capacity (Note [Micro-batch packing] in ``packing.pack``), and the input checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding, sequence_unit
from cpshard.index.balance import tri
from cpshard.plan.args import parse_seqlens

__all__ = ["Problem", "as_ratio", "by_unit", "check_fits", "checked_lengths", "checked_sizes", "group_rows",
           "make_problem"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A batch under a budget: ``n``, ``p``, ``w`` ``(B,)`` lengths, padded lengths, ``tri(n)``."""

    n: np.ndarray  # (B,) lengths
    p: np.ndarray  # (B,) per-sequence padded lengths
    w: np.ndarray  # (B,) tri(n)
    cp: int
    tp: int
    layout: Layout
    padding: Padding
    keep: int  # a micro-batch's total is a multiple of this
    capacity: int  # sum of P in one micro-batch, at most


def make_problem(seqlens: Sequence[int], max_tokens: int, cp: int, tp: int, layout: Layout,
                 padding: Padding) -> Problem:
    if padding is Padding.NONE and layout is Layout.ZIGZAG and cp > 1:
        fail("padding", "'none'", "deals zigzag's extra rows over a micro-batch's sequences together, so a "
             "sequence's per-rank work is not its own, which the packing's model needs", "pack with "
             "padding='minimal' (each sequence a multiple of 2 * cp) or layout='contiguous'")
    unit = sequence_unit(cp, tp, layout, False, padding)
    keep = math.lcm(unit, cp * tp)
    n = np.array(seqlens, dtype=np.int64)
    p = -(-n // unit) * unit
    capacity = max_tokens // keep * keep
    return Problem(n, p, tri(n), cp, tp, layout, padding, keep, capacity)


def by_unit(x: np.ndarray, group: int) -> np.ndarray:
    """``(B / group,)`` the sums of ``x`` over each ``group`` consecutive sequences."""
    return x if group == 1 else x.reshape(-1, group).sum(1)


def group_rows(prob: Problem, group: int) -> np.ndarray:
    """``(B / group,)`` the padded rows of a micro-batch holding only group ``k`` (``plan.total_len``;
    0 for an empty sequence alone)."""
    return -(-by_unit(prob.p, group) // prob.keep) * prob.keep


def check_fits(prob: Problem, max_tokens: int, group: int = 1) -> None:
    """A clear error for a batch that does not split into groups, or a sequence (group) that alone
    pads to more than ``max_tokens`` rows."""
    if prob.n.size % group:
        fail("group_size", group, f"must divide the number of sequences ({prob.n.size})",
             "pass a batch of whole groups, or another group_size")
    rows = group_rows(prob, group)
    over = np.flatnonzero(rows > max_tokens)
    if not over.size:
        return
    k, fix = int(over[0]), f"raise max_tokens to at least {int(rows.max())}"
    if group == 1:
        fail(f"seqlens[{k}]", int(prob.n[k]), f"pads to {int(rows[k])} rows (a micro-batch's rows are a multiple of "
             f"{prob.keep} at cp_size={prob.cp}, tp_size={prob.tp}, layout={prob.layout.value!r}, "
             f"padding={prob.padding.value!r}), more than max_tokens={max_tokens}", f"{fix}, or cut sequence {k}")
    fail(f"seqlens[{k * group}:{(k + 1) * group}]", [int(x) for x in prob.n[k * group:(k + 1) * group]],
         f"is group {k} (group_size={group}), whose sequences pad to {int(rows[k])} rows together, more than "
         f"max_tokens={max_tokens}", f"{fix}, or split the group")



def as_ratio(step: int, total: int, dp: int, cp: int) -> float:
    return 1.0 if total == 0 else step * dp * cp / total


_ROWS = 2**31  # a plan holds fewer rows (int32 offsets, as Megatron and TransformerEngine take them)
_WORK = 2**62  # the batch's causal work stays below it: every sum of works fits an int64


def checked_lengths(seqlens: Any) -> list[int]:
    """The batch's lengths (``parse_seqlens``: ints, an integer tensor or array), each below
    ``_ROWS``, and their causal work below ``_WORK`` (NumPy's int64 sums do not overflow)."""
    lens = list(parse_seqlens(seqlens))
    longest = max(lens)
    if longest >= _ROWS:
        fail(f"seqlens[{lens.index(longest)}]", longest, f"must be below 2**31 = {_ROWS} (no plan holds more rows)",
             "split the sequence, or drop it from the batch")
    if longest * longest * len(lens) >= _WORK:  # only then the exact sum (Python ints)
        work = sum(n * (n + 1) // 2 for n in lens)
        if work >= _WORK:
            fail("seqlens", f"{len(lens)} sequences of causal work {work}", f"must have a work below 2**62 = {_WORK} "
                 "(the search sums works as int64)", "pack the batch in parts")
    return lens


def checked_sizes(max_tokens: Any, cp_size: Any, tp_size: Any) -> tuple[int, int, int]:
    """``max_tokens``, ``cp_size``, ``tp_size`` checked before any NumPy arithmetic on them."""
    max_tokens = check_int("max_tokens", max_tokens, minimum=1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    if cp_size * tp_size >= _ROWS:
        fail("cp_size", cp_size, f"with tp_size={tp_size} every padded micro-batch has at least cp_size * tp_size "
             "rows, which must stay below 2**31", "pass the sizes of your context- and tensor-parallel groups")
    if max_tokens >= _ROWS:
        fail("max_tokens", max_tokens, f"must be below 2**31 = {_ROWS} (a micro-batch's plan holds fewer rows)",
             f"pass max_tokens <= {_ROWS - 1}")
    return max_tokens, cp_size, tp_size
