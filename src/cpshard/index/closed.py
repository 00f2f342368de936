"""Closed forms over a THD plan's sequences: where a padded position lives, and what a relayout moves.

One idea: the arithmetic of where a THD plan puts the rows of its sequences, computed over the
sequences (or over the rows a caller asks about) instead of from every rank's segments. A THD plan
splits its whole padded buffer over the ranks: with ``L = local_len`` rows on each rank and a
sequence at buffer offset ``cu`` with padded length ``P``,

- **contiguous** (and any layout at ``cp = 1``): rank ``r`` holds buffer rows ``[r L, (r + 1) L)``,
  so position ``p`` is the rank-concatenated row ``cu + p``;
- **zigzag**: with ``h = P / (2 cp)``, position ``p`` is in chunk ``k = p // h``, held by rank
  ``min(k, 2 cp - 1 - k)`` at its local row ``cu / cp + p % h`` (plus ``h`` in the second chunk).

These forms take every zigzag chunk of a sequence to have ``P / (2 cp)`` rows. A plan built with
``padding="none"`` may have chunks one row apart (Note [Zigzag chunks of any length] in
``index/segments.py``), and a sequence's first local row then differs between the ranks: for such a
plan (``segments.unequal_chunks``) :func:`thd_restore` and :func:`thd_restore_by_rank` answer None,
:func:`thd_rows` and :func:`thd_moved` refuse, and the index service reads the segments instead.

:meth:`~cpshard.plan.indices.PlanIndices.unshard` (:func:`thd_restore`) and
:meth:`~cpshard.plan.indices.PlanIndices.relayout` (:func:`thd_rows`, :func:`thd_moved`) read them,
so that the first restore or relayout of a large plan builds one rank's segments, not every rank's.
Like the rest of the index layer it builds and names no plan: it reads a plan's attributes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cpshard.base.layout import Layout
from cpshard.index import segments as _index

__all__ = ["by_position_pays", "thd_moved", "thd_restore", "thd_restore_by_rank", "thd_rows", "zigzag_by_rank",
           "zigzag_rows"]


def _caller_order(plan: Any, values: np.ndarray) -> np.ndarray:
    """``values`` (one per sequence, buffer order) in the caller's order."""
    return values if plan.order is None else values[np.argsort(np.asarray(plan.order))]


def _placement(plan: Any, padded: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(padded, cu)``: each sequence's padded length and buffer offset, in the caller's order, from
    ``padded`` (int64, buffer order; the index service keeps it) or the plan's own tuple."""
    if padded is None:
        padded = _index.int64_array(plan.padded_seqlens_py)
    cu = np.cumsum(padded) - padded
    return _caller_order(plan, padded), _caller_order(plan, cu)


def zigzag_rows(pos: np.ndarray, h: np.ndarray | int, base: np.ndarray, cp: int, local_len: int) -> np.ndarray:
    """The rank-concatenated rows of zigzag positions ``pos`` (chunks of ``h`` rows, the sequence's
    local rows starting at ``base``: ``cu / cp`` in a THD buffer; ``local_len`` a rank's rows), computed
    in place in ``pos`` (an array ``h`` is spent). A BSHD batch row is a sequence of its own: ``base``
    its first local row, ``local_len`` the rows of a rank's whole part (``plan.bshd``'s restore).

    ``h`` one int where every position's chunks have the same size: NumPy divides by one number about
    ten times faster than element by element, and a batch of short sequences at a large ``cp``, the
    batch whose restore works per token, pads most of them to the same ``2 cp tp`` rows."""
    chunk = pos // h
    if isinstance(h, np.ndarray):
        step = np.multiply(h, chunk - (chunk >= cp), out=h)  # (k - second) h: p less it is the row in its two chunks
    else:
        step = chunk - (chunk >= cp)
        step *= h
    pos -= step  # the local row inside the sequence's two chunks
    np.subtract(2 * cp - 1, chunk, out=step)
    np.minimum(chunk, step, out=chunk)  # the rank holding the chunk
    chunk *= local_len
    pos += chunk
    pos += base
    return pos


def thd_restore(plan: Any) -> np.ndarray | None:
    """:meth:`PlanIndices.unshard` of a THD plan in closed form, per token (no segments of every rank).

    Each token's row of the rank-concatenated buffer (the forms in this module's docstring), in the
    caller's order. Built over the tokens at once, in int32 and in place (a plan's buffers hold fewer
    than 2**31 rows; each fresh token-long array costs its page faults): cheaper than every rank's
    segments where those average fewer than 16 tokens (for long chunks the segments' one expansion
    is cheaper).
    """
    i32 = np.dtype(np.int32)
    lens = _index.int64_array(plan.input_seqlens_py)  # caller's order
    padded, cu = _placement(plan, None)
    cp = plan.cp_size
    if plan.layout is not Layout.ZIGZAG or cp == 1:
        return _index.expand_np(cu, lens, i32)  # token p of a sequence: cu_padded + p
    if _index.unequal_chunks(padded, cp, plan.layout):
        return None
    pos = _index.expand_np(np.zeros(plan.num_seqs, dtype=np.int64), lens, i32)  # each token's position
    h = padded // (2 * cp)
    held = h[lens > 0]  # one chunk size for every sequence that holds a token: divide by one number
    one = held.size and held.min() == held.max()
    return zigzag_rows(pos, int(held[0]) if one else np.repeat(h.astype(i32), lens),
                       np.repeat((cu // cp).astype(i32), lens), cp, plan.local_len)


def zigzag_by_rank(lens: np.ndarray, base: np.ndarray, h: int,
                   cp: int) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """The restore grouped by rank (:meth:`~cpshard.plan.indices.PlanIndices.unshard_by_rank`) where every
    sequence holding a token has zigzag chunks of one size ``h``: ``(rows, bounds, back)``, sequence ``i``
    holding ``lens[i]`` tokens on the local rows from ``base[i]`` of each rank (int64 arrays, caller's
    order), at ``cp > 1``.

    With one chunk size, a position ``p`` alone decides the token's rank and its row among its
    sequence's rows there (``off(p)``), and the sequences holding a token at ``p`` are those longer
    than ``p``, a set that shrinks as ``p`` grows. So the tokens are grouped by rank, then by position,
    then in the caller's order, with no sort of the tokens: walking the positions, rank ``rank(p)``'s
    rows gain ``base + off(p)`` of the sequences still longer than ``p`` (increasing rows: a rank's part
    is read in one ascending sweep per position it holds), and those tokens' places follow on. Work: a
    few passes over the tokens, and ``2 cp h`` steps (:func:`by_position_pays`: where that is cheaper
    than sorting the tokens)."""
    i32 = np.dtype(np.int32)
    span = 2 * cp * h
    p = np.arange(span, dtype=np.int64)
    chunk = p // h
    off = chunk - (chunk >= cp)
    off *= -h
    off += p  # the row among its sequence's rows on its rank
    rank = np.minimum(chunk, 2 * cp - 1 - chunk)
    by_rank = np.argsort(rank, kind="stable")  # the positions, rank by rank
    count = lens.size - np.cumsum(np.bincount(lens, minlength=span + 1))[:span]  # sequences longer than p
    first = np.empty(span, dtype=np.int64)  # each position's first place in the grouped order
    first[by_rank] = np.cumsum(count[by_rank]) - count[by_rank]
    token0 = (np.cumsum(lens) - lens).astype(i32)  # each sequence's first token
    base = base.astype(i32)
    grouped = np.empty(int(lens.sum()), dtype=i32)  # every rank's rows, rank by rank
    back = np.empty(grouped.size, dtype=i32)
    seqs = np.flatnonzero(lens)
    for q in range(span):
        seqs = seqs[lens[seqs] > q]  # the sequences holding a token at position q, in the caller's order
        at = int(first[q])
        np.add(base[seqs], int(off[q]), out=grouped[at:at + seqs.size])
        back[token0[seqs] + q] = np.arange(at, at + seqs.size, dtype=i32)
    bounds = [0, *np.cumsum(np.bincount(rank, weights=count, minlength=cp)).astype(np.int64).tolist()]
    return [grouped[a:b] for a, b in zip(bounds[:-1], bounds[1:])], bounds, back


def by_position_pays(span: int, tokens: int) -> bool:
    """Whether :func:`zigzag_by_rank`'s ``span`` steps (each a few NumPy calls, some microseconds) cost
    less than sorting ``tokens`` tokens by rank (some nanoseconds each): positions fewer than a
    2048th of the tokens (a batch of short sequences at a large ``cp``)."""
    return span * 2048 <= tokens


def thd_restore_by_rank(plan: Any) -> tuple[list[np.ndarray], list[int], np.ndarray] | None:
    """:func:`zigzag_by_rank` of a zigzag THD plan at ``cp > 1`` whose sequences holding a token share one
    padded length (a batch of short sequences at a large ``cp``: its alignment, ``2 cp tp`` rows); None
    for any other plan (the index service sorts :func:`thd_restore`'s index by rank)."""
    cp = plan.cp_size
    if plan.layout is not Layout.ZIGZAG or cp == 1:
        return None
    lens = _index.int64_array(plan.input_seqlens_py)  # caller's order
    padded, cu = _placement(plan, None)
    held = padded[lens > 0]
    if (not held.size or held.min() != held.max() or not by_position_pays(int(held[0]), plan.num_tokens)
            or _index.unequal_chunks(padded, cp, plan.layout)):
        return None
    return zigzag_by_rank(lens, cu // cp, int(held[0]) // (2 * cp), cp)


def _equal_chunks(plan: Any, padded: np.ndarray | None) -> None:
    if _index.unequal_chunks(_index.int64_array(plan.padded_seqlens_py) if padded is None else padded, plan.cp_size,
                             plan.layout):
        raise AssertionError("a closed form of equal zigzag chunks asked of a plan whose chunks differ "
                             "(padding='none'): the index service reads its segments")


def thd_rows(plan: Any, canonical: np.ndarray, padded: np.ndarray | None = None) -> np.ndarray:
    """``(N,)`` int64: the rank-concatenated row (``rank * local_len + local row``) of each
    **canonical** row ``canonical`` ``(N,)`` int64 names: ``cu_padded_caller[i] + p`` for caller's
    sequence ``i`` at padded position ``p`` (Note [Twin plans and their route] in ``twins.py``).
    ``padded``: the plan's padded lengths as int64 in buffer order, where the caller keeps them.

    >>> from cpshard import ShardPlan
    >>> plan = ShardPlan.build([5, 3], cp_size=2)  # padded (8, 4): h = 2 and 1
    >>> thd_rows(plan, np.arange(12)).tolist()     # rank 0 holds rows 0-5, rank 1 rows 6-11
    [0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]
    """
    padded, cu = _placement(plan, padded)
    _equal_chunks(plan, padded)
    start = np.concatenate([[0], np.cumsum(padded)])  # caller's padded buffer
    seq = np.searchsorted(start, canonical, side="right") - 1
    pos = canonical - start[seq]
    cp = plan.cp_size
    if plan.layout is not Layout.ZIGZAG or cp == 1:
        return cu[seq] + pos
    return zigzag_rows(pos, padded[seq] // (2 * cp), cu[seq] // cp, cp, plan.local_len)


def thd_moved(src: Any, dst: Any, padded: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """How many rows change rank when twin THD plans ``src`` and ``dst`` trade layouts or buffer
    orders: the route's ``total_remote``, over the whole group, in ``O(sequences + cp)``.

    A row stays when both plans put it on the same rank. Under zigzag a sequence's rank-``d`` rows
    are its chunks ``d`` and ``2 cp - 1 - d`` wherever the sequence sits; under contiguous they are
    the part of it inside ``[d L, (d + 1) L)``. So two zigzag twins move nothing, and otherwise each
    sequence is compared on the ranks its contiguous placement touches (one or two for a sequence
    shorter than ``L``): the rows that stay are the overlaps of the two plans' rank-``d`` rows.
    ``padded``: both plans' padded lengths as int64 in buffer order, where the caller keeps them.
    """
    cp = src.cp_size
    given = padded or (None, None)
    for plan, lengths in zip((src, dst), given):
        _equal_chunks(plan, lengths)
    zigzag = [p.layout is Layout.ZIGZAG and cp > 1 for p in (src, dst)]
    if all(zigzag) or cp == 1:
        return 0
    (padded, cu_a), (_, cu_b) = _placement(src, given[0]), _placement(dst, given[1])
    if zigzag[0]:  # a: the contiguous twin, whose ranks are enumerated; b: the other
        cu_a, cu_b = cu_b, cu_a
    L = src.local_len
    total = int(padded.sum())
    used = padded > 0
    padded, cu_a, cu_b = padded[used], cu_a[used], cu_b[used]
    first, count = cu_a // L, (cu_a + padded - 1) // L - cu_a // L + 1
    seq = np.repeat(np.arange(padded.size), count)  # one pair per (sequence, rank it touches)
    rank = first[seq] + np.arange(seq.size) - np.repeat(np.cumsum(count) - count, count)
    size = padded[seq]
    lo = np.maximum(rank * L - cu_a[seq], 0)  # a's rank-d rows of the sequence, as positions
    hi = np.minimum((rank + 1) * L - cu_a[seq], size)
    if zigzag[0] or zigzag[1]:
        h = size // (2 * cp)
        other = 2 * cp - 1 - rank
        kept = _index.overlap(lo, hi, rank * h, (rank + 1) * h) + _index.overlap(lo, hi, other * h, (other + 1) * h)
    else:
        kept = _index.overlap(lo, hi, rank * L - cu_b[seq], (rank + 1) * L - cu_b[seq])
    return int(total - kept.sum())
