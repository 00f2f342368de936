"""verl's ``rearrange_micro_batches`` (``verl/utils/seqlen_balancing.py``), packed by :func:`cpshard.pack`.

verl splits one DP rank's batch by **unpadded** token counts (Karmarkar-Karp over ``24576 s + s**2``);
after CP/TP padding a micro-batch can exceed ``max_token_len``, and the split is blind to where each CP
rank's attention work falls. This drop-in keeps verl's parameters and return structure (the
micro-batches, each ``index_select_tensor_dict(batch, indices)``, and the index lists, which
``get_reverse_idx(list(chain(*indices)))`` restores as in verl's ``restore_dynamic_batch``), and packs
with :func:`cpshard.pack` so that every micro-batch's **padded** rows fit ``max_token_len``.

Sources read (not copied): verl 0.9.1's ``verl/utils/seqlen_balancing.py`` (``rearrange_micro_batches``,
``get_reverse_idx``, ``restore_dynamic_batch``) and ``verl/utils/tensordict_utils.py``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding
from cpshard.compat.verl._layout import in_use
from cpshard.packing.pack import pack, plan_work
from cpshard.packing.problem import group_rows, make_problem
from cpshard.plan.values import ShardPlan

__all__ = ["rearrange_micro_batches"]

logger = logging.getLogger("cpshard.compat.verl")


def _lengths(batch: Any) -> list[int]:
    """Token counts per sample, read as verl reads them (nested ``input_ids``, else the attention mask:
    bool, integer or floating 0/1, ``(batch, seq)``)."""
    input_ids = batch["input_ids"]
    if isinstance(input_ids, torch.Tensor) and input_ids.is_nested:
        lens = input_ids.offsets().diff().tolist()  # type: ignore[attr-defined]
    else:
        mask = batch["attention_mask"]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            shown = f"tensor of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            fail("batch['attention_mask']", shown, "must be a 2-D (batch, sequence) tensor of 0/1",
                 "pass verl's padded batch, or input_ids as a jagged nested tensor", kind=TypeError)
        if mask.is_complex() or (mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all()):
            bad = mask[~((mask == 0) | (mask == 1))][:1].tolist() if not mask.is_complex() else [mask.dtype]
            fail("batch['attention_mask']", f"a {mask.dtype} mask holding {bad[0]}", "must hold only 0 and 1 (1 on "
                 "a sample's tokens)", "pass verl's attention mask (bool, integer or floating 0/1)")
        if mask.device.type == "cpu" and not mask.is_floating_point():  # NumPy counts a row's non-zeros many
            lens = np.count_nonzero(mask.numpy(), axis=1).tolist()  # times faster than torch sums them
        else:
            lens = (mask != 0).sum(dim=1).tolist()
    if not lens:
        fail("batch", "0 samples", "must hold at least one sample", "call it with a non-empty batch")
    return lens


def _select(batch: Any, indices: list[int]) -> Any:
    try:
        from verl.utils import tensordict_utils as tu
    except ImportError:  # without verl: TensorDict's own indexing (dense fields)
        return batch[torch.tensor(indices, dtype=torch.long)]
    return tu.index_select_tensor_dict(batch, indices)


def _dp_agree(count: int, units: int, failed: bool, dp_group: Any) -> tuple[int, int, bool]:
    """``(largest count, fewest samples or groups, whether a rank failed)`` over the DP group: one
    ``all_reduce(MAX)`` of three ints, verl's one collective, so that a rank that cannot take the agreed
    count makes every rank raise (verl 0.9.1 agrees on its limits the same way), not one hang."""
    from cpshard.distributed.sums import max_over

    got = max_over(torch.tensor([count, -units, int(failed)], dtype=torch.long), dp_group).tolist()
    return int(got[0]), -int(got[1]), bool(got[2])


def _oversized(lens: list[int], group: int, max_tokens: int, plan_kw: dict[str, Any]) -> set[int]:
    """The groups (``group`` consecutive samples) whose plan alone has more than ``max_tokens`` padded rows.

    verl checks only that ``max_token_len`` covers the longest sample, before padding, and places every
    group somewhere; the drop-in gives each such group a micro-batch of its own (the fewest rows it can
    have) and logs it, where :func:`cpshard.pack` refuses the batch."""
    prob = make_problem(lens, max_tokens, plan_kw["cp_size"], plan_kw["tp_size"], Layout.parse(plan_kw["layout"]),
                        Padding.parse(plan_kw["padding"]))
    rows = group_rows(prob, group)
    out = {int(k) for k in (rows > max_tokens).nonzero()[0]}
    for k in sorted(out)[:4]:
        logger.warning("cpshard.compat.verl.rearrange_micro_batches: samples %d..%d (%s tokens) pad to %d rows, "
                       "more than max_token_len=%d; they get a micro-batch of their own%s", k * group,
                       (k + 1) * group - 1, "+".join(map(str, lens[k * group:(k + 1) * group])), int(rows[k]),
                       max_tokens, f" (and {len(out) - 4} more groups)" if len(out) > 4 and k == sorted(out)[3] else "")
    return out


def _megatron_initialized() -> bool:
    """Whether Megatron's model-parallel state is initialized in this process (without importing
    Megatron: a process that never imported it runs no Megatron model parallelism)."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    probe = getattr(mpu, "model_parallel_is_initialized", None)
    return bool(probe()) if callable(probe) else False


