"""The relayout route: pure index math that moves a rank's rows between two twin plans.

No plan is named here: a route is built from the twins' **canonical rows** (each local row's row of
the padded buffer laid out in the caller's order), which each plan's index service lists
(``PlanIndices.canonical``); Note [Twin plans and their route] in ``cpshard/plan/twins.py`` says why
two twins list the same canonical rows. No communication (``cpshard.distributed.relayout`` runs a
route across ranks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from cpshard.index.segments import to_device

__all__ = ["Route", "build_route", "permutation", "rank_route"]


@dataclass(frozen=True)
class Route:
    """One rank's part of moving its local rows from ``src`` to ``dst`` (Note [Twin plans and their
    route]). Rows are the rank's flattened local rows, ``R = prod(local_shape)`` of them.

    Attributes:
        send_rows: ``(sum(send_splits),)`` int64 src-local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_rows: ``(sum(recv_splits),)`` int64 dst-local rows the received rows land on, in arrival order.
        recv_splits: rows received from each rank.
        keep_src: ``(K,)`` int64 src-local rows that stay on this rank ...
        keep_dst: ``(K,)`` ... and the dst-local rows they land on.
        rows: ``R``.
        total_remote: rows changing rank over the whole group (0: no rank communicates).
    """

    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    recv_splits: tuple[int, ...]
    keep_src: torch.Tensor
    keep_dst: torch.Tensor
    rows: int
    total_remote: int

    def to(self, device: torch.device) -> Route:
        move = functools.partial(to_device, device=device)
        return Route(move(self.send_rows), self.send_splits, move(self.recv_rows), self.recv_splits,
                     move(self.keep_src), move(self.keep_dst), self.rows, self.total_remote)

    def apply(self, local: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
        """``(R, ...)``: ``local`` ``(R, ...)``'s rows moved by the route, with ``received`` (the rows
        other ranks sent, in arrival order; None when nothing arrives) placed on ``recv_rows``."""
        out = local.new_empty(local.shape)
        if self.keep_src.numel():
            out.index_copy_(0, self.keep_dst, local.index_select(0, self.keep_src))
        if received is not None and received.shape[0]:
            out.index_copy_(0, self.recv_rows, received)
        return out


def permutation(canon_src: np.ndarray, canon_dst: np.ndarray, cp: int, rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(tgt, inv, total_remote)``: ``tgt[s * R + j] = d * R + l`` and its inverse, over every rank,
    from every rank's canonical rows under each twin (``(cp * R,)`` int64, rank 0's first)."""
    where = np.empty_like(canon_dst)
    where[canon_dst] = np.arange(canon_dst.size, dtype=np.int64)
    tgt = where[canon_src]
    inv = np.empty_like(tgt)
    inv[tgt] = np.arange(tgt.size, dtype=np.int64)
    rank_of = np.repeat(np.arange(cp, dtype=np.int64), rows)
    total_remote = int(np.count_nonzero(tgt // max(rows, 1) != rank_of))
    return tgt, inv, total_remote


def build_route(tgt: np.ndarray, inv: np.ndarray, total_remote: int, cp: int, rows: int, cp_rank: int) -> Route:
    """``cp_rank``'s route on the CPU from :func:`permutation`'s ``(tgt, inv, total_remote)``."""
    r = cp_rank
    return rank_route(tgt[r * rows:(r + 1) * rows], inv[r * rows:(r + 1) * rows], total_remote, cp, rows, r)


def rank_route(mine: np.ndarray, origin: np.ndarray, total_remote: int, cp: int, rows: int, cp_rank: int) -> Route:
    """``cp_rank``'s route on the CPU from its own slices of the permutation: ``mine`` ``(R,)`` int64,
    where each of its src-local rows goes (``d * R + l``), and ``origin`` ``(R,)`` int64, where each
    of its dst-local rows comes from (``s * R + j``); ``total_remote`` counts the group's moved rows."""
    r, span = cp_rank, max(rows, 1)
    to_rank = mine // span
    remote = to_rank != r
    out_idx = np.flatnonzero(remote)
    send_rows = out_idx[np.argsort(mine[out_idx], kind="stable")]  # by (dst rank, dst row)
    keep_src = np.flatnonzero(~remote)
    keep_dst = mine[keep_src] - r * rows
    origin = origin // span
    incoming = np.flatnonzero(origin != r)  # dst rows, ascending
    recv_rows = incoming[np.argsort(origin[incoming], kind="stable")]  # by (src rank, dst row)
    as_t = torch.from_numpy
    return Route(as_t(send_rows), tuple(np.bincount(to_rank[out_idx], minlength=cp).tolist()),
                 as_t(recv_rows), tuple(np.bincount(origin[incoming], minlength=cp).tolist()),
                 as_t(keep_src), as_t(np.ascontiguousarray(keep_dst)), rows, total_remote)
