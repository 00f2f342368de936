"""``python -m cpshard.compat.torchtitan [--json]``: what cpshard binds in torchtitan in this environment.

Run it where the job runs, before a run: it prints the versions (and those tested), the config lines
that switch cpshard on, and the sites bound: the patch in force, or, where nothing switched cpshard
on, what :func:`cpshard.compat.torchtitan.patch` would bind (it patches and undoes). Exit status 0
when the check passed, 1 when torchtitan is missing or differs from the version cpshard follows, 2 on
a usage error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.compat._report import held_or_trial, report_main, state_line
from cpshard.compat.torch_cp import TESTED_TORCH
from cpshard.compat.torchtitan import _patch, _titan

__all__ = ["main", "status"]

CONFIG = ["--override.imports cpshard.compat.torchtitan.enable.switch_on     # switches cpshard on",
          "--parallelism.context_parallel_load_balancer cpshard     # chooses it (or cpshard_zigzag)"]


def status() -> dict[str, Any]:
    """``on`` (a patch in force in this process), ``state`` (``"in force"``, ``"partly in force"``,
    ``"off"``), ``torchtitan``, ``torch``, ``tested``, ``kinds``, ``bound``, ``skipped``,
    ``unrestored`` (sites an undo left behind another library's objects), ``error`` (torchtitan's
    import error, naming where it looked and how to put torchtitan on the path, or the check's
    refusal), ``config``."""
    out: dict[str, Any] = {"on": False, "state": "off", "torchtitan": _titan.torchtitan_version(),
                           "torch": torch.__version__,
                           "tested": {"torchtitan": _titan.TESTED_TORCHTITAN, "torch": TESTED_TORCH},
                           "kinds": [], "bound": [], "skipped": {}, "unrestored": {}, "error": None, "config": CONFIG}
    try:
        held, out["state"] = held_or_trial(_patch.active, _patch.patch, "cpshard.compat.torchtitan")
    except (ImportError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(on=out["state"] == "in force", kinds=list(held.kinds), bound=list(held.bound),
               skipped=dict(held.skipped), unrestored=dict(held.unrestored))
    return out


def _text(report: dict[str, Any]) -> str:
    tested = report["tested"]
    lines = [f"cpshard in torchtitan {report['torchtitan'] or '(not installed)'} on torch {report['torch']}, "
             f"pid {os.getpid()} (tested: torchtitan {tested['torchtitan']}, torch {tested['torch']})"]
    if report["error"]:
        return "\n".join([*lines, f"refused: {report['error']}"])
    lines.append(("on in this process" if report["on"] else "partly in force in this process; it had bound:"
                  if report["state"] == "partly in force" else "off in this process; patch() would bind:")
                 + f" {len(report['bound'])} sites, load_balancer_type {' / '.join(map(repr, report['kinds']))}")
    lines += [f"  {site}" for site in report["bound"]]
    lines += state_line(report)
    lines.append(f"skipped: {len(report['skipped'])}")
    lines += [f"  {site}: {reason}" for site, reason in report["skipped"].items()]
    lines.append("switch it on in the job's config (torchtitan's command line, or these fields of its Trainer.Config):")
    lines += [f"  {line}" for line in report["config"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return report_main(argv, "python -m cpshard.compat.torchtitan", __doc__, status, _text,
                       lambda report: bool(report["error"]))


if __name__ == "__main__":
    sys.exit(main())
