"""Micro-batches that know the plan: a global batch split into token-budgeted micro-batches per DP rank.

Pure: lengths in, indices, plans and works out (NumPy and Python ints; no communication). Every rank
that holds the global batch's lengths computes the same packing, so no collective is needed.

Note [Micro-batch packing]
--------------------------
A **step** runs, on every DP rank ``d``, its micro-batches one after the other; a micro-batch takes
as long as its slowest CP rank. With ``w(m, r)`` the causal attention work of CP rank ``r`` in
micro-batch ``m`` (the (query, key) pairs it scores, ``sum(position + 1)`` over its token rows, as
:func:`cpshard.causal.attention_work` and the contiguous balancer count it), the step takes::

    T = max_d sum_{m on d} max_r w(m, r)

and its ideal is ``W / (dp * cp)``, ``W = sum_i tri(n_i)`` (``tri(x) = x (x + 1) / 2``), the total
work, which no partition or order changes. :func:`pack` reports ``T / (W / (dp cp))`` (the **step
ratio**, 1 at best) and a proven lower bound on it (Note [Why no packing beats the bound]).

The **budget**: every micro-batch's padded rows, ``plan.total_len`` (the whole micro-batch, all CP
ranks together, pad rows included), are at most ``max_tokens``. Sequence ``i`` pads to
``P_i = roundup(n_i, a)`` (``a`` the plan's per-sequence alignment) and a micro-batch's total is
rounded up to ``k = lcm(a, cp tp)`` (minimal padding), so the budget is ``sum P_i <= C`` with
``C = floor(max_tokens / k) * k``.

The **search**: the count is the first-fit-decreasing count on the padded lengths (no larger than
what verl's method needs once padding is counted: its count is raised until its partition fits,
and a fitting partition has at least as many parts as the least one), raised to ``min_micro_batches``
and ``divisible_by`` per DP rank. The micro-batches are laid out per DP rank up front, then filled
longest first, each sequence into the micro-batch, among those with room, that raises the step least
(ties: the DP rank with the least work, then the least loaded), scored by a per-micro-batch model:

- zigzag: exact, every sequence's per-rank work depends only on its own padded length (chunks ``r``
  and ``2 cp - 1 - r``), so a micro-batch's is the sum;
- contiguous: ``max(ceil(W_m / cp), max_i h_i)``, ``h_i`` the least heaviest piece of sequence ``i``
  at ``C / cp`` rows per rank (Note [Why no packing beats the bound]): what a good order inside the
  micro-batch reaches when short sequences fill around the long ones. Long documents then share
  micro-batches, where their heavy tails run at once on different ranks.

Then, under zigzag (and at ``cp = 1``), moves and swaps of sequences out of the slowest DP rank's
micro-batches, while the step (and then the sum of squares of the DP ranks' times) falls, stopping
after ``_PATIENCE`` steps in a row that lowered only the sum of squares (each step's candidates are
scored in closed form: only the two DP ranks involved change). Under the contiguous layout the
exact refinement below replaces them: on ``benchmarks/pack.py``'s batches the model's moves left
the final step ratios as they were (cp=4 1.0500 with them, 1.0501 without; cp=8 1.2159, 1.2153;
RL-like 1.0433, 1.0426) and cost about 20 ms at 1024 sequences.

The model ends there: every later step scores exactly (Note [Refining a packing], ``packing.refine``).
Under the contiguous layout every micro-batch's buffer order is chosen by a batched descent from a
longest-first start, and swaps of sequences between micro-batches that lower the sum of the
micro-batches' slowest ranks follow, each scored on both buffers in closed form (with
``reorder="balanced"`` each plan then balances that order further, never ending worse than it).
Last, the micro-batches go to the DP ranks by their exact costs (:func:`cpshard.packing.refine.assign`),
the counts unchanged.

**Groups** (``group_size = g > 1``, verl's ``force_group_size``): the count, the fill and its moves
and swaps place units of ``g`` consecutive sequences (rows, work and zigzag vectors summed, the
contiguous model's heaviest piece the members' largest), so a group never splits. The bound is the
one for single sequences (a grouped packing is one of the packings it covers). The exact refinement
exchanges whole groups instead of single sequences and runs (``Buffers.exchange_groups``); the buffer
orders and the DP split are refined as without.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding, Reorder, sequence_unit
from cpshard.index.balance import _tri, zigzag_works
from cpshard.packing.refine import Buffers, assign
from cpshard.plan.values import ShardPlan
from cpshard.plan.args import parse_seqlens

__all__ = ["Packing", "pack", "packing_bound", "step_ratio"]

_SEARCH_STEPS = 64  # moves / swaps tried on the slowest DP rank, at most
_MOVE_CELLS = 1 << 20  # a step scores moves of at most this many (sequence, micro-batch) pairs: the heaviest first
_ORDER_BUDGET = 1 << 12  # candidate orders the first descent scores, per micro-batch (Note [Refining a packing])
_EXCHANGE_ROUNDS = 8  # exchange rounds at most ...
_EXCHANGE_BUDGET = 1 << 12  # ... and candidate swaps they score, per micro-batch
_FILL_WINDOW = 256  # micro-batches the fill scores for one unit, at most (Search.fill)
_SWAP_UNITS = 1 << 14  # a step scores swaps with at most this many units, evenly spread by size
_PATIENCE = 4  # the search stops after this many steps in a row that lowered only the sum of squares


@dataclasses.dataclass(frozen=True)
class Packing:
    """What :func:`pack` returns.

    - ``micro_batches[d][m]``: the caller's sequence indices of DP rank ``d``'s micro-batch ``m``, in the
      order to pass them to ``ShardPlan.build`` (the buffer order under the contiguous layout).
    - ``plans[d][m]``: that micro-batch's plan (``plans[d][m].total_len <= max_tokens``).
    - ``work[d][m]``: its per-CP-rank causal attention work (``cp_size`` ints).
    - ``step_ratio``: ``max_d sum_m max(work[d][m])`` over ``total_work / (dp_size * cp_size)``.
    - ``lower_bound``: a ratio no packing of these lengths under this budget can beat.
    - ``num_micro_batches``: the micro-batch count of every DP rank (a tuple, ``dp_size`` long).
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    plans: tuple[tuple[ShardPlan, ...], ...]
    work: tuple[tuple[tuple[int, ...], ...], ...]
    step_ratio: float
    lower_bound: float
    num_micro_batches: tuple[int, ...]
    max_tokens: int
    total_work: int

    @property
    def step_work(self) -> int:
        """``max_d sum_m max_r work``: the step's time in (query, key) pairs."""
        return max(sum(max(w) for w in rank) for rank in self.work)


