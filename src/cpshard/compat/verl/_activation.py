"""cpshard switched on for the life of a process, the way verl loads a plugin in every process.

verl's ``import verl`` imports each module of ``VERL_USE_EXTERNAL_MODULES`` (a comma-separated list)
and loads the ``verl.plugins`` entry points, in the driver and in every Ray worker, since each imports
verl. ``cpshard.compat.verl.enable`` is such a module: importing it calls :func:`activate`. The entry
point (:mod:`cpshard.compat.verl_plugin`) calls it only where ``CPSHARD_VERL=1``.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/__init__.py`` and
``verl/utils/import_utils.py`` (``import_external_libs``).
"""

from __future__ import annotations

import logging

from cpshard.compat.verl import _fsdp, _layout, _patch
from cpshard.compat.verl._patch import VerlPatch

__all__ = ["activate", "last_process_patch", "process_patch"]

logger = logging.getLogger("cpshard.compat.verl")
_PROCESS: list[VerlPatch | None] = [None]


def activate() -> VerlPatch:
    """Switch cpshard on in this process until ``undo()``: :func:`cpshard.compat.verl.patch`, once.

    Idempotent and thread-safe: every call returns the same :class:`VerlPatch` while it is active.
    ``CPSHARD_LAYOUT`` and ``CPSHARD_RING`` are read (and checked: ``ValueError``) first; then verl is
    imported, outside the lock (which may itself run this through ``VERL_USE_EXTERNAL_MODULES``: that inner
    call does the work), then the patch binds under the lock. A ``with patch():`` block in force is taken over: its
    bindings stay for the process, and its layout gives way to ``CPSHARD_LAYOUT``, the process's
    setting, which every process of a job reads alike (a block's ``patch(layout=...)`` override that
    differs is dropped, with a WARNING naming it and the variable to set). The ``cpshard.compat.verl``
    logger gets level INFO where it has none (verl configures the root logger at WARNING, which would
    hide the line of what was bound).
    """
    current = _PROCESS[0]
    if current is not None and current.active:
        return current
    _layout.setting()  # a clear error before anything is imported or bound
    _fsdp.ring_setting()
    _patch.show_info()
    # verl first, outside the lock: its import may run this activation (its external modules), which
    # takes the lock; holding it here while another thread imports verl would deadlock
    _patch._import_verl()
    with _patch.LOCK:
        current = _PROCESS[0]
        if current is not None and current.active:
            return current
        held = VerlPatch.in_force()
        block = _layout.current()
        if held is not None:  # a with patch() block: its bindings become the process's
            logger.info("cpshard.compat.verl: switched on for this process; the patch in force is undone and "
                        "bound again for the process")
            held.undo()
        current = _PROCESS[0] = _patch._patch(None, " for this process")
        if held is not None and block.override is not None and block.override is not _layout.current().override:
            logger.warning(
                "cpshard.compat.verl: activate() inside a `with patch(%s)` block: the process's patch reads its layout "
                "from %s (%s), so the block's %r override is dropped for the rest of the process (layout now: %s). "
                "Fix: set %s=%s in the job's environment, where every process reads it",
                block.source, _layout.ENV, _layout.current().source, block.override.value, _layout.describe(),
                _layout.ENV, block.override.value)
        return current


def process_patch() -> VerlPatch | None:
    """The patch :func:`activate` made, while it is active."""
    current = _PROCESS[0]
    return current if current is not None and current.active else None


def last_process_patch() -> VerlPatch | None:
    """The patch :func:`activate` made last, in force or undone since (``enable.PATCH``)."""
    return _PROCESS[0]
