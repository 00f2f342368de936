"""The README's facts: exactly two Quick-start commands, a front door of at most 250 lines, the picture of
the two layouts as the CLI prints it, how to call the CLI after set-up; and examples/train_step.py, the
training step docs/sharding.md shows, runs (the Python blocks themselves: tests/test_docs.py)."""

from __future__ import annotations

import importlib
import re

from test_docs import ROOT

README = ROOT / "README.md"


def _section(title: str) -> str:
    return README.read_text().split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def test_readme_quick_start_has_exactly_two_commands():
    commands = re.findall(r"```bash\n(.*?)```", _section("Quick start"), flags=re.S)[0].strip().splitlines()
    assert [c.split()[0] for c in commands] == ["scripts/run.sh", "scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec scripts/test.sh" in ci


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 250
    quick = _section("Quick start")
    assert ".venv/bin/cpshard" in quick and "source .venv/bin/activate" in quick


def test_the_layouts_picture_is_what_cpshard_plan_prints():
    """Each rank's rows under zigzag and contiguous, as `cpshard plan --lengths 8,4 --cp 2 --layout both`."""
    from cpshard import ShardPlan, describe_plan

    picture = re.findall(r"```\n(.*?)```", _section("Zigzag and contiguous, in one picture"), flags=re.S)[0]
    rows = {r: re.split(r"\s{4,}", line.split(":", 1)[1].strip())
            for r, line in enumerate(line for line in picture.splitlines() if line.startswith("rank"))}
    for column, layout in enumerate(("zigzag", "contiguous")):
        printed = describe_plan(ShardPlan.build([8, 4], cp_size=2, layout=layout))
        for rank, cells in rows.items():
            assert f"rank {rank} : {cells[column]}\n" in printed, (layout, rank, cells[column])
        work = re.search(r"causal work max/mean = (\S+)", printed)[1]
        assert re.search(r"causal work max/mean:\s+(\S+)\s+(\S+)", picture)[column + 1] == work


def test_the_training_step_example_runs(monkeypatch):
    """examples/train_step.py runs on 2 gloo ranks and checks loss, gradients and restored log-probs
    against the single-process step."""
    path = ROOT / "examples" / "train_step.py"
    monkeypatch.syspath_prepend(str(path.parent))  # the ranks import it by name too
    importlib.import_module("train_step").main(world=2)
