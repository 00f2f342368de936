"""Megatron-core ``PackedSeqParams`` <-> :class:`~cpshard.ShardPlan`.

A THD micro-batch reaches Megatron-core's attention (TransformerEngine) as a ``PackedSeqParams``:
``qkv_format="thd"``, cumulative sequence offsets and the longest sequence. cpshard's plan holds
the same numbers, so the conversion is exact both ways:

``packed_seq_params(plan)`` fills every ``cu_seqlens`` field with the plan's ``cu_seqlens_padded``
(as verl 0.9.1's ``preprocess_thd_engine`` does: the kernels see padded sequences, and the pad rows
of a sequence attend only inside it) and both ``max_seqlen`` fields with ``plan.max_seqlen``.
Megatron-core releases whose ``PackedSeqParams`` has a ``cp_partition_mode`` field are told the
layout; on a release without the field only zigzag can be expressed (it is what those releases
assume), so a contiguous plan at ``cp > 1`` is an error there rather than silently wrong attention.

``packed_seq_params_with_layout(plan)`` is the same but records the layout on the instance where
the class has no field for it, for contiguous rows that never reach Megatron's CP attention.

``plan_from_packed_seq_params(psp, cp_size=...)`` reads the padded offsets back (and the real
lengths from ``cu_seqlens_q`` where it differs from the padded offsets, from what
``packed_seq_params`` remembered on ``psp``, or from ``seqlens=``).

Megatron is imported lazily (``cpshard.megatron._import``), only when these functions run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, require_equal_chunks
from cpshard.megatron._import import import_megatron, megatron_version
from cpshard.plan.args import parse_seqlens
from cpshard.plan.values import ShardPlan

__all__ = ["packed_seq_params", "packed_seq_params_class", "packed_seq_params_with_layout",
           "plan_from_packed_seq_params", "plan_from_padded", "supports_cp_partition_mode"]

# The first megatron-core line whose PackedSeqParams is expected to carry the CP partition mode. The
# field exists today only in NVIDIA's development branch and verl's Megatron fork; no release has it
# (0.19.2 does not). The check below looks at the installed class, never at this string.
_NEEDS = ("a megatron-core whose PackedSeqParams has the cp_partition_mode field (Megatron-LM's development "
          "branch or verl's Megatron fork; no release up to 0.19.2 has it)")


def packed_seq_params_class() -> type:
    """The installed megatron-core's ``PackedSeqParams`` (looked up on every call, imports lazily)."""
    cls: type = import_megatron("packed_seq_params").PackedSeqParams
    return cls


def supports_cp_partition_mode(cls: type | None = None) -> bool:
    """Whether ``cls`` (default: the installed ``PackedSeqParams``) takes ``cp_partition_mode``.

    A dataclass field or an ``__init__`` parameter of that name counts, and so does an ``__init__``
    taking ``**kwargs`` (a stand-in that accepts any field), as verl 0.9.1 decides.
    """
    return _has_field(packed_seq_params_class() if cls is None else cls, "cp_partition_mode")


