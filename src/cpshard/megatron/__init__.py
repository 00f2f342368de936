"""Megatron-core interop. ``import cpshard.megatron`` never needs Megatron; Megatron is imported
lazily (``cpshard.megatron._import``), only by the functions that use it.
"""

from cpshard.megatron._import import megatron_version
from cpshard.megatron.mtp import MtpLossImpl, mtp_loss_impl, plan_for_mtp, process_mtp_loss

__all__ = ["MtpLossImpl", "megatron_version", "mtp_loss_impl", "plan_for_mtp", "process_mtp_loss"]
