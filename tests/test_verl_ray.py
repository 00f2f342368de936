"""cpshard switched on in real Ray worker processes, configured only by ``runtime_env`` environment variables.

A local ``ray.init(num_cpus=2)``; per setting (docs/verl.md, "cpshard in a verl job"):
``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable``, and the same with ``CPSHARD_LAYOUT=contiguous`` and
``CPSHARD_RING=2`` (the FSDP backend's ring size, which each worker reports, with verl's Ulysses helpers bound),
two actors import verl and report which of verl's sites are cpshard's; then they form a gloo group and
run, through verl's module attributes, the patched ``preprocess_thd_engine`` / ``postprocess_thd_engine``
(Megatron's CP group faked over the two actors, as ``tests/verl_fakes.py`` fakes it), the dynamic-CP
mask, and ``rearrange_micro_batches(dp_group=...)`` (the two actors as DP ranks), beside verl's own
functions (``VerlPatch.original``) in the same actors. One more actor, started while the driver holds a
``with patch():`` block and given no variable, shows that the block reaches no worker.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import pathlib
import sys
import time

import pytest
import torch

for _name in ("ray", "verl", "tensordict"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed (scripts/setup.sh installs it)", allow_module_level=True)

import ray  # noqa: E402
from cpshard.spawn import free_port  # noqa: E402

from cpshard import ShardPlan, pack  # noqa: E402

TESTS = str(pathlib.Path(__file__).resolve().parent)
ENABLE = {"VERL_USE_EXTERNAL_MODULES": "cpshard.compat.verl.enable"}
WAIT = 300  # seconds: the longest any one wait may take (an actor imports verl and megatron-core)
BUDGET = 256
LENS = [[18, 73, 109, 103, 98, 9, 33, 16], [60, 5, 41, 120, 77, 30, 12, 88]]  # the two DP ranks' batches
THD = [7, 3, 13, 2, 5]


def _padded_batch(lens):
    import tensordict

    width = max(lens)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    ids = torch.arange(len(lens) * width).view(len(lens), width) + 1
    return tensordict.TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lens)])


def _object_at(site):
    """The object at ``module.attr`` (or ``module.Class.attr``); None where the module does not import."""
    import importlib

    parts = site.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001  (a site's module that does not import here)
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _is_cpshards(obj):
    return obj is not None and (str(getattr(obj, "__module__", "")).startswith("cpshard.")
                                or hasattr(obj, "__cpshard_wraps__"))


class Worker:
    """One verl worker process: whatever ``import verl`` switches on, the tests' calls run through."""

    def report(self, sites):
        """Import verl (the activation, if the environment asks for it) and say which sites are cpshard's."""
        import logging

        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.levelname, record.getMessage()))

        logging.getLogger("cpshard.compat.verl").addHandler(Keep())
        import verl  # noqa: F401

        from cpshard.compat import verl as cv

        patch = cv.active()
        return {"pid": os.getpid(), "which": {site: _is_cpshards(_object_at(site)) for site in sites},
                "bound": None if patch is None else list(patch.bound),
                "skipped": None if patch is None else dict(patch.skipped),
                "refused": None if patch is None else dict(patch.refused),
                "layout": None if patch is None else patch.layout, "log": records,
                "ring": None if patch is None else patch.ring,
                "env": {k: os.environ.get(k) for k in ("VERL_USE_EXTERNAL_MODULES", "CPSHARD_LAYOUT")}}

    def run(self, rank, port):
        """On a gloo group of the two actors: the patched sites and verl's own, on the same inputs."""
        import datetime

        import torch.distributed as dist

        sys.path.insert(0, TESTS)
        import verl.models.mcore.util as vutil
        import verl.utils.dynamic_cp_scheduler as dcp
        import verl.utils.seqlen_balancing as sb

        import verl_fakes as vf
        from cpshard.compat import verl as cv

        patch = cv.active()
        verls = {name: patch.original(f"verl.models.mcore.util.{name}")
                 for name in ("preprocess_thd_engine", "postprocess_thd_engine")}
        verls["mask"] = patch.original("verl.utils.dynamic_cp_scheduler._local_padding_mask")
        verls["pack"] = patch.original("verl.utils.seqlen_balancing.rearrange_micro_batches")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        out = {}
        try:
            x = vf.nested(THD, trailing=(2,), dtype=torch.float32, seed=5)  # one CP group: one batch
            out["thd truth"] = x.values() * 2
            with vf.parallel_state(1, 2, rank), vf.partition_mode():  # the two actors are one CP group
                runs = {"cpshard": (vutil.preprocess_thd_engine, vutil.postprocess_thd_engine),
                        "verl": (verls["preprocess_thd_engine"], verls["postprocess_thd_engine"])}
                for (who, (pre, post)), layout in itertools.product(runs.items(), ("zigzag", "contiguous", None)):
                    if who == "verl" and layout is None:
                        continue
                    kw = {} if layout is None else {"cp_layout": layout}
                    labels, _, _ = pre(x, True, True, **kw)  # pre_process, need_roll: next-token labels
                    rows, psp, pos = pre(x, True, False, **kw)
                    back = post(rows * 2, psp, x, len(THD), **kw)  # every sequence, on every rank
                    out[f"thd {who} {layout}"] = (rows, pos, psp.cu_seqlens_q_padded, back.values(), labels)
                for who, mask in (("cpshard", dcp._local_padding_mask), ("verl", verls["mask"])):
                    for layout in ("zigzag", "contiguous", None):
                        if not (who == "verl" and layout is None):
                            kw = {} if layout is None else {"cp_layout": layout}
                            out[f"mask {who} {layout}"] = mask(THD, cp_size=2, cp_rank=rank, tp_size=1, **kw)
            batch = _padded_batch(LENS[rank])
            # verl's engines call it with the DP group; Megatron's CP is 2 here (the padding the budget holds)
            with vf.parallel_state(1, 2, 0), vf.swap(vf.mpu, {"model_parallel_is_initialized": lambda: True}):
                mbs, idx = sb.rearrange_micro_batches(batch, max_token_len=BUDGET, dp_group=dist.group.WORLD)
            with vf.swap(sb, {"get_device_name": lambda: "cpu"}):  # verl sums its count on the accelerator
                v_mbs, v_idx = verls["pack"](batch, max_token_len=BUDGET, dp_group=dist.group.WORLD)
            out["pack cpshard"] = (idx, [m["input_ids"] for m in mbs], [m["attention_mask"] for m in mbs])
            out["pack verl"] = (v_idx, [m["input_ids"] for m in v_mbs], [m["attention_mask"] for m in v_mbs])
            out["restore"] = (sb.restore_dynamic_batch(torch.cat(out["pack cpshard"][1]), idx),
                              sb.restore_dynamic_batch(torch.cat(out["pack verl"][1]), v_idx), batch["input_ids"])
        finally:
            dist.destroy_process_group()
        import resource

        use = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu seconds"] = use.ru_utime + use.ru_stime  # this worker's, since it started (for the log)
        return out


