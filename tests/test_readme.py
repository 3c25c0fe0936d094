"""The README's runnable example runs, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_embedding_example_runs_and_removes_its_folder(tmp_path: Path):
    text = README.read_text()
    code = re.search(r"<!-- example: embed -->\n```python\n(.*?)```", text, re.S)
    assert code is not None
    scratch, cwd = tmp_path / "scratch", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    out = subprocess.run([sys.executable, "-c", code.group(1)], cwd=cwd,
                         capture_output=True, text=True, timeout=120,
                         env={"TMPDIR": str(scratch), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "100 done, 0 retried, 0 dead"
    assert list(scratch.iterdir()) == []  # its temporary folder is gone
    assert list(cwd.iterdir()) == []


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(python3 -m venv .*?)\n```", README.read_text())
    assert commands[0].endswith("asyncworker demo")  # the first command: the main job
    [test_command] = [c for c in commands if c.endswith("pytest")]
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_command in ci


def test_every_test_named_in_the_guarantees_exists():
    docs = (README.parent / "docs" / "guarantees.md").read_text()
    sources = "".join(p.read_text() for p in (README.parent / "tests").glob("test_*.py"))
    named = set(re.findall(r"::(test_\w+)", docs))
    assert len(named) > 20
    assert sorted(n for n in named if f"def {n}(" not in sources) == []
