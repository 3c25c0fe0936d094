"""The README's runnable example runs, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncworker.cli.parser import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


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
    assert out.stdout.splitlines() == ["134 done, 0 retried, 0 dead",
                                       "shop applied 100, crm applied 34"]
    assert list(scratch.iterdir()) == []  # its temporary folder is gone
    assert list(cwd.iterdir()) == []


def test_the_outbox_example_writes_the_event_with_the_order_or_not_at_all(tmp_path: Path):
    code = re.search(r"<!-- example: outbox -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    out = subprocess.run([sys.executable, "-c", code.group(1)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "o-2 refused: its event conflicts, so the order was rolled back",
        "['o-1'] ['o-1:placed']"]  # never an order committed without its event
    assert list(tmp_path.iterdir()) == []


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(python3 -m venv .*?)\n```", README.read_text())
    assert commands[0].endswith("asyncworker demo")  # the first command: the main job
    [test_command] = [c for c in commands if c.endswith("pytest")]
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_command in ci


def test_every_test_named_in_the_guarantees_exists():
    docs = (README.parent / "docs" / "guarantees.md").read_text()
    sources = "".join(p.read_text() for p in (README.parent / "tests").rglob("test_*.py"))
    named = set(re.findall(r"::(test_\w+)", docs))
    assert len(named) > 20
    assert sorted(n for n in named if f"def {n}(" not in sources) == []


def test_the_readme_shows_the_orders_service_example_file_whole():
    """The README's copy is the file a test runs as a service (tests/test_idempotent*)."""
    text = README.read_text()
    code = re.search(r"<!-- example: orders_service \(docs/examples/orders_service\.py\) -->\n"
                     r"```python\n(.*?)\n```\n", text, re.S)
    assert code is not None
    example = README.parent / "docs" / "examples" / "orders_service.py"
    assert code.group(1) + "\n" == example.read_text()


def _command_lines(text: str) -> list[list[str]]:
    """Every `asyncworker ...` line of the README's sh blocks, continuations joined,
    comments dropped; a line with a placeholder ("...", "[--json]") is left out."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("asyncworker ") and "..." not in line and "[" not in line:
                found.append(shlex.split(line)[1:])
    return found


def test_every_command_line_in_the_readme_parses():
    lines = _command_lines(README.read_text())
    deploying = [args for args in lines if "--secret-file" in args]
    assert len(deploying) >= 2  # the receiver on a network and the dispatcher pointed at it
    parser = build_parser()
    for args in lines:
        try:
            parser.parse_args(args)
        except SystemExit as exc:  # --version exits 0; a bad command 2, its message on stderr
            if exc.code:
                pytest.fail(f"the README's command does not parse: asyncworker "
                            f"{shlex.join(args)}")
