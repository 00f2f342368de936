"""Reference context-parallel attention: a rank's query rows against the whole batch's keys.

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
the layout, written out densely: ``(L, cp * L)`` per head, so it is a reference for checks, not a
kernel (memory grows with ``L * T``).

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
import functools
import math
from typing import Any, Union

import torch
import torch.distributed as dist

from cpshard._errors import check_tensor, fail
from cpshard.bshd import BshdPlan
from cpshard.distributed import group_rank
from cpshard.layout import Layout
from cpshard.ops import check_plan_type
from cpshard.plan import ShardPlan

__all__ = ["attend_gathered", "attention", "attention_mask", "attention_work", "contiguous_twin", "naive_attention",
           "naive_attention_mask"]

Plan = Union[ShardPlan, BshdPlan]


# -- pure index math (callable for every rank in one process) --------------------------------


def contiguous_twin(plan: Plan) -> Plan:
    """``plan`` read as if rank ``s`` held global rows ``s * L .. (s + 1) * L - 1``: the same padded
    lengths, ``layout="contiguous"`` (the belief of a layout-naive kernel). ``plan`` itself if it is
    contiguous already or ``cp_size == 1``."""
    check_plan_type(plan)
    if plan.layout is Layout.CONTIGUOUS or plan.cp_size == 1:
        return plan
    return dataclasses.replace(plan, layout=Layout.CONTIGUOUS, alignment=None)  # type: ignore[arg-type]


def _row_meta(plan: Plan, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seq, pos, token)`` of ``cp_rank``'s flattened local rows, each ``(prod(local_shape),)``."""
    return (plan.sequence_ids(cp_rank).reshape(-1), plan.position_ids(cp_rank).reshape(-1),
            plan.token_mask(cp_rank).reshape(-1))