# -- shared arithmetic -----------------------------------------------------------------------------


def _two_piece(n: np.ndarray, local: np.ndarray) -> np.ndarray:
    """``(B,)``: a work some rank holds of sequence ``i`` whatever its offset, at ``local[i]`` rows a rank
    (contiguous): ``min_c max(tri(n) - tri(c), tri(c) - tri(max(c - L, 0)))`` over ``c`` in
    ``[max(0, n - L), n - 1]`` (Note [Why no packing beats the bound], (2))."""
    n = n.astype(np.int64)
    local = np.broadcast_to(np.asarray(local, dtype=np.int64), n.shape)
    lo = np.maximum(0, n - local)
    hi = np.maximum(lo, n - 1)
    tn = _tri(n)

    def tail(c: np.ndarray) -> np.ndarray:
        return tn - _tri(c)

    def head(c: np.ndarray) -> np.ndarray:
        return _tri(c) - _tri(np.maximum(c - local, 0))

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


@dataclasses.dataclass(frozen=True)
class _Problem:
    n: np.ndarray  # (B,) lengths
    p: np.ndarray  # (B,) per-sequence padded lengths
    w: np.ndarray  # (B,) tri(n)
    cp: int
    tp: int
    layout: Layout
    padding: Padding
    keep: int  # a micro-batch's total is a multiple of this
    capacity: int  # sum of P in one micro-batch, at most


