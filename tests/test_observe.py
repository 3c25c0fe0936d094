"""Read-only observations: opening a queue to look at it changes nothing."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from lease import observe

from .conftest import T0, add


def listing(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_read_only_open_reads_a_queue(con, queue_path):
    add(con, "a", 1)
    add(con, "b", 2)
    ro = observe.open_readonly(queue_path)
    try:
        assert observe.counts(ro)["pending"] == 2
        assert observe.snapshot(ro, T0)["jobs"] == 2
        assert observe.job_history(ro, "a")["job"]["qty"] == 1
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro.execute("DELETE FROM jobs")
    finally:
        ro.close()


def test_a_wal_copy_is_read_without_switching_its_mode_or_leaving_files(tmp_path, con,
                                                                          queue_path):
    add(con, "a", 1)
    con.close()
    copy = tmp_path / "copy" / "queue.db"
    copy.parent.mkdir()
    wal = sqlite3.connect(queue_path)
    wal.execute("PRAGMA journal_mode=WAL")
    wal.execute("VACUUM INTO ?", (str(copy),))
    wal.close()
    flip = sqlite3.connect(copy)
    assert flip.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    flip.close()
    before = listing(copy.parent)
    assert list(before) == ["queue.db"]
    ro = observe.open_readonly(copy)
    assert observe.counts(ro)["pending"] == 1
    ro.close()
    assert listing(copy.parent) == before


def test_a_dropped_index_is_not_recreated(con, queue_path):
    add(con, "a", 1)
    con.execute("DROP INDEX jobs_live")
    con.close()
    before = listing(queue_path.parent)
    ro = observe.open_readonly(queue_path)
    assert observe.snapshot(ro, T0)["by_status"]["pending"] == 1
    ro.close()
    assert listing(queue_path.parent) == before


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda p: None, FileNotFoundError, "not found"),
    (lambda p: p.mkdir(), ValueError, "not a file"),
    (lambda p: p.write_bytes(b""), ValueError, "empty"),
    (lambda p: p.write_bytes(b"not sqlite at all" * 20), ValueError, "not a SQLite"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE orders (x)"), ValueError,
     "other tables"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE jobs (x)"), ValueError, "columns"),
    (lambda p: sqlite3.connect(p).execute("PRAGMA user_version = 1"), ValueError, "no tables"),
])
def test_what_is_not_a_queue_is_refused_untouched(tmp_path, make, error, message):
    path = tmp_path / "q.db"
    made = make(path)
    if isinstance(made, sqlite3.Cursor):
        made.connection.commit()
        made.connection.close()
    before = listing(tmp_path) if path.is_file() else sorted(os.listdir(tmp_path))
    with pytest.raises(error, match=message):
        observe.open_readonly(path)
    after = listing(tmp_path) if path.is_file() else sorted(os.listdir(tmp_path))
    assert after == before


def test_open_readonly_checks_its_path():
    for bad in ("", ":memory:", "file:x.db", 3):
        with pytest.raises(ValueError):
            observe.open_readonly(bad)  # type: ignore[arg-type]
