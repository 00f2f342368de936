"""The prepared check for a lent GPU: one run, one JSON file of figures (``scripts/gpu_check.sh`` runs it).

What the CPU cannot answer, each part bounded in time (at most about 5 minutes on one GPU in all):

1. ``benchmarks/step.py --device cuda --quick``: host synchronisations per micro-batch and the time
   against the copy floor (its printed tables, kept as text).
2. ``shard`` / ``unshard`` on CUDA tensors, both layouts, cp 2 and 8, every rank in this process:
   equal (``torch.equal``) to the CPU results; median time and the host synchronisations of one call.
3. ``relayout`` (``_relayout.apply_route``: the all-to-all run in this process) and the MTP targets
   (every rank's halo exchange of shifts 1..3, in this process) on CUDA tensors: equal to the CPU.
4. The header check on the device: an all-gather of stamped rows (``distributed._all_gather_stamped``)
   with the collective emulated in this process, against the same copy without the header; the host
   synchronisations it adds (0 expected: ``torch._assert_async``); and, in a child process, that a
   wrong header is a device-side assertion.

Without CUDA it writes ``{"cuda": false, "skipped": ...}`` and exits 0: nothing here is needed to
build or test cpshard.

    python scripts/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _timing import median_ms  # noqa: E402


def _median_ms(fn: Any, repeats: int = 20) -> float:
    """Median ms of ``fn()`` (``benchmarks/_timing.median_ms``), the device synchronized around each call."""
    return median_ms(fn, repeats, torch.device("cuda") if torch.cuda.is_available() else None)


def step_part() -> dict[str, Any]:
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "step.py"), "--device", "cuda", "--quick"],
                         capture_output=True, text=True, timeout=150, cwd=ROOT)
    return {"rc": run.returncode, "stdout": run.stdout[-8000:], "stderr": run.stderr[-2000:]}


def shard_part(dev: torch.device) -> list[dict[str, Any]]:
    from _timing import host_syncs

    from cpshard import ShardPlan, shard, unshard
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(128, 8192 if dev.type == "cuda" else 512, (256 if dev.type == "cuda" else 16,),
                         generator=gen).tolist()
    x_cpu = torch.randn(sum(lens), 64, generator=gen)
    x = x_cpu.to(dev)
    out = []
    for layout in ("zigzag", "contiguous"):
        for cp in (2, 8):
            plan = ShardPlan.build(lens, cp_size=cp, layout=layout)
            parts = [shard(x, plan, r) for r in range(cp)]
            same = all(torch.equal(p.cpu(), shard(x_cpu, plan, r)) for r, p in enumerate(parts))
            back = unshard(parts, plan)
            same_back = torch.equal(back.values().cpu(), x_cpu)
            labels = [shard(x, plan, r, shift=1) for r in range(cp)]
            same_shift = all(torch.equal(p.cpu(), shard(x_cpu, plan, r, shift=1)) for r, p in enumerate(labels))
            out.append({
                "layout": layout, "cp": cp, "shard_equal_cpu": same, "unshard_equal_input": same_back,
                "shifted_shard_equal_cpu": same_shift,
                "shard_rank0_ms": _median_ms(lambda: shard(x, plan, 0)),
                "unshard_ms": _median_ms(lambda: unshard(parts, plan)),
                "shard_host_syncs": host_syncs(lambda: shard(x, plan, 0), dev),
                "unshard_host_syncs": host_syncs(lambda: unshard(parts, plan), dev),
                "cold_shard_host_syncs": host_syncs(
                    lambda: shard(x, ShardPlan.build(lens, cp_size=cp, layout=layout), 0), dev),
            })
    return out


def relayout_and_mtp_part(dev: torch.device) -> list[dict[str, Any]]:
    from cpshard import ShardPlan, halo_exchange, shard, twin_plan
    from cpshard.index.shift import all_to_all_in_process
    from cpshard.plan.twins import apply_route
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 3000 if dev.type == "cuda" else 300, (64 if dev.type == "cuda" else 8,),
                         generator=gen).tolist()
    x_cpu = torch.randn(sum(lens), 16, generator=gen)
    out = []
    for cp in (2, 8):
        src = ShardPlan.build(lens, cp_size=cp, layout="zigzag")
        dst = twin_plan(src, "contiguous")
        locals_cpu = [shard(x_cpu, src, r) for r in range(cp)]
        moved_cpu = apply_route(locals_cpu, src, dst)
        moved = apply_route([t.to(dev) for t in locals_cpu], src, dst)
        relayout_equal = all(torch.equal(a.cpu(), b) for a, b in zip(moved, moved_cpu))
        relayout_ms = _median_ms(lambda: apply_route([t.to(dev) for t in locals_cpu], src, dst), 10)
        # MTP targets: the halo exchange of shifts 1..3 on every rank, the all-to-all in this process
        ids = torch.arange(sum(lens), dtype=torch.int64)
        shifts = (1, 2, 3)
        exs = [halo_exchange(src, r, shifts, dev) for r in range(cp)]
        rows = [shard(ids, src, r).reshape(-1).to(dev) for r in range(cp)]
        received = all_to_all_in_process(rows, [e.send_rows for e in exs], [e.send_splits for e in exs])
        got = [e.apply(rows[d], received[d], -100, -100) for d, e in enumerate(exs)]
        mtp_equal = all(torch.equal(got[r][k].cpu().reshape(-1),
                                    shard(ids, src, r, shift=s, pad_value=-100, fill=-100).reshape(-1))
                        for r in range(cp) for k, s in enumerate(shifts))
        out.append({"cp": cp, "relayout_equal_cpu": relayout_equal, "relayout_ms": relayout_ms,
                    "mtp_targets_equal_cpu": mtp_equal})
    return out


def header_part(dev: torch.device) -> dict[str, Any]:
    from _timing import host_syncs

    from cpshard import ShardPlan
    from cpshard.distributed import collectives as distributed
    from cpshard.distributed.collectives import _Stamp
    size = 8
    plan = ShardPlan.build([4096] * (64 if dev.type == "cuda" else 2), cp_size=size)
    local = torch.randn(plan.local_len, 128, device=dev)
    stamp = _Stamp("gather", 0, False, (plan,), {"dtype": local.dtype, "row shape": (128,)})

    senders = torch.arange(size, dtype=torch.int64).view(torch.uint8).reshape(size, 8).to(dev)

    def emulated(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:  # every rank sent what this one did
        rows = out.view(size, -1)
        rows.copy_(inp.expand(size, -1))
        rows[:, 16:24] = senders  # header word 2: the sender's rank

    saved = distributed._all_gather_flat
    distributed._all_gather_flat = emulated
    try:
        stamped = _median_ms(lambda: distributed._all_gather_stamped(local, None, size, stamp))
        syncs = host_syncs(lambda: distributed._all_gather_stamped(local, None, size, stamp), dev)
    finally:
        distributed._all_gather_flat = saved
    bare = _median_ms(lambda: local.reshape(1, -1).expand(size, -1).clone())
    if dev.type != "cuda":
        return {"stamped_ms": stamped, "bare_copy_ms": bare, "ratio": stamped / bare, "host_syncs": syncs}
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--wrong-header"], capture_output=True,
                           text=True, timeout=60)
    return {"stamped_ms": stamped, "bare_copy_ms": bare, "ratio": stamped / bare, "host_syncs": syncs,
            "rows": plan.local_len, "ranks": size,
            "wrong_header_rc": child.returncode,
            "wrong_header_is_device_assert": "assert" in (child.stderr + child.stdout).lower() and child.returncode != 0,
            "wrong_header_tail": (child.stderr or child.stdout)[-600:]}


def wrong_header() -> None:
    """A peer's header that differs from this rank's: the device assertion must fire (this process dies)."""
    from cpshard import ShardPlan
    from cpshard.distributed import collectives as distributed
    from cpshard.distributed.collectives import _Stamp
    dev = torch.device("cuda")
    plan = ShardPlan.build([64] * 4, cp_size=2)
    local = torch.randn(plan.local_len, 4, device=dev)
    stamp = _Stamp("gather", 0, False, (plan,), {"dtype": local.dtype, "row shape": (4,)})

    def peer_differs(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        out.view(2, -1).copy_(inp.expand(2, -1))
        out.view(2, -1)[1, 0] ^= 1  # the peer's first header byte differs

    distributed._all_gather_flat = peer_differs
    distributed._all_gather_stamped(local, None, 2, stamp)
    torch.cuda.synchronize()
    print("no assertion fired")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--wrong-header", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--on-cpu", action="store_true",
                        help="run parts 2-4 on the CPU (checks this script without a GPU; the figures mean nothing)")
    args = parser.parse_args()
    if args.wrong_header:
        wrong_header()
        return
    result: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if args.on_cpu:
        dev = torch.device("cpu")
        result["on_cpu"] = {"shard": shard_part(dev), "relayout_mtp": relayout_and_mtp_part(dev),
                            "header": header_part(dev)}
    elif not torch.cuda.is_available():
        result["skipped"] = "no CUDA device: nothing to check (cpshard builds and passes its tests without one)"
    else:
        dev = torch.device("cuda")
        result["device"] = torch.cuda.get_device_name(dev)
        for name, part in (("step", step_part), ("shard", lambda: shard_part(dev)),
                           ("relayout_mtp", lambda: relayout_and_mtp_part(dev)), ("header", lambda: header_part(dev))):
            t = time.perf_counter()
            try:
                result[name] = part()
            except Exception as exc:  # noqa: BLE001  (one part's failure is a figure too; the others still run)
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            result[f"{name}_seconds"] = round(time.perf_counter() - t, 1)
            with open(args.out, "w") as f:  # after every part: a run cut short keeps what it measured
                json.dump(result, f, indent=1, default=str)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in result.items() if k != "step"}, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
