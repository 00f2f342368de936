"""The context-parallel layout a verl site uses where verl passes none: the layout in use.

verl's Megatron engine picks each model's layout (``MegatronEngine._get_context_parallel_layout``:
DeepSeek-V4's ``dsv4_hybrid`` attention is contiguous, every other model zigzag, as
:func:`cpshard.layout_for` decides) and passes it as ``cp_layout`` to the model-forward functions, the
router-replay helpers and the dynamic-CP scheduler. A ``cp_layout`` verl passes always wins. Other
sites receive no layout: the micro-batch packing (``rearrange_micro_batches``), the legacy padded
path (``preprocess_packed_seqs`` / ``postprocess_packed_seqs``), the distillation loss's teacher
rows (``preprocess_thd_engine`` called without ``cp_layout``). While cpshard is switched on
(:func:`cpshard.compat.verl.patch`, ``cpshard.compat.verl.enable``) they use, in this order:

1. the override: ``CPSHARD_LAYOUT=zigzag|contiguous`` (``auto``, the default, is none), read when
   cpshard is switched on, or ``patch(layout=...)``;
2. the model's, where verl's Megatron engine runs the call (the patch wraps
   ``MegatronEngine.forward_backward_batch``, which packs the micro-batches and runs the forward, to
   note its model's layout for the length of the call);
3. zigzag.

A site that falls back to 1 or 3 outside an engine says so once in the log, at one level whichever
it falls back to: WARNING at ``cp > 1`` (or a ``cp`` not known), where no model confirms the layout, INFO
at ``cp = 1`` (the layouts pad alike); an override that contradicts the engine's model is a WARNING.
With cpshard off, a site given no layout uses zigzag, as verl does.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cpshard.base.errors import fail
from cpshard.base.layout import Layout
from cpshard.policy.layouts import layout_for

__all__ = ["ENV", "Setting", "current", "describe", "engine_layout", "in_use", "once", "running", "setting", "switch"]

logger = logging.getLogger("cpshard.compat.verl")

ENV = "CPSHARD_LAYOUT"
_CHOICES = ("auto", "zigzag", "contiguous")


@dataclass(frozen=True)
class Setting:
    """Whether cpshard is on, its override (None: ``auto``) and where the override came from."""

    on: bool = False
    override: Layout | None = None
    source: str = f"{ENV} unset"


_STATE = [Setting()]  # one cell: replaced whole under the patch's lock, read without it
# (layout, what it is) of the model whose engine runs the current call
_MODEL: contextvars.ContextVar[tuple[Layout, str] | None] = contextvars.ContextVar("cpshard_verl_model",
                                                                                   default=None)
_LOGGED: set[str] = set()
_LOG_LOCK = threading.Lock()


def setting(layout: Any = None) -> tuple[Layout | None, str]:
    """``(override, source)`` from ``layout`` (``patch(layout=...)``), else ``CPSHARD_LAYOUT``; a value
    that is not ``zigzag``, ``contiguous`` or ``auto`` is a ``ValueError`` naming where it came from."""
    if layout is not None:
        return _parse(layout, "layout"), f"layout={_text(layout)!r}"
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return None, f"{ENV} unset"
    return _parse(raw, ENV), f"{ENV}={raw.strip()}"


def _text(value: Any) -> str:
    return value.value if isinstance(value, Layout) else str(value)


def _parse(value: Any, name: str) -> Layout | None:
    if isinstance(value, Layout):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in _CHOICES:
        fail(name, repr(value), "must be 'zigzag', 'contiguous' or 'auto' (the layout of the sites verl passes "
             "none: micro-batch packing, the legacy padded path)",
             f"set {ENV}=contiguous for DeepSeek-V4 (dsv4_hybrid), or leave it unset (auto: the model's layout)")
    return None if word == "auto" else Layout.parse(word)


def switch(new: Setting) -> Setting:
    """Install ``new``; returns the setting it replaced (to restore on undo). Call under the patch's lock."""
    old, _STATE[0] = _STATE[0], new
    return old


