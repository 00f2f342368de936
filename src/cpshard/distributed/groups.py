"""The process group of a call: whether it holds this process, its size and this rank's place in it.

No communication here (``torch.distributed``'s own queries only). Every collective of
``cpshard.distributed`` checks its group through these before it sends anything; ``group=None`` is
accepted at ``cp_size == 1`` in one place, :func:`solo`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cpshard.base.errors import fail
from cpshard.base.types import Group
from cpshard.ops.sharding import check_plan_type
from cpshard.plan.values import Plan

__all__ = ["collective_device", "group_rank", "group_ranks", "group_size", "initialized", "read_group", "require_group",
           "solo"]


def require_group(group: Any) -> None:
    """The group is initialized and holds this process. No communication."""
    if not (dist.is_available() and dist.is_initialized()):
        fail("group", repr(group), "needs an initialized torch.distributed process group (one process per CP "
             "rank, each holding its shard)", "start the ranks with torchrun or cpshard.spawn.run_ranks, call "
             "torch.distributed.init_process_group in each and pass the CP group; in one process, a loss or a "
             "collective runs on the whole batch with a cp_size=1 plan and group=None (cpshard.unshard puts "
             "the shards of a larger plan back together)")
    if group is None:
        fail("group", "None", "must be the context-parallel process group (there is no default: in a "
             "DP x CP x TP job the world group would mix replicas' rows)",
             "pass your CP group, or torch.distributed.group.WORLD if the whole job is one CP group", kind=TypeError)
    if dist.get_rank(group) < 0:
        fail("group", f"a group of ranks {_group_ranks(group)}", f"does not contain this process (global rank "
             f"{dist.get_rank()})", "pass the context-parallel group this rank belongs to")


def _group_ranks(group: Any) -> Any:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - only for the message
        return "(unknown)"


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks ``group`` holds, in group-rank order (torch's ``get_process_group_ranks``), after
    checking it holds this process. No communication; what an adapter reads to refuse overlapping groups."""
    require_group(group)
    return tuple(dist.get_process_group_ranks(group))


def solo(plan: Plan, group: Group) -> bool:
    """One rank and no group: every function here then runs without ``torch.distributed`` (the one
    place that rule is written)."""
    return group is None and plan.cp_size == 1


def group_rank(plan: Plan, group: Any) -> int:
    """This process's rank in ``group`` (its CP rank), after checking the group fits ``plan``. No communication.
    ``group=None`` is accepted where ``plan.cp_size == 1`` (rank 0, nothing to communicate)."""
    check_plan_type(plan)
    if solo(plan, group):
        return 0
    require_group(group)
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        fail("group", f"a group of {size} ranks", f"must have plan.cp_size = {plan.cp_size} ranks",
             "pass the context-parallel group the plan was built for (or build the plan with "
             f"cp_size={size})")
    return dist.get_rank(group)


def collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialized() -> bool:
    """Whether ``torch.distributed`` is available and initialized (no communication)."""
    return dist.is_available() and dist.is_initialized()


def read_group(group: Any, what: str) -> int | None:
    """``torch.distributed.get_rank(group=)`` (``what="rank"``) or ``get_world_size(group=)``
    (``"size"``), looked up at call time (tests may fake them), or None where torch does not know the
    group (not initialized, or a stand-in object). No communication; what verl's helpers read."""
    reader = getattr(dist, "get_rank" if what == "rank" else "get_world_size", None)
    if reader is None or not dist.is_available():
        return None
    try:
        return int(reader(group=group))
    except (RuntimeError, ValueError, KeyError, AttributeError, TypeError):
        return None


def group_size(group: Any, name: str = "group") -> int:
    """The number of ranks in ``group``, after checking it holds this process. No communication."""
    try:
        require_group(group)
    except (TypeError, ValueError) as exc:  # name the caller's argument, keep the rest of the message
        message = str(exc).replace("group=", f"{name}=", 1)
        if name == "dp_group":  # the fix names the group the caller meant (it named the CP group before)
            message = message.replace("the context-parallel group this rank", "the data-parallel group this rank")
        raise type(exc)(message) from None
    return dist.get_world_size(group)
