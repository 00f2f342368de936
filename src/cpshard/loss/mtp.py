"""Multi-token prediction (MTP) loss, exact under every context-parallel layout and size.

SPEC.md, "Multi-token prediction loss". Hidden states arrive as ``1 + N`` equal chunks (main, then
MTP depths ``1..N``); depth ``d`` is scored against ``shift(labels, d)`` under ``shift(loss_mask, d)``
(within each sequence, fill past its end), and its gradient is attached to the main chunk, which is
returned, the way megatron-core's ``process_mtp_loss`` and ``MTPLossAutoScaler`` do it
(``megatron/core/transformer/multi_token_prediction.py``, 0.19).

Note [MTP token counts]
-----------------------
Megatron-core normalizes each depth by token counts local to the CP rank, so its gradients change
with ``cp`` whenever ranks hold different numbers of valid tokens. Here the counts are summed over
the CP group (one ``all_reduce`` of all of them): ``orig``, the loss mask aligned with the labels
(shifted by one with them when labels come from ``input_ids``), and ``n_d``, depth ``d``'s shifted
mask. With ``s = scaling_factor / N`` a rank contributes, per depth,

- ``normalization="per_token"`` (Megatron's ``calculate_per_token_loss``: gradients summed over
  DP x CP, then divided by the global token count): ``s * sum_local(loss * mask_d) * orig / n_d``;
- ``normalization="mean"`` (gradients averaged over DP x CP; Megatron's schedules scale the MoE
  auxiliary loss, and the main loss of a two-output loss function, by ``cp`` for that, but not the
  MTP loss): ``s * cp * sum_local(loss * mask_d) / n_d``.

So every hidden row's gradient (under "mean": divided by ``cp``, the average still to come) and
the weight gradient reduced over CP that way equal those of ``cp = 1``, for any ``cp`` and layout.

Those are Megatron's gradient conventions, the defaults. ``grad_reduction`` (the one convention of
``cpshard.loss``, Note [Gradient convention] there) states the caller's reduction instead:
``"mean"`` (gradients averaged over CP) puts the factor ``cp`` on either normalization, ``"sum"``
(gradients summed over CP) none. Its default follows ``normalization``: ``"mean"`` for
``"mean"``, ``"sum"`` for ``"per_token"`` (Megatron's per-token mode sums). So a step that sums
gradients over CP combines ``mtp_loss(..., grad_reduction="sum")`` with ``cpshard.loss``'s
``grad_reduction="sum"`` losses, and one that averages (the default) leaves both at ``"mean"``.
Where every rank holds the same counts, ``orig_g / n_g = orig / n`` and ``cp / n_g = 1 / n``: the
result is Megatron's. ``counts="local"`` uses the rank's own counts and no ``cp`` factor, which is
Megatron's behaviour, kept for comparison. A count of zero is clamped to one; the masked loss is
zero there, so a depth or a rank without a valid token adds exactly zero, never NaN.

Communication per call, whatever ``N`` and the batch size: at most one ``all_to_all_single`` (the
labels and mask of every depth, when they exist only sharded; Note [Halo exchange for several
shifts] in ``index/halo.py``) and one ``all_reduce`` (the counts). None at ``cp = 1``.

Note [MTP arguments]
--------------------
Every argument that changes the result, or which collectives follow, is agreed on: ``scaling_factor``
(its exact bits), ``normalization``, ``counts``, the resolved ``grad_reduction``, ``num_depths``,
``label_fill`` and the form of the labels and the mask (sharded rows, the whole batch, derived from
``input_ids``, none). With checks on, one agreement over the CP group covers them all before any
data moves (the exchange's own, or one of its own where nothing is exchanged), so that
``counts="global"`` on one rank and ``"local"`` on another raise on both instead of one waiting in the
count sum. With checks off they travel in the exchange's header and the count sum's trailer, where
those run (docs/guarantees.md says what is left).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpshard.base.convention import GradReduction
from cpshard.base.errors import check_int, check_real, fail, parse_choice
from cpshard.base.types import TokenRows
from cpshard.distributed.checks import agree, checks_on
from cpshard.distributed.collectives import shift_sharded_multi_for
from cpshard.distributed.groups import group_rank, solo
from cpshard.distributed.sums import reduce_over
from cpshard.loss.reductions import masked_rows
from cpshard.ops.sharding import shard
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["Counts", "MtpLoss", "MtpLossAutoScaler", "Normalization", "mtp_loss", "mtp_targets"]

Rows = TokenRows  # a tensor of a rank's rows, or every sequence's (cpshard.base.types)
AutoScaler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LogFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class Normalization(str, enum.Enum):
    """How a depth's loss is normalized (Note [MTP token counts])."""

    MEAN = "mean"  #: divided by the depth's token count; gradients averaged over DP x CP
    PER_TOKEN = "per_token"  #: Megatron's calculate_per_token_loss; gradients summed, divided later

    @classmethod
    def parse(cls, value: Any) -> Normalization:
        return parse_choice(cls, value, "normalization", "known normalization", "cpshard.mtp.Normalization")


