"""The gloo ranks of tests/test_hf_distributed.py: transformers' Llama (grouped-query heads, one key/value
head) and Qwen2 (full and sliding-window layers) in float64 under ``cpshard.compat.hf.SequenceParallel``
for ``(R, U)`` in (2, 1), (1, 2), (2, 2), (3, 1), (1, 4), both layouts (zigzag under its default
``padding="none"`` and under ``"minimal"``), against one process running
each document alone: the loss, every parameter gradient averaged over the ``R x U`` ranks, and
``batch.restore(logits)``.

One spawned world of 5 ranks serves every sub-case; the sequence-parallel ranks are global ranks 1..4 (or
a part of them), so no group starts at global rank 0, and rank 0 only joins the group creation. Each
sub-case returns per rank what it checked (an assertion raises on its rank and ``run_ranks`` reports it).

Facts this relies on (transformers 5.10.4, torch 2.13): the models' RMSNorm takes its mean in float32
(``hidden_states.to(torch.float32)``), about 2e-7 off between row splits; ``_exact_norms`` makes it
float64 in every process (the reference too). The reference runs ``attn_implementation="sdpa"`` (eager
takes its softmax in float32).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cpshard.compat.hf as hf
from reference import ref_cumsum, ref_two_axis_rows

SP_RANKS = [1, 2, 3, 4]
SHAPES = [(2, 1), (1, 2), (2, 2), (3, 1), (1, 4)]
WINDOW = 4
#: the explicit rows: one-token documents, odd lengths, documents longer than the window
ROWS = [[1, 7, 13, 3, 1, 9], [11], [2, 1, 5]]
#: (layout, padding) of the grids: zigzag unpadded (its default), contiguous; zigzag "minimal" on ROWS[0]
PLANS = [("zigzag", "none"), ("contiguous", "minimal")]


def _exact_norms() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    LlamaRMSNorm.forward = forward
    Qwen2RMSNorm.forward = forward


@functools.cache
def model(kind: str):
    """A tiny float64 model, the same on every rank (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    _exact_norms()
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "qwen2":
        config = Qwen2Config(num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                             sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"], **common)
        return Qwen2ForCausalLM(config).double()
    heads = {"llama": 2, "llama_1kv": 1, "llama_6h": 3}[kind]
    if kind == "llama_6h":
        common["num_attention_heads"] = 6
        common["hidden_size"] = 36
    config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=heads, **common)
    return LlamaForCausalLM(config).double()


def row(lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """A packed row ``(1, T)``: token ids, position ids, unshifted labels (some ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[torch.rand(len(ids), generator=g) < 0.2] = -100
    return ids[None], pos[None], labels[None]


@functools.cache
def reference(kind: str, lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One process, each document alone: the token-mean loss, the logits ``(T, V)``, every gradient."""
    ids, pos, labels = row(list(lengths), seed)
    ref = copy.deepcopy(model(kind))
    count = 0
    parts, sums = [], []
    start = 0
    for n in lengths:
        doc, lab = ids[:, start:start + n], labels[0, start:start + n]
        logits = ref(input_ids=doc, position_ids=torch.arange(n)[None]).logits[0]
        target = torch.cat([lab[1:], torch.tensor([-100])])  # the next token of the same document
        sums.append(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
        count += int((target != -100).sum())
        parts.append(logits.detach())
        start += n
    loss = sum(sums) / max(count, 1) + sum((p * 0).sum() for p in ref.parameters())
    loss.backward()
    return loss.detach(), torch.cat(parts), [p.grad.clone() for p in ref.parameters()]


def groups(shape: tuple[int, int], members: tuple[int, ...]):
    """This rank's groups of an ``R x U`` layout of ``members`` (None off them); every layout's groups are
    made first, on every rank in one order (``dist.new_group`` is a collective of the world)."""
    return _every_group()[(shape, members)]


@functools.cache
def _every_group() -> dict:
    return {(shape, _members(shape)): _groups(shape, _members(shape)) for shape in SHAPES}


def _groups(shape: tuple[int, int], members: tuple[int, ...]):
    """Every rank creates every group of an ``R x U`` layout of ``members`` (rank ``(r, u)`` is
    ``members[r * U + u]``), in one order; returns this rank's ring group, Ulysses group and the group of
    all ``members`` (None where this rank is not in it)."""
    R, U = shape
    me = dist.get_rank()
    ring = ulysses = None
    for u in range(U):
        ranks = [members[r * U + u] for r in range(R)]
        g = dist.new_group(ranks) if R > 1 else None
        ring = g if me in ranks else ring
    for r in range(R):
        ranks = [members[r * U + u] for u in range(U)]
        g = dist.new_group(ranks) if U > 1 else None
        ulysses = g if me in ranks else ulysses
    every = dist.new_group(list(members))
    return (ring, ulysses, every) if me in members else None


def step(kind: str, shape: tuple[int, int], members: tuple[int, ...], layout: str, lengths: list[int], seed: int,
         kernel: str = "sdpa", broken: str | None = None, grad: bool = True, padding: str | None = None
         ) -> dict | None:
    """One step under ``R x U`` ranks; returns the largest differences from one process (None off the group).
    ``grad=False``: forward only (torch's flex attention has no backward on the CPU). ``padding``: the ring
    plan's (None: the layout's default)."""
    made = groups(shape, members)
    if made is None:
        return None
    ring, ulysses, every = made
    R, U = shape
    sp = hf.SequenceParallel(ring, ulysses, layout=layout, kernel=kernel, padding=padding)
    ids, pos, labels = row(lengths, seed)
    batch = sp.shard(ids, pos, labels)
    _rows_are_the_reference(batch, ids, pos, labels, lengths, layout)
    if broken == "ulysses":  # this rank takes its Ulysses peer's rows: a layout that breaks on purpose
        batch = _peer_piece(batch, ids, pos, labels)
    if broken == "chunks":  # each chunk boundary one row off: the unpadded chunks taken one row wrong
        batch = _rolled(batch, ids, pos, labels)
    net = copy.deepcopy(model(kind))
    net.set_attn_implementation("cpshard")
    with torch.set_grad_enabled(grad), sp.attend(batch):
        logits = net(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    loss = sp.loss(logits, batch)
    if grad:
        loss = loss + sum((p * 0).sum() for p in net.parameters())
        loss.backward()  # outside attend
    ref_loss, ref_logits, ref_grads = reference(kind, tuple(lengths), seed)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=every)
    mean /= R * U
    grad_err = 0.0
    for p, q in zip(net.parameters(), ref_grads if grad else (), strict=grad):
        g = p.grad.clone()
        dist.all_reduce(g, group=every)
        grad_err = max(grad_err, float(((g / (R * U)) - q).abs().max() / (q.abs().max() + 1e-30)))
    restored = batch.restore(logits.detach())
    return {"loss": float((mean - ref_loss).abs()), "grad": grad_err,
            "logits": float((restored[0] - ref_logits).abs().max()) if restored.shape[1] == ref_logits.shape[0]
            else float("inf")}


def _rows_are_the_reference(batch, ids, pos, labels, lengths, layout) -> None:
    """This rank's token ids, positions and shifted labels equal the naive reference, exactly."""
    cut = ref_cumsum(lengths)
    docs = [(ids[0, a:b], pos[0, a:b], labels[0, a:b]) for a, b in zip(cut[:-1], cut[1:])]
    R, U, r, u, order = batch.plan.cp_size, batch.plan.tp_size, batch.ring_rank, batch.ulysses_rank, batch.plan.order
    padding = batch.plan.padding.value
    if padding == "none":  # no document padded; fewer than R * U pad rows, at the end
        padded = list(batch.plan.input_padded_seqlens_py)
        assert padded[:-1] == lengths[:-1] and 0 <= padded[-1] - lengths[-1] < R * U, (padded, lengths)
    for got, which, shift, fill in ((batch.input_ids, 0, 0, 0), (batch.position_ids, 1, 0, 0),
                                    (batch.labels, 2, 1, -100)):
        want = ref_two_axis_rows([d[which] for d in docs], R, U, layout, r, u, order=order, shift=shift, fill=fill,
                                 padding=padding)
        assert torch.equal(got[0], want), (which, got, want)
    weights = torch.arange(ids.shape[1], dtype=torch.float64)[None, :, None].expand(1, -1, 3)
    for shift in (0, 2, -1):
        want = ref_two_axis_rows([weights[0, a:b] for a, b in zip(cut[:-1], cut[1:])], R, U, layout, r, u,
                                 order=order, shift=shift, fill=-1.0, padding=padding)
        assert torch.equal(batch.shard(weights, shift=shift, fill=-1.0)[0], want)


def _peer_piece(batch, ids, pos, labels):
    """The batch with the Ulysses pieces in reverse order (rank u holds piece U - 1 - u)."""
    from cpshard import shard

    plan, U = batch.plan, batch.plan.tp_size
    size = plan.local_len // U
    u = U - 1 - batch.ulysses_rank
    cut = slice(u * size, (u + 1) * size)
    r = batch.ring_rank
    return dataclasses.replace(
        batch, input_ids=shard(ids[0], plan, r)[cut][None], position_ids=shard(pos[0], plan, r)[cut][None],
        labels=shard(labels[0], plan, r, shift=1, fill=-100)[cut][None])


def _rolled(batch, ids, pos, labels):
    """The batch with its ring rank's rows rolled by one (every chunk boundary one row off), then cut."""
    from cpshard import shard

    plan, r, u = batch.plan, batch.ring_rank, batch.ulysses_rank
    size = plan.local_len // plan.tp_size
    cut = [torch.roll(x, 1)[u * size:(u + 1) * size][None]
           for x in (shard(ids[0], plan, r), shard(pos[0], plan, r), shard(labels[0], plan, r, shift=1, fill=-100))]
    return dataclasses.replace(batch, input_ids=cut[0], position_ids=cut[1], labels=cut[2])


def _members(shape: tuple[int, int]) -> tuple[int, ...]:
    return tuple(SP_RANKS[:shape[0] * shape[1]]) if shape != (3, 1) else (2, 3, 4)


def _settings(n: int):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


# -- the sub-cases (each returns per rank what the test asserts on) ------------------------------------


def shapes(rank: int, world: int) -> dict:
    """Llama and Qwen2 at every (R, U), both layouts, the explicit rows; zigzag under ``"minimal"`` on the
    first row (the rest of that grid is what main proved before ``"none"`` became the default)."""
    out = {}
    for kind in ("llama", "qwen2"):
        for shape in SHAPES:
            for layout, padding in [*PLANS, ("zigzag", "minimal")]:
                for seed, lengths in enumerate(ROWS if padding == "none" or layout == "contiguous" else ROWS[:1]):
                    got = step(kind, shape, _members(shape), layout, lengths, seed, padding=padding)
                    if got is not None:
                        out[(kind, shape, f"{layout}/{padding}", seed)] = got
    return out


def drawn(rank: int, world: int) -> dict:
    """Qwen2 at (2, 2) and (3, 1) on drawn document lengths (every rank draws the same, derandomized)."""
    out, drawn = {}, []

    @_settings(4)
    @given(st.lists(st.integers(1, 12), min_size=1, max_size=5),
           st.sampled_from([*PLANS, ("zigzag", "minimal")]))
    def check(lengths, plan):
        drawn.append(lengths)  # the seed: the same on every rank, whichever groups it belongs to
        for shape in ((2, 2), (3, 1)):
            got = step("qwen2", shape, _members(shape), plan[0], lengths, len(drawn), padding=plan[1])
            if got is not None:
                out[(tuple(lengths), plan, shape)] = got

    check()
    return out


def one_kv_head(rank: int, world: int) -> dict:
    """Llama with one key/value head at U = 2 (repeated to 2 before the exchange) and U = 4."""
    out = {}
    for shape in ((1, 2), (2, 2), (1, 4)):
        got = step("llama_1kv", shape, _members(shape), "zigzag", ROWS[0], 0)
        if got is not None:
            out[shape] = got
    return out


def flex(rank: int, world: int) -> dict:
    """The flex kernel (a BlockMask from the plan) at (2, 2), Qwen2's windows: forward only (torch 2.13's
    flex attention has no backward on the CPU)."""
    got = step("qwen2", (2, 2), _members((2, 2)), "zigzag", ROWS[0], 0, kernel="flex", grad=False)
    return {} if got is None else {"flex": got}


def flash(rank: int, world: int) -> dict:
    """The flash kernel's wiring (``varlen_metadata``'s segments, GQA heads, pad rows, gradients) at (2, 2)
    and (3, 1), both layouts, Qwen2's windows, through tests/fake_flash_attn.py (flash-attn's documented
    semantics on SDPA: the CUDA kernel itself is not run here)."""
    import fake_flash_attn

    fake_flash_attn.install()
    out = {}
    for shape in ((2, 2), (3, 1)):
        for layout, padding in [*PLANS, *([("zigzag", "minimal")] if shape == (3, 1) else [])]:
            got = step("qwen2", shape, _members(shape), layout, ROWS[0], 0, kernel="flash", padding=padding)
            if got is not None:
                out[(shape, f"{layout}/{padding}")] = got
    return out


def broken(rank: int, world: int) -> dict:
    """The Ulysses pieces in the wrong order; the unpadded zigzag's rows one row off (Qwen2's windows, at
    (3, 1)): the comparison must see each."""
    out = {}
    got = step("llama", (2, 2), _members((2, 2)), "zigzag", ROWS[0], 0, broken="ulysses")
    if got is not None:
        out["ulysses"] = got
    got = step("qwen2", (3, 1), _members((3, 1)), "zigzag", ROWS[0], 0, broken="chunks", grad=False)
    if got is not None:
        out["chunks"] = got
    return out


def refusals(rank: int, world: int) -> dict:
    """Bad configurations raise on every rank before any collective; with checks on, documents that differ
    on one rank raise on every rank, naming it."""
    made = groups((2, 2), _members((2, 2)))
    if made is None:
        return {}
    ring, ulysses, _ = made
    out = {}
    try:
        hf.SequenceParallel(ring, ring)
    except ValueError as exc:
        out["same"] = str(exc)
    sp = hf.SequenceParallel(ring, ulysses)
    ids, pos, labels = row(ROWS[0], 0)
    if dist.get_rank() == 3:  # the document of 13 tokens cut into 2 + 11 on this rank
        pos = pos.clone()
        pos[0, 10:21] = torch.arange(11)
    try:
        sp.shard(ids, pos, labels, check=True)
    except ValueError as exc:
        out["differ"] = str(exc)
    if dist.get_rank() == 2:  # the same documents, another token: the tokens' digest differs
        ids = ids.clone()
        ids[0, 0] += 1
    try:
        sp.shard(ids, *row(ROWS[0], 0)[1:], check=True)
    except ValueError as exc:
        out["tokens"] = str(exc)
    if dist.get_rank() == 4:  # a bad row on one rank: its own error there, every other rank names it
        try:
            sp.shard(ids, pos[:, 1:], labels, check=True)
        except ValueError as exc:
            out["refused"] = str(exc)
    else:
        try:
            sp.shard(*row(ROWS[0], 0), check=True)
        except ValueError as exc:
            out["refused"] = str(exc)
    sp = hf.SequenceParallel(*groups((1, 4), _members((1, 4)))[:2])
    batch = sp.shard(*row(ROWS[0], 0))
    net = copy.deepcopy(model("llama_6h"))
    net.set_attn_implementation("cpshard")
    try:
        with sp.attend(batch):
            net(input_ids=batch.input_ids, position_ids=batch.position_ids)
    except ValueError as exc:
        out["heads"] = str(exc)
    return out


def unchecked(rank: int, world: int) -> dict:
    """Checks off, rank 2's packed row holds other documents (same tokens, one document cut in two) at (1, 2):
    each rank's shard succeeds alone, and the first Ulysses exchange of the first layer raises on both ranks
    (the plan's header differs) instead of mixing rows."""
    made = groups((1, 2), _members((1, 2)))
    if made is None:
        return {}
    _, ulysses, _ = made
    ids, pos, labels = row(ROWS[0], 0)
    if dist.get_rank() == 2:
        pos = pos.clone()
        pos[0, 10:21] = torch.arange(11)
    sp = hf.SequenceParallel(None, ulysses)
    batch = sp.shard(ids, pos, labels, check=False)
    net = copy.deepcopy(model("llama"))
    net.set_attn_implementation("cpshard")
    try:
        with sp.attend(batch):
            net(input_ids=batch.input_ids, position_ids=batch.position_ids)
    except ValueError as exc:
        return {"raised": str(exc)}
    return {"returned": True}
