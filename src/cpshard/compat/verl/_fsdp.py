"""verl's FSDP engine on cpshard: its Ulysses attention is cpshard's, and ``CPSHARD_RING=R`` adds a ring axis.

Note [verl's FSDP engine on cpshard]
------------------------------------
verl's FSDP engine (``FSDPEngineWithLMHead``, and the value head's, which inherits its inputs) runs
Ulysses sequence parallelism over a group of ``sp`` ranks: ``prepare_model_inputs`` rolls the packed row
(the label of each row is the next token of the row), pads it to a multiple of ``sp`` and hands each
rank a consecutive ``1 / sp`` of it (ids, positions, rolled labels, temperature); the model's attention
exchanges heads for sequence; ``prepare_model_outputs`` all-gathers the log-probs, entropy or values
and drops the pad. verl's attention hook replaces only transformers' flash-attention forward, so with
``sdpa`` or ``eager`` attention each rank attends over its own rows only, silently.

``patch()`` hooks four places (:data:`cpshard.compat.verl.sites.FSDP`), the engine's code unchanged:

- ``apply_monkey_patch`` (where the engine binds it): checks that ``R`` divides ``sp`` and that the
  query heads divide by ``sp / R``; verl's patches then run as for one rank (its Ulysses hook is for
  flash-attention, and its head checks for the whole group), and a language model's attention becomes ``"cpshard"``
  (:mod:`cpshard.compat.hf`): the Ulysses exchange, the ring all-gather of keys and values, the
  documents' causal attention, with any kernel (``sdpa`` on the CPU), key/value heads repeated only as
  the Ulysses axis needs. A vision-language model keeps verl's attention and patches (and refuses ``R > 1``).
- ``FSDPEngine._init_device_mesh`` (every rank of the world, together, after verl made its groups):
  checks that ``R`` divides ``sp``; at ``R > 1`` splits verl's SP group into the ring and Ulysses
  groups (:func:`cpshard.distributed.axes.split_axes`), once per engine.
- ``FSDPEngineWithLMHead.prepare_model_inputs``: from the micro-batch's document lengths, the two-axis
  plan (``ShardPlan.build(lengths, cp_size=R, tp_size=sp / R, padding="minimal")``, ``CPSHARD_LAYOUT``'s
  layout; at ``R = 1`` the contiguous one without reordering, which is verl's own slicing: ``sp``
  consecutive pieces, the pad at the end) and ``sp.attend`` over it, held until the next micro-batch
  or the end of ``forward_backward_batch`` (so that a backward, and gradient checkpointing's
  recomputation inside it, still attends). At ``R > 1`` the micro-batch also runs inside
  :func:`~cpshard.compat.verl._ulysses.ring_rows`: verl's pad-and-slice calls cut the rolled row, the
  positions and the temperature by the plan (pad 0: the plan's pad rows are its own), and its gathers
  restore log-probs, entropy and values through the plan, with verl's gradient (this rank's own rows,
  times ``sp`` under ``grad_scaler``). A static pad (``pad_to_length``) is one more document of the plan.
- ``FSDPEngine.forward_backward_batch``: closes the last micro-batch's attention.

Every rank of verl's SP group computes the same loss from the restored outputs, as under verl's
Ulysses, so the gradients FSDP averages are verl's.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from cpshard.base.errors import fail
from cpshard.compat.verl import _layout
from cpshard.compat.verl._ulysses import ring_rows

__all__ = ["ENV", "EngineAxes", "RingRows", "current_ring", "describe_ring", "hooks", "ring_setting", "set_ring"]

ENV = "CPSHARD_RING"
_RING = [1]  # the ring size of the patch in force
_STATE = "_cpshard_fsdp"  # the engine's attribute: its EngineAxes


def ring_setting(ring: Any = None) -> int:
    """The ring size: ``ring`` (``patch(ring=...)``), else ``CPSHARD_RING`` (unset: 1). Not a positive
    integer: ``ValueError`` naming where it came from."""
    name, raw = ("ring", ring) if ring is not None else (ENV, os.environ.get(ENV))
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return 1
    try:
        value = int(raw.strip()) if isinstance(raw, str) else raw
        ok = not isinstance(value, bool) and isinstance(value, int) and value >= 1
    except ValueError:
        ok = False
    if not ok:
        fail(name, repr(raw), "must be a positive integer: the ring ranks of verl's Ulysses group (it must divide "
             "ulysses_sequence_parallel_size)", f"set {ENV}=1 (plain Ulysses), or a divisor of the SP size, e.g. 2")
    return value


def describe_ring(ring: int) -> str:
    """The ring size in words (the log line, the status command)."""
    if ring == 1:
        return f"{ENV} unset or 1: plain Ulysses, attention by cpshard"
    return f"{ENV}={ring}: verl's SP group as {ring} ring ranks x sp / {ring} Ulysses ranks"


def set_ring(ring: int) -> int:
    """Install the ring size of a patch; returns the one it replaced."""
    old, _RING[0] = _RING[0], ring
    return old


def current_ring() -> int:
    return _RING[0]


def _misfit(what: str, value: Any, rule: str, fix: str) -> None:
    fail(ENV, f"{current_ring()} ({what} {value})", rule, fix)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` (verl's ``grad_scaler``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: int) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.factor, None


class RingRows:
    """The two-axis rows of one micro-batch, as verl's pad-and-slice and gather calls see them at ``R > 1``.

    ``seq``: the :class:`cpshard.compat.hf.SequenceParallel` of the two axes; ``batch``: this rank's
    :class:`~cpshard.compat.hf.SequenceBatch` of the micro-batch; ``sp``: verl's SP size. Inside
    ``with cpshard.compat.verl.ring_rows(rows):`` verl's ``ulysses_pad_and_slice_inputs`` cuts by the plan
    (``slice``), ``gather_outputs_and_unpad`` restores through it (``gather``), and the other four Ulysses
    helpers, called without ``group=``, raise (``refuse``). The FSDP engine's wrapper opens it per
    micro-batch; an engine of one's own may too."""

    def __init__(self, seq: Any, batch: Any, sp: int) -> None:
        self.seq, self.batch, self.sp = seq, batch, sp

    def refuse(self, fn: str) -> None:
        fail(ENV, f"{self.seq.ring_size} (ring) x {self.seq.ulysses_size} (Ulysses)",
             f"verl's {fn} has no two-axis meaning (it slices or exchanges verl's whole SP group), and this "
             "micro-batch is laid out by cpshard's plan", f"unset {ENV} (plain Ulysses) for this model or path")

    def _tokens(self, name: str, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != self.batch.plan.num_tokens:
            fail(name, f"a tensor of shape {tuple(x.shape)}", f"must be the micro-batch's packed row (1, "
                 f"{self.batch.plan.num_tokens}) under {ENV}={self.seq.ring_size}", "pass the packed row")

    def slice(self, x: torch.Tensor, positions: Any, sp_size: int, skip: bool,
              pad_value: Any) -> tuple[torch.Tensor, Any, int]:
        if sp_size != self.sp:
            fail("sp_size", sp_size, f"must be verl's SP size {self.sp} under {ENV}={self.seq.ring_size}",
                 "pass the engine's ulysses_sequence_parallel_size")
        self._tokens("input_ids_rmpad", x)
        out = self.batch.shard(x, pad_value=pad_value)
        if positions is not None and not skip:
            self._tokens("position_ids_rmpad", positions)
            positions = self.batch.shard(positions)
        return out, positions, 0

    def gather(self, x: torch.Tensor, gather_dim: int, unpad_dim: Any, padding_size: int,
               grad_scaler: bool) -> torch.Tensor:
        rows = self.batch.plan.local_len // self.batch.plan.tp_size
        if x.dim() < 1 or gather_dim % x.dim() != 0 or x.shape[0] != rows:
            fail("x", f"a tensor of shape {tuple(x.shape)} gathered along {gather_dim}", f"must be this rank's {rows} "
                 f"rows along dimension 0 under {ENV}={self.seq.ring_size}", "gather the per-token outputs")
        if grad_scaler:
            x = _ScaleGrad.apply(x, self.sp)
        out = self.seq.restore(x[None], self.batch)[0]
        if unpad_dim is not None and padding_size:
            out = out.narrow(0, 0, out.size(0) - padding_size)
        return out


class EngineAxes:
    """One engine's cpshard state: its ``SequenceParallel``, the SP size, and the micro-batch's open contexts."""

    def __init__(self, seq: Any, sp: int) -> None:
        self.seq, self.sp = seq, sp
        self.open: list[Any] = []

    def close(self) -> None:
        while self.open:
            self.open.pop().__exit__(None, None, None)

    def enter(self, micro_batch: Any, static_pad: int) -> None:
        from cpshard.compat.hf import SequenceBatch
        from cpshard.plan.values import ShardPlan

        self.close()
        ids = micro_batch["input_ids"]
        if not getattr(ids, "is_nested", False):
            fail("input_ids", "a padded batch", f"must be verl's no-padding (nested) micro-batch under cpshard's "
                 f"sequence parallelism (sp = {self.sp})", "set use_remove_padding=True (verl's default)")
        lengths = ids.offsets().diff().tolist() + ([static_pad] if static_pad else [])
        seq = self.seq
        if seq.ring_size == 1:  # verl's own slicing: consecutive pieces, the pad at the end
            plan = ShardPlan.build(lengths, cp_size=1, tp_size=self.sp, layout="contiguous", padding="minimal")
        else:
            plan = seq.plan(lengths)
        batch = SequenceBatch(input_ids=None, position_ids=None, labels=None, plan=plan, ring_rank=seq.ring_rank,
                              ulysses_rank=seq.ulysses_rank, sp=seq)
        contexts = [seq.attend(batch)]
        if seq.ring_size > 1:
            contexts.append(ring_rows(RingRows(seq, batch, self.sp)))
        for ctx in contexts:
            ctx.__enter__()
            self.open.append(ctx)


def _axes(engine: Any) -> EngineAxes | None:
    return getattr(engine, _STATE, None)


def _heads(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_attention_heads)


def monkey_hook(original: Any) -> Any:
    """verl's ``apply_monkey_patch``, its checks for the Ulysses axis, then the ``"cpshard"`` attention."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_monkey_patch(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sp, model, ring = int(bound.arguments["ulysses_sp_size"] or 1), bound.arguments["model"], current_ring()
        if sp <= 1:
            return original(*args, **kwargs)
        if sp % ring:
            _misfit("ulysses_sequence_parallel_size", sp, "must be a multiple of the ring size",
                    f"set {ENV} to a divisor of {sp}")
        heads = _heads(model.config)
        ulysses = sp // ring
        if heads % ulysses:
            _misfit("num_attention_heads", heads, f"must leave the Ulysses axis sp / {ENV} = {sp} / {ring} = "
                    f"{ulysses} dividing the model's {heads} attention heads",
                    f"set {ENV} so that {sp} / {ENV} divides {heads}")
        vlm = hasattr(model.config, "vision_config")
        if vlm and ring > 1:
            _misfit("model", type(model).__name__, "a vision-language model keeps verl's Ulysses input slicing, "
                    "which has no ring axis", f"unset {ENV} for this model")
        # a language model's attention is cpshard's (its own head checks above, key/value heads repeated as
        # the Ulysses axis needs): verl's Ulysses-only patches and checks are for its flash hook
        bound.arguments["ulysses_sp_size"] = sp if vlm else 1
        out = original(*bound.args, **bound.kwargs)
        if not vlm:
            from cpshard.compat.hf import NAME

            model.set_attn_implementation(NAME)
        return out

    return apply_monkey_patch


def mesh_hook(original: Any) -> Any:
    """verl's ``FSDPEngine._init_device_mesh``, then the fit check and the two axes (Note [verl's FSDP engine on
    cpshard])."""

    @functools.wraps(original)
    def _init_device_mesh(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        from cpshard.compat.hf import SequenceParallel

        sp, ring = int(self.ulysses_sequence_parallel_size), current_ring()
        if sp % ring:
            _misfit("ulysses_sequence_parallel_size", sp, f"must be a multiple of {ENV} (the ring ranks of verl's "
                    "Ulysses group)", f"set {ENV} to a divisor of {sp}, or ulysses_sequence_parallel_size to a "
                    f"multiple of {ring}")
        setattr(self, _STATE, None)
        if sp > 1:
            layout = _layout.current().override
            layout = "zigzag" if layout is None else layout.value
            if ring == 1:  # verl's own slicing (EngineAxes.enter): consecutive pieces, the pad at the end
                seq = SequenceParallel(None, self.ulysses_parallel_group, layout="contiguous", padding="minimal")
            else:
                from cpshard.distributed.axes import split_axes

                seq = SequenceParallel(*split_axes(self.ulysses_parallel_group, ring), layout=layout)
            setattr(self, _STATE, EngineAxes(seq, sp))
        return out

    return _init_device_mesh


def prepare_hook(original: Any) -> Any:
    """verl's ``prepare_model_inputs`` inside the micro-batch's plan (Note [verl's FSDP engine on cpshard])."""

    @functools.wraps(original)
    def prepare_model_inputs(self: Any, micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        axes = _axes(self)
        if axes is not None:
            from verl.utils import tensordict_utils as tu

            if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
                fail("use_remove_padding", "False", f"is not supported under cpshard's sequence parallelism (sp = "
                     f"{axes.sp}): the attention reads the packed row's documents", "set use_remove_padding=True "
                     "(verl's default)")
            ids = micro_batch["input_ids"]
            total = int(ids.offsets()[-1]) if getattr(ids, "is_nested", False) else 0
            static = self._get_packed_pad_size(total) if hasattr(self, "_get_packed_pad_size") else 0
            axes.enter(micro_batch, int(static))
        return original(self, micro_batch, *args, **kwargs)

    return prepare_model_inputs


def batch_hook(original: Any) -> Any:
    """verl's ``forward_backward_batch``, then the last micro-batch's attention closed."""

    @functools.wraps(original)
    def forward_backward_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            axes = _axes(self)
            if axes is not None:
                axes.close()

    return forward_backward_batch


def hooks() -> dict[str, Any]:
    """``{attribute: the wrapper maker}`` of the FSDP sites (:data:`cpshard.compat.verl.sites.FSDP`)."""
    return {"apply_monkey_patch": monkey_hook, "_init_device_mesh": mesh_hook,
            "prepare_model_inputs": prepare_hook, "forward_backward_batch": batch_hook}
