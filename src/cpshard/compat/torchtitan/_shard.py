"""torchtitan's ``cp_shard`` for cpshard's balancer types: one balancer from the batch's documents
shards the inputs, labels, positions and every ``BlockMask`` of the batch through torch's own path.

- ``"cpshard"``: the contiguous layout with cpshard's balanced order, no padding (a row of ``S``
  tokens stays ``S``; ``S`` must divide by ``cp``, as for torch's balancers);
- ``"cpshard_zigzag"``: per-document zigzag (each document cut into ``2 * cp`` chunks whose sizes
  differ by at most one row, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``, every rank
  ``S / cp`` rows: ``padding="none"``, SPEC.md "Zigzag without padding"): any documents on a full row.

The documents come from the position ids (0 starts a document: torchtitan's per-document positions;
sequential positions are one document a row). Where a caller gives none (a plain ``cp_shard`` call,
such as Flux's), each batch row is one document.

Every refusal of a batch (its positions, its masks, the mesh's size) happens inside the load
balancer's agreement (``plans`` given as a function: :func:`cpshard.compat.torch_cp.load_balancer`),
so with checks on every rank raises, not only the one whose batch was bad. A ``BlockMask`` of batch
size 1 over rows whose orders differ (each row its own documents) is widened to one row per batch
row before torch rewrites it, each row through its own order: a broadcast mask keeps its meaning
(every row the mask's row 0), which torch's rewrite alone would give every row through row 0's order.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from cpshard.base.errors import fail
from cpshard.base.layout import Layout
from cpshard.compat.torch_cp import BLOCK_SIZE, load_balancer, plans_from_positions, rearrange_indices, torch_names
from cpshard.plan.values import ShardPlan

__all__ = ["KINDS", "batch_plans", "shard", "work_balance"]

logger = logging.getLogger("cpshard.compat.torchtitan")
#: torchtitan's ``load_balancer_type`` names cpshard answers -> the layout each gives
KINDS: dict[str, Layout] = {"cpshard": Layout.CONTIGUOUS, "cpshard_zigzag": Layout.ZIGZAG}
MASK_Q_DIM = 2  # a BlockMask is (B, H, Q, KV): torch shards its queries
#: a BlockMask's tensors whose first dimension is the batch (what widening a B = 1 mask expands)
_MASK_BATCH_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")
_LOGGED: list[bool] = [False]  # the INFO line of the first batch, once a process


def _check_inputs(inputs: Any, names: tuple[str, ...]) -> None:
    if not isinstance(inputs, (tuple, list)) or not inputs:
        fail("inputs", type(inputs).__name__, "must be a non-empty tuple of tensors", "pass (inputs, labels, ...)",
             kind=TypeError)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            name = names[i] if i < len(names) else f"inputs[{i}]"
            fail(name, "None" if t is None else type(t).__name__, "must be a tensor of the batch (B, S, ...)",
                 "pass the batch's position ids in extra_kwargs['positions'] (torchtitan's post_dataloading_process "
                 "sets them)" if "positions" in name else "pass a tensor per input", kind=TypeError)


def batch_plans(kind: str, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor | None, input_seq_dim: int,
                cp_size: int, names: tuple[str, ...] = ()) -> list[ShardPlan]:
    """One plan per batch row of ``inputs[0]`` (``S`` rows along ``input_seq_dim``), from ``positions``
    ``(B, S)`` (or ``(1, S)``: one plan for every row) or, without positions, one document a row.
    ``names``: what the caller calls each input, for its errors."""
    if kind not in KINDS:
        fail("load_balancer_type", repr(kind), f"is not one of cpshard's ({', '.join(map(repr, KINDS))})",
             "pass 'cpshard' or 'cpshard_zigzag', or let torchtitan handle its own types")
    _check_inputs(inputs, names)
    first = inputs[0]
    if not 0 <= input_seq_dim < first.dim():
        fail("input_seq_dim", input_seq_dim, f"must name a dimension of the {first.dim()}-dimensional first input "
             f"(shape {tuple(first.shape)}), counted from 0", "pass the dimension that holds the sequence (1 for "
             "(B, S, ...), torchtitan's)")
    S = first.size(input_seq_dim)
    batch = first.size(0) if input_seq_dim > 0 else 1
    if positions is None:
        positions = torch.arange(S).expand(batch, S)
    elif not isinstance(positions, torch.Tensor):
        fail("positions", type(positions).__name__, "must be the batch's position ids as a (B, S) integer tensor",
             "pass torch.as_tensor(positions)", kind=TypeError)
    elif positions.dim() != 2 or positions.shape[1] != S or positions.shape[0] not in (1, batch):
        fail("positions", f"tensor of shape {tuple(positions.shape)}", f"must be (B, S) = ({batch}, {S}) or (1, {S}) "
             "to match the inputs", "pass the batch's position ids (extra_kwargs['positions'])")
    rows = positions.shape[0]  # the rows of the indices torch shards every input by: 1 broadcasts
    for i, t in enumerate(inputs[1:], 1):  # torch shards every input by the same (rows, S) indices
        if t.dim() <= input_seq_dim or t.size(input_seq_dim) != S or rows > 1 and t.size(0) != rows:
            name = names[i] if i < len(names) else f"inputs[{i}]"
            fail(name, f"tensor of shape {tuple(t.shape)}", f"must have S={S} rows along dimension {input_seq_dim}"
                 f"{f' and {rows} batch rows' if rows > 1 else ''} (first input: shape {tuple(first.shape)}): every "
                 "input is sharded by the same indices", "pass inputs, labels and positions of one batch, each "
                 "(B, S, ...)")
    return plans_from_positions(positions, cp_size=cp_size, layout=KINDS[kind])


def _masks(attention_masks: Any) -> list[tuple[str, Any]]:
    """``(name, BlockMask)`` of each mask given (None: none), checked for type."""
    if attention_masks is None:
        return []
    from torch.nn.attention.flex_attention import BlockMask

    named = ([(f"attention_masks[{key!r}]", m) for key, m in attention_masks.items()]
             if isinstance(attention_masks, dict) else [("attention_masks", attention_masks)])
    for name, mask in named:
        if not isinstance(mask, BlockMask):
            fail(name, type(mask).__name__, "must be a BlockMask or a dict of BlockMasks: torch's context parallelism "
                 "rewrites only flex attention's block masks", "build the masks with create_block_mask (torchtitan's "
                 "FlexAttention models do)", kind=TypeError)
    return named


def _fit_mask(name: str, mask: Any, plans: list[ShardPlan], cp_size: int) -> Any:
    """``mask`` as torch's CP rewrite needs it for these rows (checked): a ``B = 1`` mask over rows of
    different orders widened to ``B`` rows, each calling the mask's ``mask_mod`` as row 0."""
    S = plans[0].total_len
    if tuple(mask.seq_lengths) != (S, S):
        fail(name, f"a BlockMask of seq_lengths {tuple(mask.seq_lengths)}", f"must cover the batch's rows: ({S}, {S})",
             "build the mask for the batch's sequence length")
    if S % (cp_size * BLOCK_SIZE):
        fail(name, f"a BlockMask over rows of S={S}", f"torch's CP block mask needs S to divide by cp * {BLOCK_SIZE} "
             f"= {cp_size * BLOCK_SIZE} (its rewrite cuts each rank's rows into {BLOCK_SIZE}-row blocks)",
             f"make the rows cpshard.compat.torch_cp.block_mask_len(S, {cp_size}) long (torchtitan: a seq_len that "
             f"divides by {cp_size * BLOCK_SIZE})")
    rows, batch = mask.kv_num_blocks.shape[0], len(plans)
    if rows == batch:
        return mask
    if rows != 1:
        fail(name, f"a BlockMask of batch size {rows}", f"must have batch size {batch} (one per row) or 1 (broadcast)",
             "build the mask with B = the batch size")
    order = rearrange_indices(plans)
    if bool((order == order[:1]).all()):  # every row in one order: torch's rewrite of row 0 serves them all
        return mask
    wide = copy.copy(mask)
    for field in _MASK_BATCH_FIELDS:
        t = getattr(mask, field, None)
        if isinstance(t, torch.Tensor):
            setattr(wide, field, t.expand(batch, *t.shape[1:]))
    wide.mask_mod = _as_row_zero(mask.mask_mod)
    return wide


