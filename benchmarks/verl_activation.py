"""Benchmark: what switching cpshard on costs a verl process at ``import verl``, in fresh interpreters.

``VERL_USE_EXTERNAL_MODULES=cpshard.compat.verl.enable`` makes every ``import verl`` import the enable
module, which imports verl's Megatron path (megatron-core, ``verl.models.mcore.*``, the engine where it
imports) and binds cpshard's sites. Timed, each in ``--repeats`` fresh interpreters taking turns (so that
a busy machine slows both alike), with and without the variable:

- ``import verl``: a process that would not otherwise load the Megatron path (the driver, a rollout
  worker): the whole cost of the activation;
- ``import verl + verl.models.mcore.model_forward``: a Megatron training worker, which imports that path
  anyway: the cost of the binding itself.

Wall and CPU (user + system) milliseconds, the least and the median; the last column is the median
with over without. Run::

    .venv/bin/python benchmarks/verl_activation.py              # 5 interpreters per row and setting
    .venv/bin/python benchmarks/verl_activation.py --quick      # one each: a smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "import verl": "import verl",
    "import verl + verl.models.mcore.model_forward": (
        "from cpshard.megatron._import import import_megatron; import verl; import_megatron('parallel_state'); "
        "import verl.models.mcore.model_forward"),  # megatron-core the way patch() imports it (no Triton here)
}
ON = {"VERL_USE_EXTERNAL_MODULES": "cpshard.compat.verl.enable"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # not this folder: it holds a verl.py
CHECK = ("; from cpshard.compat import verl as cv; import sys; "
         "sys.exit(0 if (cv.active() is not None) == ({on}) else 3)")


def _run(code: str, on: bool) -> tuple[float, float]:
    """(wall ms, CPU ms) of one fresh interpreter running ``code`` (and checking the activation took)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "CPSHARD_LAYOUT")}
    if on:
        env.update(ON)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code + CHECK.format(on=on)], env=env, check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return 1e3 * wall, 1e3 * cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters per case and setting")
    parser.add_argument("--quick", action="store_true", help="one interpreter each (a smoke run)")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    print(f"{'case':48} {'setting':9} {'wall least':>10} {'median':>8} {'CPU least':>10} {'median':>8}   on/off")
    for name, code in CASES.items():
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(repeats):
            for on in (False, True):
                runs[on].append(_run(code, on))
        medians = {}
        for on in (False, True):
            wall, cpu = zip(*runs[on])
            medians[on] = (statistics.median(wall), statistics.median(cpu))
            ratio = "" if not on else (f"   {medians[True][0] / medians[False][0]:.2f}x wall, "
                                       f"{medians[True][1] / medians[False][1]:.2f}x CPU")
            print(f"{name:48} {'on' if on else 'off':9} {min(wall):10.0f} {medians[on][0]:8.0f} {min(cpu):10.0f} "
                  f"{medians[on][1]:8.0f}{ratio}")
        print(f"{'':48} {'on - off':9} {'':10} {medians[True][0] - medians[False][0]:8.0f} {'':10} "
              f"{medians[True][1] - medians[False][1]:8.0f}")


if __name__ == "__main__":
    main()
