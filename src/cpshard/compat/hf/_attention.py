"""The ``"cpshard"`` attention of a Hugging Face model under ``sp.attend(batch)``: the Ulysses exchange,
the ring all-gather of keys and values, the documents' causal attention (the layer's window where it has
one) of this ring rank's query rows, and the exchange back.

Note [One layer's attention under R x U ranks]
-----------------------------------------------
transformers calls ``attention(module, query, key, value, attention_mask, scaling=, dropout=,
sliding_window=, ...)`` with ``(1, H, L / U, D)`` query rows (``Hkv`` heads for key and value) and
takes ``(1, L / U, H, D)`` back. Per layer:

1. Key/value heads are repeated only as far as the exchange needs: to ``lcm(Hkv, U)`` heads (each head
   ``f = U / gcd(Hkv, U)`` times, in place, so that query head ``h`` still reads the copies of its own
   group's head). ``H`` must be divisible by ``U``; nothing else is.
2. ``exchange_dims`` over the Ulysses group: heads scattered, sequence gathered. The pieces arrive in
   group-rank order, which is the order of Note [The two-axis layout]: each rank now holds its ring
   rank's ``L`` rows for ``H / U`` heads. Keys and values travel in one message (concatenated on ``D``).
3. ``all_gather_dim`` of keys and values over the ring group (``grad="sum"``: every ring rank's queries
   read every ring rank's keys, so their gradients are summed back): ``R * L`` key rows, ring-rank order.
4. The attention of the ``L`` query rows over the ``R * L`` key rows, allowed where both rows are
   tokens of one document and ``0 <= pos_q - pos_k < window`` (``window`` infinite on full layers):
   the plan's sequence ids, positions and token masks of every ring rank say which. A query row with
   no allowed key (a pad row) attends to every key and its output is then set to zero, so that no
   softmax of an empty row (NaN) reaches a gradient. The kernels: ``"sdpa"`` (the boolean mask, any
   device: the reference), ``"flex"`` (the same rule as a ``BlockMask``), ``"flash"`` (flash-attn's
   varlen kernel on the segments ``cpshard.plan.varlen.varlen_metadata`` cuts from the plan).
5. ``exchange_dims`` back: sequence scattered, heads gathered.

The gathered keys are tied to the output (``joined``), so a ring rank whose rows are all pads still makes
the gather's backward collective. Backward needs no context: the masks live in the autograd graph.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.base.errors import fail
from cpshard.distributed.collectives import joined
from cpshard.plan.causal import attention_mask
from cpshard.plan.values import ShardPlan

__all__ = ["KERNELS", "Attending", "active", "attention_forward", "repeat_factor"]

KERNELS = ("auto", "sdpa", "flex", "flash")

_ACTIVE: list[Attending] = []


def active() -> Attending | None:
    """The innermost ``sp.attend(batch)`` in force, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def repeat_factor(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times each key/value head is repeated for ``U`` Ulysses ranks (1: none): to ``lcm(Hkv, U)``
    heads. ``ValueError`` where the query heads do not divide by ``U``."""
    if heads % ulysses:
        fail("ulysses_group", f"a group of {ulysses} ranks", f"must divide the model's attention heads "
             f"(num_attention_heads={heads}, key/value heads {kv_heads}): the Ulysses exchange gives each rank "
             f"H / U heads", "move ranks from the Ulysses axis to the ring axis (cp_group), e.g. U = "
             f"{math.gcd(heads, ulysses)} and a ring axis {ulysses // math.gcd(heads, ulysses)} times larger")
    if kv_heads < 1 or heads % kv_heads:
        fail("key", f"{kv_heads} key/value heads", f"must divide the {heads} query heads (grouped-query attention)",
             "pass the model's key and value states as its attention computes them")
    return ulysses // math.gcd(kv_heads, ulysses)


class Attending:
    """What one ``sp.attend(batch)`` holds: the groups, the ring plan, this rank's place, the kernel, and
    the masks built once per window on first use (they serve every layer of the step)."""

    def __init__(self, sp: Any, batch: Any, kernel: str) -> None:
        self.sp, self.batch, self.kernel = sp, batch, kernel
        self.plan: ShardPlan = batch.plan
        self.built: dict[tuple[str, int | None, torch.device], Any] = {}
        self.positions_seen: list[torch.Tensor] = []  # the model's position ids found equal to the batch's

    def check_positions(self, position_ids: Any) -> None:
        """The position ids the model hands its layers (transformers passes them on) must be the batch's: without
        them transformers makes ``arange(L / U)``, another part of the row's RoPE positions on every rank. Compared
        once per tensor (the layers share it); a model that hands none on, or ids of another shape (multimodal
        RoPE's ``(3, 1, L / U)``), is not checked."""
        own = self.batch.position_ids
        if own is None or not isinstance(position_ids, torch.Tensor) or position_ids.shape != own.shape or \
                any(position_ids is t for t in self.positions_seen):
            return
        if torch.equal(position_ids.to(own.device, own.dtype), own):
            self.positions_seen.append(position_ids)
            return
        fail("position_ids", f"tensor of shape {tuple(position_ids.shape)} ({position_ids.flatten()[:6].tolist()}"
             " ...)", "must be the batch's position ids (each token's position in its document)",
             "run the model with position_ids=batch.position_ids")

    def __enter__(self) -> Attending:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)

    # -- which keys a query row reads --------------------------------------------------------

    def rows(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Every ring rank's sequence ids, positions and token masks ``(R * L,)`` (the gathered keys' rows),
        and the query rows' start in them."""
        key = ("rows", None, device)
        if key not in self.built:
            plan = self.plan
            ranks = range(plan.cp_size)
            seq = torch.cat([plan.sequence_ids(s) for s in ranks]).to(device)
            pos = torch.cat([plan.position_ids(s) for s in ranks]).to(device)
            tok = torch.cat([plan.token_mask(s) for s in ranks]).to(device)
            self.built[key] = (seq, pos, tok)
        return self.built[key]

    def query_slice(self) -> slice:
        L = self.plan.local_len
        return slice(self.batch.ring_rank * L, (self.batch.ring_rank + 1) * L)

    def allowed(self, window: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, R * L)`` bool: the keys each query row reads (an empty row reads every key), and ``(L,)``
        bool: the query rows that read none (pad rows), whose output is zero."""
        key = ("sdpa", window, device)
        if key not in self.built:
            allowed = attention_mask(self.plan, self.batch.ring_rank, window).to(device)
            empty = ~self.plan.token_mask(self.batch.ring_rank).to(device)  # a token row reads at least itself
            self.built[key] = (allowed | empty[:, None], empty)
        return self.built[key]

    def block_mask(self, window: int | None, device: torch.device) -> tuple[Any, torch.Tensor]:
        """The same rule as a flex-attention ``BlockMask`` (no dense mask), and the empty query rows."""
        key = ("flex", window, device)
        if key not in self.built:
            from torch.nn.attention.flex_attention import create_block_mask

            seq, pos, tok = self.rows(device)
            q = self.query_slice()
            sq, pq, tq = seq[q], pos[q], tok[q]
            empty = ~tq  # a token row reads at least itself

            def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
                ok = (sq[qi] == seq[ki]) & (pos[ki] <= pq[qi]) & tok[ki] & tq[qi]
                if window is not None:
                    ok = ok & (pq[qi] - pos[ki] < window)
                return ok | empty[qi]

            L = self.plan.local_len
            mask = create_block_mask(mask_mod, None, None, L, self.plan.cp_size * L, device=device)
            self.built[key] = (mask, empty)
        return self.built[key]

    def varlen(self, window: int | None, device: torch.device) -> Any:
        """flash-attn's varlen metadata of this ring rank (``cpshard.plan.varlen``), and the empty rows."""
        key = ("flash", window, device)
        if key not in self.built:
            from cpshard.plan.varlen import varlen_metadata  # the other half of issue 42: imported on first use

            meta = varlen_metadata(self.plan, self.batch.ring_rank, window=window, device=device)
            self.built[key] = meta
        return self.built[key]

    # -- the layer ----------------------------------------------------------------------------

    def kernel_for(self, q: torch.Tensor) -> str:
        if self.kernel != "auto":
            return self.kernel
        if not q.is_cuda:
            return "sdpa"
        return "flash" if importlib.util.find_spec("flash_attn") is not None else "flex"

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               window: int | None) -> torch.Tensor:
        """Note [One layer's attention under R x U ranks]: ``(1, H, L / U, D)`` in, ``(1, L / U, H, D)`` out."""
        from cpshard.distributed.ulysses import all_gather_dim, exchange_dims

        plan, sp = self.plan, self.sp
        U = plan.tp_size
        if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != plan.local_len // U:
            fail("query", f"tensor of shape {tuple(query.shape)}", f"must be (1, heads, L / U, head_dim) with "
                 f"L / U = {plan.local_len // U}, this rank's rows of the batch given to sp.attend",
                 "run the model on batch.input_ids and batch.position_ids of the batch passed to sp.attend")
        if key.shape[:1] + key.shape[2:] != query.shape[:1] + query.shape[2:] or value.shape != key.shape:
            fail("key", f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}",
                 "must have the query's batch, rows and head size", "pass the layer's own states")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            fail("key", f"query {query.dtype}, key {key.dtype}, value {value.dtype}", "must have the query's dtype",
                 "pass the layer's own states (cast to one dtype)", kind=TypeError)
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
        f = repeat_factor(heads, kv_heads, U)
        if f > 1:
            key, value = key.repeat_interleave(f, dim=1), value.repeat_interleave(f, dim=1)
        q = exchange_dims(query, sp.ulysses_group, scatter_dim=1, gather_dim=2, plan=plan)
        kv = exchange_dims(torch.cat([key, value], -1), sp.ulysses_group, scatter_dim=1, gather_dim=2, plan=plan)
        kv = all_gather_dim(kv, sp.cp_group, dim=2, grad="sum", plan=plan)
        k, v = kv.split(dim, -1)
        scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
        out = _KERNELS[self.kernel_for(q)](self, q, k, v, scale, window)
        out = joined(out, kv)
        out = exchange_dims(out, sp.ulysses_group, scatter_dim=2, gather_dim=1, plan=plan)
        return out.transpose(1, 2)


