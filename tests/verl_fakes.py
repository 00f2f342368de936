"""What verl 0.9.1's functions read from Megatron, faked for tests (single process or gloo ranks).

Imports verl and megatron-core; a test module that imports this skips when they cannot be
imported. Context managers rather than pytest's monkeypatch, so that gloo workers use them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cpshard.megatron import import_megatron

mpu = import_megatron("parallel_state")
psp_module = import_megatron("packed_seq_params")
import verl.models.mcore.util as vutil  # noqa: E402  (after the triton-free Megatron import)

vutil.logger.setLevel(logging.ERROR)  # its "warning_once" about padding repeats on every sequence


@dataclasses.dataclass
class PackedSeqParamsWithMode(psp_module.PackedSeqParams):
    """A PackedSeqParams with the CP partition mode (Megatron-LM dev / verl's fork; no release has it)."""

    cp_partition_mode: str = "zigzag"


class FakeGroup:
    """A process group as far as size() and rank() go (for single-process dynamic-CP tests)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextlib.contextmanager
def swap(owner: Any, values: dict[str, Any]) -> Iterator[None]:
    missing = object()
    saved = {name: getattr(owner, name, missing) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


@contextlib.contextmanager
def parallel_state(tp: int, cp: int, rank: int, group: Any = None) -> Iterator[None]:
    """Megatron's getters answer ``tp``, ``cp``, ``rank`` (and ``group``, default the world group)."""
    def the_group(*_args: Any, **_kwargs: Any) -> Any:
        return group if group is not None else dist.group.WORLD

    with swap(mpu, {
        "get_tensor_model_parallel_world_size": lambda: tp,
        "get_context_parallel_world_size": lambda: cp,
        "get_context_parallel_rank": lambda: rank,
        "get_context_parallel_group": the_group,
        "get_dynamic_data_context_parallel_groups": the_group,
    }):
        yield


@contextlib.contextmanager
def fake_group_ranks() -> Iterator[None]:
    """``torch.distributed.get_rank(group=g)`` answers ``g.rank()`` (verl's dynamic-CP rank, one process)."""
    with swap(dist, {"get_rank": lambda group=None: group.rank()}):
        yield


@contextlib.contextmanager
def partition_mode() -> Iterator[None]:
    """Megatron's and verl's PackedSeqParams have ``cp_partition_mode`` (verl's contiguous path needs it)."""
    with swap(psp_module, {"PackedSeqParams": PackedSeqParamsWithMode}), \
            swap(vutil, {"PackedSeqParams": PackedSeqParamsWithMode,
                          "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE": True}):
        yield


def label_rows(plan: Any, rank: int) -> torch.Tensor:
    """``(L,)`` bool: token rows whose next token exists (what a rolled label is compared on)."""
    return plan.label_mask(rank)


def token_rows(plan: Any, rank: int) -> torch.Tensor:
    return plan.token_mask(rank)


def nested(lens: list[int], trailing: tuple[int, ...] = (), dtype: torch.dtype = torch.int64,
           seed: int = 0) -> torch.Tensor:
    """A jagged batch of distinct values (so that a misplaced row cannot go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    width = 1
    for t in trailing:
        width *= t
    values = torch.randperm(max(total * width, 1), generator=g)[:total * width] + 1
    values = values.view(total, *trailing)
    if dtype == torch.bool:
        values = values % 2 == 1
    else:
        values = values.to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets)
