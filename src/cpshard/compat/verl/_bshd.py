"""verl's BSHD drop-ins and VLM masks: every row padded to one aligned length, zigzag columns.

``preprocess_bshd_engine`` / ``postprocess_bshd_engine`` (``(B, M / cp, ...)`` columns of a rank, and
back), ``build_vlm_attn_mask_thd`` / ``build_vlm_attn_mask_bshd`` (the padded batch and its mask,
unsharded). verl's BSHD format has one layout, zigzag, and no ``cp_layout`` parameter: the drop-ins
keep it, and say so once in the log where the layout in use (:mod:`cpshard.compat.verl._layout`) is
contiguous.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/util.py`` and
``tests/utils/test_megatron_bshd_preprocess.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cpshard.base.errors import check_tensor, fail
from cpshard.base.layout import Layout
from cpshard.compat.verl import _rows
from cpshard.compat.verl import _layout
from cpshard.compat.verl._plans import (
    _attach,
    _attached,
    _check_batch,
    _ctx,
    _given_plan,
    _restore,
    _rules,
    bshd_plan,
)
from cpshard.megatron.state import ParallelContext
from cpshard.ops.padded import to_padded
from cpshard.ops.sharding import as_flat, shard
from cpshard.plan.bshd import BshdPlan

__all__ = ["build_vlm_attn_mask_bshd", "build_vlm_attn_mask_thd", "postprocess_bshd_engine", "preprocess_bshd_engine"]


def _zigzag_only(site: str, cp_size: int) -> None:
    """Log once where BSHD packs zigzag while the layout in use is contiguous."""
    if cp_size > 1 and _layout.in_use(site, cp_size, log=False) is Layout.CONTIGUOUS:
        _layout.once(logging.WARNING, f"{site} bshd", "cpshard.compat.verl: %s packs zigzag, verl's only BSHD layout, "
                      "while the layout in use is contiguous; a contiguous model needs THD (use_remove_padding=True)",
                      site)


# verl's parameters, then the keyword-only ones every drop-in adds: the signature stays as verl's callers
# bind it (`duplicates` pairs it with _thd.py's; the note there says why it stays).
def preprocess_bshd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    forced_max_seqlen: int | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: BshdPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's columns of the padded batch (verl's ``preprocess_bshd_engine``; zigzag).

    Args:
        input_ids: jagged nested tensor ``(B, j, ...)``.
        pre_process: accepted for verl's signature; verl 0.9.1 shards whatever it is.
        need_roll: token ``p`` receives token ``p + 1`` of its row; the last column wraps to the
            row's first token (verl rolls each padded row).
        forced_max_seqlen: pad every row to this length (before alignment); must be >= the longest.

    Returns:
        ``(x, attention_mask, position_ids)``: ``(B, M / cp, ...)``, ``(B, M / cp)`` bool (True on
        token columns) and ``(B, M / cp)`` int64 global columns, where ``M`` is the aligned length.
    """
    ctx = _ctx(tp_size, cp_size, cp_rank, cp_group)
    _zigzag_only("preprocess_bshd_engine", ctx.cp_size)
    if plan is None:
        plan = bshd_plan(input_ids, use_fp8_padding, forced_max_seqlen, tp_size=ctx.tp_size, cp_size=ctx.cp_size)
    else:
        plan = _given_plan(plan, BshdPlan, ctx.cp_size, Layout.ZIGZAG)
    x = shard(input_ids, plan, ctx.cp_rank, shift=int(bool(need_roll)), pad_value=0, fill=0)
    mask = plan.token_mask(ctx.cp_rank).to(x.device)
    if need_roll:  # verl rolls each padded row: its last column takes the row's first token
        values = input_ids.values() if input_ids.is_nested else as_flat(input_ids, plan, "input_ids")  # checked
        x = _rows.bshd_rows(x, values, plan, ctx.cp_rank)
    positions = plan.position_ids(ctx.cp_rank).to(x.device)
    _attach(mask, plan)
    return x, mask, positions


