"""What an adapter's ``python -m`` report shares: the patch in force, or one made and undone quietly."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["held_or_trial", "report_main", "state_line"]


def held_or_trial(active: Callable[[], Any], patch: Callable[[], Any], logger: str) -> tuple[Any, str]:
    """``(the patch in force, its state)`` (``"in force"``, or ``"partly in force"``: undone, but a site
    another library wrapped still holds its wrapper over cpshard's), or ``(patch() made and undone,
    "off")`` with the ``logger`` quiet meanwhile (the report says what it bound). A refusal of
    ``patch()`` propagates."""
    held = active()
    if held is not None:
        return held, held.state
    quiet = logging.getLogger(logger)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with patch() as trial:
            pass
    finally:
        quiet.setLevel(level)
    return trial, "off"


def state_line(report: dict[str, Any]) -> list[str]:
    """The report's lines of a patch partly in force: the sites ``undo()`` left behind another library's
    objects, and why (none where the patch is in force or off)."""
    if report.get("state") != "partly in force":
        return []
    return ([f"partly in force in this process: undone, but {len(report['unrestored'])} sites hold another "
             "library's object set over cpshard's (calls through them may still reach cpshard):"]
            + [f"  {site}: {reason}" for site, reason in report["unrestored"].items()])


def report_main(argv: Sequence[str] | None, prog: str, doc: str, status: Callable[[], dict[str, Any]],
                text: Callable[[dict[str, Any]], str], failed: Callable[[dict[str, Any]], bool]) -> int:
    """An adapter's ``python -m`` entry: ``--json`` prints ``status()`` as one JSON object, else ``text``
    of it; exit status 1 where ``failed`` of it, 0 otherwise (2 on a usage error, argparse's)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = status()
    print(json.dumps(report, indent=1) if args.json else text(report))
    return 1 if failed(report) else 0
