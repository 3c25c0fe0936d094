"""The layout is the architecture: the contracts of pyproject's
``[tool.importlinter]`` hold on the tree (every import, at module level or
inside a function), and each of them fails when an import breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_contract_holds_on_the_tree():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
    assert done.stdout.count(" KEPT") == 8  # every contract of pyproject.toml was checked


# (the module that gains an import, the import, the contract it breaks)
BREAKS = [
    ("asyncworker/metrics.py", "import asyncworker.dispatcher",
     "front ends above the operations, above the runtime and the receiving side"),
    ("asyncworker/dispatcher.py", "import asyncworker.cli.output",
     "front ends above the operations, above the runtime and the receiving side"),
    ("asyncworker/bench/measure.py", "from asyncworker.bench import cpu",
     "the benchmarks: the command above the scenarios"),
    ("lease/store.py", "import lease.sqlite",
     "inside the core: the factory above the drivers"),
    ("lease/policy.py", "import asyncworker.wire",
     "the lease core imports nothing of the runtime or the front ends"),
    ("asyncworker/ui/pages.py", "from asyncworker.cli import output",
     "the page and the command line are independent"),
    ("lease/postgres/reads.py", "import lease.sqlite.reads",
     "the two store drivers never import each other"),
    ("lease/worker.py", "import aiohttp", "the lab contract imports the standard library only"),
    ("asyncworker/wire.py", "import tests.support", "nothing in the product imports the tests"),
]


@pytest.mark.parametrize("module, line, contract", BREAKS,
                         ids=[f"{module}: {line}" for module, line, _ in BREAKS])
def test_an_import_that_breaks_a_contract_fails_the_check(tmp_path: Path, module: str,
                                                          line: str, contract: str):
    """A copy of the tree with one import added, inside a function as a lazy
    import would be: the check fails and names the contract."""
    for package in ("lease", "asyncworker", "tests"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / module).open("a") as source:
        source.write(f"\n\ndef _added() -> None:\n    {line}  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    broken = done.stdout.split("Broken contracts")[1]
    assert contract in broken


def test_the_postgres_launcher_imports_without_psycopg():
    """psycopg is the optional ``postgres`` extra: the launcher imports it
    only where it connects."""
    code = ("import sys; sys.modules['psycopg'] = None\n"
            "import asyncworker.devtools.postgres_server as launcher\n"
            "print(launcher.free_port() > 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
