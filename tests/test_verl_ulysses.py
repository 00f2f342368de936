"""cpshard.compat.verl's Ulysses drop-ins against verl 0.9.1's own ``verl/utils/ulysses.py`` (differential).

``ulysses_pad`` needs no group: hypothesis in this process. The rest read a process group: one gloo
group per world size (2 and 4) runs every case on its ranks, for the world group and (at 4) for groups
of two that do not start at global rank 0, with verl's group set, given as ``group=``, and none set.
Each case calls verl's function and the drop-in on the same tensors and compares the outputs and the
input gradients (under a random weight, so that the gradient differs by rank) with ``torch.equal``.
The cases come from a seeded grid drawn alike on every rank (a collective needs every rank to draw the
same case, which hypothesis in separate processes does not promise). Where verl is wrong the test
asserts verl's wrong value next to cpshard's (docs/verl.md, "FSDP backend: the Ulysses drop-ins").
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strategies import props

try:
    import verl.utils.ulysses as vu
except ImportError as exc:  # scripts/setup.sh installs verl; CI always runs these tests
    pytest.skip(f"verl cannot be imported ({exc}); run scripts/setup.sh", allow_module_level=True)

from cpshard.compat import verl as cv
from cpshard.spawn import run_ranks


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- ulysses_pad: no group ---------------------------------------------------------------------------


@props(60)
@given(data=st.data())
def test_ulysses_pad_matches_verl(data):
    t = data.draw(st.integers(1, 40), "T")
    sp = data.draw(st.integers(0, 8), "sp")
    batch = data.draw(st.sampled_from([1, 1, 2]), "batch")
    ids = torch.randint(0, 100, (batch, t)).to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.float32])))
    pos_kind = data.draw(st.sampled_from(["none", "2d", "3d"]), "positions")
    pos_dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), "position dtype")
    pos = None if pos_kind == "none" else torch.arange(t, dtype=pos_dtype).view(1, t)
    if pos_kind == "3d":
        pos = torch.stack([pos, pos + 1, pos * 2])  # (3, 1, T): multimodal RoPE
    pad_value = data.draw(st.sampled_from([0, 1, 7]), "pad_value")
    want = vu.ulysses_pad(ids, pos, sp, pad_value=pad_value)
    got = cv.ulysses_pad(ids, pos, sp, pad_value=pad_value)
    assert want[2] == got[2] == ((-t) % sp if sp > 1 else 0)
    assert _same(got[0], want[0]) and _same(got[1], want[1])
    if got[2] == 0:  # verl returns its inputs themselves
        assert got[0] is ids and got[1] is pos


def test_ulysses_pad_pads_positions_with_an_arange_as_verl():
    ids, pos = torch.arange(5).view(1, 5), torch.arange(5, dtype=torch.int32).view(1, 5)
    got = cv.ulysses_pad(ids, pos, 4, pad_value=9)
    assert got[2] == 3 and got[0].tolist() == [[0, 1, 2, 3, 4, 9, 9, 9]]
    assert got[1].dtype == torch.int64 and got[1].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]  # int32 widened, as verl


def test_ulysses_pad_errors_name_the_argument():
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"position_ids_rmpad=a tensor of shape \(2, 6\): must have size 1"):
        cv.ulysses_pad(ids, torch.zeros(2, 6, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"position_ids_rmpad=a tensor of shape \(1, 5\): must have as many tokens"):
        cv.ulysses_pad(ids, torch.zeros(1, 5, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"input_ids_rmpad=a tensor of shape \(6,\): must be \(B, T\)"):
        cv.ulysses_pad(torch.zeros(6), None, 4)
    for call in (lambda: vu.ulysses_pad(ids, torch.zeros(2, 6, dtype=torch.long), 2),
                 lambda: vu.ulysses_pad(ids, torch.zeros(1, 5, dtype=torch.long), 2)):
        with pytest.raises(AssertionError):  # verl's own checks are asserts
            call()


def test_no_group_returns_the_input_as_verl():
    """None set, none given: the collective helpers hand ``x`` back (no torch.distributed needed)."""
    assert vu.get_ulysses_sequence_parallel_group() is None
    x = torch.randn(2, 3, 4)
    for fn in ("gather_outputs_and_unpad", "gather_seq_scatter_heads"):
        assert getattr(cv, fn)(x, 1, 2) is x and getattr(vu, fn)(x, 1, 2) is x
    assert cv.gather_heads_scatter_seq(x, 2, 1) is x and vu.gather_heads_scatter_seq(x, 2, 1) is x


def test_slicing_without_torch_distributed_names_the_fix():
    with pytest.raises(ValueError, match=r"group=None: slice_input_tensor reads the size of this group .*"
                                         r"Fix: initialize torch.distributed"):
        cv.slice_input_tensor(torch.zeros(1, 4), 1)


# -- gloo: the helpers that read a group -------------------------------------------------------------


def _grad(out, x, seed):
    """``x``'s gradient of ``sum(out * w)`` for a weight ``w`` drawn from ``seed`` (per rank)."""
    if not x.requires_grad:
        return None
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), x, allow_unused=True)[0]


