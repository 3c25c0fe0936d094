"""The layout is the architecture: who may import whom, read from the source
(every import, at module level or inside a function), so a new import that
breaks a direction fails here rather than in a review."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "asyncworker"
# The runtime: what a dispatcher needs, and nothing a front end or a tool is.
RUNTIME = ("dispatcher", "leases", "finisher", "store", "wire", "sender", "metrics", "logs",
           "eventloop")
ABOVE_THE_RUNTIME = ("asyncworker.receiving", "asyncworker.bench", "asyncworker.devtools",
                     "asyncworker.cli", "asyncworker.ui", "asyncworker.demo")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


IMPORTS = {_module(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_nothing_in_the_product_imports_the_tests():
    assert {module: sorted(name for name in names if _within(name, ("tests",)))
            for module, names in IMPORTS.items()
            if any(_within(name, ("tests",)) for name in names)} == {}


@pytest.mark.parametrize("name", RUNTIME)
def test_the_runtime_imports_no_front_end_no_receiver_no_tool(name: str):
    above = sorted(imported for imported in IMPORTS[f"asyncworker.{name}"]
                   if _within(imported, ABOVE_THE_RUNTIME))
    assert above == []


def test_metrics_reads_the_dispatcher_without_importing_it():
    assert not _within_any(IMPORTS["asyncworker.metrics"], ("asyncworker.dispatcher",))


def test_the_receiving_side_imports_no_runtime_but_its_logs():
    for module, names in IMPORTS.items():
        if _within(module, ("asyncworker.receiving",)):
            runtime = [name for name in names if _within(name, tuple(
                f"asyncworker.{part}" for part in RUNTIME if part != "logs"))]
            assert runtime == [], module


def test_the_benchmarks_import_downwards_only():
    """measure under every scenario module, the command on top of them all."""
    order = ["measure", "sqlite", "cpu", "postgres", "store_cpu", "command"]
    below = {"measure": set(), "sqlite": {"measure"}, "cpu": {"measure"},
             "postgres": {"measure"}, "store_cpu": set(),
             "command": {"measure", "sqlite", "cpu", "postgres"}}
    for name in order:
        imported = {other for other in order if other != name and _within_any(
            IMPORTS[f"asyncworker.bench.{name}"], (f"asyncworker.bench.{other}",))}
        assert imported <= below[name], name


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


def _within_any(names: set[str], packages: tuple[str, ...]) -> bool:
    return any(_within(name, packages) for name in names)
