"""cpshard's ``verl.plugins`` entry point: switches cpshard on only where ``CPSHARD_VERL=1``.

verl loads every ``verl.plugins`` entry point on ``import verl`` (unless ``VERL_USE_EXTERNAL_PLUGINS``
says otherwise), in every process, for everyone who has cpshard installed; so this does nothing unless
the process opts in with ``CPSHARD_VERL=1`` (``0`` or unset: off). verl logs a plugin's exception only
at DEBUG and goes on, so an error here (a bad ``CPSHARD_VERL`` or ``CPSHARD_LAYOUT``, a refused verl)
is logged at ERROR before it is raised. ``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable`` is
the stricter way: there the error stops ``import verl``.

It lives outside the :mod:`cpshard.compat.verl` package on purpose: importing a submodule of that
package imports the whole package (the drop-ins, the collectives, torch.distributed) in every verl
process of everyone who has cpshard installed; here nothing more is imported unless ``CPSHARD_VERL=1``.
"""

from __future__ import annotations

import logging
import os

__all__: list[str] = []

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _wanted() -> bool:
    raw = os.environ.get("CPSHARD_VERL", "")
    if raw.strip().lower() in _ON:
        return True
    if raw.strip().lower() in _OFF:
        return False
    raise ValueError(f"CPSHARD_VERL={raw!r}: must be 1 (switch cpshard on in verl) or 0 / unset (off). "
                     "Fix: export CPSHARD_VERL=1, or unset it")


try:
    if _wanted():
        from cpshard.compat.verl import activate

        activate()
except Exception:
    logging.getLogger("cpshard.compat.verl").exception("cpshard.compat.verl: the verl.plugins entry point "
                                                       "(CPSHARD_VERL) could not switch cpshard on")
    raise
