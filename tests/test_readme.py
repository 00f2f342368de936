"""The README's example runs as written (its asserts are part of the documentation)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_quick_start_has_exactly_two_commands():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)[0].strip().splitlines()
    assert [c.split()[0] for c in commands] == ["scripts/run.sh", "scripts/test.sh"]


def test_readme_training_step_is_the_example_that_runs(monkeypatch):
    """The README's training step is examples/train_step.py's, which runs on 2 gloo ranks and checks
    loss, gradients and restored log-probs against the single-process step."""
    import importlib

    path = README.parent / "examples" / "train_step.py"
    shown = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    assert shown and shown[0] in path.read_text()
    monkeypatch.syspath_prepend(str(path.parent))  # the spawned ranks import it by name too
    importlib.import_module("train_step").main(world=2)
