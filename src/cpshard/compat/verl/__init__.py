"""verl's sequence-packing helpers (``verl/models/mcore/util.py``), rebuilt on the shard plan.

Each function keeps verl's name, positional parameters and return structure, so that
:func:`patch` can put it where verl's model-forward modules bind the original; each adds
keyword-only ``tp_size``, ``cp_size``, ``cp_rank`` and ``cp_group`` (read from Megatron's parallel
state only when not given; see :func:`cpshard.megatron.state.parallel_context`), ``plan=``: a
plan built once per micro-batch (:func:`thd_plan`, :func:`bshd_plan`) so that tokens, labels,
masks, router-replay indices and teacher top-k rows of one step share it, and ``verl_version=``
where verl versions differ.

A drop-in is verl's contract, bit for bit: every row of every output, pad rows and position ids
included, equals verl's (the per-row rules, stated over the plan's
own views), except where verl loses or corrupts a token; docs/verl.md's "Differences from verl"
lists those rows:

- a sequence of no rows under zigzag ``need_roll`` overwrites the previous row's label with 0;
  where that row has a label to lose, the drop-in keeps it;
- ``min_local_rows`` / ``pad_to_length_bucket``: verl's target total is used where it keeps every
  plan invariant (so the buffers equal verl's); where verl's would drop tokens, the total is
  rounded up as ``ShardPlan.build`` does;
- ``forced_max_seqlen`` shorter than a row is an error, not a silent truncation;
- a site verl passes no ``cp_layout`` uses the layout in use, not always zigzag
  (:mod:`cpshard.compat.verl._layout`).

The package, one idea a module: ``_plans`` (the plans the drop-ins build, verl's dynamic-CP mask),
``_thd`` and ``_bshd`` (the drop-ins), ``_ulysses`` (the FSDP backend's six Ulysses helpers of
``verl/utils/ulysses.py``, at one ring rank, and inside a ring axis by the micro-batch's plan), ``_fsdp``
(verl's FSDP engine on cpshard: its attention, ``CPSHARD_RING``'s ring axis), ``_layout`` (the layout of a
site verl passes none), ``sites`` (where the patch binds, and each site's checks), ``_mtp`` (the MTP loss's route),
``_rows`` (verl's per-row rules over the plan's segments), ``_pack`` (the packing drop-in
:func:`rearrange_micro_batches`, and verl's own partition), ``_patch`` (:func:`patch`,
:class:`VerlPatch`), ``_activation`` with ``enable`` and ``plugin`` (cpshard on in every process of a
verl job), ``__main__`` (``python -m cpshard.compat.verl``: what is bound here).

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/models/mcore/util.py``,
``model_forward.py``, ``model_forward_fused.py``, ``tests/utils/test_megatron_bshd_preprocess.py``;
megatron-core 0.19.2 ``megatron/core/packed_seq_params.py``.
"""

from __future__ import annotations

from cpshard.compat.verl._pack import rearrange_micro_batches
from cpshard.compat.verl._activation import activate, process_patch
from cpshard.compat.verl._bshd import (
    build_vlm_attn_mask_bshd,
    build_vlm_attn_mask_thd,
    postprocess_bshd_engine,
    preprocess_bshd_engine,
)
from cpshard.compat.verl._fsdp import ENV as RING_ENV
from cpshard.compat.verl._fsdp import RingRows
from cpshard.compat.verl._layout import ENV as LAYOUT_ENV
from cpshard.compat.verl._patch import VerlPatch, active, patch
from cpshard.compat.verl._plans import bshd_plan, local_padding_mask, thd_plan
from cpshard.compat.verl.sites import DROP_INS as DROP_INS  # verl's eight helpers -> the drop-ins patch() binds
from cpshard.compat.verl._ulysses import (
    ULYSSES_DROP_INS,
    gather_heads_scatter_seq,
    gather_outputs_and_unpad,
    gather_seq_scatter_heads,
    ring_rows,
    slice_input_tensor,
    ulysses_pad,
    ulysses_pad_and_slice_inputs,
)
from cpshard.compat.verl._thd import (
    postprocess_packed_seqs,
    postprocess_thd_engine,
    preprocess_packed_seqs,
    preprocess_thd_engine,
)

__all__ = [
    "LAYOUT_ENV",
    "RING_ENV",
    "RingRows",
    "ring_rows",
    "ULYSSES_DROP_INS",
    "VerlPatch",
    "activate",
    "active",
    "bshd_plan",
    "build_vlm_attn_mask_bshd",
    "build_vlm_attn_mask_thd",
    "gather_heads_scatter_seq",
    "gather_outputs_and_unpad",
    "gather_seq_scatter_heads",
    "local_padding_mask",
    "patch",
    "postprocess_bshd_engine",
    "postprocess_packed_seqs",
    "postprocess_thd_engine",
    "preprocess_bshd_engine",
    "preprocess_packed_seqs",
    "preprocess_thd_engine",
    "process_patch",
    "rearrange_micro_batches",
    "slice_input_tensor",
    "thd_plan",
    "ulysses_pad",
    "ulysses_pad_and_slice_inputs",
]
