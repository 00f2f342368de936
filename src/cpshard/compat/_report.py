"""What an adapter's ``python -m`` report shares: the patch in force, or one made and undone quietly."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["held_or_trial", "report_main"]


def held_or_trial(active: Callable[[], Any], patch: Callable[[], Any], logger: str) -> tuple[Any, bool]:
    """``(the patch in force, True)``, or ``(patch() made and undone, False)`` with the ``logger`` quiet
    meanwhile (the report says what it bound). A refusal of ``patch()`` propagates."""
    held = active()
    if held is not None:
        return held, True
    quiet = logging.getLogger(logger)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with patch() as trial:
            pass
    finally:
        quiet.setLevel(level)
    return trial, False


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
