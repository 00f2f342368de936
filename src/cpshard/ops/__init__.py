"""Data movement by a plan, no communication: ``shard``, ``unshard``, ``shift``; padded batch <-> jagged."""

from cpshard.ops.sharding import shard, shift, unshard

__all__ = ["shard", "shift", "unshard"]