def _has_field(cls: type, name: str) -> bool:
    """Whether ``cls(name=...)`` is accepted: a dataclass field, an ``__init__`` parameter, or ``**kwargs``."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    params = inspect.signature(getattr(cls, "__init__")).parameters  # noqa: B009
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _installed() -> str:
    version = megatron_version()
    return f"megatron-core {version}" if version else "this megatron-core (version unknown)"


def packed_seq_params(
    plan: ShardPlan,
    *,
    device: torch.device | str | None = None,
    cp_group: Any = None,
    local_cp_size: int | None = None,
    real_lengths: bool = False,
    cp_rank: int | None = None,
) -> Any:
    """Megatron-core's own ``PackedSeqParams`` for a THD plan.

    The result also remembers the plan's real lengths (beside the padded offsets they belong to), so
    that :func:`plan_from_packed_seq_params` gives the plan back without ``seqlens=``.

    Args:
        plan: the micro-batch's :class:`~cpshard.ShardPlan`.
        device: where the ``cu_seqlens`` tensors go (default CPU; TransformerEngine wants them on
            the GPU, where verl puts them: the input's device).
        cp_group, local_cp_size: for verl's dynamic CP (a per-micro-batch group of
            ``local_cp_size`` ranks): set on the result as verl sets them; ``local_cp_size`` must
            equal ``plan.cp_size``.
        real_lengths: put the real lengths (``plan.cu_seqlens``) in ``cu_seqlens_q`` / ``_kv``
            beside the padded offsets in ``cu_seqlens_*_padded``, and ``pad_between_seqs=True``
            where the class has that field: the form in which TransformerEngine skips each
            sequence's pad rows and MoE routers do not count them. Default False: every field the
            padded offsets, as verl 0.9.1 fills them (the pad rows are attended inside their sequence).
        cp_rank: this rank's CP rank. Where the installed ``PackedSeqParams`` has Megatron-LM dev's
            ``cp_partition_route`` field, the route between the plan's layout and its twin's is
            prebuilt from the plan (:func:`cpshard.megatron.route.cp_partition_route`): dev then
            neither copies ``cu_seqlens_q_padded`` to the host nor loops over rows to build it when a
            hybrid model converts layout. Ignored where the class has no such field.

    Returns:
        ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=m, max_seqlen_kv=m)`` with
        ``cu = plan.cu_seqlens_padded`` (``(B + 1,)`` int32) and ``m = plan.max_seqlen``, plus
        ``cp_partition_mode=plan.layout`` where the installed class has that field.

    Raises:
        ValueError: a contiguous plan with ``cp_size > 1`` on a megatron-core whose
            ``PackedSeqParams`` cannot say so (every release up to 0.19.2): its attention would
            assume zigzag and silently attend to the wrong rows. Where the rows never reach
            Megatron's CP attention, :func:`packed_seq_params_with_layout` records the layout anyway.

    Example::

        plan = ShardPlan.build([5, 3], cp_size=2)       # zigzag: padded to [8, 4]
        psp = packed_seq_params(plan)                   # cu_seqlens_q_padded = [0, 8, 12], max 8
    """
    return _build(plan, device=device, cp_group=cp_group, local_cp_size=local_cp_size, real_lengths=real_lengths,
                  cp_rank=cp_rank, tag=False)


def packed_seq_params_with_layout(plan: ShardPlan, **options: Any) -> Any:
    """:func:`packed_seq_params`, for any layout on any megatron-core: where the installed
    ``PackedSeqParams`` has no ``cp_partition_mode`` field (every release up to 0.19.2), the layout is
    set on the instance as an attribute of that name instead of refusing a contiguous plan.

    Why :func:`packed_seq_params` refuses: megatron-core 0.19.2's attention (TransformerEngine's
    THD context parallelism) takes every packed micro-batch as zigzag and cannot be told otherwise,
    so contiguous rows handed to it are attended as if they were zigzag ones, silently wrong. What
    this one is for: a contiguous micro-batch whose rows do not go through that attention, such
    as a model whose attention is your own or whose contiguous layers are linear attention or a
    scan, and the MTP loss. What reads the attribute: :func:`cpshard.megatron.process_mtp_loss`
    (and ``plan_for_mtp``), :func:`plan_from_packed_seq_params`, and Megatron-LM dev's code that
    reads the field of that name. Megatron 0.19.2's own attention does not: it still assumes zigzag.
    An object copied field by field (``dataclasses.replace``) loses the attribute.

    ``options``: :func:`packed_seq_params`'s keywords (``device``, ``cp_group``, ``local_cp_size``,
    ``real_lengths``, ``cp_rank``), the same result; on a release with the field the two are the same.

    Example (megatron-core 0.19.2)::

        plan = ShardPlan.build([5, 3], cp_size=2, layout="contiguous")
        psp = packed_seq_params_with_layout(plan)           # packed_seq_params(plan) refuses
        assert psp.cp_partition_mode == "contiguous"
        assert plan_from_packed_seq_params(psp, cp_size=2) == plan
    """
    known = {"device", "cp_group", "local_cp_size", "real_lengths", "cp_rank"}
    for name in options:
        if name not in known:
            fail(name, "given", "is not an option of packed_seq_params", f"pass only {', '.join(sorted(known))}",
                 kind=TypeError)
    return _build(plan, tag=True, **options)


#: where packed_seq_params leaves ``(padded offsets, real lengths)`` on its result (see _remember)
_LENGTHS_ATTR = "_cpshard_real_lengths"


def _remember(psp: Any, plan: ShardPlan) -> None:
    """The plan's real lengths, and the padded offsets they go with, on ``psp``: read back by
    :func:`plan_from_packed_seq_params` only while ``psp``'s padded offsets are still those."""
    with contextlib.suppress(AttributeError, TypeError):  # a frozen or slotted class: nothing remembered
        setattr(psp, _LENGTHS_ATTR, (plan.cu_seqlens_padded_py, plan.seqlens_py))


def _remembered(psp: Any, cu_padded: tuple[int, ...]) -> tuple[int, ...] | None:
    memo = getattr(psp, _LENGTHS_ATTR, None)
    if isinstance(memo, tuple) and len(memo) == 2 and tuple(memo[0]) == cu_padded:
        return tuple(memo[1])
    return None


