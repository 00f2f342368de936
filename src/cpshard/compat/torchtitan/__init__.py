"""cpshard as torchtitan's context-parallel load balancer: ``load_balancer_type="cpshard"``.

torchtitan 0.3.0 shards every context-parallel batch with ``cp_shard`` (through
``prepare_context_parallel_input``), choosing torch's balancer by the config's
``parallelism.context_parallel_load_balancer``: ``"headtail"`` (blind to the documents packed in a
row), ``"ptrr"`` (flex attention's block mask, 128-token blocks) or None. Switched on
(:mod:`cpshard.compat.torchtitan.enable`), it also takes:

- ``"cpshard"``: the contiguous layout with cpshard's balanced order, from the batch's position
  ids; nothing is padded, so a row of ``seq_len`` tokens stays ``seq_len``;
- ``"cpshard_zigzag"``: per-document zigzag on any documents: each cut into ``2 * cp`` chunks one
  row apart at most, every rank ``seq_len / cp`` rows, nothing padded (SPEC.md, "Zigzag without
  padding").

Inputs, labels, positions and every ``BlockMask`` of the batch go through one
:func:`cpshard.compat.torch_cp.load_balancer`; ``prepare_context_parallel_input`` passes the batch's
positions to it explicitly. Without positions (a plain ``cp_shard`` call, such as Flux's) each batch
row is one document, with a :class:`NoPositionsWarning`. Other balancer types go to torchtitan
unchanged. The ``cpshard.compat.torchtitan`` logger says at INFO when the balancer first runs, and at
DEBUG each batch's causal-work balance (max/mean over the ranks) beside torch's head-tail's
(:func:`work_balance`).

The package, one idea a module: ``_titan`` (torchtitan's names, checked against 0.3.0), ``_shard``
(the sharding for cpshard's types), ``_patch`` (:func:`patch`, :class:`TitanPatch`, :func:`activate`),
``enable`` (the import that switches it on, and the config's override), ``__main__`` (``python -m
cpshard.compat.torchtitan``: what is bound here). docs/torch_cp.md, "torchtitan".

Sources read (not copied): torchtitan 0.3.0's ``torchtitan/distributed/context_parallel/api.py``,
``torchtitan/trainer.py``, ``torchtitan/components/validate.py``, ``torchtitan/config/configs.py``,
``torchtitan/config/override.py``, ``torchtitan/models/common/attention.py``.
"""

from __future__ import annotations

from cpshard.compat.torchtitan._patch import NoPositionsWarning, TitanPatch, activate, active, patch, process_patch
from cpshard.compat.torchtitan._shard import KINDS, batch_plans, work_balance
from cpshard.compat.torchtitan._titan import TESTED_TORCHTITAN

__all__ = ["KINDS", "TESTED_TORCHTITAN", "NoPositionsWarning", "TitanPatch", "activate", "active", "batch_plans",
           "patch", "process_patch", "work_balance"]
