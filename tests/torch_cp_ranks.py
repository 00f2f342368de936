"""The gloo ranks of tests/test_torch_cp_distributed.py: torch's own context-parallel path (its shard,
unshard, CP block mask and K/V all-gather) driven by cpshard's load balancer, against cpshard.shard and
against cp = 1.

Each sub-case runs a hypothesis search inside every rank with ``derandomize=True``: every rank draws
the same examples, so their collectives match; a failing assertion raises on its rank (and
``run_ranks`` reports it). No shrinking (a rank that shrank alone would leave the others waiting).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from cpshard import ShardPlan, shard
from cpshard.compat import torch_cp
from strategies import torch_cp_batches, torch_cp_documents

warnings.filterwarnings("ignore", message=".*flex_attention.*")


def _settings(n: int):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _eager_block_masks() -> None:
    """torch's ``_create_cp_block_mask`` compiles ``create_block_mask`` on first use (about a minute per
    process on this CPU); hand it the eager function, the same computation, through the global it
    keeps the compiled one in. Its mask rewrite through the load balancer is torch's own either way."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    _attention._compiled_create_block_mask = create_block_mask


def _per_document(q, k, v, plans):
    """cp = 1: causal attention over each document alone ``(B, H, S, D)``; pad rows stay 0."""
    out = torch.zeros_like(q)
    for b, plan in enumerate(plans):
        start = 0
        for n, p in zip(plan.input_seqlens_py, plan.input_padded_seqlens_py):
            if n:
                s = slice(start, start + n)
                out[b, :, s] = F.scaled_dot_product_attention(q[b, :, s], k[b, :, s], v[b, :, s], is_causal=True)
            start += p
    return out


def _token_rows(plans) -> torch.Tensor:
    """``(B, S)`` bool: True on the buffer's token rows (the documents in ``to_buffer``'s layout)."""
    return torch_cp.to_buffer([[torch.ones(n, dtype=torch.bool) for n in plan.input_seqlens_py] for plan in plans],
                              plans, pad_value=False)


def _local_mask(plans, rank: int) -> torch.Tensor:
    """``(B, 1, L, S)`` bool: ``document_mask_mod`` for this rank's query rows against every rank's rows
    (the all-gathered K/V), both named through the rank-order indices."""
    order = torch_cp.rearrange_indices(plans)
    L = plans[0].local_len
    b = torch.arange(len(plans))[:, None, None]
    q_rows = order[:, rank * L:(rank + 1) * L, None]
    return torch_cp.document_mask_mod(plans)(b, 0, q_rows, order[:, None, :])[:, None]


def _explicit(world: int, layout: str, total: int | None = None):
    """One batch every sub-case runs first: two rows, documents of 0, 1, ``2 cp - 1`` and more tokens."""
    rows = [[5, 0, 1, 2 * world - 1, 9], [13, 3]]
    kw = dict(cp_size=world, layout=layout, reorder="balanced" if layout == "contiguous" else None)
    S = total or max(ShardPlan.build(r, **kw).total_len for r in rows)
    return [ShardPlan.build(r, **kw, total_len=S) for r in rows], rows


def _full_row(world: int, total: int | None = None):
    """A batch of full rows of ``S`` tokens (``6 cp`` unless ``total``) under unpadded zigzag: documents of
    1, ``2 cp - 1`` and more tokens, none dividing by ``2 cp`` in the second row, nothing padded
    (plans_from_positions' zigzag: ``padding="none"``)."""
    S = total or 6 * world
    rows = [[1, 2 * world - 1, S - 2 * world], [5, S - 8, 3]]
    positions = torch.tensor([[p for n in r for p in range(n)] for r in rows])
    plans = torch_cp.plans_from_positions(positions, cp_size=world, layout="zigzag")
    assert all(p.input_padded_seqlens_py == tuple(r) for p, r in zip(plans, rows))
    return plans, rows


