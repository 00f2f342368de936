"""``python -m cpshard.compat.verl [--json]``: what cpshard binds in verl in this environment.

Run it in a worker image, with the job's environment variables, before a run: it imports verl (so
``VERL_USE_EXTERNAL_MODULES`` / ``CPSHARD_VERL`` switch cpshard on as in a worker), then prints the
patch in force, or, where nothing switched cpshard on, what :func:`cpshard.compat.verl.patch` would
bind (it patches and undoes). Exit status 0 when every check passed, 1 when verl, cpshard's
activation (an invalid ``CPSHARD_LAYOUT`` stops ``import verl`` there) or its patch refused (the
reason is printed, naming which), 2 on a usage error.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Sequence
from typing import Any

from cpshard.compat._report import held_or_trial, report_main, state_line
from cpshard.compat.verl import _activation, _fsdp, _patch
from cpshard.compat.verl._plans import verl_version

__all__ = ["main", "status"]


def _switched_on_by() -> str:
    modules = [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]
    if "cpshard.compat.verl.enable" in modules:
        return "VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable"
    if os.environ.get("CPSHARD_VERL", "").strip().lower() in ("1", "true", "yes", "on"):
        return "CPSHARD_VERL=1 (the verl.plugins entry point)"
    return "nothing in this environment (set VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable)"


def _entry_point() -> str | None:
    try:
        found = importlib.metadata.entry_points(group="verl.plugins")
    except Exception:  # noqa: BLE001  (broken metadata of another package)
        return None
    return next((f"{ep.name} = {ep.value}" for ep in found if ep.value.startswith("cpshard.")), None)


def status() -> dict[str, Any]:
    """What cpshard binds here: ``on`` (whether a patch is in force in this process after ``import verl``),
    ``state`` (``"in force"``, ``"partly in force"``: undone, but a site another library wrapped still
    holds its wrapper over cpshard's, named in ``unrestored``; ``"off"``), ``by``, ``verl``, ``layout``,
    ``ring`` (the FSDP backend's ring size), ``bound``, ``skipped``, ``refused``, ``error`` (a refusal of
    the whole patch, or verl's import error), ``entry_point``."""
    out: dict[str, Any] = {"by": _switched_on_by(), "entry_point": _entry_point(), "on": False, "state": "off",
                           "verl": None, "layout": None, "ring": None, "bound": [], "skipped": {}, "refused": {},
                           "unrestored": {}, "error": None}
    try:
        import verl

        out["verl"] = getattr(verl, "__version__", None)
        held, out["state"] = held_or_trial(_patch.active, _patch.patch, "cpshard.compat.verl")
        out["on"] = out["state"] == "in force"
    except Exception as exc:  # noqa: BLE001  (verl's import, or the patch's refusal: reported)
        out["error"] = f"{type(exc).__name__}: {exc}"
        if _raised_by_activation(exc):  # verl imported cpshard's activation (enable), which refused
            out["verl"] = verl_version()
            out["error"] = f"cpshard's activation (run by `import verl`: {out['by']}): {out['error']}"
        return out
    out.update(layout=held.layout, ring=held.ring, bound=list(held.bound), skipped=dict(held.skipped),
               refused=dict(held.refused), unrestored=dict(held.unrestored))
    out["process"] = _activation.process_patch() is held
    return out


def _raised_by_activation(exc: BaseException) -> bool:
    """Whether ``exc`` came out of :func:`cpshard.compat.verl.activate` (run by ``import verl``, through
    ``VERL_USE_EXTERNAL_MODULES``), rather than from verl's own import or the patch."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _activation.activate.__code__:
            return True
        tb = tb.tb_next
    return False


def _text(report: dict[str, Any]) -> str:
    lines = [f"cpshard in verl {report['verl'] or '(not importable)'}, pid {os.getpid()}",
             f"switched on by: {report['by']}",
             f"verl.plugins entry point: {report['entry_point'] or 'not registered'} (patches where CPSHARD_VERL=1)"]
    if report["error"]:
        return "\n".join([*lines, f"refused: {report['error']}"])
    lines.append(("on in this process; bound:" if report["on"] else "partly in force in this process; it had bound:"
                  if report["state"] == "partly in force" else "off in this process; patch() would bind:")
                 + f" {len(report['bound'])} sites")
    lines += state_line(report)
    lines.append(f"layout: {report['layout']}")
    lines.append(f"FSDP backend: ring size {report['ring']} ({_fsdp.describe_ring(report['ring'])})")
    modules: dict[str, list[str]] = {}
    for site in report["bound"]:
        owner = _patch.owner(site)  # a class's method: module, then Class.method
        modules.setdefault(owner, []).append(site[len(owner) + 1:])
    lines += [f"  {owner} ({len(names)}): {', '.join(names)}" for owner, names in modules.items()]
    for what in ("skipped", "refused"):
        lines.append(f"{what}: {len(report[what])}")
        lines += [f"  {site}: {reason}" for site, reason in report[what].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return report_main(argv, "python -m cpshard.compat.verl", __doc__, status, _text,
                       lambda report: bool(report["error"] or report["refused"]))


if __name__ == "__main__":
    sys.exit(main())
