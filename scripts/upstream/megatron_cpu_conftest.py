"""pytest conftest for running Megatron-LM's own unit tests on the CPU, by hand (scripts/upstream/check.sh).

Megatron's test utilities initialize NCCL and call CUDA; here the process group is gloo, the CUDA calls
that only place or synchronize are no-ops (``current_device`` answers the CPU), ``typing.override``
(Python 3.12, used by ``megatron.training``) is the identity, and cpshard's Triton stand-in is in place
while ``paged_stash`` imports. Tests that need a GPU or several ranks still fail, as they would.
"""

import typing

import torch
import torch.distributed as dist

import cpshard.megatron._import as _megatron_import

if not hasattr(typing, "override"):
    typing.override = lambda f: f  # type: ignore[attr-defined]
_megatron_import._preload_paged_stash()
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.device_count = lambda: 1
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.memory.empty_cache = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
_init = dist.init_process_group


def _gloo(*args, **kwargs):
    kwargs["backend"] = "gloo"
    return _init(*args, **kwargs)


dist.init_process_group = _gloo