def _parallel_sizes(cp_size: int | None, tp_size: int | None) -> tuple[int, int]:
    """``(cp, tp)``: the ones passed, the rest from Megatron's parallel state when it is initialized,
    else 1 (a verl FSDP engine: no Megatron CP or TP)."""
    if not _megatron_initialized():
        return (1 if cp_size is None else cp_size), (1 if tp_size is None else tp_size)
    from cpshard.megatron.state import parallel_context

    ctx = parallel_context(tp_size=tp_size, cp_size=cp_size, cp_rank=0, need_group=False)
    return ctx.cp_size, ctx.tp_size


def rearrange_micro_batches(
    batch: Any,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
    *,
    cp_size: int | None = None,
    tp_size: int | None = None,
    layout: Layout | str | None = None,
    padding: Padding | str = "aligned",
    reorder: str | None = None,
    seed: int = 0,
) -> tuple[list[Any], list[list[int]]]:
    """verl's ``rearrange_micro_batches``: ``(micro_batches, indices)``, every micro-batch's padded rows
    (all CP ranks together, as ``ShardPlan.build`` pads them) at most ``max_token_len``.

    ``indices[m]`` lists the samples of micro-batch ``m`` in the order ``micro_batches[m]`` holds them
    (under the contiguous layout, the buffer order :func:`cpshard.pack` chose; else ascending, as
    verl's); ``get_reverse_idx(list(itertools.chain(*indices)))`` restores the batch's order.
    ``use_dynamic_bsz_balance`` orders the micro-batches as verl does (by work, the lighter ones at both
    ends). ``cp_size`` / ``tp_size``: the plan's sizes; when not given, read from Megatron's parallel
    state if it is initialized, else 1 (verl's FSDP engines call this function too, through
    ``prepare_micro_batches``, and there no Megatron CP or TP pads a sequence: the budget is then
    verl's own, unpadded tokens); ``layout``, ``padding``, ``reorder``: the ones the micro-batches'
    plans are built with; ``layout=None`` (verl passes none): the layout in use (zigzag while
    cpshard is off; under the patch the override ``CPSHARD_LAYOUT``, else the model's inside verl's
    Megatron engine, else zigzag: :mod:`cpshard.compat.verl._layout`).

    The count: :func:`cpshard.pack`'s for this rank's lengths; with ``dp_group`` and
    ``same_micro_num_in_dp`` (``torch.distributed`` initialized) the largest over the group, in one
    ``all_reduce(MAX)`` of three integers (the count, the fewest samples, whether a rank failed), so
    that when a rank cannot take the agreed count, or raises anything before the agreement (its batch,
    its mask, its arguments), every rank raises (that rank its own error, the others a ``ValueError``
    naming the DP group) and none waits in a collective. ``force_group_size``: every that many consecutive
    samples share a micro-batch (verl's reward-model pairs; :func:`cpshard.pack`'s ``group_size``), and
    the batch must hold whole groups (verl asserts it; this raises a ``ValueError`` naming it).
    """
    from cpshard.distributed.groups import initialized

    agree = bool(same_micro_num_in_dp) and dp_group is not None and initialized()
    joined: list[bool] = []  # set as this rank enters the count agreement
    try:
        return _rearrange(batch, max_token_len, dp_group, num_batches_divided_by, min_num_micro_batch,
                          use_dynamic_bsz_balance, force_group_size, cp_size, tp_size, layout, padding, reorder,
                          seed, agree, joined)
    except Exception:  # any error before the count agreement: the peers hear it there, none waits
        if agree and not joined:
            try:
                _dp_agree(0, 0, True, dp_group)
            except Exception:  # noqa: BLE001 - the group itself is unusable: this rank's error is the one to see
                pass
        raise


