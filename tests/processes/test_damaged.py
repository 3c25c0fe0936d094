"""Foreign and damaged files: each a clear error, the file untouched.

run_file never creates or repairs a queue; open_queue refuses what is not one.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from lease import worker
from tests.support.queues import T0, Clock, add


def send_ok(event: dict) -> bool:
    return True


def _queue_with_jobs(path: Path, n: int = 50) -> None:
    con = worker.open_queue(path)
    for i in range(n):
        add(con, f"j-{i}", 1)
    con.close()


def _damaged(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.db"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-sqlite":
        path.write_bytes(b"id,qty\nsnack-7,7\n" * 200)
    elif kind == "other-schema":
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE orders (id TEXT, qty INTEGER)")
        con.execute("INSERT INTO orders VALUES ('snack-7', 7)")
        con.commit()
        con.close()
    elif kind == "wrong-columns":
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY, id TEXT)")
        con.commit()
        con.close()
    elif kind == "truncated":
        _queue_with_jobs(path, 400)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbled-header":
        _queue_with_jobs(path, 10)
        data = bytearray(path.read_bytes())
        data[:16] = b"NOT A DATABASE!!"
        path.write_bytes(bytes(data))
    return path


KINDS = ["not-sqlite", "other-schema", "wrong-columns", "truncated", "garbled-header"]


def _content(path: Path) -> bytes:
    return path.read_bytes() if path.is_file() else b"<dir>"


@pytest.mark.parametrize("kind", KINDS)
def test_open_queue_refuses_and_leaves_the_file_alone(tmp_path: Path, kind: str):
    path = _damaged(tmp_path, kind)
    before = _content(path)
    with pytest.raises((ValueError, sqlite3.DatabaseError)) as raised:
        con = worker.open_queue(path)
        try:  # a truncated file may open; it must fail as soon as it is read
            worker.claim(con, "o", T0)
        finally:
            con.close()
    assert str(raised.value)
    assert _content(path) == before
    assert not Path(str(path) + "-journal").exists()


@pytest.mark.parametrize("kind", ["directory", *KINDS])
def test_run_file_refuses_and_never_repairs(tmp_path: Path, kind: str):
    path = _damaged(tmp_path, kind)
    before = _content(path)
    listing = sorted(p.name for p in tmp_path.iterdir())
    expected = FileNotFoundError if kind == "directory" else (ValueError, sqlite3.DatabaseError)
    with pytest.raises(expected):
        worker.run_file(path, "o", Clock(T0, T0 + 1), send_ok, 0.5)
    assert _content(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_an_existing_empty_file_is_initialised_as_a_queue(tmp_path: Path):
    empty = tmp_path / "empty.db"
    empty.touch()  # SQLite treats a zero-length file as an empty database
    assert worker.run_file(empty, "o", Clock(T0), send_ok, 0.5) is None
    con = sqlite3.connect(empty)
    assert con.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
    con.close()


READ_ONLY_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("worker", sys.argv[1])
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
try:
    worker.run_file(sys.argv[2], "o", iter([1_000_000, 1_000_001]).__next__,
                    lambda event: True, 0.5)
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("no error")
"""


def _not_root() -> None:
    os.setgid(65534)
    os.setuid(65534)  # as root, file modes do not bind; "nobody" is bound by them


def test_read_only_file_is_a_clear_error_and_untouched(tmp_path: Path):
    import shutil
    import subprocess
    import sys
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        path = folder / "queue.db"
        _queue_with_jobs(path, 5)
        shutil.copy(Path(worker.__file__), folder / "worker.py")
        path.chmod(0o444)
        folder.chmod(0o555)  # no journal can be created beside it either
        before = path.read_bytes()
        as_root = os.geteuid() == 0
        # "nobody" cannot enter root's home, where this interpreter may live; the
        # child needs the standard library only, so the system's python3 serves.
        python = shutil.which("python3", path="/usr/bin:/bin") if as_root else sys.executable
        assert python, "a python3 that an unprivileged user can run"
        out = subprocess.run([python, "-I", "-c", READ_ONLY_CHILD,
                              str(folder / "worker.py"), str(path)], capture_output=True,
                             text=True, timeout=60,
                             preexec_fn=_not_root if as_root else None)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("OperationalError") and "readonly" in out.stdout
        assert path.read_bytes() == before
        assert sorted(p.name for p in folder.iterdir()) == ["queue.db", "worker.py"]
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)
