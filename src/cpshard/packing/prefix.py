"""Prefix work of many buffer orders at once: position tables, and ``G`` at any row.

``G_q(x)``, the causal work of the first ``x`` buffer rows of order ``q``, is what every exact score of
the refinement reads (Note [Refining a packing] in ``packing.refine``; Note [Causal work under the
contiguous layout] in ``index.balance``). Pure NumPy on int64 arrays. :func:`tables` lays out every
position of ``Q`` orders under one sorted array of keys ``q * span + end row``; :func:`lookup` finds the
position holding each row with one binary search over them.
"""

from __future__ import annotations

import numpy as np

from cpshard.index.balance import tri

__all__ = ["lookup", "tables"]


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
    of order ``q``, plus that sequence's own prefix up to ``x``. One ``searchsorted`` for all keys.

    >>> found = tables(np.array([[3, 2, 0]]), np.array([[3, 1, 0]]), span=8)  # lengths 3 and 1, padded 3, 2
    >>> lookup(found, np.array([0, 1, 3, 4, 5, 6])).tolist()  # 1 + 2 + 3 pairs, then 1, then pad rows
    [0, 1, 6, 7, 7, 7]
    """
    _, key_start, _, before, length = tables
    j = np.searchsorted(tables[0], key, side="right")  # the position holding each row
    return before[j] + tri(np.minimum(key - key_start[j], length[j]))