def _problem(seqlens: Sequence[int], max_tokens: int, cp: int, tp: int, layout: Layout,
             padding: Padding) -> _Problem:
    unit = sequence_unit(cp, tp, layout, False, padding)
    keep = math.lcm(unit, cp * tp)
    n = np.array(seqlens, dtype=np.int64)
    p = -(-n // unit) * unit
    capacity = max_tokens // keep * keep
    return _Problem(n, p, _tri(n), cp, tp, layout, padding, keep, capacity)


def _by_unit(x: np.ndarray, group: int) -> np.ndarray:
    """``(B / group,)`` the sums of ``x`` over each ``group`` consecutive sequences."""
    return x if group == 1 else x.reshape(-1, group).sum(1)


def _group_rows(prob: _Problem, group: int) -> np.ndarray:
    """``(B / group,)`` the padded rows of a micro-batch holding only group ``k`` (``plan.total_len``;
    0 for an empty sequence alone)."""
    return -(-_by_unit(prob.p, group) // prob.keep) * prob.keep


def _check_fits(prob: _Problem, max_tokens: int, group: int = 1) -> None:
    """A clear error for a batch that does not split into groups, or a sequence (group) that alone
    pads to more than ``max_tokens`` rows."""
    if prob.n.size % group:
        fail("group_size", group, f"must divide the number of sequences ({prob.n.size})",
             "pass a batch of whole groups, or another group_size")
    rows = _group_rows(prob, group)
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


def _filler(prob: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """The most work any set of sequences fits into ``x`` padded rows, relaxed to a fractional knapsack
    (densest first): cumulative rows and work at each breakpoint, for :func:`np.interp`."""
    keep = prob.p > 0
    density = prob.w[keep] / prob.p[keep]
    by = np.argsort(-density, kind="stable")
    rows = np.concatenate([[0], np.cumsum(prob.p[keep][by])]).astype(np.float64)
    work = np.concatenate([[0], np.cumsum(prob.w[keep][by])]).astype(np.float64)
    return rows, work


def _bound_work(prob: _Problem, dp: int) -> int:
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
    spread = (total / cp + _crowded(excess, prob.p, prob.capacity)) / dp
    bound = max(-(-total // (dp * cp)), int(heavy_min.max()), math.ceil(spread * (1 - 1e-12)) - 1)
    return bound


def _crowded(excess: np.ndarray, rows: np.ndarray, capacity: int) -> float:
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


def _heaviest(prob: _Problem, local: np.ndarray) -> np.ndarray:
    """``(B,)`` a work the most loaded rank of any micro-batch with ``local`` rows a rank holding sequence
    ``i`` has at least (parts (2) and (3) of Note [Why no packing beats the bound])."""
    if prob.cp == 1:
        return prob.w.astype(np.float64)
    if prob.layout is Layout.ZIGZAG:
        if prob.padding is Padding.ALIGNED:
            return zigzag_works(prob.n, prob.p, prob.cp).max(1).astype(np.float64)
        return -(-prob.w // prob.cp).astype(np.float64)
    return _two_piece(prob.n, local).astype(np.float64)


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
       ``c_m`` is at least the least over ``c`` of the larger (``_two_piece``). That least grows with
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
       the ``k`` largest, ``sum_m max e >= sum_k (e_(k) - e_(k+1)) ceil(R_k / C)`` (``_crowded``; the
       first version took ``R(t) / C``, the fraction, which misses that one long document's excess is
       paid whole by its micro-batch). Hence ``T >= (W / cp + sum_k (e_(k) - e_(k+1)) ceil(R_k / C)) / dp``.

    ``T`` is an integer; the bound is the ceiling of the largest of the three (minus one unit
    against float rounding in (3)), over ``W / (dp cp)``. It ignores the count and DP-agreement
    rules, so it holds for every packing :func:`pack` may return. It is tight when no
    sequence's heaviest piece dominates its micro-batch (zigzag: usually within a few percent) and
    loose when long documents could share micro-batches only fractionally.
    """
    max_tokens, cp_size, tp_size = _sizes(max_tokens, cp_size, tp_size)
    dp_size = check_int("dp_size", dp_size, minimum=1)
    lens = _lengths(seqlens)
    prob = _problem(lens, max_tokens, cp_size, tp_size, Layout.parse(layout), Padding.parse(padding))
    _check_fits(prob, max_tokens)
    return _as_ratio(_bound_work(prob, dp_size), int(prob.w.sum()), dp_size, cp_size)


def _as_ratio(step: int, total: int, dp: int, cp: int) -> float:
    return 1.0 if total == 0 else step * dp * cp / total


def step_ratio(work: Sequence[Sequence[Sequence[int]]], cp_size: int) -> float:
    """``max_d sum_m max_r work[d][m][r]`` over ``sum(work) / (dp cp)``: the step ratio of per-rank works."""
    total = sum(sum(w) for rank in work for w in rank)
    step = max(sum(max(w) for w in rank) for rank in work)
    return _as_ratio(step, total, len(work), cp_size)


# -- the search -------------------------------------------------------------------------------------


_ROWS = 2**31  # a plan holds fewer rows (int32 offsets, as Megatron and TransformerEngine take them)
_WORK = 2**62  # the batch's causal work stays below it: every sum of works fits an int64


def _lengths(seqlens: Any) -> list[int]:
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


def _sizes(max_tokens: Any, cp_size: Any, tp_size: Any) -> tuple[int, int, int]:
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


def _ffd_count(p: np.ndarray, capacity: int) -> int:
    """First-fit decreasing on the padded lengths: the bins it opens.

    Equal sizes at once: first fit puts a run of ``k`` items of size ``s`` into the open bins from the
    left, each bin taking ``floor(room / s)`` of them until the run ends, and opens new bins of
    ``floor(C / s)`` for the rest, so a run costs a few array operations over the open bins, not ``k``
    scans of them (``O(distinct sizes x bins)`` element operations instead of ``O(n x bins)`` Python
    steps). The count is first fit's, item by item.
    """
    sizes, runs = np.unique(p, return_counts=True)
    room = np.zeros(0, dtype=np.int64)  # the open bins' free rows, in the order they opened
    for s, k in zip(sizes[::-1].tolist(), runs[::-1].tolist()):
        if s == 0:  # fits the first bin, or opens one
            if not room.size:
                room = np.array([capacity], dtype=np.int64)
            continue
        take = room // s
        placed = np.cumsum(take)
        if placed.size and placed[-1] >= k:
            last = int(np.searchsorted(placed, k))  # the bin where the run ends
            take[last] -= int(placed[last]) - k
            take[last + 1:] = 0
            room -= take * s
            continue
        room -= take * s
        left = k - (int(placed[-1]) if placed.size else 0)
        per = capacity // s
        full, rest = divmod(left, per)
        room = np.concatenate([room, np.full(full, capacity - per * s, dtype=np.int64),
                               np.array([capacity - rest * s] if rest else [], dtype=np.int64)])
    return max(1, room.size)


def _counts(total: int, dp: int, least: int, by: int, same: bool, num_seqs: int, group: int = 1) -> list[int]:
    """Micro-batches per DP rank: at least ``least`` each, multiples of ``by``, together ``>= total``."""
    if same:
        k = max(least, -(-total // dp))
        k = -(-k // by) * by
        counts = [k] * dp
    else:
        units = max(dp * (-(-least // by)), -(-total // by))
        counts = [by * (units // dp + (d < units % dp)) for d in range(dp)]
    if sum(counts) > num_seqs:
        what = f"{num_seqs} sequences" if group == 1 else f"{num_seqs} groups of {group}"
        fail("seqlens", what, f"cannot fill {sum(counts)} micro-batches ({counts} per DP rank: "
             f"at least {least} each, a multiple of divisible_by={by}"
             + (", the same on every DP rank" if same else "") + "), and a micro-batch holds at least one"
             + ("" if group == 1 else " group"), _fewer_counts_fix(total, dp, least, by, same, num_seqs))
    return counts


def _fewer_counts_fix(total: int, dp: int, least: int, by: int, same: bool, num_seqs: int) -> str:
    """The changes that can bring :func:`_counts` to at most ``num_seqs`` micro-batches, and only those:
    a larger ``max_tokens`` helps only while first-fit's count (``total``) is what sets the counts, i.e.
    when even one micro-batch for the whole batch would leave few enough."""
    fixes = ["pass more sequences"]
    if dp > 1:
        fixes.append("a smaller dp_size")
    if least > 1:
        fixes.append("a smaller min_micro_batches")
    if by > 1:
        fixes.append("a smaller divisible_by")
    if same and dp > 1 and sum(_counts(total, dp, least, by, False, 1 << 62)) <= num_seqs:
        fixes.append("same_count_across_dp=False")
    if total > 1 and sum(_counts(1, dp, least, by, same, 1 << 62)) <= num_seqs:
        fixes.append("a larger max_tokens")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1] if len(fixes) > 1 else fixes[0]


class RoomTree:
    """The leftmost bin with at least ``s`` free rows in ``O(log K)``: a max segment tree over the free
    rows of ``K`` bins (``room`` ``(K,)``), kept as a Python list (scalar steps are faster there).

    >>> t = RoomTree(np.array([3, 8, 5]))
    >>> t.first(4), t.first(9)
    (1, -1)
    >>> t.take(1, 6); t.first(4)
    2
    """

    def __init__(self, room: np.ndarray) -> None:
        k = int(room.size)
        self.leaves = 1 << max(0, (k - 1).bit_length())
        tree = np.full(2 * self.leaves, -1, dtype=np.int64)
        tree[self.leaves:self.leaves + k] = room
        level = self.leaves
        while level > 1:  # each level's parents from its children, one level at a time
            tree[level // 2:level] = np.maximum(tree[level:2 * level:2], tree[level + 1:2 * level:2])
            level //= 2
        self.tree: list[int] = tree.tolist()

    def first(self, s: int) -> int:
        """The leftmost bin with at least ``s`` free rows, -1 if none."""
        t = self.tree
        if t[1] < s:
            return -1
        i = 1
        while i < self.leaves:
            i = 2 * i if t[2 * i] >= s else 2 * i + 1
        return i - self.leaves

    def take(self, b: int, s: int) -> None:
        """Bin ``b`` loses ``s`` free rows."""
        t = self.tree
        i = b + self.leaves
        t[i] -= s
        i //= 2
        while i:
            t[i] = max(t[2 * i], t[2 * i + 1])
            i //= 2


class _Search:
    """Micro-batches laid out per DP rank, filled and improved under the per-micro-batch model.

    It places **units**: ``group`` consecutive sequences that share a micro-batch (one sequence each
    when ``group`` is 1), with the members' rows, work and model vectors summed and their heaviest
    pieces' largest as the unit's. Arrays over micro-batches: rows, the model's additive part ``acc``
    (zigzag: per-rank work; contiguous: total work), the largest heaviest piece ``h1`` (contiguous; 0
    under zigzag) and the cost. :meth:`improve` runs only for the additive model (zigzag, ``cp = 1``):
    under the contiguous layout the exact refinement follows the fill."""

    def __init__(self, prob: _Problem, counts: list[int], seed: int, group: int = 1) -> None:
        self.prob = prob
        self.owner = np.repeat(np.arange(len(counts)), counts)  # micro-batch -> DP rank
        self.dp = len(counts)
        k = len(self.owner)
        cp = prob.cp
        if prob.layout is Layout.ZIGZAG or cp == 1:
            vec = zigzag_works(prob.n, prob.p, cp)  # (B, cp): additive and exact
            heavy = np.zeros(prob.n.size, dtype=np.int64)
            self.contiguous = False
        else:
            vec = prob.w[:, None]
            heavy = _two_piece(prob.n, np.full(prob.n.shape, prob.capacity // cp))
            self.contiguous = True
        self.p, self.w = _by_unit(prob.p, group), _by_unit(prob.w, group)
        self.vec = vec.reshape(-1, group, vec.shape[1]).sum(1)
        self.heavy = heavy.reshape(-1, group).max(1)
        self.where = np.full(self.p.size, -1, dtype=np.int64)  # unit -> micro-batch
        self.rng = np.random.default_rng(seed)
        self.acc = np.zeros((k, self.vec.shape[1]), dtype=np.int64)
        self.rows = np.zeros(k, dtype=np.int64)
        self.size = np.zeros(k, dtype=np.int64)
        self.h1 = np.zeros(k, dtype=np.int64)
        self.cost = np.zeros(k, dtype=np.int64)

    def _put(self, i: int, b: int) -> None:
        old = int(self.where[i])
        self.where[i] = b
        for m in {old, b} - {-1}:
            self._refresh(m)

    def _refresh(self, b: int) -> None:
        ids = np.flatnonzero(self.where == b)
        self.size[b] = ids.size
        self.acc[b] = self.vec[ids].sum(0)
        self.rows[b] = int(self.p[ids].sum())
        self.h1[b] = self.heavy[ids].max(initial=0)
        acc = self.acc[b]
        self.cost[b] = max(-(-int(acc[0]) // self.prob.cp), int(self.h1[b])) if self.contiguous else int(acc.max())

    def times(self) -> np.ndarray:
        return np.bincount(self.owner, weights=self.cost, minlength=self.dp).astype(np.int64)

    def fill(self) -> bool:
        """Longest first into the micro-batch that raises the step least; False if one did not fit.

        The micro-batches are scored in **windows** of at most ``_FILL_WINDOW``: with ``G`` windows,
        micro-batch ``b`` is in window ``b mod G`` (so each window holds every DP rank's share) and the
        ``j``-th unit longest first goes to window ``j mod G`` (each window gets a like sample of the
        batch); the DP ranks' times are shared by all windows. A unit costs ``O(_FILL_WINDOW)``, not
        ``O(micro-batches)``: the fill is linear in the batch. A unit its window has no room for is
        placed after the windows, scored over every micro-batch. With one window (up to
        ``_FILL_WINDOW`` micro-batches, every batch of ``benchmarks/pack.py``) it is the plain fill.
        """
        key = self.heavy if self.contiguous else self.vec.max(1)
        units = np.lexsort((np.arange(self.p.size), -self.p, -key))
        k = self.owner.size
        windows = -(-k // _FILL_WINDOW)
        times = np.zeros(self.dp, dtype=np.int64)
        left: list[np.ndarray] = []
        for g in range(windows):
            left.append(self._fill(units[g::windows], np.arange(g, k, windows), times))
        rest = np.concatenate(left)
        return rest.size == 0 or self._fill(np.sort(rest), np.arange(k), times).size == 0

    def _fill(self, units: np.ndarray, bins: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Place ``units`` (in this order) into the micro-batches ``bins`` (sorted), each where the step
        rises least (ties: the least raise, then the least loaded DP rank, then the fewest rows);
        ``times`` ``(dp,)`` the DP ranks' model times, updated. Returns the units that found no room."""
        prob, cp = self.prob, self.prob.cp
        big = np.iinfo(np.int64).max
        owner = self.owner[bins]
        rows, cost, size, h1 = self.rows[bins], self.cost[bins], self.size[bins], self.h1[bins]
        acc = np.ascontiguousarray(self.acc[bins].T)  # (cp, bins): a unit's new maxima reduce over rows
        tot = acc[0].copy()  # the contiguous model's total work, 1-D (written back at the end)
        limit = prob.capacity - self.p  # a micro-batch takes unit i while its rows are at most this
        members = [np.flatnonzero(owner == d) for d in range(self.dp)]
        base = times[owner] - cost  # the step a micro-batch's DP rank takes without it
        vec, heavy, contiguous = self.vec, self.heavy, self.contiguous
        score = np.empty_like(base)
        missed: list[int] = []
        for i in units.tolist():
            if contiguous:
                new = tot + vec[i, 0]
                new += cp - 1
                new //= cp  # the new total's share of one rank, rounded up
                np.maximum(new, h1, out=new)
                np.maximum(new, heavy[i], out=new)
            else:
                new = (acc + vec[i][:, None]).max(0)
            np.add(base, new, out=score)
            score[rows > limit[i]] = big
            b = int(score.argmin())
            low = score[b]
            if low == big:
                missed.append(i)
                continue
            ties = (score == low).nonzero()[0]
            if ties.size > 1:
                raise_ = new[ties] - cost[ties]
                b = int(ties[np.lexsort((rows[ties], times[owner[ties]], raise_))[0]])
            d, delta = int(owner[b]), int(new[b] - cost[b])
            if delta:
                base[members[d]] += delta
                base[b] -= delta
                times[d] += delta
                cost[b] += delta
            self.where[i] = bins[b]
            if contiguous:
                tot[b] += vec[i, 0]
            else:
                acc[:, b] += vec[i]
            rows[b] += self.p[i]
            size[b] += 1
            h1[b] = max(h1[b], heavy[i])
        if contiguous:
            acc[0] = tot
        self.rows[bins], self.cost[bins], self.size[bins], self.h1[bins], self.acc[bins] = rows, cost, size, h1, acc.T
        return np.array(missed, dtype=np.int64)

    def first_fit(self) -> None:
        """First-fit decreasing into the laid-out micro-batches (always fits: at least FFD's count), each
        unit's micro-batch found in ``O(log micro-batches)`` (:class:`RoomTree`)."""
        self.where[:] = -1
        tree = RoomTree(np.full(self.owner.size, self.prob.capacity, dtype=np.int64))
        for i in np.lexsort((np.arange(self.p.size), -self.p)).tolist():
            b = tree.first(int(self.p[i]))
            self.where[i] = b
            tree.take(b, int(self.p[i]))
        self._refresh_all()

    def _refresh_all(self) -> None:
        """Every micro-batch's arrays from ``where`` at once (``_refresh`` for all, ``O(units + micro-batches)``)."""
        k = self.owner.size
        self.size[:] = np.bincount(self.where, minlength=k)
        self.rows[:] = np.bincount(self.where, weights=self.p, minlength=k).astype(np.int64)
        self.acc[:] = 0
        np.add.at(self.acc, self.where, self.vec)
        self.h1[:] = 0
        np.maximum.at(self.h1, self.where, self.heavy)
        if self.contiguous:
            self.cost[:] = np.maximum(-(-self.acc[:, 0] // self.prob.cp), self.h1)
        else:
            self.cost[:] = self.acc.max(1)

    def fill_empty(self) -> None:
        """Every micro-batch holds a sequence: the lightest one of the most populated micro-batch moves."""
        for b in np.flatnonzero(self.size == 0).tolist():
            a = int(np.argmax(self.size))
            ids = np.flatnonzero(self.where == a)
            self._put(int(ids[np.argmin(self.w[ids])]), b)

    def improve(self, steps: int = _SEARCH_STEPS) -> None:
        """Moves and swaps out of the slowest DP rank's micro-batches while (step, sum of squares) falls
        (the additive model only: a micro-batch's cost is its largest rank of ``acc``)."""
        assert not self.contiguous, "the contiguous layout is refined exactly instead (Note [Micro-batch packing])"
        p, cp_cap = self.p, self.prob.capacity
        stale, low = 0, int(self.times().max())
        for _ in range(steps):
            times = self.times()
            if int(times.max()) < low:
                stale, low = 0, int(times.max())
            elif stale >= _PATIENCE:
                return
            stale += 1
            cur = (int(times.max()), int((times ** 2).sum()))
            slow = int(times.argmax())
            seqs = np.flatnonzero(self.owner[self.where] == slow)
            most = max(16, _MOVE_CELLS // self.owner.size)  # the step's memory and time stay O(_MOVE_CELLS)
            if seqs.size > most:  # only past it (a large batch): the heaviest units, in index order
                seqs = np.sort(seqs[np.argsort(-self.vec[seqs].max(1), kind="stable")[:most]])
            a = self.where[seqs]
            best: tuple[tuple[int, int], int, int, int] | None = None
            # moves i -> b (a: the micro-batch each loses a sequence from)
            cost_b = (self.acc[None, :, :] + self.vec[seqs][:, None, :]).max(-1)
            cost_a = (self.acc[a] - self.vec[seqs]).max(-1)
            ok = (self.rows[None, :] + p[seqs][:, None] <= cp_cap) & (self.size[a] > 1)[:, None]
            ok[np.arange(seqs.size), a] = False
            best = self._best(seqs, a, cost_a, np.broadcast_to(np.arange(self.owner.size), ok.shape), cost_b,
                              None, ok, times, cur, best)
            # swaps i <-> j for the heaviest sequences of the slow rank
            top = seqs[np.argsort(-self.vec[seqs].max(1), kind="stable")[:16]]
            if top.size:
                ta = self.where[top]
                j = np.arange(p.size)
                if j.size > _SWAP_UNITS:  # a large batch: units evenly spread from the largest to the smallest
                    by = np.lexsort((j, -self.vec.max(1)))
                    j = np.sort(by[np.linspace(0, j.size - 1, _SWAP_UNITS).round().astype(np.int64)])
                bj = self.where[j]
                ok = ((self.rows[ta][:, None] - p[top][:, None] + p[j][None, :] <= cp_cap)
                      & (self.rows[bj][None, :] - p[j][None, :] + p[top][:, None] <= cp_cap)
                      & (bj[None, :] != ta[:, None]))
                if ok.any():
                    cost_a2 = (self.acc[ta][:, None, :] - self.vec[top][:, None, :] + self.vec[j][None, :, :]).max(-1)
                    cost_b2 = (self.acc[bj][None, :, :] - self.vec[j][None, :, :] + self.vec[top][:, None, :]).max(-1)
                    best = self._best(top, ta, cost_a2, np.broadcast_to(bj, ok.shape), cost_b2,
                                      np.broadcast_to(j, ok.shape), ok, times, cur, best)
            if best is None:
                return
            _, i, b, j_ = best
            a_i = int(self.where[i])
            self._put(i, b)
            if j_ >= 0:
                self._put(j_, a_i)

    def _best(self, seqs: np.ndarray, a: np.ndarray, cost_a: np.ndarray, b: np.ndarray, cost_b: np.ndarray,
              j: np.ndarray | None, ok: np.ndarray, times: np.ndarray, cur: tuple[int, int],
              best: tuple[tuple[int, int], int, int, int] | None) -> tuple[tuple[int, int], int, int, int] | None:
        """The best candidate (i from ``a`` to ``b``, j back) that lowers ``(step, sum of squares)``."""
        if not ok.any():
            return best
        da = cost_a - (self.cost[a] if cost_a.ndim == 1 else self.cost[a][:, None])
        da = np.broadcast_to(da[:, None] if da.ndim == 1 else da, ok.shape)
        db = cost_b - self.cost[b]
        oa = np.broadcast_to(self.owner[a][:, None], ok.shape)
        ob = self.owner[b]
        same = oa == ob
        # only the two owners' times change: the new max is theirs or the largest of the others (the top
        # three times cover every pair left out), the sum of squares changes by their two terms
        top = np.argsort(-times, kind="stable")[:3]
        vals = np.full(3, -1, dtype=np.int64)
        vals[:top.size] = times[top]
        ranks = np.full(3, -1, dtype=np.int64)
        ranks[:top.size] = top
        other = np.full(ok.shape, -1, dtype=np.int64)
        for k in range(2, -1, -1):  # the first of the top three that is neither owner
            free = (ranks[k] != oa) & (ranks[k] != ob) & (ranks[k] >= 0)
            other = np.where(free, vals[k], other)
        ta = times[oa] + da + np.where(same, db, 0)
        tb = np.where(same, -1, times[ob] + db)
        mx = np.maximum(np.maximum(ta, tb), other)
        t64 = times.astype(np.float64)
        sq = (float((t64 ** 2).sum()) - t64[oa] ** 2 + ta.astype(np.float64) ** 2
              + np.where(same, 0.0, tb.astype(np.float64) ** 2 - t64[ob] ** 2))
        big = np.iinfo(np.int64).max
        mx = np.where(ok, mx, big)
        low = mx.min()
        flat = int(np.argmin(np.where(mx == low, sq, np.inf).ravel()))
        r, c = np.unravel_index(flat, ok.shape)
        key = (int(mx[r, c]), int(sq[r, c]))
        if not ok[r, c] or key >= cur or (best is not None and key >= best[0]):
            return best
        return key, int(seqs[r]), int(b[r, c]), -1 if j is None else int(j[r, c])


def _refined(prob: _Problem, groups: list[list[int]], group: int = 1) -> tuple[list[list[int]], np.ndarray | None]:
    """Each micro-batch's buffer order and, under the contiguous layout, its exact per-rank work
    ``(K, cp)`` (Note [Refining a packing]); otherwise sorted orders and None (:func:`pack` reads
    the works from the plans, whose last sequence minimal padding may extend). With ``group > 1``
    the exchanges move whole groups."""
    if prob.layout is Layout.CONTIGUOUS and prob.cp > 1:
        buffers = Buffers(prob.n, prob.p, prob.keep, prob.cp, prob.capacity, groups)
        buffers.start()
        buffers.descend(np.arange(len(groups)), _ORDER_BUDGET * len(groups))
        if group == 1:
            buffers.exchange(_EXCHANGE_ROUNDS, _EXCHANGE_BUDGET * len(groups))
        else:
            buffers.exchange_groups(group, _EXCHANGE_ROUNDS, _EXCHANGE_BUDGET * len(groups))
        return buffers.orders(), buffers.works
    return [sorted(g) for g in groups], None


def plan_work(plan: ShardPlan) -> list[int]:
    """Per CP rank, ``sum(position + 1)`` over its token rows: :func:`cpshard.causal.attention_work`, the
    one work model (the search's additive per-sequence vectors, ``_zigzag_work`` and the contiguous
    balancer's tables, are its closed forms; ``tests/test_pack.py`` checks they agree)."""
    from cpshard.plan.causal import attention_work
    return attention_work(plan)


def pack(
    seqlens: Sequence[int],
    *,
    max_tokens: int,
    cp_size: int,
    tp_size: int = 1,
    layout: Layout | str = "zigzag",
    dp_size: int = 1,
    padding: Padding | str = "aligned",
    reorder: Reorder | str | None = None,
    min_micro_batches: int | None = None,
    divisible_by: int | None = None,
    same_count_across_dp: bool = True,
    group_size: int = 1,
    seed: int = 0,
) -> Packing:
    """Split a global batch into micro-batches per DP rank whose padded rows fit ``max_tokens`` and whose
    step time (Note [Micro-batch packing]) is low.

    ``seqlens`` ``(B,)`` the global batch's token counts (every rank holding them gets the same
    result: no collective). ``max_tokens``: the most padded rows of one micro-batch, all CP ranks
    together (``plan.total_len``; a rank holds ``total_len / cp_size``). ``cp_size``, ``tp_size``,
    ``layout``, ``padding``, ``reorder`` are :meth:`ShardPlan.build`'s, for every micro-batch.
    ``dp_size`` DP ranks; ``min_micro_batches`` and ``divisible_by`` (the virtual pipeline size)
    apply to every DP rank's count; ``same_count_across_dp`` gives every DP rank the same count
    (verl's ``same_micro_num_in_dp``), else the counts may differ by ``divisible_by``.
    ``group_size``: every ``group_size`` consecutive sequences (``seqlens[k g:(k + 1) g]``) share one
    micro-batch, such as a reward model's chosen and rejected responses (verl's ``force_group_size``);
    the number of sequences must be a multiple of it (under the contiguous layout the refinement then
    exchanges whole groups between micro-batches: Note [Refining a packing]). ``seed`` breaks ties in
    the search (the result is deterministic for a seed).

    Every sequence is in exactly one micro-batch; a sequence (or group) whose padded length alone
    exceeds ``max_tokens`` is an error naming it. The count is first-fit decreasing's on the padded
    lengths, raised by the count rules. See :class:`Packing` for the result and
    :func:`packing_bound` for ``lower_bound``.

    >>> p = pack([5, 3, 8, 2], max_tokens=16, cp_size=2)
    >>> p.num_micro_batches, sorted(i for mb in p.micro_batches[0] for i in mb)
    ((2,), [0, 1, 2, 3])
    >>> all(plan.total_len <= 16 for plan in p.plans[0])
    True
    """
    lens = _lengths(seqlens)
    max_tokens, cp_size, tp_size = _sizes(max_tokens, cp_size, tp_size)
    dp_size = check_int("dp_size", dp_size, minimum=1)
    seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)  # NumPy's seeds
    group = check_int("group_size", group_size, minimum=1)
    least = 1 if min_micro_batches is None else check_int("min_micro_batches", min_micro_batches, minimum=1)
    by = 1 if divisible_by is None else check_int("divisible_by", divisible_by, minimum=1)
    if not isinstance(same_count_across_dp, bool):
        fail("same_count_across_dp", repr(same_count_across_dp), "must be a bool", "pass True or False",
             kind=TypeError)
    layout = Layout.parse(layout)
    padding = Padding.parse(padding)
    if reorder is not None:
        reorder = Reorder.parse(reorder)
        if layout is not Layout.CONTIGUOUS:
            fail("reorder", repr(reorder.value), f"balances the contiguous layout (layout={layout.value!r})",
                 "pass layout='contiguous', or drop reorder")
    prob = _problem(lens, max_tokens, cp_size, tp_size, layout, padding)
    _check_fits(prob, max_tokens, group)
    units = len(lens) // group
    counts = _counts(_ffd_count(_by_unit(prob.p, group), prob.capacity), dp_size, least, by, same_count_across_dp,
                     units, group)
    search = _Search(prob, counts, seed, group)
    if not search.fill():
        search.first_fit()
    search.fill_empty()
    if not search.contiguous:  # under the contiguous layout the exact refinement follows (Note [Micro-batch packing])
        search.improve()
    members = np.arange(len(lens)).reshape(units, group)
    groups = [members[search.where == b].reshape(-1).tolist() for b in range(search.owner.size)]
    orders, works = _refined(prob, groups, group)
    built = [ShardPlan.build([lens[i] for i in ids], cp_size=cp_size, tp_size=tp_size, layout=layout,
                             padding=padding, reorder=reorder) for ids in orders]
    if works is None or reorder is not None:  # zigzag's closed form, or a plan that balanced its order further
        works = np.array([plan_work(plan) for plan in built], dtype=np.int64)
    owner = assign(works.max(1), counts)
    micro: list[list[tuple[int, ...]]] = [[] for _ in counts]
    plans: list[list[ShardPlan]] = [[] for _ in counts]
    work: list[list[tuple[int, ...]]] = [[] for _ in counts]
    for b, ids in enumerate(orders):
        d = int(owner[b])
        micro[d].append(tuple(ids))
        plans[d].append(built[b])
        work[d].append(tuple(works[b].tolist()))
    total = int(prob.w.sum())
    return Packing(
        micro_batches=tuple(tuple(m) for m in micro),
        plans=tuple(tuple(p) for p in plans),
        work=tuple(tuple(w) for w in work),
        step_ratio=step_ratio(work, cp_size),
        lower_bound=_as_ratio(_bound_work(prob, dp_size), total, dp_size, cp_size),
        num_micro_batches=tuple(counts),
        max_tokens=max_tokens,
        total_work=total,
    )
