"""Suite-wide settings: one intra-op thread (on a busy 2-core machine torch's thread pool makes the
many small index operations here thousands of times slower), tests/ importable by name, and the gloo
ranks of ``cpshard.spawn.run_ranks`` forked from a server (tests/forked.py: a spawned rank takes
seconds to import torch).

``tests/test_spawn.py`` keeps the default ``spawn`` (the ``spawned`` fixture), and the torchrun run of
``tests/test_verify.py`` has a launcher of its own, so the start methods users get stay tested.
"""

from __future__ import annotations

import pytest
import torch

import cpshard.spawn
from forked import ForkServer

torch.set_num_threads(1)

_SPAWN = cpshard.spawn._CTX
assert _SPAWN.get_start_method() == "spawn", "cpshard.spawn no longer spawns: revisit tests/forked.py"
cpshard.spawn._CTX = ForkServer()


@pytest.fixture
def spawned(monkeypatch):
    """``run_ranks`` as users get it: every rank a fresh ``spawn`` interpreter."""
    monkeypatch.setattr(cpshard.spawn, "_CTX", _SPAWN)
