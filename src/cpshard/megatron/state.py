"""Megatron-core's parallel state, read in one place: sizes, ranks and groups for building plans.

``parallel_context()`` answers "what are this rank's TP size, CP size, CP rank and CP group?" from
values the caller passes, else from a ``pg_collection`` (Megatron's ``ProcessGroupCollection``,
whose ``.tp`` and ``.cp`` are process groups), else from ``megatron.core.parallel_state``'s
getters. ``plan_from_parallel_state(seqlens, ...)`` builds the micro-batch's plan from it, with the
layout from ``cpshard.layout_for(config)`` (the one layout decision) and fp8 padding where the
config trains in fp8, as Megatron users (verl) pad.

Drift between heads is impossible by construction when a step builds one plan and passes it
everywhere: the policy head's tokens and labels, the value head's inputs and the restore of
both heads' outputs all use that plan (``cpshard.compat.verl`` functions take ``plan=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout
from cpshard.distributed.groups import read_group
from cpshard.megatron._import import import_megatron, megatron_version
from cpshard.plan.values import ShardPlan
from cpshard.policy.layouts import layout_for

__all__ = ["ParallelContext", "fp8_padding", "parallel_context", "plan_from_parallel_state"]


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the tensor- and context-parallel groups."""

    tp_size: int
    cp_size: int
    cp_rank: int
    cp_group: Any = None


def _group_read(group: Any, name: str, what: str) -> int:
    """The group's ``what`` ("rank" or "size") as verl reads it: ``torch.distributed.get_rank(group=)`` /
    ``get_world_size(group=)`` (which answer for any group torch knows, and which tests may fake),
    else the object's own ``rank()`` / ``size()``."""
    reader_name = "get_rank" if what == "rank" else "get_world_size"
    known = read_group(group, what)
    if known is not None:
        return known
    try:  # torch does not know this group (not initialized, or a stand-in): ask the object
        return int(getattr(group, what)())
    except (AttributeError, TypeError):
        fail(name, type(group).__name__, f"must be a process group (torch.distributed.{reader_name}(group=...) "
             f"cannot answer for it, and it has no {what}())",
             "pass a torch.distributed ProcessGroup", kind=TypeError)


def _group_size_rank(group: Any, name: str) -> tuple[int, int]:
    return _group_read(group, name, "size"), _group_read(group, name, "rank")


def _dynamic_group(size: int) -> Any:
    """verl's dynamic-CP group of ``size`` ranks: Megatron-LM dev's
    ``get_dynamic_data_context_parallel_groups``, or main's and releases' (0.16-0.19)
    ``get_hybrid_data_context_parallel_groups``."""
    mpu = import_megatron("parallel_state")
    for name in ("get_dynamic_data_context_parallel_groups", "get_hybrid_data_context_parallel_groups"):
        if hasattr(mpu, name):
            return _read_state(name, group_size=size)
    fail("local_cp_size", size, f"needs a dynamic context-parallel group, and megatron-core {megatron_version()}'s "
         "parallel_state has neither get_dynamic_data_context_parallel_groups nor "
         "get_hybrid_data_context_parallel_groups", "pass cp_group= (the micro-batch's group of local_cp_size ranks)")


def _read_state(what: str, **kwargs: Any) -> Any:
    """Call one of ``megatron.core.parallel_state``'s getters, with a clear error if it cannot answer."""
    mpu = import_megatron("parallel_state")
    if not hasattr(mpu, what):
        fail(what, f"missing from megatron-core {megatron_version()}'s parallel_state",
             "cpshard reads the parallel sizes and groups that were not passed from there",
             "pass them explicitly (tp_size=, cp_size=, cp_rank=, cp_group=), or use a megatron-core that has it")
    try:
        return getattr(mpu, what)(**kwargs)
    except (AssertionError, RuntimeError, KeyError) as exc:
        fail(what, f"megatron.core.parallel_state.{what}() raised {type(exc).__name__}: {exc}",
             "Megatron's parallel state must be initialized to read the parallel sizes from it",
             "call parallel_state.initialize_model_parallel(...) first, or pass tp_size=, cp_size=, cp_rank= "
             "(and cp_group=) or pg_collection= explicitly")


