"""The agreement protocol of ``check=True`` and ``check_plan``: what each rank contributes to the one
small all-gather, and what every rank concludes from everyone's contributions. Pure: the collective
itself is ``cpshard.distributed``'s (the only module that communicates); the process-wide switch
(``set_checks``, ``CPSHARD_CHECK``) lives here.

Each rank contributes twenty-six int64 words, after a ``CHECK`` call header (``distributed/header.py``: a
peer that runs a data collective here instead, its checks off, is named rather than read as these
words): its plan's fingerprint (eight, ``PlanIndices.fingerprint``), a digest of the call's arguments
that every rank must pass alike, whether its own input checks failed, and one digest per argument
(``ARG_SLOTS``, in name order; the last slot folds the rest), so that the error names the arguments
that differ. Floats are digested by their exact bits (``header.digest``). Every rank then sees the
same rows and raises the same error (or none), so nothing hangs: different plans first (the root
cause of most other errors), then a rank's own error, then the ranks that rejected their input, then
different arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cpshard.base.errors import fail
from cpshard.distributed.header import digest

__all__ = ["ARG_SLOTS", "checks_enabled", "contribution", "describe", "judge", "resolve_check", "set_checks"]

ARG_SLOTS = 16  # one digest per argument of the call (the last slot folds the rest)

_CHECKS = [os.environ.get("CPSHARD_CHECK", "").strip().lower() in ("1", "true", "yes", "on")]


def set_checks(enabled: bool) -> bool:
    """Turn the agreement checks of ``check=True`` on or off for every call that passes ``check=None``.

    For debugging runs (the environment variable ``CPSHARD_CHECK=1`` does the same at import).
    Returns the previous setting, so that a test or a debugging block can restore it.
    """
    if not isinstance(enabled, bool):
        fail("enabled", repr(enabled), "must be a bool", "pass True or False", kind=TypeError)
    previous, _CHECKS[0] = _CHECKS[0], enabled
    return previous


def checks_enabled() -> bool:
    """Whether calls with ``check=None`` run the agreement checks (see :func:`set_checks`)."""
    return _CHECKS[0]


def resolve_check(check: Any) -> bool:
    if check is None:
        return _CHECKS[0]
    if not isinstance(check, bool):
        fail("check", repr(check), "must be True, False or None (the process-wide default)",
             "pass check=True", kind=TypeError)
    return check


def describe(fp: Sequence[int]) -> str:
    if fp[1] == 0:  # the zero fingerprint of a rank that passed no plan at all
        return "no plan (see that rank's own error)"
    kind = "BshdPlan" if fp[0] else "ShardPlan"
    layout = "zigzag" if fp[3] == 0 else "contiguous"
    return (f"{kind}(cp_size={fp[1]}, tp_size={fp[2]}, layout={layout!r}, num_seqs={fp[4]}, total_len={fp[5]}, "
            f"digest={fp[6]:x})")


_digest = digest  # floats by their exact bits (their repr)


def _slots(call: dict[str, Any]) -> list[int]:
    """One digest per argument (name and value) in name order; the last slot folds the rest."""
    items = sorted(call.items())
    head, rest = items[:ARG_SLOTS - 1], items[ARG_SLOTS - 1:]
    words = [_digest(item) for item in head] + [_digest(rest) if rest else 0]
    return words + [0] * (ARG_SLOTS - len(words))


def _differing(rows: Sequence[tuple[int, ...]], rank: int, call: dict[str, Any]) -> list[str]:
    """The names of this rank's arguments (name and value) that some rank does not pass (empty: unknown);
    by digest, not position, so that calls with other argument names (another operation) compare too."""
    names = sorted(call)
    names = names[:ARG_SLOTS - 1] + ([", ".join(names[ARG_SLOTS - 1:])] if names[ARG_SLOTS - 1:] else [])
    mine = rows[rank][10:10 + ARG_SLOTS]
    return [name for i, name in enumerate(names) if any(mine[i] not in row[10:10 + ARG_SLOTS] for row in rows)]


def contribution(plan: Any, error: Exception | None, call: dict[str, Any]) -> tuple[torch.Tensor, Exception | None]:
    """This rank's twenty-six words, and its error (a TypeError when ``plan`` is no plan at all: the rank still
    takes part, with the zero fingerprint, so that the other ranks raise too)."""
    from cpshard.plan.values import Plan
    if isinstance(plan, Plan):
        fingerprint = plan.indices().fingerprint()
    else:
        fingerprint = torch.zeros(8, dtype=torch.int64)
        if error is None:
            error = TypeError(f"plan={type(plan).__name__}: must be a ShardPlan or BshdPlan. "
                              "Fix: build one with ShardPlan.build.")
    ok = error is None
    extra = torch.tensor([_digest(sorted(call.items())) if ok else 0, int(not ok),
                          *(_slots(call) if ok else [0] * ARG_SLOTS)])
    return torch.cat([fingerprint, extra]), error


def judge(rows: Sequence[tuple[int, ...]], rank: int, error: Exception | None, call: dict[str, Any]) -> None:
    """Raise what every rank raises given every rank's contribution (``rows[r]`` is rank ``r``'s)."""
    def ranks_by(key: Callable[[tuple[int, ...]], Any]) -> dict[Any, list[int]]:
        groups: dict[Any, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(key(row), []).append(r)
        return groups

    by_plan = ranks_by(lambda row: row[:8])
    if len(by_plan) > 1:  # the root cause of most other errors: report it first, on every rank
        listing = "; ".join(f"ranks {ranks} built {describe(fp)}" for fp, ranks in by_plan.items())
        raise ValueError(
            f"plan: the ranks of the context-parallel group built different plans (this is rank {rank}): {listing}. "
            "Fix: build every rank's plan from the same batch lengths, sizes and layout (e.g. broadcast the "
            "lengths from one rank), so that no rank mixes rows of different layouts.") from error
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[9]]
    if failed:
        raise ValueError(
            f"ranks {failed} of the context-parallel group rejected their input (their errors say why; this is "
            f"rank {rank}). Fix: correct the input on those ranks; every rank stopped before communicating data.")
    by_call = ranks_by(lambda row: row[8])
    if len(by_call) > 1:
        mine_desc = ", ".join(f"{k}={v}" for k, v in call.items())
        differ = _differing(rows, rank, call)
        named = f" in {', '.join(differ)}" if differ else ""
        raise ValueError(
            f"the ranks of the context-parallel group called with different arguments{named}: ranks "
            f"{' vs '.join(str(r) for r in by_call.values())} (this is rank {rank}, which passed {mine_desc}). "
            f"Fix: pass every rank the same {', '.join(differ) or 'arguments'} for one call (dtype, row shape, "
            "shift and fill values, and the call's own arguments).")
