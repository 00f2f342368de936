"""One sequence-parallel group split into a ring axis and a Ulysses axis: the process groups, made once,
collectively.

``split_axes(group, ring)``: the ``n`` ranks of ``group`` become ``ring`` ring ranks times ``n / ring``
Ulysses ranks, group rank ``i = r * U + u`` being ring rank ``r`` and Ulysses rank ``u`` (so the
Ulysses ranks of one ring rank are consecutive group ranks, the order of cpshard's two-axis layout,
and at ``ring = 1`` the whole group is the Ulysses axis, in its own order). ``torch.distributed``
makes a group only where every process of the world calls ``new_group`` with the same ranks in the
same order; a process knows only its own group, so every process first shares its group's ranks (one
``all_gather_object`` over the world), then all make every group's sub-groups in one sorted order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from cpshard.base.errors import check_int, fail
from cpshard.distributed.groups import group_ranks

__all__ = ["split_axes"]


def split_axes(group: Any, ring: int) -> tuple[Any, Any]:
    """``(ring_group, ulysses_group)`` of this process: ``group`` as ``ring`` x ``size / ring`` ranks
    (module docstring). Collective over the world group: every process calls it, with its own group
    (groups of one size; a process may pass the same group as others). ``ring`` must divide the size."""
    ring = check_int("ring", ring, minimum=1)
    mine = group_ranks(group)
    if len(mine) % ring:
        fail("ring", ring, f"must divide the size of the group ({len(mine)} ranks)", "pick a divisor of it")
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, ring))
    if len({(len(g), r) for g, r in every}) != 1:
        fail("group", f"groups and ring sizes {sorted(set(every))} across the world",
             "must be of one size and one ring size on every process", "pass each process its own group of the "
             "same mesh, with the same ring size")
    ulysses = len(mine) // ring
    me = dist.get_rank()
    ring_group = ulysses_group = None
    for ranks in sorted({g for g, _ in every}):
        for r in range(ring):  # the Ulysses groups of this group: consecutive ranks
            made = dist.new_group(list(ranks[r * ulysses:(r + 1) * ulysses]))
            if me in ranks[r * ulysses:(r + 1) * ulysses]:
                ulysses_group = made
        for u in range(ulysses):  # the ring groups: every U-th rank
            made = dist.new_group(list(ranks[u::ulysses]))
            if me in ranks[u::ulysses]:
                ring_group = made
    return ring_group, ulysses_group