def parallel_context(
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
    pg_collection: Any = None,
    local_cp_size: int | None = None,
    need_group: bool = True,
) -> ParallelContext:
    """TP size, CP size, CP rank and CP group: what is passed, else read once (no collective).

    A value the caller passes always wins. The rest comes from ``cp_group`` (its size and rank),
    then ``pg_collection.tp`` / ``.cp``, then ``megatron.core.parallel_state``. Megatron reports a
    CP size of 0 before ``torch.distributed`` is initialized; that reads as one rank (rank 0).

    ``local_cp_size`` selects verl's dynamic CP: a per-micro-batch group of that many ranks, from
    ``parallel_state.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)`` (Megatron-LM
    dev; ``get_hybrid_data_context_parallel_groups`` on main and the releases) unless ``cp_group`` is
    passed. A group's size and rank are read as verl reads them, through
    ``torch.distributed.get_world_size(group=)`` / ``get_rank(group=)``. ``need_group=False`` leaves
    ``cp_group`` None rather than reading it (for callers that do not communicate).
    """
    if local_cp_size is not None:
        local_cp_size = check_int("local_cp_size", local_cp_size, minimum=1)
        if cp_size is not None and cp_size != local_cp_size:
            fail("cp_size", cp_size, f"contradicts local_cp_size={local_cp_size} (dynamic CP uses a group of "
                 "local_cp_size ranks)", "pass only one of them, or equal values")
        cp_size = local_cp_size
        if cp_group is None and (cp_rank is None or need_group):
            cp_group = _dynamic_group(local_cp_size)
    if cp_group is not None:
        if cp_size is None:
            cp_size = _group_read(cp_group, "cp_group", "size")
        if cp_rank is None:
            cp_rank = _group_read(cp_group, "cp_group", "rank")
    if pg_collection is not None:
        if tp_size is None:
            tp_size = _group_size_rank(getattr(pg_collection, "tp", None), "pg_collection.tp")[0]
        if cp_size is None or cp_rank is None or cp_group is None:
            group = getattr(pg_collection, "cp", None)
            size, rank = _group_size_rank(group, "pg_collection.cp")
            cp_size = size if cp_size is None else cp_size
            cp_rank = rank if cp_rank is None else cp_rank
            cp_group = group if cp_group is None else cp_group
    if tp_size is None:
        tp_size = _read_state("get_tensor_model_parallel_world_size")
    if cp_size is None:
        cp_size = _read_state("get_context_parallel_world_size") or 1
    if cp_rank is None:
        cp_rank = _read_state("get_context_parallel_rank") if cp_size > 1 else 0
    if cp_group is None and cp_size > 1 and need_group:
        cp_group = _read_state("get_context_parallel_group")
    tp_size = check_int("tp_size", tp_size, minimum=1)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    cp_rank = check_int("cp_rank", cp_rank, minimum=0)
    if cp_rank >= cp_size:
        fail("cp_rank", cp_rank, f"must lie in [0, cp_size) = [0, {cp_size})",
             "pass the rank's index inside its context-parallel group")
    return ParallelContext(tp_size, cp_size, cp_rank, cp_group)


def fp8_padding(config: Any) -> bool:
    """Whether a Megatron config pads for fp8 (``config.fp8`` is ``"e4m3"`` or ``"hybrid"``, as verl decides)."""
    return getattr(config, "fp8", None) in ("e4m3", "hybrid")


def plan_from_parallel_state(
    seqlens: Sequence[int] | torch.Tensor,
    *,
    config: Any = None,
    pg_collection: Any = None,
    layout: Layout | str | None = None,
    fp8: bool | None = None,
    min_local_rows: int | None = None,
    length_bucket: int | None = None,
) -> ShardPlan:
    """The micro-batch's :class:`~cpshard.ShardPlan`, sized by Megatron's parallel state.

    Args:
        seqlens: the sequence lengths, or the batch as a jagged nested tensor.
        config: the model's ``TransformerConfig``: gives the layout (``layout_for(config)``) and
            fp8 padding (:func:`fp8_padding`) unless ``layout`` / ``fp8`` are passed.
        pg_collection: Megatron's ``ProcessGroupCollection`` (``.tp``, ``.cp``); default the global
            ``parallel_state``.
        layout, fp8, min_local_rows, length_bucket: as :meth:`ShardPlan.build`.

    Build it once per step and shard every tensor of the step with it (tokens, labels, loss masks,
    router-replay indices, teacher top-k rows), and restore the policy and value heads' outputs with
    it: one plan, so no two paths can disagree about the layout.
    """
    ctx = parallel_context(pg_collection=pg_collection)
    if layout is None:
        layout = layout_for(config) if config is not None else Layout.ZIGZAG
    if fp8 is None:
        fp8 = fp8_padding(config) if config is not None else False
    return ShardPlan.build(seqlens, cp_size=ctx.cp_size, tp_size=ctx.tp_size, layout=layout, fp8=fp8,
                           min_local_rows=min_local_rows, length_bucket=length_bucket)