def _as_row_zero(mask_mod: Any) -> Any:
    def row_zero(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mask_mod(torch.zeros_like(b), h, q_idx, kv_idx)  # a broadcast mask: every row is its row 0

    return row_zero


def work_balance(positions: torch.Tensor, order: torch.Tensor, cp_size: int) -> tuple[float, float | None]:
    """``(cpshard's, head-tail's)`` causal-work balance of a batch, max over mean of the ranks' work:
    a token at position ``p`` of its document attends to ``p + 1`` keys; rank ``r`` holds the rows
    ``order[:, r L:(r + 1) L]`` (cpshard), or chunks ``r`` and ``2 cp - 1 - r`` of every row (torch's
    head-tail, None where ``S`` does not divide by ``2 cp``)."""
    cost = positions.detach().to("cpu", torch.int64).expand(order.shape[0], -1) + 1
    ours = cost.gather(1, order).view(order.shape[0], cp_size, -1).sum((0, 2)).double()
    S = cost.shape[1]
    head_tail = None
    if S % (2 * cp_size) == 0:
        chunks = cost.view(cost.shape[0], 2 * cp_size, -1).sum((0, 2)).double()
        ht = chunks[:cp_size] + chunks.flip(0)[:cp_size]
        head_tail = float(ht.max() / ht.mean())
    return float(ours.max() / ours.mean()), head_tail


def shard(cp_mesh: Any, inputs: tuple[torch.Tensor, ...], attention_masks: Any, kind: str, input_seq_dim: int,
          positions: Any, names: tuple[str, ...] = ()) -> tuple[tuple[torch.Tensor, ...], Any]:
    """torchtitan's ``cp_shard`` contract for cpshard's ``kind``: ``(sharded inputs, sharded masks)``,
    the masks a ``BlockMask``, a dict of them, or None as given. Every check runs inside the
    balancer's agreement, before anything is sharded; sharding itself communicates nothing (each rank
    keeps its piece). ``names``: what the caller calls each input, for its errors."""
    found: dict[str, Any] = {}

    def plans() -> list[ShardPlan]:  # run by load_balancer inside its agreement: a refusal reaches every rank
        cp_size = cp_mesh.size()
        masks = _masks(attention_masks)
        found["plans"] = batch_plans(kind, inputs, positions, input_seq_dim, cp_size, names)
        found["masks"] = [_fit_mask(name, m, found["plans"], cp_size) for name, m in masks]
        return found["plans"]

    balancer = load_balancer(plans, mesh=cp_mesh)  # on the mesh's device type, its size checked
    _log(kind, found["plans"], positions, cp_mesh.size())
    shard_buffers = torch_names()._context_parallel_shard
    out = tuple(shard_buffers(mesh=cp_mesh, buffers=list(inputs), seq_dims=(input_seq_dim,) * len(inputs),
                              load_balancer=balancer))
    masks = found["masks"]
    if not masks:
        return out, attention_masks
    sharded = shard_buffers(mesh=cp_mesh, buffers=masks, seq_dims=(MASK_Q_DIM,) * len(masks), load_balancer=balancer)
    if isinstance(attention_masks, dict):
        return out, dict(zip(attention_masks, sharded))
    return out, sharded[0]


def _log(kind: str, plans: list[ShardPlan], positions: Any, cp_size: int) -> None:
    """One INFO line the first time a process shards a batch; a DEBUG line a batch with its balance."""
    B, S = len(plans), plans[0].total_len
    if not _LOGGED[0]:
        _LOGGED[0] = True
        logger.info("cpshard.compat.torchtitan: load_balancer_type %r shards the batches (cp %d, first batch: %d "
                    "rows of %d tokens, %d documents%s); DEBUG on this logger prints each batch's balance", kind,
                    cp_size, B, S, sum(p.num_seqs for p in plans),
                    "" if positions is not None else ", one a row: no positions given")
    if logger.isEnabledFor(logging.DEBUG):
        pos = positions if isinstance(positions, torch.Tensor) else torch.arange(S).expand(B, S)
        ours, head_tail = work_balance(pos, rearrange_indices(plans), cp_size)
        logger.debug("cpshard.compat.torchtitan: batch of %d rows x %d tokens, %d documents: causal work max/mean "
                     "%.3f (%s); torch's head-tail would give %s", B, S, sum(p.num_seqs for p in plans), ours, kind,
                     "n/a (S does not divide by 2 * cp)" if head_tail is None else f"{head_tail:.3f}")
