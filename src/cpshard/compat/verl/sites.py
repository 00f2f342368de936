"""Where :func:`cpshard.compat.verl.patch` puts cpshard in verl: the sites, and how each is checked.

A *site* is one module (or class) attribute through which verl calls a function cpshard replaces,
named ``module.attribute``. verl binds its sequence-packing helpers by name (``from .util import
preprocess_thd_engine``), so each helper has a site in ``verl.models.mcore.util`` and one in every
module that imports it (:data:`BINDERS`); the packing drop-in has two (:data:`PACK_SITES`); verl's
dynamic-CP padding mask one (:data:`DCP`); the MTP loss one (:data:`MTP`, with two switches beside
it); and the Megatron engine's ``forward_backward_batch`` one (:data:`ENGINE`: wrapped so that the
sites verl passes no layout learn the model's, :mod:`cpshard.compat.verl._layout`).

The FSDP backend: verl's six Ulysses helpers (``verl.utils.ulysses``) have a site in that module and in
every module that binds them by name (:data:`ULYSSES_BINDERS`: each binds the helpers it holds that are
verl's), and the FSDP engine four wrapped ones (:data:`FSDP`, Note [verl's FSDP engine on cpshard] in
:mod:`cpshard.compat.verl._fsdp`).

What can happen to a site: **bound** (verl now calls cpshard there), **skipped** (its module does
not import here, or this verl does not bind the name there: the reason is the ImportError's text or
says which), **refused** (it binds a function with other parameters than the drop-in follows: left
as it is). Sites of :data:`REQUIRED` modules and of util's eight helpers are checked before anything
changes, and a failure there stops the patch (:func:`cpshard.compat.verl.patch`).

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/*.py``,
``verl/utils/seqlen_balancing.py``, ``verl/workers/engine/utils.py``,
``verl/workers/engine/megatron/transformer_impl.py``, ``verl/utils/dynamic_cp_scheduler.py``,
``verl/utils/megatron/router_replay_utils.py``, ``verl/trainer/distillation/megatron/losses.py``; for
the FSDP backend ``verl/utils/ulysses.py``, ``verl/workers/engine/fsdp/transformer_impl.py``,
``verl/models/transformers/*.py``, ``verl/trainer/distillation/fsdp/losses.py``,
``verl/workers/engine/veomni/transformer_impl.py``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cpshard.compat._binding import MISSING
from cpshard.compat.verl._ulysses import ULYSSES_DROP_INS
from cpshard.compat.verl._pack import rearrange_micro_batches
from cpshard.compat.verl import _bshd, _thd
from cpshard.compat.verl._plans import local_padding_mask

__all__ = ["BINDERS", "DCP", "DROP_INS", "ENGINE", "FSDP", "FSDP_ENGINE", "MISSING", "MTP", "PACK_SITES", "REQUIRED",
           "ULYSSES", "ULYSSES_BINDERS", "UTIL", "OptionalSite", "WRAPS", "cannot_import", "describe", "fsdp_sites",
           "import_site", "optional_sites", "positional", "ulysses_names"]

#: verl's eight helpers in ``verl.models.mcore.util``, by name -> the drop-ins
DROP_INS: dict[str, Callable[..., Any]] = {
    name: getattr(_thd if name in _thd.__all__ else _bshd, name)
    for name in ("preprocess_thd_engine", "postprocess_thd_engine", "preprocess_bshd_engine", "postprocess_bshd_engine",
                 "preprocess_packed_seqs", "postprocess_packed_seqs", "build_vlm_attn_mask_thd",
                 "build_vlm_attn_mask_bshd")
}

UTIL = "verl.models.mcore.util"
# Where verl binds util's helpers by name, util itself first (verl 0.9.1; verl main's model_forward_fused
# no longer imports build_vlm_attn_mask_thd: skipped there). A module imported while the patch is on binds
# util's names as they are then, the drop-ins; undo() restores those bindings too.
BINDERS: dict[str, tuple[str, ...]] = {
    UTIL: tuple(DROP_INS),
    "verl.models.mcore.model_forward": tuple(DROP_INS),
    "verl.models.mcore.model_forward_fused": ("build_vlm_attn_mask_thd", "preprocess_packed_seqs",
                                              "preprocess_thd_engine", "postprocess_thd_engine"),
    "verl.models.mcore.model_forward_1f1b_overlap": ("preprocess_packed_seqs", "postprocess_packed_seqs"),
    "verl.utils.megatron.router_replay_utils": ("postprocess_packed_seqs", "postprocess_thd_engine",
                                                "preprocess_packed_seqs", "preprocess_thd_engine"),
    "verl.trainer.distillation.megatron.losses": ("preprocess_bshd_engine", "preprocess_thd_engine"),
}
REQUIRED = (UTIL, "verl.models.mcore.model_forward")  # must import: verl's Megatron path itself
MTP = "verl.models.mcore.mtp_patch"
# rearrange_micro_batches: its own module (prepare_dynamic_batch calls it there) and the engines' utilities
PACK_SITES = ("verl.utils.seqlen_balancing", "verl.workers.engine.utils")
DCP = "verl.utils.dynamic_cp_scheduler"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
ULYSSES = "verl.utils.ulysses"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
# Where verl binds its Ulysses helpers by name, verl.utils.ulysses first (verl 0.9.1 and main): each module's
# names are the helpers it holds (ULYSSES_DROP_INS' names whose value is verl's function). The FSDP engine,
# the distillation losses and veomni import HF `datasets` (verl.utils.dataset): skipped where it is missing.
ULYSSES_BINDERS: tuple[str, ...] = (
    ULYSSES, FSDP_ENGINE, "verl.models.transformers.monkey_patch",
    *(f"verl.models.transformers.{m}" for m in ("qwen2", "llama", "apertus", "qwen2_vl", "glm4v", "kimi_vl",
                                                "qwen3_5")),
    "verl.trainer.distillation.fsdp.losses", "verl.workers.engine.veomni.transformer_impl",
)
# The FSDP engine's wrapped sites: (module, class or None, attribute, verl 0.9.1's positional parameters)
FSDP: tuple[tuple[str, str | None, str, tuple[str, ...]], ...] = (
    (FSDP_ENGINE, None, "apply_monkey_patch", ("model", "ulysses_sp_size", "use_remove_padding", "use_fused_kernels",
                                               "fused_kernels_backend", "use_prefix_grouper", "use_tiled_mlp",
                                               "tiled_mlp_shards")),
    (FSDP_ENGINE, "FSDPEngine", "_init_device_mesh", ("self",)),
    (FSDP_ENGINE, "FSDPEngineWithLMHead", "prepare_model_inputs", ("self", "micro_batch")),
    (FSDP_ENGINE, "FSDPEngine", "forward_backward_batch", ("self", "data", "loss_function", "forward_only")),
)
WRAPS = "__cpshard_wraps__"  # the attribute of a cpshard wrapper that holds verl's function it wraps


def positional(fn: Callable[..., Any]) -> list[str]:
    """``fn``'s positional parameters' names (what a verl call site may pass by position)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _parameters(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


class OptionalSite:
    """A site bound where it can be: ``module`` (or its class ``cls``) binds ``attr`` to a function whose
    ``params(...)`` are ``want`` (``whose``: the verl the drop-in follows, for the reason). ``new``: the
    drop-in, or with ``wrap`` a function of verl's that returns the replacement."""

    def __init__(self, module: str, attr: str, new: Callable[..., Any],
                 params: Callable[[Callable[..., Any]], list[str]], want: list[str], whose: str,
                 cls: str | None = None, wrap: bool = False) -> None:
        self.module, self.attr, self.new, self.params, self.want, self.whose, self.cls, self.wrap = (
            module, attr, new, params, want, whose, cls, wrap)
        self.site = f"{module}.{cls + '.' if cls else ''}{attr}"

    def replacement(self, bound: Any) -> Any:
        return self.new(bound) if self.wrap else self.new

    def check(self) -> tuple[Any, Any, str, str]:
        """``(owner, bound, "bind", "")`` to bind, or ``(None, None, "skipped" | "refused", reason)``."""
        module, exc = import_site(self.module)
        if module is None:
            return None, None, "skipped", cannot_import(self.module, exc)
        owner: Any = module
        if self.cls is not None:
            owner = getattr(module, self.cls, None)
            if not isinstance(owner, type):
                return None, None, "skipped", f"this verl's {self.module} has no class {self.cls}"
        bound = vars(owner).get(self.attr, MISSING)
        if bound is MISSING:
            return None, None, "skipped", f"this verl's {self.module.rsplit('.', 1)[-1]}" \
                f"{'.' + self.cls if self.cls else ''} has no {self.attr}"
        if bound is self.new or hasattr(bound, WRAPS):
            return None, None, "skipped", "cpshard's already (bound by another patch)"
        try:
            got = self.params(bound)
        except (TypeError, ValueError) as exc:
            return None, None, "refused", f"is {describe(bound)}, not a function cpshard can check ({exc})"
        if got != self.want:
            return None, None, "refused", (f"takes ({', '.join(got)}), not {self.whose} ({', '.join(self.want)}); "
                                           "left as it is")
        return owner, bound, "bind", ""


def optional_sites(engine_hook: Callable[..., Any]) -> list[OptionalSite]:
    """The sites bound where they import: the packing drop-in's two, verl's dynamic-CP padding mask,
    and the engine's ``forward_backward_batch`` (``engine_hook``: the wrapper, made from verl's)."""
    pack = [OptionalSite(m, "rearrange_micro_batches", rearrange_micro_batches, positional,
                     positional(rearrange_micro_batches), "verl 0.9.1's") for m in PACK_SITES]
    dcp = OptionalSite(DCP, "_local_padding_mask", local_padding_mask, _parameters,
                   [p for p in _parameters(local_padding_mask) if p != "plan"], "verl's")
    engine = OptionalSite(ENGINE, "forward_backward_batch", engine_hook, positional,
                          ["self", "data", "loss_function", "forward_only"], "verl 0.9.1's", cls="MegatronEngine",
                          wrap=True)
    return [*pack, dcp, engine]


def fsdp_sites(hooks: dict[str, Callable[..., Any]]) -> list[OptionalSite]:
    """The FSDP engine's wrapped sites (:data:`FSDP`); ``hooks``: ``{attribute: wrapper maker}``."""
    def marked(make: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper_of(original: Any) -> Any:
            wrapper = make(original)
            setattr(wrapper, WRAPS, original)
            return wrapper
        return wrapper_of

    return [OptionalSite(module, attr, marked(hooks[attr]), positional, list(want), "verl 0.9.1's", cls=cls,
                         wrap=True) for module, cls, attr, want in FSDP]


def ulysses_names(module: ModuleType, verls: dict[str, Any]) -> list[str]:
    """The Ulysses helpers ``module`` binds by name that are verl's (``verls``: name -> verl's function)."""
    return [name for name in ULYSSES_DROP_INS if name in vars(module) and vars(module)[name] is verls.get(name)]


def import_site(name: str) -> tuple[ModuleType | None, Exception | None]:
    """``(module, None)``, or ``(None, the exception)`` where importing it fails (any exception: verl's
    modules import many optional packages)."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def cannot_import(name: str, exc: BaseException | None) -> str:
    """The reason a site is skipped: its module's import error, as the error says it."""
    return f"cannot import {name}: {type(exc).__name__}: {exc}"


def describe(obj: Any) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(obj)
