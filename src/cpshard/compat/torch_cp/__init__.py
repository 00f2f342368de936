"""cpshard as PyTorch's context-parallel load balancer: document-aware rows for torch's own
``_context_parallel_shard``, ``context_parallel_unshard`` and flex-attention block masks.

torch shards a ``(B, S, ...)`` batch along ``S`` after rearranging it by a ``_LoadBalancer``
(``_generate_indices(restore=False)``: ``(B, S)`` indices, rank 0's rows first). Its balancers do
not know the documents packed in a row; cpshard's plans do. One :class:`~cpshard.ShardPlan` per
batch row (all with ``total_len == S``) gives:

- :func:`load_balancer`: a torch ``_LoadBalancer`` whose indices put, for each row, rank ``r``'s
  ``cpshard.shard`` rows into its ``S / cp`` piece; torch's shard, unshard and block-mask rewrite
  run unchanged on it (both layouts, every padding mode, balanced orders, empty documents);
- :func:`rearrange_indices`: the same indices as a public tensor, for code that shards by hand;
- :func:`to_buffer` / :func:`from_buffer`: the caller's padded buffer the indices refer to (each
  document padded to its plan's padded length, in the caller's order), and back;
- :func:`document_mask_mod`: flex attention's per-document causal ``mask_mod`` over that buffer;
- :func:`plans_from_positions`: the plans of rows given as torchtitan's per-document position ids.

torch's private names stay in one module (``_torch.py``), imported on first use and checked
(tested on torch 2.13.0; elsewhere an ``ImportError`` says what to do). torch's ring-SDPA context
parallelism assumes head-tail rows whenever a balancer is set: a cpshard balancer refuses it
(``RuntimeError``) rather than give a silently wrong attention. The package, one idea a module:
``_plans`` (plans from positions, the batch's checks), ``_buffer`` (the buffer, the indices, the
mask), ``_torch`` (torch's names, the balancer class). docs/torch_cp.md shows a whole step.

Sources read (not copied): torch 2.13.0's ``_context_parallel/_load_balancer.py``,
``_attention.py``, ``_cp_custom_ops.py``; torchtitan 0.3.0's
``torchtitan/distributed/context_parallel/api.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cpshard.base.errors import check_int, fail
from cpshard.compat.torch_cp._buffer import document_mask_mod, from_buffer, rearrange_indices, to_buffer
from cpshard.compat.torch_cp._plans import document_lengths, plans_from_positions
from cpshard.compat.torch_cp._torch import TESTED_TORCH, balancer_class, ring_sdpa_active, torch_cp
from cpshard.plan.values import ShardPlan

__all__ = ["BLOCK_SIZE", "TESTED_TORCH", "block_mask_len", "document_lengths", "document_mask_mod", "from_buffer",
           "load_balancer", "plans_from_positions", "rearrange_indices", "ring_sdpa_active", "to_buffer",
           "torch_names"]

#: torch's CP block mask (``_create_cp_block_mask``) cuts each rank's rows into blocks of this many
BLOCK_SIZE = 128


def block_mask_len(total_len: int, cp_size: int, *, block_size: int = BLOCK_SIZE) -> int:
    """The smallest row length ``S >= total_len`` that torch's CP block mask takes: ``S % (cp_size *
    block_size) == 0`` (torch 2.13 raises ``NotImplementedError: Q_LEN ... is not divisible by CP mesh
    world size * BLOCK_SIZE`` otherwise). Pass it as ``total_len=`` when building each row's plan
    (the last document's padding takes the rest), so that a padded row (zigzag's documents padded to
    ``2 * cp``) still gets a flex-attention block mask under CP.

    >>> block_mask_len(300, 2)
    512
    """
    total_len = check_int("total_len", total_len, minimum=1)
    unit = check_int("cp_size", cp_size, minimum=1) * check_int("block_size", block_size, minimum=1)
    return -(-total_len // unit) * unit


def _check_mesh(mesh: Any) -> None:
    """A process group or a mesh of several dimensions, refused by name (the same on every rank: before
    any agreement, which needs the mesh's group)."""
    if mesh is None:
        return
    if not (hasattr(mesh, "size") and hasattr(mesh, "device_type")):  # a ProcessGroup has size() alone
        fail("mesh", type(mesh).__name__, "must be a 1-D DeviceMesh of the context-parallel ranks (torch's shard "
             "reads the mesh's local rank and device type, which a process group does not carry)",
             "pass DeviceMesh.from_group(group, device_type) or init_device_mesh(device_type, (cp,))", kind=TypeError)
    if getattr(mesh, "ndim", 1) != 1:
        fail("mesh", f"a DeviceMesh of {mesh.ndim} dimensions {tuple(mesh.shape)}", "must be the 1-D "
             "context-parallel mesh: torch cuts each row into one piece per rank of it",
             "pass the CP sub-mesh, e.g. world_mesh['cp']")


def load_balancer(plans: list[ShardPlan] | ShardPlan | Callable[[], Any], *, device: torch.device | str | None = None,
                  mesh: Any = None, check: bool | None = None) -> Any:
    """A torch ``_LoadBalancer`` (``torch.distributed.tensor.experimental._context_parallel``) over
    one :class:`~cpshard.ShardPlan` per batch row, for ``_context_parallel_shard``,
    ``context_parallel_unshard`` and the CP block mask (``_create_cp_block_mask``).

    ``_generate_indices(restore=False)`` returns :func:`rearrange_indices` ``(B, S)`` int64 on
    ``device`` (CPU by default: the device of the buffers torch shards), ``restore=True`` its
    inverse; both built on first use and kept by the balancer. Every plan must have the same
    ``total_len`` (``S``, the buffer's sequence length) and ``cp_size``, the size of the CP mesh
    torch cuts the rows for (torch does not tell a balancer its mesh: pass ``mesh=`` to have it
    checked here, and ``device`` defaults to the mesh's device type).
    Raises ``RuntimeError`` when asked for indices while torch's ring-SDPA path is on
    (:func:`ring_sdpa_active`); ``ImportError`` where the torch in use lacks the interface.

    ``check``: with ``mesh=``, share every rank's plans first (one small all-gather over the mesh's
    group, as :func:`cpshard.distributed.check_plan`), so that ranks whose plans differ, or a rank
    that refuses its own, raise on every rank: torch's shard and unshard carry no cpshard header, and
    ranks with other plans get other rows silently. ``None`` follows
    :func:`cpshard.distributed.set_checks`; without ``mesh`` nothing is shared.

    ``plans`` may also be a function of no arguments that returns them (e.g. ``lambda:
    plans_from_positions(positions, cp_size=cp)``): its ``ValueError`` / ``TypeError`` (a rank's bad
    positions) is then carried by the agreement too, so every rank raises, not only the one whose
    input was bad. ``mesh`` must be a 1-D ``DeviceMesh`` (a process group or a 2-D mesh is refused by
    name, ``TypeError`` / ``ValueError``).
    """
    from cpshard.distributed.agree import checks_enabled
    from cpshard.distributed.checks import agree, checks_on, plan_fingerprint

    _check_mesh(mesh)
    group, checked = None, False
    if mesh is not None and check is not False and (check is not None or checks_enabled()):
        group = mesh.get_group()  # only then: a mesh is read for its size and device type otherwise
        checked = checks_on(check, None, group)
    try:
        if callable(plans):
            plans = plans()
        balancer = balancer_class()(plans, device if device is not None or mesh is None else mesh.device_type)
        if mesh is not None and mesh.size() != balancer.cp_size:
            fail("mesh", f"a device mesh of {mesh.size()} ranks", f"must have the plans' cp_size={balancer.cp_size} "
                 "ranks: torch cuts each row into one piece per rank of the mesh", "build the plans with "
                 "cp_size=mesh.size(), or pass the context-parallel mesh (e.g. world_mesh['cp'])")
    except (ValueError, TypeError) as exc:
        if checked:  # this rank's refusal, carried by the agreement (as "no plan"): its peers raise too
            agree(None, group, exc, {})
        raise
    if checked:  # every row's plan, in order: rows of other documents on another rank raise on every rank
        agree(balancer.plans[0], group, None, {"operation": "load_balancer",
                                               "plans": [plan_fingerprint(p).tolist() for p in balancer.plans]})
    return balancer


def torch_names() -> Any:
    """torch's private context-parallel names this package uses, by torch's own names
    (``_LoadBalancer`` and torch's own balancers, ``_context_parallel_shard``,
    ``context_parallel_unshard``, ``_create_cp_block_mask``, ``flex_cp_allgather``, ...), checked once:
    for tests, benchmarks and adapters (torchtitan's) that drive torch's own path, so that no other
    module names torch's privates."""
    return torch_cp()
