"""cpshard as torchtitan's load balancer (``cpshard.compat.torchtitan``), through torchtitan's own code.

torchtitan's ``prepare_context_parallel_input`` (imported here by name before anything switches
cpshard on, as torchtitan's trainer does) with ``load_balancer_type="cpshard"`` / ``"cpshard_zigzag"``
on gloo ranks (cp 2, 3, 4): every rank holds ``cpshard.shard``'s rows, every (input, label, position)
triple is kept, and flex attention with the block mask it returns (built by torchtitan's own mask
helpers from the positions), K/V all-gathered as torchtitan does, equals attention at cp = 1
(float64, forward only: flex attention has no CPU backward in torch 2.13). cpshard's zigzag indices
equal the per-document head-tail layout of PyTorch after #189902 (a naive reference below); torch's own
types ("headtail") pass through unchanged. The patch's round trip, its report and the config's override.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan.distributed.context_parallel",
                    reason="torchtitan is not on this path: scripts/test.sh runs this module in a pass of its own with "
                    ".venv-torchtitan first on PYTHONPATH (scripts/setup.sh; CPSHARD_NO_TORCHTITAN=1 skips it)")

# imported before cpshard is switched on, as torchtitan's trainer and validator do
from torchtitan.distributed.context_parallel import prepare_context_parallel_input  # noqa: E402

import cpshard  # noqa: E402
from cpshard.compat import torch_cp  # noqa: E402
from cpshard.compat import torchtitan as cptitan  # noqa: E402
from cpshard.spawn import run_ranks  # noqa: E402
from reference import ref_rank_order  # noqa: E402

API = "torchtitan.distributed.context_parallel.api"
PACKAGE = "torchtitan.distributed.context_parallel"
H, D = 2, 4


def per_document_head_tail(lengths: list[int], cp: int) -> torch.Tensor:
    """Naive reference: PyTorch's per-document head-tail layout after pytorch #189902, from its
    definition. Each document is cut into ``2 * cp`` equal chunks; rank ``r`` takes chunks ``r`` and
    ``2 * cp - 1 - r`` of every document, documents in order; the ranks follow one another. The row's
    original positions in that order."""
    out = []
    for r in range(cp):
        start = 0
        for n in lengths:
            assert n % (2 * cp) == 0
            c = n // (2 * cp)
            out += list(range(start + r * c, start + (r + 1) * c))
            out += list(range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c))
            start += n
    return torch.tensor(out)


def positions_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.data())
def test_zigzag_indices_equal_per_document_head_tail(cp, data):
    rows_n = data.draw(st.integers(1, 3))
    units = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))  # row of documents, 2cp-multiples
    rows = [[u * 2 * cp for u in units]]
    for _ in range(rows_n - 1):  # more rows of the same S, other documents
        total, left, lens = sum(units), sum(units), []
        while left:
            lens.append(data.draw(st.integers(1, left)))
            left -= lens[-1]
        rows.append([u * 2 * cp for u in lens])
        assert sum(lens) == total
    pos = positions_of(rows)
    plans = cptitan.batch_plans("cpshard_zigzag", (pos,), pos, 1, cp)
    got = torch_cp.rearrange_indices(plans)
    want = torch.stack([per_document_head_tail(lens, cp) for lens in rows])
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.data())
def test_zigzag_takes_rows_of_any_documents(cp, data):
    """A full row of any documents (0 never: a document starts at each 0; 1-token ones, ones shorter
    than 2 * cp): nothing padded, every rank S / cp rows, and the indices those of the naive per-token
    reference of unpadded zigzag (chunks one row apart, extras dealt by one counter)."""
    S = cp * data.draw(st.integers(1, 16))
    rows = []
    for _ in range(data.draw(st.integers(1, 3))):
        lens, left = [], S
        while left:
            lens.append(min(data.draw(st.sampled_from([1, 2 * cp - 1]) | st.integers(1, left)), left))
            left -= lens[-1]
        rows.append(lens)
    pos = positions_of(rows)
    plans = cptitan.batch_plans("cpshard_zigzag", (pos,), pos, 1, cp)
    for plan, lens in zip(plans, rows, strict=True):
        assert plan.input_padded_seqlens_py == tuple(lens) and plan.total_len == S
        assert plan.padding.value == "none" and plan.padding_overhead == 0.0
    got = torch_cp.rearrange_indices(plans)
    want = torch.tensor([ref_rank_order(lens, None, cp, "zigzag") for lens in rows])
    assert torch.equal(got, want)


def test_zigzag_takes_documents_that_do_not_divide_by_2cp():
    pos = positions_of([[8, 6, 2]])
    plan, = cptitan.batch_plans("cpshard_zigzag", (pos,), pos, 1, 4)
    assert plan.input_padded_seqlens_py == (8, 6, 2) and [len(plan.global_rows(r)) for r in range(4)] == [4] * 4
    with pytest.raises(ValueError, match="'headtail'.*not one of cpshard's"):
        cptitan.batch_plans("headtail", (pos,), pos, 1, 4)
    with pytest.raises(ValueError, match=r"positions=tensor of shape \(1, 15\).*must be \(B, S\) = \(1, 16\)"):
        cptitan.batch_plans("cpshard", (pos,), pos[:, :15], 1, 4)


def test_without_positions_each_row_is_one_document():
    x = torch.arange(24).view(2, 12)
    plans = cptitan.batch_plans("cpshard", (x,), None, 1, 3)
    assert [list(p.input_seqlens_py) for p in plans] == [[12], [12]]


def _block_mask(pos: torch.Tensor):
    """The batch's document-causal BlockMask, built by torchtitan's own mask helpers."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

    B, S = pos.shape
    return create_block_mask(and_masks(get_causal_mask_mod(), get_document_mask_mod(pos)), B, None, S, S,
                             device="cpu", BLOCK_SIZE=8)


