"""The one module of :mod:`cpshard.compat.torchtitan` that names torchtitan's own objects.

torchtitan 0.3.0 shards every context-parallel batch in
``torchtitan/distributed/context_parallel/api.py``: ``prepare_context_parallel_input(inputs, labels,
extra_kwargs, cp_mesh, device, load_balancer_type, ptrr_mask_key)`` reads
``extra_kwargs["positions"]`` and calls that module's global ``cp_shard(cp_mesh, (inputs, labels,
positions), attention_masks, load_balancer_type, ptrr_mask_key=...)``, which picks torch's balancer
by name (``"headtail"``, ``"ptrr"``, None) and shards the inputs and every ``BlockMask``. The
trainer and the validator import ``prepare_context_parallel_input`` by name when they load; Flux
imports ``cp_shard`` from the package inside its step. Its config extension point
(``torchtitan/config/override.py``) imports the module of each ``--override.imports module.function``
entry, which registers its ``@override`` factories. What cpshard relies on is checked here, once,
against the version tested (:data:`TESTED_TORCHTITAN`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cpshard.base.errors import fail

__all__ = ["API", "CP_SHARD_PARAMETERS", "INSTALL", "PACKAGE", "PREPARE_PARAMETERS", "TESTED_TORCHTITAN", "api",
           "register_override", "torchtitan_version", "where_to_find"]

TESTED_TORCHTITAN = "0.3.0"
API = "torchtitan.distributed.context_parallel.api"
PACKAGE = "torchtitan.distributed.context_parallel"
#: torchtitan 0.3.0's ``cp_shard`` parameters, in order (what the replacement takes, and passes on)
CP_SHARD_PARAMETERS = ["cp_mesh", "inputs", "attention_masks", "load_balancer_type", "input_seq_dim", "ptrr_mask_key"]
#: torchtitan 0.3.0's ``prepare_context_parallel_input`` parameters, in order (what its replacement takes)
PREPARE_PARAMETERS = ["inputs", "labels", "extra_kwargs", "cp_mesh", "device", "load_balancer_type", "ptrr_mask_key"]
#: what torchtitan's context-parallel module needs to import on a CPU machine (scripts/setup.sh, constraints.txt)
INSTALL = ("pip install --no-deps torchtitan==0.3.0 triton==3.9.0 tyro==1.0.17 docstring_parser==0.18.0 "
           "spmd_types==0.2.3 (scripts/setup.sh's torchtitan step)")


def where_to_find() -> str:
    """The fix of a torchtitan that does not import: the ``.venv-torchtitan`` folder scripts/setup.sh
    fills (a ``--target`` folder, not a virtual environment: it goes on ``PYTHONPATH``) where one is
    found beside the working directory, else how to install it."""
    found = [os.path.abspath(p) for p in (".venv-torchtitan", os.path.join("..", ".venv-torchtitan"))
             if os.path.isdir(os.path.join(p, "torchtitan"))]
    if found:
        return (f"torchtitan is installed in {found[0]} (scripts/setup.sh's --target folder): put it on the path, "
                f"PYTHONPATH={found[0]}:$PYTHONPATH")
    return (f"install it into this environment: {INSTALL}; or, after scripts/setup.sh, put its folder on the path: "
            "PYTHONPATH=.venv-torchtitan:$PYTHONPATH")


def torchtitan_version() -> str | None:
    """The installed torchtitan's version, or None."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def api() -> ModuleType:
    """torchtitan's ``context_parallel/api.py``, checked: ``cp_shard`` takes torchtitan 0.3.0's
    parameters and ``prepare_context_parallel_input`` passes its ``positions`` to the module's global
    ``cp_shard``. ``ImportError`` where it does not import, ``ValueError`` where it differs."""
    version = torchtitan_version()
    try:
        module = importlib.import_module(API)
    except ImportError as err:
        fail("torchtitan", version or "not installed", f"cannot import {API} ({type(err).__name__}: {err}); "
             f"looked in sys.path {sys.path}; cpshard.compat.torchtitan was tested on torchtitan "
             f"{TESTED_TORCHTITAN}", where_to_find(), kind=ImportError)
    cp_shard = getattr(module, "cp_shard", None)
    prepare = getattr(module, "prepare_context_parallel_input", None)
    if not callable(cp_shard) or not callable(prepare):
        fail("torchtitan", version, f"{API} has no cp_shard or prepare_context_parallel_input (cpshard follows "
             f"torchtitan {TESTED_TORCHTITAN})", f"install torchtitan=={TESTED_TORCHTITAN}")
    got = list(inspect.signature(_unwrapped(cp_shard)).parameters)
    if got != CP_SHARD_PARAMETERS:
        fail("torchtitan", version, f"{API}.cp_shard takes ({', '.join(got)}), but cpshard's replacement is written "
             f"for torchtitan {TESTED_TORCHTITAN}'s ({', '.join(CP_SHARD_PARAMETERS)})",
             f"install torchtitan=={TESTED_TORCHTITAN}")
    got = list(inspect.signature(_unwrapped(prepare)).parameters)
    if not isinstance(prepare, types.FunctionType) or prepare.__closure__:
        fail("torchtitan", version, f"{API}.prepare_context_parallel_input is {type(prepare).__name__}, not a plain "
             f"module function as torchtitan {TESTED_TORCHTITAN}'s (cpshard swaps its code: every reference reaches "
             "cpshard)", f"install torchtitan=={TESTED_TORCHTITAN}, or undo what replaced it")
    if got != PREPARE_PARAMETERS:
        fail("torchtitan", version, f"{API}.prepare_context_parallel_input takes ({', '.join(got)}), but cpshard's "
             f"replacement is written for torchtitan {TESTED_TORCHTITAN}'s ({', '.join(PREPARE_PARAMETERS)})",
             f"install torchtitan=={TESTED_TORCHTITAN}")
    return module


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__cpshard_wraps__", fn)


def register_override(factory: Callable[..., Any], description: str) -> None:
    """Register ``factory`` as a torchtitan ``@override`` of ``Profiler.Config`` (a node every trainer
    config holds), so that ``--override.imports <factory's module>.<its name>`` imports its module; the
    factory returns the config it is given. A second registration (a reloaded module) is left alone."""
    from torchtitan.config.override import override
    from torchtitan.tools.profiler import Profiler

    try:
        override(target=Profiler.Config, description=description)(factory)
    except ValueError as err:
        if "already registered" not in str(err):
            raise
