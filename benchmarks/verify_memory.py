"""Peak memory and time of one `cpshard verify` step (forward and backward of the tiny transformer,
the reference attention in blocks of query rows), each case in a fresh process so that its peak
resident set is its own.

    python benchmarks/verify_memory.py                      # at the 8192-token cap, cp=1 and cp=2
    python benchmarks/verify_memory.py --tokens 2000 --quick

Cases: one sequence filling the cap (the worst case for the attention: every query sees up to all
keys) and a long-tailed batch scaled to the cap. cp=1 is the reference step; cp=2 runs two spawned
gloo ranks (the peak is the larger rank's).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one(lengths: list[int], cp: int, dtype: str) -> dict:
    import torch

    from cpshard.verify import DTYPES, Config, TinyDecoder, config_plan, step, token_batch

    torch.set_num_threads(1)
    start = time.perf_counter()
    if cp == 1:
        step(TinyDecoder(DTYPES[dtype]), token_batch(lengths), config_plan(lengths, Config(1, 1, "zigzag")), 0, None)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    else:
        from cpshard.spawn import run_ranks

        peak_kib = max(run_ranks(_rank, cp, lengths, dtype, timeout=900))
    return {"seconds": time.perf_counter() - start, "peak_mib": peak_kib / 1024}


def _rank(rank: int, world: int, lengths: list[int], dtype: str) -> int:
    import torch.distributed as dist

    from cpshard.verify import DTYPES, Config, TinyDecoder, config_plan, step, token_batch

    step(TinyDecoder(DTYPES[dtype]), token_batch(lengths), config_plan(lengths, Config(world, 1, "zigzag")), rank,
         dist.group.WORLD)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--cp", default="1,2")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--quick", action="store_true", help="the single-sequence case only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        lengths, cp = json.loads(args.child)
        print(json.dumps(_one(lengths, cp, args.dtype)))
        return
    from cpshard.verify import scale_lengths

    tail = [4000, 1500, 900, 700, 400, 300, 200, 150, 120, 100, 80, 60, 50, 40, 30, 20, 10, 5, 3, 1]
    cases = {"one sequence": [args.tokens]}
    if not args.quick:
        cases["long tail"] = scale_lengths(tail, args.tokens)
    print(f"{'case':<14} {'cp':>3} {'tokens':>7} {'peak MiB':>9} {'seconds':>8}")
    for name, lengths in cases.items():
        for cp in map(int, args.cp.split(",")):
            done = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--child",
                                   json.dumps([lengths, cp])], capture_output=True, text=True, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:<14} {cp:>3} {sum(lengths):>7} {got['peak_mib']:>9.0f} {got['seconds']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
