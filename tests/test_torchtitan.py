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
import logging
import random
import subprocess
import sys
import types
import warnings

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
        # a plain cp_shard call (Flux's): one document a row (with a warning naming it), or the positions it names
        package = importlib.import_module(PACKAGE)
        rows = [[3, 2 * world - 1, 2 * world - 2], [4 * world]]
        pos = positions_of(rows)
        ids = torch.arange(pos.numel()).view(pos.shape)
        with pytest.warns(cptitan.NoPositionsWarning, match="each batch row is taken as one document"):
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
        assert p.active and cptitan.active() is p and p.state == "in force"
        assert p.bound == [f"{API}.prepare_context_parallel_input", f"{API}.cp_shard", f"{PACKAGE}.cp_shard",
                           f"{early.__name__}.cp_shard", f"{early.__name__}.shard"]
        assert early.cp_shard is api.cp_shard and early.shard is api.cp_shard
        # its code: the function this module took by name runs cpshard's (and every other reference to it)
        assert prepare_context_parallel_input is api.prepare_context_parallel_input
        assert prepare_context_parallel_input.__code__ is not p.original("prepare_context_parallel_input").__code__
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
    assert prepare_context_parallel_input.__code__ is p.original("prepare_context_parallel_input").__code__
    assert p.state == "off" and p.unrestored == {}
    p.undo()  # a second undo does nothing
    assert api.cp_shard is before


def test_a_copy_of_the_function_made_while_patched_runs_torchtitans_after_undo():
    """A copy of ``prepare_context_parallel_input`` made while the patch is on (a new function of its
    code and globals, as pickling by value makes) runs the swapped code. Before: after ``undo()`` it
    raised a raw ``NameError`` (the module global that code calls was deleted). Now it runs
    torchtitan's own function, as the original does."""
    api = importlib.import_module(API)
    fn = api.prepare_context_parallel_input
    with cptitan.patch():
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    calls = []
    # torchtitan's own code for an unknown balancer type: whatever it does, the copy must do the same
    for f in (fn, copy):
        try:
            f(None, None, {"positions": None}, None, "cpu", "headtail")
        except Exception as e:  # noqa: BLE001  (torchtitan's own error on a None mesh)
            calls.append((type(e), str(e)))
    assert calls[0] == calls[1] and calls[0][0] is not NameError
    with cptitan.patch() as again:  # a second patch binds and undoes the same way
        own = again.original("prepare_context_parallel_input").__code__
        assert api.prepare_context_parallel_input.__code__ is not own
    assert api.prepare_context_parallel_input.__code__ is own


def test_the_report_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-m", "cpshard.compat.torchtitan", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert not report["on"] and report["state"] == "off"
    assert report["bound"] == [f"{API}.prepare_context_parallel_input", f"{API}.cp_shard", f"{PACKAGE}.cp_shard"]
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
enable = importlib.import_module("cpshard.compat.torchtitan.enable")
assert cptitan.active() is not None and enable.PATCH is cptitan.active(), "PATCH names the patch in force"
enable.PATCH.undo()  # switches it off: the new patch, not the stale first one
assert cptitan.active() is None and api.cp_shard is patch.original()
print("ok")
"""

ADOPT = """
import importlib
from cpshard.compat import torchtitan as cptitan
with cptitan.patch() as block:
    enable = importlib.import_module("cpshard.compat.torchtitan.enable")  # imported inside a with block
    assert enable.PATCH is not block and enable.PATCH.state == "in force" and not block.active
