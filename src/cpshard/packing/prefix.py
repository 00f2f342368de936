"""Prefix work of many buffer orders at once: position tables, and ``G`` at any row.

``G_q(x)``, the causal work of the first ``x`` buffer rows of order ``q``, is what every exact score of
the refinement reads (Note [Refining a packing] in ``packing.refine``; Note [Causal work under the
contiguous layout] in ``index.balance``). Pure NumPy on int64 arrays. :func:`tables` lays out every
position of ``Q`` orders under one sorted array of keys ``q * span + end row``; :func:`lookup` finds the
position holding a row with one binary search, :class:`Buckets` with a table of buckets and a few steps.
"""

from __future__ import annotations

import numpy as np

from cpshard.index.balance import tri

__all__ = ["Buckets", "at_position", "lookup", "tables"]


class Buckets:
    """The position holding a key, from a table of buckets of ``2**shift`` key values and a few steps.

    For ``orders`` orders of ``span`` keys each (keys ``q * span + x``), ``rows`` the rows a position of a
    full order holds on average: a bucket is about a quarter of that, so a key steps past a few keys on
    average after its bucket's entry, where a binary search would take ``log2`` of all keys.

    >>> found = tables(np.array([[3, 2, 0]]), np.array([[3, 1, 0]]), span=8)
    >>> b = Buckets(1, 8, rows=2); b.fill(found[0], np.array([0]))
    >>> b.position(found[0], np.array([0, 2, 3, 4, 6])).tolist()  # rows 0-2 are position 0's, 3-4 position 1's
    [0, 0, 1, 1, 2]
    """

    def __init__(self, orders: int, span: int, rows: int) -> None:
        self.span = span
        self.shift = max(0, (rows // 4).bit_length() - 1)
        self.first = np.zeros((orders * span >> self.shift) + 1, dtype=np.int64)

    def fill(self, keys: np.ndarray, which: np.ndarray) -> None:
        """The entries of the orders ``which``: for every bucket that starts in order ``q``'s
        ``[q span, (q + 1) span)``, the position holding its first key (``searchsorted``, right). An entry
        depends on its own order's keys only, so an order whose keys changed refills its own."""
        size = 1 << self.shift
        lo = -(-(which * self.span) // size)
        count = -(-((which + 1) * self.span) // size) - lo
        t = np.arange(int(count.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(count) - count), count)
        self.first[t] = np.searchsorted(keys, t << self.shift, side="right")

    def position(self, keys: np.ndarray, key: np.ndarray) -> np.ndarray:
        """``searchsorted(keys, key, side="right")``: the bucket's entry, then a step past every key in between."""
        flat = key.reshape(-1)
        j = self.first[flat >> self.shift]
        more = np.flatnonzero(keys[j] <= flat)
        while more.size:
            j[more] += 1
            more = more[keys[j[more]] <= flat[more]]
        return j.reshape(key.shape)


def tables(p_o: np.ndarray, n_o: np.ndarray, span: int) -> tuple[np.ndarray, ...]:
    """Per position of orders whose padded and real lengths are ``p_o``, ``n_o`` ``(Q, cols)`` (the last
    column empty), flat: the search keys ``q * span + end row`` (the last column's ``q``'s last key, so
    that every row of order ``q`` finds a position), ``q * span + start row``, the start row, the work
    before it and the length. One sorted key array over all ``Q`` orders."""
    w_o = tri(n_o)
    ends = np.cumsum(p_o, 1)
    start = ends - p_o
    base = np.arange(p_o.shape[0], dtype=np.int64)[:, None] * span
    keys = base + ends
    keys[:, -1] = base[:, 0] + span - 1
    return (keys.reshape(-1), (base + start).reshape(-1), start.reshape(-1), (np.cumsum(w_o, 1) - w_o).reshape(-1),
            n_o.reshape(-1))


def lookup(tables: tuple[np.ndarray, ...], key: np.ndarray) -> np.ndarray:
    """``G`` at ``key = q * span + x`` (:func:`tables`): the work before the position holding row ``x``
    of order ``q``, plus that sequence's own prefix up to ``x``. One ``searchsorted`` for all keys."""
    return at_position(tables, key, np.searchsorted(tables[0], key, side="right"))  # the position holding each row


def at_position(tables: tuple[np.ndarray, ...], key: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``G`` at ``key``, ``j`` the position holding it (:func:`lookup`)."""
    _, key_start, _, before, length = tables
    return before[j] + tri(np.minimum(key - key_start[j], length[j]))
