"""One spawned gloo group per world size running several named sub-cases (starting processes is the
slow part on a small machine); each test then asserts on its sub-case's results."""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist

from cpshard.spawn import run_ranks


def _suite(rank: int, world: int, module: str, names: tuple[str, ...]) -> dict[str, Any]:
    fns = importlib.import_module(module)
    out = {}
    for name in names:
        out[name] = getattr(fns, name)(rank, world)
        dist.barrier()
    return out


def run_suite(module: str, names: tuple[str, ...], world: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Per rank, ``{name: module.name(rank, world)}`` for every name, in one spawned group of ``world`` ranks."""
    return run_ranks(_suite, world, module, names, **kwargs)