assert cptitan.active() is enable.PATCH and enable.PATCH.state == "in force", "on for the life of the process"
print("ok")
"""


def test_enable_imported_inside_a_with_block_stays_on():
    """Before: the block's patch became the process's, and leaving the block switched cpshard off."""
    run = subprocess.run([sys.executable, "-c", ADOPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_the_report_says_where_it_looked_when_torchtitan_does_not_import(tmp_path):
    """Before: "install it", where scripts/setup.sh had installed it into .venv-torchtitan (a --target folder
    that goes on PYTHONPATH). Now the error lists sys.path and the PYTHONPATH line (here: the folder found)."""
    (tmp_path / ".venv-torchtitan" / "torchtitan").mkdir(parents=True)
    code = ("import sys; sys.modules['torchtitan.distributed.context_parallel.api'] = None\n"
            "from cpshard.compat.torchtitan.__main__ import main\nraise SystemExit(main())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "looked in sys.path [" in run.stdout and f"PYTHONPATH={tmp_path}/.venv-torchtitan" in run.stdout


def test_the_config_override_switches_cpshard_on():
    run = subprocess.run([sys.executable, "-c", ENABLE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_undo_under_another_librarys_wrapper_reports_what_it_left(capsys, caplog):
    """Before: undo() logged "restored" while the wrapped site still reached cpshard. Now the site is
    named in ``unrestored`` and a WARNING, and ``active()`` / the report say "partly in force" while the
    wrapper holds it; once the other library takes its wrapper off, the patch is off."""
    package = importlib.import_module(PACKAGE)
    api = importlib.import_module(API)
    before = package.cp_shard
    p = cptitan.patch()
    ours = package.cp_shard

    @functools.wraps(ours)
    def other_librarys(*args, **kwargs):  # another library's wrapper, set over cpshard's
        return ours(*args, **kwargs)

    package.cp_shard = other_librarys
    try:
        p.undo()
        assert not p.active and p.state == "partly in force"
        assert list(p.unrestored) == [f"{PACKAGE}.cp_shard"]
        assert "still reach cpshard" in p.unrestored[f"{PACKAGE}.cp_shard"]
        assert cptitan.active() is p and "partly in force" in repr(p)
        from cpshard.compat.torchtitan.__main__ import main, status
        report = status()
        assert report["state"] == "partly in force" and not report["on"]
        assert list(report["unrestored"]) == [f"{PACKAGE}.cp_shard"]
        assert main([]) == 0 and "partly in force in this process" in capsys.readouterr().out
        assert api.cp_shard is p.original()  # every other site restored
        assert api.prepare_context_parallel_input.__code__ is p.original("prepare_context_parallel_input").__code__
        api.cp_shard = other_librarys  # Before: a new patch over the wrapper bound nothing, silently
        with caplog.at_level(logging.WARNING, logger="cpshard.compat.torchtitan"):
            again = cptitan.patch()
        assert not again.active and "patch() bound nothing" in caplog.text
        api.cp_shard = p.original()
    finally:
        package.cp_shard = before  # the other library unwraps
    assert p.state == "off" and cptitan.active() is None


def test_batch_errors_are_named():
    """Before: AttributeError for NumPy or list positions, and extra_kwargs['positions'] = None reported
    as a bad ``inputs``."""
    import numpy as np

    ids = torch.zeros(2, 8, dtype=torch.long)
    pos = positions_of([[8], [4, 4]])
    for bad in (pos.numpy(), pos.tolist()):
        with pytest.raises(TypeError, match=r"positions=(ndarray|list): must be the batch's position ids as a \(B, "):
            cptitan.batch_plans("cpshard", (ids,), bad, 1, 2)
    with pytest.raises(TypeError, match=r"extra_kwargs\['positions'\]=None: must be a tensor.*post_dataloading"):
        cptitan.batch_plans("cpshard", (ids, ids, None), None, 1, 2,
                            ("inputs", "labels", "extra_kwargs['positions']"))
    assert np.asarray(pos).shape == (2, 8)
    # Before: labels of another shape than the inputs reached torch's shard, a raw RuntimeError / ValueError
    # naming no argument ("The expanded size of the tensor (10) must match ...")
    names = ("inputs", "labels", "extra_kwargs['positions']")
    for labels in (torch.zeros(2, 10, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), torch.zeros(8)):
        with pytest.raises(ValueError, match=r"labels=tensor of shape .*: must have S=8 rows along dimension 1 "
                                             r"and 2 batch rows"):
            cptitan.batch_plans("cpshard", (ids, labels, pos), pos, 1, 2, names)
    for dim in (2, -1):
        with pytest.raises(ValueError, match=rf"input_seq_dim={dim}: must name a dimension of the 2-dimensional first"):
            cptitan.batch_plans("cpshard", (ids,), pos, dim, 2)
    assert len(cptitan.batch_plans("cpshard", (ids, ids, pos), pos, 1, 2, names)) == 2
    assert len(cptitan.batch_plans("cpshard", (ids, ids[:1], pos[:1]), pos[:1], 1, 2, names)) == 1  # broadcast


def test_work_balance_is_the_ranks_causal_work():
    """The DEBUG line's figures against a per-token count: rank work = sum of (position + 1) over its rows."""
    pos = positions_of([[6, 2], [8]])
    plans = cptitan.batch_plans("cpshard", (pos,), pos, 1, 2)
    order = torch_cp.rearrange_indices(plans)
    ours, head_tail = cptitan.work_balance(pos, order, 2)
    work = [sum(int(pos[b, i]) + 1 for b in range(2) for i in order[b, r * 4:(r + 1) * 4]) for r in range(2)]
    assert ours == max(work) / (sum(work) / 2)
    ht = [sum(int(pos[b, i]) + 1 for b in range(2) for i in idx) for idx in ([0, 1, 6, 7], [2, 3, 4, 5])]
    assert head_tail == max(ht) / (sum(ht) / 2)


