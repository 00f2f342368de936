"""cpshard for Hugging Face ``transformers`` models (5.x, tested on 5.10.4): sequence parallelism of packed
documents over ``R`` ring ranks times ``U`` Ulysses ranks, with each layer's own mask and an exact loss.

Importing this module registers ``attn_implementation="cpshard"`` with transformers. Then, on every rank::

    sp = SequenceParallel(cp_group, ulysses_group)           # R x U ranks hold one micro-batch
    batch = sp.shard(input_ids, position_ids, labels)       # the packed row (1, T), the same on every rank
    with sp.attend(batch):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    sp.loss(logits, batch).backward()                       # then average gradients over the R x U ranks

- :class:`SequenceParallel`: the two groups (or a ``DeviceMesh``), the layout and the kernel;
  ``shard``, ``attend``, ``loss``, ``restore``.
- :class:`SequenceBatch`: this rank's ``input_ids``, ``position_ids``, shifted ``labels``, the ``plan``
  and ``restore``.
- :func:`document_lengths`: the documents of a packed row, from its position ids; :func:`shard_row`: a
  rank's batch without process groups (a data loader's workers).
- :func:`varlen_metadata` (from ``cpshard.plan.varlen``, on first use): flash-attn's varlen arguments of
  a ring rank, for users of ring-flash-attn's llama3 path.

The package, one idea a module: ``_batch`` (the two-axis layout, Note [The two-axis layout]),
``_attention`` (one layer's attention, Note [One layer's attention under R x U ranks]), ``_parallel``
(``SequenceParallel``, Note [The loss over R x U ranks]), ``_transformers`` (transformers' interfaces).
docs/hf.md shows a whole program. Read (not copied): transformers 5.10.4's
``integrations/sdpa_attention.py``, ``masking_utils.py``, ``modeling_utils.py``; verl's
``verl/utils/ulysses.py`` and ``verl/models/transformers/monkey_patch.py`` (the Ulysses exchange of an HF
model); DeepSpeed-Ulysses (arXiv:2309.14509).
"""

from __future__ import annotations

from typing import Any

from cpshard.compat.hf._attention import KERNELS, attention_forward
from cpshard.compat.hf._batch import SequenceBatch, document_lengths, shard_row
from cpshard.compat.hf._parallel import SequenceParallel
from cpshard.compat.hf._transformers import NAME, TESTED_TRANSFORMERS, register

__all__ = ["KERNELS", "NAME", "TESTED_TRANSFORMERS", "SequenceBatch", "SequenceParallel", "attention_forward",
           "document_lengths", "register", "shard_row", "varlen_metadata"]

register()


def __getattr__(name: str) -> Any:
    if name == "varlen_metadata":
        from cpshard.plan.varlen import varlen_metadata

        return varlen_metadata
    raise AttributeError(f"module 'cpshard.compat.hf' has no attribute {name!r}")
