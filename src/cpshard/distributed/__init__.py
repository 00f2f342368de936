"""Across context-parallel ranks: the only collectives in cpshard (``collectives``), the call header
every data collective carries (``header``) and the agreement protocol of ``check=True`` (``agree``).

``cpshard.distributed`` is the public path; the names below are its API.
"""

from cpshard.distributed.collectives import (
    all_gather_rows,
    check_plan,
    checks_enabled,
    gather,
    gather_states,
    gather_tokens,
    group_rank,
    group_size,
    initialized,
    joined,
    max_over,
    plan_fingerprint,
    read_group,
    relayout,
    set_checks,
    shift_sharded,
    shift_sharded_multi,
    sum_over,
    sum_over_group,
)

__all__ = ["all_gather_rows", "check_plan", "checks_enabled", "gather", "gather_states", "gather_tokens",
           "group_rank", "group_size", "initialized", "joined", "max_over", "plan_fingerprint", "read_group", "relayout",
           "set_checks", "shift_sharded", "shift_sharded_multi", "sum_over", "sum_over_group"]