def _search(world: int, examples: int, layout: str, check, total: int | None = None, longest: int = 12) -> int:
    """Run ``check(plans, seed)`` on the explicit batch of ``layout`` and on drawn batches (``examples``
    in all, the same on every rank); ``seed`` counts the batches checked before. Returns how many ran."""
    seen = []

    @_settings(examples)
    @given(torch_cp_batches(cps=(world,), total=total, longest=longest))
    @example(_explicit(world, layout, total))
    @example(_full_row(world, total))
    def search(batch):
        check(batch[0], len(seen))
        seen.append(len(batch[0]))

    search()
    return len(seen)


# -- sub-cases -----------------------------------------------------------------------------------


def shard_unshard(rank: int, world: int) -> int:
    """torch's ``_context_parallel_shard`` with the balancer gives each rank exactly ``cpshard.shard``'s
    rows of every batch row; ``context_parallel_unshard`` gives the buffer back bit for bit."""
    names = torch_cp.torch_names()
    mesh = _mesh(world)
    seen = []

    @_settings(8)
    @given(torch_cp_batches(cps=(world,)), st.sampled_from([(), (3,)]))
    @example(_explicit(world, "zigzag"), (3,))
    @example(_explicit(world, "contiguous"), ())
    @example(_full_row(world), (3,))
    def check(batch, trailing):
        plans, _ = batch
        docs = torch_cp_documents(plans, trailing)
        buffer = torch_cp.to_buffer(docs, plans, pad_value=-1)
        balancer = torch_cp.load_balancer(plans, mesh=mesh)
        local, = names._context_parallel_shard(mesh, [buffer], [1], load_balancer=balancer)
        for b, plan in enumerate(plans):
            assert torch.equal(local[b], shard(docs[b], plan, rank, pad_value=-1)), (b, plan)
        back, = names.context_parallel_unshard(mesh, [local], [1], load_balancer=balancer)
        assert torch.equal(back, buffer)
        seen.append(len(plans))

    check()
    return len(seen)


def cp_flex_attention(q, k, v, plans, mesh):
    """Document-causal flex attention of the caller's buffers ``q, k, v`` ``(B, H, S, D)`` under torch's
    context parallelism with cpshard's balancer; the ``(B, H, S, D)`` output, restored on every rank."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from cpshard.compat import torch_cp

    torch_names = torch_cp.torch_names()  # torch's own CP functions, checked once
    balancer = torch_cp.load_balancer(plans)
    B, S = len(plans), plans[0].total_len
    mask = create_block_mask(torch_cp.document_mask_mod(plans), B, 1, S, S, device="cpu")
    q, k, v, mask = torch_names._context_parallel_shard(mesh, [q, k, v, mask], [2, 2, 2, 2], load_balancer=balancer)
    k, v = torch_names.flex_cp_allgather(k, v, 2, mesh.get_group().group_name)  # every rank's K/V, as torchtitan
    out = flex_attention(q, k, v, block_mask=mask)  # the mask: this rank's rows, rewritten through the balancer
    return torch_names.context_parallel_unshard(mesh, [out], [2], load_balancer=balancer)[0]


def flex(rank: int, world: int) -> int:
    """flex_attention under CP (:func:`cp_flex_attention`: torch's CP block mask of ``document_mask_mod``
    rewritten through the balancer, K/V all-gathered with torch's ``flex_cp_allgather`` as torchtitan's
    ``apply_cp_to_forward`` does): the restored output equals per-document causal attention at cp = 1
    on every token row (float64)."""
    mesh = _mesh(world)
    _eager_block_masks()
    S = 128 * world  # torch's CP block mask needs S % (cp * 128) == 0

    def check(plans, seed):
        B, H, D = len(plans), 2, 4
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
        full = cp_flex_attention(q, k, v, plans, mesh)
        tokens = _token_rows(plans)
        expected = _per_document(q, k, v, plans)
        got, want = full.transpose(1, 2)[tokens], expected.transpose(1, 2)[tokens]
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()

    return _search(world, 2, "contiguous", check, total=S, longest=S // 3)


def sdpa_grads(rank: int, world: int) -> int:
    """The gradients of q, k and v under CP (flex has no CPU backward in torch 2.13): SDPA with the
    explicit mask ``document_mask_mod`` gives over this rank's rows and the all-gathered K/V (torch's
    ``flex_cp_allgather``, whose backward reduce-scatters), each rank's loss its rows' share; the
    gradients, restored by torch's unshard, and the summed loss equal per-document attention at cp = 1."""
    names = torch_cp.torch_names()
    mesh = _mesh(world)

    def check(plans, seed):
        B, H, D, S = len(plans), 2, 4, plans[0].total_len
        g = torch.Generator().manual_seed(seed)
        q, k, v, w = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4))
        w = w * _token_rows(plans)[:, None, :, None]  # the loss reads token rows only
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_loss = (_per_document(*ref, plans) * w).sum() + sum((t * 0).sum() for t in ref)  # a batch of no tokens
        ref_loss.backward()

        balancer = torch_cp.load_balancer(plans)
        local = names._context_parallel_shard(mesh, [q, k, v, w], [2, 2, 2, 2], load_balancer=balancer)
        lq, lk, lv = (t.clone().requires_grad_() for t in local[:3])
        K, V = names.flex_cp_allgather(lk, lv, 2, mesh.get_group().group_name)
        out = F.scaled_dot_product_attention(lq, K, V, attn_mask=_local_mask(plans, rank))
        loss = (out * local[3]).sum()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert torch.allclose(total, ref_loss.detach(), rtol=1e-12, atol=1e-12)
        grads = names.context_parallel_unshard(mesh, [lq.grad, lk.grad, lv.grad], [2, 2, 2], load_balancer=balancer)
        for name, got, want in zip("qkv", grads, (t.grad for t in ref)):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (name, (got - want).abs().max())

    return _search(world, 4, "zigzag", check, longest=24)


