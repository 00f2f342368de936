"""Reference context-parallel attention: a rank's query rows against the whole batch's keys.

The keys and values are all-gathered over the CP group by ``cpshard.distributed.all_gather_rows``
(whose backward sums their gradients over the group); which keys each query sees, and the blocked
arithmetic, are pure (``cpshard.causal``, Note [Reference CP attention]). It is a reference for
checks, not a kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.distributed.checks import validated
from cpshard.distributed.collectives import all_gather_rows_for, backward_follows, joined
from cpshard.ops.sharding import check_plan_type
from cpshard.plan.causal import (
    attend_blocks,
    attend_gathered,
    attention_mask,
    attention_work,
    contiguous_twin,
    naive_attention_mask,
)
from cpshard.plan.values import Plan

__all__ = ["attend_blocks", "attend_gathered", "attention", "attention_mask", "attention_work", "contiguous_twin",
           "naive_attention", "naive_attention_mask"]


# -- the attention --------------------------------------------------------------------------


def _check_qkv(q: Any, k: Any, v: Any, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = plan.local_shape
    out = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        t = check_real(name, check_tensor(name, t))
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


def _attend(q: Any, k: Any, v: Any, plan: Plan, group: Any, scale: float | None, naive: bool,
            check: bool | None) -> torch.Tensor:
    def validate() -> tuple[tuple[tuple[torch.Tensor, ...], dict[str, Any]], dict[str, Any]]:
        check_plan_type(plan)
        qkv = _check_qkv(q, k, v, plan)
        # every rank alike: agreed on, and carried by the gather's header (the scale as used: None is 1/sqrt(D))
        # and whether the key/value gather's backward collective follows (k or v requiring a gradient)
        args = {"scale": float(1.0 / math.sqrt(qkv[0].shape[-1]) if scale is None else scale), "naive": naive,
                "requires_grad": backward_follows(qkv[1], qkv[2])}
        return (qkv, args), {"dtype": qkv[0].dtype, "row shape": tuple(qkv[0].shape[len(plan.local_shape):]), **args}

    ((q, k, v), args), rank, _ = validated(plan, group, check, validate, "attention")
    rows = math.prod(plan.local_shape)
    heads, dim = q.shape[-2:]
    kv = torch.cat([k, v], -1).reshape(rows, heads, 2 * dim)
    kv = all_gather_rows_for(kv, plan, group, args, check=False)  # agreed above, with checks on
    k_all, v_all = kv.split(dim, -1)  # (cp * R, H, D) each
    out = attend_blocks(q.reshape(rows, heads, dim), k_all, v_all, contiguous_twin(plan) if naive else plan, rank,
                        scale=scale)
    # a rank whose rows are all pad rows reads no key: its output still depends on the gathered keys
    # and values, so that their backward all_reduce runs on it too (its peers wait in it otherwise)
    return joined(out, kv).reshape(q.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Any, *,
              scale: float | None = None, check: bool | None = None) -> torch.Tensor:
    """Causal attention of this rank's query rows over the whole batch (Note [Reference CP attention]).

    Args:
        q, k, v: this rank's rows, ``plan.local_shape + (H, D)``: ``(L, H, D)`` for a
            :class:`~cpshard.ShardPlan`, ``(B, M / cp, H, D)`` for a :class:`~cpshard.BshdPlan`;
            one dtype and device. Rotary embeddings, if any, are already applied (with
            ``plan.position_ids(cp_rank)``).
        plan: the plan every rank of ``group`` sharded the batch with (any layout, any ``cp``).
        group: the CP group; ``None`` only when ``plan.cp_size == 1``.
        scale: the score scale; default ``1 / sqrt(D)``.
        check: as in :func:`cpshard.distributed.gather`: the agreement before the key/value gather.

    Returns:
        ``plan.local_shape + (H, D)``: each token row's attention over the tokens at or before it
        in its own sequence; zeros on pad rows.

    Communication: one ``all_gather_single`` of this rank's keys and values in forward, one
    ``all_reduce`` of the gathered gradient in backward; none at ``cp = 1``. Memory: the gathered
    keys and values, plus one block of ``H * _BLOCK_SCORES`` scores (:func:`attend_blocks`), whatever
    the batch.

    Autograd: the gradient of each rank's ``k`` and ``v`` is summed over every rank's queries (see
    the Note), so if the ranks' losses add up to the batch's, every gradient equals ``cp = 1``'s.
    Every rank joins that backward collective, a rank of pad rows only too.
    """
    return _attend(q, k, v, plan, group, scale, False, check)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group: Any, *,
                    scale: float | None = None, check: bool | None = None) -> torch.Tensor:
    """:func:`attention` with a layout-naive kernel's mask: it assumes rank ``s`` holds global rows
    ``s * L .. (s + 1) * L - 1`` (:func:`contiguous_twin`). Right under the contiguous layout, wrong
    under zigzag: kept to show that ``cpshard verify`` catches such a kernel. Same arguments."""
    return _attend(q, k, v, plan, group, scale, True, check)
