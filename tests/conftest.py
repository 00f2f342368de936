"""Suite-wide settings: one intra-op thread (on a busy 2-core machine torch's thread pool makes the
many small index operations here thousands of times slower), tests/ importable by name, the gloo
ranks of ``cpshard.spawn.run_ranks`` forked from a server (tests/forked.py, made the default with
``cpshard.spawn.set_default_context``: a spawned rank takes seconds to import torch), and how
pytest-xdist's workers share the modules.

``tests/test_spawn.py`` keeps the default ``spawn`` (the ``spawned`` fixture), and the torchrun run of
``tests/test_verify.py`` has a launcher of its own, so the start methods users get stay tested.

``scripts/test.sh`` runs the suite on two pytest-xdist workers. Each worker gets whole modules (their
module fixtures, such as one gloo group for many sub-cases, run once), and every module that starts
gloo ranks or binds a port (``GLOO``) goes to the same worker, so that no two process groups ever start
at once (a port ``free_port`` found free could be taken by the other worker's ranks before rank 0
binds it). A rank started by a test outside ``GLOO`` on a worker is an error naming the fix.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

import cpshard.spawn
from forked import ForkServer

torch.set_num_threads(1)

#: the modules whose tests start gloo ranks (run_ranks, cpshard verify, torchrun, a benchmark that spawns)
GLOO = {"test_attention", "test_benchmarks", "test_distributed", "test_faults", "test_hf_distributed", "test_loss_distributed",
        "test_docs", "test_mtp_distributed", "test_readme", "test_relayout", "test_scan", "test_spawn",
        "test_torch_cp_distributed", "test_torchtitan", "test_ulysses_exchange", "test_verify", "test_verl_compat",
        "test_verl_fsdp_cpshard", "test_verl_fsdp_engine", "test_verl_pack", "test_verl_ray",
        "test_verl_ulysses"}


def _outside_gloo_group() -> None:
    """Refuse ranks started by a test outside ``GLOO`` while xdist runs tests side by side."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    if pathlib.PurePath(test).stem not in GLOO:
        raise RuntimeError(f"{test} starts gloo ranks on an xdist worker: add its module to GLOO in tests/conftest.py")


_FORKED = ForkServer(before_start=_outside_gloo_group)
_SPAWN = cpshard.spawn.set_default_context(_FORKED)
assert _SPAWN.get_start_method() == "spawn", "cpshard.spawn no longer spawns: revisit tests/forked.py"


@pytest.fixture(autouse=True, scope="module")
def _environment_restored():
    """Each test module leaves ``os.environ`` as it found it: a variable one module sets (verl's
    ``VERL_PLATFORM=cpu`` for its CPU engine) would otherwise reach the processes a later module starts
    on the same worker (Ray workers that then cannot import verl's engine)."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update(before)


@pytest.fixture
def spawned():
    """``run_ranks`` as users get it: every rank a fresh ``spawn`` interpreter."""
    cpshard.spawn.set_default_context(_SPAWN)
    try:
        yield
    finally:
        cpshard.spawn.set_default_context(_FORKED)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist it is never called
def pytest_xdist_make_scheduler(config, log):
    """Whole modules to each worker, and every ``GLOO`` module in one unit (whatever ``--dist`` says
    but ``each``): a module's fixtures run once, and no two gloo groups start at once."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByModule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "gloo" if pathlib.PurePath(path).stem in GLOO else path

    return ByModule(config, log)
