"""Which layout a model needs: one function from a model config to a layout (:func:`layout_for`),
extensible by registration, and the layouts of a hybrid model's two kinds of layer
(:func:`layer_layouts`). SPEC.md, "Layout choice".

Policy, not arithmetic: the rules read a framework's config fields (Megatron-LM's
``experimental_attention_variant``, ``cp_partition_mode``, ``attention_cp_layout``,
``linear_cp_layout``) and the registry is process state a project extends. The plan takes a layout,
never a config; the framework adapters (``megatron/``, ``compat/``) and ``cpshard.layout_for`` ask here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpshard.base.errors import fail
from cpshard.base.layout import Layout

__all__ = ["LayerLayouts", "layer_layouts", "layout_for", "register_layout_rule", "unregister_layout_rule"]

_LayoutRule = Callable[[Any], "Layout | None"]
_RULES: list[_LayoutRule] = []


def register_layout_rule(rule: _LayoutRule) -> _LayoutRule:
    """Register ``rule(config) -> Layout | None``; the first rule that answers decides.

    Rules registered later are asked first, so a project can override the built-in choice.
    Usable as a decorator.
    """
    _RULES.insert(0, rule)
    return rule


def unregister_layout_rule(rule: _LayoutRule) -> None:
    """Remove ``rule``, registered with :func:`register_layout_rule` (a plugin's or a test's clean-up)."""
    _RULES.remove(rule)


@register_layout_rule
def _declared(config: Any) -> Layout | None:
    # What the config itself declares: Megatron-LM dev's TransformerConfig.cp_partition_mode, or
    # attention_cp_layout (the name Megatron-LM main gives the attention layers' layout). Asked after
    # the rules below: a dsv4_hybrid model is contiguous whatever the field says.
    for name in ("cp_partition_mode", "attention_cp_layout"):
        value = getattr(config, name, None)
        if value is not None:
            return Layout.parse(value, f"config.{name}")
    return None


@register_layout_rule
def _dsv4_hybrid(config: Any) -> Layout | None:
    # DeepSeek-V4's hybrid attention addresses rows through one rank-local global_start:
    # zigzag silently gives wrong attention there, so it needs the contiguous layout.
    if getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid":
        return Layout.CONTIGUOUS
    return None


def layout_for(config: Any) -> Layout:
    """The context-parallel layout a model config needs (SPEC.md, "Layout choice").

    ``CONTIGUOUS`` when ``config.experimental_attention_variant == "dsv4_hybrid"`` (or when a
    registered rule says so), else the layout the config declares (Megatron-LM dev's
    ``cp_partition_mode``, or ``attention_cp_layout``), else ``ZIGZAG``. Decide once per step and shard every tensor of
    that step (tokens, labels, masks, router indices, value-head outputs) with the same plan.
    """
    for rule in _RULES:
        choice = rule(config)
        if choice is not None:
            return Layout.parse(choice)
    return Layout.ZIGZAG


@dataclass(frozen=True)
class LayerLayouts:
    """The layout each kind of layer of a hybrid model runs on: softmax attention, and linear
    attention or state-space layers (GatedDeltaNet, Mamba). Where they differ, the step builds one
    plan for each, twins (``plan.twin(layouts.linear)``), and converts between them with
    ``cpshard.distributed.relayout``."""

    attention: Layout
    linear: Layout

    @property
    def hybrid(self) -> bool:
        """Whether the two kinds of layer need different layouts (a relayout between them)."""
        return self.attention is not self.linear


def layer_layouts(config: Any) -> LayerLayouts:
    """Which layout a model's attention layers and its linear (recurrent) layers need.

    Megatron-LM main names them on the config (``attention_cp_layout``, ``linear_cp_layout``); where
    a name is absent that kind of layer takes :func:`layout_for`'s choice, so a model that is not
    hybrid gets the same layout twice. Linear layers need each document's rows in order on
    consecutive ranks (their state passes from rank to rank), so a config naming
    ``linear_cp_layout="zigzag"`` is refused.
    """
    base = layout_for(config)
    declared = {kind: getattr(config, f"{kind}_cp_layout", None) for kind in ("attention", "linear")}
    attention, linear = (base if declared[kind] is None else Layout.parse(declared[kind], f"config.{kind}_cp_layout")
                         for kind in ("attention", "linear"))
    if declared["linear"] is not None and linear is Layout.ZIGZAG:
        fail("config.linear_cp_layout", repr(declared["linear"]), "linear-attention and state-space layers pass "
             "their state from rank to rank and need each document's rows in order (contiguous)",
             "set linear_cp_layout='contiguous'")
    return LayerLayouts(attention, linear)
