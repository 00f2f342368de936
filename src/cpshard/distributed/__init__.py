"""Across context-parallel ranks: the only collectives in cpshard.

``collectives`` (gather, shifts, relayout, the reference computations' gathers), ``sums`` (the stamped
reductions), ``checks`` (local checks and the agreement of ``check=True`` before any of them),
``ulysses`` (the head-parallel exchanges: ``exchange_dims``, ``all_gather_dim``), ``groups`` (the group a
call runs on: no communication), ``stamp`` (every all-gather and all-to-all led by the call's header),
``header`` (the header's and the trailer's words, pure) and ``agree`` (the agreement's rules, pure).

``cpshard.distributed`` is the public path; the names below are its API.
"""

from cpshard.distributed.agree import checks_enabled, set_checks
from cpshard.distributed.checks import check_plan, plan_fingerprint
from cpshard.distributed.collectives import (
    all_gather_rows,
    gather,
    gather_states,
    gather_tokens,
    joined,
    relayout,
    shift_sharded,
    shift_sharded_multi,
)
from cpshard.distributed.groups import group_rank, group_size, initialized, read_group
from cpshard.distributed.sums import max_over, sum_over, sum_over_group
from cpshard.distributed.ulysses import all_gather_dim, exchange_dims

__all__ = ["all_gather_dim", "all_gather_rows", "check_plan", "checks_enabled", "exchange_dims", "gather",
           "gather_states", "gather_tokens", "group_rank", "group_size", "initialized", "joined", "max_over",
           "plan_fingerprint", "read_group", "relayout", "set_checks", "shift_sharded", "shift_sharded_multi",
           "sum_over", "sum_over_group"]
