"""Plans for torch's context parallelism: from torchtitan's position ids, and the checks every
function of :mod:`cpshard.compat.torch_cp` runs on a batch's plans.

torch shards a ``(B, S, ...)`` buffer: every batch row has the same ``S`` rows, cut into ``cp``
equal pieces after the load balancer's rearrangement. So a batch here is one :class:`ShardPlan`
per row, all with ``total_len == S`` (the plan's padded buffer IS the row) and the same
``cp_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_int, check_real, fail
from cpshard.base.layout import Layout, Padding, Reorder, alignment
from cpshard.index.segments import document_runs
from cpshard.plan.values import ShardPlan

__all__ = ["check_plans", "document_lengths", "plans_from_positions"]

_BALANCED_FOR_CONTIGUOUS: Any = "balanced for contiguous"
_NONE_FOR_ZIGZAG: Any = "none for zigzag, minimal for contiguous"


def check_plans(plans: Any, name: str = "plans") -> list[ShardPlan]:
    """``plans`` as a list of THD plans sharing one ``total_len`` and one ``cp_size``; else a clear error."""
    if isinstance(plans, ShardPlan):
        plans = [plans]
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence) or not plans:
        fail(name, type(plans).__name__, "must be a non-empty list of ShardPlan, one per batch row",
             "pass [plan] for one row, or the list plans_from_positions returns", kind=TypeError)
    for b, plan in enumerate(plans):
        if not isinstance(plan, ShardPlan):
            fail(f"{name}[{b}]", type(plan).__name__, "must be a ShardPlan (a THD plan: one batch row's documents)",
                 "build it with ShardPlan.build(lengths, cp_size=..., total_len=S) or plans_from_positions",
                 kind=TypeError)
    first = plans[0]
    for b, plan in enumerate(plans):
        if plan.total_len != first.total_len:
            fail(f"{name}[{b}].total_len", plan.total_len, f"must equal plans[0].total_len={first.total_len}: torch "
                 "shards one (B, S) buffer, every row S long", "build every row's plan with the same total_len=S")
        if plan.cp_size != first.cp_size:
            fail(f"{name}[{b}].cp_size", plan.cp_size, f"must equal plans[0].cp_size={first.cp_size}",
                 "build every row's plan for the one context-parallel group")
    return list(plans)


def _positions_array(positions: Any) -> np.ndarray:
    """``positions`` as a ``(B, S)`` int64 array (one host copy), checked for type and shape."""
    if isinstance(positions, torch.Tensor):
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            fail("positions", f"{positions.dtype} tensor", "must hold integers (position ids)",
                 "pass the integer position ids the model takes, e.g. positions.long()", kind=TypeError)
        array = check_real("positions", positions).detach().cpu().numpy()  # a meta tensor: refused, named
    else:
        if positions is None:
            fail("positions", "None", "must be the batch's position ids, (B, S) or (S,)",
                 "pass them (torchtitan: extra_kwargs['positions'])", kind=TypeError)
        try:
            array = np.asarray(positions)
        except ValueError:  # NumPy's "inhomogeneous shape"
            fail("positions", f"{type(positions).__name__} of rows of lengths "
                 f"{[len(row) if hasattr(row, '__len__') else 1 for row in positions][:8]}",
                 "must be rectangular (B, S): every batch row S long", "pad every row to the same S (a last document "
                 "of positions 0, 1, ...), or pass a (B, S) tensor")
        if array.dtype.kind not in "iu":
            fail("positions", f"array of dtype {array.dtype}", "must hold integers (position ids)",
                 "pass a (B, S) integer tensor", kind=TypeError)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or 0 in array.shape:
        fail("positions", f"shape {tuple(array.shape)}", "must be (B, S) with B >= 1, or (S,), with S >= 1",
             "pass one row of position ids per batch row (at least one row)")
    if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:  # before the cast wraps it negative
        b, t = (int(v) for v in np.argwhere(array > np.iinfo(np.int64).max)[0])
        fail(f"positions[{b}, {t}]", int(array[b, t]), "is past int64's range: not a position id",
             "pass per-document positions that restart at 0 at each document and count up by 1")
    return array.astype(np.int64, copy=False)


def document_lengths(positions: Any) -> list[list[int]]:
    """Per batch row, the document lengths that position ids ``positions`` ``(B, S)`` or ``(S,)``
    describe: every document starts at position 0 and counts up by 1 (torchtitan's per-document
    positions), so each 0 starts a document. Checked, vectorized: a row that does not start at 0 or
    steps by anything but ``+1`` or back to 0 is a ``ValueError`` naming the first such entry.

    >>> document_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]]))
    [[3, 2, 1, 2]]
    """
    return [row.tolist() for row in _row_lengths(positions)]


def _row_lengths(positions: Any) -> list[np.ndarray]:
    """:func:`document_lengths` as one int64 array a row (what the plans are built from: no Python list)."""
    pos = _positions_array(positions)
    lengths, bad = document_runs(pos)
    if bad is not None and bad[1] == 0:
        b = bad[0]
        fail(f"positions[{b}, 0]", int(pos[b, 0]), "must be 0: each row starts a document",
             "pass per-document positions that restart at 0 at each document (torchtitan's convention)")
    if bad is not None:
        b, t = bad[0], bad[1] - 1
        fail(f"positions[{b}, {t + 1}]", int(pos[b, t + 1]), f"must be positions[{b}, {t}] + 1 = {int(pos[b, t]) + 1} "
             "or 0 (a new document)", "pass per-document positions that restart at 0 at each document and count "
             "up by 1 (torchtitan's convention)")
    return lengths


def plans_from_positions(positions: Any, *, cp_size: int, layout: Layout | str = Layout.CONTIGUOUS,
                         reorder: Reorder | str | None = _BALANCED_FOR_CONTIGUOUS, tp_size: int = 1,
                         padding: Padding | str = _NONE_FOR_ZIGZAG) -> list[ShardPlan]:
    """One :class:`ShardPlan` per batch row of position ids ``positions`` ``(B, S)`` or ``(S,)`` that
    restart at 0 at each document (torchtitan's convention; :func:`document_lengths`), each with
    ``total_len=S``: the plan's padded buffer is the row itself, so the row's tokens are the buffer
    and nothing is added.

    - ``layout="contiguous"`` (the default) with ``reorder="balanced"`` (its default): documents are
      never padded (``padding="minimal"``), so any row works whose ``S`` divides by ``cp * tp``; the
      balanced order spreads the causal work over the ranks (SPEC.md, "Balanced order").
      ``reorder=None`` keeps the caller's order.
    - ``layout="zigzag"`` with ``padding="none"`` (its default): each document is cut into ``2 * cp``
      chunks whose sizes differ by at most one row, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 -
      r``, the extra rows dealt so that every rank holds ``S / cp`` rows (SPEC.md, "Zigzag without
      padding"): any documents, nothing padded, the causal balance of zigzag within rounding.

    ``padding="minimal"`` (zigzag) or ``"aligned"`` pads every document to a multiple of ``2 * cp``
    (``2 * cp * tp`` aligned, ``cp * tp`` contiguous aligned), which a full row has no room for
    unless the lengths already divide by it: the error names the first document that does not. A
    zigzag plan with ``padding="none"`` is refused, by name, where a kernel needs equal chunks
    (Megatron's ``PackedSeqParams``, :attr:`ShardPlan.equal_chunks`); torch's CP attention does not.
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    layout = Layout.parse(layout)
    if padding is _NONE_FOR_ZIGZAG:
        padding = Padding.NONE if layout is Layout.ZIGZAG else Padding.MINIMAL
    padding = Padding.parse(padding)
    if reorder is _BALANCED_FOR_CONTIGUOUS:
        reorder = Reorder.BALANCED if layout is Layout.CONTIGUOUS else None
    lengths = _row_lengths(positions)
    S = int(lengths[0].sum())
    if S % (cp_size * tp_size):
        fail("positions", f"rows of S={S} positions", f"S must divide by cp_size * tp_size = {cp_size * tp_size}: "
             "torch cuts each row into cp equal pieces (and each piece splits over tp)",
             f"pad every row to a multiple of {cp_size * tp_size} tokens (a last document of positions 0, 1, ...)")
    unit = alignment(cp_size, tp_size, layout, padding)
    for b, lens in enumerate(lengths):
        odd = None if unit == 1 else next(iter(np.flatnonzero(lens % unit).tolist()), None)
        if odd is not None:
            fail(f"positions[{b}]", f"document {odd} of length {lens[odd]}", f"every document of a full row must "
                 f"divide by {unit} under layout={layout.value!r} with padding={padding.value!r} (no room for pad "
                 "rows)",
                 "leave padding at its default (zigzag: 'none', chunks one row apart; contiguous: 'minimal'), "
                 "or build plans of the documents' own lengths and their buffer with "
                 "cpshard.compat.torch_cp.to_buffer, which pads each document")
    return [ShardPlan.build(lens, cp_size=cp_size, tp_size=tp_size, layout=layout, padding=padding,
                            reorder=reorder, total_len=S) for lens in lengths]