def _qkv(B: int, S: int) -> torch.Tensor:
    return torch.randn(3, B, H, S, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


BATCHES = {  # cp -> (kind, rows): B >= 1 rows of S = 128 * cp tokens (torch's CP block mask needs S to divide
    # by cp * 128); documents of any length, those of zigzag rows too (chunks one row apart)
    2: [("cpshard", [[37, 1, 90, 5, 123], [256]]), ("cpshard_zigzag", [[100, 61, 1, 94], [251, 5]])],
    3: [("cpshard", [[7, 200, 1, 99, 77]]), ("cpshard_zigzag", [[7, 299, 1, 77], [384]])],
    4: [("cpshard", [[1, 13, 250, 8, 240], [512]]), ("cpshard_zigzag", [[9, 15, 1, 487], [255, 257]])],
}


def grid(cp: int) -> list[tuple[str, list[list[int]]]]:
    """Small batches without masks, seeded: 1-3 rows of S tokens (S a multiple of 2 * cp), documents of
    1 .. 3 * cp tokens (lengths below 2 * cp included) for "cpshard" and "cpshard_zigzag" alike, and
    multiples of 2 * cp for zigzag too."""
    rng = random.Random(cp)
    out = []
    for _ in range(6):
        S = 2 * cp * rng.randint(1, 5)
        for kind, unit, most in (("cpshard", 1, 3 * cp), ("cpshard_zigzag", 1, 3 * cp), ("cpshard_zigzag", 2 * cp, 3)):
            rows = []
            for _ in range(rng.randint(1, 3)):
                lens, left = [], S
                while left:
                    lens.append(min(left, unit * rng.randint(1, most)))
                    left -= lens[-1]
                rows.append(lens)
            out.append((kind, rows))
    return out


def _rank(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention.flex_attention import flex_attention

    mesh = DeviceMesh("cpu", list(range(world)))
    names = torch_cp.torch_names()
    out = []
    with cptitan.patch() as patched:
        assert patched.active
        for kind, rows in BATCHES[world]:
            B, S = len(rows), sum(rows[0])
            pos = positions_of(rows)
            ids = torch.arange(B * S).view(B, S)  # each token's global id
            labels = 1000 + ids
            extra = {"positions": pos, "attention_masks": _block_mask(pos)}
            got_ids, got_labels, got = prepare_context_parallel_input(ids, labels, extra, mesh, torch.device("cpu"),
                                                                      kind, None)
            qkv = _qkv(B, S)  # (3, B, H, S, D): the rank takes its tokens' q, k and v
            local = torch.stack([qkv[:, b][:, :, got_ids[b] - b * S] for b in range(B)], 1)  # (3, B, H, L, D)
            gk, gv = names.flex_cp_allgather(local[1], local[2], 2, mesh.get_group().group_name)
            o = flex_attention(local[0], gk, gv, block_mask=got["attention_masks"])
            out.append((kind, got_ids, got_labels, got["positions"], o))
        for kind, rows in grid(world):  # no masks: any S that divides by 2 * cp
            pos = positions_of(rows)
            ids = torch.arange(pos.numel()).view(pos.shape)
            got_ids, got_labels, got = prepare_context_parallel_input(ids, 1000 + ids, {"positions": pos}, mesh,
                                                                      torch.device("cpu"), kind, None)
            out.append((kind, got_ids, got_labels, got["positions"], None))
        # a plain cp_shard call (Flux's): one document a row, or the positions it names
        package = importlib.import_module(PACKAGE)
        rows = [[3, 2 * world - 1, 2 * world - 2], [4 * world]]
        pos = positions_of(rows)
        ids = torch.arange(pos.numel()).view(pos.shape)
        (plain,), none = package.cp_shard(mesh, (ids,), None, "cpshard")
        (named, named_pos), _ = package.cp_shard(mesh, (ids, pos), None, "cpshard", positions=pos)
        out.append((plain, named, named_pos, none))
        ids = torch.arange(2 * 128 * world).view(2, -1)
        on = prepare_context_parallel_input(ids, ids + 1, {"positions": ids % 7}, mesh, torch.device("cpu"),
                                            "headtail", None)
    assert not patched.active
    off = prepare_context_parallel_input(ids, ids + 1, {"positions": ids % 7}, mesh, torch.device("cpu"), "headtail",
                                         None)
    assert all(torch.equal(a, b) for a, b in zip((on[0], on[1], on[2]["positions"]), (off[0], off[1],
                                                                                       off[2]["positions"])))
    assert not torch.equal(on[0], ids.chunk(world, 1)[rank])  # torch's head-tail rows, not plain pieces
    return out


@functools.cache
def ranks_of(cp: int) -> list:
    """Every rank's results of :func:`_rank`, one run per ``cp`` for the tests below."""
    return run_ranks(_rank, cp)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_prepare_context_parallel_input_shards_every_triple_and_flex_attention_equals_cp1(cp):
    from torch.nn.attention.flex_attention import flex_attention

    ranks = ranks_of(cp)
    for i, (kind, rows) in enumerate(BATCHES[cp]):
        B, S = len(rows), sum(rows[0])
        pos = positions_of(rows)
        ids = torch.arange(B * S).view(B, S)
        plans = cptitan.batch_plans(kind, (ids,), pos, 1, cp)
        qkv = _qkv(B, S)
        want = flex_attention(qkv[0], qkv[1], qkv[2], block_mask=_block_mask(pos))  # cp = 1
        seen = []
        for r, results in enumerate(ranks):
            got_kind, got_ids, got_labels, got_pos, o = results[i]
            assert got_kind == kind
            for b in range(B):  # rank r holds exactly cpshard.shard's rows of the row's documents
                assert torch.equal(got_ids[b], cpshard.shard(ids[b], plans[b], r)), (kind, r, b)
            assert torch.equal(got_labels, 1000 + got_ids)  # every (input, label, position) triple kept
            assert torch.equal(got_pos, pos.flatten()[got_ids])
            seen.append(got_ids)
            for b in range(B):
                assert torch.allclose(o[b], want[b][:, got_ids[b] - b * S], rtol=1e-12, atol=1e-13), (kind, r, b)
        assert torch.equal(torch.cat(seen, 1).sort(1).values, ids)  # a permutation of every row


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_triple_is_kept_on_small_batches_and_plain_cp_shard_calls(cp):
    ranks = ranks_of(cp)
    first = len(BATCHES[cp])
    for i, (kind, rows) in enumerate(grid(cp), first):
        pos = positions_of(rows)
        ids = torch.arange(pos.numel()).view(pos.shape)
        plans = cptitan.batch_plans(kind, (ids,), pos, 1, cp)
        seen = []
        for r, results in enumerate(ranks):
            got_kind, got_ids, got_labels, got_pos, _ = results[i]
            assert got_kind == kind
            for b in range(len(rows)):
                assert torch.equal(got_ids[b], cpshard.shard(ids[b], plans[b], r)), (kind, rows, r, b)
            assert torch.equal(got_labels, 1000 + got_ids) and torch.equal(got_pos, pos.flatten()[got_ids])
            seen.append(got_ids)
        assert torch.equal(torch.cat(seen, 1).sort(1).values, ids), (kind, rows)
    rows = [[3, 2 * cp - 1, 2 * cp - 2], [4 * cp]]
    pos = positions_of(rows)
    ids = torch.arange(pos.numel()).view(pos.shape)
    one_each = cptitan.batch_plans("cpshard", (ids,), None, 1, cp)  # each row one document
    by_document = cptitan.batch_plans("cpshard", (ids,), pos, 1, cp)
    assert [list(p.input_seqlens_py) for p in by_document] == rows
    for r, results in enumerate(ranks):
        plain, named, named_pos, masks = results[-1]
        assert masks is None
        for b in range(2):
            assert torch.equal(plain[b], cpshard.shard(ids[b], one_each[b], r))
            assert torch.equal(named[b], cpshard.shard(ids[b], by_document[b], r))
        assert torch.equal(named_pos, pos.flatten()[named])


def test_patch_round_trip_and_report(monkeypatch):
    api = importlib.import_module(API)
    package = importlib.import_module(PACKAGE)
    before = api.cp_shard
    early = types.ModuleType("torchtitan.cpshard_probe")  # a loaded torchtitan module that bound cp_shard by name
    early.cp_shard = early.shard = before
    monkeypatch.setitem(sys.modules, early.__name__, early)
    assert cptitan.active() is None
    with cptitan.patch() as p:
        assert p.active and cptitan.active() is p
        assert p.bound == [f"{API}.cp_shard", f"{PACKAGE}.cp_shard", f"{early.__name__}.cp_shard",
                           f"{early.__name__}.shard"]
        assert early.cp_shard is api.cp_shard and early.shard is api.cp_shard
        late = types.ModuleType("torchtitan.cpshard_late")  # imported while the patch is on: takes cpshard's
        late.cp_shard = package.cp_shard
        monkeypatch.setitem(sys.modules, late.__name__, late)
        assert p.original() is before and api.cp_shard is not before and package.cp_shard is api.cp_shard
        assert p.kinds == ("cpshard", "cpshard_zigzag")
        assert not cptitan.patch().active  # another patch holds the sites: binds nothing
        from cpshard.compat.torchtitan.__main__ import status
        report = status()
        assert report["on"] and report["bound"] == p.bound and report["error"] is None
    assert not p.active and cptitan.active() is None
    assert api.cp_shard is before and package.cp_shard is before
    assert early.cp_shard is before and early.shard is before and late.cp_shard is before
    p.undo()  # a second undo does nothing
    assert api.cp_shard is before


def test_the_report_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-m", "cpshard.compat.torchtitan", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert not report["on"] and report["bound"] == [f"{API}.cp_shard", f"{PACKAGE}.cp_shard"]
    assert report["tested"] == {"torchtitan": "0.3.0", "torch": "2.13.0"}
    assert "--override.imports cpshard.compat.torchtitan.enable.switch_on" in " ".join(report["config"])


ENABLE = """
import dataclasses, importlib
from torchtitan.distributed.context_parallel import prepare_context_parallel_input
from torchtitan.config import Configurable
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.tools.profiler import Profiler
from cpshard.compat import torchtitan as cptitan

@dataclasses.dataclass(kw_only=True, slots=True)
class Root(Configurable.Config):  # a trainer config's profiler node, as Trainer.Config holds it
    profiler: Profiler.Config = dataclasses.field(default_factory=Profiler.Config)

root = Root()
node = root.profiler
assert cptitan.active() is None
lines = apply_overrides(OverrideConfig(imports=["cpshard.compat.torchtitan.enable.switch_on"]), root)
assert root.profiler is node, "the override returns the profiler's config unchanged"
assert len(lines) == 1 and "cpshard.compat.torchtitan.enable.switch_on: profiler" in lines[0], lines
patch = cptitan.active()
assert patch is not None and patch is importlib.import_module("cpshard.compat.torchtitan.enable").PATCH
assert cptitan.activate() is patch and cptitan.process_patch() is patch  # once a process
api = importlib.import_module("torchtitan.distributed.context_parallel.api")
assert api.cp_shard is not patch.original()
patch.undo()
assert api.cp_shard is patch.original() and cptitan.active() is None
apply_overrides(OverrideConfig(imports=["cpshard.compat.torchtitan.enable.switch_on"]), root)  # on again
assert cptitan.active() is not None
print("ok")
"""


def test_the_config_override_switches_cpshard_on():
    run = subprocess.run([sys.executable, "-c", ENABLE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
