"""cpshard.loss (with cpshard.mtp.mtp_loss in the same backward) on real gloo ranks, against one process
holding the whole batch (cp = 1, float64, tests/reference.py's naive losses).

For each gradient convention, the ranks' parameter gradients reduced that way (averaged under
"mean", summed under "sum") and the reported loss reduced the same way must equal cp = 1's to 1e-12
of their size: cp 2 and 4, zigzag (tp 1 and 2, aligned, minimal and no padding), contiguous (aligned,
and minimal with reorder="balanced"), BSHD; an empty sequence, a one-token sequence, a sequence with
no labelled token, a rank with no labelled token, an all-padding micro-batch. Then: a rank-local token
mean is wrong (what users report), Megatron's own schedule on the README's rows, the collectives
per call, a 2 x 2 DP x CP world with dp_group against one process holding both micro-batches, and
gradient accumulation with counts known before the step. One spawned world of 4 ranks runs it all
(cp = 2 as two CP groups of 2).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import BshdPlan, ShardPlan, shard
from cpshard.loss import sequence_mean, token_mean, token_sum, token_sum_and_count
from cpshard.spawn import CollectiveCounter
from rank_suites import run_suite
from reference import ref_mtp_depth_loss, ref_sequence_mean, ref_token_mean, ref_token_sum

F64 = torch.float64
VOCAB, HID, DEPTHS, SCALE = 11, 4, 2, 0.3

BATCHES = {
    "mixed": [9, 0, 13, 1, 6],  # an empty and a one-token sequence; sequence 2 has no labelled token
    "long-short": [23, 2, 5],
    "all-padding": [0, 1],  # no label anywhere
}

LOSSES = {
    "token_mean": (token_mean, ref_token_mean),
    "sequence_mean": (sequence_mean, ref_sequence_mean),
    "seq-mean-token-sum": (functools.partial(sequence_mean, token_reduction="sum"),
                           lambda ls, ms: ref_sequence_mean(ls, ms, "sum")),
    "token_sum": (token_sum, ref_token_sum),
}


def _plans(lens, world):
    """Both layouts and unpadded zigzag at every world size; the other variants split between cp = 2 and 4."""
    yield "zigzag", ShardPlan.build(lens, cp_size=world)
    yield "contiguous/minimal/balanced", ShardPlan.build(lens, cp_size=world, layout="contiguous",
                                                         padding="minimal", reorder="balanced")
    yield "zigzag/none", ShardPlan.build(lens, cp_size=world, padding="none")  # chunks one row apart
    if world == 2:
        yield "zigzag/tp2", ShardPlan.build(lens, cp_size=world, tp_size=2)
        yield "bshd", BshdPlan.build(lens, cp_size=world)
    else:
        yield "zigzag/minimal", ShardPlan.build(lens, cp_size=world, padding="minimal")
        yield "contiguous", ShardPlan.build(lens, cp_size=world, layout="contiguous")


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(VOCAB, HID, generator=g, dtype=F64), torch.randn(VOCAB, HID, generator=g, dtype=F64),
            torch.randn(DEPTHS, HID, HID, generator=g, dtype=F64) * 0.5]


def _batch(lens, seed):
    """Token ids and a 0/1 mask on the label rows (0 on each sequence's last token: no label)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    mask = [((torch.rand(n, generator=g) < 0.75) & (torch.arange(n) < n - 1)).to(F64) for n in lens]
    if len(lens) > 2:
        mask[2] = torch.zeros(lens[2], dtype=F64)  # a sequence with no labelled token
    return ids, mask


def _without_rank0(mask, plan):
    """The mask with every token held by CP rank 0 unlabelled: a rank with no labelled token."""
    lens = [len(m) for m in mask]
    index = list(torch.arange(sum(lens)).split(lens))
    held = shard(index, plan, 0, pad_value=-1).reshape(-1)
    flat = torch.cat(mask).clone()
    flat[held[held >= 0]] = 0
    return list(flat.split(lens))


def _ce(labels, logits):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(labels.shape)


@functools.cache
def _cached_reference(key, loss_name, mtp):
    ids, mask = ([torch.tensor(x, dtype=dt) for x in part] for part, dt in zip(key, (torch.long, F64)))
    return _reference(ids, mask, LOSSES[loss_name][1], mtp=mtp)


def _reference_of(ids, mask, loss_name, *, mtp=True):
    """:func:`_reference`, once per batch, mask and loss (the masks of most cases repeat across plans)."""
    key = (tuple(tuple(x.tolist()) for x in ids), tuple(tuple(m.tolist()) for m in mask))
    return _cached_reference(key, loss_name, mtp)


def _reference(ids, mask, ref, *, mtp=True):
    """One process, the whole batch, no plan: the main loss, the MTP depths' and every gradient of
    their sum (of the main loss alone without ``mtp``)."""
    E, W, P = (p.clone().requires_grad_(True) for p in _params())
    main, depths = [], [[] for _ in range(DEPTHS)]
    for x in ids:
        n = len(x)
        h = E[x]
        main.append(_ce(torch.tensor([int(x[p + 1]) if p + 1 < n else 0 for p in range(n)], dtype=torch.long),
                        h @ W.T))
        for d in range(1, DEPTHS + 1):
            label = torch.tensor([int(x[p + d + 1]) if p + d + 1 < n else 0 for p in range(n)], dtype=torch.long)
            depths[d - 1].append(_ce(label, torch.tanh(h @ P[d - 1]) @ W.T))
    loss = ref(main, mask)
    logged = [ref_mtp_depth_loss(ls, mask, d, 1.0) for d, ls in enumerate(depths, start=1)]
    total = loss + sum(SCALE / DEPTHS * x for x in logged) if mtp else loss
    if total.requires_grad:
        total.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in (E, W, P)]
    return loss.detach(), torch.stack([x.detach() for x in logged]), torch.cat([g.reshape(-1) for g in grads])


