"""Import this module to switch cpshard on in the process, for its life: how a torchtitan job turns it on.

On torchtitan's command line, one flag beside the balancer's name (or the same two fields of the
``Trainer.Config`` a ``config_registry`` function returns)::

    --override.imports cpshard.compat.torchtitan.enable.switch_on
    --parallelism.context_parallel_load_balancer cpshard        # or cpshard_zigzag

torchtitan's trainer imports each ``override.imports`` module when it builds the model, in every
rank, before the first batch; importing this one binds cpshard's ``cp_shard``
(:func:`cpshard.compat.torchtitan.activate`) and registers :func:`switch_on`, an override of
``Profiler.Config`` that returns the config it is given (torchtitan's log names it: "[Override]
cpshard.compat.torchtitan.enable.switch_on: profiler Profiler.Config -> Profiler.Config"). A script
that drives torchtitan itself imports this module instead. What it bound is :data:`PATCH`;
``PATCH.undo()`` switches cpshard off again.
"""

from __future__ import annotations

from typing import Any

from cpshard.compat.torchtitan import _titan
from cpshard.compat.torchtitan._patch import activate

__all__ = ["PATCH", "switch_on"]

PATCH = activate()


def switch_on(config: Any) -> Any:
    """torchtitan's override factory: switches cpshard on (again, if undone) and returns ``config`` unchanged."""
    activate()
    return config


_titan.register_override(switch_on, "cpshard: load_balancer_type 'cpshard' / 'cpshard_zigzag' for cp_shard "
                                    "(the profiler's config is returned unchanged)")
