"""The values of a THD plan's twin: its padded lengths, alignment, padding mode and buffer order under
another layout, checked. :meth:`ShardPlan._twin <cpshard.plan.values.ShardPlan>` builds the twin from
them; Note [Twin plans and their route] in ``twins.py`` says what a twin is.

Pure arithmetic over the plan's fields (no plan is built or named here): the twin keeps every padded
length, so the checks are those a layout puts on lengths it did not pad (zigzag's ``2 * cp`` chunks,
fp8's total), and the alignment is the largest of the target layout's units that the lengths keep.
"""

from __future__ import annotations

from cpshard.base.errors import fail
from cpshard.base.layout import Layout, Padding, TwinOrder, alignment, fp8_alignment, fp8_total_alignment
from cpshard.index.balance import balanced_order

__all__ = ["thd_twin_values"]


def thd_twin_values(lens: tuple[int, ...], padded: tuple[int, ...], cp: int, tp: int, fp8: bool, padding: Padding,
                    layout: Layout, current_order: tuple[int, ...] | None, target: Layout, order: TwinOrder
                    ) -> tuple[tuple[int, ...], tuple[int, ...], int, Padding, tuple[int, ...] | None]:
    """``(seqlens, padded_seqlens, alignment, padding, order)`` of the ``target``-layout twin of a THD plan
    whose sequences, in the caller's order, hold ``lens`` tokens padded to ``padded`` rows (the lengths in
    the twin's buffer order, as a ``ShardPlan`` holds them); ``layout`` and ``current_order`` are the
    plan's own. A ``ValueError`` names the plan where no twin exists."""
    if order is TwinOrder.SAME:
        new_order = current_order
    elif order is TwinOrder.CALLER:
        new_order = None
    else:
        if target is not Layout.CONTIGUOUS:
            fail("order", "'balanced'", f"balances the contiguous layout (zigzag is balanced by its chunks; "
                 f"layout={target.value!r})", "pass layout='contiguous', or order='same'")
        new_order = tuple(balanced_order(lens, padded, cp)) if cp > 1 else None
    if target is Layout.ZIGZAG and cp > 1 and padding is not Padding.NONE:
        bad = [i for i, p in enumerate(padded) if p % (2 * cp)]
        if bad:
            i = bad[0]
            fail("plan", f"a {layout.value} plan whose sequence {i} is padded to {padded[i]}",
                 f"a zigzag twin needs every padded length to divide by 2 * cp_size = {2 * cp} ({len(bad)} do "
                 "not)", "build the plan with layout='zigzag' (its padding, 2 * cp * tp per sequence or "
                 "2 * cp with padding='minimal', serves both layouts) and take its contiguous twin, or build it "
                 "with padding='none' (zigzag chunks one row apart)")
    if fp8:
        base = alignment(cp, tp, target)
        if sum(padded) % fp8_total_alignment(base):
            fail("plan", f"an fp8 plan of {sum(padded)} padded rows", f"an fp8 {target.value} twin needs the "
                 f"total to divide by {fp8_total_alignment(base)}", "build the fp8 plan with layout='zigzag' "
                 "and take its contiguous twin")
    unit = alignment(cp, tp, target, padding)
    unit = fp8_alignment(unit) if fp8 else unit
    if any(p % unit for p in padded):  # contiguous padding too small for zigzag's aligned unit: minimal's
        padding = Padding.MINIMAL
        unit = alignment(cp, tp, target, padding)
        unit = fp8_alignment(unit) if fp8 else unit
        if any(p % unit for p in padded):
            unit = 2 * cp  # fp8's lcm(16, 2 cp) does not divide: 2 cp still keeps zigzag's invariant
    if new_order is not None:
        lens, padded = tuple(lens[i] for i in new_order), tuple(padded[i] for i in new_order)
    return lens, padded, unit, padding, new_order
