"""Megatron-core interop. ``import cpshard.megatron`` never needs Megatron; Megatron is imported
lazily (``cpshard.megatron._import``), only by the functions that use it.
"""

from cpshard.megatron._import import megatron_version

__all__ = ["megatron_version"]
