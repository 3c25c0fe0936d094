"""Read-only observations: opening a queue to look at it changes nothing."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from lease import worker
from lease.sqlite import reads
from tests.support.queues import T0, add


def listing(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_read_only_open_reads_a_queue(con, queue_path):
    add(con, "a", 1)
    add(con, "b", 2)
    ro = reads.open_readonly(queue_path)
    try:
        assert reads.counts(ro)["pending"] == 2
        assert reads.snapshot(ro, T0)["jobs"] == 2
        assert reads.job_history(ro, "a")["job"]["qty"] == 1
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
    ro = reads.open_readonly(copy)
    assert reads.counts(ro)["pending"] == 1
    ro.close()
    assert listing(copy.parent) == before


def test_a_dropped_index_is_not_recreated(con, queue_path):
    add(con, "a", 1)
    con.execute("DROP INDEX jobs_live")
    con.close()
    before = listing(queue_path.parent)
    ro = reads.open_readonly(queue_path)
    assert reads.snapshot(ro, T0)["by_status"]["pending"] == 1
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
        reads.open_readonly(path)
    after = listing(tmp_path) if path.is_file() else sorted(os.listdir(tmp_path))
    assert after == before


def test_open_readonly_checks_its_path():
    for bad in ("", ":memory:", "file:x.db", 3):
        with pytest.raises(ValueError):
            reads.open_readonly(bad)  # type: ignore[arg-type]


def test_a_hot_journal_left_by_a_killed_writer_is_named_not_repaired(queue_path, con):
    import subprocess
    import sys

    add(con, "a", 1)
    con.close()
    killed = subprocess.run([sys.executable, "-c", f"""
import os, sqlite3
con = sqlite3.connect({str(queue_path)!r}, isolation_level=None)
con.execute("PRAGMA cache_size = 1")  # changed pages spill to the file before COMMIT
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE jobs SET qty = 999")
con.execute("CREATE TABLE spill AS SELECT * FROM jobs")
con.execute("DELETE FROM jobs")
os._exit(9)  # killed mid-transaction: the rollback journal stays, hot
"""], timeout=30)
    assert killed.returncode == 9
    journal = queue_path.with_name(queue_path.name + "-journal")
    assert journal.exists()
    before = listing(queue_path.parent)
    reads.READ_PATIENCE_S, saved = 0.2, reads.READ_PATIENCE_S
    try:
        with pytest.raises(sqlite3.OperationalError) as refused:
            reads.open_readonly(queue_path)
        # what is known, not a guess: no writer finished it, killed or failed on a full
        # disk, and the room left where the file lives
        said = str(refused.value)
        assert "its writer did not finish" in said and "full disk" in said
        assert "was killed" not in said
        free = int(said.split("free space on its disk: ")[1].split(" bytes")[0].replace(",", ""))
        assert abs(free - shutil.disk_usage(queue_path.parent).free) < 64 << 20
        assert "rolls it back" in said
    finally:
        reads.READ_PATIENCE_S = saved
    assert listing(queue_path.parent) == before
    writer = worker.open_queue(queue_path)  # a writer rolls it back: the committed state
    assert writer.execute("SELECT id, qty FROM jobs").fetchall() == [("a", 1)]
    writer.close()
    ro = reads.open_readonly(queue_path)
    assert reads.counts(ro)["pending"] == 1
    ro.close()
