"""verl's own partition of a batch into micro-batches: what ``cpshard pack`` and the packing benchmarks
compare against (``cpshard.compat.verl_partition``, ``cpshard.compat.verl_partitioner``).

It sits beside the :mod:`cpshard.compat.verl` package, as the plugin entry point does, because importing
any module of that package imports the whole package (the drop-ins, the collectives): ``cpshard pack``
loads no communication layer.

Sources read (not copied): verl 0.9.1's ``verl/utils/seqlen_balancing.py``.
"""

from __future__ import annotations

import heapq
import os
import sys
from collections.abc import Sequence
from typing import Any

from cpshard.base.errors import fail

__all__ = ["verl_partition", "verl_partitioner"]


def _greedy(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Without verl: the heaviest item to the lightest part (a part with room, under ``equal_size``)."""
    cap = len(weights) // k if equal_size else len(weights)
    heap = [(0, b) for b in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        skipped = []
        while len(parts[heap[0][1]]) >= cap:
            skipped.append(heapq.heappop(heap))
        w, b = heapq.heappop(heap)
        parts[b].append(i)
        heapq.heappush(heap, (w + weights[i], b))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]


_PARTITIONER: list[Any] = []  # [verl's get_seqlen_balanced_partitions or None], looked up once


def verl_partitioner() -> Any:
    """verl's own ``get_seqlen_balanced_partitions`` when verl imports, else ``None`` (looked up once;
    a ``verl.py`` beside the running script, as in ``benchmarks/``, is not taken for verl)."""
    if not _PARTITIONER:
        here = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else None
        saved = sys.path[:]
        sys.path[:] = [p for p in sys.path if here is None or os.path.abspath(p or ".") != here]
        try:
            from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

            _PARTITIONER.append(get_seqlen_balanced_partitions)
        except Exception:  # noqa: BLE001  (verl's import pulls many packages; any failure means "not usable")
            _PARTITIONER.append(None)
        finally:
            sys.path[:] = saved
    return _PARTITIONER[0]


def _partitions(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    verl = verl_partitioner()
    return verl(list(weights), k, equal_size) if verl is not None else _greedy(weights, k, equal_size)


def verl_partition(lens: Sequence[int], dp: int, max_tokens: int) -> list[list[list[int]]]:
    """verl's partition of a global batch, as the caller's indices per DP rank and micro-batch.

    The DP split is verl's ``_balance_batch`` (Karmarkar-Karp into ``dp`` equal-sized parts on
    ``24576 s + s**2``), then on every DP rank verl's ``rearrange_micro_batches`` rule:
    ``ceil(tokens / max_tokens)`` micro-batches (the max over DP ranks), Karmarkar-Karp on the same
    workload, raised by one until every part's **unpadded** tokens fit. verl's own
    ``get_seqlen_balanced_partitions`` runs when verl imports (:func:`verl_partitioner`); without it,
    a re-statement (longest-processing-time greedy). ``dp`` must divide ``len(lens)`` (verl's DP split
    takes equal counts)."""
    lens = list(lens)
    if dp > 1 and len(lens) % dp:
        fail("seqlens", f"{len(lens)} sequences", f"verl's DP split takes equal counts: must divide by dp_size={dp}",
             "pass a multiple of dp_size sequences")
    work = [24576 * n + n * n for n in lens]
    ranks = _partitions(work, dp, True) if dp > 1 else [list(range(len(lens)))]
    count = max(1, max(-(-sum(lens[i] for i in r) // max_tokens) for r in ranks))
    while True:
        out = []
        for r in ranks:
            parts = _partitions([work[i] for i in r], min(count, len(r)), False)
            out.append([[r[j] for j in p] for p in parts])
        if all(sum(lens[i] for i in mb) <= max_tokens for rank in out for mb in rank) or count >= max(map(len, ranks)):
            return out
        count += 1
