"""``SequenceParallel``: the groups of the two axes, checked once; ``shard``, ``attend``, ``loss`` and
``restore`` of one packed micro-batch (Note [The two-axis layout], Note [One layer's attention under R x U
ranks], Note [The loss over R x U ranks])."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.base.convention import GradReduction
from cpshard.base.errors import check_tensor, fail
from cpshard.base.layout import Layout
from cpshard.compat.hf._attention import KERNELS, Attending
from cpshard.compat.hf._batch import (SequenceBatch, build_plan, check_layout, check_padding, packed_rows,
                                    rank_batch)
from cpshard.distributed.agree import checks_enabled
from cpshard.distributed.checks import agree
from cpshard.distributed.collectives import gather_tokens
from cpshard.distributed.groups import group_ranks, group_size, read_group
from cpshard.loss.reductions import token_mean
from cpshard.plan.values import ShardPlan

__all__ = ["SequenceParallel"]

# Note [The loss over R x U ranks]
# --------------------------------
# Ulysses rank u holds L / U of its ring rank's L rows. Its per-token losses are placed at their rows of
# the ring rank's L (zeros and a False mask on its peers' rows) and handed to cpshard.loss.token_mean over
# the ring group with the Ulysses group as the count's second group (token_mean's dp_group: the count N
# is summed over both, so it is every labelled token of the micro-batch, and each rank returns
# R * U * s / N under "mean", s / N under "sum", s its own rows' sum). The returned values then average
# (sum) over the R * U ranks to the token mean, and since every rank's loss reads only its own rows,
# the gradients averaged (summed) over the R * U ranks are one process's: the gradient convention of
# cpshard.loss, unchanged. No logits cross ranks.


def _axis(mesh: Any, names: tuple[str, ...]) -> Any:
    dims = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    for name in names:
        if name in dims:
            return mesh.get_group(name)
    return None


class SequenceParallel:
    """Sequence parallelism of a Hugging Face causal LM over ``R`` ring ranks times ``U`` Ulysses ranks.

    Args:
        cp_group: the ring (context-parallel) group, ``R`` ranks; ``None``: ``R = 1``. A
            ``DeviceMesh`` with named dimensions is read for both axes instead: ``"cp"`` (or ``"ring"``)
            and ``"ulysses"`` (or ``"sp"``), an absent name meaning size 1.
        ulysses_group: the Ulysses (head-parallel) group, ``U`` ranks; ``None``: ``U = 1``. The two
            groups meet in this rank only: rank ``(r, u)`` is group rank ``r`` of its ring group and
            ``u`` of its Ulysses group.
        layout: ``"zigzag"`` (default) or ``"contiguous"`` (with the balanced order of documents).
        padding: the ring plan's padding (Note [Padding of the ring plan] in ``_batch.py``): ``"none"``
            (zigzag's default: no document padded, at most ``R * U - 1`` pad rows at the end) or
            ``"minimal"`` (zigzag: each document padded to a multiple of ``2 R``; contiguous's default,
            which pads no document either way).
        kernel: ``"auto"`` (on CUDA flash-attn's varlen kernel where it is installed, else ``"flex"``; elsewhere
            ``"sdpa"``), ``"sdpa"``, ``"flex"`` or ``"flash"``.
    """

    def __init__(self, cp_group: Any = None, ulysses_group: Any = None, *, layout: Layout | str = "zigzag",
                 padding: str | None = None, kernel: str = "auto") -> None:
        if cp_group is not None and hasattr(cp_group, "get_group") and hasattr(cp_group, "mesh_dim_names"):
            if ulysses_group is not None:
                fail("ulysses_group", repr(ulysses_group), "must be None when cp_group is a DeviceMesh (its "
                     "named dimensions give both axes)", "pass the mesh alone, or two process groups")
            mesh = cp_group
            cp_group, ulysses_group = _axis(mesh, ("cp", "ring")), _axis(mesh, ("ulysses", "sp"))
            if cp_group is None and ulysses_group is None:
                fail("cp_group", f"a DeviceMesh with dimensions {mesh.mesh_dim_names}", "must name a 'cp' (or "
                     "'ring') or 'ulysses' (or 'sp') dimension", "name the mesh's dimensions with "
                     "init_device_mesh(..., mesh_dim_names=('cp', 'ulysses'))")
        layout = check_layout(layout)
        if kernel not in KERNELS:
            fail("kernel", repr(kernel), f"must be one of {KERNELS}", "pass kernel='sdpa' on any device")
        self.layout, self.padding, self.kernel = layout, check_padding(padding, layout), kernel
        self.ring_size = 1 if cp_group is None else group_size(cp_group, "cp_group")
        self.ulysses_size = 1 if ulysses_group is None else group_size(ulysses_group, "ulysses_group")
        self.cp_group = cp_group if self.ring_size > 1 else None
        self.ulysses_group = ulysses_group if self.ulysses_size > 1 else None
        self.ring_rank = 0 if self.cp_group is None else int(read_group(self.cp_group, "rank"))
        self.ulysses_rank = 0 if self.ulysses_group is None else int(read_group(self.ulysses_group, "rank"))
        if self.cp_group is not None and self.ulysses_group is not None:
            ring, ulysses = group_ranks(self.cp_group), group_ranks(self.ulysses_group)
            shared = sorted(set(ring) & set(ulysses))
            if len(shared) != 1:
                fail("ulysses_group", f"the global ranks {list(ulysses)} (cp_group: {list(ring)})",
                     f"must meet the ring group in this rank only (they share {shared}): each axis is its own "
                     "set of ranks", "pass different groups, e.g. from init_device_mesh(..., (R, U), "
                     "mesh_dim_names=('cp', 'ulysses'))")

    def __repr__(self) -> str:
        return (f"SequenceParallel(R={self.ring_size}, U={self.ulysses_size}, layout={self.layout.value!r}, "
                f"padding={self.padding!r}, kernel={self.kernel!r}, rank=({self.ring_rank}, {self.ulysses_rank}))")

    # -- the batch --------------------------------------------------------------------------

    def plan(self, lengths: list[int]) -> ShardPlan:
        """The ring plan of documents of ``lengths`` (Note [The two-axis layout])."""
        return build_plan(list(lengths), self.ring_size, self.ulysses_size, self.layout.value, self.padding)

    def shard(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
              check: bool | None = None) -> SequenceBatch:
        """This rank's rows of a packed row ``(1, T)`` (identical on every rank): a :class:`SequenceBatch`.

        ``position_ids`` restart at 0 at each document (HF's padding-free collators); ``labels`` are
        unshifted, ``-100`` where ignored. No communication, except with checks on (``check=True``,
        ``cpshard.distributed.set_checks``): one small all-gather over each group first, so that ranks
        whose documents (or tokens) differ raise on every rank, naming the rank.
        """
        error, plan, rows = None, None, None
        try:
            plan, rows = packed_rows(input_ids, position_ids, labels, self.ring_size, self.ulysses_size,
                                     self.layout.value, self.padding)
        except (ValueError, TypeError) as exc:
            error = exc
        grouped = self.cp_group is not None or self.ulysses_group is not None
        if grouped and (check if check is not None else checks_enabled()):
            self._agree(plan, rows, error)
        if error is not None:
            raise error
        return rank_batch(plan, rows, self.ring_rank, self.ulysses_rank, self)

    def _agree(self, plan: ShardPlan | None, rows: Any, error: Exception | None) -> None:
        """The agreement of ``check=True`` over both groups (ring, then Ulysses, each rank carrying the
        ring's verdict into the second), so that every rank raises or none; the error names the global
        ranks of both groups, and a rank's own refusal is raised as it is."""
        call: dict[str, Any] = {"operation": "hf.shard"}
        if error is None:
            call["tokens"] = zlib.crc32(b"".join(t.detach().cpu().numpy().tobytes() for t in rows if t is not None))
        own, found = error, None
        if self.cp_group is not None:
            try:
                agree(plan, self.cp_group, error, call)
            except (ValueError, TypeError) as exc:
                error = found = exc
        if self.ulysses_group is not None:
            # the same documents give the same plan of cp_size U: what the Ulysses peers compare
            twin = None if plan is None else ShardPlan.build(plan.input_seqlens_py, cp_size=self.ulysses_size,
                                                             layout="contiguous", padding="minimal")
            try:
                agree(twin, self.ulysses_group, error, call if error is None else {})
            except (ValueError, TypeError) as exc:
                found = found or exc
        if own is not None:
            raise own
        if found is not None:
            ring = None if self.cp_group is None else list(group_ranks(self.cp_group))
            ulysses = None if self.ulysses_group is None else list(group_ranks(self.ulysses_group))
            raise ValueError(
                f"sp.shard(check=True): the packed rows (documents or tokens) differ across the sequence-parallel "
                f"ranks, or a rank refused its own (this is ring rank {self.ring_rank}, Ulysses rank "
                f"{self.ulysses_rank}; ring group = global ranks {ring}, Ulysses group = global ranks {ulysses}; "
                f"the ranks below are group ranks): {found}") from found

    def _check_batch(self, batch: Any) -> SequenceBatch:
        if not isinstance(batch, SequenceBatch):
            fail("batch", f"a {type(batch).__name__}", "must be what sp.shard returned", "pass sp.shard(...)'s batch",
                 kind=TypeError)
        plan = batch.plan
        if (plan.cp_size, plan.tp_size) != (self.ring_size, self.ulysses_size) or \
                (batch.ring_rank, batch.ulysses_rank) != (self.ring_rank, self.ulysses_rank):
            fail("batch", f"a batch for R={plan.cp_size}, U={plan.tp_size} at rank ({batch.ring_rank}, "
                 f"{batch.ulysses_rank})", f"must be sharded for this SequenceParallel's R={self.ring_size}, "
                 f"U={self.ulysses_size} at rank ({self.ring_rank}, {self.ulysses_rank})",
                 "shard the batch with the same SequenceParallel")
        if (plan.layout, plan.padding.value) != (self.layout, self.padding):
            fail("batch", f"a batch of layout={plan.layout.value!r}, padding={plan.padding.value!r}",
                 f"must be sharded with this SequenceParallel's layout={self.layout.value!r}, "
                 f"padding={self.padding!r}", "shard the batch with the same SequenceParallel (or shard_row with "
                 "its layout and padding)")
        return batch

    # -- attention, loss, restore -------------------------------------------------------------

    def attend(self, batch: SequenceBatch) -> Attending:
        """``with sp.attend(batch):`` the ``"cpshard"`` attention of every layer computes ``batch``'s
        documents' causal attention over all ranks (Note [One layer's attention under R x U ranks])."""
        return Attending(self, self._check_batch(batch), self.kernel)

    def loss(self, logits: torch.Tensor, batch: SequenceBatch, *,
             grad_reduction: GradReduction | str = GradReduction.MEAN, check: bool | None = None) -> torch.Tensor:
        """This rank's share of the token-mean cross entropy over every labelled token of the micro-batch
        (Note [The loss over R x U ranks]): averaged over the ``R * U`` ranks (``"sum"``: summed), the
        values are the micro-batch's mean and the gradients one process's. ``logits`` ``(1, L / U, V)``
        (float16/bfloat16 are taken in float32). One small all-reduce over each group."""
        batch = self._check_batch(batch)
        if batch.labels is None:
            fail("batch", "a batch sharded without labels", "must carry labels for the loss",
                 "pass labels to sp.shard")
        logits = check_tensor("logits", logits)
        rows = batch.labels.shape[1]
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (1, rows):
            fail("logits", f"tensor of shape {tuple(logits.shape)}", f"must be (1, {rows}, vocab): this rank's rows",
                 "pass the model's logits for batch.input_ids")
        if not logits.is_floating_point():
            fail("logits", f"a {logits.dtype} tensor", "must be floating", "pass the model's logits", kind=TypeError)
        if batch.max_label >= logits.shape[2]:  # the whole row's largest label: every rank raises, before a collective
            fail("logits", f"a vocabulary of {logits.shape[2]}", f"must hold every label's class (the packed row has "
                 f"label {batch.max_label})", "pass the model's logits, or labels below its vocab_size")
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        labels = batch.labels[0].to(logits.device)
        per_token = F.cross_entropy(logits[0], labels, ignore_index=-100, reduction="none")
        plan, u = batch.plan, batch.ulysses_rank
        before, after = u * rows, (plan.tp_size - u - 1) * rows
        values = F.pad(per_token, (before, after))
        mask = F.pad(labels != -100, (before, after))
        return token_mean(values, mask, plan, self.cp_group, grad_reduction=grad_reduction,
                          dp_group=self.ulysses_group, check=check)

    def restore(self, x: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
        """``batch.restore(x)``: every rank's ``(1, L / U, ...)`` rows as the packed row ``(1, T, ...)``."""
        from cpshard.distributed.ulysses import all_gather_dim

        batch = self._check_batch(batch)
        x = check_tensor("x", x)
        rows = batch.plan.local_len // batch.plan.tp_size
        if x.dim() < 2 or tuple(x.shape[:2]) != (1, rows):
            fail("x", f"tensor of shape {tuple(x.shape)}", f"must be (1, {rows}, ...): this rank's rows",
                 "pass the model's output for batch.input_ids")
        ring_rows = all_gather_dim(x, self.ulysses_group, dim=1, grad="own", plan=batch.plan)[0]
        return gather_tokens(ring_rows, batch.plan, self.cp_group)[None]
