"""The plan: its values (``ShardPlan``, ``BshdPlan``), the index service each one owns, twin plans,
and the causal masks and work under a plan. Pure: nothing here communicates."""

from cpshard.plan.exchanges import halo_exchange, shift_exchange
from cpshard.plan.values import DeviceTensors, Plan, PlanBase, ShardPlan
from cpshard.plan.varlen import VarlenMetadata, varlen_metadata

__all__ = ["DeviceTensors", "Plan", "PlanBase", "ShardPlan", "VarlenMetadata", "halo_exchange", "shift_exchange",
           "varlen_metadata"]