def _start(env, count):
    actor = ray.remote(num_cpus=1)(Worker)
    return [actor.options(runtime_env={"env_vars": env}).remote() for _ in range(count)]


def _get(refs, what):
    try:
        return ray.get(refs, timeout=WAIT)
    except ray.exceptions.GetTimeoutError:
        pytest.fail(f"{what} took longer than {WAIT} s")


def _thd_checks(res, rank, want):
    """Patched equals verl's own: the layout verl passes wins; where it passes none, the layout in use."""
    for layout in ("zigzag", "contiguous"):
        got, theirs = res[f"thd cpshard {layout}"], res[f"thd verl {layout}"]
        assert all(torch.equal(a, b) for a, b in zip(got, theirs)), (rank, layout)
        assert torch.equal(got[3], res["thd truth"])  # every sequence back, in order
    got, theirs = res["thd cpshard None"], res[f"thd verl {want}"]
    assert all(torch.equal(a, b) for a, b in zip(got, theirs)), (rank, want)
    for layout in ("zigzag", "contiguous"):
        assert torch.equal(res[f"mask cpshard {layout}"], res[f"mask verl {layout}"])
    assert torch.equal(res["mask cpshard None"], res[f"mask verl {want}"])


def _pack_checks(results, want):
    """verl's structure, restore order and DP-agreed count; cpshard.pack's micro-batches for the layout in
    use (the partition, README "Differences from verl" 5), each within the budget after CP padding."""
    counts = {len(r["pack cpshard"][0]) for r in results}
    assert len(counts) == 1 and len({len(r["pack verl"][0]) for r in results}) == 1  # agreed over DP
    count = counts.pop()
    for rank, res in enumerate(results):
        lens = LENS[rank]
        idx, ids, masks = res["pack cpshard"]
        restored, v_restored, original = res["restore"]
        assert torch.equal(restored, original) and torch.equal(v_restored, original)
        assert sorted(itertools.chain(*idx)) == list(range(len(lens)))
        for i, m_ids, m_mask in zip(idx, ids, masks):
            assert torch.equal(m_ids, original[i]) and m_mask.sum(1).tolist() == [lens[j] for j in i]
            assert ShardPlan.build([lens[j] for j in i], cp_size=2, layout=want).total_len <= BUDGET
        own = pack(lens, max_tokens=BUDGET, cp_size=2, layout=want)  # the drop-in's: pack's count, or the agreed
        if own.num_micro_batches[0] != count:
            own = pack(lens, max_tokens=BUDGET, cp_size=2, layout=want, min_micro_batches=count)
        assert sorted(map(tuple, idx)) == sorted(map(tuple, own.micro_batches[0])), (rank, want)


