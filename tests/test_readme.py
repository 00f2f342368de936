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