def _edges(rank, world):
    """On gloo ranks (cp 2), torch's CP block masks built by the uncompiled create_block_mask: (1) a
    wrapper over cp_shard, which fooled the caller-frame inspection (every row one document), does not
    hide the positions; (2) a B = 1 BlockMask over rows of different orders gives each row its own
    attention (as at cp = 1); (3) with checks on, a rank whose positions are refused makes every rank
    raise; (4) a 2-D mesh and a process group are refused by name."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from cpshard.distributed import set_checks

    _attention._compiled_create_block_mask = create_block_mask
    api = importlib.import_module(API)
    mesh = DeviceMesh("cpu", list(range(world)))
    names = torch_cp.torch_names()
    out = {}
    rows = [[100, 156], [30, 226]]  # S = 256: two rows whose balanced orders differ
    pos = positions_of(rows)
    B, S = len(rows), sum(rows[0])
    ids = torch.arange(B * S).view(B, S)
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(f"{record.levelname} {record.getMessage()}")
    log = logging.getLogger("cpshard.compat.torchtitan")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    captured = api.prepare_context_parallel_input  # taken before the patch, called through a closure

    def early_wrapper(*args, **kwargs):
        return captured(*args, **kwargs)

    with cptitan.patch():
        inner = api.cp_shard

        def logged(*args, **kwargs):  # a wrapper over cp_shard, as a logging library would add
            return inner(*args, **kwargs)

        api.cp_shard = logged
        with warnings.catch_warnings():
            warnings.simplefilter("error", cptitan.NoPositionsWarning)
            got_ids, _, _ = prepare_context_parallel_input(ids, ids, {"positions": pos}, mesh, torch.device("cpu"),
                                                           "cpshard", None)
        api.cp_shard = inner
        out["wrapped"] = got_ids
        with warnings.catch_warnings():
            warnings.simplefilter("error", cptitan.NoPositionsWarning)
            out["early"] = early_wrapper(ids, ids, {"positions": pos}, mesh, torch.device("cpu"), "cpshard", None)[0]
        out["log"] = [r for r in records if "load_balancer_type" in r or "causal work" in r]
        wide = positions_of(BROADCAST_ROWS)
        S2 = wide.shape[1]
        wide_ids = torch.arange(B * S2).view(B, S2)
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, S2, S2, device="cpu")  # one mask for all rows
        got_ids, _, extra = prepare_context_parallel_input(wide_ids, wide_ids, {"positions": wide,
                                                                                "attention_masks": mask}, mesh,
                                                           torch.device("cpu"), "cpshard", None)
        qkv = _qkv(B, S2)
        local = torch.stack([qkv[:, b][:, :, got_ids[b] - b * S2] for b in range(B)], 1)
        gk, gv = names.flex_cp_allgather(local[1], local[2], 2, mesh.get_group().group_name)
        m = extra["attention_masks"]
        out["broadcast"] = (got_ids, flex_attention(local[0], gk, gv, block_mask=m),
                            {f: getattr(m, f) for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                        "full_kv_indices")})
        set_checks(True)
        try:
            bad = pos + 1 if rank == 1 else pos  # rank 1's positions do not start at 0
            labels = ids[:, :-1] if rank == 1 else ids  # rank 1's labels are one row short
            for key, (lab, p) in {"agreed": (ids, bad), "labels": (labels, pos)}.items():
                try:
                    prepare_context_parallel_input(ids, lab, {"positions": p}, mesh, torch.device("cpu"), "cpshard",
                                                   None)
                    out[key] = "ok"
                except ValueError as exc:
                    out[key] = (str(exc), str(exc.__cause__))
        finally:
            set_checks(False)
        short = torch.arange(16).view(1, 16)  # S = 16: torch's CP block mask needs S % (cp * 128) == 0
        try:
            prepare_context_parallel_input(short, short, {"positions": short, "attention_masks": create_block_mask(
                lambda b, h, q, kv: q >= kv, 1, None, 16, 16, device="cpu")}, mesh, torch.device("cpu"), "cpshard",
                None)
            out["short"] = "ok"
        except ValueError as exc:
            out["short"] = str(exc)
        two_d = DeviceMesh("cpu", torch.arange(world).view(1, world))
        for name, bad_mesh in (("2d", two_d), ("group", mesh.get_group())):
            try:
                importlib.import_module(PACKAGE).cp_shard(bad_mesh, (ids,), None, "cpshard", positions=pos)
                out[name] = "ok"
            except (TypeError, ValueError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    return out


#: rows whose orders differ where it shows: row 0 in its own order, row 1 its long document first, so
#: that a block row 0 leaves empty (its first queries against its last keys) holds row 1's keys 0-11
BROADCAST_ROWS = [[512], [12, 500]]


def _blocks(mask: dict, KV: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, Q blocks, KV blocks)`` bool of a BlockMask's partial and full blocks (head 0), from its tensors."""
    B, _, Q = mask["kv_num_blocks"].shape
    out = []
    for num, idx in ((mask["kv_num_blocks"], mask["kv_indices"]), (mask["full_kv_num_blocks"],
                                                                   mask["full_kv_indices"])):
        dense = torch.zeros(B, Q, KV, dtype=torch.bool)
        for b in range(B):
            for q in range(Q):
                if num is not None:
                    dense[b, q, idx[b, 0, q, :num[b, 0, q]]] = True
        out.append(dense)
    return out[0], out[1]


