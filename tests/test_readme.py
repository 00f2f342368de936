"""The README's facts: exactly two Quick-start commands, a front door of at most 250 lines, the picture of
the two layouts as the CLI prints it, how to call the CLI after set-up, next steps that run on files the
repository ships, a test script that says why tests were skipped and how the docs built; and
examples/train_step.py, the training step docs/sharding.md shows, runs (the Python blocks themselves:
tests/test_docs.py)."""

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


def test_the_next_steps_run_on_files_the_repository_ships(monkeypatch, capsys):
    """Each `cpshard` command of the README's next steps names only files the repository ships and is
    accepted as written (before: --lengths-file my_lengths.txt, which nobody had made; and a real batch
    is over verify's 8192 tokens, so the command says --scale-to). verify's spawned run is stood in for:
    what is checked here is the command line and the lengths it hands over."""
    import shlex

    from cpshard.cli import main as cli_main
    from cpshard.verify import MAX_TOKENS, Report

    block = re.findall(r"```bash\n(.*?)```", _section("Quick start"), flags=re.S)[1]
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.startswith(".venv/bin/cpshard ")]
    assert [argv[1] for argv in commands] == ["plan", "verify", "pack"]
    handed = []

    def verify(lengths, **options):
        handed.append(list(lengths))
        return Report([], None, tuple(lengths), "float64", 1e-9, 0.0, naive_skipped="(not run here)")

    monkeypatch.setattr("cpshard.tools.verify.verify", verify)
    monkeypatch.chdir(ROOT)
    for argv in commands:
        files = [value for flag, value in zip(argv, argv[1:]) if flag == "--lengths-file"]
        assert all((ROOT / f).is_file() for f in files), files
        assert cli_main(argv[1:]) == 0, argv
    (lengths,) = handed
    assert sum(lengths) == MAX_TOKENS and len(lengths) == 96
    assert "examples/lengths.txt" in _section("Quick start") and "--scale-to" in _section("Quick start")


def test_the_test_script_says_why_it_skipped_and_how_the_docs_built():
    """scripts/test.sh printed the docs site's header and then nothing on success, and a skipped test
    without its reason: its pytest runs list skip reasons (-rs), and the docs build ends with a result."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    runs = [line for line in script.splitlines() if "-m pytest" in line and '"$@"' not in line]
    assert len(runs) == 3 and all(" -rs " in line for line in runs), runs  # the suite, MTP on 0.16, torchtitan
    docs = script.split("--- the docs site", 1)[1].split("--- the install cases", 1)[0]
    assert re.search(r'\nfi\necho "docs site: OK, .* pages built with no warning"\n', docs), docs
