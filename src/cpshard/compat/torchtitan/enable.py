"""Import this module to switch cpshard on in the process, for its life: how a torchtitan job turns it on.

On torchtitan's command line, two flags: this module's override, and the balancer's name (or the
same two fields of the ``Trainer.Config`` a ``config_registry`` function returns)::

    --override.imports cpshard.compat.torchtitan.enable.switch_on
    --parallelism.context_parallel_load_balancer cpshard        # or cpshard_zigzag

The first switches cpshard on; the second chooses it (torchtitan's own ``headtail`` stays the
default, so a job that names no cpshard type runs as before).

torchtitan's trainer imports each ``override.imports`` module when it builds the model, in every
rank, before the first batch; importing this one binds cpshard's replacements
(:func:`cpshard.compat.torchtitan.activate`) and registers :func:`switch_on`, an override of
``Profiler.Config`` that returns the config it is given (torchtitan's log names it: "[Override]
cpshard.compat.torchtitan.enable.switch_on: profiler Profiler.Config -> Profiler.Config"). A script
that drives torchtitan itself imports this module instead. It stays on for the life of the process,
whatever block imports it (a ``with patch():`` block in force is taken over, not adopted).

:data:`PATCH`, read as ``enable.PATCH``, is always the process's patch: the one in force, the new one
after :func:`switch_on` switched cpshard on again, or, after ``PATCH.undo()`` (which switches cpshard
off), that undone one (``PATCH.state`` says which).
"""

from __future__ import annotations

from typing import Any

from cpshard.compat.torchtitan import _titan
from cpshard.compat.torchtitan._patch import activate, last_process_patch

__all__ = ["PATCH", "switch_on"]

activate()


def __getattr__(name: str) -> Any:
    if name == "PATCH":  # read afresh: never a patch undone and replaced since
        return last_process_patch()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def switch_on(config: Any) -> Any:
    """torchtitan's override factory: switches cpshard on (again, if undone) and returns ``config`` unchanged."""
    activate()
    return config


_titan.register_override(switch_on, "cpshard: load_balancer_type 'cpshard' / 'cpshard_zigzag' for cp_shard "
                                    "(the profiler's config is returned unchanged)")