def ring_sdpa(rank: int, world: int) -> bool:
    """Inside torch's ``context_parallel()`` (ring SDPA patched in, head-tail rows assumed) a cpshard
    balancer refuses to hand out indices; after it, it serves again."""
    from torch.distributed.tensor.experimental import context_parallel

    mesh = _mesh(world)
    plans, _ = _explicit(world, "zigzag")
    balancer = torch_cp.load_balancer(plans)
    refused = False
    with context_parallel(mesh, buffers=[torch.zeros(1, 1, 4 * world, 2)], buffer_seq_dims=[2]):
        assert torch_cp.ring_sdpa_active()
        try:
            balancer._generate_indices()
        except RuntimeError as err:
            refused = "ring-SDPA" in str(err)
    assert not torch_cp.ring_sdpa_active()
    assert balancer._generate_indices().shape == (2, plans[0].total_len)
    return refused


# -- a real model: transformers' Llama ------------------------------------------------------------

_CP_ATTENTION = "cpshard_torch_cp_test"
_GROUP: dict[str, str] = {}


def _cp_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with the keys and values of every CP rank: all-gathered along the
    sequence by torch's ``flex_cp_allgather`` (backward: a reduce-scatter), as torchtitan's CP
    forward does; ``attention_mask`` is this rank's rows against them (``_local_mask``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = torch_cp.torch_names().flex_cp_allgather(key.contiguous(), value.contiguous(), 2, _GROUP["name"])
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, is_causal=False, **kwargs)


