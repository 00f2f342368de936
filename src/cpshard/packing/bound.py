"""The bound of a packing: a step ratio no packing of a batch under its budget goes below.

Note [Why no packing beats the bound] (at :func:`packing_bound`) proves it; :func:`cpshard.pack`
reports it as ``Packing.lower_bound``, and its search scores the contiguous model's heaviest pieces
with :func:`two_piece`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cpshard.base.errors import check_int
from cpshard.base.layout import Layout, Padding
from cpshard.index.balance import tri, zigzag_works
from cpshard.packing.problem import Problem, as_ratio, check_fits, checked_lengths, checked_sizes, make_problem

__all__ = ["bound_work", "crowded", "packing_bound", "two_piece"]


def two_piece(n: np.ndarray, local: np.ndarray) -> np.ndarray:
    """``(B,)``: a work some rank holds of sequence ``i`` whatever its offset, at ``local[i]`` rows a rank
    (contiguous): ``min_c max(tri(n) - tri(c), tri(c) - tri(max(c - L, 0)))`` over ``c`` in
    ``[max(0, n - L), n - 1]`` (Note [Why no packing beats the bound], (2))."""
    n = n.astype(np.int64)
    local = np.broadcast_to(np.asarray(local, dtype=np.int64), n.shape)
    lo = np.maximum(0, n - local)
    hi = np.maximum(lo, n - 1)
    tn = tri(n)

    def tail(c: np.ndarray) -> np.ndarray:
        return tn - tri(c)

    def head(c: np.ndarray) -> np.ndarray:
        return tri(c) - tri(np.maximum(c - local, 0))

    a, b = lo.copy(), hi.copy()  # the least c in [lo, hi] with head >= tail (hi when none)
    while True:
        open_ = a < b
        if not open_.any():
            break
        mid = (a + b) // 2
        up = head(mid) >= tail(mid)
        b = np.where(open_ & up, mid, b)
        a = np.where(open_ & ~up, mid + 1, a)
    best = np.maximum(tail(a), head(a))
    prev = np.maximum(a - 1, lo)
    best = np.minimum(best, np.maximum(tail(prev), head(prev)))
    return np.where(n > 0, best, 0)


def _filler(prob: Problem) -> tuple[np.ndarray, np.ndarray]:
    """The most work any set of sequences fits into ``x`` padded rows, relaxed to a fractional knapsack
    (densest first): cumulative rows and work at each breakpoint, for :func:`np.interp`."""
    keep = prob.p > 0
    density = prob.w[keep] / prob.p[keep]
    by = np.argsort(-density, kind="stable")
    rows = np.concatenate([[0], np.cumsum(prob.p[keep][by])]).astype(np.float64)
    work = np.concatenate([[0], np.cumsum(prob.w[keep][by])]).astype(np.float64)
    return rows, work


def bound_work(prob: Problem, dp: int) -> int:
    """A step time (Note [Why no packing beats the bound]) no packing under the budget goes below."""
    cp, n, w = prob.cp, prob.n, prob.w
    total = int(w.sum())
    if total == 0:
        return 0
    rows_min = np.maximum(-(-prob.p // prob.keep) * prob.keep, prob.keep)  # a micro-batch holding i, at least
    grid = 8
    steps = np.linspace(0.0, 1.0, grid + 1)
    frows, fwork = _filler(prob)
    excess = np.full(n.shape, np.inf)
    for k in range(grid):
        lo = rows_min + ((prob.capacity - rows_min) * steps[k]).astype(np.int64) // prob.keep * prob.keep
        hi = rows_min + -(-((prob.capacity - rows_min) * steps[k + 1]).astype(np.int64) // prob.keep) * prob.keep
        hi = np.minimum(np.maximum(hi, lo), prob.capacity)
        heavy = _heaviest(prob, lo // cp)
        fill = np.interp((hi - prob.p).astype(np.float64), frows, fwork)
        excess = np.minimum(excess, heavy - (w + fill) / cp)
    heavy_min = _heaviest(prob, rows_min // cp)
    excess = np.maximum(excess, 0.0)
    spread = (total / cp + crowded(excess, prob.p, prob.capacity)) / dp
    bound = max(-(-total // (dp * cp)), int(heavy_min.max()), math.ceil(spread * (1 - 1e-12)) - 1)
    return bound


def crowded(excess: np.ndarray, rows: np.ndarray, capacity: int) -> float:
    """``sum_k (e_(k) - e_(k+1)) ceil(R_k / C)``: the least ``sum_m max_{i in m} e_i`` over every split of
    the sequences into micro-batches of at most ``C`` rows (Note [Why no packing beats the bound], (3)),
    with ``e`` sorted descending and ``R_k`` the rows of the ``k`` largest."""
    by = np.argsort(-excess, kind="stable")
    e = excess[by]
    keep = e > 0
    e, cum = e[keep], np.cumsum(rows[by][keep])
    if e.size == 0:
        return 0.0
    steps = e - np.concatenate([e[1:], [0.0]])
    return float((steps * -(-cum // capacity)).sum())


def _heaviest(prob: Problem, local: np.ndarray) -> np.ndarray:
    """``(B,)`` a work the most loaded rank of any micro-batch with ``local`` rows a rank holding sequence
    ``i`` has at least (parts (2) and (3) of Note [Why no packing beats the bound])."""
    if prob.cp == 1:
        return prob.w.astype(np.float64)
    if prob.layout is Layout.ZIGZAG:
        if prob.padding is Padding.ALIGNED:
            return zigzag_works(prob.n, prob.p, prob.cp).max(1).astype(np.float64)
        return -(-prob.w // prob.cp).astype(np.float64)
    return two_piece(prob.n, local).astype(np.float64)


def packing_bound(seqlens: Sequence[int], *, max_tokens: int, cp_size: int, tp_size: int = 1,
                  layout: Layout | str = "zigzag", dp_size: int = 1, padding: Padding | str = "aligned") -> float:
    """The least step ratio (Note [Micro-batch packing]) any packing of ``seqlens`` under ``max_tokens``
    can reach, with any number of micro-batches, any DP split and any order inside them.

    Note [Why no packing beats the bound]
    -------------------------------------
    Write ``c_m = max_r w(m, r)``, ``W_m`` micro-batch ``m``'s work and ``R_m <= C`` its padded rows,
    ``L_m = R_m / cp`` a rank's. Then ``T >= sum_m c_m / dp`` (the slowest DP rank is at least the
    mean) and, for each ``m``:

    1. ``c_m >= W_m / cp`` (the slowest rank holds at least the mean), so ``T >= W / (dp cp)``.
    2. ``c_m >= b_i(L_m)`` for every sequence ``i`` of ``m``, the most of ``i``'s work one rank must
       hold. Zigzag, aligned padding: ``i``'s per-rank work is fixed by ``P_i`` (its chunks), so
       ``b_i`` is its largest; minimal zigzag padding may lengthen one sequence, so only
       ``ceil(tri(n_i) / cp)`` is used. Contiguous: the rank boundaries inside the sequence are
       ``L_m`` apart, so the piece holding its last token starts at some ``c`` in
       ``[max(0, n - L), n - 1]`` and costs ``tri(n) - tri(c)``, and the piece before it is
       ``[max(0, c - L), c)``, costing ``tri(c) - tri(max(0, c - L))``; the two are on different ranks, so
       ``c_m`` is at least the least over ``c`` of the larger (``two_piece``). That least grows with
       ``L``: a larger ``L`` raises the second term for every ``c`` and adds only ``c < n - L``,
       whose tail ``tri(n) - tri(c)`` exceeds ``tri(n) - tri(n - L)``, the larger term at ``c = n - L``
       (later positions cost more). So ``b_i`` at the least ``L`` a micro-batch holding ``i`` has
       (``roundup(P_i, k) / cp``) bounds every micro-batch holding it: ``T >= max_i b_i``.
    3. With ``F(x)`` the most work any sequences fit into ``x`` padded rows (a fractional knapsack,
       densest first, over all sequences: an upper bound), ``W_m <= tri(n_i) + F(R_m - P_i)``, so
       ``c_m - W_m / cp >= e_i := min_R (b_i(R / cp) - (tri(n_i) + F(R - P_i)) / cp)^+`` over the rows
       ``R`` a micro-batch holding ``i`` can have (evaluated on a grid: over each interval, ``b_i`` at
       its lower end, which is no more by the monotonicity above, and ``F`` at its upper end). So
       ``sum_m c_m >= W / cp + sum_m max_{i in m} e_i``, and the last sum is
       ``integral_0^inf N(t) dt`` with ``N(t)`` the micro-batches holding a sequence of ``e_i > t``.
       Those sequences' rows ``R(t) = sum_{e_i > t} P_i`` fit only in micro-batches of at most ``C``
       rows each, so ``N(t) >= ceil(R(t) / C)``: with ``e`` sorted descending and ``R_k`` the rows of
       the ``k`` largest, ``sum_m max e >= sum_k (e_(k) - e_(k+1)) ceil(R_k / C)`` (``crowded``; the
       first version took ``R(t) / C``, the fraction, which misses that one long document's excess is
       paid whole by its micro-batch). Hence ``T >= (W / cp + sum_k (e_(k) - e_(k+1)) ceil(R_k / C)) / dp``.

    ``T`` is an integer; the bound is the ceiling of the largest of the three (minus one unit
    against float rounding in (3)), over ``W / (dp cp)``. It ignores the count and DP-agreement
    rules, so it holds for every packing :func:`pack` may return. It is tight when no
    sequence's heaviest piece dominates its micro-batch (zigzag: usually within a few percent) and
    loose when long documents could share micro-batches only fractionally.
    """
    max_tokens, cp_size, tp_size = checked_sizes(max_tokens, cp_size, tp_size)
    dp_size = check_int("dp_size", dp_size, minimum=1)
    lens = checked_lengths(seqlens)
    prob = make_problem(lens, max_tokens, cp_size, tp_size, Layout.parse(layout), Padding.parse(padding))
    check_fits(prob, max_tokens)
    return as_ratio(bound_work(prob, dp_size), int(prob.w.sum()), dp_size, cp_size)
