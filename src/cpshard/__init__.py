"""cpshard: context-parallel sharding of variable-length micro-batches from one plan.

Public API (documented in the README):

- :class:`ShardPlan` / :class:`BshdPlan`: immutable plans for packed (THD) and padded (BSHD) batches,
  with the same names for the same things (``local_len``, ``total_len``, ``max_seqlen``,
  ``token_mask``, ``label_mask``, ``padding_overhead``).
- :func:`shard` / :func:`unshard`: a rank's rows (optionally shifted) and the exact inverse.
- :func:`shift`: SPEC's ``shift(x, k)`` on unsharded sequences.
- :func:`shift_exchange`: the pure index math behind ``cpshard.distributed.shift_sharded``.
- :func:`from_padded` / :func:`to_padded`: padded batch + attention mask <-> jagged nested tensor.
- :class:`GradReduction`: the gradient convention of ``cpshard.loss`` and ``cpshard.mtp``.
- :class:`Layout`, :class:`Padding`, :func:`alignment`, :func:`layout_for`, :func:`register_layout_rule`.
- :func:`pack` / :class:`Packing`: a global batch split into micro-batches under a padded token budget,
  scored by every CP rank's causal work (``cpshard.pack``).
- :func:`describe_plan` / :func:`describe_bshd`: the text ``cpshard plan`` prints (which rows each rank
  holds, padding, causal-work balance); :func:`draw_plans`: its ``--png`` figure (matplotlib).

The package keeps pure index math (``plan``, ``bshd``, ``layout``, ``_index``, ``_exchange``) apart
from data movement (``ops``, ``padded``) and from communication (``distributed``, the only module
that uses ``torch.distributed``); framework adapters live in ``cpshard.megatron``.
"""

from cpshard import _deps  # noqa: F401  (first: a missing NumPy is named with the fix)
from cpshard._exchange import Exchange
from cpshard.bshd import BshdPlan
from cpshard.layout import GradReduction, Layout, Padding, alignment, layout_for, register_layout_rule
from cpshard.ops import shard, shift, unshard
from cpshard.pack import Packing, pack  # eager: the function must shadow its module's name (pure, NumPy)
from cpshard.padded import from_padded, to_padded
from cpshard.plan import DeviceTensors, ShardPlan, shift_exchange

__version__ = "0.2.0.dev0"

# The summary and the figure come from the CLI's modules, which reach the reference attention (and so
# torch.distributed): imported on first use, so that ``import cpshard`` stays the index math alone.
_LAZY = {"describe_plan": "cpshard.cli", "describe_bshd": "cpshard.cli", "draw_plans": "cpshard.plot"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cpshard' has no attribute {name!r}")

__all__ = [
    "BshdPlan",
    "DeviceTensors",
    "Exchange",
    "GradReduction",
    "Layout",
    "Packing",
    "Padding",
    "ShardPlan",
    "alignment",
    "describe_bshd",
    "describe_plan",
    "draw_plans",
    "from_padded",
    "layout_for",
    "pack",
    "register_layout_rule",
    "shard",
    "shift",
    "shift_exchange",
    "to_padded",
    "unshard",
]
