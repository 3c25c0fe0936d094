"""A queue file in WAL mode: a choice made once (``journal="wal"``, ``asyncworker
init --journal wal``), kept by every later open, durable at every COMMIT, and
undone only on purpose. The rules themselves run on a WAL file in the
conformance suite (kind "sqlite-wal")."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncworker import Dispatcher
from lease import worker
from lease.sqlite import SQLiteStore, journal_mode
from lease.stores import open_store
from tests.support.commands import cli
from tests.support.queues import T0
from tests.support.servers import ReceiverProcess

EVENTS = [{"id": f"w-{i}", "qty": i + 1} for i in range(20)]


def file_journal(path: Path) -> str:
    """The journal mode a fresh connection finds in the file's header."""
    con = sqlite3.connect(path)
    try:
        return str(con.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        con.close()


def test_a_wal_file_is_made_once_and_every_later_open_keeps_it(tmp_path: Path):
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True, journal="wal") as store:
        assert journal_mode(store.connection) == "wal"
        store.enqueue_events(EVENTS, now_ms=T0)
    assert file_journal(path) == "wal"
    with SQLiteStore(path) as store:  # no flag: the file says what it is
        assert journal_mode(store.connection) == "wal"
        assert store.connection.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert store.counts()["pending"] == 20
    with open_store(path, read_only=True) as reader:
        assert reader.counts()["pending"] == 20
    assert file_journal(path) == "wal"


def test_a_rollback_journal_file_stays_one_and_can_be_switched_back(tmp_path: Path):
    path = tmp_path / "q.db"
    SQLiteStore(path, create=True).close()
    assert file_journal(path) == "delete"
    SQLiteStore(path, journal="wal").close()
    assert file_journal(path) == "wal"
    with SQLiteStore(path, journal="delete") as store:
        assert journal_mode(store.connection) == "delete"
    assert file_journal(path) == "delete"
    assert not (tmp_path / "q.db-wal").exists()


def test_two_stores_share_a_wal_file_and_a_switch_while_it_is_in_use_is_refused(
        tmp_path: Path):
    path = tmp_path / "q.db"
    first = SQLiteStore(path, create=True, journal="wal")
    try:
        first.enqueue_events(EVENTS[:5], now_ms=T0)
        with SQLiteStore(path) as second:  # a second process's open keeps WAL too
            assert second.counts()["pending"] == 5
            with pytest.raises(worker.StoreError, match="journal_mode=delete.*open"):
                SQLiteStore(path, journal="delete")
        # the contract's own opener insists on its rollback journal: refused while in use
        with pytest.raises(sqlite3.OperationalError, match="locked|journal_mode=DELETE"):
            worker.open_queue(path)
    finally:
        first.close()
    assert file_journal(path) == "wal"


@pytest.mark.parametrize("journal", ["WAL", "memory", "off", "truncate", 1, True])
def test_a_journal_that_is_no_choice_is_refused_and_nothing_is_created(
        tmp_path: Path, journal: object):
    path = tmp_path / "q.db"
    with pytest.raises(ValueError, match="journal must be None, 'delete' or 'wal'"):
        SQLiteStore(path, create=True, journal=journal)  # type: ignore[arg-type]
    assert not path.exists()


def test_a_shared_file_keeps_the_services_journal(tmp_path: Path):
    with pytest.raises(ValueError, match="shared file keeps the service's journal"):
        SQLiteStore(tmp_path / "q.db", create=True, shared=True, journal="wal")


def test_every_commit_on_a_wal_file_survives_the_process_dying_at_once(tmp_path: Path):
    """A child claims and finishes jobs one transaction at a time and dies by
    os._exit right after a COMMIT, its last transaction in the WAL only (no
    checkpoint, no close): every committed change is there when the file is
    opened again."""
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True, journal="wal") as store:
        store.enqueue_events(EVENTS, now_ms=T0)
    script = textwrap.dedent(f"""
        import os
        from lease.sqlite import SQLiteStore
        from lease.records import Attempt
        store = SQLiteStore({str(path)!r})
        now = {T0 + 10}
        for _ in range(7):
            claimed = store.claim_jobs("child", 60_000, 1, now_ms=now)
            [job] = claimed.leased
            store.finish_jobs([(job.ticket, "ok", 0, Attempt.of(now, 1, None))], now_ms=now)
        claimed = store.claim_jobs("child", 60_000, 2, now_ms=now)
        print(len(claimed.leased), flush=True)
        os._exit(9)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout.strip()) == (9, "2"), out.stderr
    assert (tmp_path / "q.db-wal").exists()  # nothing was checkpointed at a close
    with SQLiteStore(path) as store:
        assert store.counts() == {"pending": 11, "leased": 2, "done": 7, "dead": 0}
        assert all(store.job_history(f"w-{i}")["job"]["status"] == "done" for i in range(7))


def test_the_lab_contract_on_a_wal_file_it_alone_has_open_turns_it_back(tmp_path: Path):
    """The contract's opener keeps its rules (a rollback journal): alone with a
    WAL file, it makes it a rollback-journal file again, rows kept."""
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True, journal="wal") as store:
        store.enqueue_events(EVENTS[:3], now_ms=T0)
    con = worker.open_queue(path)
    try:
        assert con.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 3
    finally:
        con.close()
    assert file_journal(path) == "delete"


def test_init_journal_wal_then_a_dispatcher_delivers_and_stats_reads_it(tmp_path: Path):
    queue = tmp_path / "q.db"
    out = cli("init", str(queue), "--journal", "wal")
    assert out.returncode == 0, out.stderr
    assert "journal wal" in out.stdout
    lines = "".join(json.dumps(event) + "\n" for event in EVENTS)
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", "--concurrency", "8")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ok"] == 20 and rx.stats()["applied"] == 20
    snap = json.loads(cli("stats", str(queue), "--json").stdout)
    assert snap["by_status"]["done"] == 20
    assert file_journal(queue) == "wal"
    out = cli("init", str(queue))  # kept as it is, journal and all
    assert out.returncode == 0 and "kept existing" in out.stdout and "journal wal" in out.stdout
    assert file_journal(queue) == "wal"


def test_init_journal_refuses_what_it_cannot_do(tmp_path: Path):
    out = cli("init", str(tmp_path / "q.db"), "--journal", "memory")
    assert out.returncode == 2 and "--journal" in out.stderr
    out = cli("init", str(tmp_path / "s.db"), "--journal", "wal", "--shared")
    assert out.returncode == 2 and "journal" in out.stderr
    assert not (tmp_path / "s.db").exists()
    out = cli("init", "postgresql://127.0.0.1:9/none", "--journal", "wal")
    assert out.returncode == 2 and "SQLite" in out.stderr


async def test_the_dispatcher_on_a_wal_file_records_every_attempt(tmp_path: Path):
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True, journal="wal") as store:
        store.enqueue_events(EVENTS)  # now, on the store's clock, as the dispatcher judges

    async def send(event: dict, token: int) -> bool:
        return True

    async with Dispatcher(path, "d1", send=send, concurrency=4) as d:
        stats = await d.run(until_idle=True)
    assert stats.ok == 20
    with SQLiteStore(path) as store:
        assert journal_mode(store.connection) == "wal"
        history = store.job_history("w-3")
        assert history is not None and history["job"]["done_by"] == "d1"
