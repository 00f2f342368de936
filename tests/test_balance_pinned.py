"""The balanced order is pinned: the search returns exactly the orders it returned before it was made
faster (issue 37, item 4), and the bound it stops at is the one it always computed.

``balanced_order`` feeds ``cpshard.pack``, the verl drop-ins, the torch CP balancer and the docs'
figures, so a faster search must visit the same candidates, score them to the same floats and break
ties the same way. ``EXPECTED`` holds, for every case of ``grid()``, the first 12 hex digits of the
SHA-256 of ``repr((order, simple_work_bound))``, written by running the implementation before the
speed-up (main at 1d2c2f7: ``_works`` by one ``searchsorted`` over offset rows, ``order_score``
over a ``(K, cp)`` array, every heavy move map rebuilt, ``_bound`` over every piece of every offset)
on this grid; the grid must not change without rewriting them the same way from that code. The
grid spans every path of the search: every order scored (up to 7 sequences), the full neighbourhood
(up to 40), the heaviest rank's moves (up to 256) and the large path without kicks; benchmark rows
of exponential and long-tailed lengths at S 8k-128k, cp 2-16; padded lengths, zero and one-token
sequences.
"""

from __future__ import annotations

import hashlib
import math
import random

from hypothesis import given
from hypothesis import strategies as st

from cpshard.index.balance import balanced_order, simple_work_bound, tri
from strategies import props


def _packed_row(rng: random.Random, dist: str, total: int) -> list[int]:
    """Documents drawn until the row holds ``total`` tokens, the last one cut (benchmarks/torch_cp.py's rows)."""
    out: list[int] = []
    left = total
    while left > 0:
        n = rng.lognormvariate(math.log(1024), 1.5) if dist == "lognormal" else rng.expovariate(1 / 2048)
        out.append(min(max(1, round(n)), left))
        left -= out[-1]
    return out


def _fill(padded: list[int], cp: int) -> list[int]:
    padded[-1] += -sum(padded) % cp  # the last sequence's padding makes the total divide by cp
    return padded