def _sdpa(ctx: Attending, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          window: int | None) -> torch.Tensor:
    allowed, empty = ctx.allowed(window, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.masked_fill(empty[:, None], 0)


def _flex(ctx: Attending, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          window: int | None) -> torch.Tensor:
    mask, empty = ctx.block_mask(window, q.device)
    out = _flex_kernel(q.is_cuda)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(empty[:, None], 0)


_COMPILED: list[Any] = []


def _flex_kernel(cuda: bool) -> Any:
    """torch's ``flex_attention``: compiled once on CUDA (its fused kernel; uncompiled it materializes every
    score, as transformers' flex integration also compiles it), eager elsewhere (the CPU: forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not cuda:
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def _flash(ctx: Attending, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window: int | None) -> torch.Tensor:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        fail("kernel", "'flash'", "needs flash-attn (flash_attn_varlen_func) and a CUDA device",
             "pip install flash-attn on a GPU machine, or pass kernel='sdpa' or 'flex'", kind=ImportError)
    meta = ctx.varlen(window, q.device)
    rows_q, rows_k, rows_v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # (rows, heads, D)
    part = rows_q[meta.q_index]  # a rank without a token calls no kernel (its graph still reads q, as its peers')
    if meta.num_segments:
        part = flash_attn_varlen_func(part, rows_k[meta.k_index], rows_v[meta.k_index], meta.cu_seqlens_q,
                                      meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, dropout_p=0.0,
                                      softmax_scale=scale, causal=True, window_size=meta.window_size)
    out = rows_q.new_zeros(rows_q.shape).index_copy(0, meta.q_index, part)  # pad rows: zeros
    return out.transpose(0, 1).unsqueeze(0)


_KERNELS = {"sdpa": _sdpa, "flex": _flex, "flash": _flash}

_REFUSED = {
    "softcap": "a logit soft-cap (Gemma 2's attn_logit_softcapping)",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks",
}


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, *, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for ``attn_implementation="cpshard"``: Note [One layer's attention
    under R x U ranks]. Refuses (naming it) what would change the result and is not supported."""
    ctx = active()
    if ctx is None:
        raise RuntimeError("attn_implementation='cpshard' runs only inside `with sp.attend(batch):` (cpshard.compat"
                           ".hf.SequenceParallel): outside it this rank holds a piece of the packed row and a local "
                           "attention would be silently wrong. Fix: wrap the forward in `with sp.attend(batch):`, "
                           "or set another attn_implementation for a model run on whole documents. Under gradient "
                           "checkpointing the backward recomputes the forward: call loss.backward() inside the "
                           "`with sp.attend(batch):` block.")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            fail(name, repr(kwargs[name]), f"{what} is not supported by the 'cpshard' attention",
                 "train this model with another attention, or without the argument")
    if dropout:
        fail("dropout", repr(dropout), "attention dropout is not supported by the 'cpshard' attention (it would "
             "draw other masks than one process)", "set the config's attention_dropout=0.0")
    if kwargs.get("output_attentions"):
        fail("output_attentions", "True", "the 'cpshard' attention returns no weights", "pass output_attentions=False")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        fail("is_causal", "False", "the 'cpshard' attention is the documents' causal attention",
             "use it for causal language models only")
    if attention_mask is not None:
        fail("attention_mask", f"a {type(attention_mask).__name__}", "must be None under the 'cpshard' attention: "
             "the documents' causal mask comes from the plan (a dense mask given to the model is another rule)",
             "pass no attention_mask to the model (the packed documents come from position_ids)")
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1
                                       or int(sliding_window) != sliding_window):  # 2.5 is not taken as 2
        fail("sliding_window", repr(sliding_window), "must be a window of >= 1 tokens (a whole number) or None",
             "fix the model config's sliding_window")
    window = None if sliding_window is None else int(sliding_window)
    ctx.check_positions(kwargs.get("position_ids"))
    return ctx.attend(query, key, value, scaling, window), None
