"""The plans verl's drop-ins build, and what they share: verl's checks, parallel state, restore.

``thd_plan`` / ``bshd_plan`` are the plans ``preprocess_thd_engine`` / ``preprocess_bshd_engine``
build (pass one as ``plan=`` to share it across a step); ``local_padding_mask`` is verl's dynamic-CP
router mask from the same plan. The plan travels with what preprocess returns (an attribute of the
``PackedSeqParams`` and of the BSHD mask), so the matching postprocess restores by that very plan.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/util.py`` and
``verl/utils/dynamic_cp_scheduler.py``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from typing import Any

import torch

from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.base.layout import Layout, alignment, fp8_total_alignment, require_equal_chunks, total_problem
from cpshard.compat.verl import _rows
from cpshard.compat.verl import _layout
from cpshard.distributed.collectives import gather, gather_tokens
from cpshard.megatron.state import ParallelContext, parallel_context
from cpshard.ops.sharding import unshard
from cpshard.plan.args import jagged_lengths, parse_seqlens
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.values import ShardPlan

__all__ = ["bshd_plan", "local_padding_mask", "thd_plan"]

# The attribute under which a plan travels with the PackedSeqParams / BSHD mask that preprocess
# returns, so that the matching postprocess restores by the very same plan (no re-derivation).
_PLAN_ATTR = "_cpshard_plan"
WRITTEN_FOR = "0.9.1"  # the verl release whose signatures the drop-ins take


def verl_version(default: str = "unknown") -> str:
    """The installed verl's version (its distribution metadata), else ``default``."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return default


def layout_of(cp_layout: Any, site: str, cp_size: int | None = None) -> Layout:
    """The ``cp_layout`` verl passed (checked as verl checks it), else the layout in use for ``site``
    (:mod:`cpshard.compat.verl._layout`: the override, the engine's model, or zigzag)."""
    return _layout.in_use(site, cp_size) if cp_layout is None else _cp_layout(cp_layout)


def _cp_layout(value: Any) -> Layout:
    """verl's check of ``cp_layout``, in its words (its tests match them), with cpshard's fix."""
    if isinstance(value, Layout) or value in ("zigzag", "contiguous"):
        return Layout.parse(value, "cp_layout")
    raise ValueError(f"Unsupported context parallel layout: {value} (cp_layout={value!r}; valid: 'zigzag', "
                     "'contiguous'). Fix: pass cp_layout='zigzag' (balanced causal attention) or 'contiguous' "
                     "(kernels such as DeepSeek-V4's dsv4_hybrid)")


@functools.lru_cache(maxsize=1)
def _installed_rules() -> _rows.Rules:
    return _rows.rules_for(verl_version(default=WRITTEN_FOR))


def _rules(verl_version: str | None) -> _rows.Rules:
    if verl_version is None:
        return _installed_rules()
    if not isinstance(verl_version, str):
        fail("verl_version", repr(verl_version), "must be a version string", "pass e.g. '0.9.1', or None",
             kind=TypeError)
    return _rows.rules_for(verl_version)


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
    cp_layout: Layout | str | None = None,
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
    contiguous, ``min_local_rows`` positive. ``cp_layout=None`` (not passed): the layout in use
    (:mod:`cpshard.compat.verl._layout`; zigzag, verl's default, while cpshard is off)."""
    cp = check_int("cp_size", cp_size, minimum=1)
    rank = check_int("cp_rank", cp_rank, minimum=0)
    if rank >= cp:
        fail("cp_rank", rank, f"must be below cp_size={cp}", f"pass a rank in 0..{cp - 1}")
    layout = layout_of(cp_layout, "local_padding_mask", cp)
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
    require_equal_chunks(plan, "verl's Megatron drop-ins (Megatron's THD attention)")
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


def _seqlens(input_ids: Any) -> tuple[int, ...]:
    if not (isinstance(input_ids, torch.Tensor) and input_ids.is_nested):
        fail("input_ids", type(input_ids).__name__, "must be the micro-batch as a jagged nested tensor",
             "pass the same input_ids as to preprocess", kind=TypeError)
    return jagged_lengths(input_ids, "input_ids")


def _check_batch(batch_size: Any, num_seqs: int) -> None:
    if check_int("batch_size", batch_size, minimum=1) != num_seqs:
        fail("batch_size", batch_size, f"must equal the micro-batch's {num_seqs} sequences",
             "pass input_ids.shape[0]")


