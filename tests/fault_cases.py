"""Rank bodies for tests/test_faults.py: ranks that disagree about one call, checks off unless named.
Each returns what its rank saw: ``("ok", result)`` or ``("raised", type name, message, seconds)``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cpshard import ShardPlan, shard
from cpshard.distributed import gather, relayout, shift_sharded, shift_sharded_multi


def _world() -> Any:
    return dist.group.WORLD


def _seen(call: Callable[[], Any]) -> tuple[Any, ...]:
    start = time.monotonic()
    try:
        out = call()
    except (ValueError, TypeError) as exc:
        return ("raised", type(exc).__name__, str(exc), time.monotonic() - start)
    return ("ok", out)


def plans_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Plans of the same local length (12 tokens either way: 6 rows per rank), checks off."""
    plan = ShardPlan.build([6, 2] if rank == 0 else [2, 6], cp_size=world)
    local = shard(torch.arange(8.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=False).values()),
            _seen(lambda: shift_sharded(local, plan, _world(), shift=1, check=False))]


def dtypes_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """float32 on rank 0, int32 (the same width) elsewhere."""
    plan = ShardPlan.build([5, 3], cp_size=world)
    local = shard(torch.arange(8.0), plan, rank)
    local = local if rank == 0 else local.int()
    return [_seen(lambda: gather(local, plan, _world(), check=False).values()),
            _seen(lambda: shift_sharded(local, plan, _world(), shift=1, check=False)),
            _seen(lambda: shift_sharded_multi([local], plan, _world(), shifts=[1, 2], check=False))]


def shifts_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Another fill value on rank 1; then shift 1 on rank 0 and -1 on rank 1 (one contiguous sequence:
    each rank sends the other only a header, where it expects a row more)."""
    plan = ShardPlan.build([9, 7], cp_size=world)
    local = shard(torch.arange(16.0), plan, rank)
    one = ShardPlan.build([8], cp_size=world, layout="contiguous")
    mine = shard(torch.arange(8.0), one, rank)
    return [_seen(lambda: shift_sharded(local, plan, _world(), shift=1, fill=-1 if rank == 1 else 0, check=False)),
            _seen(lambda: shift_sharded(mine, one, _world(), shift=-1 if rank == 1 else 1, check=False)),
            _seen(lambda: shift_sharded_multi([local], plan, _world(), shifts=[1, 2], fills=[-1 if rank == 1 else 0],
                                              check=False))]


def checks_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True on rank 0 only; the gather's message is as long as the check's (144 bytes)."""
    plan = ShardPlan.build([16, 24], cp_size=world, layout="contiguous")  # 20 float32 rows per rank: 80 bytes
    assert plan.local_len == 20
    local = shard(torch.arange(40.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=rank == 0).values())]


def relayout_plans_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """The twins of two plans of the same local length ([12, 4] and [4, 12]), zigzag to contiguous."""
    from cpshard import twin_plan
    plan = ShardPlan.build([12, 4] if rank == 0 else [4, 12], cp_size=world)
    local = shard(torch.arange(16.0), plan, rank)
    return [_seen(lambda: relayout(local, plan, twin_plan(plan, "contiguous"), _world(), check=False))]


def checks_differ_sizes(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True on rank 0 only, a gather of another size than the check: measured, not asserted."""
    plan = ShardPlan.build([500, 300], cp_size=world)
    local = shard(torch.arange(800.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=rank == 0).values())]
