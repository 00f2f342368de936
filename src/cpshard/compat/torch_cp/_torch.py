"""The one module of cpshard that names torch's private context-parallel interface.

torch keeps its context parallelism's load balancers private
(``torch/distributed/tensor/experimental/_context_parallel/``): ``_LoadBalancer`` with
``_generate_indices(restore=False)``, read by ``_context_parallel_shard``,
``context_parallel_unshard`` and ``_create_cp_block_mask``; ``_cp_options.enable_load_balance``;
the ring-SDPA dispatcher (``_sdpa_handler`` in the DTensor op dispatcher's custom handlers, or
``F.scaled_dot_product_attention`` patched by ``context_parallel()``). torchtitan reaches them
from one module (``torchtitan/distributed/context_parallel/api.py``); so does cpshard, here, so
that when torch moves them one file changes. Imported on first use, never by ``import cpshard``.
Tested on torch 2.13.0.
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any, NoReturn

import torch

from cpshard.base.errors import fail
from cpshard.compat.torch_cp._buffer import rearrange_indices
from cpshard.compat.torch_cp._plans import check_plans

__all__ = ["TESTED_TORCH", "balancer_class", "ring_sdpa_active", "torch_cp"]

TESTED_TORCH = "2.13.0"
"""The torch version whose private context-parallel interface this package was tested on."""
_MODULE = "torch.distributed.tensor.experimental._context_parallel"
_NAMES = {  # what cpshard uses (and hands to its torchtitan adapter), by the module that defines it in torch 2.13
    "_load_balancer": ("_LoadBalancer", "_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer",
                       "_PTRRLoadBalancer"),
    "_attention": ("_context_parallel_shard", "context_parallel_unshard", "_create_cp_block_mask", "_cp_options",
                   "_sdpa_handler", "custom_ops", "_replaced_functions"),
    "_cp_custom_ops": ("flex_cp_allgather",),
}


@functools.cache
def torch_cp() -> types.SimpleNamespace:
    """torch's context-parallel names cpshard uses, by their own names (``_LoadBalancer``, ...), or an
    ``ImportError`` saying which torch was tested and what to do."""
    found: dict[str, Any] = {}
    for module, names in _NAMES.items():
        try:
            mod = importlib.import_module(f"{_MODULE}.{module}")
        except ImportError as err:
            _missing(f"{_MODULE}.{module}", err)
        for name in names:
            if not hasattr(mod, name):
                _missing(f"{_MODULE}.{module}.{name}", None)
            found[name] = getattr(mod, name)
    return types.SimpleNamespace(**found)


def _missing(what: str, err: BaseException | None) -> NoReturn:
    fail("torch", torch.__version__, f"cpshard.compat.torch_cp needs torch's context-parallel interface, and this "
         f"torch lacks {what}{f' ({err})' if err else ''}; it was tested on torch {TESTED_TORCH}",
         f"install torch=={TESTED_TORCH}, or shard by hand with cpshard.compat.torch_cp.rearrange_indices, "
         "to_buffer and document_mask_mod (no private torch name)", kind=ImportError)


def ring_sdpa_active() -> bool:
    """Whether torch's ring-SDPA context parallelism is on in this process, which a cpshard balancer
    refuses to serve: the CP handlers in DTensor's op dispatcher (``_enable_context_parallel_dispatcher``,
    torchtitan's ``apply_cp_to_forward`` for SDPA models, or the ``context_parallel()`` context), or
    ``F.scaled_dot_product_attention`` patched by it."""
    names = torch_cp()
    from torch.distributed.tensor import DTensor

    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})
    if any(handlers.get(op) is names._sdpa_handler for op in names.custom_ops):
        return True
    return torch.nn.functional.scaled_dot_product_attention in names._replaced_functions


def _refuse_ring_sdpa() -> None:
    if ring_sdpa_active():
        fail("load_balancer", "a cpshard balancer", "cannot serve torch's ring-SDPA context parallelism: its causal "
             "ring (_templated_ring_attention) assumes torch's head-tail rows whenever a balancer is set, so "
             "cpshard's rows would give a silently wrong attention, and it has no document mask",
             "use flex attention with cpshard.compat.torch_cp.document_mask_mod (K/V all-gathered, as torchtitan's "
             "FlexAttention path does), or torch's _HeadTailLoadBalancer with SDPA", kind=RuntimeError)


@functools.cache
def balancer_class() -> type:
    """The ``_LoadBalancer`` subclass whose indices come from cpshard plans (built once, on first use)."""
    base = torch_cp()._LoadBalancer

    class PlanLoadBalancer(base):  # type: ignore[misc, valid-type]
        """torch's ``_LoadBalancer`` over one ``ShardPlan`` per batch row:
        ``_generate_indices(restore=False)`` is ``rearrange_indices(plans)`` ``(B, S)`` int64, built once
        per balancer (both directions, on ``device``) and shared: torch only reads them. Refuses torch's
        ring-SDPA path (``RuntimeError``) whenever it is on."""

        def __init__(self, plans: Any, device: torch.device | str | None = None) -> None:
            self.plans = check_plans(plans)
            self.cp_size = self.plans[0].cp_size
            self.seq_length = self.plans[0].total_len
            self.device = torch.device("cpu" if device is None else device)
            self._indices: dict[bool, torch.Tensor] = {}

        def _generate_indices(self, restore: bool = False) -> torch.Tensor:
            _refuse_ring_sdpa()
            key = bool(restore)
            if key not in self._indices:
                self._indices[key] = rearrange_indices(self.plans, restore=key, device=self.device)
            return self._indices[key]

        def __repr__(self) -> str:
            return f"PlanLoadBalancer(B={len(self.plans)}, S={self.seq_length}, cp_size={self.cp_size})"

    PlanLoadBalancer.__module__ = "cpshard.compat.torch_cp"
    return PlanLoadBalancer
