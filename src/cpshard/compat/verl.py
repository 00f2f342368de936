"""verl's sequence-packing helpers (``verl/models/mcore/util.py``), rebuilt on the shard plan.

Each function keeps verl's name, positional parameters and return structure, so that
:func:`patch` can put it where verl's model-forward modules bind the original; each adds
keyword-only ``tp_size``, ``cp_size``, ``cp_rank`` and ``cp_group`` (read from Megatron's parallel
state only when not given; see :func:`cpshard.megatron.state.parallel_context`), ``plan=``: a
plan built once per micro-batch (:func:`thd_plan`, :func:`bshd_plan`) so that tokens, labels,
masks, router-replay indices and teacher top-k rows of one step share it, and ``verl_version=``
where verl versions differ.

A drop-in is verl's contract, bit for bit: every row of every output, pad rows and position ids
included, equals verl's (the per-row rules are :mod:`cpshard.compat._verl_rows`, over the plan's
own views), except where verl loses or corrupts a token; the README's "Differences from verl"
lists those rows:

- a sequence of no rows under zigzag ``need_roll`` overwrites the previous row's label with 0;
  where that row has a label to lose, the drop-in keeps it;
- ``min_local_rows`` / ``pad_to_length_bucket``: verl's target total is used where it keeps every
  plan invariant (so the buffers equal verl's); where verl's would drop tokens, the total is
  rounded up as ``ShardPlan.build`` does;
- ``forced_max_seqlen`` shorter than a row is an error, not a silent truncation.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/util.py``,
``model_forward.py``, ``model_forward_fused.py``, ``tests/utils/test_megatron_bshd_preprocess.py``;
megatron-core 0.19.2 ``megatron/core/packed_seq_params.py``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.metadata
import inspect
import logging
import math
import sys
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import torch

from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.base.layout import Layout, alignment, fp8_total_alignment, total_problem
from cpshard.compat import _verl_rows
from cpshard.compat._verl_pack import bind_site as _bind_site
from cpshard.compat._verl_pack import patch_sites as _patch_pack_sites
from cpshard.compat._verl_pack import positional as _positional
from cpshard.compat._verl_pack import rearrange_micro_batches
from cpshard.distributed.collectives import gather, gather_tokens
from cpshard.megatron.packed import packed_seq_params, plan_from_packed_seq_params
from cpshard.megatron.state import ParallelContext, parallel_context
from cpshard.ops.padded import to_padded
from cpshard.ops.sharding import as_flat, shard, unshard
from cpshard.plan.args import jagged_lengths, parse_seqlens
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.values import ShardPlan

__all__ = [
    "VerlPatch",
    "bshd_plan",
    "build_vlm_attn_mask_bshd",
    "build_vlm_attn_mask_thd",
    "local_padding_mask",
    "patch",
    "postprocess_bshd_engine",
    "postprocess_packed_seqs",
    "postprocess_thd_engine",
    "preprocess_bshd_engine",
    "preprocess_packed_seqs",
    "preprocess_thd_engine",
    "rearrange_micro_batches",
    "thd_plan",
]

logger = logging.getLogger(__name__)

# The attribute under which a plan travels with the PackedSeqParams / BSHD mask that preprocess
# returns, so that the matching postprocess restores by the very same plan (no re-derivation).
_PLAN_ATTR = "_cpshard_plan"


# -- plans ---------------------------------------------------------------------------------------

def _cp_layout(value: Any) -> Layout:
    """verl's check of ``cp_layout``, in its words (its tests match them), with cpshard's fix."""
    if isinstance(value, Layout) or value in ("zigzag", "contiguous"):
        return Layout.parse(value, "cp_layout")
    raise ValueError(f"Unsupported context parallel layout: {value} (cp_layout={value!r}; valid: 'zigzag', "
                     "'contiguous'). Fix: pass cp_layout='zigzag' (balanced causal attention) or 'contiguous' "
                     "(kernels such as DeepSeek-V4's dsv4_hybrid)")


@functools.lru_cache(maxsize=1)
def _installed_rules() -> _verl_rows.Rules:
    return _verl_rows.rules_for(_verl_version(default=_WRITTEN_FOR))


def _rules(verl_version: str | None) -> _verl_rows.Rules:
    if verl_version is None:
        return _installed_rules()
    if not isinstance(verl_version, str):
        fail("verl_version", repr(verl_version), "must be a version string", "pass e.g. '0.9.1', or None",
             kind=TypeError)
    return _verl_rows.rules_for(verl_version)


def _ctx(tp_size: int | None, cp_size: int | None, cp_rank: int | None, cp_group: Any,
         local_cp_size: int | None = None, need_group: bool = False) -> ParallelContext:
    return parallel_context(tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group,
                            local_cp_size=local_cp_size, need_group=need_group)


def thd_plan(
    input_ids: torch.Tensor | list[int] | tuple[int, ...],
    use_fp8_padding: bool = False,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: Layout | str = "zigzag",
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    local_cp_size: int | None = None,
) -> ShardPlan:
    """The plan ``preprocess_thd_engine`` uses for a micro-batch (pass it as ``plan=`` to share it).

    ``input_ids`` is the jagged nested batch (or its lengths). Padding follows verl: every
    sequence to the layout's alignment (fp8: ``lcm(16, a)`` and the total to ``a * 128``), then the
    total to at least ``cp * min_local_rows``, then to a multiple of ``lcm(pad_to_length_bucket,
    cp)`` (and of the fp8 total), all on the last sequence. Where verl's target keeps every token
    and split (``T % cp``, ``L % tp``, zigzag ``P % 2cp``, the fp8 total) its rows are kept, with the
    alignment the lengths share (SPEC's per-sequence multiple may not divide verl's last length);
    where it breaks one (verl drops tokens there), ``ShardPlan.build``'s rounding is used.
    """
    if local_cp_size is not None:
        cp_size = check_int("local_cp_size", local_cp_size, minimum=1)
    ctx = _ctx(tp_size, cp_size, 0, None)
    cp, tp, layout = ctx.cp_size, ctx.tp_size, Layout.parse(cp_layout, "cp_layout")
    if not isinstance(use_fp8_padding, bool):
        fail("use_fp8_padding", repr(use_fp8_padding), "must be a bool", "pass True or False", kind=TypeError)
    if min_local_rows is not None:
        min_local_rows = check_int("min_local_rows", min_local_rows, minimum=0)
    if pad_to_length_bucket is not None:
        pad_to_length_bucket = check_int("pad_to_length_bucket", pad_to_length_bucket, minimum=1)
    base = ShardPlan.build(input_ids, cp_size=cp, tp_size=tp, layout=layout, fp8=use_fp8_padding)
    if min_local_rows is None and pad_to_length_bucket is None:
        return base
    ours = ShardPlan.build(base.seqlens_py, cp_size=cp, tp_size=tp, layout=layout, fp8=use_fp8_padding,
                           min_local_rows=min_local_rows, length_bucket=pad_to_length_bucket)
    fp8_total = fp8_total_alignment(alignment(cp, tp, layout))
    total = base.total_len  # verl's target, on Python ints
    if min_local_rows is not None:
        total = max(total, cp * min_local_rows)
    if pad_to_length_bucket is not None:
        multiple = math.lcm(pad_to_length_bucket, cp, fp8_total if use_fp8_padding else 1)
        total = -(-total // multiple) * multiple
    if total == ours.total_len or total_problem(total, total - base.total_len, cp, tp, layout, use_fp8_padding):
        return ours  # the same rows, or verl's padding would drop tokens here: keep cpshard's
    return ShardPlan.build(base.seqlens_py, cp_size=cp, tp_size=tp, layout=layout, fp8=use_fp8_padding,
                           total_len=total)


def local_padding_mask(
    seq_lens: list[int] | tuple[int, ...] | torch.Tensor,
    *,
    cp_size: int,
    cp_rank: int,
    tp_size: int,
    cp_layout: Layout | str = "zigzag",
    min_local_rows: int | None = None,
    plan: ShardPlan | None = None,
) -> torch.Tensor:
    """verl main's dynamic-CP router padding mask (``verl.utils.dynamic_cp_scheduler._local_padding_mask``):
    ``(L,)`` bool, True on CP rank ``cp_rank``'s pad rows, of the micro-batch :func:`thd_plan` pads
    (``preprocess_thd_engine`` with ``local_cp_size=cp_size``), so the router's mask and the rows the
    drop-in gives that rank come from one plan. verl's own restates the padding per sequence; it
    equals this one wherever verl's padding keeps every token, and differs exactly where the rows do
    (README, "Differences from verl", items 2 and 3). ``plan=``: the micro-batch's plan, when built
    already (checked against the lengths). verl's checks are kept: ``cp_layout`` zigzag or
    contiguous, ``min_local_rows`` positive."""
    cp = check_int("cp_size", cp_size, minimum=1)
    rank = check_int("cp_rank", cp_rank, minimum=0)
    if rank >= cp:
        fail("cp_rank", rank, f"must be below cp_size={cp}", f"pass a rank in 0..{cp - 1}")
    layout = _cp_layout(cp_layout)
    if min_local_rows is not None and check_int("min_local_rows", min_local_rows) <= 0:
        fail("min_local_rows", min_local_rows, "must be positive (verl's rule for dynamic CP)",
             "pass a positive number of rows, or None")
    lens = list(parse_seqlens(seq_lens, "seq_lens"))
    if plan is None:
        plan = thd_plan(lens, min_local_rows=min_local_rows, cp_layout=layout, tp_size=tp_size, cp_size=cp)
    else:
        plan = _given_plan(plan, ShardPlan, cp, layout)
        if list(plan.input_seqlens_py) != lens:
            fail("plan", repr(plan), f"is for seqlens {list(plan.input_seqlens_py)}, not {lens}",
                 "pass the plan of this micro-batch")
        tp = check_int("tp_size", tp_size, minimum=1)
        if plan.tp_size != tp:
            fail("plan", repr(plan), f"is for tp_size={plan.tp_size}, not tp_size={tp}",
                 "pass the plan built for this call's sizes (thd_plan with the same tp_size)")
        if min_local_rows is not None and plan.local_len < min_local_rows:
            fail("plan", repr(plan), f"has {plan.local_len} rows a rank, fewer than min_local_rows={min_local_rows}",
                 "pass the plan built with this min_local_rows (thd_plan(..., min_local_rows=...))")
    return ~plan.token_mask(rank)


def bshd_plan(
    input_ids: torch.Tensor | list[int] | tuple[int, ...],
    use_fp8_padding: bool = False,
    forced_max_seqlen: int | None = None,
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
) -> BshdPlan:
    """The plan ``preprocess_bshd_engine`` uses (zigzag; every row padded to one aligned length)."""
    ctx = _ctx(tp_size, cp_size, 0, None)
    return BshdPlan.build(input_ids, cp_size=ctx.cp_size, tp_size=ctx.tp_size, layout=Layout.ZIGZAG,
                          fp8=use_fp8_padding, max_seqlen=forced_max_seqlen)


def _given_plan(plan: Any, kind: type[Any], cp_size: int | None, layout: Layout | None) -> Any:
    if not isinstance(plan, kind):
        fail("plan", type(plan).__name__, f"must be a {kind.__name__}",
             f"build it with cpshard.compat.verl.{'thd_plan' if kind is ShardPlan else 'bshd_plan'}", kind=TypeError)
    if cp_size is not None and plan.cp_size != cp_size:
        fail("plan", repr(plan), f"is for cp_size={plan.cp_size}, not the {cp_size} ranks of this call",
             "build the plan for this context-parallel group")
    if layout is not None and plan.layout is not layout:
        fail("plan", repr(plan), f"has layout {plan.layout.value!r}, not cp_layout={layout.value!r}",
             "pass the cp_layout the plan was built with")
    return plan


def _attach(carrier: Any, plan: Any) -> None:
    try:
        setattr(carrier, _PLAN_ATTR, plan)
    except (AttributeError, TypeError):  # a frozen or slotted stand-in: restore re-derives the plan
        pass


def _attached(carrier: Any, kind: type) -> Any:
    plan = getattr(carrier, _PLAN_ATTR, None)
    return plan if isinstance(plan, kind) else None


def _local_rows(output: Any, name: str = "output") -> torch.Tensor:
    output = check_tensor(name, output)
    if output.dim() < 2 or output.shape[0] != 1:
        fail(name, f"tensor of shape {tuple(output.shape)}", "must be (1, local rows, ...), as the model returns "
             "a packed micro-batch", "pass the model's packed output")
    return output[0]


def _restore(local: torch.Tensor, plan: Any, group: Any, flat: bool) -> torch.Tensor:
    """Every token's output in order: ``unshard`` on one rank, ``cpshard.distributed`` across ranks."""
    if plan.cp_size == 1:
        nt = unshard([local], plan)
        return nt.values() if flat else nt
    if group is None:
        group = _ctx(1, plan.cp_size, 0, None, need_group=True).cp_group  # sizes known: read only the group
    return (gather_tokens if flat else gather)(local, plan, group, check=None)