def _rearrange(batch: Any, max_token_len: Any, dp_group: Any, num_batches_divided_by: Any, min_num_micro_batch: Any,
               use_dynamic_bsz_balance: Any, force_group_size: Any, cp_size: Any, tp_size: Any, layout: Any,
               padding: Any, reorder: Any, seed: Any, agree: bool,
               joined: list[bool]) -> tuple[list[Any], list[list[int]]]:
    max_token_len = check_int("max_token_len", max_token_len, minimum=1)
    force_group_size = check_int("force_group_size", force_group_size, minimum=1)
    seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)
    if cp_size is None or tp_size is None:
        cp_size, tp_size = _parallel_sizes(cp_size, tp_size)
    if layout is None:
        layout = in_use("rearrange_micro_batches", cp_size)
    lens = _lengths(batch)
    if len(lens) % force_group_size:
        fail("force_group_size", force_group_size, f"must divide the batch size ({len(lens)}), as verl asserts",
             "pass a batch of whole groups")
    g = force_group_size
    plan_kw: dict[str, Any] = {"cp_size": cp_size, "tp_size": tp_size, "layout": layout, "padding": padding,
                               "reorder": reorder}
    alone = _oversized(lens, g, max_token_len, plan_kw)
    rest = [i for i in range(len(lens)) if i // g not in alone]
    kw: dict[str, Any] = {"max_tokens": max_token_len, "group_size": g, "seed": seed, **plan_kw}
    by = 1 if num_batches_divided_by is None else check_int("num_batches_divided_by", num_batches_divided_by,
                                                            minimum=1)
    least = 1 if min_num_micro_batch is None else check_int("min_num_micro_batch", min_num_micro_batch, minimum=1)

    def packed(total: int) -> tuple[list[list[int]], list[int]]:
        """Micro-batches (batch indices) and their works: at least ``total`` in all, a multiple of ``by``."""
        if not rest:  # only groups that each take a micro-batch of their own: that many, no other count
            if total > len(alone) or len(alone) % by:
                fail("seqlens", f"{len(alone)} " + ("samples" if g == 1 else f"groups of {g}") + " over the budget",
                     f"cannot fill {max(total, -(-len(alone) // by) * by)} micro-batches (at least {total}, a "
                     f"multiple of num_batches_divided_by={by}), and each takes a micro-batch of its own",
                     "pass a smaller min_num_micro_batch or num_batches_divided_by, or a larger max_token_len")
            return [], []
        want = max(1, total - len(alone))
        aligned = len(alone) % by == 0  # then pack's own divisible_by keeps the total a multiple of by
        packing = pack([lens[i] for i in rest], min_micro_batches=want, divisible_by=by if aligned else None, **kw)
        count = packing.num_micro_batches[0]
        if (count + len(alone)) % by:  # the alone micro-batches offset the count: ask for the next multiple
            packing = pack([lens[i] for i in rest], min_micro_batches=-(-(count + len(alone)) // by) * by
                           - len(alone), **kw)
        return ([[rest[j] for j in mb] for mb in packing.micro_batches[0]],
                [sum(w) for w in packing.work[0]])

    indices, work = packed(least)  # an error here reaches the peers through the agreement (the caller)
    if agree:
        joined.append(True)
        count, fewest, failed = _dp_agree(len(indices) + len(alone), len(lens) // g, False, dp_group)
        if failed:
            fail("dp_group", "a DP group", "another DP rank could not pack its batch (its own error names why)",
                 "fix that rank's batch; every rank of the group raises so that none waits in a collective")
        if count > fewest:
            fail("dp_group", "a DP group", f"agreed on {count} micro-batches a rank (same_micro_num_in_dp), but a "
                 f"rank holds only {fewest} " + ("samples" if g == 1 else f"groups of {g}") + ", and a micro-batch "
                 "holds at least one", "pass same_micro_num_in_dp=False, a larger max_token_len, or a smaller "
                 "min_num_micro_batch / num_batches_divided_by")
        if count != len(indices) + len(alone):
            indices, work = packed(count)
    for k in sorted(alone):  # a group (or sequence) over the budget alone: in a micro-batch of its own
        ids = list(range(k * g, (k + 1) * g))
        plan = ShardPlan.build([lens[i] for i in ids], **plan_kw)
        indices.append(ids)
        work.append(sum(plan_work(plan)))
    if use_dynamic_bsz_balance:
        order = sorted(range(len(indices)), key=lambda m: (work[m], indices[m][0]), reverse=True)
        order = order[::2][::-1] + order[1::2]  # verl's rule: the lighter micro-batches at both ends
        indices = [indices[m] for m in order]
    return [_select(batch, idx) for idx in indices], indices
