"""megatron-core's ``process_mtp_loss``, exact at every CP size and layout, on every megatron-core version.

:func:`process_mtp_loss` takes megatron-core 0.19's arguments and gives its result at ``cp = 1``
(``megatron/core/transformer/multi_token_prediction.py``: labels derived from ``input_ids`` when
``labels`` is None, ``mtp_detach_heads``, ``scale_logits_fn``, training-time loss and acceptance
logging). It builds a cpshard plan from ``packed_seq_params`` and runs :func:`cpshard.mtp.mtp_loss`,
so that under ``cp > 1`` the token counts are summed over the CP group (Note [MTP token counts] in
``cpshard/mtp.py``), any layout is shifted right, and the labels and masks of all depths move in one
collective instead of Megatron's four point-to-point messages per sequence, depth and tensor.

Megatron is imported lazily, only here and only through ``cpshard.megatron._import``; without it
the function still works (cpshard's own autoscaler, no tracker logging).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.base.errors import fail
from cpshard.distributed.agree import checks_enabled
from cpshard.distributed.checks import agree
from cpshard.loss.mtp import Counts, MtpLossAutoScaler, Normalization, mtp_loss
from cpshard.loss.reductions import masked_rows
from cpshard.megatron._import import import_megatron, megatron_version
from cpshard.megatron.packed import offsets_of
from cpshard.megatron.state import _group_read
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.values import Plan, ShardPlan

__all__ = ["MtpLossImpl", "forget_logged_choices", "fuses_linear_cross_entropy", "megatron_mtp_module", "mtp_loss_impl",
           "plan_for_mtp", "process_mtp_loss"]

_log = logging.getLogger("cpshard.megatron")
_logged: set[tuple[str, str]] = set()
_NOT_LOADED = object()
_module: Any = _NOT_LOADED
_module_error = ""


def forget_logged_choices() -> None:
    """Forget which choices :func:`mtp_loss_impl` has logged, so that the next one logs again (it logs
    each choice once a process). A test hook."""
    _logged.clear()


def megatron_mtp_module() -> tuple[Any, str]:
    """``(module, why_not)``: megatron-core's ``multi_token_prediction`` module, or None and why it is
    not importable; imported once. A test hook too: patched to stand in for an install without Megatron."""
    global _module, _module_error
    if _module is _NOT_LOADED:
        try:
            _module = import_megatron("transformer.multi_token_prediction")
        except Exception as exc:  # not installed, or an install this torch cannot import
            _module, _module_error = None, f"{type(exc).__name__}: {exc}"
    return _module, _module_error


def _group_size(cp_group: Any) -> int:
    return 1 if cp_group is None else _group_read(cp_group, "cp_group", "size")


def plan_for_mtp(labels_shape: tuple[int, ...], cp_size: int, packed_seq_params: Any = None) -> Plan:
    """The plan that describes Megatron's sharded MTP inputs of shape ``labels_shape`` (``[b, s]``).

    Packed (``packed_seq_params`` given): one sequence per padded ``cu_seqlens`` interval
    (``cu_seqlens_q_padded``, else ``cu_seqlens_q``), laid out by ``cp_partition_mode`` (zigzag
    when the field is absent or None). Pad rows count as rows of their sequence, as in Megatron's
    packed roll; the loss mask keeps them out of the loss. BSHD (``None``): every row is one
    sequence of ``s * cp`` columns in the zigzag layout, as Megatron's CP roll assumes.
    """
    if packed_seq_params is None:
        if len(labels_shape) != 2:
            fail("labels", f"tensor of shape {labels_shape}", "must be [b, s] for BSHD input",
                 "pass Megatron's [batch, local sequence] labels")
        b, s = labels_shape
        if cp_size > 1 and s % 2:
            fail("labels", f"tensor of shape {labels_shape}", f"under cp = {cp_size} the local sequence length "
                 "must be even (two zigzag chunks per rank)", "pad the batch to a multiple of 2 * cp")
        bshd = BshdPlan.build([s * cp_size] * b, cp_size=cp_size, layout="zigzag")
        if bshd.local_shape != (b, s):
            fail("labels", f"tensor of shape {labels_shape}", f"does not match the zigzag columns of cp = {cp_size} "
                 f"(expected {bshd.local_shape})", "pad the batch to a multiple of 2 * cp")
        return bshd
    offsets = offsets_of(packed_seq_params, "cu_seqlens_q_padded") or offsets_of(packed_seq_params, "cu_seqlens_q")
    if offsets is None:
        fail("packed_seq_params", "PackedSeqParams without cu_seqlens_q", "must give the packed offsets",
             "set cu_seqlens_q (and cu_seqlens_q_padded) as for attention")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    layout = getattr(packed_seq_params, "cp_partition_mode", None) or "zigzag"
    plan = ShardPlan.build(lengths, cp_size=cp_size, layout=layout)
    if list(plan.padded_seqlens_py) != lengths:
        fail("packed_seq_params", f"cu_seqlens {offsets[:8]}{' ...' if len(offsets) > 8 else ''}",
             f"every sequence must already be padded for cp = {cp_size} under the {layout} layout "
             f"(multiples of {plan.alignment})", "pass the padded offsets (cu_seqlens_q_padded), as attention uses")
    if math.prod(labels_shape) != plan.local_len:
        fail("labels", f"tensor of shape {labels_shape}", f"must hold this rank's {plan.local_len} rows "
             f"(cu_seqlens total {offsets[-1]} / cp {cp_size})", "pass the rank's sharded labels, e.g. [1, L]")
    return plan


def process_mtp_loss(
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    output_layer: Callable[..., Any],
    output_weight: torch.Tensor | None,
    runtime_gather_output: bool | None,
    is_training: bool,
    compute_language_model_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: Any,
    cp_group: Any = None,
    tp_group: Any = None,
    packed_seq_params: Any = None,
    scale_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    input_ids: torch.Tensor | None = None,
    sequence_roll_context: Any = None,
    *,
    counts: Counts | str = Counts.GLOBAL,
) -> torch.Tensor:
    """Drop-in for megatron-core 0.19's ``process_mtp_loss``, exact at every ``cp`` and layout.

    Same arguments and result: ``hidden_states`` ``[(1 + N) s, b, h]`` (``N =
    config.mtp_num_layers``), labels / loss mask / input ids ``[b, s]`` (``b = 1`` for packed THD),
    the first chunk returned with every depth's loss gradient attached. ``config`` needs
    ``mtp_num_layers``, ``mtp_loss_scaling_factor``, ``calculate_per_token_loss`` and optionally
    ``mtp_detach_heads``. Differences from Megatron's, all at ``cp > 1`` only: token counts are
    summed over ``cp_group`` (``counts="local"`` keeps Megatron's per-rank counts), the layout comes
    from ``packed_seq_params.cp_partition_mode`` (so contiguous is shifted right), and labels and
    masks of all depths cross ranks in one collective. The gradient is attached through Megatron's
    ``MTPLossAutoScaler`` when megatron-core imports (its scale applies), else cpshard's.

    ``sequence_roll_context`` (Megatron-LM dev, which its GPT and hybrid models pass): dev's
    per-micro-batch state for rolling contiguous packed CP rows, built from ``packed_seq_params``
    and ``cp_group`` (sequence boundaries, neighbour ranks, optionally prefetched successor rows).
    Accepted and not read: the plan built here from the same two arguments holds the same
    boundaries for every layout, and the labels of all depths cross ranks in cpshard's one
    collective, so the result is the same with or without it (``tests/test_mtp.py``).

    Where Megatron-LM dev changed the contract, the drop-in follows the installed Megatron: with
    ``config.cross_entropy_loss_fusion`` and ``cross_entropy_fusion_impl == "linear"``, dev (and the
    drop-in) take each depth's per-token loss from ``output_layer(..., output_cross_entropy_loss=True,
    labels=...)`` and build no logits (``scale_logits_fn`` unused); its tracker takes loss sums and
    token counts, and acceptance counts only where logits exist (``_tracker_logger``).

    On the CPU without Megatron's parallel state initialized, pass ``is_training=False``: training
    mode logs each depth through Megatron's tracker, which reads the data-parallel group.
    """
    num_depths = int(config.mtp_num_layers)
    if labels is None and input_ids is None:
        return torch.chunk(hidden_states, 1 + num_depths, dim=0)[0]
    like = labels if labels is not None else input_ids
    assert like is not None
    cp_size = _group_size(cp_group)
    try:
        plan = plan_for_mtp(tuple(like.shape), cp_size, packed_seq_params)
    except (ValueError, TypeError) as exc:
        if cp_size > 1 and checks_enabled():  # no plan here: every CP rank raises, not this one alone
            agree(None, cp_group, exc, {})
        raise
    if getattr(config, "mtp_detach_heads", False):
        weight = output_weight if output_weight is not None else getattr(output_layer, "weight")  # noqa: B009
        output_weight = weight.detach()

    shape = tuple(like.shape)
    mod, _ = megatron_mtp_module()
    fused = fuses_linear_cross_entropy(mod, config)
    last: dict[str, torch.Tensor] = {}  # each depth's per-token loss, for the tracker's loss sum (dev)

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:
        if fused:  # the head computes the loss from hidden states and labels itself: no logits
            return hidden
        logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=runtime_gather_output)
        return scale_logits_fn(logits) if scale_logits_fn is not None else logits

    def loss_of(lab: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if fused:
            loss = output_layer(logits, weight=output_weight, runtime_gather_output=runtime_gather_output,
                                output_cross_entropy_loss=True, labels=lab.reshape(shape))
        else:
            loss = compute_language_model_loss(lab.reshape(shape), logits)
        last["loss"] = loss
        return loss

    autoscaler = mod.MTPLossAutoScaler.apply if mod is not None else MtpLossAutoScaler.apply
    log_fn = _tracker_logger(mod, config, shape, output_layer, runtime_gather_output, tp_group, fused, last) \
        if is_training and mod is not None else None
    result = mtp_loss(
        hidden_states, labels, loss_mask, plan, cp_group if cp_size > 1 else None,
        output_layer=logits_of,
        loss_fn=loss_of,
        num_depths=num_depths,
        scaling_factor=config.mtp_loss_scaling_factor,
        normalization=Normalization.PER_TOKEN if config.calculate_per_token_loss else Normalization.MEAN,
        counts=counts,
        input_ids=input_ids,
        autoscaler=autoscaler,
        log_fn=log_fn,
    )
    return result.hidden


def fuses_linear_cross_entropy(mod: Any, config: Any) -> bool:
    """Whether the installed Megatron's ``process_mtp_loss`` takes each depth's loss from the output
    layer (``output_cross_entropy_loss=True``, no logits) under this config: Megatron-LM dev does with
    ``cross_entropy_loss_fusion`` and ``cross_entropy_fusion_impl == "linear"``; 0.19 and main always
    build logits. Read from its source, once per module."""
    if not (getattr(config, "cross_entropy_loss_fusion", False)
            and getattr(config, "cross_entropy_fusion_impl", None) == "linear"):
        return False
    fn = getattr(mod, "process_mtp_loss", None)
    if fn is None:
        return False
    if fn not in _FUSES:
        try:
            _FUSES[fn] = "output_cross_entropy_loss=True" in inspect.getsource(fn)
        except (OSError, TypeError):  # no source: the releases' behaviour
            _FUSES[fn] = False
    return _FUSES[fn]


_FUSES: dict[Any, bool] = {}


def _tracker_logger(mod: Any, config: Any, shape: tuple[int, ...], output_layer: Any, runtime_gather_output: Any,
                    tp_group: Any, fused: bool, last: dict[str, torch.Tensor]) -> Callable[..., None]:
    """Log each depth through Megatron's ``MTPLossLoggingHelper``, as the installed version's own does.

    - Megatron-LM dev: ``save_loss_to_tracker(loss_sum, num_tokens, ...)`` with this rank's masked loss
      sum and token count, and acceptance counts only where logits exist (not under fused linear cross
      entropy) and ``should_collect_acceptance()`` says a consumer wants them;
    - 0.19 and main: ``save_metrics_to_tracker`` (the depth's loss, acceptance counts);
    - older: ``save_loss_to_tracker(loss, ...)``.
    """
    helper = mod.MTPLossLoggingHelper
    parallel_state = import_megatron("parallel_state")
    acceptance = getattr(mod, "_compute_mtp_acceptance_counts", None)
    num_depths = int(config.mtp_num_layers)
    saver = getattr(helper, "save_loss_to_tracker", None)
    sums_and_counts = saver is not None and "num_tokens" in inspect.signature(saver).parameters
    wants = getattr(helper, "should_collect_acceptance", lambda: True)

    def log(depth: int, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, loss: torch.Tensor) -> None:
        avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if sums_and_counts:
            correct = total = None
            if acceptance is not None and not fused and wants():
                correct, total = acceptance(logits, labels.reshape(shape), mask.reshape(shape), output_layer,
                                            runtime_gather_output, tp_group)
            loss_sum = masked_rows(last["loss"].detach().reshape(mask.shape), mask).sum()
            helper.save_loss_to_tracker(loss_sum, mask.sum(), depth, num_depths, correct=correct, total=total,
                                        avg_group=avg_group,
                                        calculate_per_token_loss=bool(config.calculate_per_token_loss))
        elif hasattr(helper, "save_metrics_to_tracker") and acceptance is not None:
            correct, total = acceptance(logits, labels.reshape(shape), mask.reshape(shape), output_layer,
                                        runtime_gather_output, tp_group)
            helper.save_metrics_to_tracker(loss, correct, total, depth, num_depths, avg_group=avg_group)
        else:
            helper.save_loss_to_tracker(loss, depth, num_depths, avg_group=avg_group)
    return log


@dataclass(frozen=True)
class MtpLossImpl:
    """The MTP loss implementation to call, with ``process_mtp_loss``'s signature, and why."""

    fn: Callable[..., torch.Tensor]
    source: str  #: "megatron" or "cpshard"
    reason: str


def mtp_loss_impl(cp_size: int = 1) -> MtpLossImpl:
    """Which ``process_mtp_loss`` to use at ``cp_size``: Megatron's own only where it provably equals cpshard's.

    That is megatron-core with ``process_mtp_loss`` and the packed-sequence roll (0.19) at ``cp =
    1``, where the tests show both equal in the result and every gradient. Everywhere else
    cpshard's: at ``cp > 1`` Megatron normalizes by per-rank counts and its packed roll assumes
    zigzag; 0.16 has no ``process_mtp_loss``; 0.14/0.15 roll the whole packed buffer across
    sequences. Logs the choice once per distinct outcome (logger ``cpshard.megatron``).
    """
    mod, why_not = megatron_mtp_module()
    version = megatron_version()
    if mod is None:
        choice = MtpLossImpl(process_mtp_loss, "cpshard", f"megatron-core is not importable ({why_not})")
    elif not hasattr(mod, "process_mtp_loss"):
        choice = MtpLossImpl(process_mtp_loss, "cpshard", f"megatron-core {version} has no process_mtp_loss")
    elif not hasattr(mod, "_roll_tensor_packed_seq"):
        choice = MtpLossImpl(process_mtp_loss, "cpshard",
                             f"megatron-core {version} has no packed-sequence roll (it rolls across sequences)")
    elif cp_size > 1:
        choice = MtpLossImpl(process_mtp_loss, "cpshard", f"cp = {cp_size} > 1: megatron-core {version} normalizes "
                             "by per-rank token counts and its packed roll assumes the zigzag layout")
    else:
        choice = MtpLossImpl(mod.process_mtp_loss, "megatron", f"cp = 1 and megatron-core {version} has "
                             "process_mtp_loss with the packed-sequence roll: equal to cpshard's")
    key = (choice.source, choice.reason)
    if key not in _logged:
        _logged.add(key)
        _log.info("MTP loss: using %s's process_mtp_loss (%s)", choice.source, choice.reason)
    return choice
