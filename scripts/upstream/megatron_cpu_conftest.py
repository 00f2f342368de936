"""pytest conftest for running Megatron-LM's own unit tests on the CPU, by hand (scripts/upstream/check.sh).

Megatron's test utilities initialize NCCL and call CUDA; here the process group is gloo, the CUDA calls
that only place or synchronize are no-ops (``current_device`` answers the CPU), ``typing.override``
(Python 3.12, used by ``megatron.training``) is the identity, and cpshard's Triton stand-in is in place
while ``paged_stash`` imports. Newer trees (Megatron-LM main) import Triton kernels unguarded beyond
``paged_stash`` (the SSM ops that ``hybrid_layer_specs`` pulls in, which the MTP tests import): every
such module of the tree is imported once here, under a permissive stand-in (decorators return the
function, anything else returns a placeholder) that leaves ``sys.modules`` as soon as they are loaded,
so torch never sees it. Their kernels are never launched. Tests that need a GPU or several ranks still
fail, as they would.
"""

import importlib
import pathlib
import re
import types
import typing

import torch
import torch.distributed as dist

import cpshard.megatron._import as _megatron_import

if not hasattr(typing, "override"):
    typing.override = lambda f: f  # type: ignore[attr-defined]
_megatron_import._preload_paged_stash()


class _Placeholder:
    """Any attribute of the stand-in: a decorator (``@triton.jit``, ``@triton.autotune(...)``) returns the
    function it decorates; anything else called, indexed or read returns another placeholder."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __getitem__(self, key):
        return _Placeholder()


class _Stand(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


def _preload_triton_kernels() -> None:
    import megatron

    root = pathlib.Path(list(megatron.__path__)[0]).parent
    unguarded = re.compile(r"^(import triton|from triton)", re.M)
    names = [".".join(f.relative_to(root).with_suffix("").parts) for f in sorted((root / "megatron").rglob("*.py"))
             if "paged_stash" not in f.name and unguarded.search(f.read_text(errors="replace"))]
    if not names:
        return
    # torch probes for triton as its compiler loads (some of these modules call torch.compile at import):
    # load it first, so that it sees none
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    triton, language = _Stand("triton"), _Stand("triton.language")
    triton.language = language
    triton.__version__ = "0.0.0"  # version-gated kernels' features off
    with _megatron_import.stand_in({"triton": triton, "triton.language": language}):
        for name in names:
            importlib.import_module(name)


_preload_triton_kernels()
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
