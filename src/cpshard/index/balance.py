"""Balanced contiguous order: permute a micro-batch's sequences so causal attention work is even.

Pure index math on NumPy int64 arrays and Python ints; no communication, no plan. NumPy, not torch,
like the rest of the host-side index math (plans, packing, refinement): one array library, whose
calls run on the calling thread, so the cost does not depend on ``torch.set_num_threads`` or
``OMP_NUM_THREADS`` (torch's kernels fork and join its thread pool on arrays past a few thousand
elements, which the descent's candidate matrices are; ``benchmarks/scale.py`` prints the rows). Only
the kicks' random swaps draw from a seeded ``torch.Generator``, a handful of scalars per kick.

Note [Causal work under the contiguous layout]
----------------------------------------------
Under the contiguous layout (SPEC, "Which rows a rank holds") the padded sequences are concatenated
in some ``order`` (``order[j]`` is the sequence at buffer position ``j``) and rank ``r`` holds the
global rows ``[r L, (r + 1) L)``, ``L = sum(padded) / cp``. A token at position ``p`` of its sequence
attends to ``p + 1`` keys, pad rows do no work, so with ``tri(x) = x (x + 1) / 2`` the positions
``[s, e)`` of a sequence of length ``n`` cost ``tri(min(e, n)) - tri(min(s, n))``.

Let ``G(x)`` be the work of the first ``x`` rows of the buffer. If row ``x`` falls in the sequence at
buffer position ``j`` (it starts at row ``S_j``), ``G(x) = sum_{t<j} tri(n_{o_t}) + tri(min(n_{o_j}, x - S_j))``:
one ``cumsum`` over the batch and one ``searchsorted`` per rank boundary. Rank ``r``'s work is
``G((r + 1) L) - G(r L)``; the total ``W = sum tri(n_i)`` does not depend on the order, so balancing
means keeping the boundary values ``G(r L)`` close to ``r W / cp``.

Worked example, lengths ``[5, 3]`` padded to ``[6, 4]``, ``cp = 2`` (``L = 5``)::

    order (0, 1): rows  s0p0..s0p4 | s0pad s1p0 s1p1 s1p2 s1pad   work 15 | 6   max/mean 1.43
    order (1, 0): rows  s1p0..s1pad s0p0 | s0p1..s0p4 s0pad        work 7 | 14   max/mean 1.33
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import fail
from cpshard.index.segments import zigzag_bounds

__all__ = ["balanced_order", "balanced_permutation", "longest_first", "longest_first_runs", "order_score", "rank_work",
           "simple_work_bound", "spread_positions", "tri", "work_lower_bound", "zigzag_works"]

_I64 = np.dtype(np.int64)
_FULL_SEARCH = 40  # up to this many sequences the descent tries every insertion and swap
_LARGE = 256  # past this many the descent gets an eighth of the budget
_STEP_ROWS = 1 << 14  # beyond it, candidate rows a step (moves of the heaviest rank's sequences)
_BUDGET = 1 << 18  # candidate rows (orders scored times B) per call
_KICK = 2  # random swaps between descents
_KICKS = 64  # at most this many kicked descents ...
_PATIENCE = 8  # ... and no more once this many in a row found nothing better
_EXACT = 7  # up to this many sequences every order is scored (7! = 5040)
_GOOD = 1e-3  # stop once the largest rank is this close to the lower bound
_BOUND_DOCS = 4  # the window bound looks at this many of the longest sequences
_HUGE = 1024  # past this many sequences: the greedy one run of equal lengths at a time, no descent


def tri(x: Any) -> Any:
    """``x (x + 1) / 2`` of an int64 array (or an int): the causal work of ``x`` tokens, which the packer shares."""
    return (x * (x + 1)) >> 1  # x (x + 1) is even and >= 0; the shift is many times faster than // 2


def _check(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(n, P, L)`` as int64 arrays and the rows per rank, after checking SPEC's rules."""
    if len(seqlens) != len(padded) or not seqlens:
        fail("padded", f"{len(padded)} padded lengths for {len(seqlens)} sequences",
             "must give one padded length per sequence, and at least one sequence",
             "pass padded lengths aligned with seqlens")
    if cp_size < 1:
        fail("cp_size", cp_size, "must be >= 1", "pass the context-parallel size")
    n = np.fromiter(seqlens, dtype=_I64, count=len(seqlens))
    p = np.fromiter(padded, dtype=_I64, count=len(padded))
    if bool((n < 0).any()) or bool((p < n).any()):
        fail("padded", list(padded), "every padded length must be >= its sequence length >= 0",
             "pad each sequence at its end (SPEC, Padding)")
    total = int(p.sum())
    if total % cp_size:
        fail("padded", f"lengths summing to {total}", f"the total must divide by cp_size={cp_size}",
             "extend the last sequence's padding (SPEC, Padding)")
    return n, p, total // cp_size


