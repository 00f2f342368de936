"""The last step of a packing: its micro-batches, with exact costs, to the DP ranks (counts fixed).

Step 3 of Note [Refining a packing] (``packing.refine``): longest first to the least loaded DP rank
with a place left, then swaps of one micro-batch of the slowest rank with one of another while the
slowest rank's sum falls. Each swap is found in ``O(K log K)`` (:func:`best_swap`), at most
``_ASSIGN_SWAPS`` of them: linear in the batch up to a log. Deterministic (ties to the lowest index).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["assign", "best_swap"]

_ASSIGN_SWAPS = 256  # swaps at most


def assign(costs: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """``(K,)`` the DP rank of each micro-batch: ``counts[d]`` on rank ``d``, the slowest rank's sum low.

    Longest first to the least loaded rank with a place left, then, while it lowers the slowest rank's
    sum, the best swap of one of its micro-batches with one of another rank (Note [Refining a packing]).
    """
    k, dp = costs.size, len(counts)
    owner = np.zeros(k, dtype=np.int64)
    if dp == 1:
        return owner
    sums = np.zeros(dp, dtype=np.int64)
    left = np.array(counts, dtype=np.int64)
    for b in np.lexsort((np.arange(k), -costs)).tolist():
        d = int(np.argmin(np.where(left > 0, sums, np.iinfo(np.int64).max)))
        owner[b], left[d] = d, left[d] - 1
        sums[d] += costs[b]
    for _ in range(min(4 * k, _ASSIGN_SWAPS)):
        slow = int(np.argmax(sums))
        swap = best_swap(costs, owner, sums, slow)
        if swap is None:
            break
        u, v, diff = swap
        du = int(owner[v])
        owner[u], owner[v] = du, slow
        sums[slow] -= diff
        sums[du] += diff
    return owner


def best_swap(costs: np.ndarray, owner: np.ndarray, sums: np.ndarray, slow: int) -> tuple[int, int, int] | None:
    """The swap of a micro-batch ``u`` of rank ``slow`` with a micro-batch ``v`` of another rank that
    leaves the largest rank sum least, if below ``sums[slow]``: ``(u, v, costs[u] - costs[v])``.

    For ``u`` and the other rank ``d``, the largest sum after the swap, ``max(S - x, S_d + x, rest)``
    with ``x = c_u - c_v``, falls while ``x`` nears ``(S - S_d) / 2`` from either side, so only the two
    costs of ``d`` around ``c_u - (S - S_d) / 2`` can be best: one ``searchsorted`` per rank, ``O(K log K)``
    in all, not the ``O(K^2)`` table of every pair (ties: the lowest ``u``, then the lowest ``v``)."""
    mine = np.flatnonzero(owner == slow)
    rest = _largest_other(sums, slow)
    best: tuple[int, int, int, int] | None = None  # (worst, u, v, diff)
    for d in range(sums.size):
        if d == slow:
            continue
        theirs = np.flatnonzero(owner == d)
        if not theirs.size or not mine.size:
            continue
        theirs = theirs[np.argsort(costs[theirs], kind="stable")]
        c = costs[theirs]
        target = costs[mine] * 2 - (sums[slow] - sums[d])  # twice the c_v that halves the gap
        pos = np.searchsorted(c * 2, target)
        for at in (np.maximum(pos - 1, 0), np.minimum(pos, c.size - 1)):
            diff = costs[mine] - c[at]
            worst = np.maximum(np.maximum(sums[slow] - diff, sums[d] + diff), rest[d])
            key = np.lexsort((theirs[at], mine, worst))[0]
            cand = (int(worst[key]), int(mine[key]), int(theirs[at][key]), int(diff[key]))
            if best is None or cand[:3] < best[:3]:
                best = cand
    if best is None or best[0] >= sums[slow]:
        return None
    return best[1], best[2], best[3]


def _largest_other(sums: np.ndarray, slow: int) -> np.ndarray:
    """``(dp,)``: for each rank ``d``, the largest sum of the ranks other than ``slow`` and ``d`` (-1 if none)."""
    out = np.full(sums.size, -1, dtype=np.int64)
    by = [int(r) for r in np.argsort(-sums, kind="stable") if r != slow]
    for d in range(sums.size):
        for r in by[:2]:
            if r != d:
                out[d] = sums[r]
                break
    return out
