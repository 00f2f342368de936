"""``cpshard.distributed.ulysses`` on real gloo ranks: ``exchange_dims`` and ``all_gather_dim`` against what
one process computes by slicing and concatenating the whole tensor, outputs and gradients exactly, on groups
that do not start at global rank 0; the header catches ranks that disagree; local refusals come first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.distributed.ulysses import all_gather_dim, exchange_dims
from cpshard.spawn import run_ranks

#: (world size, the group's global ranks): groups of 2, 3 and 4 ranks, two of them without global rank 0
CASES = [(3, [1, 2]), (4, [1, 2, 3]), (4, [0, 1, 2, 3]), (5, [4, 2, 1, 3])]


def _whole(seed: int, n: int) -> torch.Tensor:
    """The whole tensor ``(2, n * 3, n * 2, 5)`` (B, S, H, D), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n * 3, n * 2, 5, generator=g, dtype=torch.float64)


def _upstream(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rank_main(rank: int, world: int, members: list[int]) -> dict:
    group = dist.new_group(members)   # every process creates every group, in the same order
    if rank not in members:
        return {}
    me, n = dist.get_rank(group), len(members)   # torch orders a group by global rank
    out: dict = {"me": me}
    for seed in range(3):
        whole = _whole(seed, n)
        # sequence-split (B, S/n, H, D) -> heads-split (B, S, H/n, D), then back
        local = whole.chunk(n, dim=1)[me].clone().requires_grad_(True)
        heads = exchange_dims(local, group, scatter_dim=2, gather_dim=1)
        back = exchange_dims(heads, group, scatter_dim=1, gather_dim=2)
        (heads * _upstream(seed, tuple(heads.shape))).sum().backward()
        out[("heads", seed)] = heads.detach()
        out[("back", seed)] = back.detach()
        out[("heads grad", seed)] = local.grad
        for how in ("sum", "own", "own_scaled"):
            x = whole.chunk(n, dim=1)[me].clone().requires_grad_(True)
            gathered = all_gather_dim(x, group, dim=1, grad=how)
            (gathered * _upstream(seed + 10 * me, tuple(gathered.shape))).sum().backward()
            out[(how, seed)] = gathered.detach()
            out[(how, "grad", seed)] = x.grad
    # rank 0 exchanges the other way round (the same bytes): the header names the disagreement on every rank
    x = torch.zeros(2, n * 3, n * 2)
    try:
        exchange_dims(x, group, scatter_dim=1 if me else 2, gather_dim=2 if me else 1)
    except ValueError as exc:
        out["mismatch"] = str(exc)
    # only rank 0's tensor requires a gradient: where the backward communicates, every rank raises in forward
    # (else rank 0 alone would make the backward collective and wait); "own"'s backward is local: it runs
    y = torch.zeros(2, n * 3, n * 2, dtype=torch.float64, requires_grad=me == 0)
    for name, call in (("grad exchange", lambda: exchange_dims(y, group, scatter_dim=2, gather_dim=1)),
                       ("grad sum", lambda: all_gather_dim(y, group, dim=1, grad="sum"))):
        try:
            call()
        except ValueError as exc:
            out[name] = str(exc)
    out["grad own"] = tuple(all_gather_dim(y, group, dim=1, grad="own").shape)
    return out


@pytest.mark.parametrize(("world", "members"), CASES)
def test_exchanges_equal_one_process(world: int, members: list[int]) -> None:
    ranks = [r for r in run_ranks(_rank_main, world, members) if r]
    n = len(members)
    for seed in range(3):
        whole = _whole(seed, n)
        for r in ranks:
            me = r["me"]
            # heads split: the whole sequence, this rank's H/n heads
            assert torch.equal(r[("heads", seed)], whole.chunk(n, dim=2)[me])
            assert torch.equal(r[("back", seed)], whole.chunk(n, dim=1)[me])
            # the exchange's adjoint: rank me's sequence piece gets every rank's upstream at its rows and heads
            upstream = torch.cat([_upstream(seed, tuple(whole.chunk(n, dim=2)[0].shape)) for _ in range(n)], dim=2)
            assert torch.equal(r[("heads grad", seed)], upstream.chunk(n, dim=1)[me])
            for how in ("sum", "own", "own_scaled"):
                assert torch.equal(r[(how, seed)], whole)
            shape = tuple(whole.shape)
            own = _upstream(seed + 10 * me, shape).chunk(n, dim=1)[me]
            summed = sum(_upstream(seed + 10 * k, shape) for k in range(n)).chunk(n, dim=1)[me]
            assert torch.allclose(r[("sum", "grad", seed)], summed, rtol=0, atol=1e-12)
            assert torch.equal(r[("own", "grad", seed)], own)
            assert torch.equal(r[("own_scaled", "grad", seed)], own * n)
        for r in ranks:
            assert "exchange_dims" in r["mismatch"] and "disagree" in r["mismatch"], r["mismatch"]
            assert "requires_grad" in r.get("grad exchange", ""), r.get("grad exchange")
            assert "requires_grad" in r.get("grad sum", ""), r.get("grad sum")
            assert r["grad own"] == (2, n * n * 3, n * 2)


def test_one_rank_and_local_refusals() -> None:
    x = torch.randn(2, 6, 4)
    assert exchange_dims(x, None, scatter_dim=2, gather_dim=1) is x
    assert all_gather_dim(x, None, dim=1) is x
    with pytest.raises(TypeError, match="scatter_dim"):
        exchange_dims(x, None, scatter_dim=1.0, gather_dim=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gather_dim"):
        exchange_dims(x, None, scatter_dim=1, gather_dim=3)
    with pytest.raises(ValueError, match="grad"):
        all_gather_dim(x, None, dim=1, grad="mean")


def _axes_main(rank: int, world: int, ring: int, halves: bool) -> dict:
    """Every process splits its own SP group (the world, or its half when ``halves``) into ``ring`` ring ranks."""
    import torch.distributed as dist

    from cpshard.distributed.axes import split_axes
    from cpshard.distributed.groups import group_ranks

    half = world // 2
    groups = [dist.new_group(list(range(h * half, (h + 1) * half))) for h in range(2)]
    sp = groups[rank // half] if halves else dist.group.WORLD
    ring_group, ulysses_group = split_axes(sp, ring)
    return {"ring": group_ranks(ring_group), "ulysses": group_ranks(ulysses_group)}


@pytest.mark.parametrize("ring, halves", [(1, False), (2, False), (4, False), (2, True)])
def test_split_axes_makes_the_two_axes_of_each_group(ring: int, halves: bool) -> None:
    """Group rank ``r * U + u`` is ring rank ``r`` and Ulysses rank ``u``: the Ulysses groups are runs of ``U``
    consecutive group ranks, the ring groups every ``U``-th; each process gets the two that hold it."""
    world = 4
    got = run_ranks(_axes_main, world, ring, halves)
    for rank, axes in enumerate(got):
        members = list(range(2 * (rank // 2), 2 * (rank // 2) + 2)) if halves else list(range(world))
        u_size = len(members) // ring
        i = members.index(rank)
        r, u = divmod(i, u_size)
        assert axes["ulysses"] == tuple(members[r * u_size:(r + 1) * u_size])
        assert axes["ring"] == tuple(members[u::u_size])


def _misfit_main(rank: int, world: int) -> str:
    import torch.distributed as dist

    from cpshard.distributed.axes import split_axes

    try:
        split_axes(dist.group.WORLD, 3)
    except ValueError as exc:
        return str(exc)
    return ""


def test_split_axes_refuses_a_ring_that_does_not_divide_the_group() -> None:
    for message in run_ranks(_misfit_main, 2):
        assert message.startswith("ring=3: must divide the size of the group (2 ranks)")