def _forward(plan, rank, group, ids, mask, *, normalization="mean", grad_reduction=None):
    """This rank's rows through the toy model: per-token main loss, the MTP result, the leaves."""
    from cpshard.mtp import mtp_loss

    leaves = [p.clone().requires_grad_(True) for p in _params()]
    E, W, P = leaves
    x = shard(ids, plan, rank)
    labels = shard(ids, plan, rank, shift=1, fill=0)
    m = shard(mask, plan, rank, pad_value=0)
    h = E[x]
    chunks = [h] + [torch.tanh(h @ P[d]) for d in range(DEPTHS)]
    out = mtp_loss(chunks, labels, m, plan, group, output_layer=lambda z: z @ W.T, loss_fn=_ce,
                   scaling_factor=SCALE, normalization=normalization, grad_reduction=grad_reduction)
    return _ce(labels, out.hidden @ W.T), m, out, leaves


def _flat_grads(leaves):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in leaves])


def _near(got, want):
    """Within 1e-12 of the reference's size (exactly 0 where the reference is all 0)."""
    return bool((got - want).abs().max() <= 1e-12 * want.abs().max()) if want.numel() else True


def _reduced(t, group, world, mean):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / world if mean else t


def _reduced_together(*tensors, group):
    """Each tensor summed over ``group``, in one all_reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _cases(world):
    """Every plan on "mixed", with and without a rank that holds no labelled token; fewer elsewhere."""
    for batch, lens in BATCHES.items():
        ids, base = _batch(lens, seed=len(lens))
        for i, (layout, plan) in enumerate(_plans(lens, world)):
            if batch == "all-padding" and i >= 2:
                continue
            for variant in ("random", "rank 0 unlabelled") if batch == "mixed" else ("random",):
                mask = base if variant == "random" else _without_rank0(base, plan)
                yield f"{batch}/{layout}/{variant}", plan, ids, mask


CASES = 5 * 2 + 5 + 2


def _cp_groups(rank, world, cp):
    """Split the world into CP groups of ``cp`` ranks (every rank creates every group, in one order):
    (this rank's CP rank, cp, its group). cp = 2 runs in the cp = 4 world: one spawn for both."""
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world, cp)]
    return rank % cp, cp, groups[rank // cp]


def _exactness(rank, world, group):
    checked = []
    for name, plan, ids, mask in _cases(world):
        for loss_name, (fn, _) in LOSSES.items():
            want_loss, want_logged, want_grads = _reference_of(ids, mask, loss_name)
            for gr in ("mean", "sum"):
                per_token, m, out, leaves = _forward(plan, rank, group, ids, mask, grad_reduction=gr)
                loss = fn(per_token, m, plan, group, grad_reduction=gr)
                loss.backward()
                case = (name, loss_name, gr)
                grads, loss, logged = _reduced_together(_flat_grads(leaves), loss.detach(), out.losses,
                                                         group=group)
                unit = world if gr == "mean" else 1
                assert _near(grads / unit, want_grads) and _near(loss / unit, want_loss), case
                assert _near(logged / world, want_logged), case  # its mean over CP: Megatron's MTP log
                checked.append(case)
        # Megatron's calculate_per_token_loss: (sum, own count); it sums both over DP x CP and divides
        want_loss, want_logged, want_grads = _reference_of(ids, mask, "token_mean")
        per_token, m, out, leaves = _forward(plan, rank, group, ids, mask, normalization="per_token")
        loss_sum, num_tokens = token_sum_and_count(per_token, m, plan, group)
        loss_sum.backward()
        total = _reduced(num_tokens, group, world, False).clamp(min=1)
        assert _near(_reduced(_flat_grads(leaves), group, world, False) / total, want_grads), name
        assert _near(_reduced(loss_sum.detach(), group, world, False) / total, want_loss), name
        checked.append((name, "megatron per-token", "sum"))
        # per-token normalization under "mean": averaged over CP, then divided by the global count
        per_token, m, out, leaves = _forward(plan, rank, group, ids, mask, normalization="per_token",
                                             grad_reduction="mean")
        token_sum(per_token, m, plan, group).backward()
        assert _near(_reduced(_flat_grads(leaves), group, world, True) / total, want_grads), name
        checked.append((name, "per-token", "mean"))
    return len(checked)


def _local_mean_is_wrong(rank, world, group):
    """The rank-local token mean (Megatron 0.19's three-value loss without per-token mode divides
    each rank's sum by its own count) differs from cp = 1 where ranks hold unequal counts."""
    lens = BATCHES["long-short"]
    ids, mask = _batch(lens, seed=3)
    _, _, want = _reference(ids, mask, ref_token_mean)
    report = {}
    for layout, plan in _plans(lens, world):
        if layout not in ("zigzag", "contiguous/minimal/balanced"):
            continue
        per_token, m, _, leaves = _forward(plan, rank, group, ids, mask)
        counts = [torch.zeros((), dtype=F64) for _ in range(world)]
        dist.all_gather(counts, m.sum(), group=group)
        (per_token * m).sum().div(m.sum().clamp(min=1)).backward()
        local = _reduced(_flat_grads(leaves), group, world, True)
        per_token, m, _, leaves = _forward(plan, rank, group, ids, mask)
        token_mean(per_token, m, plan, group).backward()
        exact = _reduced(_flat_grads(leaves), group, world, True)
        report[layout] = {"unequal counts": len({float(c) for c in counts}) > 1, "exact": _near(exact, want),
                          "local exact": _near(local, want),
                          "local error": float((local - want).abs().max() / want.abs().max())}
    return report


def _megatron_schedule(rank, world, group):
    """The README's Megatron rows through megatron-core's own forward_step_calc_loss (its cp factor
    for a two-value loss_func, its division by the rank's count for a three-value one), then its
    DDP reduction (averaged over CP; per-token mode: summed, divided by num_tokens summed over CP)."""
    from cpshard.megatron import import_megatron

    try:
        forward_step_calc_loss = import_megatron("pipeline_parallel.schedules").forward_step_calc_loss
    except (ImportError, AttributeError) as exc:
        return {"reason": f"megatron-core's forward_step_calc_loss is not importable ({exc!r})"}
    lens = BATCHES["long-short"]
    ids, mask = _batch(lens, seed=3)
    _, _, want = _reference_of(ids, mask, "token_mean")
    report = {"reason": ""}
    for layout, plan in _plans(lens, world):
        if layout not in ("zigzag", "contiguous/minimal/balanced"):
            continue
        for mode in ("per-token", "two-value", "three-value"):
            per_token_mode = mode == "per-token"
            per_token, m, _, leaves = _forward(plan, rank, group, ids, mask,
                                               normalization="per_token" if per_token_mode else "mean")

            def loss_func(t, mode=mode, m=m):
                if mode == "two-value":
                    return token_mean(t, m, plan, group, grad_reduction="sum"), {}
                return (*token_sum_and_count(t, m, plan, group), {})  # three-value: Megatron divides by n_r

            config = SimpleNamespace(timers=None, calculate_per_token_loss=per_token_mode, num_moe_experts=None,
                                     mtp_num_layers=None)
            loss, num_tokens = forward_step_calc_loss(None, per_token, loss_func, config, None, False, 1, [],
                                                      cp_group_size=world, is_last_stage=True)
            loss.backward()
            grads = _reduced(_flat_grads(leaves), group, world, not per_token_mode)
            if per_token_mode:
                grads = grads / _reduced(num_tokens, group, world, False).clamp(min=1)
            report[f"{layout}/{mode}"] = _near(grads, want)
    return report


def _collectives(rank, world):
    """One small all_reduce per call (none for the sums), whatever the number of sequences; none at cp = 1."""
    group = dist.new_group(list(range(world)))
    seen = {}
    for b in (4, 64):
        lens = torch.randint(1, 30, (b,), generator=torch.Generator().manual_seed(b)).tolist()
        for cp, plan, grp in ((world, ShardPlan.build(lens, cp_size=world), group),
                              (1, ShardPlan.build(lens, cp_size=1), None)):
            x = torch.randn(plan.local_len, dtype=F64, requires_grad=True)
            m = plan.label_mask(0 if cp == 1 else rank)
            for name, fn in (("token_mean", token_mean), ("sequence_mean", sequence_mean),
                             ("token_sum", token_sum), ("token_sum_and_count", token_sum_and_count)):
                with CollectiveCounter() as counter:
                    fn(x, m, plan, grp)
                seen[(b, cp, name)] = (list(counter.calls), counter.bytes)
    # bad input raises before any collective, naming the argument (checks off; with checks on the
    # agreement carries it: tests/test_faults.py)
    plan = ShardPlan.build([5, 3, 9], cp_size=world)
    x, m = torch.zeros(plan.local_len, dtype=F64), plan.label_mask(rank)
    calls = [("per_token", lambda: token_mean(x[1:], m, plan, group)),
             ("group", lambda: sequence_mean(x, m, ShardPlan.build([5, 3, 9], cp_size=2), group)),
             ("grad_reduction", lambda: token_mean(x, m, plan, group, grad_reduction="avg")),
             ("dp_group", lambda: sequence_mean(x, m, plan, group, dp_group=group))]
    for argument, call in calls:
        with CollectiveCounter() as counter, pytest.raises((TypeError, ValueError), match=f"^{argument}="):
            call()
        seen[("error", argument)] = list(counter.calls)
    return seen


def _dp_cp(rank, world):
    """2 x 2: CP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3}; each CP group holds its own micro-batch.
    With dp_group, gradients reduced over all four ranks equal one process holding both micro-batches."""
    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    cp_group, dp_group = groups[rank // 2], groups[2 + rank % 2]
    everyone = dist.group.WORLD
    batches = [BATCHES["mixed"], BATCHES["long-short"]]
    data = [_batch(lens, seed=10 + i) for i, lens in enumerate(batches)]
    ids, mask = data[rank // 2]
    both_ids, both_mask = data[0][0] + data[1][0], data[0][1] + data[1][1]
    checked = 0
    for layout in ("zigzag", "contiguous"):
        extra = {"padding": "minimal", "reorder": "balanced"} if layout == "contiguous" else {}
        plan = ShardPlan.build(batches[rank // 2], cp_size=2, layout=layout, **extra)
        for loss_name, (fn, _) in LOSSES.items():
            want_loss, _, want_grads = _reference_of(both_ids, both_mask, loss_name, mtp=False)
            E, W, _ = leaves = [p.clone().requires_grad_(True) for p in _params()]
            x = shard(ids, plan, rank % 2)
            labels = shard(ids, plan, rank % 2, shift=1, fill=0)
            m = shard(mask, plan, rank % 2, pad_value=0)
            per_token = _ce(labels, E[x] @ W.T)
            for gr in ("mean", "sum"):
                for p in leaves:
                    p.grad = None
                loss = fn(per_token, m, plan, cp_group, grad_reduction=gr, dp_group=dp_group)
                loss.backward(retain_graph=True)
                grads = _reduced(_flat_grads(leaves), everyone, world, gr == "mean")
                assert _near(grads, want_grads), (layout, loss_name, gr)
                assert _near(_reduced(loss.detach(), everyone, world, gr == "mean"), want_loss), (layout, loss_name)
                checked += 1
    with CollectiveCounter() as counter:
        token_mean(per_token, m, plan, cp_group, dp_group=dp_group)
        sequence_mean(per_token, m, plan, cp_group, dp_group=dp_group)
        token_sum(per_token, m, plan, cp_group, dp_group=dp_group)
    with pytest.raises(ValueError, match=r"dp_group=the CP group: must be the data-parallel group"):
        token_mean(per_token, m, plan, cp_group, dp_group=cp_group)
    return checked, counter.calls, _accumulated(rank, world, cp_group, dp_group)


def _accumulated(rank, world, cp_group, dp_group):
    """Gradient accumulation as verl does it: two micro-batches per DP rank, each normalized by counts
    known before the step (num_tokens, num_seqs over all four), gradients added, then averaged over
    the four ranks: one process holding all four micro-batches. No DP collective."""
    batches = [BATCHES["mixed"], BATCHES["long-short"], [4, 7], [0, 1, 12]]
    data = [_batch(lens, seed=20 + i) for i, lens in enumerate(batches)]
    all_ids = [x for ids, _ in data for x in ids]
    all_mask = [x for _, mask in data for x in mask]
    totals = {"token_mean": {"num_tokens": float(sum(m.sum() for m in all_mask))},
              "sequence_mean": {"num_seqs": float(sum(1 for m in all_mask if m.sum() > 0))}}
    totals["seq-mean-token-sum"] = totals["sequence_mean"]
    calls, checked = {}, 0
    for loss_name, known in totals.items():
        fn = LOSSES[loss_name][0]
        want_loss, _, want_grads = _reference_of(all_ids, all_mask, loss_name, mtp=False)
        for gr in ("mean", "sum"):
            leaves = [p.clone().requires_grad_(True) for p in _params()]
            E, W, _ = leaves
            loss_total = torch.zeros((), dtype=F64)
            for i in (rank // 2, 2 + rank // 2):  # DP rank k holds micro-batches k and k + 2
                ids, mask = data[i]
                plan = ShardPlan.build(batches[i], cp_size=2, layout="contiguous" if i % 2 else "zigzag")
                x, m = shard(ids, plan, rank % 2), shard(mask, plan, rank % 2, pad_value=0)
                per_token = _ce(shard(ids, plan, rank % 2, shift=1, fill=0), E[x] @ W.T)
                with CollectiveCounter() as counter:
                    loss = fn(per_token, m, plan, cp_group, grad_reduction=gr, dp_group=dp_group, **known)
                calls[loss_name] = list(counter.calls)
                loss.backward()
                loss_total = loss_total + loss.detach()
            mean = gr == "mean"
            assert _near(_reduced(_flat_grads(leaves), dist.group.WORLD, world, mean), want_grads), (loss_name, gr)
            assert _near(_reduced(loss_total, dist.group.WORLD, world, mean), want_loss), (loss_name, gr)
            checked += 1
    return checked, calls


def _seen(call):
    try:
        return ("ok", float(call()))
    except ValueError as exc:
        return ("raised", str(exc))


def _dp_disagree(rank, world):
    """2 x 2 as _dp_cp, the CP groups disagreeing about the DP step (Note [DP-level calls]): with checks
    on each call with dp_group makes one DP collective whose trailer carries the decision. Before: the
    first four hung in the DP sum (or returned shares scaled by another factor), the last two returned."""
    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    cp, dp = groups[rank // 2], groups[2 + rank % 2]
    a = rank < 2  # CP group A: ranks 0 and 1; B: 2 and 3
    plan = ShardPlan.build([5, 3] if a else [4, 4, 4], cp_size=2)
    v, m = torch.arange(plan.local_len, dtype=F64) + 1, plan.token_mask(rank % 2)
    kw = {"dp_group": dp, "check": True}
    cases = {
        "num_tokens": lambda: token_mean(v, m, plan, cp, num_tokens=20 if a else None, **kw),
        "token_sum": lambda: (token_sum if a else token_mean)(v, m, plan, cp, **kw),
        "num_tokens value": lambda: token_mean(v, m, plan, cp, num_tokens=20 if a else 24, **kw),
        "grad_reduction": lambda: token_sum(v, m, plan, cp, grad_reduction="mean" if a else "sum", **kw),
        "num_seqs": lambda: sequence_mean(v, m, plan, cp, num_seqs=5 if a else None, **kw),
        "num_seqs value": lambda: sequence_mean(v, m, plan, cp, token_reduction="sum", num_seqs=5 if a else 6, **kw),
        "alike": lambda: token_mean(v, m, plan, cp, **kw),
        # checks off: the DP sums carry the call; a call without a DP collective is each CP group's own
        "grad_reduction unchecked": lambda: token_mean(v, m, plan, cp, grad_reduction="mean" if a else "sum",
                                                       dp_group=dp, check=False),
        "token_sum unchecked": lambda: token_sum(v, m, plan, cp, dp_group=dp if a else None, check=False),
    }
    return {name: _seen(call) for name, call in cases.items()} | {"own sum": float(v[m].sum())}


def _exactness_cp2(rank, world):
    return _exactness(*_cp_groups(rank, world, 2))


def _exactness_cp4(rank, world):
    return _exactness(*_cp_groups(rank, world, 4))


def _local_mean_cp2(rank, world):
    return _local_mean_is_wrong(*_cp_groups(rank, world, 2))


def _local_mean_cp4(rank, world):
    return _local_mean_is_wrong(*_cp_groups(rank, world, 4))


def _megatron_cp2(rank, world):
    return _megatron_schedule(*_cp_groups(rank, world, 2))


# one spawned world of 4 ranks runs every sub-case (starting processes is the slow part)
_NAMES = ("_exactness_cp2", "_exactness_cp4", "_local_mean_cp2", "_local_mean_cp4", "_megatron_cp2",
          "_collectives", "_dp_cp", "_dp_disagree")


@functools.cache
def suites():
    return run_suite(__name__, _NAMES, 4, timeout=400, collective_timeout=120)


SUBCASES = CASES * (len(LOSSES) * 2 + 2)
TRAILER = 8 * 5  # bytes: a stamped float64 sum over 4 ranks


@pytest.mark.parametrize("cp", [2, 4])
def test_every_loss_with_mtp_equals_cp1_under_both_conventions(cp):
    assert [r[f"_exactness_cp{cp}"] for r in suites()] == [SUBCASES] * 4


@pytest.mark.parametrize("cp", [2, 4])
def test_a_rank_local_token_mean_is_wrong(cp):
    for report in (r[f"_local_mean_cp{cp}"] for r in suites()):
        for layout, r in report.items():
            assert r["unequal counts"] and r["exact"], (layout, r)
            assert not r["local exact"] and r["local error"] > 1e-3, (layout, r)


def test_one_small_all_reduce_per_call():
    for seen in (r["_collectives"] for r in suites()):
        for b in (4, 64):
            # one float64 count, after the trailer that stamps the sum (Note [Stamped reductions]): the
            # failure word and two 24-bit chunks of the call's digest with their squares, 5 words at cp = 4
            assert seen[(b, 4, "token_mean")] == (["allreduce"], 8 + TRAILER)
            assert seen[(b, 4, "sequence_mean")] == (["allreduce"], 8 * b + TRAILER)  # every sequence's count
            assert seen[(b, 4, "token_sum")] == ([], 0)
            assert seen[(b, 4, "token_sum_and_count")] == ([], 0)
            for name in ("token_mean", "sequence_mean", "token_sum", "token_sum_and_count"):
                assert seen[(b, 1, name)] == ([], 0), name
        for argument in ("per_token", "group", "grad_reduction", "dp_group"):
            assert seen[("error", argument)] == [], argument


def test_dp_group_equals_one_process_holding_both_micro_batches():
    for checked, calls, _ in (r["_dp_cp"] for r in suites()):
        assert checked == 2 * len(LOSSES) * 2
        assert calls == ["allreduce"] * 4  # token_mean and sequence_mean: one over CP, one over DP each


def test_gradient_accumulation_with_counts_known_before_the_step():
    for _, _, (checked, calls) in (r["_dp_cp"] for r in suites()):
        assert checked == 3 * 2
        # no DP collective; sequence_mean still sums each sequence's count over CP for its token mean
        assert calls == {"token_mean": [], "sequence_mean": ["allreduce"], "seq-mean-token-sum": []}


def test_the_megatron_rows_through_megatrons_own_schedule():
    report = suites()[0]["_megatron_cp2"]
    if report["reason"]:
        pytest.skip(report["reason"])
    for layout in ("zigzag", "contiguous/minimal/balanced"):
        assert report[f"{layout}/per-token"] and report[f"{layout}/two-value"], report
        assert not report[f"{layout}/three-value"], report  # Megatron's rank-local division


def test_cp_groups_that_disagree_about_the_dp_step_raise_on_every_rank():
    """Checks on: a count given on one CP group and summed on the other, token_sum against token_mean,
    other counts or another grad_reduction over dp_group: every rank of both CP groups raises, naming
    the loss and its arguments (Note [DP-level calls])."""
    for rank, seen in enumerate(r["_dp_disagree"] for r in suites()):
        a = rank < 2
        ops = {"token_sum": "token_sum" if a else "token_mean", "grad_reduction": "token_sum"}
        for name in ("num_tokens", "token_sum", "num_tokens value", "grad_reduction", "num_seqs", "num_seqs value"):
            kind, msg = seen[name]
            op = ops.get(name, "sequence_mean" if name.startswith("num_seqs") else "token_mean")
            assert kind == "raised" and msg.startswith(f"{op} over dp_group: the ranks of the group disagree"), msg
            argument = name.split()[0]
            assert f"This rank passed loss={op}" in msg and (argument == "token_sum" or f"{argument}=" in msg), msg
        assert seen["alike"][0] == "ok"
        kind, msg = seen["grad_reduction unchecked"]
        assert kind == "raised" and msg.startswith("token_mean over dp_group: the ranks of the group disagree"), msg
        # no collective: dp_group on one CP group and None on the other scale the shares by 4 and by 2
        # (docs/guarantees.md, "Over dp_group"); checks on, the DP side would wait in its DP check instead
        assert seen["token_sum unchecked"] == ("ok", (4 if a else 2) * seen["own sum"])
