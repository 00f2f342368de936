"""Reference context-parallel scan of a linear recurrence, per document, under the contiguous layout.

Note [CP linear scan]
---------------------
Per document, ``h_t = a_t * h_{t-1} + x_t`` with ``h`` starting at 0 before each document's first
token (elementwise over trailing dimensions): the shape of the state passing in GatedDeltaNet and
Mamba. Pad rows hold ``h = 0`` and have no effect (their ``a`` and ``x`` are never read, and get no
gradient).

Under the contiguous layout a rank holds one consecutive interval of the padded buffer, so its rows
are **segments** of consecutive positions of one document each, and only its first segment can
start in the middle of a document (continuing the previous rank's last segment). Each rank

1. scans its segments locally from a zero state (:func:`segmented_scan`, a segmented Hillis-Steele
   scan: ``log2(L)`` vectorized steps over the rank's rows, every segment at once), which also gives
   ``A_t``, the product of ``a`` from the segment's start to ``t``; so ``h_t = H_t + A_t * c`` where
   ``c`` is the true state just before the segment;
2. shares its last row's ``(H, A)``, its end state and decay product, with every rank (one
   ``all_gather_single`` of ``(2, ...)`` per rank, :func:`cpshard.distributed.gather_states`);
3. composes the carries of the ranks before it, in rank order (:func:`carry_in`: a loop over at most
   ``cp`` ranks, vectorized over the trailing dimensions), and applies its carry to its first segment.

The index math (which rows start a segment, which ranks continue which) is pure and the same on
every rank (:func:`scan_layout`); no metadata message. Under zigzag a rank's chunks of a document are
not consecutive and the carry of chunk ``2 cp - 1 - r`` comes from rank ``r + 1``: :func:`linear_scan`
refuses a zigzag plan (relayout to its contiguous twin first), and :func:`naive_linear_scan`, the
belief that the rows are contiguous, gives wrong states there (``cpshard verify --model hybrid``
shows it caught).

Autograd: differentiable in ``a`` and ``x`` through the local arithmetic and the gather, whose
backward sums each rank's state gradient over the group: if the ranks' losses add up to the batch's,
every gradient equals the single-process one. The association order of the products differs from a
per-token loop, so floating results agree to rounding (exactly where every value is an integer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.base.layout import Layout
from cpshard.plan.twins import twin
from cpshard.plan.values import ShardPlan

__all__ = ["ScanLayout", "apply_carry", "carry_in", "last_states", "linear_scan", "naive_linear_scan", "scan_layout",
           "scan_ranks", "segmented_scan"]


@dataclass(frozen=True)
class ScanLayout:
    """Per rank (``cp`` entries each), what the carry chain needs, from the plan alone.

    Attributes:
        starts: per rank, ``(R,)`` bool, True on the first local row of each segment.
        first_rows: per rank, the number of rows of its first segment.
        chained: per rank, whether its first segment continues the previous rank's last segment
            (the same document, the next position); always False for rank 0.
        single: per rank, whether its rows are one segment (the first is the last).
    """

    starts: tuple[torch.Tensor, ...]
    first_rows: tuple[int, ...]
    chained: tuple[bool, ...]
    single: tuple[bool, ...]


def _segments_of(plan: ShardPlan, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seq, pos = plan.sequence_ids(rank).numpy(), plan.position_ids(rank).numpy()
    start = np.ones(seq.shape, dtype=bool)
    start[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + 1)
    return seq, pos, start


def scan_layout(plan: ShardPlan) -> ScanLayout:
    """The :class:`ScanLayout` of ``plan``'s rows read as contiguous segments (Note [CP linear scan]).
    Pure; the same on every rank; kept by the plan."""
    return plan.indices().kept_for("scan", None, lambda: _scan_layout(plan))


def _scan_layout(plan: ShardPlan) -> ScanLayout:
    starts, first_rows, chained, single = [], [], [], []
    prev: tuple[int, int] | None = None  # (sequence, position) of the previous rank's last row
    for r in range(plan.cp_size):
        seq, pos, start = _segments_of(plan, r)
        rows = seq.size
        heads = np.flatnonzero(start)
        starts.append(torch.from_numpy(start))
        first_rows.append(int(heads[1]) if heads.size > 1 else rows)
        single.append(heads.size <= 1)
        chained.append(bool(rows) and prev is not None and prev == (int(seq[0]), int(pos[0]) - 1))
        prev = (int(seq[-1]), int(pos[-1])) if rows else None
    return ScanLayout(tuple(starts), tuple(first_rows), tuple(chained), tuple(single))


def segmented_scan(a: torch.Tensor, x: torch.Tensor, starts: torch.Tensor,
                   tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, A)``, each ``(R, ...)``: per segment, ``H_t = a_t H_{t-1} + x_t`` from ``H = 0`` before the
    segment's first row, and ``A_t`` the product of ``a`` from that row to ``t``. No communication.

    ``a``, ``x`` ``(R, ...)``; ``starts`` ``(R,)`` bool, True on each segment's first row; ``tokens``
    ``(R,)`` bool, False on pad rows (where ``a`` and ``x`` count as 0, so ``H = A = 0`` there and
    after). A segmented Hillis-Steele scan of the pairs ``(A, H)`` under ``(A1, H1) then (A2, H2) =
    (A1 A2, A2 H1 + H2)``, restarted at every start: ``ceil(log2 R)`` vectorized steps.
    """
    extra = (1,) * (a.dim() - 1)
    tok = tokens.view(-1, *extra)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    A, H = torch.where(tok, a, zero), torch.where(tok, x, zero)
    flag = starts.clone()
    rows, d = a.shape[0], 1
    while d < rows:
        stop = flag[d:].view(-1, *extra)
        A_left, H_left = A[:-d], H[:-d]
        A_next = torch.cat([A[:d], torch.where(stop, A[d:], A_left * A[d:])])
        H_next = torch.cat([H[:d], torch.where(stop, H[d:], A[d:] * H_left + H[d:])])
        flag = torch.cat([flag[:d], flag[d:] | flag[:-d]])
        A, H = A_next, H_next
        d *= 2
    return H, A


