"""The contract module loads as one file by its path, on the standard library alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import lease
from lease import worker

SCRIPT = """
import importlib.util as u, sys
s = u.spec_from_file_location('worker', 'worker.py')
m = u.module_from_spec(s)
s.loader.exec_module(m)
names = 'retry_delay open_queue enqueue claim finish redrive run_once run_file extend'.split()
errors = 'Conflict Retryable Permanent BadAck'.split()
assert all(callable(getattr(m, n)) for n in names)
assert all(issubclass(getattr(m, n), Exception) for n in errors)
con = m.open_queue('q.db')
assert m.enqueue(con, {'id': 'snack-7', 'qty': 7}, 0, 1000) is True
print(m.run_once(con, 'solo', iter([0, 5]).__next__, lambda e: True, 0.5))
con.close()
mods = sorted(k for k in sys.modules if k.split('.')[0] in ('lease', 'asyncworker', 'aiohttp'))
print(mods)
"""


def test_worker_loads_alone_from_an_empty_folder(tmp_path: Path):
    shutil.copy(Path(worker.__file__), tmp_path / "worker.py")
    out = subprocess.run([sys.executable, "-I", "-c", SCRIPT], cwd=tmp_path, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["{'id': 'snack-7', 'token': 1, 'status': 'done'}", "[]"]


def test_package_reexports_the_whole_contract():
    for name in worker.__all__:
        assert getattr(lease, name) is getattr(worker, name)
    assert sorted(lease.__all__) == sorted(worker.__all__)


def test_asyncworker_names_match_their_homes():
    import asyncworker

    for name in asyncworker.__all__:
        assert getattr(asyncworker, name) is not None
    assert sorted(asyncworker.__all__) == sorted(asyncworker._HOMES)
