"""cpshard: context-parallel sharding of variable-length micro-batches from one plan.

Public API (documented in docs/ and the README):

- :class:`ShardPlan` / :class:`BshdPlan`: immutable plans for packed (THD) and padded (BSHD) batches,
  with the same names for the same things (``local_len``, ``total_len``, ``max_seqlen``,
  ``token_mask``, ``label_mask``, ``padding_overhead``); :class:`Plan` is what both are.
- :func:`shard` / :func:`unshard`: a rank's rows (optionally shifted) and the exact inverse.
- :func:`shift`: SPEC's ``shift(x, k)`` on unsharded sequences.
- :func:`shift_exchange` / :func:`halo_exchange`: the pure index math behind
  ``cpshard.distributed.shift_sharded`` / ``shift_sharded_multi`` (:class:`ShiftExchange`,
  :class:`HaloExchange`), callable for every rank in one process.
- :func:`varlen_metadata` / :class:`VarlenMetadata`: a rank's ``flash_attn_varlen_func`` arguments
  (query rows, gathered key rows, ``cu_seqlens``, window) for document-causal attention over
  all-gathered keys.
- :func:`twin_plan`: a plan's twin under another layout or order (``cpshard.distributed.relayout``).
- :func:`from_padded` / :func:`to_padded`: padded batch + attention mask <-> jagged nested tensor.
- :class:`GradReduction`: the gradient convention of ``cpshard.loss`` and ``cpshard.mtp``.
- :class:`Layout`, :class:`Padding`, :class:`Reorder`, :class:`TwinOrder`, :func:`alignment`, :func:`layout_for`,
  :func:`register_layout_rule`, :func:`unregister_layout_rule`.
- :func:`pack` / :class:`Packing`: a global batch split into micro-batches under a padded token budget,
  scored by every CP rank's causal work (``cpshard.pack``).
- :func:`describe_plan` / :func:`describe_bshd`: the text ``cpshard plan`` prints (which rows each rank
  holds, padding, causal-work balance); :func:`draw_plans`: its ``--png`` figure (matplotlib).

The package is layered, one subpackage per layer (``docs/ARCHITECTURE.md``): ``base`` (errors, dtypes,
layouts and padding), ``index`` (pure index math over segments), ``plan`` (the plan values, their index
service, twins, causal math), ``ops``, ``packing`` and ``policy`` (data movement, micro-batch packing,
the layout a model needs), ``distributed`` (the
only collectives), ``loss`` and ``testing`` (losses, the launcher and the reference computations),
then ``megatron``, ``compat`` and ``tools`` (framework adapters, the CLI). The paths before the
subpackages (``cpshard.mtp``, ``cpshard.spawn``, ...) still import (``_aliases``).
"""

from cpshard import _aliases
from cpshard.base import deps as _deps  # noqa: F401  (first: a missing NumPy is named with the fix)
from cpshard.base.convention import GradReduction
from cpshard.base.layout import Layout, Padding, Reorder, TwinOrder, alignment
from cpshard.index.halo import HaloExchange
from cpshard.index.shift import Exchange, ShiftExchange
from cpshard.ops.padded import from_padded, to_padded
from cpshard.ops.sharding import shard, shift, unshard
from cpshard.packing.pack import Packing, pack  # eager: the function must shadow its module's name (pure, NumPy)
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.exchanges import halo_exchange, shift_exchange
from cpshard.plan.twins import twin_plan
from cpshard.plan.values import DeviceTensors, Plan, ShardPlan
from cpshard.plan.varlen import VarlenMetadata, varlen_metadata
from cpshard.policy.layouts import layout_for, register_layout_rule, unregister_layout_rule

__version__ = "0.2.0"

_aliases.install()  # the module paths before the subpackages (cpshard.mtp, cpshard.spawn, ...)

# The summary and the figure come from the tools' modules (matplotlib for the figure):
# imported on first use, so that ``import cpshard`` stays the index math and data movement alone.
_LAZY = {"describe_plan": "cpshard.tools.describe", "describe_bshd": "cpshard.tools.describe",
         "draw_plans": "cpshard.tools.plot"}


def __getattr__(name: str) -> object:
    import importlib
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if f"cpshard.{name}" in {**_aliases.MOVED, **_aliases.SPLIT}:  # cpshard.layout, cpshard.spawn, ... as attributes
        return importlib.import_module(f"cpshard.{name}")
    raise AttributeError(f"module 'cpshard' has no attribute {name!r}")

__all__ = [
    "BshdPlan",
    "DeviceTensors",
    "Exchange",
    "GradReduction",
    "HaloExchange",
    "Layout",
    "Packing",
    "Padding",
    "Plan",
    "Reorder",
    "ShardPlan",
    "ShiftExchange",
    "TwinOrder",
    "VarlenMetadata",
    "alignment",
    "describe_bshd",
    "describe_plan",
    "draw_plans",
    "from_padded",
    "halo_exchange",
    "layout_for",
    "pack",
    "register_layout_rule",
    "shard",
    "shift",
    "shift_exchange",
    "to_padded",
    "twin_plan",
    "unregister_layout_rule",
    "unshard",
    "varlen_metadata",
]