class Counts(str, enum.Enum):
    """Which token counts normalize the loss (Note [MTP token counts])."""

    GLOBAL = "global"  #: summed over the CP group: exact at every cp
    LOCAL = "local"  #: the rank's own, as megatron-core does (for comparison)

    @classmethod
    def parse(cls, value: Any) -> Counts:
        return parse_choice(cls, value, "counts", "known kind of counts", "cpshard.mtp.Counts")


class MtpLossAutoScaler(torch.autograd.Function):
    """Return ``output`` unchanged; in backward, also give ``loss`` the gradient ``main_loss_backward_scale``.

    The pattern of megatron-core's ``MTPLossAutoScaler``: the MTP loss rides on the main hidden
    states, so one ``backward()`` of the main loss also back-propagates it, scaled like the main
    loss (set the scale with :meth:`set_loss_scale`, as Megatron's schedules set theirs). cpshard's
    Megatron drop-in uses Megatron's own class when it is importable, so Megatron's scale applies.
    """

    main_loss_backward_scale: ClassVar[torch.Tensor] = torch.tensor(1.0)

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        scale = MtpLossAutoScaler.main_loss_backward_scale
        return grad, torch.ones_like(loss) * scale.to(loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Scale every later MTP loss gradient by ``scale`` (match the main loss's scale)."""
        MtpLossAutoScaler.main_loss_backward_scale = torch.as_tensor(scale)


@dataclass(frozen=True)
class MtpLoss:
    """What :func:`mtp_loss` returns.

    Attributes:
        hidden: the main chunk, with every depth's loss gradient attached (continue the model with it).
        losses: ``(N,)`` detached, depth ``d``'s loss as this rank logs it: ``f * sum_local(loss *
            mask_d) / max(n_d, 1)`` with ``f = cp`` for global counts (so the mean over the CP
            group, which Megatron's MTP logger takes over DP x CP, is the depth's loss over the whole
            batch) and ``f = 1`` for local counts (Megatron's per-rank value).
        counts: ``(1 + N,)`` detached, ``[orig, n_1, ..., n_N]``: summed over the CP group for
            global counts, the rank's own for local counts; exact: int64 for a bool or integer loss
            mask, float64 for a floating one (whatever its precision).
    """

    hidden: torch.Tensor
    losses: torch.Tensor
    counts: torch.Tensor


def _is_global(x: Any) -> bool:
    """A list of per-sequence tensors or a jagged nested tensor is the whole batch; a tensor is this rank's rows."""
    return isinstance(x, (list, tuple)) or (isinstance(x, torch.Tensor) and x.is_nested)


def _check_rows(name: str, x: Any, plan: Plan) -> None:
    if _is_global(x):
        for i, t in enumerate([x] if isinstance(x, torch.Tensor) else x):
            if isinstance(t, torch.Tensor):
                check_real(name if isinstance(x, torch.Tensor) else f"{name}[{i}]", t)
        return
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, "must be this rank's rows (a tensor), or the whole batch (a list of "
             "per-sequence tensors or a jagged nested tensor)", f"pass {name} as one of those", kind=TypeError)
    check_real(name, x)
    if x.numel() != math.prod(plan.local_shape):
        fail(name, f"tensor of shape {tuple(x.shape)}",
             f"must hold one value per local row, local_shape = {plan.local_shape} (any shape of that many "
             "elements, e.g. Megatron's [1, L])",
             "pass this rank's sharded rows, or the whole batch as a list of per-sequence tensors")


def mtp_targets(labels: Rows | None, loss_mask: Rows | None, plan: Plan, group: Any, *, num_depths: int,
                input_ids: Rows | None = None, label_fill: int = 0,
                check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels and loss masks of every MTP depth on this rank, in at most one collective.

    Args:
        labels: next-token labels; this rank's rows ``plan.local_shape`` (a leading ``1`` is
            accepted, as Megatron's ``[1, L]``), or the whole batch (a list of ``(n_i,)`` tensors
            or a jagged nested tensor: sharded here with ``shard(..., shift=d)``, no communication).
            ``None``: derived from ``input_ids`` as ``shift(input_ids, 1)``, the mask shifted with
            them (as megatron-core does).
        loss_mask: the same forms; ``None`` means every token row counts.
        plan, group: the plan and the CP group (``None`` allowed when ``plan.cp_size == 1``).
        num_depths: ``N >= 1``.
        input_ids: used only when ``labels`` is None.
        label_fill: the label of rows whose source lies past the sequence's end (and of pad rows);
            Megatron's roll writes 0. Such rows have mask 0.
        check: as in :func:`cpshard.distributed.gather`.

    Returns:
        ``(labels_d, masks)``: ``labels_d`` ``(N, *local_shape)``, row ``d - 1`` is depth ``d``'s;
        ``masks`` ``(1 + N, *local_shape)``, row 0 the mask aligned with the labels (pad rows 0;
        its sum is ``orig``), row ``d`` depth ``d``'s. ``local_shape`` is ``plan.local_shape``.
    """
    labels_d, masks, *_ = _targets(labels, loss_mask, plan, group, input_ids, label_fill, check,
                                   lambda: (None, {}, num_depths))
    return labels_d, masks


def _form(x: Any) -> str | None:
    """How a rank passed labels or a mask (which collectives follow depend on it: agreed on)."""
    return None if x is None else "whole batch" if _is_global(x) else "sharded"


def _target_args(labels: Any, loss_mask: Any, plan: Plan, num_depths: Any, input_ids: Any) -> int:
    """:func:`mtp_targets`' checks of its arguments (no communication); returns ``N``."""
    check_plan_type(plan)
    n = check_int("num_depths", num_depths, minimum=1)
    if labels is None and input_ids is None:
        fail("labels", None, "needs input_ids when labels is None (labels are derived from them)",
             "pass labels, or input_ids to derive them")
    _check_rows("labels" if labels is not None else "input_ids", labels if labels is not None else input_ids, plan)
    if loss_mask is not None:
        _check_rows("loss_mask", loss_mask, plan)
    return n


def _targets(labels: Rows | None, loss_mask: Rows | None, plan: Plan, group: Any, input_ids: Rows | None,
             label_fill: int, check: bool | None,
             own: Callable[[], tuple[Any, dict[str, Any], Any]]) -> tuple[torch.Tensor, torch.Tensor, Any,
                                                                      dict[str, Any], bool]:
    """:func:`mtp_targets` for a calling loss whose own checks ``own()`` give ``(its result, its
    arguments every rank passes alike, num_depths)``; returns the labels and masks, that result, the
    arguments agreed on and whether the agreement ran (checks on, ``cp > 1`` or a group).

    Every check, the caller's and the targets', runs first: with checks on a refusal joins the
    agreement (every rank raises, this one its own error) instead of raising here while the peers
    wait. The agreement then always runs, with or without an exchange, so that ranks that pass their
    labels in another form (and so make another collective) or other arguments raise on every rank."""
    agreed = checks_on(check, plan, group) and not (isinstance(plan, Plan) and solo(plan, group))
    source_name, source = ("labels", labels) if labels is not None else ("input_ids", input_ids)
    out: dict[str, torch.Tensor] = {}
    try:
        result, args, num_depths = own()
        n = _target_args(labels, loss_mask, plan, num_depths, input_ids)
        base = 0 if labels is not None else 1
        shifts = tuple(range(base, base + n + 1))
        rank = group_rank(plan, group)
        # whole-batch inputs are sharded here, inside the checks: their lengths, count and label_fill are
        # checked by shard, which then raises on every rank (checks on) instead of on this one after the
        # agreement while its peers wait in the count sum
        for name, x in ((source_name, source), ("loss_mask", loss_mask)):
            if x is not None and _is_global(x):
                fill = label_fill if name != "loss_mask" else 0
                out[name] = torch.stack([shard(x, plan, rank, shift=k, pad_value=fill, fill=fill) for k in shifts])
    except (ValueError, TypeError) as exc:
        if agreed:
            agree(plan, group, exc, {})
        raise  # agree re-raised it (kept for the type checker), or checks are off
    lead = plan.local_shape
    args = {**args, source_name: _form(source), "loss_mask": _form(loss_mask), "label_fill": _as_number(label_fill),
            "num_depths": n}
    exchanges = any(x is not None and not _is_global(x) for x in (source, loss_mask))
    if agreed and not exchanges:  # the exchange agrees on its own call (which then holds args) below
        agree(plan, group, None, args)

    sharded: list[tuple[str, torch.Tensor]] = []
    for name, x in ((source_name, source), ("loss_mask", loss_mask)):
        if x is not None and not _is_global(x):
            assert isinstance(x, torch.Tensor)
            sharded.append((name, x.reshape(lead)))
    if sharded:
        fills = [label_fill if name != "loss_mask" else 0 for name, _ in sharded]
        tensors = [t for _, t in sharded]
        shifted = shift_sharded_multi_for(tensors, plan, group, args, shifts=shifts, pad_values=fills, fills=fills,
                                          check=agreed)
        out.update({name: s for (name, _), s in zip(sharded, shifted)})
    labels_all = out[source_name]
    if loss_mask is None:  # ones on every token row, shifted: True where the source exists
        valid = torch.stack([plan.label_mask(rank, k) for k in shifts]).to(labels_all.device)
        out["loss_mask"] = valid.to(labels_all.dtype)
    return labels_all[1:], out["loss_mask"], result, args, agreed


def mtp_loss(
    hidden_states: torch.Tensor | Sequence[torch.Tensor],
    labels: Rows | None,
    loss_mask: Rows | None,
    plan: Plan,
    group: Any,
    *,
    output_layer: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_depths: int | None = None,
    scaling_factor: float = 1.0,
    normalization: Normalization | str = Normalization.MEAN,
    counts: Counts | str = Counts.GLOBAL,
    grad_reduction: GradReduction | str | None = None,
    input_ids: Rows | None = None,
    label_fill: int = 0,
    autoscaler: AutoScaler | None = None,
    log_fn: LogFn | None = None,
    check: bool | None = None,
) -> MtpLoss:
    """The MTP loss of every depth, attached to the main hidden states (SPEC.md, Note [MTP token counts]).

    Args:
        hidden_states: the rank's ``1 + N`` chunks, main first: one tensor split evenly along dim 0
            (Megatron's ``[(1 + N) s, b, h]``; give ``num_depths``) or a sequence of ``1 + N`` tensors.
        labels, loss_mask, input_ids, label_fill: as in :func:`mtp_targets`.
        plan: the plan the batch was sharded with (THD or BSHD).
        group: the CP group; ``None`` only when ``plan.cp_size == 1``.
        output_layer: ``chunk -> logits`` (e.g. the LM head; Megatron's returns a tuple: unwrap it).
        loss_fn: ``(labels_d, logits) -> per-token loss`` with ``prod(plan.local_shape)`` elements;
            ``labels_d`` has ``plan.local_shape`` (reshape it for your loss, e.g. to ``[1, L]``).
        num_depths: ``N``, required when ``hidden_states`` is one tensor.
        scaling_factor: Megatron's ``mtp_loss_scaling_factor``; each depth is scaled by it over ``N``.
        normalization: ``"mean"`` or ``"per_token"`` (Megatron's ``calculate_per_token_loss``).
        counts: ``"global"`` (exact) or ``"local"`` (Megatron's per-rank counts, for comparison).
        grad_reduction: how you reduce gradients over the CP group after ``backward()``:
            ``"mean"`` (averaged, as Megatron's DDP and FSDP do) or ``"sum"``; ``None`` (default):
            ``"mean"`` under ``normalization="mean"``, ``"sum"`` under ``"per_token"`` (Megatron's
            own). Then every gradient equals ``cp = 1``'s (under ``"per_token"``: before Megatron's
            division by the global token count, which is the same at every ``cp``). ``counts="local"``
            takes only the default (it reproduces Megatron, not ``cp = 1``).
        autoscaler: ``(main_chunk, loss) -> main_chunk`` attaching the loss's gradient;
            default :class:`MtpLossAutoScaler`. Pass ``MTPLossAutoScaler.apply`` from Megatron to
            keep the scale Megatron's schedules set.
        log_fn: called per depth as ``log_fn(d - 1, logits, labels_d, mask_d, loss_d)`` (detached
            values; for Megatron's loss and acceptance-rate tracker).
        check: as in :func:`cpshard.distributed.gather` (the exchange's agreement check).

    Returns:
        :class:`MtpLoss`: the main chunk with the gradients attached, per-depth losses and the counts.

    After the main loss's ``backward()``: under ``"mean"`` average the gradients over the CP (and
    DP) group, as Megatron's DDP and FSDP do; under ``"sum"`` sum them over CP, and in per-token
    mode divide them by the global token count (Megatron's ``finalize_model_grads`` does both).
    Every gradient then equals ``cp = 1``'s. Combine it with ``cpshard.loss`` losses of the same
    ``grad_reduction``.

    Communication: at most two collectives per call (one exchange of labels and masks for every
    depth, when they exist only sharded; one ``all_reduce`` of all counts); none at ``cp = 1``.
    """
    def own() -> tuple[tuple[Normalization, Counts, GradReduction, list[torch.Tensor]], dict[str, Any], int]:
        norm, kind = Normalization.parse(normalization), Counts.parse(counts)
        reduced = _grad_reduction(grad_reduction, norm, kind)
        if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, numbers.Real):
            fail("scaling_factor", repr(scaling_factor), "must be a real number", "pass e.g. scaling_factor=0.1",
                 kind=TypeError)
        parts = _chunks(hidden_states, num_depths)
        # every argument that changes the result or the collectives (Note [MTP arguments])
        args = {"scaling_factor": float(scaling_factor), "normalization": norm.value, "counts": kind.value,
                "grad_reduction": reduced.value}
        return (norm, kind, reduced, parts), args, len(parts) - 1

    # every argument checked first, inside the agreement with checks on: a rank that refuses its
    # own makes every rank raise, instead of its peers waiting in the labels' exchange
    labels_d, masks, (normalization, counts, reduction, chunks), args, agreed = _targets(
        labels, loss_mask, plan, group, input_ids, label_fill, check, own)
    n = len(chunks) - 1
    local_counts = torch.stack([m.sum(dtype=_count_dtype(m)) for m in masks])
    global_counts = counts is Counts.GLOBAL and plan.cp_size > 1
    if global_counts:  # stamped with the arguments; agreed on above, with checks on
        totals = reduce_over(local_counts, group, op="mtp_loss", plans=(plan,), checked=agreed,
                             call={**args, "dtype": local_counts.dtype, "row shape": tuple(local_counts.shape)})
    else:
        totals = local_counts
    factor = plan.cp_size if global_counts else 1  # the logged losses' (their mean over CP is the depth's)
    grad_factor = plan.cp_size if global_counts and reduction is GradReduction.MEAN else 1
    scale = float(scaling_factor) / n
    orig = totals[0]
    total: torch.Tensor | None = None
    losses = []
    for d in range(1, n + 1):
        logits = output_layer(chunks[d])
        loss = loss_fn(labels_d[d - 1], logits)
        if not isinstance(loss, torch.Tensor) or loss.numel() != math.prod(plan.local_shape):
            fail("loss_fn", f"a result of shape {tuple(getattr(loss, 'shape', ()))}",
                 f"must give one loss per local row, {math.prod(plan.local_shape)} values (local_shape "
                 f"{plan.local_shape})", "return the unreduced per-token loss")
        mask = masks[d]
        loss = loss.reshape(mask.shape)
        masked = masked_rows(loss, mask)
        num = totals[d].clamp(min=1)
        summed = masked.sum()
        weight = orig
        if totals.is_floating_point():  # counted exactly in float64; divided in the loss's dtype, as cpshard.loss does
            num, weight = num.to(summed.dtype), orig.to(summed.dtype)
        if normalization is Normalization.PER_TOKEN:
            part = scale * grad_factor * summed * (weight / num)
        else:
            part = scale * grad_factor * summed / num
        total = part if total is None else total + part
        logged = (factor * summed.detach() / num).to(loss.dtype)
        losses.append(logged)
        if log_fn is not None:
            log_fn(d - 1, logits.detach(), labels_d[d - 1], mask, logged)
    assert total is not None
    attach = autoscaler if autoscaler is not None else MtpLossAutoScaler.apply
    hidden = attach(chunks[0], total)
    return MtpLoss(hidden=hidden, losses=torch.stack(losses), counts=totals.detach())


