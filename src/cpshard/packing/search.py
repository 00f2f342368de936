"""The search of a packing: the micro-batch count, then a fill and moves scored by a per-micro-batch model.

Note [Micro-batch packing] (``packing.pack``) describes it: the count is first fit decreasing's
(:func:`ffd_count`), raised by the count rules (:func:`micro_batch_counts`); :class:`Search` lays the
micro-batches out per DP rank, fills them longest first where the step rises least (in windows of at
most ``FILL_WINDOW`` micro-batches, so the cost is linear in the batch) and, under the additive
(zigzag) model, moves and swaps units out of the slowest DP rank. :class:`RoomTree` finds first fit's
bin in ``O(log K)``.
"""

from __future__ import annotations

import math

import numpy as np

from cpshard.base.errors import fail
from cpshard.base.layout import Layout
from cpshard.index.balance import zigzag_works
from cpshard.packing.bound import two_piece
from cpshard.packing.problem import Problem, by_unit

__all__ = ["FILL_WINDOW", "RoomTree", "Search", "ffd_count", "micro_batch_counts"]

_SEARCH_STEPS = 64  # moves / swaps tried on the slowest DP rank, at most
_MOVE_CELLS = 1 << 16  # a step scores moves of at most this many (sequence, micro-batch) pairs: the heaviest first
# ffd_count's estimate of its two ways, in microseconds: an item through the tree a level; a run; a run a bin
_TREE_STEP, _RUN_STEP, _RUN_BIN = 0.4, 25.0, 0.003
_SCAN_CELLS = 1 << 16  # ffd_count scans the open bins item by item up to this many (items x least bins)
FILL_WINDOW = 256  # micro-batches the fill scores for one unit, at most (Search.fill)
_SWAP_UNITS = 1 << 12  # a step scores swaps with at most this many units, evenly spread by size
_PATIENCE = 1  # the search stops after this many steps in a row that lowered only the sum of squares
# (the DP split is chosen again from exact costs at the end: assign)