def carry_in(states: torch.Tensor, layout: ScanLayout, rank: int) -> torch.Tensor:
    """``(...)``: the true state just before ``rank``'s first row (0 unless its first segment is
    ``chained``), from every rank's ``states`` ``(cp, 2, ...)`` = ``(H, A)`` of its last row.

    Composes ranks ``0 .. rank - 1`` in order: a rank's true end state is its ``H`` plus, when its
    rows are one chained segment, its ``A`` times its own carry. Pure; callable for every rank.
    """
    carry = torch.zeros_like(states[0, 0])
    for s in range(1, rank + 1):
        prev_end = states[s - 1, 0] + (states[s - 1, 1] * carry if layout.single[s - 1] and layout.chained[s - 1]
                                       else 0)
        carry = prev_end if layout.chained[s] else torch.zeros_like(carry)
    return carry


def apply_carry(H: torch.Tensor, A: torch.Tensor, states: torch.Tensor, layout: ScanLayout,
                rank: int) -> torch.Tensor:
    """``h`` ``(R, ...)`` of ``rank`` from its local scan ``(H, A)`` (:func:`segmented_scan`) and every
    rank's ``states`` ``(cp, 2, ...)``: ``H + A * carry`` on its first segment when that is chained."""
    if not layout.chained[rank]:
        return H
    first = torch.zeros(H.shape[0], dtype=torch.bool, device=H.device)
    first[:layout.first_rows[rank]] = True
    carried = A * carry_in(states, layout, rank)
    return H + torch.where(first.view(-1, *(1,) * (H.dim() - 1)), carried, torch.zeros_like(carried))