def _llama():
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register(_CP_ATTENTION, _cp_attention)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def llama(rank: int, world: int) -> int:
    """A forward and backward of transformers' Llama (2 layers, hidden 32, float64) under torch CP with
    cpshard's balancer: token ids, positions and labels of the caller's buffer sharded by torch's
    ``_context_parallel_shard``; cpshard's labels (``shard(..., shift=1, fill=-100)``: the next token in
    the document, -100 at its end and on pad rows) equal torch's sharding of the label buffer; each
    rank's loss is its share of the batch's token mean; the summed loss and every parameter gradient
    summed over the ranks equal cp = 1, where each document runs through the model alone."""
    import copy

    names = torch_cp.torch_names()
    mesh = _mesh(world)
    _GROUP["name"] = mesh.get_group().group_name
    base = _llama()

    def check(plans, seed):
        docs = torch_cp_documents(plans, high=64, seed=seed)
        labels_of = [[torch.cat([d[1:], torch.full((min(len(d), 1),), -100)]) for d in row] for row in docs]
        count = sum(max(len(d) - 1, 0) for row in docs for d in row)

        ref = copy.deepcopy(base)
        ref_loss = sum((p * 0).sum() for p in ref.parameters())  # every parameter in the graph
        for row, labels in zip(docs, labels_of):
            for d, lab in zip(row, labels):
                if len(d):
                    logits = ref(input_ids=d[None], position_ids=torch.arange(len(d))[None]).logits[0]
                    token_sum = F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum")
                    ref_loss = ref_loss + token_sum / max(count, 1)
        ref_loss.backward()

        model = copy.deepcopy(base)
        model.set_attn_implementation(_CP_ATTENTION)
        balancer = torch_cp.load_balancer(plans)
        positions = [[torch.arange(len(d)) for d in row] for row in docs]
        ids, pos, labels = names._context_parallel_shard(
            mesh, [torch_cp.to_buffer(docs, plans), torch_cp.to_buffer(positions, plans),
                   torch_cp.to_buffer(labels_of, plans, pad_value=-100)], [1, 1, 1], load_balancer=balancer)
        ours = torch.stack([shard(row, plan, rank, shift=1, fill=-100) for row, plan in zip(docs, plans)])
        assert torch.equal(labels, ours)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=_local_mask(plans, rank)).logits
        token_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = token_sum / max(count, 1)
        loss = loss + sum((p * 0).sum() for p in model.parameters())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert torch.allclose(total, ref_loss.detach(), rtol=1e-10, atol=1e-12), (total, ref_loss)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # the CP reduction: the ranks' losses add up to the batch's
            assert torch.allclose(grad, q.grad, rtol=1e-9, atol=1e-12), (name, (grad - q.grad).abs().max())

    return _search(world, 2, "contiguous", check, longest=20)


def plans_differ(rank: int, world: int) -> list[tuple]:
    """Rank 1 builds other plans than rank 0 (one document of 8 against two of 4, zigzag): torch's shard
    and unshard returned other rows on each rank, silently (their collectives carry no cpshard header).
    With ``check=True`` the balancer's agreement raises on every rank; a rank whose own plans are
    refused (the wrong ``cp_size`` for the mesh) makes every rank raise too. Then the same plans: the
    buffer back bit for bit."""
    names = torch_cp.torch_names()
    mesh = _mesh(world)
    buffer = torch.arange(8.0)[None]

    def round_trip(lengths, cp_size=world, check=True):
        plan = ShardPlan.build(lengths, cp_size=cp_size, layout="zigzag", padding="minimal")
        balancer = torch_cp.load_balancer([plan], mesh=mesh, check=check)
        local, = names._context_parallel_shard(mesh, [buffer], [1], load_balancer=balancer)
        back, = names.context_parallel_unshard(mesh, [local], [1], load_balancer=balancer)
        return back

    def seen(call):
        try:
            return ("ok", call())
        except ValueError as exc:
            return ("raised", str(exc), str(exc.__cause__))  # the refusing rank's own error: the cause

    def from_positions():  # rank 1's positions refused inside the agreement: plans given as a function
        pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]) + (1 if rank == 1 else 0)
        return torch_cp.load_balancer(lambda: torch_cp.plans_from_positions(pos, cp_size=world), mesh=mesh,
                                      check=True)._generate_indices()

    def refused_mesh(bad):
        try:
            torch_cp.load_balancer([ShardPlan.build([8], cp_size=world)], mesh=bad, check=True)
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    from torch.distributed.device_mesh import DeviceMesh

    return [seen(lambda: round_trip([4, 4] if rank == 0 else [8])),
            seen(lambda: round_trip([8], cp_size=1 if rank == 1 else world)),
            seen(lambda: round_trip([8])),
            seen(from_positions),
            refused_mesh(mesh.get_group()),
            refused_mesh(DeviceMesh("cpu", torch.arange(world).view(1, world)))]
