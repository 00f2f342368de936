"""Context-parallel layouts and the padding they need: the choices a plan is built with (``Layout``,
``Padding``, the orders ``Reorder`` and ``TwinOrder``) and the padding arithmetic every plan builder
and adapter shares (:func:`alignment`, :func:`padded_lengths`, :func:`total_problem`).

Pure Python and NumPy; no tensors. See SPEC.md, "Padding" (the per-sequence alignment, and the padded
lengths every plan builder derives from it). Which layout a model needs is policy, decided above the
plan (``policy/layouts.py``: :func:`cpshard.layout_for`); the gradient convention's name is
``base/convention.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cpshard.base.choice import Choice
from cpshard.base.errors import check_int, fail

__all__ = ["Layout", "Padding", "Reorder", "TwinOrder", "alignment", "fp8_alignment", "fp8_total_alignment",
           "padded_lengths", "require_equal_chunks", "round_up", "sequence_unit", "shared_alignment",
           "total_problem"]


class Layout(Choice, argument="layout", what="known layout"):
    """How a padded THD buffer is divided among context-parallel ranks.

    ``ZIGZAG`` cuts each sequence into ``2 * cp`` chunks; rank ``r`` holds chunks ``r`` and
    ``2 * cp - 1 - r``, which balances causal-attention work. ``CONTIGUOUS`` gives rank ``r``
    the ``r``-th consecutive ``1 / cp`` of the whole buffer, as attention kernels that address
    rows through one rank-local offset need (DeepSeek-V4's ``dsv4_hybrid``). With ``cp = 1``
    both are the identity.
    """

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"



class Padding(Choice, argument="padding", what="padding mode"):
    """How much each sequence is padded (SPEC.md, "Padding").

    ``ALIGNED`` (the default) pads every sequence to the alignment Megatron users run: ``tp``,
    ``2 * cp * tp`` (zigzag) or ``cp * tp`` (contiguous). ``MINIMAL`` pads each sequence only as
    far as its layout needs (``2 * cp`` for zigzag's chunks, nothing for contiguous) and extends
    the last sequence so that every rank's row count still divides by ``tp``: far less padding for
    short sequences, the same rows per rank, every shift and gather unchanged.

    ``NONE`` pads no sequence: each keeps its own length, and only the total is extended through the
    last sequence to a multiple of ``cp * tp`` (nothing on a full row whose length divides by it).
    Under zigzag with ``cp > 1`` a sequence's ``2 * cp`` chunks then differ by at most one row
    (SPEC.md, "Zigzag without padding"), which attention kernels that take zigzag as equal chunks
    (Megatron's ``PackedSeqParams``, TransformerEngine) cannot read: they refuse such a plan by name.
    No fp8 (it pads every sequence for TransformerEngine).
    """

    ALIGNED = "aligned"
    MINIMAL = "minimal"
    NONE = "none"



class Reorder(Choice, argument="reorder", what="known order (or None: the caller's)"):
    """Which order a plan puts the sequences in (SPEC.md, "Balanced order").

    ``BALANCED`` (contiguous layout): the order that spreads causal-attention work evenly over the
    ranks, recorded in ``plan.order``; ``shard`` takes and ``unshard`` / ``gather`` return the
    caller's order. ``None`` (the default where a ``reorder`` is asked for) keeps the caller's order.
    """

    BALANCED = "balanced"



class TwinOrder(Choice, argument="order", what="twin order"):
    """The buffer order of a THD plan's twin (:meth:`~cpshard.Plan.twin`): ``SAME`` keeps the plan's,
    ``CALLER`` lays the sequences out in the caller's order, ``BALANCED`` in the order
    ``reorder="balanced"`` chooses (contiguous layout only)."""

    SAME = "same"
    CALLER = "caller"
    BALANCED = "balanced"


def alignment(cp_size: int, tp_size: int, layout: Layout | str, padding: Padding | str = Padding.ALIGNED) -> int:
    """Per-sequence padding multiple ``a`` before fp8 (SPEC.md, "Padding").

    ``tp`` when ``cp == 1``; ``2 * cp * tp`` for zigzag (every sequence splits into ``2 * cp``
    equal chunks and each rank's share must still split over ``tp`` for the sequence-parallel
    scatter; the product, not ``cp * lcm(2, tp)``, is what Megatron users run); ``cp * tp`` for
    contiguous. With ``padding="minimal"``: ``2 * cp`` for zigzag with ``cp > 1``, else 1 (the
    total is then extended to a multiple of ``cp * tp`` through the last sequence). With
    ``padding="none"``: 1 (zigzag's chunks differ by at most one row).

    >>> alignment(2, 1, "zigzag"), alignment(2, 2, "zigzag"), alignment(4, 2, "contiguous")
    (4, 8, 8)
    >>> alignment(2, 2, "zigzag", "minimal"), alignment(4, 2, "contiguous", "minimal"), alignment(4, 1, "zigzag",
    ...                                                                                          "none")
    (4, 1, 1)
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    layout = Layout.parse(layout)
    padding = Padding.parse(padding)
    if padding is Padding.NONE:
        return 1
    if padding is Padding.MINIMAL:
        return 2 * cp_size if (layout is Layout.ZIGZAG and cp_size > 1) else 1
    if cp_size == 1:
        return tp_size
    if layout is Layout.ZIGZAG:
        return 2 * cp_size * tp_size
    return cp_size * tp_size


def require_equal_chunks(plan: Any, user: str, name: str = "plan") -> None:
    """A ``ValueError`` naming ``user`` (what takes zigzag as ``2 * cp`` equal chunks a sequence: Megatron's
    ``PackedSeqParams``, TransformerEngine) unless ``plan.equal_chunks`` (SPEC.md, "Zigzag without padding")."""
    if not plan.equal_chunks:
        fail(name, repr(plan), f"has zigzag chunks of unequal sizes (padding='none'), which {user} cannot address: "
             "it takes 2 * cp equal chunks a sequence", "build the plan with padding='minimal' (or 'aligned')")


def fp8_alignment(base: int) -> int:
    """Per-sequence multiple under fp8 padding: ``lcm(16, a)``."""
    return math.lcm(16, base)


def fp8_total_alignment(base: int) -> int:
    """Multiple the whole THD buffer reaches under fp8 padding: ``a * 128`` (TransformerEngine)."""
    return base * 128


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def sequence_unit(cp_size: int, tp_size: int, layout: Layout, fp8: bool, padding: Padding) -> int:
    """The per-sequence multiple: :func:`alignment` for ``padding``, ``lcm(16, .)`` under fp8 (not with
    ``padding="none"``: a ``ValueError``)."""
    if fp8 and Padding.parse(padding) is Padding.NONE:
        fail("padding", "'none'", "pads no sequence, and fp8 pads each to a multiple of 16 rows for "
             "TransformerEngine (whose zigzag needs equal chunks)", "pass padding='minimal' with fp8=True")
    unit = alignment(cp_size, tp_size, layout, padding)
    return fp8_alignment(unit) if fp8 else unit


def total_problem(total: int, extension: int, cp_size: int, tp_size: int, layout: Layout, fp8: bool,
                  padding: Padding = Padding.ALIGNED) -> str | None:
    """Why a padded batch of ``total`` rows, whose last sequence was extended by ``extension`` rows
    past its own padding, breaks a plan invariant (SPEC.md, "Padding"); None when it keeps them all.

    The invariants: ``cp`` equal shares, each a multiple of ``tp``; under zigzag with ``cp > 1`` the
    extension keeps the last sequence a multiple of ``2 * cp`` (unless ``padding="none"``, whose chunks
    need not be equal); under fp8 the total a multiple of ``a * 128``. The one statement of the rule
    that :meth:`ShardPlan.build` (``total_len=``) and the framework adapters share.
    """
    if total % cp_size or (total // cp_size) % tp_size:
        return (f"a total of {total} rows must split into cp_size={cp_size} equal parts each divisible by "
                f"tp_size={tp_size}")
    if layout is Layout.ZIGZAG and cp_size > 1 and padding is not Padding.NONE and extension % (2 * cp_size):
        return f"the last zigzag sequence must stay a multiple of 2 * cp_size = {2 * cp_size}"
    if fp8 and total % fp8_total_alignment(alignment(cp_size, tp_size, layout)):
        return f"with fp8 the total must divide by {fp8_total_alignment(alignment(cp_size, tp_size, layout))}"
    return None


def padded_lengths(
    seqlens: tuple[int, ...],
    cp_size: int,
    tp_size: int,
    layout: Layout,
    fp8: bool,
    min_local_rows: int | None = None,
    length_bucket: int | None = None,
    padding: Padding = Padding.ALIGNED,
    total_len: int | None = None,
) -> tuple[int, ...]:
    """Padded lengths per SPEC.md, "Padding" (the arguments checked by the caller).

    Each sequence is rounded up to :func:`sequence_unit`; the total must then split into ``cp``
    shares of a multiple of ``tp`` rows (already so for aligned padding, reached through the last
    sequence for minimal padding). The extensions (fp8 total, ``min_local_rows``, ``length_bucket``)
    only lengthen the last sequence, each by a multiple of the per-sequence alignment, so every
    invariant still holds; a target that would break one is rounded up to the nearest one that
    keeps them all, and under fp8 every target is also kept a multiple of the fp8 total alignment.
    ``total_len`` instead asks for exactly that many rows (another framework's target): it must be
    at least the padded total and keep every invariant (:func:`total_problem`), else ``ValueError``.
    """
    unit = sequence_unit(cp_size, tp_size, layout, fp8, padding)
    if unit == 1:  # nothing to round (the contiguous layout's minimal padding)
        padded = list(seqlens)
    elif max(seqlens) < 2**62:  # NumPy for long batches (the common case); Python ints beyond int64
        padded = (-(-np.array(seqlens, dtype=np.int64) // unit) * unit).tolist()
    else:
        padded = [-(-n // unit) * unit for n in seqlens]
    keep = math.lcm(unit, cp_size * tp_size)
    if fp8:
        keep = math.lcm(keep, fp8_total_alignment(alignment(cp_size, tp_size, layout)))
    if total_len is None:
        total = round_up(sum(padded), keep)
        if min_local_rows is not None:
            total = max(total, round_up(min_local_rows * cp_size, keep))
        if length_bucket is not None:
            total = round_up(total, math.lcm(length_bucket, cp_size, keep))
    else:
        rows = sum(padded)
        problem = None if total_len >= rows else f"is below the {rows} rows these lengths pad to"
        problem = problem or total_problem(total_len, total_len - rows, cp_size, tp_size, layout, fp8, padding)
        if problem:
            fail("total_len", total_len, problem, "leave total_len=None for the smallest valid total")
        total = total_len
    padded[-1] += total - (rows if total_len is not None else sum(padded))
    return tuple(padded)


def shared_alignment(padded: tuple[int, ...], unit: int) -> int:
    """The ``alignment`` of a plan over lengths padded elsewhere: SPEC's per-sequence ``unit`` where it
    divides every padded length, else the greatest common divisor of the lengths (another
    framework's padding: a last sequence extended to its own target, say). A plan's alignment is
    part of its value and is what a twin or a rebuilt plan keeps."""
    if unit == 1 or all(p % unit == 0 for p in padded):
        return unit
    return max(math.gcd(*padded), 1)
