"""Causal attention under a plan, as pure index math and arithmetic: which keys each query row may see
(the mask), how much work each rank does, and the attention of a rank's query rows against gathered
keys in blocks. No communication: ``cpshard.attention`` gathers the keys (through
``cpshard.distributed``) and calls these; the CLI, ``cpshard verify`` and the balancer read the work.

Note [Reference CP attention]
-----------------------------
Rank ``r`` holds the query, key and value rows the plan gives it. Keys and values are all-gathered
over the CP group (one ``all_gather_single`` per call, keys and values packed side by side), so the
gathered buffer holds every rank's local rows in rank order: buffer row ``s * L + j`` is rank
``s``'s local row ``j``. What that row *is* (its sequence, its position, whether it is a token) is
pure index math from the plan: ``plan.sequence_ids(s)``, ``plan.position_ids(s)`` and
``plan.token_mask(s)``, the same on every rank. The mask of query row ``i`` and key row ``j``::

    token(i) and token(j) and seq(i) == seq(j) and pos(j) <= pos(i)

(same sequence, causal by position, real tokens only). A pad query row sees no key and outputs
zeros; a pad key is never seen. This is the mask a varlen kernel derives from ``cu_seqlens`` and
the layout; :func:`attention_mask` writes it out densely, ``(L, cp * L)``, for tests.

:func:`attention` never builds that matrix. It walks the rank's query rows in **blocks** (runs of
consecutive local rows, whole sequences where they fit) and scores each block only against the keys
it can see: the token keys of the block's sequences whose position is at most the block's largest
query position. A block holds at most ``_BLOCK_SCORES`` (query, key) pairs per head, a long
sequence's rows being cut into several blocks; each block runs under activation checkpointing, so
its scores are recomputed in the backward instead of kept. Memory is then bounded by one block
(``H * _BLOCK_SCORES`` scores, a few copies) whatever the batch, and the work is the mask's True
entries plus at most one block's worth per block, not ``L * T``. The result equals the dense
arithmetic (:func:`attend_gathered` under :func:`attention_mask`) to rounding: a masked key
contributes an exact zero there and is absent here. It is a reference for checks, not a kernel.

The **layout-naive** variant computes the same thing under one wrong belief, the one of kernels
that address rows through a single rank-local ``global_start``: that rank ``s`` holds the global
padded rows ``s * L .. (s + 1) * L - 1``. Its index math is the plan's contiguous twin (the same
padded lengths, ``layout="contiguous"``), so it equals :func:`attention` under the contiguous layout
and silently attends to the wrong rows under zigzag. ``cpshard verify`` shows that it is caught.

Autograd: differentiable in ``q``, ``k`` and ``v``. Every rank's queries use every rank's keys, so
the backward of the all-gather sums the key/value gradients over the group (one ``all_reduce`` of
the gathered gradient, whose own slice each rank keeps): each rank gets the gradient of the *sum of
all ranks' outputs* with respect to its own key/value rows, which is what the single-process
attention gives when the ranks' losses add up to the batch's.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from cpshard.base.errors import check_int
from cpshard.base.layout import Layout
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["attend_blocks", "attend_gathered", "attention_mask", "attention_work", "contiguous_twin",
           "naive_attention_mask"]


# -- pure index math (callable for every rank in one process) --------------------------------


def contiguous_twin(plan: Plan) -> Plan:
    """``plan`` read as if rank ``s`` held global rows ``s * L .. (s + 1) * L - 1``: the same padded
    lengths, ``layout="contiguous"`` (the belief of a layout-naive kernel): its contiguous twin
    (:meth:`~cpshard.plan.Plan.twin`). ``plan`` itself if it is contiguous already or ``cp_size == 1``."""
    check_plan_type(plan)
    if plan.layout is Layout.CONTIGUOUS or plan.cp_size == 1:
        return plan
    return plan.twin(Layout.CONTIGUOUS)


def _row_meta(plan: Plan, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seq, pos, token)`` of ``cp_rank``'s flattened local rows, each ``(prod(local_shape),)``."""
    return (plan.sequence_ids(cp_rank).reshape(-1), plan.position_ids(cp_rank).reshape(-1),
            plan.token_mask(cp_rank).reshape(-1))


