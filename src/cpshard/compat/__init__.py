"""Drop-in replacements for the sequence-packing helpers of frameworks built on Megatron-core: one
folder per framework, each holding its adapter's modules (beside it only what must load without the
package: verl's plugin entry point and verl's own partition).

- :mod:`cpshard.compat.verl`: verl 0.9.1's ``preprocess_thd_engine`` and friends, and ``patch()``.
- ``verl_partition(lens, dp_size, max_tokens)`` and ``verl_partitioner()``: verl's own partition of
  a batch into micro-batches (its ``get_seqlen_balanced_partitions`` when importable, else a
  re-statement), what ``cpshard pack`` and the packing benchmarks compare against. Loaded on first
  use (from :mod:`cpshard.compat.verl_balancing`): ``import cpshard.compat`` imports nothing more
  (verl's plugin entry point sits here).

Nothing here is imported by the core; each adapter builds a plan and calls the core.
"""

from typing import Any

_LAZY = {"verl_partition": "cpshard.compat.verl_balancing", "verl_partitioner": "cpshard.compat.verl_balancing"}


def __getattr__(name: str) -> Any:
    import importlib
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cpshard.compat' has no attribute {name!r}")


__all__ = ["verl_partition", "verl_partitioner"]
