"""verl's THD drop-ins: a jagged (or padded) micro-batch packed into a CP rank's rows, and back.

``preprocess_thd_engine`` / ``postprocess_thd_engine`` (verl's engine path, jagged input) and
``preprocess_packed_seqs`` / ``postprocess_packed_seqs`` (the legacy path, a padded ``(B, S)`` batch
with its mask), each with verl's name, positional parameters and return structure (README,
"Differences from verl", lists the rows where verl loses a token and the drop-in does not).

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/util.py``;
megatron-core 0.19.2 ``megatron/core/packed_seq_params.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.base.layout import Layout
from cpshard.compat.verl import _rows
from cpshard.compat.verl import _layout
from cpshard.compat.verl._plans import (
    _attach,
    _attached,
    _check_batch,
    _ctx,
    _given_plan,
    _local_rows,
    _restore,
    _rules,
    _seqlens,
    layout_of,
    thd_plan,
)
from cpshard.megatron.packed import packed_seq_params, plan_from_packed_seq_params
from cpshard.ops.sharding import shard
from cpshard.plan.values import ShardPlan

__all__ = ["postprocess_packed_seqs", "postprocess_thd_engine", "preprocess_packed_seqs", "preprocess_thd_engine"]

# Each drop-in spells out verl's parameters, then the keyword-only ones every drop-in adds (tp_size, cp_size,
# cp_rank, cp_group, plan). `duplicates` pairs these lists, here and with _bshd.py; they stay: each is the
# drop-in's signature, which verl's callers bind by position and name.

def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: ShardPlan | None = None,
    verl_version: str | None = None,
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """Pack a jagged batch into this CP rank's rows (verl's ``preprocess_thd_engine``).

    Args:
        input_ids: jagged nested tensor ``(B, j, ...)``, any dtype (tokens, labels, masks, top-k rows).
        need_roll: next-token labels: token ``p`` receives token ``p + 1`` of its sequence; the
            last token and the pad rows what verl's roll gives them (docs/verl.md, Differences from verl).
        local_cp_size: verl's dynamic CP: this micro-batch uses a group of that many ranks
            (``cp_group``, else Megatron's dynamic group of that size).
        cp_layout: ``"zigzag"`` or ``"contiguous"``; None (not passed): the layout in use
            (:mod:`cpshard.compat.verl._layout`: verl's default zigzag while cpshard is off; under the
            patch the override, else the model's inside verl's Megatron engine, else zigzag).
        tp_size, cp_size, cp_rank, cp_group: parallel state; read from Megatron when not given.
        plan: the micro-batch's plan (:func:`thd_plan`); built from the arguments when None.
        verl_version: whose rows to reproduce where verl versions differ (the roll at a sequence's
            end, see docs/verl.md); default the installed verl's.

    Every row equals verl's, pad rows and position ids included, except where verl loses a token
    (README, "Differences from verl").

    Returns:
        ``(rows, packed_seq_params, position_ids)``: ``(1, L, ...)``, Megatron's ``PackedSeqParams``
        (:func:`cpshard.megatron.packed_seq_params`) and ``(1, L)`` int64 positions;
        ``(input_ids, packed_seq_params, None)`` when ``pre_process`` is False.
    """
    layout = layout_of(cp_layout, "preprocess_thd_engine", local_cp_size or cp_size)
    rules = _rules(verl_version)
    ctx = _ctx(tp_size, cp_size, cp_rank, cp_group, local_cp_size, need_group=local_cp_size is not None)
    if plan is None:  # one host copy of the lengths; the rows are then the batch's values as they are
        plan = thd_plan(_seqlens(input_ids), use_fp8_padding, min_local_rows, pad_to_length_bucket, layout,
                        tp_size=ctx.tp_size, cp_size=ctx.cp_size)
    else:  # checked against the plan (one host copy)
        plan = _given_plan(plan, ShardPlan, ctx.cp_size, layout)
        if _seqlens(input_ids) != plan.input_seqlens_py:
            fail("input_ids", f"nested tensor with lengths {list(_seqlens(input_ids))}",
                 f"must match the plan's seqlens {list(plan.input_seqlens_py)}",
                 "pass the batch the plan was built for")
    dynamic = local_cp_size is not None
    psp = packed_seq_params(plan, device=input_ids.device, cp_group=ctx.cp_group if dynamic else None,
                            local_cp_size=local_cp_size)
    _attach(psp, plan)
    if not pre_process:
        return input_ids, psp, None
    rows, positions = _rows.thd_rows(input_ids.values(), plan, ctx.cp_rank, bool(need_roll), rules)
    return rows.unsqueeze(0), psp, positions.to(input_ids.device).unsqueeze(0)


def _thd_restore_plan(psp: Any, seqlens: Any, layout: Layout | None, cp_size: int | None, tp_size: int | None,
                      plan: ShardPlan | None) -> ShardPlan:
    if plan is not None:
        return _given_plan(plan, ShardPlan, cp_size, layout)
    attached = _attached(psp, ShardPlan)
    if attached is not None:
        return _given_plan(attached, ShardPlan, cp_size, layout)
    cp = _ctx(tp_size or 1, cp_size, 0, None).cp_size
    if layout is None:
        layout = _layout.in_use("postprocess_packed_seqs", cp)
    return plan_from_packed_seq_params(psp, cp_size=cp, tp_size=tp_size or 1, layout=layout, seqlens=seqlens)


def _match_plan(name: str, shown: str, lens: tuple[int, ...], plan: ShardPlan, fix: str) -> None:
    """The batch's lengths, in the caller's order (a plan may have reordered its buffer), against the
    plan that restores it: another batch would put tokens into the wrong sample, or fail in torch's
    indexing."""
    if plan.input_seqlens_py != lens:
        fail(name, f"{shown} with lengths {list(lens)}", f"must match the plan's seqlens {list(plan.input_seqlens_py)}",
             fix)


def postprocess_thd_engine(
    output: torch.Tensor,
    packed_seq_params: Any,
    input_ids: torch.Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: ShardPlan | None = None,
) -> torch.Tensor:
    """Every sequence's outputs from this rank's packed output (verl's ``postprocess_thd_engine``).

    Args:
        output: ``(1, L, ...)``, this rank's model output for the packed rows.
        packed_seq_params: what :func:`preprocess_thd_engine` returned (it carries the plan), or
            any ``PackedSeqParams`` of the micro-batch.
        input_ids: the jagged batch (its lengths).
        batch_size: ``B``.
        local_cp_size: dynamic CP; the group is ``cp_group`` or ``packed_seq_params.cp_group``.
        cp_layout: as in :func:`preprocess_thd_engine` (the plan preprocess attached must have it).
        tp_size, cp_size, cp_rank, cp_group, plan: as in :func:`preprocess_thd_engine`
            (``cp_rank`` is the group rank and only checked).

    Returns:
        Jagged nested tensor ``(B, j, ...)``, the same on every rank: one all-gather across the CP
        group (none at ``cp = 1``). The gradient reaches this rank's own rows once (as verl's, whose
        other ranks' rows are detached).
    """
    layout = layout_of(cp_layout, "postprocess_thd_engine", local_cp_size or cp_size)
    if not post_process:
        return output
    local = _local_rows(output)
    if local_cp_size is not None:
        cp_size = check_int("local_cp_size", local_cp_size, minimum=1) if cp_size is None else cp_size
        if cp_group is None:
            cp_group = getattr(packed_seq_params, "cp_group", None)
    lens = _seqlens(input_ids)  # one host copy, as verl makes
    plan = _thd_restore_plan(packed_seq_params, lens, layout, cp_size, tp_size, plan)
    _match_plan("input_ids", "nested tensor", lens, plan, "pass the input_ids that preprocess_thd_engine packed")
    _check_batch(batch_size, plan.num_seqs)
    return _restore(local, plan, cp_group, flat=False)


# -- padded (B, S) input: the legacy THD path --------------------------------------------------------

def preprocess_packed_seqs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pre_process: bool = True,
    use_fp8_padding: bool = False,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: ShardPlan | None = None,
) -> tuple[torch.Tensor, Any]:
    """Pack a padded batch ``(B, S, ...)`` with its ``(B, S)`` mask into this rank's rows.

    verl's ``preprocess_packed_seqs``: the tokens of row ``b`` are ``input_ids[b, attention_mask[b]]``.
    verl passes no layout here and packs zigzag; the drop-in uses the layout in use
    (:mod:`cpshard.compat.verl._layout`: zigzag while cpshard is off, and under the patch unless the
    override or the engine's model says contiguous).
    Returns ``((1, L, ...), packed_seq_params)``, or ``(input_ids, packed_seq_params)`` when
    ``pre_process`` is False. One host copy (the lengths).
    """
    input_ids, mask = check_tensor("input_ids", input_ids), _mask(attention_mask, input_ids)
    ctx = _ctx(tp_size, cp_size, cp_rank, cp_group)
    if plan is None:
        layout = _layout.in_use("preprocess_packed_seqs", ctx.cp_size)
        plan = ShardPlan.build(mask.sum(-1), cp_size=ctx.cp_size, tp_size=ctx.tp_size, layout=layout,
                               fp8=use_fp8_padding)
    else:
        plan = _given_plan(plan, ShardPlan, ctx.cp_size, None)
    psp = packed_seq_params(plan, device=input_ids.device)
    _attach(psp, plan)
    if not pre_process:
        return input_ids, psp
    rows = shard(input_ids[mask], plan, ctx.cp_rank, pad_value=0, fill=0)
    return rows.unsqueeze(0), psp


def _mask(attention_mask: Any, x: torch.Tensor) -> torch.Tensor:
    mask = check_tensor("attention_mask", attention_mask)
    if mask.dim() != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        fail("attention_mask", f"tensor of shape {tuple(mask.shape)}",
             f"must be (B, S) matching the batch's leading shape {tuple(x.shape[:2])}", "pass the batch's mask")
    return mask.bool()


def postprocess_packed_seqs(
    output: torch.Tensor,
    packed_seq_params: Any,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: ShardPlan | None = None,
) -> torch.Tensor:
    """This rank's packed output back into the padded ``(batch_size, seq_len, ...)`` batch (zeros off the mask).

    verl's ``postprocess_packed_seqs``: one all-gather across the CP group, then one scatter of the
    token rows into the positions ``attention_mask`` marks. Same gradient contract as
    :func:`postprocess_thd_engine`. The plan: ``plan=``, else the one preprocess attached, else
    re-derived for the layout in use.
    """
    if not post_process:
        return output
    local = _local_rows(output)
    mask = check_tensor("attention_mask", attention_mask).bool()
    if tuple(mask.shape) != (batch_size, seq_len):
        fail("attention_mask", f"tensor of shape {tuple(mask.shape)}", f"must be (batch_size, seq_len) = "
             f"({batch_size}, {seq_len})", "pass the padded batch's mask")
    lens = tuple(mask.sum(-1).tolist())  # one host copy (the scatter below syncs anyway)
    seqlens = None if plan is not None or _attached(packed_seq_params, ShardPlan) else lens
    plan = _thd_restore_plan(packed_seq_params, seqlens, None, cp_size, tp_size, plan)
    _match_plan("attention_mask", "mask", lens, plan, "pass the attention_mask that preprocess_packed_seqs packed")
    tokens = _restore(local, plan, cp_group, flat=True)
    out = tokens.new_zeros((batch_size, seq_len, *tokens.shape[1:]))
    out[mask] = tokens
    return out


