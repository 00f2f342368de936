"""Megatron-core interop. ``import cpshard.megatron`` never needs Megatron; Megatron is imported
lazily (``cpshard.megatron._import``), only by the functions that use it. On a machine without
triton, :func:`install_cpu_stand_ins` lets your own ``import megatron.core`` work too, and
:func:`import_megatron` (``megatron.core.<module>``), :func:`import_roll_tensor` and ``INSTALL_HINT``
(the install commands an ``ImportError`` names) are the same import for adapters and tests.
"""

from cpshard.megatron._import import (
    INSTALL_HINT,
    import_megatron,
    import_roll_tensor,
    install_cpu_stand_ins,
    megatron_version,
)
from cpshard.megatron.mtp import MtpLossImpl, mtp_loss_impl, plan_for_mtp, process_mtp_loss
from cpshard.megatron.packed import (
    packed_seq_params,
    packed_seq_params_class,
    packed_seq_params_with_layout,
    plan_from_packed_seq_params,
    plan_from_padded,
    supports_cp_partition_mode,
)
from cpshard.megatron.state import ParallelContext, parallel_context, plan_from_parallel_state

__all__ = ["INSTALL_HINT", "MtpLossImpl", "ParallelContext", "import_megatron", "import_roll_tensor",
           "install_cpu_stand_ins", "megatron_version", "mtp_loss_impl",
           "packed_seq_params", "packed_seq_params_class", "packed_seq_params_with_layout", "parallel_context",
           "plan_for_mtp", "plan_from_packed_seq_params", "plan_from_padded", "plan_from_parallel_state",
           "process_mtp_loss", "supports_cp_partition_mode"]