def _build(plan: ShardPlan, *, device: torch.device | str | None = None, cp_group: Any = None,
           local_cp_size: int | None = None, real_lengths: bool = False, cp_rank: int | None = None,
           tag: bool) -> Any:
    """:func:`packed_seq_params` (``tag=False``) and :func:`packed_seq_params_with_layout` (``tag=True``)."""
    if not isinstance(plan, ShardPlan):
        fail("plan", type(plan).__name__, "must be a THD ShardPlan (PackedSeqParams describes packed sequences)",
             "build one with ShardPlan.build", kind=TypeError)
    require_equal_chunks(plan, "Megatron's PackedSeqParams (TransformerEngine's THD zigzag)")
    cls = packed_seq_params_class()
    extra: dict[str, Any] = {}
    if supports_cp_partition_mode(cls):
        extra["cp_partition_mode"] = plan.layout.value
    elif plan.layout is Layout.CONTIGUOUS and plan.cp_size > 1 and not tag:
        fail("plan", f"a contiguous plan at cp_size={plan.cp_size}",
             f"needs PackedSeqParams.cp_partition_mode to tell attention the layout, and {_installed()}'s "
             "PackedSeqParams has no such field (its attention assumes zigzag)",
             f"install {_NEEDS}, or use layout='zigzag'; where these rows never reach Megatron's CP attention "
             "(your own attention, linear-attention or scan layers, the MTP loss), "
             "cpshard.megatron.packed_seq_params_with_layout(plan) sets the layout on the instance")
    if local_cp_size is not None:
        local_cp_size = check_int("local_cp_size", local_cp_size, minimum=1)
        if local_cp_size != plan.cp_size:
            fail("local_cp_size", local_cp_size, f"must equal the plan's cp_size ({plan.cp_size})",
                 "build the plan for the dynamic CP group's size")
        extra["local_cp_size"] = local_cp_size
    if cp_group is not None:
        extra["cp_group"] = cp_group
    if cp_rank is not None and _has_field(cls, "cp_partition_route"):
        from cpshard.megatron.route import cp_partition_route
        extra["cp_partition_route"] = cp_partition_route(plan, cp_rank, device)
    # a copy: the plan's own offsets are built once and must not be edited by whoever holds the params
    on = None if device is None else plan.device_tensors(device)
    cu = (plan.cu_seqlens_padded if on is None else on.cu_seqlens_padded).clone()
    real = cu
    if not isinstance(real_lengths, bool):
        fail("real_lengths", repr(real_lengths), "must be a bool", "pass True or False", kind=TypeError)
    if real_lengths:
        real = (plan.cu_seqlens if on is None else on.cu_seqlens).clone()
        if _has_field(cls, "pad_between_seqs"):
            extra["pad_between_seqs"] = True
    psp = cls(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=plan.max_seqlen,
        max_seqlen_kv=plan.max_seqlen,
        **extra,
    )
    if tag and "cp_partition_mode" not in extra:
        try:
            psp.cp_partition_mode = plan.layout.value
        except (AttributeError, TypeError):
            fail("plan", f"a {plan.layout.value} plan", f"cannot be recorded on {type(psp).__name__}, which "
                 "takes no new attributes (frozen or slotted) and has no cp_partition_mode field",
                 f"install {_NEEDS}")
    _remember(psp, plan)
    return psp


def offsets_of(psp: Any, name: str) -> tuple[int, ...] | None:
    """``psp.<name>`` (a ``cu_seqlens*`` field) as Python ints, checked to be cumulative offsets; None if unset."""
    value = getattr(psp, name, None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            fail(f"psp.{name}", f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}",
                 "must be a 1-D integer tensor of cumulative offsets", "pass a PackedSeqParams built for THD")
        values = value.tolist()
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            fail(f"psp.{name}", repr(value), "must be a 1-D integer tensor or a sequence of ints",
                 "pass a PackedSeqParams built for THD", kind=TypeError)
        values = list(value)
        for i, v in enumerate(values):  # whole numbers only: int() would truncate 8.5 to 8
            if isinstance(v, bool) or not hasattr(type(v), "__index__"):
                fail(f"psp.{name}[{i}]", repr(v), "must be an integer offset",
                     "pass integer cumulative offsets (e.g. torch.int32, as Megatron builds them)", kind=TypeError)
    if not values or values[0] != 0 or any(b < a for a, b in zip(values[:-1], values[1:])):
        fail(f"psp.{name}", values, "must start at 0 and never decrease (cumulative sequence offsets)",
             "pass the PackedSeqParams of a THD micro-batch")
    return tuple(int(v) for v in values)