def ffd_count(p: np.ndarray, capacity: int) -> int:
    """First-fit decreasing on the padded lengths: the bins it opens.

    Equal sizes at once: first fit puts a run of ``k`` items of size ``s`` into the open bins from the
    left, each bin taking ``floor(room / s)`` of them until the run ends, and opens new bins of
    ``floor(C / s)`` for the rest, so a run costs a few array operations over the open bins, not ``k``
    scans of them (``O(distinct sizes x bins)`` element operations instead of ``O(n x bins)`` Python
    steps). The count is first fit's, item by item. Where that is dearer than placing the ``n`` items
    one by one through a :class:`RoomTree` (``O(n log n)`` Python steps: many distinct sizes in a
    small batch), they go through the tree instead; and a small batch (items x bins at most
    ``_SCAN_CELLS``) scans a plain list of the open bins, cheaper still. The count is the same every way.
    """
    sizes, runs = np.unique(p, return_counts=True)
    bins = -(-int(p.sum()) // max(capacity, 1))
    if p.size * bins <= _SCAN_CELLS:  # a small batch: first fit item by item over a list of the open bins' rooms
        open_: list[int] = []
        for s in np.sort(p)[::-1].tolist():
            for b, r in enumerate(open_):
                if r >= s:
                    open_[b] = r - s
                    break
            else:
                open_.append(capacity - s)
        return max(1, len(open_))
    if p.size * math.log2(p.size + 1) * _TREE_STEP < sizes.size * (_RUN_STEP + bins * _RUN_BIN):
        tree = RoomTree(np.full(p.size, capacity, dtype=np.int64))
        used = -1
        for s in np.sort(p)[::-1].tolist():
            b = tree.first(s)
            tree.take(b, s)
            used = max(used, b)
        return max(1, used + 1)
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


def micro_batch_counts(total: int, dp: int, least: int, by: int, same: bool, num_seqs: int,
                       group: int = 1) -> list[int]:
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
    """The changes that can bring :func:`micro_batch_counts` to at most ``num_seqs`` micro-batches, and only those:
    a larger ``max_tokens`` helps only while first-fit's count (``total``) is what sets the counts, i.e.
    when even one micro-batch for the whole batch would leave few enough."""
    fixes = ["pass more sequences"]
    if dp > 1:
        fixes.append("a smaller dp_size")
    if least > 1:
        fixes.append("a smaller min_micro_batches")
    if by > 1:
        fixes.append("a smaller divisible_by")
    if same and dp > 1 and sum(micro_batch_counts(total, dp, least, by, False, 1 << 62)) <= num_seqs:
        fixes.append("same_count_across_dp=False")
    if total > 1 and sum(micro_batch_counts(1, dp, least, by, same, 1 << 62)) <= num_seqs:
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


class Search:
    """Micro-batches laid out per DP rank, filled and improved under the per-micro-batch model.

    It places **units**: ``group`` consecutive sequences that share a micro-batch (one sequence each
    when ``group`` is 1), with the members' rows, work and model vectors summed and their heaviest
    pieces' largest as the unit's. Arrays over micro-batches: rows, the model's additive part ``acc``
    (zigzag: per-rank work; contiguous: total work), the largest heaviest piece ``h1`` (contiguous; 0
    under zigzag) and the cost. :meth:`improve` runs only for the additive model (zigzag, ``cp = 1``):
    under the contiguous layout the exact refinement follows the fill."""

    def __init__(self, prob: Problem, counts: list[int], seed: int, group: int = 1) -> None:
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
            heavy = two_piece(prob.n, np.full(prob.n.shape, prob.capacity // cp))
            self.contiguous = True
        self.p, self.w = by_unit(prob.p, group), by_unit(prob.w, group)
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

        The micro-batches are scored in **windows** of at most ``FILL_WINDOW``: with ``G`` windows,
        micro-batch ``b`` is in window ``b mod G`` (so each window holds every DP rank's share) and the
        ``j``-th unit longest first goes to window ``j mod G`` (each window gets a like sample of the
        batch); the DP ranks' times are shared by all windows. A unit costs ``O(FILL_WINDOW)``, not
        ``O(micro-batches)``: the fill is linear in the batch. A unit its window has no room for is
        placed after the windows, scored over every micro-batch. With one window (up to
        ``FILL_WINDOW`` micro-batches, every batch of ``benchmarks/pack.py``) it is the plain fill.
        """
        key = self.heavy if self.contiguous else self.vec.max(1)
        units = np.lexsort((np.arange(self.p.size), -self.p, -key))
        k = self.owner.size
        windows = -(-k // FILL_WINDOW)
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
        members = [np.flatnonzero(owner == d) for d in range(self.dp)]
        base = times[owner] - cost  # the step a micro-batch's DP rank takes without it
        contiguous = self.contiguous
        # per unit, as Python ints or (cp, 1) columns: the loop below runs once a unit, so its NumPy calls
        # are few and write into buffers allocated once (same decisions as the plain expressions)
        p_of, heavy_of, w_of = self.p.tolist(), self.heavy.tolist(), self.vec[:, 0].tolist()
        col = np.ascontiguousarray(self.vec[:, :, None])
        room = prob.capacity - rows  # a micro-batch takes a unit of p rows while p is at most its room
        score, new, full = np.empty_like(base), np.empty_like(base), np.empty(rows.size, dtype=bool)
        grid = np.empty_like(acc)
        where = self.where
        missed: list[int] = []
        for i in units.tolist():
            if contiguous:
                np.add(tot, w_of[i] + cp - 1, out=new)
                new //= cp  # the new total's share of one rank, rounded up
                np.maximum(new, h1, out=new)
                np.maximum(new, heavy_of[i], out=new)
            else:
                np.add(acc, col[i], out=grid)
                grid.max(0, out=new)
            np.add(base, new, out=score)
            np.less(room, p_of[i], out=full)
            score[full] = big
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
            where[i] = bins[b]
            if contiguous:
                tot[b] += w_of[i]
            else:
                acc[:, b] += col[i, :, 0]
            rows[b] += p_of[i]
            room[b] -= p_of[i]
            size[b] += 1
            if heavy_of[i] > h1[b]:
                h1[b] = heavy_of[i]
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
