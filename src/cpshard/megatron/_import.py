"""Import megatron-core lazily, on a machine without triton. The only place cpshard imports Megatron.

megatron-core 0.19.2 guards almost every ``import triton`` with ``try/except ImportError``, but
``megatron/core/transformer/moe/ops/paged_stash.py`` imports it unconditionally, and importing
``megatron.core.transformer.multi_token_prediction`` (where ``roll_tensor`` lives) pulls that file
in through ``megatron.core.transformer.moe.paged_stash``. A stand-in ``triton`` left in
``sys.modules`` would break torch (which probes for triton) and would fool Megatron's guarded
imports into thinking triton is available, so the stand-in exists only while that one file runs:

1. put fake ``triton`` / ``triton.language`` modules in ``sys.modules``;
2. execute ``paged_stash.py`` by file path under its real module name (its kernels are only
   decorated, never launched; ``@triton.jit`` returns the function unchanged);
3. remove the fakes again, then import Megatron normally; it finds the already-loaded module.

Where triton is installed, nothing is preloaded (the real one is used). Users call the same
preload as :func:`install_cpu_stand_ins` before importing Megatron themselves.

Install: ``pip install numpy 'packaging>=24.2'`` then
``pip install --no-deps --ignore-requires-python megatron-core==0.19.2``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
INSTALL_HINT = ("megatron-core is not installed. On a CPU machine, without letting pip touch torch: "
                "pip install numpy 'packaging>=24.2' && "
                "pip install --no-deps --ignore-requires-python megatron-core==0.19.2")


def _fake_triton() -> dict[str, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")

    def jit(fn: Any = None, **_kwargs: Any) -> Any:
        # Supports both ``@triton.jit`` and ``@triton.jit(...)``.
        return fn if fn is not None else (lambda f: f)

    class constexpr:
        pass

    triton.jit = jit  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    language.constexpr = constexpr  # type: ignore[attr-defined]
    return {"triton": triton, "triton.language": language}


def _triton_importable() -> bool:
    """Whether a real ``triton`` is installed (then no stand-in is needed, nor wanted)."""
    module = sys.modules.get("triton")
    if module is not None:
        return getattr(module, "__spec__", None) is not None
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _preload_paged_stash() -> None:
    if _PAGED_STASH in sys.modules or _triton_importable():
        return
    loaded = sys.modules.get("megatron")
    if loaded is not None:  # imported already, perhaps a stand-in without __spec__ (a test's stub)
        locations = list(getattr(loaded, "__path__", None) or ())
    else:
        spec = importlib.util.find_spec("megatron")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(INSTALL_HINT)
        locations = list(spec.submodule_search_locations)
    if not locations:  # a stand-in module: nothing to preload, its submodules are what it provides
        return
    path = f"{locations[0]}/core/transformer/moe/ops/paged_stash.py"
    if not os.path.exists(path):  # older releases (0.14, 0.16) have no such file and import fine
        return
    with stand_in(_fake_triton()):
        file_spec = importlib.util.spec_from_file_location(_PAGED_STASH, path)
        assert file_spec is not None and file_spec.loader is not None
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[_PAGED_STASH] = module
        try:
            file_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_PAGED_STASH]
            raise


@contextlib.contextmanager
def stand_in(fakes: dict[str, types.ModuleType]) -> Iterator[None]:
    """``fakes`` in ``sys.modules`` for the block only; what was there before is put back."""
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def install_cpu_stand_ins() -> str:
    """Make ``import megatron.core...`` work on a machine without triton (a CPU box); call it once,
    before importing Megatron yourself. Returns the installed megatron-core version.

    megatron-core 0.19.2 imports triton unconditionally in one file that ``import megatron.core``
    reaches (``megatron/core/transformer/moe/ops/paged_stash.py``, through the MoE package), so on
    a machine without triton ``import megatron.core`` fails with ``ModuleNotFoundError: No module
    named 'triton'``. This loads that one file under a stand-in ``triton`` whose ``@triton.jit``
    returns the function undecorated (its kernels are only defined at import, never launched on a
    CPU) and removes the stand-in again, so ``triton`` stays unimportable (torch and Megatron's other,
    guarded imports see no triton, as before). Every later ``import megatron.core`` finds that file
    loaded. cpshard's own Megatron functions do this themselves; the call is for your code.

    Idempotent; does nothing where triton is installed (the real one is used) or where the file does
    not exist (older releases). Raises ``ImportError`` naming the install command when megatron-core
    is not installed.

    Example::

        import cpshard.megatron

        cpshard.megatron.install_cpu_stand_ins()
        from megatron.core.packed_seq_params import PackedSeqParams   # no triton needed
    """
    version = megatron_version()
    if version is None:
        raise ImportError(INSTALL_HINT)
    _preload_paged_stash()
    return version


def megatron_version() -> str | None:
    """The installed megatron-core version, or None when it is not installed. Imports nothing."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def import_megatron(module: str) -> Any:
    """Import ``megatron.core.<module>`` on a machine without triton (see the module docstring).

    Raises ``ImportError`` when megatron-core is not installed.
    """
    _preload_paged_stash()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", absl
        return importlib.import_module(f"megatron.core.{module}")


def import_roll_tensor() -> tuple[Callable[..., Any], type]:
    """Return ``(roll_tensor, PackedSeqParams)`` from megatron-core (no triton needed)."""
    mtp = import_megatron("transformer.multi_token_prediction")
    return mtp.roll_tensor, import_megatron("packed_seq_params").PackedSeqParams
