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
    supports_cp_partition_mode,
)

__all__ += ["packed_seq_params", "packed_seq_params_class", "plan_from_packed_seq_params",
            "supports_cp_partition_mode"]
