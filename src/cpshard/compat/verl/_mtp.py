"""verl's MTP loss routed through :func:`cpshard.megatron.process_mtp_loss` (one site of the patch).

Sources read (not copied): verl 0.9.1's ``verl/models/mcore/mtp_patch.py``; megatron-core 0.19.2's
``process_mtp_loss``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cpshard.base.errors import fail
from cpshard.compat.verl._plans import WRITTEN_FOR
from cpshard.compat.verl.sites import MTP, cannot_import, import_site

__all__ = ["SITE", "mtp_module", "route_mtp_loss"]

SITE = f"{MTP}._process_mtp_loss"


def mtp_module(version: str) -> tuple[ModuleType | None, str]:
    """verl's MTP module, checked before anything is patched: ``(module, "")``, or ``(None, reason)``
    where it does not import (then the site is skipped); a module without verl's switch is refused
    with a ``ValueError`` (the patch changes nothing)."""
    module, exc = import_site(MTP)
    if module is None:
        return None, cannot_import(MTP, exc)
    if not isinstance(getattr(module, "_HAS_PROCESS_MTP_LOSS", None), bool):
        fail("verl", version, f"{MTP} has no _HAS_PROCESS_MTP_LOSS switch (cpshard routes its MTP loss as "
             f"verl {WRITTEN_FOR} has it)", f"install verl=={WRITTEN_FOR}")
    return module, ""


def route_mtp_loss(replace: Callable[[Any, str, Any, str | None], None], mtp_patch: ModuleType) -> None:
    """Route verl's MTP loss through ``cpshard.megatron.process_mtp_loss`` on every Megatron-core version
    (``replace(owner, name, new, site)``: the patch's, so that undo restores it).

    verl 0.9.1's ``_megatron_gptmodel_postprocess`` calls ``_process_mtp_loss`` (megatron-core's,
    where it imports) when ``_HAS_PROCESS_MTP_LOSS``, else rolls labels itself with ``roll_tensor``
    (per-rank counts, zigzag only). Both module globals are read at call time, so pointing the
    first at cpshard's drop-in and setting the switch sends both paths through cpshard, exact at
    every ``cp`` and layout (the layout is the micro-batch's ``PackedSeqParams``'). The legacy path
    trained no output-layer weight from the MTP loss; where verl would have taken it, the drop-in gets
    ``mtp_detach_heads=True`` to keep that.
    """
    from cpshard.megatron import process_mtp_loss

    legacy = not mtp_patch._HAS_PROCESS_MTP_LOSS

    def routed(**kwargs: Any) -> Any:
        if legacy and "config" in kwargs:
            config = copy.copy(kwargs["config"])
            config.mtp_detach_heads = True
            kwargs["config"] = config
        return process_mtp_loss(**kwargs)

    routed.__wrapped__ = process_mtp_loss  # type: ignore[attr-defined]
    replace(mtp_patch, "_process_mtp_loss", routed, SITE)
    replace(mtp_patch, "_HAS_PROCESS_MTP_LOSS", True, None)  # switches beside the site, not sites
    replace(mtp_patch, "_PROCESS_MTP_LOSS_PARAMS", set(inspect.signature(process_mtp_loss).parameters), None)