def grid() -> list[tuple[list[int], list[int], int]]:
    """``(seqlens, padded, cp)`` for every pinned case, from fixed seeds."""
    cases = []
    for total in (8192, 32768, 131072):  # benchmark rows, unpadded (plans_from_positions' plans)
        for cp in (2, 4, 8, 16):
            for dist in ("exp", "lognormal"):
                for seed in range(2):
                    lens = _packed_row(random.Random(1000 * seed + cp), dist, total)
                    cases.append((lens, list(lens), cp))
    rng = random.Random(37)
    for c in range(48):  # small and medium batches: padding to cp, extra pad rows, zeros and ones
        cp = rng.choice([2, 3, 4, 5, 8, 16])
        b = rng.randint(2, 48)
        lens = [rng.choice([0, 1, rng.randint(0, 60), round(rng.expovariate(1 / 400))]) for _ in range(b)]
        align = (1, cp)[c % 2]
        padded = [-(-n // align) * align + rng.choice([0, 0, 0, align]) for n in lens]
        cases.append((lens, _fill(padded, cp), cp))
    for c in range(12):  # the heaviest rank's moves (41 .. 256 sequences) and the large path (past 256)
        cp = rng.choice([2, 4, 8, 16])
        b = rng.randint(41, 256) if c < 9 else rng.randint(257, 360)
        lens = [max(1, round(rng.lognormvariate(5, 1.3))) for _ in range(b)]
        cases.append((lens, _fill(list(lens), cp), cp))
    return cases


def _digest(seqlens: list[int], padded: list[int], cp: int) -> str:
    got = (tuple(balanced_order(seqlens, padded, cp)), simple_work_bound(seqlens, padded, cp))
    return hashlib.sha256(repr(got).encode()).hexdigest()[:12]


EXPECTED = """
65aecddde69a 85252968ad88 678e59141fc2 2f881b34e398 a053100350ab 4b02be161f9d 9f5ee6b58c29 a6c2f726914d
a77c92a944ae b9941e990822 5775ff5d664b 29a859131efe ce55103f3746 93ac6ea19a4e 9e3c3618b549 50bcd439fc14
b171a2cd2617 45d496125952 5aad7aea3954 6fee22365916 3f40dd1a5bbc 5a737f4cdd54 a71cbba09ac5 1bffbda0a3da
fe4cbee2ef7a 69462eb9d7b6 873506d14d16 f1091ade9e70 d99a8c7548cd 1f5eeceb41c4 984a435567cc 7cf8e66b52f8
e4d18e6f9dfa 4a299c184a72 6176984e69f3 da53c7317dc2 216e52f45305 f9c05211fdd3 4940f18bd30a aa511aa3e2ee
3bf36d34cc4e 953899af3418 626269b6314c 77395b5c6181 85da7f23f93d c9e65ba8f543 3365f16f9064 316234ffdc39
296af5d69fce 303de0934fa6 b6a4176d0935 385704acbd7a e1315188b4ce 10e4c8ae66e9 2cf2a506fad2 e1bcce9adf97
99b27d71f9ee 81d802f12e83 f47c37b05f8a 05d8bc612248 aee44b04971a a213cab012e2 b1b16dc8d183 deadc48df145
0f6e07b4b01a 6a1fe29fec51 b598a9809cbd 49796611d6a7 21bec0d1ee52 953b3ab763c7 f39bd97e3c45 16cd629b4807
51fac11f638e 02008db8a168 e3af21398632 48bacf43be42 c06faa01de9f 92576ab18a20 3e75f676b3a7 09b57c2e4705
3443323018ca eabb26abc155 1d1c7f1c7878 44b1cbfd2532 291ddfcd5a9f d74c03287135 e6f9ae8801a4 c11e54dcdc1f
aeea8c1b5fe9 7647c0c97ea9 d88d60281e4e 25b29d74d7b5 b6cb7adf28b0 d69d58bed645 a37351e43b38 45fadf9c8ced
fb9dec196a2c 4117d40b80b4 ea95beaa08cf 2f873694fc3e c4d26dea0c2e f6f219427014 1e89abde2b1d 1dd580505c49
5eb9f48e9cb8 ba5a3641f9dd 63d1faf188a7 ebc1634657a0
""".split()


def test_balanced_orders_are_the_pinned_ones():
    cases = grid()
    assert len(EXPECTED) == len(cases)
    wrong = [(k, len(lens), cp) for k, ((lens, padded, cp), want) in enumerate(zip(cases, EXPECTED))
             if _digest(lens, padded, cp) != want]
    assert not wrong, f"(case, sequences, cp) whose order or bound changed: {wrong}"


def naive_piece_bound(seqlens: list[int], local: int, cp: int) -> int:
    """Parts (1) and (2) of Note [Why no order beats the bound] from the definition: every offset
    ``q`` of every sequence, every piece ``[0, q)``, ``[q, q + L)``, ... cut at its length."""
    bound = -(-sum(tri(n) for n in seqlens) // cp)
    for n in seqlens:
        if tri(n) <= bound or local == 0:
            continue
        best = None
        for q in range(1, local + 1):
            cuts = [0, *range(q, n, local), n] if q < n else [0, n]
            heaviest = max(tri(hi) - tri(lo) for lo, hi in zip(cuts, cuts[1:]))
            best = heaviest if best is None else min(best, heaviest)
        bound = max(bound, best)
    return bound


@props(200)
@given(st.lists(st.integers(0, 3) | st.integers(0, 200), min_size=1, max_size=12), st.integers(1, 8))
def test_simple_work_bound_matches_the_definition(seqlens, cp):
    """Only the first, last and second-last pieces are read now (whole pieces cost more the later
    they start); the definition reads every piece."""
    padded = _fill(list(seqlens), cp)
    local = sum(padded) // cp
    # the piece bound uses the original lengths (tokens), the padded total only for L
    assert simple_work_bound(seqlens, padded, cp) == naive_piece_bound(seqlens, local, cp)