@functools.cache
def edges() -> list:
    return run_ranks(_edges, 2)


def test_a_wrapper_over_cp_shard_does_not_hide_the_positions():
    pos = positions_of([[100, 156], [30, 226]])
    ids = torch.arange(pos.numel()).view(pos.shape)
    plans = cptitan.batch_plans("cpshard", (ids,), pos, 1, 2)
    assert [list(p.input_seqlens_py) for p in plans] == [[100, 156], [30, 226]]
    for r, out in enumerate(edges()):
        for b in range(2):
            assert torch.equal(out["wrapped"][b], cpshard.shard(ids[b], plans[b], r))
            # a wrapper of prepare_context_parallel_input bound before the patch reaches cpshard's too
            assert torch.equal(out["early"][b], cpshard.shard(ids[b], plans[b], r))


def test_a_broadcast_block_mask_over_rows_of_different_orders_equals_cp1():
    """Before: torch's rewrite of a B = 1 mask read every row through row 0's order (the second row's
    attention wrong). Now the mask is widened to one row per batch row, each through its own order."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pos = positions_of(BROADCAST_ROWS)
    B, S = pos.shape
    plans = cptitan.batch_plans("cpshard", (pos,), pos, 1, 2)
    order = torch_cp.rearrange_indices(plans)
    assert not torch.equal(order[0], order[1])  # the rows' orders differ
    qkv = _qkv(B, S)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, S, S, device="cpu")
    want = flex_attention(qkv[0], qkv[1], qkv[2], block_mask=mask)  # cp = 1, the mask broadcast
    for out in edges():
        got_ids, o, local = out["broadcast"]
        assert local["kv_num_blocks"].shape[0] == B  # one row per batch row
        partial, full = _blocks(local)
        for b in range(B):
            assert torch.allclose(o[b], want[b][:, got_ids[b] - b * S], rtol=1e-12, atol=1e-13), b
            # what compiled flex reads (eager flex evaluates every element): every query/key pair the mask
            # allows lies in a block it computes, and a block it takes as full is allowed throughout
            q_orig = (got_ids[b] - b * S)[:, None]
            allowed = (q_orig >= order[b][None, :]).view(2, 128, 4, 128).any(3).any(1)
            whole = (q_orig >= order[b][None, :]).view(2, 128, 4, 128).all(3).all(1)
            assert not (allowed & ~(partial[b] | full[b])).any(), b
            assert not (full[b] & ~whole).any(), b


def test_a_refused_batch_raises_on_every_rank_with_checks_on():
    """Before: rank 1 refused its positions before the agreement; rank 0 waited, then died on gloo's raw
    "Connection closed". Now every rank raises: rank 1 its own error, rank 0 naming rank 1."""
    ranks = edges()
    for rank in ranks:
        assert "ranks [1] built no plan (see that rank's own error)" in rank["agreed"][0], rank["agreed"]
    assert ranks[1]["agreed"][1].startswith("positions[0, 0]=1: must be 0"), ranks[1]["agreed"]  # its own, chained
    # Before: rank 1's short labels reached torch's shard (a raw RuntimeError there) and rank 0 went on
    for rank in ranks:
        assert "ranks [1] built no plan (see that rank's own error)" in rank["labels"][0], rank["labels"]
    assert ranks[1]["labels"][1].startswith("labels=tensor of shape (2, 255): must have S=256 rows"), ranks[1]["labels"]


def test_the_balancer_says_when_it_first_runs_and_each_batchs_balance():
    """One INFO line the first time a process shards a batch; a DEBUG line a batch with the causal-work
    balance beside head-tail's (its figures: test_work_balance_is_the_ranks_causal_work)."""
    for out in edges():
        info = [r for r in out["log"] if r.startswith("INFO") and "shards the batches" in r]
        debug = [r for r in out["log"] if r.startswith("DEBUG")]
        assert len(info) == 1 and "load_balancer_type 'cpshard' shards the batches (cp 2" in info[0], out["log"]
        assert debug and all("causal work max/mean" in r and "torch's head-tail would give" in r for r in debug)


def test_a_block_mask_over_rows_torch_cannot_cut_names_the_way_out():
    for out in edges():
        assert out["short"].startswith("attention_masks=a BlockMask over rows of S=16: torch's CP block mask needs S "
                                       "to divide by cp * 128 = 256"), out["short"]
        assert "cpshard.compat.torch_cp.block_mask_len(S, 2)" in out["short"]


def test_a_2d_mesh_and_a_process_group_are_refused_by_name():
    for out in edges():
        assert out["2d"].startswith("ValueError: mesh=a DeviceMesh of 2 dimensions (1, 2)"), out["2d"]
        assert out["group"].startswith("TypeError: mesh=ProcessGroup: must be a 1-D DeviceMesh"), out["group"]
