"""Context-parallel layouts, their padding alignment, and the one place a model config picks a layout.

Pure Python; no tensors. See SPEC.md, "Padding" and "Layout choice".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

from cpshard._errors import check_int, parse_choice

__all__ = ["Layout", "Padding", "alignment", "layout_for", "register_layout_rule"]


class Layout(str, enum.Enum):
    """How a padded THD buffer is divided among context-parallel ranks.

    ``ZIGZAG`` cuts each sequence into ``2 * cp`` chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp - 1 - r``, which balances causal-attention work. ``CONTIGUOUS`` gives rank ``r``
    the ``r``-th consecutive ``1 / cp`` of the whole buffer, as attention kernels that address
    rows through one rank-local offset need (DeepSeek-V4's ``dsv4_hybrid``). With ``cp = 1``
    both are the identity.
    """

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"

    def __str__(self) -> str:  # "zigzag", not "Layout.ZIGZAG", in messages and pictures
        return self.value

    @classmethod
    def parse(cls, value: Any, name: str = "layout") -> Layout:
        """Accept a ``Layout`` or its string value; anything else is a clear error."""
        return parse_choice(cls, value, name, "known layout", "cpshard.Layout")


class Padding(str, enum.Enum):
    """How much each sequence is padded (SPEC.md, "Padding").

    ``ALIGNED`` (the default) pads every sequence to the alignment Megatron users run: ``tp``,
    ``2 * cp * tp`` (zigzag) or ``cp * tp`` (contiguous). ``MINIMAL`` pads each sequence only as
    far as its layout needs (``2 * cp`` for zigzag's chunks, nothing for contiguous) and extends
    the last sequence so that every rank's row count still divides by ``tp``: far less padding for
    short sequences, the same rows per rank, every shift and gather unchanged.
    """

    ALIGNED = "aligned"
    MINIMAL = "minimal"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, name: str = "padding") -> Padding:
        """Accept a ``Padding`` or its string value; anything else is a clear error."""
        return parse_choice(cls, value, name, "padding mode", "cpshard.layout.Padding")


def alignment(cp_size: int, tp_size: int, layout: Layout | str, padding: Padding | str = Padding.ALIGNED) -> int:
    """Per-sequence padding multiple ``a`` before fp8 (SPEC.md, "Padding").

    ``tp`` when ``cp == 1``; ``2 * cp * tp`` for zigzag (every sequence splits into ``2 * cp``
    equal chunks and each rank's share must still split over ``tp`` for the sequence-parallel
    scatter; the product, not ``cp * lcm(2, tp)``, is what Megatron users run); ``cp * tp`` for
    contiguous. With ``padding="minimal"``: ``2 * cp`` for zigzag with ``cp > 1``, else 1 (the
    total is then extended to a multiple of ``cp * tp`` through the last sequence).

    >>> alignment(2, 1, "zigzag"), alignment(2, 2, "zigzag"), alignment(4, 2, "contiguous")
    (4, 8, 8)
    >>> alignment(2, 2, "zigzag", "minimal"), alignment(4, 2, "contiguous", "minimal")
    (4, 1)
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    layout = Layout.parse(layout)
    if Padding.parse(padding) is Padding.MINIMAL:
        return 2 * cp_size if (layout is Layout.ZIGZAG and cp_size > 1) else 1
    if cp_size == 1:
        return tp_size
    if layout is Layout.ZIGZAG:
        return 2 * cp_size * tp_size
    return cp_size * tp_size


def fp8_alignment(base: int) -> int:
    """Per-sequence multiple under fp8 padding: ``lcm(16, a)``."""
    return math.lcm(16, base)


def fp8_total_alignment(base: int) -> int:
    """Multiple the whole THD buffer reaches under fp8 padding: ``a * 128`` (TransformerEngine)."""
    return base * 128


# ---------------------------------------------------------------------------------------------
# Layout choice: one function from a model config to a layout, extensible by registration.

_LayoutRule = Callable[[Any], "Layout | None"]
_RULES: list[_LayoutRule] = []


def register_layout_rule(rule: _LayoutRule) -> _LayoutRule:
    """Register ``rule(config) -> Layout | None``; the first rule that answers decides.

    Rules registered later are asked first, so a project can override the built-in choice.
    Usable as a decorator.
    """
    _RULES.insert(0, rule)
    return rule


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