def _both(name, args, kwargs, x, seed, ours=None):
    """``(verl's output, ours, verl's input gradient, ours)`` of ``name`` on the same inputs."""
    res = []
    for fn in (getattr(vu, name), ours or getattr(cv, name)):
        out = fn(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        res.append((out, _grad(first, x, seed) if first.requires_grad else None))
    (want, gw), (got, gg) = res
    return want, got, gw, gg


def _equal_outputs(want, got):
    if isinstance(want, tuple):
        return all(_same(g, w) if isinstance(w, torch.Tensor) or w is None else g == w for w, g in zip(want, got))
    return _same(got, want)


def _tensor(rng, shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    return torch.randint(0, 1000, shape, generator=gen, dtype=dtype)


def _cases(rng, n, rank, count):
    """``count`` cases ``(name, args, kwargs, x)`` for a group of ``n`` ranks, alike on every rank but for
    the values (seeded by rank)."""
    out = []
    for i in range(count):
        seed = 1000 * i + rank
        dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
        ndim = rng.choice([3, 4])
        kind = rng.choice(["seq->heads", "heads->seq", "gather", "slice", "pad+slice"])
        dims = list(range(ndim))
        rng.shuffle(dims)
        a, b = dims[0] - rng.choice([0, ndim]), dims[1] - rng.choice([0, ndim])  # some negative
        shape = [rng.randint(1, 3) for _ in range(ndim)]
        if kind == "seq->heads":  # x: [.., S/n, H, ..]
            shape[a] = rng.randint(1, 3)
            shape[b] = n * rng.randint(1, 2)
            gathered = n * shape[a]
            unpadded = rng.choice([0, gathered, gathered - rng.randint(0, n - 1)])
            x = _tensor(rng, shape, dtype, seed)
            out.append((kind, "gather_seq_scatter_heads", (x,), dict(seq_dim=a, head_dim=b, unpadded_dim_size=unpadded),
                        x))
        elif kind == "heads->seq":  # x: [.., S, H/n, ..], S any
            shape[a] = rng.randint(1, 2 * n + 1)
            x = _tensor(rng, shape, dtype, seed)
            out.append((kind, "gather_heads_scatter_seq", (x,), dict(seq_dim=a, head_dim=b), x))
        elif kind == "gather":
            x = _tensor(rng, shape, dtype, seed)
            unpad = rng.choice([None, a, b])
            if unpad is None:
                pad = rng.choice([0, 3])  # not read without unpad_dim
            else:
                pad = rng.randint(0, shape[unpad] * (n if unpad % ndim == a % ndim else 1))
            out.append((kind, "gather_outputs_and_unpad", (x, a),
                        dict(unpad_dim=unpad, padding_size=pad, grad_scaler=rng.choice([True, False])), x))
        elif kind == "slice":
            shape[a] = rng.randint(1, 2 * n + 1)
            x = _tensor(rng, shape, rng.choice([dtype, torch.int64]), seed)
            out.append((kind, "slice_input_tensor", (x, a), dict(padding=rng.choice([True, False])), x))
        else:
            t = rng.randint(1, 3 * n + 1)
            ids = _tensor(rng, (1, t), rng.choice([torch.int64, torch.float32]), seed)
            pos = torch.arange(t).view(1, t)
            if rng.random() < 0.25:
                pos = torch.stack([pos, pos + 1, pos + 2])
            out.append((kind, "ulysses_pad_and_slice_inputs", (ids, rng.choice([pos, None]), n),
                        dict(skip_position_ids_rmpad=rng.choice([True, False]), pad_value=rng.choice([0, 1])), ids))
    return out


def _suite(rank, world):
    """Every case on every group this world offers, with verl's group set / given / none; returns the
    labels of the cases that differ, the count of cases compared, and the mutants' results."""
    import torch.distributed as dist
    import verl.utils.ulysses as vu

    groups = [("world", dist.group.WORLD)]
    if world == 4:
        pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]  # every rank creates every group
        strided = [dist.new_group(r) for r in ([0, 2], [1, 3])]
        groups += [("pairs", pairs[rank // 2]), ("strided", strided[rank % 2])]
    differ, compared = [], 0
    for label, group in groups:
        n = dist.get_world_size(group)
        rng = random.Random(f"{world} {label}")
        # verl's group set; given as group= (none set); given while another group is set
        modes = [("set", group, None), ("given", None, group)]
        if label != "world":
            modes.append(("given over set", dist.group.WORLD, group))
        for mode, set_group, given_group in modes:
            vu.set_ulysses_sequence_parallel_group(set_group)
            for i, (_kind, name, args, kwargs, x) in enumerate(_cases(rng, n, rank, 40)):
                if given_group is not None:
                    if name in ("ulysses_pad_and_slice_inputs", "slice_input_tensor"):
                        continue  # no group parameter / verl's rank from the set group: asserted apart
                    kwargs = {**kwargs, "group": given_group}
                want, got, gw, gg = _both(name, args, kwargs, x, seed=7 * i + rank)
                compared += 1
                if not (_equal_outputs(want, got) and _same(gg, gw)):
                    differ.append(f"{label} {mode} {i} {name} {kwargs} {tuple(x.shape)} {x.dtype}")
        vu.set_ulysses_sequence_parallel_group(None)
    res = {"differ": differ, "compared": compared, "given": _given_group(rank, world, groups[-1][1]),
           "none set": _none_set(rank, world), "mutants": _mutants(rank, world),
           "errors": _errors(world)}
    vu.set_ulysses_sequence_parallel_group(None)
    return res


def _given_group(rank, world, group):
    """``slice_input_tensor(x, group=g)``: verl slices at its set group's rank (0 where none is set),
    the drop-in at this rank's place in ``g``."""
    import torch.distributed as dist
    import verl.utils.ulysses as vu

    from cpshard.compat import verl as cv

    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = torch.arange(2 * n * 3).view(2, n * 3)
    vu.set_ulysses_sequence_parallel_group(None)
    want, got = vu.slice_input_tensor(x, 1, group=group), cv.slice_input_tensor(x, 1, group=group)
    return torch.equal(want, x[:, :3]), torch.equal(got, x[:, 3 * r:3 * r + 3])


def _none_set(rank, world):
    """None set, none given: both slice by the world group's size at rank 0, pad and all."""
    import verl.utils.ulysses as vu

    from cpshard.compat import verl as cv

    x = torch.arange(2 * (world + 1), dtype=torch.float32).view(2, world + 1).requires_grad_(True)
    out = []
    for padding in (True, False):
        want, got, gw, gg = _both("slice_input_tensor", (x, 1), dict(padding=padding), x, seed=rank)
        out.append(_same(got, want) and _same(gg, gw) and torch.equal(got, want) and got.shape[1] == 1 + padding)
    ids = torch.arange(world + 1).view(1, -1)
    want, got = vu.ulysses_pad_and_slice_inputs(ids, None, 1), cv.ulysses_pad_and_slice_inputs(ids, None, 1)
    out.append(_equal_outputs(want, got) and got[0].tolist() == [[0]])
    return out


def _mutants(rank, world):
    """Drop-ins broken on purpose (the gradient scale, the unpad, the slice's rank): each must differ."""
    import torch.distributed as dist
    import verl.utils.ulysses as vu

    from cpshard.compat import verl as cv

    vu.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)

    def unscaled(x, dim, **kw):
        return cv.gather_outputs_and_unpad(x, dim, **{**kw, "grad_scaler": not kw["grad_scaler"]})

    def short(x, dim, **kw):
        return cv.gather_outputs_and_unpad(x, dim, **{**kw, "padding_size": kw["padding_size"] + 1})

    def next_rank(x, dim, **kw):  # the next rank's piece
        return cv.slice_input_tensor(torch.roll(x, -(x.shape[dim] // world), dim), dim, **kw)

    found = []
    for name, ours, args, kw in [("gather_outputs_and_unpad", unscaled, (x, 1), dict(grad_scaler=True)),
                                 ("gather_outputs_and_unpad", short, (x, 1),
                                  dict(unpad_dim=1, padding_size=1, grad_scaler=True)),
                                 ("slice_input_tensor", next_rank, (torch.randn(2, 2 * world), 1), {})]:
        want, got, gw, gg = _both(name, args, kw, x if args[0] is x else args[0], seed=rank, ours=ours)
        found.append(not (_equal_outputs(want, got) and _same(gg, gw)))
    vu.set_ulysses_sequence_parallel_group(None)
    return found


def _errors(world):
    """What bad arguments raise, on every rank before any collective (the ranks go on together after)."""
    import torch.distributed as dist

    from cpshard.compat import verl as cv

    g, x = dist.group.WORLD, torch.zeros(2, 3, 4)
    other = dist.new_group([0])  # every rank creates it; only rank 0 belongs to it
    calls = [lambda: cv.gather_outputs_and_unpad(x, 1, unpad_dim=1, padding_size=3 * world + 1, group=g),
             lambda: cv.gather_outputs_and_unpad(x, 1, unpad_dim=0, padding_size=-1, group=g),
             lambda: cv.gather_outputs_and_unpad(x, 1, unpad_dim=0, padding_size=1.0, group=g),
             lambda: cv.gather_seq_scatter_heads(torch.zeros(2, 3, 2 * world), 1, 2, 3 * world + 1, group=g),
             lambda: cv.gather_seq_scatter_heads(torch.zeros(2, 3, world + 1), 1, 2, group=g),
             lambda: cv.slice_input_tensor(x, 5, group=g),
             lambda: cv.slice_input_tensor(x, 1, group=other) if dist.get_rank() else _raise()]
    out = []
    for call in calls:
        try:
            call()
            out.append("returned")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    dist.barrier()
    return out


def _raise():
    raise ValueError("rank 0 is in the group")


@pytest.fixture(scope="module")
def gloo():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(_suite, world, timeout=300, collective_timeout=60)
        return cache[world]
    return get


@pytest.mark.parametrize("world", [2, 4])
def test_drop_ins_match_verl_on_gloo(gloo, world):
    for rank, res in enumerate(gloo(world)):
        assert res["differ"] == [], (rank, res["differ"][:5])
        assert res["compared"] == (69 if world == 2 else 236), res["compared"]  # the grid is seeded


@pytest.mark.parametrize("world", [2, 4])
def test_no_group_set_slices_by_the_world_at_rank_0_as_verl(gloo, world):
    for res in gloo(world):
        assert res["none set"] == [True, True, True]


@pytest.mark.parametrize("world", [2, 4])
def test_given_group_slices_at_this_ranks_place_where_verl_takes_rank_0(gloo, world):
    for res in gloo(world):
        verl_at_rank_0, ours_at_own_rank = res["given"]
        assert verl_at_rank_0 and ours_at_own_rank


def test_a_broken_drop_in_is_caught(gloo):
    for res in gloo(2):
        assert res["mutants"] == [True, True, True]


def test_bad_arguments_raise_on_every_rank_naming_them(gloo):
    for rank, res in enumerate(gloo(2)):
        big, negative, floating, unpadded, heads, dim, outside = res["errors"]
        assert big.startswith("ValueError: padding_size=7: must be in [0, 6] (the gathered size of dimension 1)")
        assert negative.startswith("ValueError: padding_size=-1: must be in [0, 2]")
        assert floating.startswith("TypeError: padding_size=1.0: must be an int where unpad_dim is given")
        assert unpadded.startswith("ValueError: unpadded_dim_size=7: must be in [1, 6)")
        assert heads.startswith("ValueError: x=a tensor of shape (2, 3, 3): must divide dimension 2 (3) by the group")
        assert dim.startswith("ValueError: dim=5: must name a dimension of the tensor of shape (2, 3, 4)")
        assert outside.startswith("ValueError: group=" if rank else "ValueError: rank 0 is in the group")
        assert rank == 0 or "does not contain this process (global rank 1)" in outside


def test_inside_a_ring_axis_the_helpers_without_two_axis_meaning_refuse():
    """Under ``CPSHARD_RING=R > 1`` (the FSDP engine's micro-batch inside ``ring_rows``), the four helpers that
    slice or exchange over verl's whole SP group raise naming the variable, and verl's pad-and-slice call
    refuses another SP size or another row length; with ``group=`` given they are verl's as ever."""
    from types import SimpleNamespace

    plan = SimpleNamespace(num_tokens=6, local_len=4, tp_size=1)
    rows = cv.RingRows(SimpleNamespace(ring_size=2, ulysses_size=1), SimpleNamespace(plan=plan), 2)
    x = torch.arange(6)[None]
    with cv.ring_rows(rows):
        for call in (lambda: cv.slice_input_tensor(x, 1), lambda: cv.ulysses_pad(x, None, 2),
                     lambda: cv.gather_seq_scatter_heads(torch.ones(1, 3, 2, 1), 1, 2),
                     lambda: cv.gather_heads_scatter_seq(torch.ones(1, 6, 1, 1), 2, 1)):
            with pytest.raises(ValueError, match=r"^CPSHARD_RING=2 \(ring\) x 1 \(Ulysses\): verl's \w+ has no "
                                                 r"two-axis meaning"):
                call()
        with pytest.raises(ValueError, match=r"^sp_size=4: must be verl's SP size 2 under CPSHARD_RING=2"):
            cv.ulysses_pad_and_slice_inputs(x, None, 4)
        with pytest.raises(ValueError, match=r"^input_ids_rmpad=a tensor of shape \(1, 5\): must be the "
                                             r"micro-batch's packed row \(1, 6\)"):
            cv.ulysses_pad_and_slice_inputs(x[:, :5], None, 2)
        with pytest.raises(ValueError, match=r"^x=a tensor of shape \(3,\) gathered along 0: must be this rank's 4"):
            cv.gather_outputs_and_unpad(torch.ones(3), 0, 0, 0)