def attention_mask(plan: Plan, cp_rank: int, window: int | None = None) -> torch.Tensor:
    """``(R, cp * R)`` bool, ``R = prod(plan.local_shape)``: may local query row ``i`` attend to row
    ``j`` of the gathered buffer (every rank's flattened local rows, in rank order)? Note [Reference
    CP attention]. ``window``: a sliding window of that many positions (a key at most ``window - 1``
    positions before the query), as Mistral's and Qwen2's windowed layers. Pure index math; CPU.

    Example, ``ShardPlan.build([3], cp_size=2)`` (zigzag, rows ``P = 4``: rank 0 holds positions
    ``0, 3`` (pad), rank 1 positions ``1, 2``; buffer = ``[p0, pad, p1, p2]``)::

        rank 0, query p0 : [True,  False, False, False]
        rank 1, query p2 : [True,  False, True,  True ]
    """
    check_plan_type(plan)
    q_seq, q_pos, q_tok = _row_meta(plan, cp_rank)
    keys = [_row_meta(plan, s) for s in range(plan.cp_size)]
    k_seq, k_pos, k_tok = (torch.cat(parts) for parts in zip(*keys))
    allowed = ((q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
               & q_tok[:, None] & k_tok[None, :])
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def naive_attention_mask(plan: Plan, cp_rank: int) -> torch.Tensor:
    """The mask a layout-naive kernel uses: :func:`attention_mask` of :func:`contiguous_twin`.

    Under the contiguous layout it equals :func:`attention_mask`; under zigzag it does not."""
    return attention_mask(contiguous_twin(plan), cp_rank)


def attention_work(plan: Plan) -> list[int]:
    """Per rank, the (query, key) pairs its causal attention scores: ``sum(pos + 1)`` over its token rows.

    The one work model of cpshard: what ``cpshard plan`` and ``cpshard verify`` report as the
    balance (max / mean), and what the balanced order (``index.balance``, whose scoring of many orders at
    once is its closed form under the contiguous layout; ``tests/test_balance.py`` checks they
    agree) evens out. Equal to the number of True entries of :func:`attention_mask`. Pure; per
    segment, no mask is built.
    """
    check_plan_type(plan)
    return plan.indices().work()


#: (query, key) pairs per head that one block of query rows scores at most (Note [Reference CP attention]):
#: 2**18 pairs are 2 MiB of float64 scores per head. Larger blocks do not run faster on the CPU, and
#: the allocator keeps more of their freed memory (benchmarks/verify_memory.py measures the peak)
_BLOCK_SCORES = 2**18


@dataclasses.dataclass(frozen=True)
class _Block:
    """Query rows ``start .. stop - 1`` and the gathered-buffer rows of the keys they may see, with the
    (sequence, position) of both, from which the block's mask is rebuilt (it is never stored)."""

    start: int
    stop: int
    keys: torch.Tensor      # (K,) int64 rows of the gathered buffer, token keys only
    q_seq: torch.Tensor     # (stop - start,)
    q_pos: torch.Tensor
    q_tok: torch.Tensor
    k_seq: torch.Tensor     # (K,)
    k_pos: torch.Tensor

    def to(self, device: torch.device) -> _Block:
        return _Block(self.start, self.stop, *(t.to(device) for t in (self.keys, self.q_seq, self.q_pos, self.q_tok,
                                                                       self.k_seq, self.k_pos)))


def _blocks(plan: Plan, cp_rank: int, max_scores: int) -> list[_Block]:
    """Cover ``cp_rank``'s flattened query rows with consecutive blocks of at most ``max_scores``
    (query, key) pairs each (a block of one row may exceed it: it sees every key it needs)."""
    q_seq, q_pos, q_tok = (t.numpy() for t in _row_meta(plan, cp_rank))
    metas = [_row_meta(plan, s) for s in range(plan.cp_size)]
    k_seq, k_pos, k_tok = (torch.cat(parts).numpy() for parts in zip(*metas))
    # per sequence, the positions of its token keys, sorted: how many keys a query at position p sees
    token_keys = np.flatnonzero(k_tok)
    order = np.lexsort((k_pos[token_keys], k_seq[token_keys]))
    sorted_seq, sorted_pos = k_seq[token_keys][order], k_pos[token_keys][order]
    rows = q_seq.shape[0]
    # runs of consecutive query rows of one sequence (both layouts keep a sequence's local rows together)
    cuts = np.flatnonzero(np.diff(q_seq)) + 1 if rows else np.zeros(0, np.int64)
    starts = np.concatenate([[0], cuts]).astype(np.int64) if rows else cuts
    stops = np.concatenate([cuts, [rows]]).astype(np.int64) if rows else cuts
    pieces: list[tuple[int, int]] = []  # row ranges, each within one run and under the budget alone
    cost: list[int] = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        seq = int(q_seq[a])
        lo, hi = np.searchsorted(sorted_seq, seq, "left"), np.searchsorted(sorted_seq, seq, "right")
        tok = q_tok[a:b]
        if not tok.any():
            pieces.append((a, b))
            cost.append(0)
            continue
        # keys seen by rows a .. j: those of the sequence at positions <= max token position so far
        seen = np.searchsorted(sorted_pos[lo:hi], np.maximum.accumulate(np.where(tok, q_pos[a:b], -1)), "right")
        j = a
        while j < b:
            # the longest prefix of rows j .. whose (rows x keys) fits (at least one row)
            span = np.arange(1, b - j + 1)
            fits = np.flatnonzero(span * seen[j - a:] <= max_scores)
            n = int(fits[-1]) + 1 if fits.size else 1
            pieces.append((j, j + n))
            cost.append(int(seen[j - a + n - 1]))
            j += n
    blocks: list[_Block] = []
    i = 0
    while i < len(pieces):  # greedy: consecutive pieces share a block while the block's pairs fit
        a, b = pieces[i]
        keys = cost[i]
        i += 1
        while i < len(pieces) and (pieces[i][1] - a) * (keys + cost[i]) <= max_scores:
            keys += cost[i]
            b = pieces[i][1]
            i += 1
        seqs = np.unique(q_seq[a:b][q_tok[a:b]])
        top = int(q_pos[a:b][q_tok[a:b]].max()) if seqs.size else -1
        idx = np.flatnonzero(k_tok & np.isin(k_seq, seqs) & (k_pos <= top))
        blocks.append(_Block(a, b, *(torch.from_numpy(np.ascontiguousarray(t)) for t in (
            idx.astype(np.int64), q_seq[a:b], q_pos[a:b], q_tok[a:b], k_seq[idx], k_pos[idx]))))
    return blocks


def _device_blocks(plan: Plan, rank: int, device: torch.device, max_scores: int) -> list[_Block]:
    """:func:`_blocks` on ``device``, built once per plan, rank and device and kept by the plan (shared:
    read only; index vectors only, O(rows + keys seen))."""
    return plan.indices().kept_for("blocks", (rank, device, max_scores),
                                   lambda: [b.to(device) for b in _blocks(plan, rank, max_scores)])


def _attend_block(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, block: _Block,
                  scale: float | None) -> torch.Tensor:
    """One block's output ``(stop - start, H, D)``: its rows of ``q`` against its keys only."""
    mask = ((block.q_seq[:, None] == block.k_seq[None, :]) & (block.k_pos[None, :] <= block.q_pos[:, None])
            & block.q_tok[:, None])
    return attend_gathered(q, k_all.index_select(0, block.keys), v_all.index_select(0, block.keys), mask,
                           scale=scale)


def attend_blocks(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, plan: Plan, cp_rank: int, *,
                  scale: float | None = None, max_scores: int | None = None) -> torch.Tensor:
    """What :func:`attend_gathered` computes under :func:`attention_mask` ``(plan, cp_rank)``, in blocks
    of query rows (Note [Reference CP attention]): ``q`` ``(R, H, D)``, ``k_all`` / ``v_all``
    ``(cp * R, H, D)`` the gathered keys and values; returns ``(R, H, D)``. No communication;
    callable for every rank in one process. ``max_scores``: (query, key) pairs per head and block
    (default ``_BLOCK_SCORES``); memory is one block's, each recomputed in the backward."""
    budget = _BLOCK_SCORES if max_scores is None else check_int("max_scores", max_scores, minimum=1)
    blocks = _device_blocks(plan, cp_rank, q.device, budget)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_all, v_all))
    outs = []
    for block in blocks:
        rows = q[block.start:block.stop]
        if not block.keys.numel():  # pad rows only, or no key to see: zeros, as the dense mask gives
            outs.append(torch.zeros_like(rows))
        elif keep:
            outs.append(checkpoint(_attend_block, rows, k_all, v_all, block, scale, use_reentrant=False))
        else:
            outs.append(_attend_block(rows, k_all, v_all, block, scale))
    return torch.cat(outs) if outs else torch.zeros_like(q)


def attend_gathered(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor, *,
                    scale: float | None = None) -> torch.Tensor:
    """The attention arithmetic, no communication: ``q`` ``(R, H, D)`` against the gathered ``k_all``,
    ``v_all`` ``(cp * R, H, D)`` under ``mask`` ``(R, cp * R)`` (:func:`attention_mask`); returns
    ``(R, H, D)``, zeros on rows whose mask is empty. Callable for every rank in one process."""
    q = q * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # on q: no score-sized copy
    scores = torch.einsum("qhd,khd->hqk", q, k_all)
    # a finite fill, not -inf: a masked key's weight is exactly 0 beside any key a row sees, and a row
    # that sees no key gets uniform weights (never NaN), zeroed below
    probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), -1)
    out = torch.einsum("hqk,khd->qhd", probs, v_all)
    return out * mask.any(-1)[:, None, None]
