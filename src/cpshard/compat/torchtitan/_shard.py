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
"""

from __future__ import annotations

from typing import Any

import torch

from cpshard.base.errors import fail
from cpshard.base.layout import Layout
from cpshard.compat.torch_cp import load_balancer, plans_from_positions, torch_names
from cpshard.plan.values import ShardPlan

__all__ = ["KINDS", "batch_plans", "shard"]

#: torchtitan's ``load_balancer_type`` names cpshard answers -> the layout each gives
KINDS: dict[str, Layout] = {"cpshard": Layout.CONTIGUOUS, "cpshard_zigzag": Layout.ZIGZAG}
MASK_Q_DIM = 2  # a BlockMask is (B, H, Q, KV): torch shards its queries


def batch_plans(kind: str, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor | None, input_seq_dim: int,
                cp_size: int) -> list[ShardPlan]:
    """One plan per batch row of ``inputs[0]`` (``S`` rows along ``input_seq_dim``), from ``positions``
    ``(B, S)`` (or ``(1, S)``: one plan for every row) or, without positions, one document a row."""
    if kind not in KINDS:
        fail("load_balancer_type", repr(kind), f"is not one of cpshard's ({', '.join(map(repr, KINDS))})",
             "pass 'cpshard' or 'cpshard_zigzag', or let torchtitan handle its own types")
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        fail("inputs", type(inputs).__name__, "must be a non-empty tuple of tensors", "pass (inputs, labels, ...)",
             kind=TypeError)
    first = inputs[0]
    S = first.size(input_seq_dim)
    batch = first.size(0) if input_seq_dim > 0 else 1
    if positions is None:
        positions = torch.arange(S).expand(batch, S)
    elif positions.dim() != 2 or positions.shape[1] != S or positions.shape[0] not in (1, batch):
        fail("positions", f"tensor of shape {tuple(positions.shape)}", f"must be (B, S) = ({batch}, {S}) or (1, {S}) "
             "to match the inputs", "pass the batch's position ids (extra_kwargs['positions'])")
    return plans_from_positions(positions, cp_size=cp_size, layout=KINDS[kind])


def shard(cp_mesh: Any, inputs: tuple[torch.Tensor, ...], attention_masks: Any, kind: str, input_seq_dim: int,
          positions: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], Any]:
    """torchtitan's ``cp_shard`` contract for cpshard's ``kind``: ``(sharded inputs, sharded masks)``,
    the masks a ``BlockMask``, a dict of them, or None as given. Every check runs before anything is
    sharded; sharding itself communicates nothing (each rank keeps its piece)."""
    masks: list[Any] = []
    if attention_masks is not None:
        masks = list(attention_masks.values()) if isinstance(attention_masks, dict) else [attention_masks]
        from torch.nn.attention.flex_attention import BlockMask

        for mask in masks:
            if not isinstance(mask, BlockMask):
                fail("attention_masks", type(mask).__name__, "must be a BlockMask or a dict of BlockMasks: torch's "
                     "context parallelism rewrites only flex attention's block masks",
                     "build the masks with create_block_mask (torchtitan's FlexAttention models do)", kind=TypeError)
    plans = batch_plans(kind, inputs, positions, input_seq_dim, cp_mesh.size(0))
    balancer = load_balancer(plans, mesh=cp_mesh)  # on the mesh's device type, its size checked
    shard_buffers = torch_names()._context_parallel_shard
    out = tuple(shard_buffers(mesh=cp_mesh, buffers=list(inputs), seq_dims=(input_seq_dim,) * len(inputs),
                              load_balancer=balancer))
    if not masks:
        return out, attention_masks
    sharded = shard_buffers(mesh=cp_mesh, buffers=masks, seq_dims=(MASK_Q_DIM,) * len(masks), load_balancer=balancer)
    if isinstance(attention_masks, dict):
        return out, dict(zip(attention_masks, sharded))
    return out, sharded[0]