def _as_number(value: Any) -> Any:
    """A real ``value`` as the number it is (``np.int64(0)``, ``0`` and ``0.0`` are ``0``; ``np.float32(0.5)``
    is ``0.5``), so that ranks that spell one label_fill two ways agree; anything else as given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) or float(value).is_integer() else float(value)


def _count_dtype(mask: torch.Tensor) -> torch.dtype:
    """Where a mask's counts are summed exactly: int64 for a bool or integer mask, float64 for a
    floating one (a bfloat16 sum of 555 ones is 556; float16 stops counting at 2048)."""
    return torch.float64 if mask.is_floating_point() or mask.is_complex() else torch.int64


def _grad_reduction(value: Any, normalization: Normalization, counts: Counts) -> GradReduction:
    megatrons = GradReduction.SUM if normalization is Normalization.PER_TOKEN else GradReduction.MEAN
    if value is None:
        return megatrons
    reduction = GradReduction.parse(value)
    if counts is Counts.LOCAL and reduction is not megatrons:
        fail("grad_reduction", repr(reduction.value), f"does not apply to counts='local', which reproduces "
             f"megatron-core (gradients {'summed' if megatrons is GradReduction.SUM else 'averaged'} under "
             f"normalization={normalization.value!r})", "drop grad_reduction, or pass counts='global'")
    return reduction


def _chunks(hidden: Any, num_depths: int | None) -> list[torch.Tensor]:
    if isinstance(hidden, torch.Tensor):
        if num_depths is None:
            fail("num_depths", None, "is required when hidden_states is one tensor of 1 + N chunks",
                 "pass num_depths=N (Megatron's config.mtp_num_layers)")
        n = check_int("num_depths", num_depths, minimum=1)
        check_real("hidden_states", hidden)
        if hidden.dim() == 0 or hidden.shape[0] % (1 + n):
            fail("hidden_states", f"tensor of shape {tuple(hidden.shape)}",
                 f"dim 0 must split into 1 + num_depths = {1 + n} equal chunks",
                 "pass the main hidden states and every depth's, concatenated along dim 0")
        return list(torch.chunk(hidden, 1 + n, dim=0))
    if not isinstance(hidden, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hidden):
        fail("hidden_states", type(hidden).__name__, "must be a tensor or a sequence of tensors",
             "pass the 1 + N hidden-state chunks", kind=TypeError)
    if len(hidden) < 2:
        fail("hidden_states", f"{len(hidden)} chunks", "must hold the main chunk and at least one depth",
             "pass [main, depth 1, ..., depth N]")
    if num_depths is not None and check_int("num_depths", num_depths, minimum=1) != len(hidden) - 1:
        fail("num_depths", num_depths, f"must equal len(hidden_states) - 1 = {len(hidden) - 1}",
             "drop num_depths or pass matching chunks")
    for i, h in enumerate(hidden):
        check_real(f"hidden_states[{i}]", h)
    return list(hidden)
