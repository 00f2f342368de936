"""The MTP loss across real gloo ranks (cpshard.spawn.run_ranks): exact against cp = 1, counts per call,
and megatron-core's process_mtp_loss shown to differ where its per-rank counts or zigzag roll are wrong.

Each rank computes the cp = 1 result of the same batch itself (deterministic data), so it can assert
on its own rows; weight gradients are reduced over the group with one test-side all_reduce.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import Layout, ShardPlan, shard
from cpshard.spawn import CollectiveCounter
from rank_suites import run_suite
from test_mtp import megatron_loop

F64 = torch.float64
VOCAB, HID = 9, 3

# short sequences, an empty one; one token per rank at most; a shard of padding only (cp = 4); longer
BATCHES = {
    "short": [1, 0, 5, 2, 9, 3],
    "padding-shard": [3],
    "no-valid-token": [1],
    "longer": [13, 7, 21, 4],
}


def _batch(lens, n, seed):
    """Per-sequence input ids, labels, a 0/1 loss mask and the 1 + n hidden states of every token."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (k,), generator=g) for k in lens]
    labels = [torch.randint(0, VOCAB, (k,), generator=g) for k in lens]
    mask = [(torch.rand(k, generator=g) < 0.8).to(F64) for k in lens]
    hidden = [[torch.randn(k, HID, generator=g, dtype=F64) for k in lens] for _ in range(n + 1)]
    weight = torch.randn(VOCAB, HID, generator=g, dtype=F64)
    return ids, labels, mask, hidden, weight


def _run(plan, rank, group, data, n, *, normalization, form, derived, counts="global"):
    """The native loss on this rank's rows; returns (hidden grads per depth, weight grad, MtpLoss)."""
    from cpshard.mtp import mtp_loss

    ids, labels, mask, hidden, weight = data
    chunks = [shard(h, plan, rank, pad_value=0).requires_grad_(True) for h in hidden]
    w = weight.clone().requires_grad_(True)
    source = ids if derived else labels
    if form == "sharded":
        source, mask = shard(source, plan, rank, pad_value=0), shard(mask, plan, rank, pad_value=0)
    out = mtp_loss(chunks, None if derived else source, mask, plan, group, output_layer=lambda x: x @ w.T,
                   loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), scaling_factor=0.3,
                   normalization=normalization, counts=counts, input_ids=source if derived else None)
    (out.hidden * 0).sum().backward()  # only the MTP gradients reach the depth chunks and the weight
    grads = [c.grad if c.grad is not None else torch.zeros_like(c) for c in chunks[1:]]
    return grads, (w.grad if w.grad is not None else torch.zeros_like(w)), out


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-11, atol=1e-13)


def _exactness(rank, world):
    """Every hidden row's gradient and the CP-reduced weight gradient equal cp = 1's (Note [MTP token counts])."""
    group = dist.new_group(list(range(world)))
    checked = 0
    for name, lens in BATCHES.items():
        plan1 = ShardPlan.build(lens, cp_size=1)
        for n in (1, 3):
            data = _batch(lens, n, seed=len(lens) * 10 + n)
            for layout in Layout:
                plan = ShardPlan.build(lens, cp_size=world, layout=layout)
                for normalization in ("mean", "per_token"):
                    for derived in (False, True):
                        ref_grads, ref_w, ref = _run(plan1, 0, None, data, n, normalization=normalization,
                                                     form="global", derived=derived)
                        for form in ("sharded", "global"):
                            grads, wgrad, out = _run(plan, rank, group, data, n, normalization=normalization,
                                                     form=form, derived=derived)
                            # "mean": gradients are averaged over DP x CP afterwards; "per_token": summed
                            unit = world if normalization == "mean" else 1
                            dist.all_reduce(wgrad, group=group)
                            case = (name, n, layout.value, normalization, derived, form)
                            assert _close(wgrad / unit, ref_w), case
                            for d in range(n):
                                want = shard(list(ref_grads[d].split(lens)), plan, rank, pad_value=0)
                                assert _close(grads[d] / unit, want), (case, d)
                            assert torch.equal(out.counts, ref.counts), case
                            losses = out.losses.clone()
                            dist.all_reduce(losses, group=group)  # the mean over CP is the depth's loss
                            assert _close(losses / world, ref.losses), case
                            assert torch.isfinite(grads[0]).all() and torch.isfinite(out.losses).all()
                            checked += 1
    return checked