def plan_from_packed_seq_params(
    psp: Any,
    *,
    cp_size: int,
    tp_size: int = 1,
    layout: Layout | str | None = None,
    seqlens: Sequence[int] | torch.Tensor | None = None,
    fp8: bool = False,
) -> ShardPlan:
    """The :class:`~cpshard.ShardPlan` a THD ``PackedSeqParams`` describes (the inverse of :func:`packed_seq_params`).

    Args:
        psp: a ``PackedSeqParams`` (any object with its fields): the padded lengths come from
            ``cu_seqlens_q_padded`` (or ``cu_seqlens_q`` when that is None).
        cp_size, tp_size: the parallel sizes the micro-batch was padded for.
        layout: the layout; default ``psp.cp_partition_mode`` where the field exists, else zigzag.
            Passing one that contradicts ``psp.cp_partition_mode`` is an error.
        seqlens: the real token counts ``(B,)``. Default, in this order: the differences of
            ``cu_seqlens_q`` when it differs from the padded offsets (Megatron's convention); the
            real lengths :func:`packed_seq_params` remembered on ``psp`` (while its padded offsets
            are the ones it built, so the round trip gives the plan back); else the padded lengths
            themselves. That last case is a ``PackedSeqParams`` built elsewhere with both fields
            padded, as verl 0.9.1 fills them: it does not say which rows are padding, so every row
            counts as a token (pad rows then get labels and count in losses); pass ``seqlens``
            where that matters, e.g. for label shifts.
        fp8: whether the micro-batch was padded for fp8 (a PackedSeqParams does not say; part of
            the plan's value, not of its rows).

    Returns:
        A plan with ``plan.cu_seqlens_padded`` equal to the padded offsets, whose rows are
        exactly the rows Megatron-core's attention sees on each rank. One host copy per offsets
        tensor.

    Example::

        plan = ShardPlan.build([5, 3], cp_size=2)
        assert plan_from_packed_seq_params(packed_seq_params(plan), cp_size=2) == plan
        cu = torch.tensor([0, 8, 12], dtype=torch.int32)       # both fields padded, as verl fills them
        verl_style = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
        assert plan_from_packed_seq_params(verl_style, cp_size=2).seqlens_py == (8, 4)  # pad rows as tokens
        assert plan_from_packed_seq_params(verl_style, cp_size=2, seqlens=[5, 3]) == plan
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    q, q_padded = offsets_of(psp, "cu_seqlens_q"), offsets_of(psp, "cu_seqlens_q_padded")
    cu_padded = q_padded if q_padded is not None else q
    if cu_padded is None or len(cu_padded) < 2:
        fail("psp", type(psp).__name__, "must carry cu_seqlens_q_padded or cu_seqlens_q with at least one sequence",
             "pass the PackedSeqParams of a THD micro-batch")
    padded = tuple(b - a for a, b in zip(cu_padded[:-1], cu_padded[1:]))
    if seqlens is not None:
        lens = parse_seqlens(seqlens)
    elif q is not None and q != cu_padded:
        lens = tuple(b - a for a, b in zip(q[:-1], q[1:]))
    else:
        lens = _remembered(psp, cu_padded) or padded
    mode = getattr(psp, "cp_partition_mode", None)
    if layout is None:
        layout = Layout.ZIGZAG if mode is None else Layout.parse(mode, "psp.cp_partition_mode")
    else:
        layout = Layout.parse(layout)
        if mode is not None and Layout.parse(mode, "psp.cp_partition_mode") is not layout:
            fail("layout", repr(layout.value), f"contradicts psp.cp_partition_mode={mode!r}",
                 "leave layout=None to read it from the PackedSeqParams")
    return ShardPlan.from_padded(lens, padded, cp_size=cp_size, tp_size=tp_size, layout=layout, fp8=fp8,
                                 name="psp.cu_seqlens_q_padded",
                                 fix="pass the cp_size and tp_size it was padded for (layout='contiguous' if it "
                                     "was sharded contiguously), and the real token counts as seqlens")


def plan_from_padded(seqlens: Sequence[int], padded: Sequence[int], *, cp_size: int, tp_size: int = 1,
                     layout: Layout | str = Layout.ZIGZAG, fp8: bool = False) -> ShardPlan:
    """The plan whose sequences hold ``seqlens`` tokens padded to exactly ``padded`` rows:
    :meth:`cpshard.ShardPlan.from_padded` (kept under this name for callers of 0.1)."""
    return ShardPlan.from_padded(seqlens, padded, cp_size=cp_size, tp_size=tp_size, layout=layout, fp8=fp8)