# -- THD ------------------------------------------------------------------------------------------

def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
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
            last token and the pad rows what verl's roll gives them (:mod:`cpshard.compat._verl_rows`).
        local_cp_size: verl's dynamic CP: this micro-batch uses a group of that many ranks
            (``cp_group``, else Megatron's dynamic group of that size).
        cp_layout: ``"zigzag"`` or ``"contiguous"``.
        tp_size, cp_size, cp_rank, cp_group: parallel state; read from Megatron when not given.
        plan: the micro-batch's plan (:func:`thd_plan`); built from the arguments when None.
        verl_version: whose rows to reproduce where verl versions differ (the roll at a sequence's
            end, see :mod:`cpshard.compat._verl_rows`); default the installed verl's.

    Every row equals verl's, pad rows and position ids included, except where verl loses a token
    (README, "Differences from verl").

    Returns:
        ``(rows, packed_seq_params, position_ids)``: ``(1, L, ...)``, Megatron's ``PackedSeqParams``
        (:func:`cpshard.megatron.packed_seq_params`) and ``(1, L)`` int64 positions;
        ``(input_ids, packed_seq_params, None)`` when ``pre_process`` is False.
    """
    layout = _cp_layout(cp_layout)
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
    rows, positions = _verl_rows.thd_rows(input_ids.values(), plan, ctx.cp_rank, bool(need_roll), rules)
    return rows.unsqueeze(0), psp, positions.to(input_ids.device).unsqueeze(0)


def _thd_restore_plan(psp: Any, seqlens: Any, layout: Layout, cp_size: int | None, tp_size: int | None,
                      plan: ShardPlan | None) -> ShardPlan:
    if plan is not None:
        return _given_plan(plan, ShardPlan, cp_size, layout)
    attached = _attached(psp, ShardPlan)
    if attached is not None:
        return _given_plan(attached, ShardPlan, cp_size, layout)
    cp = _ctx(tp_size or 1, cp_size, 0, None).cp_size
    return plan_from_packed_seq_params(psp, cp_size=cp, tp_size=tp_size or 1, layout=layout, seqlens=seqlens)


def postprocess_thd_engine(
    output: torch.Tensor,
    packed_seq_params: Any,
    input_ids: torch.Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str = "zigzag",
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
        tp_size, cp_size, cp_rank, cp_group, plan: as in :func:`preprocess_thd_engine`
            (``cp_rank`` is the group rank and only checked).

    Returns:
        Jagged nested tensor ``(B, j, ...)``, the same on every rank: one all-gather across the CP
        group (none at ``cp = 1``). The gradient reaches this rank's own rows once (as verl's, whose
        other ranks' rows are detached).
    """
    layout = _cp_layout(cp_layout)
    if not post_process:
        return output
    local = _local_rows(output)
    if local_cp_size is not None:
        cp_size = check_int("local_cp_size", local_cp_size, minimum=1) if cp_size is None else cp_size
        if cp_group is None:
            cp_group = getattr(packed_seq_params, "cp_group", None)
    lens = _seqlens(input_ids)  # one host copy, as verl makes
    plan = _thd_restore_plan(packed_seq_params, lens, layout, cp_size, tp_size, plan)
    if plan.input_seqlens_py != lens:  # the caller's order (a plan may have reordered its buffer)
        fail("input_ids", f"nested tensor with lengths {list(lens)}", f"must match the plan's seqlens "
             f"{list(plan.input_seqlens_py)}", "pass the input_ids that preprocess_thd_engine packed")
    _check_batch(batch_size, plan.num_seqs)
    return _restore(local, plan, cp_group, flat=False)


def _seqlens(input_ids: Any) -> tuple[int, ...]:
    if not (isinstance(input_ids, torch.Tensor) and input_ids.is_nested):
        fail("input_ids", type(input_ids).__name__, "must be the micro-batch as a jagged nested tensor",
             "pass the same input_ids as to preprocess", kind=TypeError)
    return jagged_lengths(input_ids, "input_ids")


def _check_batch(batch_size: Any, num_seqs: int) -> None:
    if check_int("batch_size", batch_size, minimum=1) != num_seqs:
        fail("batch_size", batch_size, f"must equal the micro-batch's {num_seqs} sequences",
             "pass input_ids.shape[0]")


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
    """Pack a padded batch ``(B, S, ...)`` with its ``(B, S)`` mask into this rank's zigzag rows.

    verl's ``preprocess_packed_seqs``: the tokens of row ``b`` are ``input_ids[b, attention_mask[b]]``.
    Returns ``((1, L, ...), packed_seq_params)``, or ``(input_ids, packed_seq_params)`` when
    ``pre_process`` is False. One host copy (the lengths).
    """
    input_ids, mask = check_tensor("input_ids", input_ids), _mask(attention_mask, input_ids)
    ctx = _ctx(tp_size, cp_size, cp_rank, cp_group)
    if plan is None:
        plan = ShardPlan.build(mask.sum(-1), cp_size=ctx.cp_size, tp_size=ctx.tp_size, layout=Layout.ZIGZAG,
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
    :func:`postprocess_thd_engine`.
    """
    if not post_process:
        return output
    local = _local_rows(output)
    mask = check_tensor("attention_mask", attention_mask).bool()
    if tuple(mask.shape) != (batch_size, seq_len):
        fail("attention_mask", f"tensor of shape {tuple(mask.shape)}", f"must be (batch_size, seq_len) = "
             f"({batch_size}, {seq_len})", "pass the padded batch's mask")
    seqlens = None if plan is not None or _attached(packed_seq_params, ShardPlan) else mask.sum(-1)
    plan = _thd_restore_plan(packed_seq_params, seqlens, Layout.ZIGZAG, cp_size, tp_size, plan)
    tokens = _restore(local, plan, cp_group, flat=True)
    out = tokens.new_zeros((batch_size, seq_len, *tokens.shape[1:]))
    out[mask] = tokens
    return out


# -- BSHD ---------------------------------------------------------------------------------------------

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
    if plan is None:
        plan = bshd_plan(input_ids, use_fp8_padding, forced_max_seqlen, tp_size=ctx.tp_size, cp_size=ctx.cp_size)
    else:
        plan = _given_plan(plan, BshdPlan, ctx.cp_size, Layout.ZIGZAG)
    x = shard(input_ids, plan, ctx.cp_rank, shift=int(bool(need_roll)), pad_value=0, fill=0)
    mask = plan.token_mask(ctx.cp_rank).to(x.device)
    if need_roll:  # verl rolls each padded row: its last column takes the row's first token
        values = input_ids.values() if input_ids.is_nested else as_flat(input_ids, plan, "input_ids")  # checked
        x = _verl_rows.bshd_rows(x, values, plan, ctx.cp_rank)
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



# -- patch() -------------------------------------------------------------------------------------------

_DROP_INS: dict[str, Callable[..., Any]] = {
    "preprocess_thd_engine": preprocess_thd_engine,
    "postprocess_thd_engine": postprocess_thd_engine,
    "preprocess_bshd_engine": preprocess_bshd_engine,
    "postprocess_bshd_engine": postprocess_bshd_engine,
    "preprocess_packed_seqs": preprocess_packed_seqs,
    "postprocess_packed_seqs": postprocess_packed_seqs,
    "build_vlm_attn_mask_thd": build_vlm_attn_mask_thd,
    "build_vlm_attn_mask_bshd": build_vlm_attn_mask_bshd,
}

_UTIL = "verl.models.mcore.util"
# Where verl binds the functions by name (``from .util import ...``), besides util itself (0.9.1; main binds
# one name fewer in model_forward_fused: skipped).
# The first two must import; the others are patched when importable (a module imported later binds
# util's names as they are then, i.e. the drop-ins while the patch is on).
_BINDERS: dict[str, tuple[str, ...]] = {
    _UTIL: tuple(_DROP_INS),
    "verl.models.mcore.model_forward": tuple(_DROP_INS),
    "verl.models.mcore.model_forward_fused": ("build_vlm_attn_mask_thd", "preprocess_packed_seqs",
                                              "preprocess_thd_engine", "postprocess_thd_engine"),
    "verl.models.mcore.model_forward_1f1b_overlap": ("preprocess_packed_seqs", "postprocess_packed_seqs"),
    "verl.utils.megatron.router_replay_utils": ("postprocess_packed_seqs", "postprocess_thd_engine",
                                                "preprocess_packed_seqs", "preprocess_thd_engine"),
    "verl.trainer.distillation.megatron.losses": ("preprocess_bshd_engine", "preprocess_thd_engine"),
}
_REQUIRED = (_UTIL, "verl.models.mcore.model_forward")
_WRITTEN_FOR = "0.9.1"
_logged = False


def _verl_version(default: str = "unknown") -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return default


class VerlPatch:
    """What :func:`patch` replaced; ``undo()`` (or leaving the ``with`` block) puts verl's functions back."""

    def __init__(self) -> None:
        self.replaced: list[str] = []  # "module.name", in the order they were replaced
        self.skipped: list[str] = []  # "module.name" sites this verl does not bind (nothing to replace)
        self._saved: list[tuple[ModuleType, str, Any, Any]] = []
        self._originals: dict[str, Any] = {}
        self.active = False

    def _replace(self, module: ModuleType, name: str, new: Any) -> None:
        self._saved.append((module, name, getattr(module, name, _MISSING), new))
        setattr(module, name, new)
        self.replaced.append(f"{module.__name__}.{name}")

    def undo(self) -> None:
        """Restore every name this patch replaced (and those a module imported meanwhile bound)."""
        if not self.active:
            return
        for module, name, old, new in reversed(self._saved):
            if getattr(module, name, None) is new:  # leave alone what someone patched over us
                if old is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, old)
        for module_name, names in _BINDERS.items():  # imported while the patch was on
            module = sys.modules.get(module_name)
            for name in names if module is not None else ():
                if getattr(module, name, None) is _DROP_INS[name] and name in self._originals:
                    setattr(module, name, self._originals[name])
        self.active = False
        logger.info("cpshard.compat.verl: restored verl's %d functions", len(self.replaced))

    def __enter__(self) -> VerlPatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()


def patch() -> VerlPatch:
    """Make a running verl use cpshard's drop-ins; also a context manager that undoes itself.

    Imports megatron-core without Triton first (:mod:`cpshard.megatron._import`), then replaces the
    functions of this module in ``verl.models.mcore.util`` and at every site where verl binds them by
    name (``model_forward``, ``model_forward_fused``, ``model_forward_1f1b_overlap``,
    ``verl.utils.megatron.router_replay_utils``, ``verl.trainer.distillation.megatron.losses``), and
    routes verl's MTP loss through :func:`cpshard.megatron.process_mtp_loss`, puts
    :func:`rearrange_micro_batches` in ``verl.utils.seqlen_balancing`` and ``verl.workers.engine.utils``,
    and, in verl main, :func:`local_padding_mask` in ``verl.utils.dynamic_cp_scheduler``.
    A site that does not
    bind a name (verl main's ``model_forward_fused`` has no ``build_vlm_attn_mask_thd``) is skipped
    and logged (``VerlPatch.skipped``). Checks first, changing nothing on failure: every function
    must exist in util with verl's positional parameters, and no site may bind another object (a
    wrapper) under the name, else a ``ValueError`` names the verl version and the site. Logs what
    it did (once per process at INFO, then DEBUG).

    Example::

        from cpshard.compat import verl as cpverl
        with cpverl.patch():
            trainer.fit()          # or: p = cpverl.patch(); ...; p.undo()
    """
    global _logged
    version = _verl_version()
    result = VerlPatch()
    modules: dict[str, ModuleType] = {}
    _import_megatron_for_verl(version)
    for name in _BINDERS:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as exc:
            if name in _REQUIRED:
                missing = f"the module {exc.name!r} is missing" if exc.name else "an import failed"
                fail("verl", version, f"cannot import {name}: {missing} ({exc})",
                     f"install {exc.name or 'the missing package'} (verl's Megatron path needs megatron-core; "
                     "see the README's install section), then patch again")
            logger.debug("cpshard.compat.verl: %s not importable (%s); it binds the patched names if "
                         "imported later", name, exc)
    util = modules[_UTIL]
    originals = {}
    for name, drop_in in _DROP_INS.items():
        original = getattr(util, name, None)
        if original is None:
            fail("verl", version, f"{_UTIL} has no {name} (cpshard's drop-ins follow verl {_WRITTEN_FOR})",
                 f"install verl=={_WRITTEN_FOR}, or call cpshard.compat.verl.{name} yourself")
        if original is drop_in:
            logger.debug("cpshard.compat.verl: already patched")
            return result
        want, got = _positional(drop_in), _positional(original)
        if got != want:
            fail("verl", version, f"{_UTIL}.{name} takes ({', '.join(got)}), but cpshard's drop-in is written "
                 f"for verl {_WRITTEN_FOR}'s ({', '.join(want)})",
                 f"install verl=={_WRITTEN_FOR}, or call cpshard.compat.verl.{name} yourself")
        originals[name] = original
    sites: list[tuple[ModuleType, str]] = []
    for module_name, module in modules.items():
        for name in _BINDERS[module_name]:
            bound = getattr(module, name, _MISSING)
            if bound is _MISSING:  # this verl no longer binds it there (verl main's model_forward_fused)
                result.skipped.append(f"{module_name}.{name}")
                continue
            if bound is not originals[name]:
                fail("verl", version, f"{module_name}.{name} is {_describe(bound)}, not {_UTIL}.{name} (verl "
                     "wrapped or replaced it; cpshard would not know what the wrapper adds)",
                     "patch that module yourself, or call cpshard.compat.verl's functions from the wrapper")
            sites.append((module, name))
    mtp_patch = _mtp_patch_module(version)
    for module, name in sites:
        result._replace(module, name, _DROP_INS[name])
    _patch_pack_sites(result._replace)  # rearrange_micro_batches: verl.utils.seqlen_balancing and its binders
    _patch_dcp_site(result._replace)  # verl main's dynamic-CP padding mask
    if result.skipped:
        logger.info("cpshard.compat.verl: verl %s does not bind %s; left alone", version, ", ".join(result.skipped))
    result._originals = originals
    result.active = True
    if mtp_patch is not None:
        _route_mtp_loss(result, mtp_patch)
    (logger.debug if _logged else logger.info)(
        "cpshard.compat.verl: verl %s now packs with cpshard (%d names in %s)", version, len(result.replaced),
        ", ".join(modules))
    _logged = True
    return result


_MISSING = object()
_MTP_PATCH = "verl.models.mcore.mtp_patch"
_DCP = "verl.utils.dynamic_cp_scheduler"


def _patch_dcp_site(replace: Callable[[ModuleType, str, Any], None]) -> None:
    """Put :func:`local_padding_mask` in place of verl main's ``_local_padding_mask`` where that module
    imports (verl 0.9.1 has no dynamic CP) and the function takes verl main's parameters (else it is
    left alone and logged)."""
    want = [p for p in inspect.signature(local_padding_mask).parameters if p != "plan"]
    _bind_site(replace, _DCP, "_local_padding_mask", local_padding_mask,
               lambda fn: list(inspect.signature(fn).parameters), want, "verl main's")


def _describe(obj: Any) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(obj)


def _import_megatron_for_verl(version: str) -> None:
    """Import megatron-core the way cpshard does on a machine without Triton, before verl's modules
    import it themselves (verl's util imports ``megatron.core``; the Triton stand-in exists only
    while the one file that needs it runs: :mod:`cpshard.megatron._import`)."""
    from cpshard.megatron._import import INSTALL_HINT, import_megatron

    try:
        import_megatron("parallel_state")
        import_megatron("packed_seq_params")
    except ImportError as exc:
        fail("verl", version, f"needs megatron-core for its Megatron path, and importing it failed: {exc}",
             INSTALL_HINT.replace("megatron-core is not installed. ", "install it: "))


def _mtp_patch_module(version: str) -> ModuleType | None:
    """verl's MTP module, checked before anything is patched (None where Megatron cannot import)."""
    try:
        module = importlib.import_module(_MTP_PATCH)
    except ImportError as exc:
        logger.debug("cpshard.compat.verl: %s not importable (%s); its MTP loss is not routed", _MTP_PATCH, exc)
        return None
    if not isinstance(getattr(module, "_HAS_PROCESS_MTP_LOSS", None), bool):
        fail("verl", version, f"{_MTP_PATCH} has no _HAS_PROCESS_MTP_LOSS switch (cpshard routes its MTP loss as "
             f"verl {_WRITTEN_FOR} has it)", f"install verl=={_WRITTEN_FOR}")
    return module


def _route_mtp_loss(result: VerlPatch, mtp_patch: ModuleType) -> None:
    """Route verl's MTP loss through ``cpshard.megatron.process_mtp_loss`` on every Megatron-core version.

    verl 0.9.1's ``_megatron_gptmodel_postprocess`` calls ``_process_mtp_loss`` (megatron-core's,
    where it imports) when ``_HAS_PROCESS_MTP_LOSS``, else rolls labels itself with ``roll_tensor``
    (per-rank counts, zigzag only). Both module globals are read at call time, so pointing the
    first at cpshard's drop-in and setting the switch sends both paths through cpshard, exact at
    every ``cp`` and layout. The legacy path trained no output-layer weight from the MTP loss; where
    verl would have taken it, the drop-in gets ``mtp_detach_heads=True`` to keep that.
    """
    from cpshard.megatron import process_mtp_loss

    legacy = not mtp_patch._HAS_PROCESS_MTP_LOSS

    def routed(**kwargs: Any) -> Any:
        if legacy and "config" in kwargs:
            config = copy.copy(kwargs["config"])
            config.mtp_detach_heads = True
            kwargs["config"] = config
        return process_mtp_loss(**kwargs)

    routed.__wrapped__ = process_mtp_loss  # type: ignore[attr-defined]
    result._replace(mtp_patch, "_process_mtp_loss", routed)
    result._replace(mtp_patch, "_HAS_PROCESS_MTP_LOSS", True)
    result._replace(mtp_patch, "_PROCESS_MTP_LOSS_PARAMS", set(inspect.signature(process_mtp_loss).parameters))
