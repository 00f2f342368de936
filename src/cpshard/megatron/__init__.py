"""Megatron-core interop. ``import cpshard.megatron`` never needs Megatron; Megatron is imported
lazily (``cpshard.megatron._import``), only by the functions that use it.
"""

from cpshard.megatron._import import megatron_version

__all__ = ["megatron_version"]

# -- PackedSeqParams and parallel state (issue 8) ---------------------------------------------
from cpshard.megatron.packed import (  # noqa: E402
    packed_seq_params,
    packed_seq_params_class,
    plan_from_packed_seq_params,
    plan_from_padded,
    supports_cp_partition_mode,
)
from cpshard.megatron.state import ParallelContext, parallel_context, plan_from_parallel_state  # noqa: E402

__all__ += ["ParallelContext", "packed_seq_params", "packed_seq_params_class", "parallel_context",
            "plan_from_packed_seq_params", "plan_from_padded", "plan_from_parallel_state",
            "supports_cp_partition_mode"]