def test_the_environment_switches_cpshard_on_in_every_worker():
    from cpshard.compat import verl as cv

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import this file
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    started, cpu = time.monotonic(), []
    try:
        with cv.patch() as driver:  # the driver's own: what the workers are expected to bind
            sites = [*driver.bound, *driver.skipped]
            # a worker given no variable, started while the driver holds the block: reached by nothing
            control = _get([_start({}, 1)[0].report.remote(sites)], "the control worker")[0]
        assert driver.bound and control["bound"] is None and not any(control["which"].values())
        for env, want in ((ENABLE, "zigzag"), ({**ENABLE, "CPSHARD_LAYOUT": "contiguous", "CPSHARD_RING": "2"},
                                              "contiguous")):
            actors = _start(env, 2)
            reports = _get([a.report.remote(sites) for a in actors], f"importing verl with {env}")
            for rep in reports:
                assert rep["env"] == {"VERL_USE_EXTERNAL_MODULES": env["VERL_USE_EXTERNAL_MODULES"],
                                      "CPSHARD_LAYOUT": env.get("CPSHARD_LAYOUT")}
                assert rep["bound"] == driver.bound and rep["skipped"] == driver.skipped and rep["refused"] == {}
                assert rep["which"] == {site: site in driver.bound for site in sites}, rep["which"]
                assert rep["layout"].startswith(want if "CPSHARD_LAYOUT" in env else "auto")
                assert rep["ring"] == int(env.get("CPSHARD_RING", 1))  # the FSDP backend's ring size
                assert "verl.utils.ulysses.gather_outputs_and_unpad" in rep["bound"]  # its Ulysses helpers
                infos = [m for level, m in rep["log"] if level == "INFO" and "calls cpshard at" in m]
                assert len(infos) == 1 and f"calls cpshard at {len(driver.bound)} sites for this process" in infos[0]
                warned = {m for level, m in rep["log"] if level == "WARNING" and m.startswith("cpshard.compat.verl: "
                                                                                              "skipped ")}
                assert warned == {f"cpshard.compat.verl: skipped {s}: {r}" for s, r in driver.skipped.items()}
            port = free_port()
            results = _get([a.run.remote(rank, port) for rank, a in enumerate(actors)], "the gloo calls")
            for rank, res in enumerate(results):
                _thd_checks(res, rank, want)
            _pack_checks(results, want)
            cpu.extend(r["cpu seconds"] for r in results)
            for a in actors:
                ray.kill(a)
    finally:
        ray.shutdown()
    print(f"ray test: {time.monotonic() - started:.1f} s after ray.init; the four activated workers used "
          f"{sum(cpu):.1f} CPU seconds")
