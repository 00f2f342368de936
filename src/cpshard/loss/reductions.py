"""Losses that are exact under context parallelism, in one gradient convention.

SPEC.md, "Losses and the gradient convention". Every function takes the rank's per-token values
(``plan.local_shape``, or any shape with that many elements, such as Megatron's ``[1, L]``), the
loss mask on the same rows and the plan, and returns this rank's share of the loss: a rank computes
only its own rows, and the counts that normalize them are reduced over the CP group.

Note [Gradient convention]
--------------------------
A loss computed on a rank's rows is exact when, after the gradient reduction the caller runs, every
parameter gradient equals the one computed on the whole micro-batch at ``cp = 1``. With ``s_r`` the
sum of rank ``r``'s masked per-token values and ``N`` the micro-batch's token count (summed over
the CP group), the batch's token mean is ``sum_r s_r / N``, so:

- ``grad_reduction="mean"`` (:class:`~cpshard.GradReduction`, the default): the caller averages
  gradients over the CP group (and the DP group), as Megatron-core's DDP and FSDP do (their
  gradient scaling ``1 / (dp * cp)``, ``megatron/core/distributed/distributed_data_parallel.py``);
  rank ``r`` returns ``cp * s_r / N``, and ``cp * dp * s_r / N`` when ``N`` spans the DP group too
  (``dp_group``, verl's global token mean over data-parallel ranks, ``agg_loss(dp_size=...)``).
- ``grad_reduction="sum"``: the caller sums gradients over the CP group (and over the DP group
  with ``dp_group``); rank ``r`` returns ``s_r / N``.

The returned loss follows the same rule: averaged (``"mean"``) or summed (``"sum"``) over the ranks,
it is the ``cp = 1`` loss. A rank-local normalization (``s_r / n_r`` with the rank's own count
``n_r``) is exact only when every rank holds the same count, which causal-balanced layouts, masks
and minimal padding rarely give: the error users report (Megatron-LM #7513, verl #5983).

Counts are weights: ``sum(loss_mask)`` over token rows (0/1 for a plain mask). Pad rows never count,
whatever the mask holds there. A zero count is replaced by one, so a rank, a sequence or a
micro-batch without a labelled token contributes exactly zero loss and zero gradient, never NaN;
per-token values on unlabelled rows (``inf``, ``NaN``) are never read into the sum.

Communication: one ``all_reduce`` over the CP group per call (the count, or every sequence's count
in one tensor), none at ``cp = 1`` and none for the sums (:func:`token_sum`,
:func:`token_sum_and_count`); with ``dp_group``, one more small ``all_reduce`` over it. With checks on
(``check=True``, :func:`cpshard.distributed.set_checks`, ``CPSHARD_CHECK=1``), first the agreement's
small all-gather over the CP group, for every loss (those without a collective of their own too),
and with ``dp_group`` one stamped DP collective per call (Note [DP-level calls]).

Note [Failure in a loss]
------------------------
Every sum of a loss is stamped (Note [Stamped reductions] in ``cpshard/distributed/header.py``: the loss, its plan and
arguments, folded into the same ``all_reduce``), so ranks that disagree about the call raise instead
of returning a wrong share, checks on or off. With checks off a rank's own bad input raises there,
before any collective (the project's rule), and its CP peers wait in the count sum until it exits.
With checks on the agreement over the CP group raises on every CP rank; each of them then still
joins the call's DP count (``dp_group``) with the failure word set, so that the DP peers raise in
it instead of waiting. A rank that reads a disagreement or a failure in the CP count joins the DP
count the same way. docs/guarantees.md has the table.

Note [DP-level calls]
---------------------
The agreement of ``check=True`` runs over the CP group only, so CP groups that disagree about the DP
step (one passes ``num_tokens`` and skips the DP sum another makes; ``token_sum`` against
``token_mean``; another ``grad_reduction`` or count over ``dp_group``) would hang in the DP sum or
return other shares. Rather than a second agreement over ``dp_group`` (an all-gather, whose first rule,
one plan for every rank, does not hold there: DP ranks hold other batches), the DP collective itself
carries the disagreement: every DP sum is stamped with the loss, its arguments, whether it counts and,
with checks on, the given count's exact value (Note [Stamped reductions]); and with checks on a call
with ``dp_group`` that makes no DP sum (``token_sum``, a count given) joins a one-word stamped sum
over ``dp_group`` in its place. So with checks on every DP rank makes exactly one DP collective per
loss call, and any difference makes every DP rank raise. That costs one ``all_reduce`` of one word
and its trailer, only with checks on and only for calls without a DP sum of their own; with checks
off nothing is added: the DP sums of the calls that count carry the same trailer (two of them that
differ raise), but a call that makes no DP collective cannot be heard by its DP peers, which wait
in their DP sum, and ``token_sum``'s shares follow each rank's own arguments. A CP group that passes
``dp_group=None`` holds no handle on the DP group: its DP peers that pass one wait, checks on or off.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from cpshard.base.convention import GradReduction
from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.distributed.checks import agree, checks_on
from cpshard.distributed.groups import group_rank, group_size
from cpshard.distributed.sums import reduce_over
from cpshard.index.segments import to_device
from cpshard.plan.values import Plan

__all__ = ["GradReduction", "masked_rows", "rank_of", "sequence_mean", "token_mean", "token_sum",
           "token_sum_and_count"]

_F64 = torch.float64

rank_of = group_rank  # the caller's CP rank (0 at cp = 1 without a group); the name before 0.2 (CHANGELOG)


def masked_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` where ``mask != 0``, exactly 0 elsewhere (so ``inf`` or ``NaN`` on unlabelled
    rows reaches neither the sum nor the gradient)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if mask.dtype == torch.bool:
        return torch.where(mask, values, zero)
    return torch.where(mask != 0, values * mask.to(values.dtype), zero)


def _rows(name: str, x: Any, plan: Plan) -> torch.Tensor:
    x = check_real(name, check_tensor(name, x))
    if x.is_nested or x.numel() != math.prod(plan.local_shape):
        fail(name, f"tensor of shape {tuple(x.shape)}",
             f"must hold one value per local row, local_shape = {plan.local_shape} (any shape of that many "
             "elements, e.g. Megatron's [1, L])", "pass this rank's rows, sharded with the same plan")
    return x.reshape(plan.local_shape)


def _check_count(name: str, shown: str, value: float, fix: str) -> None:
    """A given count: a number >= 0 (not NaN), and finite (an infinite count made every share 0)."""
    if not value >= 0:
        fail(name, shown, "must be a count >= 0", fix)
    if math.isinf(value):
        fail(name, shown, "must be finite (a count of tokens or sequences)", fix)


class _Local:
    """What every loss needs from a rank's rows, checked before any collective."""

    def __init__(self, per_token: Any, loss_mask: Any, plan: Plan, group: Any, dp_group: Any,
                 grad_reduction: Any) -> None:
        self.reduction = GradReduction.parse(grad_reduction)
        self.rank = group_rank(plan, group)
        values = _rows("per_token", per_token, plan)
        if not values.is_floating_point():
            fail("per_token", f"a {values.dtype} tensor", "must be floating point (a per-token loss)",
                 "pass the unreduced per-token loss, e.g. cross_entropy(..., reduction='none')", kind=TypeError)
        mask = _rows("loss_mask", loss_mask, plan)
        if mask.is_complex():
            fail("loss_mask", f"a {mask.dtype} tensor", "must be bool, integer or real", "pass a 0/1 mask",
                 kind=TypeError)
        if mask.device != values.device:
            fail("loss_mask", f"a tensor on {mask.device}", f"must be on per_token's device ({values.device})",
                 "move it there once per step")
        self.dp = 1
        if dp_group is not None:
            if dp_group is group:
                fail("dp_group", "the CP group", "must be the data-parallel group (the ranks with this CP rank "
                     "that hold other micro-batches), not the CP group", "pass your DP group, or None")
            self.dp = group_size(dp_group, "dp_group")
        tokens = to_device(plan.token_mask(self.rank), values.device)  # pad rows never count
        self.exact = not mask.is_floating_point()  # a bool or integer mask: its counts are exact
        self.mask = mask.detach() if mask.dtype == torch.bool else mask.detach().to(_F64)
        self.mask = torch.where(tokens, self.mask, torch.zeros((), dtype=self.mask.dtype, device=values.device))
        self.values = masked_rows(values, self.mask)
        self.plan, self.group, self.dp_group = plan, group, dp_group

    @property
    def factor(self) -> int:
        """``cp`` (times ``dp`` with ``dp_group``) under ``"mean"``, 1 under ``"sum"``."""
        return self.plan.cp_size * self.dp if self.reduction is GradReduction.MEAN else 1

    def given(self, name: str, value: Any) -> torch.Tensor | None:
        """A count the caller knows already, as a float64 scalar on the rows' device (``None``: not given)."""
        if value is None:
            return None
        fix = f"pass {name} as the total over every rank and micro-batch it covers, or None to count here"
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and not value.is_meta:
            count = value.detach().reshape(()).to(device=self.values.device, dtype=_F64)
            if value.device.type == "cpu":  # read here: no device to wait for
                _check_count(name, f"tensor({float(count)})", float(count), fix)
            else:  # on the device, no host sync: a device-side assertion
                torch._assert_async((count >= 0) & count.isfinite())
            return count
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            fail(name, repr(value), "must be a number or a one-element tensor", fix, kind=TypeError)
        _check_count(name, repr(value), float(value), fix)
        return torch.tensor(float(value), dtype=_F64, device=self.values.device)

    def covers(self, name: str, count: torch.Tensor, read: bool, sequences: bool = False) -> None:
        """Refuse a given count below what this rank holds, which the count must include: its labelled
        tokens (weights: the mask's sum over token rows), or with ``sequences`` its sequences with a
        labelled token. Read on the host where that costs no sync: the rows on the CPU, or ``read``
        (checks on: the agreement reads the host anyway); on a device otherwise, a device-side
        assertion (no host sync), as for a negative count."""
        if sequences:
            seq = to_device(self.plan.sequence_ids(self.rank), self.mask.device).reshape(-1)
            held = torch.zeros(self.plan.num_seqs, dtype=_F64, device=self.mask.device)
            present, what = (held.index_add(0, seq, self.mask.reshape(-1).to(_F64)) > 0).sum(dtype=_F64), "sequences"
        else:
            present, what = self.mask.sum(dtype=_F64), "tokens"
        slack = 0.0 if self.exact or sequences else 1e-6 * present  # weights summed in another order may round
        if count.device.type == "cpu" or read:
            have, need = float(count), float(present)
            if have < need - float(slack):
                fail(name, f"{have:g}", f"must count at least this rank's labelled {what} ({need:g}, from the loss "
                     "mask over its token rows)", f"pass {name} as the total over every rank and micro-batch it "
                     "covers, or None to count here")
        else:
            torch._assert_async(count >= present - slack)

    def divide(self, summed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``factor * summed / count``, with a zero count taken as one (the sum is then zero too). Only zero:
        a NaN count (a NaN weight in some rank's mask) gives NaN on every rank, not each rank's plain sum."""
        count = torch.where(count == 0, torch.ones_like(count), count).to(summed.dtype)
        return self.factor * summed / count


class _Call:
    """One loss call's communication (Note [Failure in a loss]): the agreement with checks on, the
    stamped sums over the CP and DP groups, and a failure carried to the DP group."""

    def __init__(self, name: str, plan: Any, group: Any, dp_group: Any, check: Any, call: dict[str, Any],
                 dp_sum: bool) -> None:
        self.name, self.plan, self.group, self.dp_group = name, plan, group, dp_group
        self.call = call  # the arguments every CP rank passes alike
        self.dp_sum = dp_sum  # whether this call sums over dp_group (else, checks on, it joins a one-word check)
        self.checked = checks_on(check, plan, group)  # a check that is no bool: refused inside the agreement

    @property
    def dp_call(self) -> dict[str, Any]:
        return {"loss": self.name, **self.call}

    def note(self, name: str, count: torch.Tensor | None) -> None:
        """With checks on, a given count's exact value joins the call (the agreement's digest, the stamps):
        ranks that pass different counts raise instead of returning wrong shares. One host read, as the
        agreement's own (checks off: only whether a count was given, no host sync)."""
        if self.checked and count is not None:
            self.call[name] = float(count)

    def finish(self) -> None:
        """With checks on and ``dp_group``, a call that makes no DP sum joins a one-word stamped sum over
        ``dp_group`` instead (Note [DP-level calls]): every DP rank then makes exactly one DP collective
        per loss call, whose trailer carries the loss, its arguments and whether it counts, so that CP
        groups that disagree about the DP step raise instead of hanging or returning other shares."""
        if self.checked and self.dp_group is not None and not self.dp_sum:
            self._sum_dp(torch.zeros((), dtype=_F64))

    def start(self, build: Any) -> Any:
        """``build()`` (this rank's checks, before any collective); with checks on, the agreement
        over the CP group first, which raises on every CP rank or none."""
        solo = isinstance(self.plan, Plan) and self.plan.cp_size == 1 and self.group is None
        if not self.checked:
            return build()  # a failing check raises here, before any collective
        try:
            local = build()
        except (ValueError, TypeError) as exc:
            if solo:
                self._leave(exc)
            self._agreed(exc)
            raise  # _agreed re-raised it; kept for the type checker
        if not solo:
            rows = local[0] if isinstance(local, tuple) else local  # the _Local (and a given count)
            self._agreed(None, {"device": rows.values.device.type})
        return local

    def _agreed(self, error: Exception | None, extra: dict[str, Any] | None = None) -> None:
        try:
            agree(self.plan, self.group, error, {**self.call, **(extra or {}), "operation": self.name})
        except (ValueError, TypeError) as exc:  # the verdict, or this rank's own error re-raised
            self._leave(exc)

    def _leave(self, error: Exception) -> Any:
        """Join the DP sum this call runs with the failure word set (where this rank can), then raise
        ``error``: the DP peers raise in that sum instead of waiting in it."""
        if self.dp_group is not None and (self.dp_sum or self.checked):  # the DP sum, or the DP check
            try:
                self._sum_dp(torch.zeros((), dtype=_F64), failed=True)
            except (ValueError, TypeError):
                pass
        raise error

    def _sum_dp(self, counts: torch.Tensor, failed: bool = False) -> torch.Tensor:
        return reduce_over(counts, self.dp_group, op=f"{self.name} over dp_group", call=self.dp_call,
                           checked=self.checked, failed=failed)

    def over_cp(self, counts: torch.Tensor, given: tuple[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``counts`` summed over the CP group (stamped: the loss, its plan and arguments), or as they
        are at ``cp = 1``; a disagreement or failure read there reaches the DP group too. ``given``: a
        count the caller passed (name, value), whose exact bits ride in the same sum (:func:`_value_words`),
        so that ranks that pass different values raise, checks on or off, with no host read."""
        if self.plan.cp_size == 1:
            return counts
        words = _value_words(given[1]) if given is not None else counts.new_zeros(0)
        try:
            summed = reduce_over(torch.cat([counts.reshape(-1), words]), self.group, op=self.name,
                                 plans=(self.plan,), call=self.call, checked=self.checked)
            if given is not None:
                _same_everywhere(summed[counts.numel():], words, self.plan.cp_size, self.name, *given)
        except ValueError as exc:
            return self._leave(exc)
        return summed[:counts.numel()].view(counts.shape)

    def over_dp(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` summed over ``dp_group`` (stamped: the loss and its arguments), or as they are."""
        return self._sum_dp(counts) if self.dp_group is not None else counts


def _value_words(value: torch.Tensor) -> torch.Tensor:
    """A float64 scalar's 64 bits as four 16-bit chunks ``c`` (1 .. 2**16), then their squares, in float64
    on its device: summed over ``n`` ranks (exact below ``2**21`` ranks), ``sum c = n c`` and ``sum c**2 =
    n c**2`` hold for every chunk only when every rank's value has the same bits (Note [Stamped
    reductions] reads a digest the same way)."""
    bits = value.detach().reshape(1).to(_F64).view(torch.int64)
    c = ((bits >> torch.arange(0, 64, 16, device=value.device)) & 0xFFFF).to(_F64) + 1
    return torch.cat([c, c * c])


def _same_everywhere(summed: torch.Tensor, words: torch.Tensor, ranks: int, op: str, name: str,
                     value: torch.Tensor) -> None:
    """Raise unless every rank folded the same value's words into ``summed`` (on a device: a device-side
    assertion, no host sync)."""
    same = summed == ranks * words
    if same.device.type != "cpu":
        torch._assert_async(same.all())
    elif not bool(same.all()):
        raise ValueError(f"{op}: the ranks of the CP group passed different {name} (this rank passed "
                         f"{float(value)}), so the shares would not add up to one loss; no rank returns one. Fix: "
                         f"pass every rank of the group the same {name}, the total over every rank and micro-batch "
                         "it covers.")


def _call_args(grad_reduction: Any, dp_group: Any, **extra: Any) -> dict[str, Any]:
    """The arguments every rank passes alike; ``grad_reduction`` as parsed (``"MEAN"`` and ``GradReduction.MEAN``
    are ``"mean"``: ranks that spell one convention two ways agree), or as given where it does not parse
    (refused inside the checks, by ``_Local``)."""
    try:
        reduction = GradReduction.parse(grad_reduction).value
    except (ValueError, TypeError):
        reduction = repr(grad_reduction)
    return {"grad_reduction": reduction, "dp_group": dp_group is not None, **extra}


def token_mean(per_token: torch.Tensor, loss_mask: torch.Tensor, plan: Plan, group: Any, *,
               grad_reduction: GradReduction | str = GradReduction.MEAN, dp_group: Any = None,
               num_tokens: float | torch.Tensor | None = None, check: bool | None = None) -> torch.Tensor:
    """This rank's share of the mean over every labelled token of the micro-batch (Note [Gradient convention]).

    Args:
        per_token: the rank's per-token loss (floating), ``plan.local_shape`` or that many elements.
        loss_mask: the same rows: bool, or 0/1 (other values are weights). Pad rows never count.
        plan: the plan the micro-batch was sharded with (THD or BSHD, any layout, order or padding).
        group: the CP group; ``None`` only when ``plan.cp_size == 1``.
        grad_reduction: ``"mean"`` (default) or ``"sum"``: how you reduce gradients over the CP
            (and DP) ranks after ``backward()``.
        dp_group: the data-parallel group (the ranks with this CP rank that hold the other
            micro-batches). Given, the mean runs over every labelled token of all of them (verl's
            global ``token-mean``); ``None``: over this micro-batch only (each replica's own mean,
            what Megatron's ``calculate_per_token_loss=False`` takes).
        num_tokens: ``N`` when it is known before the step, e.g. verl's ``batch_num_tokens`` (every
            labelled token of the mini-batch's micro-batches, over the DP group: gradient
            accumulation then adds up to their mean): no collective at all. Pass ``dp_group`` too
            when ``N`` spans DP ranks (only its size is read, for ``f``). An ``N`` below this rank's
            own labelled tokens is refused (read on the host where the rows are on the CPU or checks
            are on; else a device-side assertion, no host sync).
        check: ``True`` runs the agreement over ``group`` first (one small all-gather), so that bad
            input or another plan on any rank raises on every rank, naming them; ``None`` follows
            :func:`cpshard.distributed.set_checks`. Checks on or off, the sums are stamped: ranks that
            disagree raise instead of returning (Note [Failure in a loss]).

    Returns:
        A scalar: ``f * s_r / N`` (``s_r`` this rank's masked sum, ``N`` the token count of the
        micro-batch, or of the DP group's micro-batches), ``f = cp`` (``cp * dp`` with
        ``dp_group``) under ``"mean"`` and 1 under ``"sum"``.

    After ``loss.backward()``: average the gradients over the CP and DP groups under ``"mean"``
    (Megatron's DDP / FSDP do it), or sum them over the CP group (and the DP group, with
    ``dp_group``) under ``"sum"``; then every gradient equals ``cp = 1``'s, and the loss reduced
    the same way is ``cp = 1``'s loss.

    One ``all_reduce`` of one count over ``group`` (none at ``cp = 1``); one more over ``dp_group``;
    none with ``num_tokens`` (with checks on and ``dp_group``, one word over it: Note [DP-level calls]).
    """
    given = None if num_tokens is None else "given"  # its value joins the call with checks on (_Call.note)
    call = _Call("token_mean", plan, group, dp_group, check, _call_args(grad_reduction, dp_group, num_tokens=given),
                 num_tokens is None)

    def build() -> tuple[_Local, torch.Tensor | None]:
        local = _Local(per_token, loss_mask, plan, group, dp_group, grad_reduction)
        count = local.given("num_tokens", num_tokens)
        if count is not None:
            local.covers("num_tokens", count, call.checked)
        call.note("num_tokens", count)
        return local, count

    local, count = call.start(build)
    if count is None:
        count = call.over_dp(call.over_cp(local.mask.sum(dtype=_F64)))
    call.finish()
    return local.divide(local.values.sum(), count)


def token_sum(per_token: torch.Tensor, loss_mask: torch.Tensor, plan: Plan, group: Any, *,
              grad_reduction: GradReduction | str = GradReduction.MEAN, dp_group: Any = None,
              check: bool | None = None) -> torch.Tensor:
    """This rank's share of the sum over every labelled token (verl's ``token-sum``). No communication.

    Arguments as :func:`token_mean`. Returns ``f * s_r`` with ``f = cp`` (``cp * dp`` with
    ``dp_group``: the sum over the DP group's micro-batches) under ``"mean"`` and 1 under ``"sum"``;
    after ``backward()``, reduce gradients and the loss as :func:`token_mean` says. With checks on,
    the agreement over ``group`` and, with ``dp_group``, one stamped word over it (Note [DP-level calls]).
    """
    call = _Call("token_sum", plan, group, dp_group, check, _call_args(grad_reduction, dp_group), False)
    local = call.start(lambda: _Local(per_token, loss_mask, plan, group, dp_group, grad_reduction))
    call.finish()
    return local.factor * local.values.sum()


def token_sum_and_count(per_token: torch.Tensor, loss_mask: torch.Tensor, plan: Plan, group: Any, *,
                        check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-core's per-token-loss form: ``(s_r, n_r)``, this rank's loss sum and own token count.

    For a ``loss_func`` under ``calculate_per_token_loss=True``, which returns ``(loss_sum,
    num_tokens, reporting)``: Megatron then sums gradients over DP x CP (its DDP scaling is 1) and
    divides them by ``num_tokens`` summed over DP x CP (``finalize_model_grads``), so the count must
    be the rank's own, not the CP group's (that would count every token ``cp`` times). No
    communication, no factor: the gradient convention is Megatron's, a sum.

    Args: as :func:`token_mean` (``group`` is only checked against ``plan``; with checks on, the
    agreement runs over it).

    Returns:
        ``(loss_sum, num_tokens)``: a scalar with gradient, and the count (the mask's sum over
        token rows) as a ``torch.int`` scalar on ``per_token``'s device, Megatron's accumulator type.
    """
    call = _Call("token_sum_and_count", plan, group, None, check, {}, False)
    local = call.start(lambda: _Local(per_token, loss_mask, plan, group, None, GradReduction.SUM))
    return local.values.sum(), local.mask.sum(dtype=_F64).round().to(torch.int)


_TOKEN_REDUCTIONS = ("mean", "sum")


def sequence_mean(per_token: torch.Tensor, loss_mask: torch.Tensor, plan: Plan, group: Any, *,
                  token_reduction: str = "mean", grad_reduction: GradReduction | str = GradReduction.MEAN,
                  dp_group: Any = None, num_seqs: float | torch.Tensor | None = None,
                  check: bool | None = None) -> torch.Tensor:
    """This rank's share of the mean over sequences of each sequence's token mean, though every
    sequence's tokens sit on several ranks (verl's ``seq-mean-token-mean``; Note [Gradient convention]).

    Each sequence's count is summed over the CP group first (one ``all_reduce`` of all ``B`` counts
    together, whatever ``B``); only sequences with a labelled token take part in the mean, as
    verl's ``agg_loss`` excludes fully masked ones.

    Args:
        per_token, loss_mask, plan, group, grad_reduction: as :func:`token_mean`.
        token_reduction: ``"mean"`` (each sequence's token mean) or ``"sum"`` (its token sum: verl's
            ``seq-mean-token-sum``).
        dp_group: the data-parallel group: given, the mean runs over the sequences of every DP
            rank's micro-batch (one more ``all_reduce`` over it, of one number).
        num_seqs: ``S`` when it is known before the step (verl's ``global_batch_size``): no
            ``all_reduce`` over ``dp_group`` (give it for ``f``), and none at all with
            ``token_reduction="sum"``. An ``S`` below this rank's sequences with a labelled token is
            refused, as ``num_tokens`` is in :func:`token_mean`.
        check: as in :func:`token_mean`.

    Returns:
        A scalar: ``f * sum_i (s_ri / n_i) / S`` (``s_ri`` this rank's masked sum of sequence ``i``,
        ``n_i`` its count over the CP group, 1 under ``token_reduction="sum"``; ``S`` the number of
        sequences with ``n_i > 0``, over the DP group with ``dp_group``), ``f`` as in
        :func:`token_mean`. After ``backward()`` reduce gradients and the loss as it says.
    """
    call = _Call("sequence_mean", plan, group, dp_group, check,
                 _call_args(grad_reduction, dp_group, token_reduction=token_reduction,
                            num_seqs=None if num_seqs is None else "given"),
                 num_seqs is None)

    def build() -> tuple[_Local, torch.Tensor | None]:
        if token_reduction not in _TOKEN_REDUCTIONS:
            fail("token_reduction", repr(token_reduction), "must be 'mean' (a sequence's token mean) or 'sum'",
                 "pass token_reduction='mean' or 'sum'")
        local = _Local(per_token, loss_mask, plan, group, dp_group, grad_reduction)
        count = local.given("num_seqs", num_seqs)
        if count is not None:
            local.covers("num_seqs", count, call.checked, sequences=True)
        call.note("num_seqs", count)
        return local, count

    local, given = call.start(build)
    device = local.values.device
    seq = to_device(plan.sequence_ids(local.rank), device).reshape(-1)
    b = plan.num_seqs
    sums = local.values.new_zeros(b).index_add(0, seq, local.values.reshape(-1))
    if given is not None and token_reduction == "sum":
        call.finish()
        return local.divide(sums.sum(), given)
    counts = call.over_cp(torch.zeros(b, dtype=_F64, device=device).index_add(0, seq, local.mask.reshape(-1).to(_F64)),
                          None if given is None else ("num_seqs", given))
    labelled = (counts > 0) | counts.isnan()  # a NaN weight in a rank's mask: NaN on every rank, not dropped
    if token_reduction == "mean":
        sums = sums / torch.where(labelled, counts, torch.ones_like(counts)).to(sums.dtype)
    total = given if given is not None else call.over_dp(labelled.sum(dtype=_F64))
    call.finish()
    return local.divide(sums.sum(), total)
