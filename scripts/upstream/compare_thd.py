"""By hand: preprocess_thd_engine's whole outputs against the verl on the path, on random batches.

Run from the repository root with a verl source tree first on the path (scripts/upstream/check.sh
does): every row, pad rows and position ids included, must equal verl's, except the rows where verl
loses a label (README, "Differences from verl", 1) and batches whose padding verl breaks (2, 3);
cases where verl itself raises are counted, not compared.
"""
import random
import sys

import torch

sys.path.insert(0, "tests")  # noqa: E402 (the test helpers)
import verl_fakes as vf
from test_verl_compat import _lost_labels, _ours_thd, _verl_thd

random.seed(0)
checked = crashed = 0
for it in range(1500):
    cp, tp = random.randint(1, 5), random.randint(1, 4)
    layout = random.choice(["zigzag", "contiguous"])
    lens = [random.choice([0, 1, 7, 8, 9, 16, 17, random.randint(0, 150)]) for _ in range(random.randint(1, 6))]
    if sum(lens) == 0:
        lens[0] = 1
    roll, fp8 = random.random() < 0.6, random.random() < 0.3
    ext = random.choice([{}, {"min_local_rows": random.randint(0, 80)},
                         {"pad_to_length_bucket": random.randint(1, 70)}])
    x = vf.nested(lens, random.choice([(), (3,)]), random.choice([torch.int64, torch.float32]), seed=it)
    kw = dict(need_roll=roll, use_fp8_padding=fp8, cp_layout=layout, **ext)
    for r in range(cp):
        got, psp, pos = _ours_thd(x, cp, tp, r, **kw)
        try:
            want, vpsp, vpos = _verl_thd(x, cp, tp, r, **kw)
        except (RuntimeError, IndexError):
            crashed += 1
            continue
        plan = psp._cpshard_plan
        if list(torch.diff(vpsp.cu_seqlens_q_padded).tolist()) != list(plan.padded_seqlens_py):
            continue  # verl's padding loses tokens there (exceptions 2 and 3)
        lost = _lost_labels(plan, r, roll)
        assert got.shape == want.shape, (lens, cp, tp, kw)
        assert torch.equal(got[0][~lost], want[0][~lost]), (lens, cp, tp, r, kw, got, want)
        assert torch.equal(pos, vpos), (lens, cp, tp, r, kw, pos, vpos)
        checked += 1
print("verl", vf.vutil.__file__, "checked", checked, "rank-cases; verl crashed on", crashed)