def _table(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``(3, B)``: padded length, work ``tri(n)`` and length of every sequence (what ``_works`` reads)."""
    return np.stack([p, tri(n), n])


def _works(table: np.ndarray, local: int, cp_size: int, orders: np.ndarray) -> np.ndarray:
    """``(K, cp)`` rank works of ``K`` orders ``(K, B)`` (Note [Causal work under the contiguous layout]).

    A dozen array operations whatever ``K``: the descent scores all its candidates in one call. The
    running sums run over all ``K`` orders flat (several times faster than row by row): every order
    holds the same rows and work, so order ``k``'s sums are its own plus ``k`` times the total, which
    the flat positions of its boundaries account for and the final difference cancels (exactly, even
    where the sums would pass int64: NumPy's integer sums wrap, and the differences fit). The boundary
    ``r L`` cuts the sequence after every one that ends at or before it, and a sequence ending at row
    ``e`` does so exactly when ``ceil(e / L) <= r``: one ``bincount`` of every order's ``ceil(e / L)``
    (each order its own ``cp + 1`` bins) and a running count give every boundary's sequence, no search.
    """
    k, b = orders.shape
    if local == 0:
        return np.zeros((k, cp_size), dtype=_I64)
    bins, total = cp_size + 1, local * cp_size
    p_o, w_o = table[0][orders].reshape(-1), table[1][orders].reshape(-1)
    end = np.cumsum(p_o).reshape(k, b)  # the row after each sequence, plus k * total
    first = end + (np.arange(k, dtype=_I64) * local + (local - 1))[:, None]
    first //= local  # the first boundary at or after each end (0 .. cp), plus k * (cp + 1)
    j = np.bincount(first.reshape(-1), minlength=k * bins).cumsum().reshape(k, bins)  # plus k * b: flat
    np.minimum(j, np.arange(b - 1, k * b, b, dtype=_I64)[:, None], out=j)  # the sequence each boundary cuts
    cuts = np.arange(bins, dtype=_I64) * local + np.arange(0, k * total, total, dtype=_I64)[:, None]
    head = np.minimum(cuts - end.reshape(-1)[j] + p_o[j], table[2][orders.reshape(-1)[j]])
    g = np.cumsum(w_o)[j] - w_o[j] + tri(head)  # G(r L), r = 0 .. cp, plus k * W
    return g[:, 1:] - g[:, :-1]


def rank_work(seqlens: Sequence[int], padded: Sequence[int], order: Sequence[int], cp_size: int) -> list[int]:
    """Causal attention work of every rank when the padded sequences are concatenated in ``order``.

    ``order[j]`` is the sequence at buffer position ``j`` (a permutation of ``range(B)``); rank ``r``
    holds rows ``[r L, (r + 1) L)`` and its work is ``sum (position + 1)`` over its token rows
    (Note [Causal work under the contiguous layout]). ``O(B + cp log B)``.

    >>> rank_work([5, 3], [6, 4], [0, 1], 2), rank_work([5, 3], [6, 4], [1, 0], 2)
    ([15, 6], [7, 14])
    """
    n, p, local = _check(seqlens, padded, cp_size)
    if sorted(order) != list(range(len(n))):
        fail("order", list(order), f"must be a permutation of range({len(n)})", "pass each sequence index once")
    return _works(_table(n, p), local, cp_size, np.array([list(order)], dtype=_I64))[0].tolist()


def zigzag_works(n: np.ndarray, p: np.ndarray, cp: int) -> np.ndarray:
    """``(B, cp)`` int64: each sequence's causal work on every rank under zigzag, for ``n`` tokens padded
    to ``p`` (NumPy int64 arrays): rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``p / (2 cp)``
    rows, and the first ``k`` chunks hold ``tri(min(n, k c))`` pairs; with ``cp = 1``, all of it.
    Additive over sequences: the zigzag counterpart of Note [Causal work under the contiguous layout].
    Where some ``p`` does not divide by ``2 cp`` (``padding="none"``) the chunks are
    :func:`~cpshard.index.segments.zigzag_bounds`'s, which depend on the sequences before: ``n`` and
    ``p`` then list a plan's sequences in its buffer order.

    >>> zigzag_works(np.array([5, 3]), np.array([8, 4]), 2).tolist()  # SPEC's worked example
    [[3, 12], [1, 5]]
    """
    if cp == 1:
        return tri(n)[:, None]
    if (p % (2 * cp)).any():  # chunks of unequal sizes (padding="none"): their bounds
        bounds = zigzag_bounds(p, cp)
    else:
        bounds = np.arange(2 * cp + 1, dtype=np.int64)[None, :] * (p // (2 * cp))[:, None]
    chunk = np.diff(tri(np.minimum(n[:, None], bounds)), axis=1)
    return chunk[:, :cp] + chunk[:, ::-1][:, :cp]


def _move_maps(b: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``(2 K, B)`` index maps: insert the item at ``i[k]`` at ``j[k]``, then swap ``i[k]`` and ``j[k]``."""
    t = np.arange(b, dtype=_I64)
    k = i.size
    rows = np.arange(k)
    ahead = i < j  # positions lo .. hi - 1 take the item one after them (ahead) or one before (behind)
    lo, hi = np.where(ahead, i, j + 1)[:, None], np.where(ahead, j, i + 1)[:, None]
    out = np.empty((2 * k, b), dtype=_I64)
    ins, swp = out[:k], out[k:]
    np.multiply((t >= lo) & (t < hi), np.where(ahead, 1, -1)[:, None], out=ins)
    ins += t
    ins[rows, j] = i
    swp[:] = t
    swp[rows, i] = j
    swp[rows, j] = i
    return out


@lru_cache(maxsize=32)
def _all_moves(b: int) -> np.ndarray:
    """Every insertion and every swap of a batch of ``b`` (``2 b (b - 1)`` maps, a few duplicates)."""
    t = np.arange(b, dtype=_I64)
    i, j = (x.reshape(-1) for x in np.meshgrid(t, t, indexing="ij"))
    keep = i != j
    out = _move_maps(b, i[keep], j[keep])
    out.flags.writeable = False
    return out


@lru_cache(maxsize=_EXACT)
def _permutations(b: int) -> np.ndarray:
    """``(b!, b)``: every order of ``b`` sequences, the given one first."""
    out = np.array(list(itertools.permutations(range(b))), dtype=_I64).reshape(-1, b)
    out.flags.writeable = False
    return out


def spread_positions(last: int, steps: int) -> np.ndarray:
    """``steps`` evenly spread integers from 0 to ``last``: torch's float32 ``linspace(0, last, steps)``
    rounded half to even, restated exactly (the first half counted up from 0, the rest down from
    ``last``), so that the descent visits the positions it always did. torch's kernel fuses each
    multiply and add (one rounding to float32): here the product and the sum are taken in float64,
    where both are exact for ``last`` up to 2**24, and rounded to float32 once. (Rounded twice, as
    plain float32 arithmetic does, 27 of 4,290 sampled ``(last, steps)`` landed one off at a tie.)"""
    if steps == 1:
        return np.zeros(1, dtype=_I64)
    step = np.float64(np.float32(last) / np.float32(steps - 1))
    idx = np.arange(steps)
    up = (step * idx).astype(np.float32)
    down = (np.float64(np.float32(last)) - step * (steps - 1 - idx)).astype(np.float32)
    return np.where(idx < steps // 2, up, down).round().astype(_I64)


def _heavy_moves(table: np.ndarray, local: int, order: np.ndarray, heavy: int,
                 seen: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """Past ``_FULL_SEARCH``: insertions and swaps of the sequences touching rank ``heavy`` with evenly
    spread positions, at most ``_STEP_ROWS`` candidate rows (both spread more thinly as ``B`` grows).
    The maps depend only on the positions of the first and last of those sequences; ``seen`` keeps
    them by those positions for the rest of one search, which comes back to the same ones often."""
    b = order.size
    ends = np.cumsum(table[0][order])
    first = int(np.searchsorted(ends, heavy * local, side="right"))
    last = min(int(np.searchsorted(ends, (heavy + 1) * local - 1, side="right")), b - 1)
    if (first, last) not in seen:
        seen[first, last] = _spread_moves(b, first, last)
    return seen[first, last]


def _spread_moves(b: int, first: int, last: int) -> np.ndarray:
    """``_heavy_moves``' maps for the sequences at positions ``first .. last`` of ``b``."""
    pos = np.arange(first, last + 1, dtype=_I64)
    pairs = max(16, _STEP_ROWS // (2 * b))
    if pos.size * b > pairs:
        keep = max(4, math.isqrt(pairs))
        pos = pos[spread_positions(pos.size - 1, min(pos.size, keep))]
    targets = spread_positions(b - 1, min(b, max(2, pairs // pos.size)))
    i, j = (x.reshape(-1) for x in np.meshgrid(pos, targets, indexing="ij"))
    keep_pair = i != j
    return _move_maps(b, i[keep_pair], j[keep_pair])


def _descend(table: np.ndarray, local: int, cp_size: int, order: np.ndarray, budget: int,
             seen: dict[tuple[int, int], np.ndarray], scored: bool = True) -> tuple[np.ndarray, float, int]:
    """Best-improvement descent on ``order_score`` from ``order``: ``(order, its score, budget left)``.

    Stops at a local optimum or once ``budget`` candidate rows (orders scored times ``B``) are spent.
    ``scored=False`` skips scoring the start (a kicked order): the first step then always moves.
    """
    b = order.size
    full = _all_moves(b) if b <= _FULL_SEARCH else None
    w = _works(table, local, cp_size, order[None])[0] if scored or full is None else None
    cur = float(order_score(w[None])[0]) if scored and w is not None else float("inf")
    while budget > 0:
        if full is not None:
            moves = full
        else:
            assert w is not None  # scored above whenever full is None
            moves = _heavy_moves(table, local, order, int(w.argmax()), seen)
        works = _works(table[:, order], local, cp_size, moves)  # the table in this order: moves index it
        budget -= moves.size
        scores = order_score(works)
        k = int(scores.argmin())
        if not scores[k] < cur:
            break
        cur, order, w = float(scores[k]), order[moves[k]], works[k]
    return order, cur, budget


def _kick(order: np.ndarray, gen: torch.Generator) -> np.ndarray:
    """``order`` with ``_KICK`` random pairs swapped: a step out of a local optimum (``gen`` draws the
    pairs: a seeded torch generator, a few scalars, so the kicks are the ones they always were)."""
    out = order.copy()
    for i, j in torch.randint(out.size, (_KICK, 2), generator=gen).tolist():
        out[i], out[j] = out[j], out[i]
    return out


def order_score(works: np.ndarray) -> np.ndarray:
    """``(K,)`` float64 keys ordered as ``(max, sum of squares)`` of each row of ``works`` ``(K, cp)``.

    ``max + sum(w^2) / (2 cp max^2)``: the fraction lies in ``(0, 1/2]`` and maxima are integers, so
    the key orders first by the maximum, then by the sum of squares among equal maxima.
    """
    x = works.T.astype(np.float64, order="C")  # (cp, K): a rank's row is contiguous
    mx = x.max(0)
    x *= x
    total = x[0].copy()
    for r in range(1, x.shape[0]):  # rank by rank: the same sum whatever the array library's reduction
        total += x[r]
    return mx + total / (2 * works.shape[1] * np.maximum(mx * mx, 1))


def longest_first(n: list[int], p: list[int], local: int, cp_size: int) -> list[int]:
    """Longest first, each to the least-loaded rank with room for its rows (else the emptiest rank).

    Within a rank the longest sequence comes first and the shortest last, so when the ranks' row
    counts miss ``L`` the boundary moves across a cheap head or a short tail.
    """
    work = [(0, r) for r in range(cp_size)]  # a heap of (work, rank)
    rows = [0] * cp_size
    bins: list[list[int]] = [[] for _ in range(cp_size)]
    for i in sorted(range(len(n)), key=lambda i: -n[i]):
        if min(rows) + p[i] > local:  # no rank has room: the emptiest, ties to the least work, then rank
            w, r = min(work, key=lambda wr: (rows[wr[1]], wr))
            work.remove((w, r))
            heapq.heapify(work)
            rows[r] += p[i]
            bins[r].append(i)
            heapq.heappush(work, (w + n[i] * (n[i] + 1) // 2, r))
            continue
        full = []
        while work and rows[work[0][1]] + p[i] > local:
            full.append(heapq.heappop(work))
        if work:
            w, r = heapq.heappop(work)
        else:
            w, r = min(full, key=lambda wr: rows[wr[1]])
            full.remove((w, r))
        rows[r] += p[i]
        bins[r].append(i)
        heapq.heappush(work, (w + n[i] * (n[i] + 1) // 2, r))
        for item in full:
            heapq.heappush(work, item)
    return [i for b in bins for i in b]


def _level_counts(work: list[int], cap: list[int], step: int, m: int) -> list[int]:
    """How many of ``m`` equal sequences (work ``step`` each) each rank takes when every one goes to the
    rank of least ``(work, rank)`` with room (``cap[r]`` more): the ``m`` smallest levels
    ``(work[r] + k step, r)``, ``k < cap[r]``, counted per rank. ``m <= sum(cap)``; ``step >= 1``."""
    def below(t: int) -> list[int]:  # per rank, its levels under t
        return [min(c, max(0, -(-(t - w) // step))) for w, c in zip(work, cap)]

    lo, hi = min(work), max(work) + m * step + 1  # sum(below(lo)) == 0 <= m < sum(below(hi))
    while hi - lo > 1:  # the largest t with at most m levels under it
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sum(below(mid)) <= m else (lo, mid)
    counts = below(lo)
    left = m - sum(counts)
    for r, (w, c) in enumerate(zip(work, cap)):  # the levels equal to lo, in rank order
        if left and counts[r] < c and w + counts[r] * step == lo:
            counts[r] += 1
            left -= 1
    return counts


def longest_first_runs(n: np.ndarray, p: np.ndarray, local: int, cp_size: int) -> np.ndarray:
    """:func:`longest_first`'s rule for many sequences: one step per run of equal ``(length, padded
    length)`` in longest-first order, each rank taking as many of the run as the rule gives it
    (:func:`_level_counts`) and the earliest of them first; a sequence no rank has room for goes to the
    emptiest rank, as there. The same work per rank as placing the run one by one up to the order of
    equal sequences (which changes no work); in ``O(runs * cp)`` Python steps, not ``O(B log cp)``."""
    b = n.size
    top = int(n.max())
    # longest first, ties by index: a stable sort, radix on 16-bit keys (the lengths of short documents)
    order = np.argsort((top - n).astype(np.uint16) if top < 1 << 16 else -n, kind="stable")
    ns, ps = n[order], p[order]
    cut = np.flatnonzero((ns[1:] != ns[:-1]) | (ps[1:] != ps[:-1])) + 1
    work, rows = [0] * cp_size, [0] * cp_size
    bins: list[list[np.ndarray]] = [[] for _ in range(cp_size)]
    for s, e in zip([0, *cut.tolist()], [*cut.tolist(), b]):
        step, pad, m = int(tri(ns[s])), int(ps[s]), e - s
        cap = [(m if rows[r] <= local else 0) if pad == 0 else max(0, (local - rows[r]) // pad)
               for r in range(cp_size)]
        fit = min(m, sum(cap))
        if step == 0 and fit:  # empty sequences: all to the least-loaded rank with room
            r = min((r for r in range(cp_size) if cap[r]), key=lambda r: (work[r], r))
            counts = [fit if q == r else 0 for q in range(cp_size)]
        else:
            counts = _level_counts(work, cap, step, fit) if fit else [0] * cp_size
        at = s
        for r, c in enumerate(counts):
            if c:
                bins[r].append(order[at:at + c])
                work[r] += c * step
                rows[r] += c * pad
                at += c
        for i in order[at:e].tolist():  # no rank has room: the emptiest, ties to the least work, then rank
            r = min(range(cp_size), key=lambda r: (rows[r], work[r], r))
            bins[r].append(np.array([i], dtype=_I64))
            work[r] += step
            rows[r] += pad
    return np.concatenate([part for parts in bins for part in parts]).astype(_I64, copy=False)


def balanced_order(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> tuple[int, ...]:
    """:func:`balanced_permutation`, the given order spelled out (``tuple(range(B))``) where it is kept."""
    order = balanced_permutation(seqlens, padded, cp_size)
    return tuple(range(len(seqlens))) if order is None else order


def balanced_permutation(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> tuple[int, ...] | None:
    """A permutation of the sequences that makes the largest rank's causal work close to the mean, or
    None where that is the given order (no search, or none better: :func:`balanced_order` spells it out).

    ``seqlens`` ``(B,)`` token counts, ``padded`` ``(B,)`` padded lengths (``sum(padded) % cp_size == 0``);
    returns ``order`` with ``order[j]`` the sequence to put at buffer position ``j``. Deterministic,
    never worse than the given order (``rank_work`` of ``range(B)``), and within ``work_lower_bound``
    where the batch allows it.

    Note [Balanced contiguous order]
    --------------------------------
    Only the boundary values ``G(r L)`` matter (Note [Causal work under the contiguous layout]), and
    they move in steps: the order of the sequences inside a rank is free, what counts is which
    sequences each rank holds whole and where the boundaries cut the straddlers. A long document must
    straddle; its head (low positions) is cheap and its tail dear, so the rank holding the tail needs
    cheap filler, and which short documents go where is a combinatorial choice. Hence a search, with
    every candidate scored exactly and many at once (``_works``: a dozen tensor operations for ``K``
    orders), by ``(max rank work, sum of squared rank works)`` (``order_score``; the second term breaks
    the plateaus where only a non-maximal rank improves).

    - Up to ``_EXACT`` sequences every order is scored: the result is optimal.
    - Otherwise two starts: the given order, and a longest-first greedy with row capacity (each
      sequence goes to the least-loaded rank that still has ``P_i`` of its ``L`` rows free, else to
      the emptiest rank; each rank lists its sequences longest first, so a boundary that misses lands
      in a cheap head or a short tail). With hundreds of sequences the short ones are fine-grained
      filler and the greedy alone is within a fraction of a percent of the mean.
    - From each start, a best-improvement descent over every insertion (one sequence moved elsewhere)
      and every swap, then, while budget remains, iterated local search: ``_KICK`` random swaps of the
      best order so far (a fixed-seed generator, so the result is deterministic) and a new descent,
      kept when not worse. It stops at ``_KICKS`` kicks, at ``_BUDGET`` candidate rows (orders scored
      times ``B``: the cost is bounded whatever ``B``), or once the largest rank is within ``_GOOD``
      of ``work_lower_bound``.
    - Past ``_FULL_SEARCH`` sequences the given order is only scored, and each descent step moves
      the sequences touching the heaviest rank to evenly spread positions (``_heavy_moves``, at most
      ``_STEP_ROWS`` candidate rows); past ``_LARGE`` there are no kicks and an eighth of the budget.
    - A given order whose ranks all hold the mean work is kept at once (no order scores lower, and
      ties keep it: what the search would return).
    - Past ``_HUGE`` sequences (a row of a thousand short documents or more; all-zero position ids
      make every token one) no search: the given order or the greedy, whichever scores lower, the
      greedy placed one run of equal lengths at a time (:func:`longest_first_runs`), so the cost
      follows the distinct lengths, not the count (a few ms at 128k sequences, where the search took
      a second; 27 ms at 4k sequences of 1-3 tokens, now 2-6 ms).

    The result is never worse than the given order (it is one of the candidates, and ties keep it).
    What the search cannot reach is measured in ``benchmarks/balance.py`` against the lower bound.

    >>> balanced_order([5, 3], [6, 4], 2)
    (1, 0)
    """
    n, p, local = _check(seqlens, padded, cp_size)
    b = n.size
    if cp_size == 1 or b == 1 or local == 0:
        return None
    table = _table(n, p)
    if b <= _EXACT:
        perms = _permutations(b)
        return tuple(perms[int(order_score(_works(table, local, cp_size, perms)).argmin())].tolist())
    if b > _EXACT:  # every rank the mean already (all-zero positions: every token one sequence): no order
        first = _works(table, local, cp_size, np.arange(b, dtype=_I64)[None])[0]  # scores lower, ties keep it
        if first.min() == first.max():
            return None
    if b > _HUGE:  # many short sequences, fine-grained filler: the given order or the greedy in runs, scored
        candidates = np.stack([np.arange(b, dtype=_I64), longest_first_runs(n, p, local, cp_size)])
        best = int(order_score(_works(table, local, cp_size, candidates)).argmin())  # ties: the given order
        return None if best == 0 else tuple(candidates[1].tolist())
    good = _bound(n, local, cp_size) * (1 + _GOOD) + 1  # a score below this is within _GOOD of optimal
    small = b <= _FULL_SEARCH
    budget = _BUDGET if b <= _LARGE else _BUDGET // 8
    seen: dict[tuple[int, int], np.ndarray] = {}  # _heavy_moves' maps, for this search
    greedy = np.array(longest_first(n.tolist(), p.tolist(), local, cp_size), dtype=_I64)
    best = (float("inf"), greedy)
    for start, search in ((np.arange(b, dtype=_I64), small), (greedy, True)):
        order, score, left = _descend(table, local, cp_size, start, budget if search else 0, seen)
        budget = left if search else budget
        best = min(best, (score, order), key=lambda x: x[0])  # the first of equals: the given order
    current, gen, stale = best, torch.Generator().manual_seed(0), 0
    for _ in range(_KICKS if b <= _LARGE else 0):
        if budget <= 0 or best[0] < good or stale >= _PATIENCE:
            break
        order, score, budget = _descend(table, local, cp_size, _kick(current[1], gen), budget, seen, False)
        stale = 0 if score < best[0] else stale + 1
        if score <= current[0]:
            current = (score, order)
            best = min(best, current, key=lambda x: x[0])
    return tuple(best[1].tolist())


def simple_work_bound(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> int:
    """Parts (1) and (2) of :func:`work_lower_bound` alone (the mean and every sequence's heaviest
    piece): what the window part (3) adds is the difference, which ``benchmarks/balance.py`` shows."""
    n, _, local = _check(seqlens, padded, cp_size)
    return _bound(n, local, cp_size)


def work_lower_bound(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> int:
    """A causal work no order can bring the largest rank below (compare ``max(rank_work(...))`` to it).

    The largest of: (1) ``ceil(W / cp)``, ``W = sum tri(n_i)``; (2) for every sequence,
    ``min_{q in [1, L]} max_k work(piece k)``, its token pieces being ``[0, q)``, ``[q, q + L)``,
    ``[q + L, q + 2 L)``, ... cut at ``n_i`` when its first ``q`` rows end a rank; (3) for the
    ``_BOUND_DOCS`` longest sequences ``d``, ``min_q max_{windows}`` of
    ``ceil((work of d in the window + filler(rows of the window not d's)) / ranks in the window)``
    over the windows of consecutive ranks that ``d`` touches at offset ``q`` (offsets spanning more
    than ``cp`` ranks excluded), ``filler`` from ``_filler_curve``.

    Note [Why no order beats the bound]
    -----------------------------------
    (1) The largest rank holds at least the mean and, work being an integer, its ceiling. (2) In any
    order, sequence ``i`` starts ``L - q`` rows into some rank for some ``q in [1, L]`` (boundaries
    are ``L`` apart), so the ranks it touches hold exactly its pieces at that ``q``, and the largest
    rank holds at least the heaviest piece; whatever ``q`` the order gives it, that is at least the
    minimum over all ``q``. (3) The ranks ``a .. b`` that ``d`` touches form one interval of the
    buffer, so besides ``d`` they hold only whole sequences and at most two partial ones (the
    interval's two ends), filling exactly the rows ``d`` leaves free. A whole sequence costs
    ``tri(n_i)`` for ``P_i`` rows, which no fractional mix at ``tri(n_i) / P_i`` a row undercuts for
    the same rows; ``k`` rows of a partial sequence cost at least ``tri(k - pad)`` (positions ``0 ..``
    are the cheapest, pad rows are free); taking the rows cheapest first among all of these is a
    relaxation, so its cost bounds the window's filler from below, and the window's work divided by
    its ranks bounds its largest rank. ``d``'s offset is again unknown, hence the minimum over ``q``.
    Part (2) alone misses that a document filling most of two ranks leaves rows that must hold some
    work; part (3) is what makes the bound tight on batches with one very long document. It still
    relaxes the filler (every sequence may lend a head), so the best order can sit above it.

    >>> work_lower_bound([5, 3], [6, 4], 2), work_lower_bound([8, 0], [8, 0], 2)
    (11, 26)
    """
    n, p, local = _check(seqlens, padded, cp_size)
    bound = _bound(n, local, cp_size)
    if local == 0 or cp_size == 1:
        return bound
    for d in np.argsort(-n, kind="stable")[:_BOUND_DOCS].tolist():
        bound = max(bound, _window_bound(n, p, local, cp_size, d))
    return bound


def _bound(n: np.ndarray, local: int, cp_size: int) -> int:
    """The mean and every sequence's heaviest piece (the first two parts of Note [Why no order beats the bound])."""
    w = tri(n)
    bound = -(-int(w.sum()) // cp_size)
    if local == 0:
        return bound
    length = n[w > bound][:, None]  # fewer than cp of them: each holds more than a rank's mean
    if not length.size:
        return bound
    # At offset q the pieces are [0, q), then L-row pieces from q on, the last one cut at the length.
    # Whole L-row pieces cost more the later they start, so the heaviest piece is the first, the last
    # (index k, from q + (k - 1) L to the length) or the whole one before it (when k >= 2).
    q = np.arange(1, local + 1, dtype=_I64)[None, :]
    k = np.where(length > q, (length - q + (local - 1)) // local, 0)  # the last piece holding a token
    start = np.maximum(q + (k - 1) * local, 0)  # where the last piece starts (k >= 1)
    piece = tri(np.minimum(q, length))
    np.maximum(piece, np.where(k >= 1, tri(length) - tri(start), 0), out=piece)
    np.maximum(piece, np.where(k >= 2, tri(start) - tri(np.maximum(start - local, 0)), 0), out=piece)
    return max(bound, int(piece.min(1).max()))


def _filler_curve(n: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The cheapest way to fill rows from sequences ``n, p`` as a window of the buffer holds them:
    whole sequences and at most two partial ones (Note [Why no order beats the bound]).

    Relaxed to a mix of whole sequences, fractionally, at ``tri(n_i) / P_i`` a row, and two heads of
    any sequence, free for their first ``max(P - n)`` rows, then ``1, 2, ...`` up to ``max(n)``; rows
    are taken cheapest first. Returns the chunks sorted by cost a row: ``(rows, cost a row, rows up
    to the chunk's end, cost up to its end)``, read by ``_filler_cost``.
    """
    longest = int(n.max()) if n.size else 0
    pad = int((p - n).max()) if n.size else 0
    whole = p > 0
    marginal = np.concatenate([np.zeros(1), np.arange(1, longest + 1, dtype=np.float64),
                               tri(n[whole]).astype(np.float64) / p[whole].astype(np.float64)])
    supply = np.concatenate([np.array([2 * pad], dtype=_I64), np.full(longest, 2, dtype=_I64), p[whole]])
    by_cost = np.argsort(marginal, kind="stable")
    marginal, supply = marginal[by_cost], supply[by_cost]
    return supply, marginal, np.cumsum(supply), np.cumsum(supply.astype(np.float64) * marginal)


def _filler_cost(curve: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """``(Q,)`` integer lower bounds on the work of ``rows`` ``(Q,)`` filler rows (``_filler_curve``)."""
    supply, marginal, rows_end, cost_end = curve
    rows = np.maximum(rows, 0)
    k = np.minimum(np.searchsorted(rows_end, rows), rows_end.size - 1)
    cost = cost_end[k] + (rows - rows_end[k]).astype(np.float64) * marginal[k]
    return np.maximum(np.floor(cost).astype(_I64) - 1, 0)  # one unit below: float rounding can never raise it


def _window_bound(n: np.ndarray, p: np.ndarray, local: int, cp_size: int, d: int) -> int:
    """The third part of Note [Why no order beats the bound], for sequence ``d``: the least over its
    offsets of the heaviest window of consecutive ranks it touches, its own work there plus the
    cheapest possible filler of the window's other rows, shared by the window's ranks."""
    length, size = int(n[d]), int(p[d])
    if size == 0:
        return 0
    keep = np.arange(n.size) != d
    curve = _filler_curve(n[keep], p[keep])
    start = local - np.arange(1, local + 1, dtype=_I64)[:, None]  # its first row inside its first rank
    ranks = -(-(local - 1 + size) // local)
    r = np.arange(ranks, dtype=_I64)
    lo = (r * local - start).clip(0, size)  # the positions of d inside each rank it may touch
    hi = ((r + 1) * local - start).clip(0, size)
    rows, work = hi - lo, tri(np.minimum(hi, length)) - tri(np.minimum(lo, length))
    touched = rows > 0
    best = np.zeros(local, dtype=_I64)
    for a in range(ranks):
        for b in range(a, ranks):
            width = b - a + 1
            other = width * local - rows[:, a:b + 1].sum(1)
            total = work[:, a:b + 1].sum(1) + _filler_cost(curve, other)
            value = -(-total // width)
            best = np.where(touched[:, a] & touched[:, b], np.maximum(best, value), best)
    spans = touched.sum(1)
    return int(best[spans <= cp_size].min())