def postprocess_bshd_engine(
    output: torch.Tensor,
    attention_mask: torch.Tensor,
    post_process: bool = True,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    plan: BshdPlan | None = None,
) -> torch.Tensor:
    """Every row's token outputs from this rank's ``(B, M / cp, ...)`` output (verl's ``postprocess_bshd_engine``).

    The plan comes from ``plan=``, else from the mask :func:`preprocess_bshd_engine` returned, else
    from the masks of all ranks (one extra all-gather, as verl always does). Returns a jagged
    nested tensor ``(B, j, ...)``, the same on every rank; the gradient reaches this rank's rows.
    """
    if not post_process:
        return output
    output, mask = check_tensor("output", output), check_tensor("attention_mask", attention_mask)
    if output.dim() < 2 or tuple(output.shape[:2]) != tuple(mask.shape):
        fail("attention_mask", f"tensor of shape {tuple(mask.shape)}",
             f"must match output's leading shape {tuple(output.shape[:2])}", "pass the mask preprocess returned")
    if plan is None:
        plan = _attached(mask, BshdPlan)
    ctx = _ctx(tp_size or 1, cp_size if plan is None else plan.cp_size, cp_rank if cp_group is not None else 0,
               cp_group, need_group=True)
    _zigzag_only("postprocess_bshd_engine", ctx.cp_size)
    if plan is None:
        plan = _bshd_plan_from_masks(mask, ctx)
    else:
        plan = _given_plan(plan, BshdPlan, ctx.cp_size, Layout.ZIGZAG)
    return _restore(output, plan, ctx.cp_group, flat=False)


def _bshd_plan_from_masks(mask: torch.Tensor, ctx: ParallelContext) -> BshdPlan:
    """The plan of a BSHD batch known only by each rank's local mask ``(B, M / cp)``."""
    b, local = mask.shape
    full = local * ctx.cp_size
    if ctx.cp_size == 1:
        lens = mask.bool().sum(-1)
    else:
        every_column = BshdPlan.build([full] * b, cp_size=ctx.cp_size, max_seqlen=full)
        lens = _restore(mask.bool(), every_column, ctx.cp_group, flat=True).view(b, full).sum(-1)
    return BshdPlan.build(lens, cp_size=ctx.cp_size, layout=Layout.ZIGZAG, max_seqlen=full)


# -- VLM masks --------------------------------------------------------------------------------------

def build_vlm_attn_mask_thd(
    input_ids: torch.Tensor,
    pad_token_id: int | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    verl_version: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The jagged batch padded to the longest row, and its mask (verl's function).

    Returns ``(input_ids (B, M), attention_mask (B, M) bool)``, unsharded (the vision model packs
    later). verl 0.9.1 rounds ``M`` up to the BSHD plan's alignment (``2 * cp * tp`` at ``cp > 1``,
    else ``tp``); verl 0.9.0 and main do not (``verl_version``: whose to follow, default the
    installed verl's).
    """
    plan = bshd_plan(input_ids, tp_size=tp_size, cp_size=cp_size)
    if _rules(verl_version).vlm_thd_aligned:
        return _padded(input_ids, plan.max_seqlen, pad_token_id)
    # verl 0.9.0 / main: torch's own padding, whose width is the longest row only where the nested
    # tensor carries it (built from a list); from values and offsets alone torch pads to all the values
    if pad_token_id is None:
        return _padded(input_ids, 0, pad_token_id)  # the error
    padded = input_ids.to_padded_tensor(pad_token_id)
    lens = torch.tensor(plan.seqlens_py, device=padded.device)
    return padded, torch.arange(padded.shape[1], device=padded.device) < lens[:, None]


def build_vlm_attn_mask_bshd(
    input_ids: torch.Tensor,
    batch_size: int,
    pad_token_id: int | None = None,
    forced_max_seqlen: int | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`build_vlm_attn_mask_thd`, padded to ``forced_max_seqlen`` (aligned) when given."""
    plan = bshd_plan(input_ids, forced_max_seqlen=forced_max_seqlen, tp_size=tp_size, cp_size=cp_size)
    _check_batch(batch_size, plan.num_seqs)
    return _padded(input_ids, plan.max_seqlen, pad_token_id)


def _padded(input_ids: torch.Tensor, length: int, pad_token_id: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if pad_token_id is None:
        fail("pad_token_id", None, "is needed to fill the padding", "pass the tokenizer's pad token id",
             kind=TypeError)
    return to_padded(input_ids, length=length, pad_value=pad_token_id)



