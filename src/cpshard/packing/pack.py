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

**Cost.** Every step's effort is bounded per sequence or per micro-batch, never by a clock, so every
DP rank computes the same packing: the fill scores a sequence against at most ``FILL_WINDOW`` (256)
micro-batches (``packing.search``: windows that each hold every DP rank's share and a like sample of
the batch; a batch of at most 256 micro-batches is one window, the plain fill), first fit finds its
bin in ``O(log K)`` (``RoomTree``), the moves and swaps below score at most ``2**16`` cells and
``2**12`` swap partners a step, an exchange round of the refinement looks at the top micro-batches
and at most 128 partners (8 rounds up to ``cp = 4``, ``32 / cp`` past it, at least 1), and the DP
split's swaps take one ``searchsorted`` per DP rank each. The time is then linear in the batch up to a
log (``benchmarks/pack.py --sweep``). An exact candidate costs ``cp - 1`` boundary lookups, so past
``cp = 8`` the refinement scores fewer of them, keeping (candidates x boundaries) about what it is at
``cp = 8``: fewer top micro-batches and partners a round, a coarser grid for the descent (Note
[Refining a packing]) and, from ``cp = 32``, one round; at ``cp = 64`` on 1,024 sequences this took the
time from 2.1 s to under 0.2 s for a step ratio 0.8% higher (1.932 against 1.916; verl's partition: 3.51).

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
Last, the micro-batches go to the DP ranks by their exact costs (:func:`cpshard.packing.assign.assign`),
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
import functools
from collections.abc import Sequence

import numpy as np

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding, Reorder
from cpshard.packing.assign import assign
from cpshard.packing.bound import bound_work, packing_bound
from cpshard.packing.problem import Problem, as_ratio, by_unit, check_fits, checked_lengths, checked_sizes, make_problem
from cpshard.packing.refine import Buffers
from cpshard.packing.search import Search, ffd_count, micro_batch_counts
from cpshard.plan.values import ShardPlan

__all__ = ["Packing", "pack", "packing_bound", "plan_work", "step_ratio"]

_ORDER_BUDGET = 1 << 12  # candidate orders the first descent scores, per micro-batch (Note [Refining a packing])
_EXCHANGE_ROUNDS = 8  # exchange rounds at most (at cp <= _EXCHANGE_CP; fewer past it) ...
_EXCHANGE_CP = 4  # ... each candidate costs cp - 1 boundary lookups: the rounds times cp stay at most 8 x 4 (1 round least)
_EXCHANGE_BUDGET = 1 << 12  # ... and candidate swaps they score, per micro-batch


@dataclasses.dataclass(frozen=True)
class Packing:
    """What :func:`pack` returns.

    - ``micro_batches[d][m]``: the caller's sequence indices of DP rank ``d``'s micro-batch ``m``, in the
      order to pass them to ``ShardPlan.build`` (the buffer order under the contiguous layout).
    - ``plans[d][m]``: that micro-batch's plan (``plans[d][m].total_len <= max_tokens``).
    - ``work[d][m]``: its per-CP-rank causal attention work (``cp_size`` ints).
    - ``step_ratio``: ``max_d sum_m max(work[d][m])`` over ``total_work / (dp_size * cp_size)``.
    - ``lower_bound``: a ratio no packing of these lengths under this budget can beat (found when first
      read, then kept: most callers never read it, and its search takes about 5% of ``pack``'s time).
    - ``num_micro_batches``: the micro-batch count of every DP rank (a tuple, ``dp_size`` long).
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    plans: tuple[tuple[ShardPlan, ...], ...]
    work: tuple[tuple[tuple[int, ...], ...], ...]
    step_ratio: float
    num_micro_batches: tuple[int, ...]
    max_tokens: int
    total_work: int
    _problem: Problem = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def lower_bound(self) -> float:
        """A ratio no packing of these lengths under this budget can beat (:func:`packing_bound`)."""
        return as_ratio(bound_work(self._problem, len(self.num_micro_batches)), self.total_work,
                        len(self.num_micro_batches), self._problem.cp)

    @property
    def step_work(self) -> int:
        """``max_d sum_m max_r work``: the step's time in (query, key) pairs."""
        return max(sum(max(w) for w in rank) for rank in self.work)


def step_ratio(work: Sequence[Sequence[Sequence[int]]], cp_size: int) -> float:
    """``max_d sum_m max_r work[d][m][r]`` over ``sum(work) / (dp cp)``: the step ratio of per-rank works."""
    total = sum(sum(w) for rank in work for w in rank)
    step = max(sum(max(w) for w in rank) for rank in work)
    return as_ratio(step, total, len(work), cp_size)


def _refined(prob: Problem, groups: list[list[int]], group: int = 1) -> tuple[list[list[int]], np.ndarray | None]:
    """Each micro-batch's buffer order and, under the contiguous layout, its exact per-rank work
    ``(K, cp)`` (Note [Refining a packing]); otherwise sorted orders and None (:func:`pack` reads
    the works from the plans, whose last sequence minimal padding may extend). With ``group > 1``
    the exchanges move whole groups."""
    if prob.layout is Layout.CONTIGUOUS and prob.cp > 1:
        buffers = Buffers(prob.n, prob.p, prob.keep, prob.cp, prob.capacity, groups)
        buffers.start()
        buffers.descend(np.arange(len(groups)), _ORDER_BUDGET * len(groups))
        rounds = max(1, _EXCHANGE_ROUNDS * _EXCHANGE_CP // max(prob.cp, _EXCHANGE_CP))
        if group == 1:
            buffers.exchange(rounds, _EXCHANGE_BUDGET * len(groups))
        else:
            buffers.exchange_groups(group, rounds, _EXCHANGE_BUDGET * len(groups))
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
    lens = checked_lengths(seqlens)
    max_tokens, cp_size, tp_size = checked_sizes(max_tokens, cp_size, tp_size)
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
    prob = make_problem(lens, max_tokens, cp_size, tp_size, layout, padding)
    check_fits(prob, max_tokens, group)
    units = len(lens) // group
    counts = micro_batch_counts(ffd_count(by_unit(prob.p, group), prob.capacity), dp_size, least, by,
                                same_count_across_dp, units, group)
    search = Search(prob, counts, seed, group)
    if not search.fill():
        search.first_fit()
    search.fill_empty()
    if not search.contiguous:  # under the contiguous layout the exact refinement follows (Note [Micro-batch packing])
        search.improve()
    by_mb = np.argsort(search.where, kind="stable")  # units by micro-batch, in index order within each
    cuts = np.cumsum(np.bincount(search.where, minlength=search.owner.size))[:-1]
    members = np.arange(len(lens)).reshape(units, group)
    groups = [members[ids].reshape(-1).tolist() for ids in np.split(by_mb, cuts)]
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
        num_micro_batches=tuple(counts),
        max_tokens=max_tokens,
        total_work=total,
        _problem=prob,
    )
