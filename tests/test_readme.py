"""The README's runnable example runs, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_embedding_example_runs(tmp_path: Path):
    text = README.read_text()
    code = re.search(r"<!-- example: embed -->\n```python\n(.*?)```", text, re.S)
    assert code is not None
    out = subprocess.run([sys.executable, "-c", code.group(1)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "100 done, 0 retried, 0 stale"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(python3 -m venv .*?)\n```", README.read_text())
    assert len(commands) == 2 and commands[0].endswith("asyncworker demo")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci
