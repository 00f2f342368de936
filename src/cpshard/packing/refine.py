"""Exact refinement of a packing: contiguous buffer orders, exchanges between micro-batches, DP ranks.

Pure index math on NumPy int64 arrays (scored by ``index.balance.order_score``; no plan is built, no
communication). :func:`cpshard.pack` calls it after its fill; every score here is the exact per-rank
causal work of the contiguous layout (Note [Causal work under the contiguous layout] in ``index.balance``,
the closed form of :func:`cpshard.causal.attention_work`), never a model.

Note [Refining a packing]
-------------------------
The fill (Note [Micro-batch packing]) scores micro-batches with a model; under the contiguous layout
the model cannot see how a micro-batch's sequences split over its ranks (seven documents of 0.6
``L`` each balance worse than a long one among short filler), so three exact steps follow.

**The closed form, per move.** :class:`Buffers` keeps every micro-batch's buffer order and, per buffer
position, the rows and the work before it (``G`` at its start). ``G_b(x)``, the work of micro-batch
``b``'s first ``x`` rows, is one ``searchsorted`` over all micro-batches' keys ``b * span + end`` and
a ``tri``. A move changes one stretch of the buffer, so the moved buffer's ``G'`` at a rank
boundary ``c`` is the old ``G`` before the stretch, a moved sequence's prefix inside its new place,
the old ``G`` at ``c`` shifted by the stretch's change of rows (plus its change of work) in between,
and the old ``G`` after it. Swapping positions ``i < j`` (``s`` a start, ``e`` an end, ``D = P_j - P_i``)::

    c <  s_i                G(c)
    c <  s_i + P_j          G(s_i) + tri(min(c - s_i, n_j))
    c <  s_j + D            G(c - D) + tri(n_j) - tri(n_i)
    c <  e_j                G(s_j) + tri(n_j) - tri(n_i) + tri(min(c - s_j - D, n_i))
    else                    G(c)

and moving ``i`` to just after ``j > i``, or to just before ``j < i``, are the same with one moved
sequence; splicing a run of another micro-batch in place of a run of this one (an exchange) shifts
everything after it and moves the boundaries (``L`` follows the new rows). A candidate then costs ``O(cp log K)``, not a
rescan of its buffer: thousands are scored in one call of a few NumPy operations.

1. **Orders.** From longest-first starts (``index.balance.longest_first``), :meth:`Buffers.descend` runs a
   best-improvement descent of every micro-batch at once over the swaps and insertions between up to
   ``_GRID`` evenly spread positions (fewer past ``cp = 8``: ``Buffers._for_cp``), scored by the largest
   rank, then the sum of squares (``index.balance.order_score``'s key), until none improves or ``budget``
   candidates are spent.
2. **Exchanges.** DP ranks share out ``sum_m c_m`` (``c_m`` a micro-batch's slowest rank), so
   :meth:`Buffers.exchange` lowers it. Every exchange splices a run of consecutive buffer positions of
   one micro-batch in place of a run of another and back (``_spliced``: the old ``G`` before the
   splice, the run's own ``G`` inside it, the old ``G`` shifted after it): for the ``_EXCHANGE_TOP``
   micro-batches whose slowest rank is furthest above their mean (fewer past ``cp = 8``, at least 2,
   and fewer partners too, by the same rule as the grid), a sequence for none (a move), for one
   within a rank's rows of its length (a swap: **Near swaps** below), or, when it holds rows of the
   slowest rank, for a run of ``2 .. _RUN`` (which lets a long document's micro-batch trade one filler
   for several and so reach offsets a single one cannot); a run of theirs for one sequence of half a
   rank or more; and moves into them. Every candidate that keeps both micro-batches within the budget is
   scored exactly on both (the receiving side only when its new mean leaves room for a gain);
   improving ones are applied best first, one per micro-batch a round, and the micro-batches they
   touched descend a step (all of them fully at the end). An exchange is kept only when ``c_a + c_b``
   falls, so the sum never rises.
   **Groups** (``pack(group_size=g)``): :meth:`Buffers.exchange_groups` exchanges whole groups
   instead: a group of a top micro-batch for a group of another (member ``k`` takes member ``k``'s
   buffer position), a group of it to the end of another, a group of another to the end of it. A
   group's members need not be adjacent in the buffer, so these are scored from the whole new orders
   (:meth:`Buffers._scored`: the same closed form, one ``searchsorted`` over all candidates, empty
   places where a group left), with the same receiving-side filter, order of application and rule
   that ``c_a + c_b`` falls.
3. **DP ranks.** :func:`cpshard.packing.assign.assign` gives the micro-batches, with exact costs, to
   the DP ranks with their counts fixed: longest first to the least loaded rank with a place left, then swaps of a
   micro-batch of the slowest rank with one of another while the slowest rank's time falls.

**Tiles.** Candidates are scored in tiles of at most ``_TILE_CELLS`` (candidate, boundary) cells, and the
pairs of an exchange round are enumerated in tiles of as many: one pass of array operations over a
tile keeps its temporaries in the CPU's cache, where one pass over every candidate streams them from
memory (on ``benchmarks/pack.py``'s batches the exact scoring takes 0.6x the time in tiles). The
results are the same either way.

**Near swaps.** A one-for-one swap whose two sequences differ by more than ``L / _SWAP_SHIFT`` rows (one
rank's) is not a candidate; moves and runs are (one sequence for several reaches offsets a swap cannot).
Such a swap shifts every later boundary of both buffers by more than a rank: on ``benchmarks/pack.py``'s
batches the swaps within a rank gave all of the applied swaps' gain at ``cp = 4`` and on RL, 91% at
``cp = 8``, where the far ones were 38-40% of the exchanges' candidates; step ratios stay within 0.1 point
of scoring them all (a quarter of a rank lost 1.4 points on one batch of 1,024 sequences at ``cp = 8``).

Every step is deterministic (no random choice; ties go to the lowest index).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from cpshard.index.balance import longest_first, order_score, tri
from cpshard.packing.prefix import lookup, tables

__all__ = ["Buffers"]

_GOOD = 1e-3  # a micro-batch whose slowest rank is this close to its mean descends no further
_GRID = 10  # positions a descent step moves from and to, evenly spread over the buffer (fewer past cp = 8 ...
_GRID_LEAST = 6  # ... and at least this: _for_cp)
_EXCHANGE_TOP = 12  # micro-batches whose sequences an exchange round tries to swap out (up to cp = 8; fewer past it)
_RUN = 4  # an exchange swaps one sequence for a run of up to this many consecutive ones
_SWAP_SHIFT = 1  # a one-for-one swap changes its micro-batches' rows by at most a rank's rows over this
_PARTNERS = 128  # past this many micro-batches an exchange round looks at this many partners
_DESCENT_AFTER_SWAP = 1  # the micro-batches of a round's swaps take one descent step (all descend at the end)
_TILE_CELLS = 1 << 15  # (candidate, boundary) cells, or enumerated pairs, one pass of array operations takes


# a round's candidates: micro-batches u and v, the gain of each, applying candidate c, candidates scored
_Round = tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[int], None], int]


class Buffers:
    """Every contiguous micro-batch's buffer order and exact per-rank work (Note [Refining a packing]).

    ``n``, ``p`` ``(N,)``: the batch's lengths and per-sequence padded lengths; ``keep``: a micro-batch's
    total rows are rounded up to a multiple of it (the plan's extension of its last sequence: pad rows,
    which do no work, at the buffer's end); ``capacity``: the most rows a micro-batch may hold;
    ``groups``: the micro-batches' sequence indices (``Buffers.orders()`` returns their buffer orders).
    """

    def __init__(self, n: np.ndarray, p: np.ndarray, keep: int, cp: int, capacity: int,
                 groups: Sequence[Sequence[int]]) -> None:
        self.n, self.p, self.keep, self.cp, self.capacity = n, p, keep, cp, capacity
        self.null = n.size  # an empty sequence fills each order's row past its size
        self._n = np.concatenate([n, [0]]).astype(np.int64)
        self._p = np.concatenate([p, [0]]).astype(np.int64)
        self.size = np.array([len(g) for g in groups], dtype=np.int64)
        k = len(groups)
        self.order = np.full((k, int(self.size.max()) + 1), self.null, dtype=np.int64)
        self.where = np.full(n.size, -1, dtype=np.int64)
        self.pos = np.zeros(n.size, dtype=np.int64)
        for b, g in enumerate(groups):
            self._set(b, [int(i) for i in g])
        self.rows = self._p[self.order].sum(1)
        self._span = 2 * capacity + 2
        self._grid = math.isqrt(self._for_cp(_GRID * _GRID, _GRID_LEAST * _GRID_LEAST))  # moves go as its square
        self._index()
        self.works = self._rank_works(np.arange(k), self.rows)

    # -- the closed form -------------------------------------------------------------------------

    def _set(self, b: int, ids: list[int]) -> None:
        self.order[b, :] = self.null
        self.order[b, :len(ids)] = ids
        self.where[ids] = b
        self.pos[ids] = np.arange(len(ids))

    def _index(self) -> None:
        """Every micro-batch's position tables (``packing.prefix.tables``, one sorted array of keys over all
        micro-batches). The last column is always empty (``_room``)."""
        self._cols = self.order.shape[1]
        self._keys, self._key_start, self._start, self._before, self._len = tables(
            self._p[self.order], self._n[self.order], self._span)

    def _reindex(self, which: np.ndarray) -> None:
        """:meth:`_index` for the micro-batches ``which`` (sorted, unique) only, the order's columns
        unchanged: each micro-batch's keys lie in its own ``[b span, (b + 1) span)`` and its positions in
        its own row of the flat tables, so the others' entries and the keys' order stand. ``O(|which| cols)``,
        which keeps a refinement step's cost to the micro-batches it changed."""
        if not which.size:
            return
        if self.order.shape[1] != self._cols:
            self._index()
            return
        sub = self.order[which]
        keys, key_start, start, before, length = tables(self._p[sub], self._n[sub], self._span)
        shift = ((which - np.arange(which.size)) * self._span)[:, None]  # from row q's keys to row b's
        flat = (which[:, None] * self._cols + np.arange(self._cols)[None, :]).reshape(-1)
        self._keys[flat] = (keys.reshape(which.size, -1) + shift).reshape(-1)
        self._key_start[flat] = (key_start.reshape(which.size, -1) + shift).reshape(-1)
        self._start[flat], self._before[flat], self._len[flat] = start, before, length

    def _lookup(self, key: np.ndarray) -> np.ndarray:
        """``G`` at keys ``b * span + x``: the work of micro-batch ``b``'s first ``x`` buffer rows."""
        return lookup((self._keys, self._key_start, self._start, self._before, self._len), key)

    def _g(self, b: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``G_b(x)``: the work of micro-batch ``b``'s first ``x`` buffer rows (``b`` broadcast over ``x``)."""
        return self._lookup(b * self._span + x)

    def _local(self, rows: np.ndarray) -> np.ndarray:
        """The rows a rank holds of micro-batches of ``rows`` padded rows (their total rounded up to ``keep``)."""
        return -(-rows // self.keep) * self.keep // self.cp

    def _for_cp(self, count: int, least: int) -> int:
        """``count`` up to ``cp = 8``, past it ``count * 7 / (cp - 1)`` and at least ``least``: a candidate costs
        ``cp - 1`` boundary lookups, and so candidates times boundaries stay about as at ``cp = 8`` (the
        top micro-batches and partners of an exchange round, the square of the descent's grid)."""
        return min(count, max(least, count * 7 // max(self.cp - 1, 1)))

    def _inner(self, rows: np.ndarray) -> np.ndarray:
        """``(Q, cp - 1)`` the boundaries between ranks (``G`` is 0 at the first and the whole work at the
        last, which every row precedes: only these need a lookup)."""
        return self._local(rows)[:, None] * np.arange(1, self.cp, dtype=np.int64)[None, :]

    @staticmethod
    def _framed(inner: np.ndarray, total: np.ndarray) -> np.ndarray:
        """``(Q, cp)`` rank works from ``G`` at the inner boundaries and each buffer's whole work."""
        q = inner.shape[0]
        return np.diff(np.concatenate([np.zeros((q, 1), dtype=np.int64), inner, total[:, None]], axis=1), axis=1)

    def _rank_works(self, b: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``(Q, cp)`` the works of micro-batches ``b`` as their orders stand (``rows`` padded rows)."""
        return self._framed(self._g(b[:, None], self._inner(rows)), self._before[b * self._cols + self.size[b]])

    def _at(self, b: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Start row, work before, padded rows and length of the sequence at position ``t`` of ``b``, ``(Q, 1)``."""
        flat = b * self._cols + t
        seq = self.order[b, t]
        return (self._start[flat][:, None], self._before[flat][:, None], self._p[seq][:, None],
                self._n[seq][:, None])

    def _spliced(self, b: np.ndarray, b1: np.ndarray, b2: np.ndarray, src: np.ndarray, s1: np.ndarray,
                 s2: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``(Q, cp)`` works of micro-batch ``b`` with its positions ``[b1, b2)`` replaced by the run
        ``[s1, s2)`` of micro-batch ``src`` (either may be empty), ``rows`` rows: the old prefix before
        the splice, the run's own prefix inside it, the old prefix shifted by the change of rows (plus
        the change of work) after it. One ``G`` lookup a boundary: each boundary's region (before,
        inside, after) picks the search key's offset and the work added, so the lookup is one
        ``searchsorted`` for all."""
        c = self._inner(rows)
        cols, span = self._cols, self._span
        at_b1, at_b2, at_s1, at_s2 = b * cols + b1, b * cols + b2, src * cols + s1, src * cols + s2
        start, before = self._start[at_b1], self._before[at_b1]
        src_start, src_before = self._start[at_s1], self._before[at_s1]
        rows_new, work_new = self._start[at_s2] - src_start, self._before[at_s2] - src_before
        rows_old, work_old = self._start[at_b2] - start, self._before[at_b2] - before
        region = (c >= start[:, None]).view(np.int8) + (c >= (start + rows_new)[:, None]).view(np.int8)
        pick = np.arange(0, 3 * b.size, 3, dtype=np.int64)[:, None] + region  # (Q, cp - 1) into (Q, 3)
        home = b * span
        offset = np.stack([home, src * span + src_start - start, home + rows_old - rows_new], axis=1)
        added = np.stack([np.zeros_like(before), before - src_before, work_new - work_old], axis=1)
        g = self._lookup(c + offset.reshape(-1)[pick]) + added.reshape(-1)[pick]
        return self._framed(g, self.works[b].sum(1) + (work_new - work_old))

    def _tiled(self, score: Callable[..., np.ndarray], *columns: np.ndarray) -> np.ndarray:
        """``score(*columns)`` ``(Q, cp)`` over tiles of candidates, concatenated: a tile's candidates
        times their ``cp - 1`` boundaries make at most ``_TILE_CELLS`` cells (Note [Refining a
        packing], **Tiles**)."""
        q, tile = columns[0].size, max(1, _TILE_CELLS // max(self.cp - 1, 1))
        if q <= tile:
            return score(*columns)
        return np.concatenate([score(*(c[k:k + tile] for c in columns)) for k in range(0, q, tile)])

    def _moved(self, b: np.ndarray, i: np.ndarray, j: np.ndarray, swap: np.ndarray) -> np.ndarray:
        """``(Q, cp)`` works of micro-batch ``b`` with positions ``i != j`` swapped (``swap``) or the sequence
        at ``i`` moved to position ``j`` (the others keep their order); the rows do not change.

        One ``G`` lookup a boundary: outside the moved stretch the old ``G``; over the shifted middle the
        old ``G`` at the shifted row plus the change of work; inside a moved sequence its own prefix."""
        c = self._inner(self.rows[b])
        lo, hi = np.minimum(i, j), np.maximum(i, j)
        s_lo, g_lo, p_lo, n_lo = self._at(b, lo)
        s_hi, g_hi, p_hi, n_hi = self._at(b, hi)
        w_lo, w_hi = tri(n_lo), tri(n_hi)
        sw, later = swap[:, None], (~swap & (i < j))[:, None]  # later: lo moves to just after hi
        earlier = ~sw & ~later  # hi moves to just before lo
        # where the first moved piece ends, the middle's shift of rows and work, the last piece's start
        first_end = np.where(later, s_lo, s_lo + p_hi)  # a swap or "earlier" puts hi's sequence at s_lo
        shift = np.where(sw, p_hi - p_lo, np.where(later, -p_lo, p_hi))
        d_work = np.where(sw, w_hi - w_lo, np.where(later, -w_lo, w_hi))
        last_start = np.where(earlier, s_hi + p_hi, s_hi + p_hi - p_lo)  # lo's sequence ends the stretch
        e_hi = s_hi + p_hi
        outside = (c < s_lo) | (c >= e_hi)
        first = ~outside & (c < first_end)
        last = ~outside & ~first & (c >= last_start) & ~earlier
        middle = ~outside & ~first & ~last
        g = self._g(b[:, None], np.where(middle, c - shift, c))
        g = np.where(middle, g + d_work, g)
        g = np.where(first, g_lo + tri(np.minimum(c - s_lo, n_hi)), g)
        g = np.where(last, g_hi + w_hi - w_lo + tri(np.minimum(c - last_start, n_lo)), g)
        return self._framed(g, self.works[b].sum(1))

    def orders(self) -> list[list[int]]:
        return [self.order[b, :s].tolist() for b, s in enumerate(self.size.tolist())]

    def costs(self) -> np.ndarray:
        return self.works.max(1)

    # -- 1. orders -------------------------------------------------------------------------------

    def start(self) -> None:
        """Longest first onto the least loaded rank with room (``index.balance.longest_first``), every micro-batch."""
        nl, pl = self.n.tolist(), self.p.tolist()
        for b, s in enumerate(self.size.tolist()):
            if s < 2:
                continue
            ids = self.order[b, :s].tolist()
            local = int(self._local(self.rows[b]))
            start = longest_first([nl[i] for i in ids], [pl[i] for i in ids], local, self.cp)
            self._set(b, [ids[j] for j in start])
        self._index()
        self.works = self._rank_works(np.arange(self.size.size), self.rows)

    def _unbalanced(self, b: np.ndarray) -> np.ndarray:
        w = self.works[b]
        return (self.size[b] > 1) & (w.max(1) > w.sum(1) / self.cp * (1 + _GOOD))

    def descend(self, which: np.ndarray, budget: int) -> int:
        """Best-improvement descent of the micro-batches ``which`` together; the candidates spent."""
        active = which[self._unbalanced(which)]
        spent = 0
        while active.size and spent < budget:
            group, i, j, swap = _candidates(self.size[active], self._grid)
            b = active[group]
            works = self._tiled(self._moved, b, i, j, swap)
            spent += int(b.size)
            score = order_score(works)
            first = np.lexsort((np.arange(b.size), score, group))  # each micro-batch's best candidate first
            lead = first[np.r_[True, group[first][1:] != group[first][:-1]]]
            better = score[lead] < order_score(self.works[active])
            for q in lead[better].tolist():
                k = int(b[q])
                ids = self.order[k, :self.size[k]].tolist()
                x, y = int(i[q]), int(j[q])
                if swap[q]:
                    ids[x], ids[y] = ids[y], ids[x]
                else:
                    ids.insert(y, ids.pop(x))
                self._set(k, ids)
                self.works[k] = works[q]
            self._reindex(np.unique(b[lead[better]]))
            active = active[better]
            active = active[self._unbalanced(active)]
        return spent

    # -- 2. exchanges ----------------------------------------------------------------------------

    def _room(self, need: int) -> None:
        """At least ``need`` order columns: an empty one past the longest micro-batch (a move appends there)."""
        cols = self.order.shape[1]
        if need > cols:
            grown = np.full((self.order.shape[0], max(need, 2 * cols)), self.null, dtype=np.int64)
            grown[:, :cols] = self.order
            self.order = grown
            self._index()

    def _runs(self, which: np.ndarray, lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every run of ``lengths`` consecutive positions in the micro-batches ``which``, ``(b, first, end)``;
        a length of 0 is the empty run at a micro-batch's end (where a move appends)."""
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for k in lengths:
            if k == 0:
                out.append((which, self.size[which], self.size[which]))
                continue
            count = np.maximum(self.size[which] - k + 1, 0)
            b = np.repeat(which, count)
            first = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
            out.append((b, first, first + k))
        return tuple(np.concatenate([o[f] for o in out]) if out else np.zeros(0, dtype=np.int64)
                     for f in range(3))  # type: ignore[return-value]

    def _long(self, run: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The single-sequence runs among ``run`` whose sequence takes at least half a rank's rows."""
        b, first, end = run
        keep = 2 * self.cp * self._p[self.order[b, first]] >= self.capacity
        return b[keep], first[keep], end[keep]

    def _on_slowest(self, run: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The single-sequence runs among ``run`` holding rows of their micro-batch's slowest rank."""
        b, first, end = run
        local = self._local(self.rows[b])
        h = self.works[b].argmax(1)
        start = self._start[b * self._cols + first]
        keep = (start < (h + 1) * local) & (start + self._p[self.order[b, first]] > h * local)
        return b[keep], first[keep], end[keep]

    def _partners(self, top: np.ndarray) -> np.ndarray:
        """The micro-batches a round exchanges with: all of them up to ``_PARTNERS``; past it ``top`` and
        the ``_PARTNERS`` whose slowest rank is closest to their mean (the most room for a heavier
        piece), so that a round's candidates, and the refinement, stay linear in the batch."""
        k, most = self.size.size, self._for_cp(_PARTNERS, 16)
        if k <= most:
            return np.arange(k, dtype=np.int64)
        excess = self.works.max(1) - self.works.sum(1) / self.cp
        calm = np.argsort(excess, kind="stable")[:most]
        return np.union1d(top, calm).astype(np.int64)

    def _exchanges(self, top: np.ndarray) -> tuple[np.ndarray, ...]:
        """Candidates ``(u, u1, u2, v, v1, v2, rows_u, rows_v)``: micro-batch ``u``'s run ``[u1, u2)`` and
        ``v``'s run ``[v1, v2)`` change places, one of the two in ``top``, both within the budget and
        keeping a sequence. The families (Note [Refining a packing]), ``u`` in ``top`` but the last:

        - one sequence of ``u`` for none (a move out), one (a swap), or, when it holds rows of ``u``'s
          slowest rank, a run of ``2 .. _RUN`` of ``v``;
        - a run of ``2 .. _RUN`` of ``u`` for one sequence of ``v`` that takes half a rank's rows or more;
        - one sequence of another micro-batch ``u`` moved into ``v`` in ``top`` (appended).
        """
        k = self._partners(top)
        rest = np.setdiff1d(k, top)
        singles, runs = self._runs(top, [1]), self._runs(k, range(2, _RUN + 1))
        cands = [(singles, self._runs(k, [0, 1]), True), (self._on_slowest(singles), runs, False),
                 (self._runs(top, range(2, _RUN + 1)), self._long(self._runs(k, [1])), False),
                 (self._runs(rest, [1]), self._runs(top, [0]), False)]
        cols = []
        for (ub, u1, u2), (vb, v1, v2), near in cands:
            ru = self._start[ub * self._cols + u2] - self._start[ub * self._cols + u1]
            rv = self._start[vb * self._cols + v2] - self._start[vb * self._cols + v1]
            # u takes v's run while rv <= hu, v takes u's while ru <= hv; each keeps a sequence while
            # what stays of it plus what arrives is not empty; a one-for-one swap (a run of v not empty)
            # changes the rows by at most shift (Note [Refining a packing], **Near swaps**)
            hu, hv = self.capacity - self.rows[ub] + ru, self.capacity - self.rows[vb] + rv
            lu, lv = u2 - u1, v2 - v1
            stay_u, stay_v = self.size[ub] - lu, self.size[vb] - lv
            shift = self._local(self.rows[ub]) // _SWAP_SHIFT
            step = max(1, _TILE_CELLS // max(vb.size, 1))
            for first in range(0, ub.size, step):  # tiles of rows, in order: the pairs come out row-major
                t = slice(first, first + step)
                ok = ((rv[None, :] <= hu[t, None]) & (ru[t, None] <= hv[None, :]) & (ub[t, None] != vb[None, :])
                      & (stay_u[t, None] + lv[None, :] > 0) & (stay_v[None, :] + lu[t, None] > 0))
                if near:
                    ok &= (np.abs(rv[None, :] - ru[t, None]) <= shift[t, None]) | (lv[None, :] == 0)
                i, j = np.nonzero(ok)
                i += first
                cols.append((ub[i], u1[i], u2[i], vb[j], v1[j], v2[j], self.rows[ub[i]] - ru[i] + rv[j],
                             self.rows[vb[j]] - rv[j] + ru[i]))
        return tuple(np.concatenate([c[f] for c in cols]) for f in range(8))

    def exchange(self, rounds: int, budget: int) -> None:
        """Exchanges of sequences between micro-batches that lower ``sum_m c_m`` exactly, best first."""
        self._rounds(rounds, budget, 1, self._runs_round)

    def _rounds(self, rounds: int, budget: int, room: int, propose: Callable[[np.ndarray, np.ndarray], _Round | None]
                ) -> None:
        """The exchange rounds: ``propose(top, costs)`` scores a round's candidates for the
        ``_EXCHANGE_TOP`` micro-batches furthest above their mean; the improving ones are applied best
        first, one per micro-batch, the touched micro-batches descend a step (all of them fully at the
        end). ``room``: the order columns a candidate may add past the longest micro-batch."""
        spent = 0
        touched_all: set[int] = set()
        for _ in range(rounds):
            if spent >= budget:
                break
            self._room(int(self.size.max()) + room)
            costs = self.costs()
            excess = costs - self.works.sum(1) / self.cp
            top = np.argsort(-excess, kind="stable")[:self._for_cp(_EXCHANGE_TOP, 2)]
            top = np.sort(top[excess[top] > 0])
            if top.size == 0:
                break
            proposed = propose(top, costs)
            if proposed is None:
                break
            u, v, gain, apply, scored = proposed
            spent += scored
            touched: set[int] = set()
            for c in np.lexsort((np.arange(u.size), -gain)).tolist():
                if gain[c] <= 0:
                    break
                a, b = int(u[c]), int(v[c])
                if a in touched or b in touched:
                    continue
                touched.update((a, b))
                apply(c)
            if not touched:
                break
            done = np.array(sorted(touched), dtype=np.int64)
            self._reindex(done)
            spent += self.descend(done, _DESCENT_AFTER_SWAP * done.size)
            touched_all.update(touched)
        if touched_all:
            self.descend(np.array(sorted(touched_all), dtype=np.int64), budget)

    def _runs_round(self, top: np.ndarray, costs: np.ndarray) -> _Round | None:
        """One round of :meth:`exchange`: the runs of :meth:`_exchanges`, spliced (``_spliced``)."""
        u, u1, u2, v, v1, v2, ru, rv = self._exchanges(top)
        if u.size == 0:
            return None
        wu = self._tiled(self._spliced, u, u1, u2, v, v1, v2, ru)
        scored = u.size
        # v's slowest rank is at least its new mean: only candidates that could still gain score v (the
        # two micro-batches hold the work they held together)
        total = self.works.sum(1)
        work_v = total[u] + total[v] - wu.sum(1)
        hope = costs[u] - wu.max(1) + costs[v] - work_v / self.cp > 0
        u, u1, u2, v, v1, v2, ru, rv, wu = (x[hope] for x in (u, u1, u2, v, v1, v2, ru, rv, wu))
        wv = self._tiled(self._spliced, v, v1, v2, u, u1, u2, rv)
        scored += u.size

        def apply(c: int) -> None:
            a, b = int(u[c]), int(v[c])
            old_a, old_b = self.order[a, :self.size[a]].tolist(), self.order[b, :self.size[b]].tolist()
            new_a = old_a[:u1[c]] + old_b[v1[c]:v2[c]] + old_a[u2[c]:]
            new_b = old_b[:v1[c]] + old_a[u1[c]:u2[c]] + old_b[v2[c]:]
            self._room(max(len(new_a), len(new_b)) + 1)
            self.size[a], self.size[b] = len(new_a), len(new_b)
            self._set(a, new_a)
            self._set(b, new_b)
            self.rows[a], self.rows[b] = ru[c], rv[c]
            self.works[a], self.works[b] = wu[c], wv[c]

        return u, v, costs[u] + costs[v] - wu.max(1) - wv.max(1), apply, scored

    # -- 2b. exchanges of whole groups -----------------------------------------------------------

    def _scored(self, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(Q, cp)`` works and ``(Q,)`` rows of whole candidate orders ``(Q, cols)`` (``null`` entries
        are empty places): the closed form from scratch, one ``searchsorted`` for all of them."""
        q = orders.shape[0]
        orders = np.concatenate([orders, np.full((q, 1), self.null, dtype=np.int64)], axis=1)  # an empty last
        p_o = self._p[orders]
        found = tables(p_o, self._n[orders], self._span)
        rows = p_o.sum(1)
        c = np.arange(q, dtype=np.int64)[:, None] * self._span + self._inner(rows)
        return self._framed(lookup(found, c), found[3].reshape(orders.shape)[:, -1]), rows

    def exchange_groups(self, group: int, rounds: int, budget: int) -> None:
        """:meth:`exchange` for packings whose every ``group`` consecutive sequences share a micro-batch:
        whole groups change micro-batch. For each top micro-batch ``u``: a group of ``u`` for a group of
        another micro-batch (member ``k`` takes member ``k``'s place), a group of ``u`` to the end of
        another, and a group of another to the end of ``u``; scored exactly from the whole new orders
        (:meth:`_scored`), kept only when ``c_u + c_v`` falls."""
        members = np.arange(self.n.size, dtype=np.int64).reshape(-1, group)
        self._rounds(rounds, budget, group + 1, functools.partial(self._groups_round, members))

    def _groups_round(self, members: np.ndarray, top: np.ndarray, costs: np.ndarray) -> _Round | None:
        """One round of :meth:`exchange_groups` (``members`` ``(units, group)``: each group's sequences)."""
        units, group = members.shape
        mb = self.where[members[:, 0]]
        rows_unit = self._p[members].sum(1)
        in_top = np.isin(mb, top)
        k = self._partners(top)
        mine, rest = np.flatnonzero(in_top), np.flatnonzero(~in_top & np.isin(mb, k))
        none = np.int64(-1)
        # (x leaves u for v, y leaves v for u, -1: none), u in top
        near = np.flatnonzero(np.isin(mb, k))  # the groups of the round's micro-batches
        x, y = np.repeat(mine, near.size), np.tile(near, mine.size)  # group for group
        x2, v2 = np.repeat(mine, k.size), np.tile(k, mine.size)  # a group of u to the end of v
        y3, u3 = np.repeat(rest, top.size), np.tile(top, rest.size)  # a group of v to the end of u
        swap, move = mb[x] != mb[y], mb[x2] != v2
        x = np.concatenate([x[swap], x2[move], np.full(y3.size, none)])
        y = np.concatenate([y[swap], np.full(int(move.sum()), none), y3])
        u = np.concatenate([mb[x[:int(swap.sum()) + int(move.sum())]], u3])
        v = np.concatenate([mb[y[:int(swap.sum())]], v2[move], mb[y3]])
        rx, ry = np.where(x >= 0, rows_unit[x], 0), np.where(y >= 0, rows_unit[y], 0)
        ru, rv = self.rows[u] - rx + ry, self.rows[v] - ry + rx
        du = ((y >= 0).astype(np.int64) - (x >= 0)) * group  # u's change of size (v's is minus it)
        ok = (ru <= self.capacity) & (rv <= self.capacity) & (self.size[u] + du > 0) & (self.size[v] - du > 0)
        x, y, u, v = x[ok], y[ok], u[ok], v[ok]
        if u.size == 0:
            return None
        new_u = self._regrouped(u, x, y, members)
        wu, _ = self._scored(new_u)
        scored = u.size
        work_v = self.works[v].sum(1) - (wu.sum(1) - self.works[u].sum(1))
        hope = costs[u] - wu.max(1) + costs[v] - work_v / self.cp > 0
        x, y, u, v, new_u, wu = (a[hope] for a in (x, y, u, v, new_u, wu))
        new_v = self._regrouped(v, y, x, members)
        wv, _ = self._scored(new_v)
        scored += v.size

        def apply(c: int) -> None:
            for m, order, w in ((int(u[c]), new_u[c], wu[c]), (int(v[c]), new_v[c], wv[c])):
                ids = order[order != self.null].tolist()
                self.size[m] = len(ids)
                self._set(m, ids)
                self.rows[m] = int(self._p[ids].sum())
                self.works[m] = w

        return u, v, costs[u] + costs[v] - wu.max(1) - wv.max(1), apply, scored

    def _regrouped(self, b: np.ndarray, out: np.ndarray, into: np.ndarray, members: np.ndarray) -> np.ndarray:
        """``(Q, cols)`` micro-batch ``b``'s order with group ``out`` leaving and group ``into`` arriving
        (-1: none): with both, ``into``'s member ``k`` takes ``out``'s member ``k``'s place; ``out`` alone
        leaves empty places; ``into`` alone is appended."""
        q = np.arange(b.size)
        orders = self.order[b].copy()
        g = members.shape[1]
        both, only_out, only_in = (out >= 0) & (into >= 0), (out >= 0) & (into < 0), (out < 0) & (into >= 0)
        for j in range(g):
            at_out = self.pos[members[np.maximum(out, 0), j]]
            orders[q[both], at_out[both]] = members[into[both], j]
            orders[q[only_out], at_out[only_out]] = self.null
            orders[q[only_in], self.size[b[only_in]] + j] = members[into[only_in], j]
        return orders


def _grid(size: int, grid: int) -> np.ndarray:
    """Up to ``grid`` buffer positions of a micro-batch of ``size`` sequences, evenly spread."""
    if size <= grid:
        return np.arange(size, dtype=np.int64)
    return np.unique(np.linspace(0, size - 1, grid).round().astype(np.int64))


@functools.lru_cache(maxsize=256)
def _moves(size: int, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The descent's moves in a micro-batch of ``size`` sequences, ``(i, j, swap)``: swaps of grid
    positions ``i < j`` and moves of ``i`` to ``j`` for ``i != j``."""
    at = _grid(size, grid)
    i, j = (x.reshape(-1) for x in np.meshgrid(at, at, indexing="ij"))
    keep = i != j
    i, j = i[keep], j[keep]
    up = i < j
    swap = np.zeros(int(up.sum()) + i.size, dtype=bool)
    swap[:int(up.sum())] = True
    return np.concatenate([i[up], i]), np.concatenate([j[up], j]), swap


def _candidates(sizes: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every descent move of micro-batches of ``sizes``, flat and grouped: ``(which, i, j, swap)``."""
    parts = [_moves(size, grid) for size in sizes.tolist()]
    counts = [p[0].size for p in parts]
    which = np.repeat(np.arange(len(parts), dtype=np.int64), counts)
    return (which, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]))