def attention_mask(plan: Plan, cp_rank: int) -> torch.Tensor:
    """``(R, cp * R)`` bool, ``R = prod(plan.local_shape)``: may local query row ``i`` attend to row
    ``j`` of the gathered buffer (every rank's flattened local rows, in rank order)? Note [Reference
    CP attention]. Pure index math; CPU.

    Example, ``ShardPlan.build([3], cp_size=2)`` (zigzag, rows ``P = 4``: rank 0 holds positions
    ``0, 3`` (pad), rank 1 positions ``1, 2``; buffer = ``[p0, pad, p1, p2]``)::

        rank 0, query p0 : [True,  False, False, False]
        rank 1, query p2 : [True,  False, True,  True ]
    """
    check_plan_type(plan)
    q_seq, q_pos, q_tok = _row_meta(plan, cp_rank)
    keys = [_row_meta(plan, s) for s in range(plan.cp_size)]
    k_seq, k_pos, k_tok = (torch.cat(parts) for parts in zip(*keys))
    return ((q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            & q_tok[:, None] & k_tok[None, :])


def naive_attention_mask(plan: Plan, cp_rank: int) -> torch.Tensor:
    """The mask a layout-naive kernel uses: :func:`attention_mask` of :func:`contiguous_twin`.

    Under the contiguous layout it equals :func:`attention_mask`; under zigzag it does not."""
    return attention_mask(contiguous_twin(plan), cp_rank)


def attention_work(plan: Plan) -> list[int]:
    """Per rank, the (query, key) pairs its causal attention scores: ``sum(pos + 1)`` over its token rows.

    What ``cpshard plan`` and ``cpshard verify`` report as the balance (max / mean); equal to the
    number of True entries of :func:`attention_mask`. Pure; no mask is built.
    """
    check_plan_type(plan)
    work = []
    for r in range(plan.cp_size):
        mask = plan.token_mask(r)
        work.append(int((plan.position_ids(r)[mask] + 1).sum()))
    return work


# -- communication (the one collective of the forward, and of the backward) -------------------


class _GatherRowsSumGrad(torch.autograd.Function):
    """All-gather along dim 0 (``all_gather_single``); backward: the gathered gradient summed over the
    group (``all_reduce``), of which the caller keeps its own rows. The pairing of nanotron's
    ``DifferentiableAllGather`` / ``DifferentiableReduceScatterSum``; ``all_reduce`` because gloo has
    no reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        local = local.contiguous()
        ctx.rows, ctx.rank, ctx.group = local.shape[0], rank, group
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # summed in at least float32: gloo reduces half precision poorly or not at all
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous()
        dist.all_reduce(wide, group=ctx.group)
        own = wide[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]
        return own.to(grad.dtype), None, None, None


# -- the attention --------------------------------------------------------------------------


def _check_qkv(q: Any, k: Any, v: Any, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = plan.local_shape
    out = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        t = check_tensor(name, t)
        if t.dim() != len(lead) + 2 or tuple(t.shape[:len(lead)]) != lead:
            fail(name, f"tensor of shape {tuple(t.shape)}", f"must be plan.local_shape + (heads, head_dim) = "
                 f"{lead} + (H, D)", "pass this rank's rows with the heads split out, e.g. x.view(L, H, D)")
        out.append(t)
    q, k, v = out
    if q.shape != k.shape or k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        fail("k", f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}",
             "q, k and v must have one shape and dtype (no grouped-query heads in the reference)",
             "repeat the key/value heads to the query heads first")
    if q.device != k.device or k.device != v.device:
        fail("k", f"q on {q.device}, k on {k.device}, v on {v.device}", "must be on one device",
             "move them to one device")
    return q, k, v


def _rank(plan: Plan, group: Any) -> int:
    if plan.cp_size == 1 and group is None:
        return 0
    return group_rank(plan, group)


@functools.lru_cache(maxsize=4)  # a few plans: each mask is (R, cp * R) bytes
def _device_mask(plan: Plan, rank: int, device: torch.device) -> torch.Tensor:
    """:func:`attention_mask` on ``device``, built once per plan value, rank and device (shared: read only)."""
    return attention_mask(plan, rank).to(device)


def attend_gathered(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor, *,
                    scale: float | None = None) -> torch.Tensor:
    """The attention arithmetic, no communication: ``q`` ``(R, H, D)`` against the gathered ``k_all``,
    ``v_all`` ``(cp * R, H, D)`` under ``mask`` ``(R, cp * R)`` (:func:`attention_mask`); returns
    ``(R, H, D)``, zeros on rows whose mask is empty. Callable for every rank in one process."""
    scores = torch.einsum("qhd,khd->hqk", q, k_all)
    scores = scores * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    # a finite fill, not -inf: a row without keys gives uniform weights, zeroed by the mask (never NaN)
    probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), -1) * mask
    return torch.einsum("hqk,khd->qhd", probs, v_all)


def _attend(q: Any, k: Any, v: Any, plan: Plan, group: Any, scale: float | None, naive: bool) -> torch.Tensor:
    check_plan_type(plan)
    q, k, v = _check_qkv(q, k, v, plan)
    rank = _rank(plan, group)
    rows = math.prod(plan.local_shape)
    heads, dim = q.shape[-2:]
    kv = torch.cat([k, v], -1).reshape(rows, heads, 2 * dim)
    if plan.cp_size > 1:
        kv = _GatherRowsSumGrad.apply(kv, group, rank, plan.cp_size)
    k_all, v_all = kv.split(dim, -1)  # (cp * R, H, D) each
    mask = _device_mask(contiguous_twin(plan) if naive else plan, rank, q.device)  # (R, cp * R)
    out = attend_gathered(q.reshape(rows, heads, dim), k_all, v_all, mask, scale=scale)
    return out.reshape(q.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Any, *,
              scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's query rows over the whole batch (Note [Reference CP attention]).

    Args:
        q, k, v: this rank's rows, ``plan.local_shape + (H, D)``: ``(L, H, D)`` for a
            :class:`~cpshard.ShardPlan`, ``(B, M / cp, H, D)`` for a :class:`~cpshard.BshdPlan`;
            one dtype and device. Rotary embeddings, if any, are already applied (with
            ``plan.position_ids(cp_rank)``).
        plan: the plan every rank of ``group`` sharded the batch with (any layout, any ``cp``).
        group: the CP group; ``None`` only when ``plan.cp_size == 1``.
        scale: the score scale; default ``1 / sqrt(D)``.

    Returns:
        ``plan.local_shape + (H, D)``: each token row's attention over the tokens at or before it
        in its own sequence; zeros on pad rows.

    Communication: one ``all_gather_single`` of this rank's keys and values in forward, one
    ``all_reduce`` of the gathered gradient in backward; none at ``cp = 1``. Memory ``H * L * cp * L``.

    Autograd: the gradient of each rank's ``k`` and ``v`` is summed over every rank's queries (see
    the Note), so if the ranks' losses add up to the batch's, every gradient equals ``cp = 1``'s.
    """
    return _attend(q, k, v, plan, group, scale, naive=False)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Any, *,
                    scale: float | None = None) -> torch.Tensor:
    """:func:`attention` with a layout-naive kernel's mask: it assumes rank ``s`` holds global rows
    ``s * L .. (s + 1) * L - 1`` (:func:`contiguous_twin`). Right under the contiguous layout, wrong
    under zigzag: kept to show that ``cpshard verify`` catches such a kernel. Same arguments."""
    return _attend(q, k, v, plan, group, scale, naive=True)
