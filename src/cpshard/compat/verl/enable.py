"""Import this module to switch cpshard on in the process, for its life: how a verl job turns it on.

Set ``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable`` where verl runs (the shell of the
driver, or Ray's ``runtime_env={"env_vars": {...}}`` for the workers): ``import verl`` imports it in
every process, before any worker builds a model. Importing it again changes nothing. What it bound,
skipped and refused is :data:`PATCH` (and the log: one INFO line, a WARNING per site left out);
``PATCH.undo()`` switches cpshard off again. Read as ``enable.PATCH``, it is always the process's
patch: the one in force, the new one after :func:`cpshard.compat.verl.activate` switched cpshard on
again, or, after ``PATCH.undo()``, that undone one (``PATCH.state`` says which).
``CPSHARD_LAYOUT=zigzag|contiguous|auto`` sets the layout of the sites verl passes none (docs/verl.md,
"cpshard in a verl job").
"""

from __future__ import annotations

from typing import Any

from cpshard.compat.verl._activation import activate, last_process_patch

__all__ = ["PATCH"]

activate()


def __getattr__(name: str) -> Any:
    if name == "PATCH":  # read afresh: never a patch undone and replaced since
        return last_process_patch()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