def _drop_in(plan, rank, group, data, n, *, fn, per_token, counts=None, contiguous=False):
    """Megatron's calling convention: [(1 + n) L, 1, h] hidden, [1, L] labels, packed_seq_params."""
    from cpshard.megatron import import_megatron

    ids, labels, mask, hidden, weight = data
    psp = import_megatron("packed_seq_params").PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=plan.cu_seqlens_padded, cu_seqlens_kv=plan.cu_seqlens_padded,
        cu_seqlens_q_padded=plan.cu_seqlens_padded, cu_seqlens_kv_padded=plan.cu_seqlens_padded,
        max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)
    if contiguous:
        psp.cp_partition_mode = "contiguous"  # what verl sets where the field exists; Megatron ignores it
    hid = torch.cat([shard(h, plan, rank, pad_value=0) for h in hidden]).unsqueeze(1).requires_grad_(True)
    w = torch.nn.Parameter(weight.clone())

    def output_layer(x, weight=None, runtime_gather_output=None):
        return x @ (w if weight is None else weight).T, None

    def lm_loss(lab, logits):
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), lab.reshape(-1), reduction="none").view(
            lab.shape)

    config = SimpleNamespace(mtp_num_layers=n, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=per_token,
                             mtp_detach_heads=False)
    kw = {} if counts is None else {"counts": counts}
    out = fn(hid, shard(labels, plan, rank, pad_value=0).view(1, -1), shard(mask, plan, rank, pad_value=0).view(1, -1),
             output_layer, w, None, False, lm_loss, config, cp_group=group, packed_seq_params=psp, **kw)
    (out * 0).sum().backward()
    wgrad = w.grad.clone()
    dist.all_reduce(wgrad, group=group)
    return wgrad / (1 if per_token else plan.cp_size)


def _megatron_and_local_counts(rank, world):
    """Where ranks hold unequal counts: counts="local" and Megatron's own differ from cp = 1; cpshard's does not.

    Under zigzag Megatron's function equals cpshard's counts="local" (same labels, same per-rank
    counts); under contiguous it differs even from that (its roll assumes zigzag: wrong labels).
    """
    from cpshard.megatron import import_megatron, process_mtp_loss

    megatrons = None
    try:
        mod = import_megatron("transformer.multi_token_prediction")
    except ImportError as exc:
        reason = f"megatron-core is not importable ({exc})"
    else:
        reason = ""
        if hasattr(mod, "process_mtp_loss"):
            megatrons = mod.process_mtp_loss
        elif hasattr(mod, "_roll_tensor_packed_seq"):  # 0.16: the same recipe on its own packed CP roll
            megatrons = megatron_loop(mod)
        else:
            reason = "this megatron-core has no packed-sequence roll (0.14/0.15)"
    group = dist.new_group(list(range(world)))
    # Megatron's packed roll splits each sequence's local rows into two halves: under the contiguous
    # layout a sequence with one local row makes it raise (IndexError) after posting sends, so every
    # sequence here keeps at least two rows per rank
    lens, n = [11, 9, 13, 6], 2
    data = _batch(lens, n, seed=77)
    report = {"reason": reason}
    for per_token in (False, True):
        norm = "per_token" if per_token else "mean"
        ref = _run(ShardPlan.build(lens, cp_size=1), 0, None, data, n, normalization=norm, form="global",
                   derived=False)[1]
        for layout in Layout:
            plan = ShardPlan.build(lens, cp_size=world, layout=layout)
            key = f"{layout.value}/{norm}"
            unit = world if norm == "mean" else 1
            counts = [m.sum() for m in (shard(data[2], plan, rank, shift=d, pad_value=0) for d in range(n + 1))]
            gathered = [torch.zeros(n + 1, dtype=F64) for _ in range(world)]
            dist.all_gather(gathered, torch.stack(counts), group=group)
            report[f"{key} unequal"] = len({tuple(c.tolist()) for c in gathered}) > 1
            local = _run(plan, rank, group, data, n, normalization=norm, form="sharded", derived=False,
                         counts="local")[1]
            dist.all_reduce(local, group=group)
            report[f"{key} local==cp1"] = _close(local / unit, ref)
            contiguous = layout is Layout.CONTIGUOUS
            ours = _drop_in(plan, rank, group, data, n, fn=process_mtp_loss, per_token=per_token, contiguous=contiguous)
            report[f"{key} drop-in==cp1"] = _close(ours, ref)
            ours_local = _drop_in(plan, rank, group, data, n, fn=process_mtp_loss, per_token=per_token,
                                  counts="local", contiguous=contiguous)
            report[f"{key} drop-in local==native local"] = _close(ours_local, local / unit)
            if megatrons is not None:
                theirs = _drop_in(plan, rank, group, data, n, fn=megatrons, per_token=per_token)
                report[f"{key} megatron==cp1"] = _close(theirs, ref)
                report[f"{key} megatron==drop-in local"] = _close(theirs, ours_local)
    return report


