"""cpshard switched on in verl: the layout each site uses, activation for a process, the reports.

In one process, against verl 0.9.1 itself. verl's Megatron engine does not import on a CPU box
without its optional packages (``peft``), so where a test needs the engine it puts a stand-in module
in its place, as ``test_verl_dcp.py`` does for the dynamic-CP scheduler: a ``MegatronEngine`` whose
``forward_backward_batch`` calls verl's sites the way verl's engine calls them (through verl's module
attributes, without a layout). ``tests/test_verl_ray.py`` runs the activation in real worker processes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import logging
import os
import re
import sys
import threading
import types

import pytest
import torch

try:
    import tensordict
    from verl.utils import seqlen_balancing as sb

    import verl_fakes as vf
except ImportError as exc:
    pytest.skip(f"verl 0.9.1 / megatron-core cannot be imported ({exc}); run scripts/setup.sh",
                allow_module_level=True)

from cpshard import ShardPlan, to_padded
from cpshard.compat import verl as cv
from cpshard.compat.verl import sites
from cpshard.compat.verl.__main__ import main as status_main

ENGINE = sites.ENGINE
LENS = [18, 73, 109, 103, 98, 9, 33, 16]  # at cp=4, 256 rows: zigzag and contiguous pack them differently
CP, BUDGET = 4, 256


def _batch(lens):
    width = max(lens)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    ids = torch.arange(len(lens) * width).view(len(lens), width)
    return tensordict.TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lens)])


def _engine_module(monkeypatch, rule=None):
    """A stand-in ``verl.workers.engine.megatron.transformer_impl`` with verl's ``MegatronEngine`` shape:
    ``tf_config``, and ``forward_backward_batch(data, loss_function, forward_only)`` that hands the call to
    ``loss_function`` (so the test runs verl's sites inside it); ``rule``: its ``_get_context_parallel_layout``."""
    module = types.ModuleType(ENGINE)

    class MegatronEngine:
        def __init__(self, config):
            self.tf_config = config

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            return loss_function(data)

    if rule is not None:
        MegatronEngine._get_context_parallel_layout = staticmethod(rule)
    module.MegatronEngine = MegatronEngine
    monkeypatch.setitem(sys.modules, ENGINE, module)
    return MegatronEngine


def _sites_layouts(data):
    """Run every layout-dependent site as verl calls it (no layout passed), through verl's module
    attributes; returns the layout each one used, read from what it returned."""
    import verl.models.mcore.util as vutil
    import verl.utils.dynamic_cp_scheduler as dcp

    out = {}
    _, idx = sb.rearrange_micro_batches(data, max_token_len=BUDGET)  # verl's engine utilities' call
    by_layout = {lay: cv.rearrange_micro_batches(data, BUDGET, cp_size=CP, tp_size=1, layout=lay)[1]
                 for lay in ("zigzag", "contiguous")}
    assert by_layout["zigzag"] != by_layout["contiguous"]
    out["rearrange_micro_batches"] = next(lay for lay, want in by_layout.items() if idx == want)
    x = vf.nested([5, 11, 3])
    _, psp, _ = vutil.preprocess_thd_engine(x, pre_process=True)  # verl's distillation loss: no cp_layout
    out["preprocess_thd_engine"] = psp._cpshard_plan.layout.value
    _, psp, _ = vutil.preprocess_thd_engine(x, cp_layout="zigzag")  # a layout verl passes wins
    out["preprocess_thd_engine(cp_layout='zigzag')"] = psp._cpshard_plan.layout.value
    padded, mask = to_padded(x, length=12)
    _, psp = vutil.preprocess_packed_seqs(padded, mask)
    out["preprocess_packed_seqs"] = psp._cpshard_plan.layout.value
    got = dcp._local_padding_mask([5, 11, 3], cp_size=CP, cp_rank=1, tp_size=1)
    out["local_padding_mask"] = next(lay for lay in ("zigzag", "contiguous") if torch.equal(
        got, cv.local_padding_mask([5, 11, 3], cp_size=CP, cp_rank=1, tp_size=1, cp_layout=lay)))
    return out


LAYOUT_SITES = ("rearrange_micro_batches", "preprocess_thd_engine", "preprocess_packed_seqs", "local_padding_mask")


@pytest.fixture
def megatron_cp4():
    """Megatron's parallel state initialized as far as the sites read it: cp=4, tp=1, rank 0."""
    with vf.parallel_state(1, CP, 0), vf.partition_mode(), \
            vf.swap(vf.mpu, {"model_parallel_is_initialized": lambda: True}):
        yield


DSV4 = types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid")
DENSE = types.SimpleNamespace(experimental_attention_variant=None)


@pytest.mark.parametrize("override", [None, "auto", "zigzag", "contiguous"])
@pytest.mark.parametrize("model", ["dsv4_hybrid", "dense", "no engine"])
def test_the_layout_each_site_uses(monkeypatch, megatron_cp4, model, override, caplog):
    """The rule (docs/verl.md): a layout verl passes wins; else the override (CPSHARD_LAYOUT); else the
    model's where verl's Megatron engine runs the call (dsv4_hybrid: contiguous); else zigzag."""
    if override is None:
        monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("CPSHARD_LAYOUT", override)
    engine_cls = _engine_module(monkeypatch)
    data = _batch(LENS)
    with caplog.at_level(logging.DEBUG, logger="cpshard.compat.verl"), cv.patch() as p:
        assert f"{ENGINE}.MegatronEngine.forward_backward_batch" in p.bound
        if model == "no engine":
            got = _sites_layouts(data)
        else:
            got = engine_cls(DSV4 if model == "dsv4_hybrid" else DENSE).forward_backward_batch(data, _sites_layouts)
    if override in ("zigzag", "contiguous"):
        want = override
    else:
        want = "contiguous" if model == "dsv4_hybrid" else "zigzag"
    assert {site: got[site] for site in LAYOUT_SITES} == dict.fromkeys(LAYOUT_SITES, want)
    assert got["preprocess_thd_engine(cp_layout='zigzag')"] == "zigzag"
    if model == "no engine":  # said once, with what it fell back to
        text = "runs outside a verl Megatron engine (the model is unknown); it uses"
        assert any(text in r.getMessage() and "rearrange_micro_batches" in r.getMessage() for r in caplog.records)
    if model == "dsv4_hybrid" and override == "zigzag":
        assert "uses zigzag (CPSHARD_LAYOUT=zigzag), not the contiguous layout of MegatronEngine's model " \
               "(dsv4_hybrid)" in caplog.text


def test_with_cpshard_off_a_site_given_no_layout_uses_zigzag(monkeypatch, megatron_cp4):
    monkeypatch.setenv("CPSHARD_LAYOUT", "contiguous")  # read only when cpshard is switched on
    data = _batch(LENS)
    assert cv.active() is None
    assert cv.rearrange_micro_batches(data, BUDGET)[1] == cv.rearrange_micro_batches(data, BUDGET, layout="zigzag")[1]
    x = vf.nested([5, 11, 3])
    assert cv.preprocess_thd_engine(x)[1]._cpshard_plan.layout.value == "zigzag"
    assert torch.equal(cv.local_padding_mask([5, 11, 3], cp_size=CP, cp_rank=1, tp_size=1),
                       cv.local_padding_mask([5, 11, 3], cp_size=CP, cp_rank=1, tp_size=1, cp_layout="zigzag"))


def test_the_layout_follows_verls_engine_where_cpshard_disagrees(monkeypatch, megatron_cp4, caplog):
    """The packing must match the forward: a model verl's engine runs zigzag though its config declares
    contiguous (``cp_partition_mode``, which cpshard.layout_for reads) packs zigzag, and says so."""
    engine_cls = _engine_module(monkeypatch, rule=lambda model: "zigzag")
    config = types.SimpleNamespace(cp_partition_mode="contiguous")
    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    with caplog.at_level(logging.WARNING, logger="cpshard.compat.verl"), cv.patch():
        got = engine_cls(config).forward_backward_batch(_batch(LENS), _sites_layouts)
    assert got["rearrange_micro_batches"] == "zigzag" and got["preprocess_thd_engine"] == "zigzag"
    assert "verl's MegatronEngine runs its model with cp_layout='zigzag', while cpshard.layout_for gives " \
           "'contiguous'" in caplog.text


def test_an_invalid_layout_is_an_error_and_changes_nothing(monkeypatch):
    import verl.models.mcore.util as vutil

    original = vutil.preprocess_thd_engine
    monkeypatch.setenv("CPSHARD_LAYOUT", "diagonal")
    with pytest.raises(ValueError, match=r"^CPSHARD_LAYOUT='diagonal': must be 'zigzag', 'contiguous' or 'auto' "
                                         r".*Fix: set CPSHARD_LAYOUT=contiguous for DeepSeek-V4"):
        cv.patch()
    with pytest.raises(ValueError, match=r"^CPSHARD_LAYOUT='diagonal'"):
        cv.activate()
    monkeypatch.delenv("CPSHARD_LAYOUT")
    with pytest.raises(ValueError, match=r"^layout='ring': must be"):
        cv.patch(layout="ring")
    assert vutil.preprocess_thd_engine is original and cv.active() is None


@pytest.mark.parametrize("value", ["two", "0", "-2", "1.5", "true"])
def test_an_invalid_ring_size_is_an_error_at_activation_and_changes_nothing(monkeypatch, value):
    """``CPSHARD_RING`` that is not a positive integer: a ValueError naming the variable and the value, from
    ``patch()`` and ``activate()``, before anything is bound (its fit to verl's SP size is checked when the
    FSDP engine makes its groups: tests/test_verl_fsdp_cpshard.py)."""
    import verl.utils.ulysses as vul

    original = vul.gather_outputs_and_unpad
    monkeypatch.setenv("CPSHARD_RING", value)
    for call in (cv.patch, cv.activate):
        with pytest.raises(ValueError, match=rf"^CPSHARD_RING='{re.escape(value)}': must be a positive integer"):
            call()
    monkeypatch.delenv("CPSHARD_RING")
    with pytest.raises(ValueError, match=r"^ring=0: must be a positive integer"):
        cv.patch(ring=0)
    assert vul.gather_outputs_and_unpad is original and cv.active() is None


def test_the_ring_size_is_the_patchs(monkeypatch):
    monkeypatch.setenv("CPSHARD_RING", "2")
    with cv.patch() as p:
        assert p.ring == 2 and "ring 2" in repr(p)
        assert "verl.utils.ulysses.gather_outputs_and_unpad" in p.bound
    with cv.patch(ring=4) as p:  # the argument over the variable
        assert p.ring == 4


def test_a_site_that_cannot_import_is_skipped_with_its_reason(monkeypatch, caplog, capsys):
    """Each site of a module that does not import is reported with the import error's text, at WARNING
    (verl 0.9.1 in this environment: the distillation losses need ``datasets``; here forced)."""
    losses = "verl.trainer.distillation.megatron.losses"
    monkeypatch.setitem(sys.modules, losses, None)  # importing it raises ModuleNotFoundError
    reason = f"cannot import {losses}: ModuleNotFoundError: import of {losses} halted; None in sys.modules"
    with caplog.at_level(logging.DEBUG, logger="cpshard.compat.verl"), cv.patch() as p:
        assert p.skipped[f"{losses}.preprocess_thd_engine"] == reason
        assert p.skipped[f"{losses}.preprocess_bshd_engine"] == reason
        assert not any(site.startswith(losses) for site in p.bound)
    for attr in ("preprocess_thd_engine", "preprocess_bshd_engine"):
        assert any(r.levelno == logging.WARNING and r.getMessage() == f"cpshard.compat.verl: skipped {losses}.{attr}: "
                   f"{reason}" for r in caplog.records)
    assert any(f"calls cpshard at {len(p.bound)} sites" in r.getMessage() for r in caplog.records)
    # the status command reports the same, and what it would bind
    assert status_main(["--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert report["on"] is False and report["bound"] == p.bound and report["skipped"] == p.skipped
    assert report["refused"] == {} and report["error"] is None
    assert status_main([]) == 0
    text = capsys.readouterr().out
    assert f"off in this process; patch() would bind: {len(p.bound)} sites" in text
    assert f"  {losses}.preprocess_thd_engine: {reason}" in text


def _site_values():
    """Every site's current object (module attributes; the engine's method where its module is loaded)."""
    out = {}
    for module_name, names in sites.BINDERS.items():
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            out[f"{module_name}.{name}"] = getattr(module, name, None)
    for module_name in (*sites.PACK_SITES, sites.DCP):
        module = sys.modules.get(module_name)
        if module is not None:
            out[module_name] = vars(module).copy()
    return out


def test_activation_is_idempotent_thread_safe_and_undoes_everything(monkeypatch, caplog):
    """Eight threads switch cpshard on at once: one patch, binding what patch() binds; importing
    ``enable`` again changes nothing; a ``with patch():`` inside binds nothing and leaves it on; undo
    restores every site, and the binding a module imported meanwhile took by ``from ... import``."""
    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    with cv.patch() as reference:
        pass
    before = _site_values()
    got, barrier = [], threading.Barrier(8)

    def switch_on():
        barrier.wait(timeout=60)
        got.append(cv.activate())

    threads = [threading.Thread(target=switch_on) for _ in range(8)]
    try:
        with caplog.at_level(logging.INFO, logger="cpshard.compat.verl"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads) and len(got) == 8
            patch = got[0]
            assert all(g is patch for g in got) and patch.active and cv.active() is patch
            assert (patch.bound, patch.skipped, patch.refused) == (reference.bound, reference.skipped,
                                                                    reference.refused)
            enable = importlib.import_module("cpshard.compat.verl.enable")
            assert importlib.reload(enable).PATCH is patch
            lines = [r for r in caplog.records if "calls cpshard at" in r.getMessage()]
            assert len(lines) == 1 and lines[0].levelno == logging.INFO and "for this process" in lines[0].getMessage()
            import verl.models.mcore.util as vutil
            assert vutil.preprocess_thd_engine is cv.preprocess_thd_engine
            with cv.patch(layout="contiguous") as inner:
                assert inner.bound == [] and not inner.active
                assert cv.local_padding_mask([6], cp_size=2, cp_rank=0, tp_size=1).tolist() == \
                    cv.local_padding_mask([6], cp_size=2, cp_rank=0, tp_size=1, cp_layout="contiguous").tolist()
            assert vutil.preprocess_thd_engine is cv.preprocess_thd_engine and patch.active
            # a module imported while cpshard is on binds the drop-ins by name (verl's engine utilities do)
            taker = types.ModuleType("verl._cpshard_taker")
            monkeypatch.setitem(sys.modules, taker.__name__, taker)
            exec("from verl.models.mcore.util import preprocess_thd_engine\n"
                 "from verl.utils.seqlen_balancing import rearrange_micro_batches as rmb", taker.__dict__)
            assert taker.preprocess_thd_engine is cv.preprocess_thd_engine and taker.rmb is cv.rearrange_micro_batches
    finally:
        for p in got[:1]:
            p.undo()
    assert cv.active() is None and cv.process_patch() is None
    assert _site_values() == before
    assert taker.preprocess_thd_engine is vutil.preprocess_thd_engine is reference._verls[
        id(cv.preprocess_thd_engine)][1]
    assert taker.rmb is sb.rearrange_micro_batches and sb.rearrange_micro_batches is not cv.rearrange_micro_batches


def test_activation_takes_over_a_with_block(monkeypatch):
    """Switched on while a ``with patch():`` holds the sites: they stay bound after the block."""
    import verl.models.mcore.util as vutil

    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    original = vutil.preprocess_thd_engine
    try:
        with cv.patch() as outer:
            process = cv.activate()
        assert not outer.active and process.active and vutil.preprocess_thd_engine is cv.preprocess_thd_engine
    finally:
        process.undo()
    assert vutil.preprocess_thd_engine is original


def test_enable_patch_names_the_process_patch_after_it_is_switched_on_again(monkeypatch):
    """Before: ``enable.PATCH`` was the first patch for good: after ``PATCH.undo()`` and a new activation it
    named the undone one, whose ``undo()`` did nothing. Now it is read afresh."""
    import verl.models.mcore.util as vutil

    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    original = vutil.preprocess_thd_engine
    enable = importlib.import_module("cpshard.compat.verl.enable")
    try:
        first = cv.activate()  # on (again, where an earlier test switched the import's patch off)
        assert enable.PATCH is first is cv.active() and first.state == "in force"
        first.undo()
        assert enable.PATCH is first and first.state == "off" and cv.active() is None
        second = cv.activate()
        assert second is not first and enable.PATCH is second
        enable.PATCH.undo()  # switches cpshard off: the patch in force, not the stale one
        assert vutil.preprocess_thd_engine is original and cv.active() is None
    finally:
        if cv.active() is not None:
            cv.active().undo()


def test_undo_under_another_librarys_wrapper_is_partly_in_force(monkeypatch, capsys):
    """Before: undo() logged "restored" while a site another library had wrapped still reached cpshard.
    Now the site is named in ``unrestored``, ``active()`` returns the patch with state "partly in force",
    and the report says so; once the wrapper is gone the patch is off."""
    import functools

    import verl.utils.seqlen_balancing as sb

    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    site = "verl.utils.seqlen_balancing.rearrange_micro_batches"
    p = cv.patch()
    ours = sb.rearrange_micro_batches
    original = p.original(site)

    @functools.wraps(ours)
    def other_librarys(*args, **kwargs):
        return ours(*args, **kwargs)

    sb.rearrange_micro_batches = other_librarys
    try:
        p.undo()
        assert p.state == "partly in force" and cv.active() is p and list(p.unrestored) == [site]
        assert "still reach cpshard" in p.unrestored[site]
        assert status_main([]) == 0
        assert "partly in force in this process" in capsys.readouterr().out
    finally:
        sb.rearrange_micro_batches = original
    assert p.state == "off" and cv.active() is None


def test_the_entry_point_imports_nothing_more_unless_asked():
    """verl imports the entry point in every process of everyone who has cpshard installed: unless
    CPSHARD_VERL=1 it must not pull in the drop-ins or the communication layer."""
    import subprocess

    code = ("import sys, cpshard.compat.verl_plugin; "
            "print(sorted(m for m in sys.modules if m.startswith(('cpshard.compat.verl.', 'cpshard.distributed'))"
            " or m == 'cpshard.compat.verl'))")
    env = {k: v for k, v in os.environ.items() if k not in ("CPSHARD_VERL", "CPSHARD_LAYOUT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("value", ["", "0", "1", "sometimes"])
def test_the_entry_point_patches_only_where_asked(monkeypatch, caplog, value):
    """``verl.plugins`` loads the entry point for everyone with cpshard installed: only CPSHARD_VERL=1
    switches cpshard on; a value it does not know is an error logged at ERROR (verl hides a plugin's)."""
    monkeypatch.setenv("CPSHARD_VERL", value)
    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    monkeypatch.delitem(sys.modules, "cpshard.compat.verl_plugin", raising=False)
    try:
        if value == "sometimes":
            with caplog.at_level(logging.ERROR, logger="cpshard.compat.verl"), \
                    pytest.raises(ValueError, match=r"^CPSHARD_VERL='sometimes': must be 1"):
                importlib.import_module("cpshard.compat.verl_plugin")
            assert "the verl.plugins entry point (CPSHARD_VERL) could not switch cpshard on" in caplog.text
        else:
            importlib.import_module("cpshard.compat.verl_plugin")
        assert (cv.active() is not None) is (value == "1")
        assert (cv.process_patch() is not None) is (value == "1")
    finally:
        process = cv.process_patch()
        if process is not None:
            process.undo()


def test_the_packing_stays_packs_for_the_layout_in_use(monkeypatch, megatron_cp4):
    """Under the patch with CPSHARD_LAYOUT=contiguous, verl's call returns cpshard.pack's micro-batches for
    the contiguous layout (in pack's buffer order), each within the budget."""
    from cpshard import pack

    monkeypatch.setenv("CPSHARD_LAYOUT", "contiguous")
    with cv.patch():
        mbs, idx = sb.rearrange_micro_batches(_batch(LENS), max_token_len=BUDGET)
    packing = pack(LENS, max_tokens=BUDGET, cp_size=CP, layout="contiguous")
    assert sorted(map(tuple, idx)) == sorted(map(tuple, packing.micro_batches[0]))
    assert sorted(itertools.chain(*idx)) == list(range(len(LENS)))
    for m, i in zip(mbs, idx):
        assert ShardPlan.build([LENS[j] for j in i], cp_size=CP, layout="contiguous").total_len <= BUDGET
        assert torch.equal(m["attention_mask"], _batch(LENS)["attention_mask"][i])


_LOGS_OF_A_FRESH_PROCESS = '''
import logging
import torch
import tensordict
logging.basicConfig(level=logging.WARNING, format="%(levelname)s|%(message)s")  # as verl leaves the root logger
from cpshard.compat import verl as cv

lens = [18, 73, 109, 103, 98, 9, 33, 16]
mask = torch.zeros(len(lens), max(lens), dtype=torch.long)
for i, n in enumerate(lens):
    mask[i, :n] = 1
data = tensordict.TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lens)])
with cv.patch(layout="contiguous"):
    cv.rearrange_micro_batches(data, 256, cp_size=4, tp_size=1)  # no engine, the override
    process = cv.activate()
process.undo()
with cv.patch():
    cv.local_padding_mask([5, 11, 3], cp_size=4, cp_rank=1, tp_size=1)  # no engine, zigzag
'''


def test_what_a_fresh_process_logs_under_patch_and_activate():
    """In a process whose root logger is at WARNING (as verl leaves it): ``with patch():`` shows its line of
    what it bound beside the WARNINGs of the sites it skipped (before: only the WARNINGs); the note of a
    site outside a verl engine has one level at cp = 4, whether it uses the override or zigzag (before:
    INFO for the override); ``activate()`` inside ``with patch(layout="contiguous")`` says at WARNING
    that the block's override is dropped, and how to keep it (before: an INFO line only)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("CPSHARD_VERL", "CPSHARD_LAYOUT",
                                                            "VERL_USE_EXTERNAL_MODULES")}
    done = subprocess.run([sys.executable, "-c", _LOGS_OF_A_FRESH_PROCESS], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [line.split("|", 1) for line in done.stderr.splitlines() if line.startswith(("INFO|", "WARNING|"))]
    # 29 Megatron sites and 22 of verl's Ulysses helpers (the FSDP engine's module needs `datasets`: skipped here)
    summary = [level for level, text in records if "calls cpshard at 51 sites (pid" in text]
    assert summary == ["INFO"], done.stderr
    assert any(level == "WARNING" and text.startswith("cpshard.compat.verl: skipped ") for level, text in records)
    outside = {text.split(": ", 1)[1].split(" ", 1)[0]: level for level, text in records
               if "runs outside a verl Megatron engine" in text}
    assert outside == {"rearrange_micro_batches": "WARNING", "local_padding_mask": "WARNING"}, done.stderr
    dropped = [(level, text) for level, text in records if "activate() inside a `with patch(" in text]
    assert dropped == [("WARNING", "cpshard.compat.verl: activate() inside a `with patch(layout='contiguous')` block: "
                        "the process's patch reads its layout from CPSHARD_LAYOUT (CPSHARD_LAYOUT unset), so the "
                        "block's 'contiguous' override is dropped for the rest of the process (layout now: auto "
                        "(CPSHARD_LAYOUT unset): where verl passes no cp_layout, the model's layout inside verl's "
                        "Megatron engine, else zigzag). Fix: set CPSHARD_LAYOUT=contiguous in the job's environment, "
                        "where every process reads it")], done.stderr


def test_the_status_command_says_what_refused(monkeypatch):
    """``python -m cpshard.compat.verl`` where ``import verl`` runs cpshard's activation and it refuses an
    invalid CPSHARD_LAYOUT: verl imported fine, so its version is reported and the refusal is named as
    the activation's (before: "cpshard in verl (not importable)")."""
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if k != "CPSHARD_VERL"}, "CPSHARD_LAYOUT": "zigzga",
           "VERL_USE_EXTERNAL_MODULES": "cpshard.compat.verl.enable"}
    done = subprocess.run([sys.executable, "-m", "cpshard.compat.verl"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"cpshard in verl {importlib.metadata.version('verl')}, pid "), lines
    assert lines[-1].startswith("refused: cpshard's activation (run by `import verl`: VERL_USE_EXTERNAL_MODULES="
                                "cpshard.compat.verl.enable): ValueError: CPSHARD_LAYOUT='zigzga': must be"), lines


def test_the_status_command_words_both_states_alike(monkeypatch, capsys):
    """On and off, the count of sites reads the same way: "<on|off> in this process; <verb>: N sites"."""
    monkeypatch.delenv("CPSHARD_LAYOUT", raising=False)
    process = cv.activate()
    try:
        assert status_main([]) == 0
    finally:
        process.undo()
    assert f"\non in this process; bound: {len(process.bound)} sites\n" in capsys.readouterr().out
