"""The metadata of a variable-length attention kernel for one rank's query rows over the gathered keys.

Under context parallelism with all-gathered keys and values, rank ``r`` holds ``L`` query rows (its
plan rows) and, after the all-gather, every rank's ``L`` key rows side by side (``R * L`` rows, rank
0's first). ``flash_attn_varlen_func`` computes causal attention over packed segments; given the
right segments it computes this rank's document-causal attention exactly, with no mask tensor:

Note [Query segments and their keys]
------------------------------------
A **query segment** is a maximal run of this rank's token rows holding consecutive positions
``p0 .. p1`` of one document (zigzag: the two chunks of a document, one run where they meet on the
last rank; contiguous: one per document the rank holds part of). Its **keys** are the rows of the
gathered buffer holding positions ``k0 .. p1`` of the same document, in position order, where
``k0 = 0``, or ``max(0, p0 - w + 1)`` under a window of ``w`` positions (a query at ``p`` sees the
keys at ``p - w + 1 .. p``). With ``nq = p1 - p0 + 1`` queries and ``nk = p1 - k0 + 1 >= nq`` keys,
query ``i`` (position ``p0 + i``) may see key ``j`` (position ``k0 + j``) iff ``k0 + j <= p0 + i``,
that is ``j <= i + nk - nq``: flash-attn's causal mask aligned to the bottom-right corner (the
alignment of flash-attn >= 2.1 when ``nq != nk``); the window's lower bound is
``j >= i + nk - nq - (w - 1)``, flash-attn's ``window_size=(w - 1, 0)``. Every (query, key) pair
the document mask allows is then scored once, in exactly one segment, and no other pair.

The keys' rows come from the plan's restore index (``PlanIndices.unshard``: the gathered row of
every token in the caller's order), read at the document's positions ``k0 .. p1``; the query rows
are the rank's token rows, segment by segment. Pure NumPy over the rank's segments: no loop over
documents. ring-flash-attn's ``llama3_flash_attn_prepare_cu_seqlens`` computes the same kind of
metadata for its contiguous split of the whole buffer (one key range per rank, keys from each
document's start); here every layout and padding of a plan is covered, keys are listed per segment
(zigzag's two chunks read different key ranges) and a window shortens them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpshard.base.errors import check_int, check_rank
from cpshard.index import segments as _index
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["VarlenMetadata", "varlen_metadata"]

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class VarlenMetadata:
    """What ``flash_attn_varlen_func`` takes for one rank (Note [Query segments and their keys]).

    ``flash_attn_varlen_func(q[q_index], k[k_index], v[k_index], cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, causal=True, window_size=window_size)`` with ``q`` the rank's ``L``
    local rows and ``k``, ``v`` the gathered ``R * L`` rows (ring-rank order) returns the attention
    of the rows ``q_index`` (a :class:`~cpshard.BshdPlan`'s rank holds ``L = B * M / cp`` rows,
    flattened); the rank's other rows are pad rows, which the caller fills (zeros). Kept by the plan's
    index service: shared, not to be edited in place.
    """

    q_index: torch.Tensor  # (Nq,) int64: the rank's token rows, segment by segment
    k_index: torch.Tensor  # (Nk,) int64: rows of the gathered key buffer, segment by segment
    cu_seqlens_q: torch.Tensor  # (n + 1,) int32
    cu_seqlens_k: torch.Tensor  # (n + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    window_size: tuple[int, int]  # flash-attn's (left, right): (-1, -1) none; (w - 1, 0) for a window of w

    @property
    def num_segments(self) -> int:
        """``n``: the query segments (0 on a rank holding no token: nothing to call the kernel on)."""
        return self.cu_seqlens_q.numel() - 1

    def to(self, device: torch.device | str) -> VarlenMetadata:
        """The same metadata with its tensors on ``device`` (through pinned memory to CUDA)."""
        q, k, cq, ck = (_index.to_device(t, torch.device(device))
                        for t in (self.q_index, self.k_index, self.cu_seqlens_q, self.cu_seqlens_k))
        return VarlenMetadata(q, k, cq, ck, self.max_seqlen_q, self.max_seqlen_k, self.window_size)


def varlen_metadata(plan: Plan, cp_rank: int, *, window: int | None = None,
                    device: torch.device | str | None = None) -> VarlenMetadata:
    """Rank ``cp_rank``'s :class:`VarlenMetadata` under ``plan``: document-causal attention of its query
    rows over every rank's key rows gathered in rank order, each query seeing the keys of its own
    document at its position or before, and with ``window=w`` only the last ``w`` of them (itself
    included; ``w >= 1``; None: no window). On ``device`` (default: the CPU). Built once per (rank,
    window, device) and kept by the plan (Note [Query segments and their keys])."""
    check_plan_type(plan)
    cp_rank = check_rank(cp_rank, plan.cp_size)
    if window is not None:
        window = check_int("window", window, minimum=1)
    device = _CPU if device is None else torch.device(device)
    indices = plan.indices()
    if device != _CPU:
        return indices.kept_for("varlen", (cp_rank, window, device),
                                lambda: varlen_metadata(plan, cp_rank, window=window).to(device))
    return indices.kept_for("varlen", (cp_rank, window, device), lambda: _build(plan, cp_rank, window))


def _build(plan: Plan, cp_rank: int, window: int | None) -> VarlenMetadata:
    indices = plan.indices()
    seg = indices.segments(cp_rank)
    held = np.flatnonzero(seg.tokens)
    seq, pos, tokens = seg.seq[held], seg.pos[held], seg.tokens[held]
    q_index = _index.expand_np(seg.start[held], tokens)  # pad rows trail their segment: the token rows alone
    # query segments: runs of held segments continuing one document's positions (zigzag's chunks on the last rank)
    joins = (seq[1:] == seq[:-1]) & (pos[1:] == pos[:-1] + tokens[:-1])
    heads = np.flatnonzero(np.concatenate([[True], ~joins])) if held.size else held
    q_len = np.add.reduceat(tokens, heads) if heads.size else heads
    first, last = pos[heads], pos[heads] + q_len - 1
    k_first = first * 0 if window is None else np.maximum(first - (window - 1), 0)
    k_len = last + 1 - k_first
    # the gathered row of (buffer sequence, position): the restore index at the caller's token
    caller_cu = _index.int64_array(plan.input_cu_seqlens_py[:-1])
    doc_first = caller_cu if plan.order is None else caller_cu[np.array(plan.order, dtype=np.int64)]
    restore = indices.unshard(_CPU).numpy()
    k_index = restore[_index.expand_np(doc_first[seq[heads]] + k_first, k_len)].astype(np.int64)
    return VarlenMetadata(
        torch.from_numpy(q_index), torch.from_numpy(k_index), _cu(q_len), _cu(k_len),
        int(q_len.max()) if q_len.size else 0, int(k_len.max()) if k_len.size else 0,
        (-1, -1) if window is None else (window - 1, 0))


def _cu(lengths: np.ndarray) -> torch.Tensor:
    out = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out)