def current() -> Setting:
    return _STATE[0]


def describe(state: Setting | None = None) -> str:
    """The layout rule in force, in words (for the log and the status command)."""
    state = current() if state is None else state
    if state.override is not None:
        return f"{state.override.value} ({state.source}) where verl passes no cp_layout"
    return (f"auto ({state.source}): where verl passes no cp_layout, the model's layout inside verl's Megatron "
            "engine, else zigzag")


@contextlib.contextmanager
def running(model: tuple[Layout, str] | None) -> Iterator[None]:
    """The calls inside run for a model of this ``(layout, description)`` (None: unknown)."""
    token = _MODEL.set(model)
    try:
        yield
    finally:
        _MODEL.reset(token)


def engine_layout(engine: Any) -> tuple[Layout, str] | None:
    """``(layout, description)`` of the model a verl Megatron engine runs: the layout verl's engine
    passes its forward (its ``_get_context_parallel_layout``), which :func:`cpshard.layout_for` is
    compared with (a disagreement is logged once). None before the engine has a model config."""
    config = getattr(engine, "tf_config", None)
    if config is None:
        return None
    ours = layout_for(config)
    variant = getattr(config, "experimental_attention_variant", None)
    what = f"{type(engine).__name__}'s model" + (f" ({variant})" if variant else "")
    rule = getattr(type(engine), "_get_context_parallel_layout", None)
    if not callable(rule):
        return ours, what
    try:
        verls = Layout.parse(rule(types.SimpleNamespace(config=config)), "cp_layout")
    except (TypeError, AttributeError, ValueError):  # another verl's rule, which reads more: cpshard's
        return ours, what
    if verls is not ours:
        once(logging.WARNING, f"engine {type(engine).__name__} {verls} {ours}",
              "cpshard.compat.verl: verl's %s runs its model with cp_layout=%r, while cpshard.layout_for gives %r; "
              "the sites verl passes no layout follow verl's %r (the forward's)", type(engine).__name__,
              verls.value, ours.value, verls.value)
    return verls, what


def in_use(site: str, cp_size: int | None = None, *, log: bool = True) -> Layout:
    """The layout ``site`` uses when verl passes it none (the module docstring's rule). ``cp_size``: the
    call's, where known (at ``cp = 1`` the layouts pad alike: the note is logged at INFO, else WARNING)."""
    state, model = current(), _MODEL.get()
    if not state.on:
        return Layout.ZIGZAG
    # outside an engine no model confirms the layout: one level for the note, whatever the layout's source
    outside = logging.WARNING if cp_size is None or cp_size > 1 else logging.INFO
    if state.override is not None:
        if log and model is not None and model[0] is not state.override:
            once(logging.WARNING, f"{site} override", "cpshard.compat.verl: %s uses %s (%s), not the %s layout of "
                  "%s", site, state.override.value, state.source, model[0].value, model[1])
        elif log and model is None:
            once(outside, f"{site} override", "cpshard.compat.verl: %s runs outside a verl Megatron engine "
                  "(the model is unknown); it uses %s (%s)", site, state.override.value, state.source)
        return state.override
    if model is not None:
        return model[0]
    if log:
        once(outside, f"{site} zigzag",
              "cpshard.compat.verl: %s runs outside a verl Megatron engine (the model is unknown); it uses zigzag "
              "(set %s=contiguous for a DeepSeek-V4 dsv4_hybrid model)", site, ENV)
    return Layout.ZIGZAG


def once(level: int, key: str, message: str, *args: Any) -> None:
    """Log ``message`` at ``level`` the first time ``key`` comes, at DEBUG after."""
    with _LOG_LOCK:
        first = key not in _LOGGED
        _LOGGED.add(key)
    logger.log(level if first else logging.DEBUG, message, *args)