def last_states(H: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``(2, ...)``: a rank's last row of ``(H, A)``, what it shares (zeros for a rank of no rows)."""
    if H.shape[0]:
        return torch.stack([H[-1], A[-1]])
    return H.new_zeros((2, *H.shape[1:]))


def scan_ranks(a: list[torch.Tensor], x: list[torch.Tensor], plan: ShardPlan) -> list[torch.Tensor]:
    """Every rank's :func:`linear_scan` in one process (the gather simulated): ``a[r]``, ``x[r]`` rank
    ``r``'s rows of a contiguous plan. For tests and pictures; no communication."""
    layout = scan_layout(plan)
    local = [segmented_scan(a[r], x[r], layout.starts[r].to(a[r].device), plan.token_mask(r).to(a[r].device))
             for r in range(plan.cp_size)]
    states = torch.stack([last_states(H, A) for H, A in local])
    return [apply_carry(H, A, states, layout, r) for r, (H, A) in enumerate(local)]


def _check_kind(plan: Any) -> ShardPlan:
    """The scan's one check of the plan's type (validation of the argument, not a switch on plan kinds:
    the scan runs on packed THD rows only)."""
    if not isinstance(plan, ShardPlan):
        fail("plan", type(plan).__name__, "must be a ShardPlan (the scan runs on packed THD rows)",
             "build one with ShardPlan.build", kind=TypeError)
    return plan


def _check(a: Any, x: Any, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _check_kind(plan)
    a, x = check_real("a", check_tensor("a", a)), check_real("x", check_tensor("x", x))
    lead = plan.local_shape
    if a.dim() < 1 or tuple(a.shape[:1]) != lead:
        fail("a", f"tensor of shape {tuple(a.shape)}", f"must lead with the plan's local_shape = {lead}",
             "pass this rank's rows (pad rows included)")
    if a.shape != x.shape or a.dtype != x.dtype or a.device != x.device:
        fail("x", f"{tuple(x.shape)} {x.dtype} on {x.device}", f"must match a ({tuple(a.shape)} {a.dtype} on "
             f"{a.device})", "pass a and x of one shape, dtype and device")
    if not a.dtype.is_floating_point:
        fail("a", f"tensor of dtype {a.dtype}", "must be floating point (the scan is differentiable)",
             "pass a.double() (or float)", kind=TypeError)
    return a, x


def _scan(a: Any, x: Any, plan: ShardPlan, group: Any, naive: bool, check: bool | None) -> torch.Tensor:
    """The scan of ``plan``'s rows (``naive``: read as its contiguous twin's; else ``plan`` must not be
    zigzag). Every check runs inside the agreement (checks on), so that a rank that refuses its
    input or its plan makes every rank raise instead of leaving its peers waiting in the state gather."""
    from cpshard.distributed.checks import validated
    from cpshard.distributed.collectives import backward_follows, gather_states_for, joined

    def validate() -> tuple[tuple[torch.Tensor, torch.Tensor, ShardPlan], dict[str, Any]]:
        belief = _check_kind(twin(_check_kind(plan), Layout.CONTIGUOUS)) if naive else _refuse_zigzag(plan)
        a_, x_ = _check(a, x, plan)
        return (a_, x_, belief), {"dtype": a_.dtype, "row shape": tuple(a_.shape[1:]), "naive": belief != plan,
                                  "requires_grad": backward_follows(a_, x_)}  # the state gather's backward

    (a, x, rows_plan), rank, _ = validated(plan, group, check, validate, "linear_scan")
    args = {"naive": rows_plan != plan}  # every rank alike: agreed on, and carried by the gather's header
    layout = scan_layout(rows_plan)
    dev = a.device
    H, A = segmented_scan(a, x, layout.starts[rank].to(dev), rows_plan.token_mask(rank).to(dev))
    if plan.cp_size == 1:
        return H
    states = gather_states_for(last_states(H, A), plan, group, args, check=False)  # agreed above, with checks on
    # every rank's output depends on the gathered states, also where it reads no carry (rank 0,
    # unchained ranks): the gather's backward all_reduce then runs on every rank
    return joined(apply_carry(H, A, states, layout, rank), states)


def linear_scan(a: torch.Tensor, x: torch.Tensor, plan: ShardPlan, group: Any, *,
                check: bool | None = None) -> torch.Tensor:
    """``h`` ``(L, ...)``: per document ``h_t = a_t * h_{t-1} + x_t`` from 0 (Note [CP linear scan]).

    Args:
        a, x: this rank's rows, ``(L, ...)``, one floating dtype; ``a`` the decay, ``x`` the input.
        plan: a contiguous plan (any order; ``cp = 1`` any layout): relayout zigzag rows to the
            plan's contiguous twin first (``cpshard.distributed.relayout`` and ``cpshard.twin_plan``).
        group: the CP group; ``None`` only when ``plan.cp_size == 1``.
        check: as in :func:`cpshard.distributed.gather` (``None``: :func:`~cpshard.distributed.set_checks`):
            the agreement before the state gather, so that a rank whose plan, dtype or trailing shape
            differs makes every rank raise, naming it.

    Returns:
        ``(L, ...)``, 0 on pad rows. Communication: one ``all_gather_single`` of ``(2, ...)`` per rank
        in forward, one ``all_reduce`` of ``(cp, 2, ...)`` in backward; none at ``cp = 1``.
    """
    return _scan(a, x, plan, group, False, check)  # a zigzag plan is refused there, under the agreement


def _refuse_zigzag(plan: Any) -> ShardPlan:
    if isinstance(plan, ShardPlan) and plan.layout is Layout.ZIGZAG and plan.cp_size > 1:
        fail("plan", f"a zigzag plan (cp_size={plan.cp_size})", "the scan needs each document's rows in order on "
             "consecutive ranks, and zigzag's second chunk on rank r continues rank r + 1's rows",
             "run it on the contiguous twin: y = relayout(x, plan, twin_plan(plan, 'contiguous'), group), scan, "
             "then relayout back")
    return plan


def naive_linear_scan(a: torch.Tensor, x: torch.Tensor, plan: ShardPlan, group: Any, *,
                      check: bool | None = None) -> torch.Tensor:
    """:func:`linear_scan` under one wrong belief: that the rows are ``plan``'s contiguous twin's.
    Right under the contiguous layout; wrong on zigzag rows. Kept to show that
    ``cpshard verify --model hybrid`` catches it. Same arguments."""
    return _scan(a, x, plan, group, True, check)