def _collectives(rank, world):
    """Per call: one all_to_all_single (labels and mask of every depth) and one all_reduce (every count)."""
    from cpshard.mtp import mtp_loss

    group = dist.new_group(list(range(world)))
    seen = {}
    for b in (4, 64):
        g = torch.Generator().manual_seed(b)
        lens = torch.randint(1, 40, (b,), generator=g).tolist()
        for layout in Layout:
            plan = ShardPlan.build(lens, cp_size=world, layout=layout)
            for n in (1, 3):
                data = _batch(lens, n, seed=b)
                chunks = [shard(h, plan, rank, pad_value=0) for h in data[3]]
                for form, counts in (("sharded", "global"), ("global", "global"), ("sharded", "local")):
                    labels, mask = data[1], data[2]
                    if form == "sharded":
                        labels, mask = shard(labels, plan, rank, pad_value=0), shard(mask, plan, rank, pad_value=0)
                    with CollectiveCounter() as counter:
                        mtp_loss(chunks, labels, mask, plan, group, output_layer=lambda x: x @ data[4].T,
                                 loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), counts=counts)
                    seen[(b, layout.value, n, form, counts)] = list(counter.calls)
    return seen


def _mask_dtypes(rank, world):
    """Counts of a loss mask of every dtype, summed over the group: exact (a bfloat16 sum of 555 ones
    was 556 before, float16 stopped at 2048), and the same losses as a float64 mask's."""
    from cpshard.mtp import mtp_loss

    lens = [1500, 555, 700]  # 2755 tokens: past float16's 2048 on every rank
    plan = ShardPlan.build(lens, cp_size=world)
    data = _batch(lens, 2, seed=5)
    chunks = [shard(h, plan, rank, pad_value=0) for h in data[3]]
    labels = shard(data[1], plan, rank, pad_value=0)
    seen = {}
    for dtype in (F64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        for which, lengths in (("all", lens), ("555", [0, 555, 0])):
            mask = shard([torch.arange(n) < k for n, k in zip(lens, lengths)], plan, rank, pad_value=0).to(dtype)
            out = mtp_loss(chunks, labels, mask, plan, dist.group.WORLD, output_layer=lambda x: x @ data[4].T,
                           loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), num_depths=2)
            seen[(str(dtype), which)] = (out.counts.tolist(), out.losses)
    return seen


_PLAN = {
    2: ("_exactness", "_megatron_and_local_counts", "_mask_dtypes"),
    4: ("_exactness", "_megatron_and_local_counts", "_collectives"),
}


@functools.cache
def suites(world):
    return run_suite(__name__, _PLAN[world], world, timeout=400, collective_timeout=120)


SUBCASES = len(BATCHES) * 2 * 2 * 2 * 2 * 2


@pytest.mark.parametrize("world", [2, 4])
def test_exact_against_cp1(world):
    assert [r["_exactness"] for r in suites(world)] == [SUBCASES] * world


@pytest.mark.parametrize("world", [2, 4])
def test_local_counts_and_megatron_differ_where_counts_are_unequal(world):
    reports = [r["_megatron_and_local_counts"] for r in suites(world)]
    report = reports[0]
    assert all(r == report for r in reports)  # every rank saw the same reduced results
    for layout in ("zigzag", "contiguous"):
        for norm in ("mean", "per_token"):
            key = f"{layout}/{norm}"
            assert report[f"{key} unequal"], key  # the batch is chosen so that ranks hold different counts
            assert report[f"{key} drop-in==cp1"], key
            assert not report[f"{key} local==cp1"], key
            assert report[f"{key} drop-in local==native local"], key
    if report["reason"]:
        pytest.skip(f"Megatron's side not compared: {report['reason']}")
    for norm in ("mean", "per_token"):
        assert report[f"zigzag/{norm} megatron==drop-in local"]  # same labels, same per-rank counts
        assert not report[f"zigzag/{norm} megatron==cp1"]
        assert not report[f"contiguous/{norm} megatron==drop-in local"]  # its roll assumes zigzag
        assert not report[f"contiguous/{norm} megatron==cp1"]


def test_two_collectives_per_call_whatever_depths_and_batch():
    seen = suites(4)[0]["_collectives"]
    assert len(seen) == 2 * 2 * 2 * 3
    for (b, layout, n, form, counts), calls in seen.items():
        want = (["alltoall_base"] if form == "sharded" else []) + (["allreduce"] if counts == "global" else [])
        assert calls == want, (b, layout, n, form, counts, calls)


def test_counts_are_exact_for_every_mask_dtype():
    """Every rank: [orig, n_1, n_2] as many as the mask holds, whatever its dtype, and the losses of a
    float64 mask (the counts divide in the loss's dtype, here float64)."""
    for seen in (r["_mask_dtypes"] for r in suites(2)):
        for which, lens in (("all", [1500, 555, 700]), ("555", [555])):
            truth = [sum(max(n - d, 0) for n in lens) for d in range(3)]
            _, want = seen[(str(F64), which)]
            for dtype in (F64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
                counts, losses = seen[(str(dtype), which)]
                assert counts == truth, (dtype, which, counts)
                assert torch.equal(losses, want), (dtype, which)
