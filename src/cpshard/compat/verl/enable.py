"""Import this module to switch cpshard on in the process, for its life: how a verl job turns it on.

Set ``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable`` where verl runs (the shell of the
driver, or Ray's ``runtime_env={"env_vars": {...}}`` for the workers): ``import verl`` imports it in
every process, before any worker builds a model. Importing it again changes nothing. What it bound,
skipped and refused is :data:`PATCH` (and the log: one INFO line, a WARNING per site left out);
``PATCH.undo()`` switches cpshard off again. ``CPSHARD_LAYOUT=zigzag|contiguous|auto`` sets the
layout of the sites verl passes none (docs/verl.md, "cpshard in a verl job").
"""

from __future__ import annotations

from cpshard.compat.verl._activation import activate

__all__ = ["PATCH"]

PATCH = activate()
