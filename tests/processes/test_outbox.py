"""The transactional outbox: a queue beside a service's own tables, and the
service's job written inside the service's own transaction, on SQLite (a file
declared shared, WAL kept) and on PostgreSQL (the service's psycopg
connection). A real child process killed before and after its COMMIT leaves
both rows or neither; a rolled-back transaction leaves no job."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from lease import postgres, sqlite, worker
from lease.postgres import PostgresStore
from lease.records import Conflicts, NotAQueue
from lease.sqlite import SQLiteStore, reads
from lease.stores import open_store
from tests.support.queues import T0

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "outbox_service.py"


def event(job_id: str, key: str = "cust-1") -> dict:
    return {"id": job_id, "key": key, "body": {"order": job_id}}


def service_file(path: Path, journal: str = "wal") -> sqlite3.Connection:
    """A service's own file: its table, its journal mode, its connection."""
    shop = sqlite3.connect(path, isolation_level=None)
    assert shop.execute(f"PRAGMA journal_mode={journal}").fetchone()[0] == journal
    shop.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
    return shop


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A WAL service file with the queue declared beside its table."""
    con = service_file(tmp_path / "shop.db")
    SQLiteStore(tmp_path / "shop.db", create=True, shared=True).close()
    yield con
    con.close()


def orders(con: sqlite3.Connection) -> list[str]:
    return [row[0] for row in con.execute("SELECT id FROM orders ORDER BY id")]


def job_ids(con: sqlite3.Connection) -> list[str]:
    return [row[0] for row in con.execute("SELECT id FROM jobs ORDER BY seq")]


# ----------------------------------------------------------------- SQLite: sharing a file


def test_a_service_file_is_refused_unless_declared_shared_and_then_always_accepted(tmp_path):
    path = tmp_path / "shop.db"
    service_file(path).close()
    for opening in (lambda: SQLiteStore(path), lambda: SQLiteStore(path, create=True),
                    lambda: open_store(path, create=True), lambda: worker.open_queue(path)):
        with pytest.raises(NotAQueue, match="other tables"):
            opening()
    with SQLiteStore(path, create=True, shared=True) as store:
        assert store.shared and store.schema_version() == sqlite.SCHEMA_VERSION
    with SQLiteStore(path) as store, open_store(path, read_only=True) as looking:
        assert store.shared  # the file says so: no flag needed any more
        assert store.enqueue_events([event("a")], now_ms=T0) == [True]
        assert looking.counts()["pending"] == 1
    ro = reads.open_readonly(path)
    assert reads.snapshot(ro, T0)["by_status"]["pending"] == 1
    ro.close()


def test_a_shared_file_keeps_its_journal_mode(tmp_path):
    """WAL stays WAL (it is the file's); a rollback journal's flavour is each
    connection's own (the queue's is DELETE): the file is never switched."""
    for journal in ("wal", "delete", "truncate"):
        path = tmp_path / f"{journal}.db"
        service_file(path, journal).close()
        with SQLiteStore(path, create=True, shared=True) as store:
            store.enqueue_events([event("a")], now_ms=T0)
            mode = store.connection.execute("PRAGMA journal_mode").fetchone()[0]
            assert mode == ("wal" if journal == "wal" else "delete")
        header = path.read_bytes()[:20]
        assert header[18] == (2 if journal == "wal" else 1)  # the file's read format


def test_a_file_whose_queue_tables_are_malformed_is_refused_even_when_shared(tmp_path):
    path = tmp_path / "shop.db"
    con = service_file(path)
    con.execute("CREATE TABLE jobs (id INTEGER)")  # the service's own "jobs": a collision
    con.close()
    with pytest.raises(NotAQueue, match="table 'jobs'"):
        SQLiteStore(path, create=True, shared=True)
    con = sqlite3.connect(path)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                      " ORDER BY name")] == ["jobs", "orders"]
    con.close()


def test_a_service_numbering_its_schema_in_user_version_is_told_so(tmp_path):
    path = tmp_path / "shop.db"
    con = service_file(path)
    con.execute("PRAGMA user_version = 41")
    con.close()
    with pytest.raises(NotAQueue, match="user_version"):
        SQLiteStore(path, create=True, shared=True)


# ----------------------------------------------------------------- SQLite: enqueue_in


def test_the_job_commits_with_the_services_row(shop):
    shop.execute("BEGIN IMMEDIATE")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    assert sqlite.enqueue_in(shop, [event("o-1"), event("o-1")], now_ms=T0) == [True, False]
    other = sqlite3.connect(shop.execute("PRAGMA database_list").fetchone()[2])
    assert job_ids(other) == []  # not before the service's COMMIT
    shop.execute("COMMIT")
    assert job_ids(other) == ["o-1"] and orders(other) == ["o-1"]
    other.close()


def test_every_delivery_of_a_message_commits_or_rolls_back_with_the_services_row(tmp_path,
                                                                                 shop):
    from lease.endpoints import Endpoint
    path = tmp_path / "shop.db"
    with SQLiteStore(path) as store:
        for name in ("crm", "billing", "audit"):
            store.add_endpoint(Endpoint(name, "http://127.0.0.1:9/events",
                                        types=("*",) if name == "audit" else ("order.paid",)))
    shop.execute("BEGIN")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    assert sqlite.enqueue_in(shop, [{**event("o-1"), "type": "order.paid"}], now_ms=T0) == [
        True]
    shop.execute("ROLLBACK")
    assert job_ids(shop) == [] and orders(shop) == []
    shop.execute("BEGIN")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    sqlite.enqueue_in(shop, [{**event("o-1"), "type": "order.paid"}, event("o-2")], now_ms=T0)
    shop.execute("COMMIT")
    assert sorted(job_ids(shop)) == ["o-1@audit", "o-1@billing", "o-1@crm", "o-2@audit"]


def test_a_rolled_back_service_transaction_leaves_no_job(shop):
    shop.execute("BEGIN")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    sqlite.enqueue_in(shop, [event("o-1")])
    shop.execute("ROLLBACK")
    assert job_ids(shop) == [] and orders(shop) == []


def test_a_connection_with_no_transaction_open_is_refused(shop):
    with pytest.raises(ValueError, match="open transaction"):
        sqlite.enqueue_in(shop, [event("o-1")])
    assert job_ids(shop) == []


def test_a_bad_event_undoes_only_this_calls_rows(shop):
    shop.execute("BEGIN")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    with pytest.raises(ValueError, match="event key"):
        sqlite.enqueue_in(shop, [event("o-1"), {"id": "o-2", "qty": 1, "key": ""}])
    assert shop.in_transaction  # the service decides what becomes of its transaction
    shop.execute("COMMIT")
    assert orders(shop) == ["o-1"] and job_ids(shop) == []


def test_a_conflict_raises_so_the_order_never_commits_without_its_event(shop):
    """The same event id with another body: Conflicts, this call's rows undone,
    and the service's own ``with con:`` rolls its order back."""
    with shop:
        shop.execute("BEGIN")
        shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
        assert sqlite.enqueue_in(shop, [event("o-1")], now_ms=T0) == [True]
    with pytest.raises(Conflicts, match="1 of 2 events conflict, nothing was enqueued: "
                                        "event 2: job 'o-1'") as refused, shop:
        shop.execute("BEGIN")
        shop.execute("INSERT INTO orders (id) VALUES ('o-2')")
        sqlite.enqueue_in(shop, [event("o-2"), {**event("o-1"), "body": {"other": 1}}])
    assert isinstance(refused.value, worker.Conflict)
    assert not shop.in_transaction
    assert orders(shop) == ["o-1"] and job_ids(shop) == ["o-1"]


def test_conflicts_come_back_as_values_only_when_asked(shop):
    shop.execute("BEGIN")
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    sqlite.enqueue_in(shop, [event("o-1")], now_ms=T0)
    with pytest.raises(Conflicts):  # this call's rows undone, the service's kept
        sqlite.enqueue_in(shop, [event("o-2"), {**event("o-1"), "key": "other"}])
    assert shop.in_transaction and job_ids(shop) == ["o-1"]
    results = sqlite.enqueue_in(shop, [event("o-2"), {**event("o-1"), "key": "other"}],
                                on_conflict="return")
    assert results[0] is True and isinstance(results[1], worker.Conflict)
    with pytest.raises(ValueError, match="on_conflict must be one of"):
        sqlite.enqueue_in(shop, [event("o-3")], on_conflict="ignore")
    shop.execute("COMMIT")
    assert job_ids(shop) == ["o-1", "o-2"]


def test_enqueue_in_works_with_the_services_row_factory_and_python_transactions(tmp_path):
    path = tmp_path / "shop.db"
    service_file(path).close()
    SQLiteStore(path, create=True, shared=True).close()
    shop = sqlite3.connect(path)  # Python's default: an implicit BEGIN before DML
    shop.row_factory = lambda cursor, row: {"row": row}
    shop.execute("INSERT INTO orders (id) VALUES ('o-1')")
    assert sqlite.enqueue_in(shop, [event("o-1")], now_ms=T0) == [True]
    shop.commit()
    shop.close()
    with SQLiteStore(path) as store:
        [leased] = store.claim_jobs("w", 1000, now_ms=T0).leased
        assert leased.ticket["id"] == "o-1"


def test_a_file_without_the_current_queue_is_refused(tmp_path):
    shop = service_file(tmp_path / "shop.db")
    shop.execute("BEGIN")
    with pytest.raises(NotAQueue, match="shared=True"):
        sqlite.enqueue_in(shop, [event("o-1")])
    shop.execute("ROLLBACK")
    shop.close()


# ----------------------------------------------------------------- a real crash


def run_child(spec: dict) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.support.outbox_child", json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 73, done.stderr  # it died at the point, nowhere else


@pytest.mark.parametrize("die", ["before-commit", "after-commit"])
def test_a_service_killed_around_its_commit_leaves_both_rows_or_neither_sqlite(shop, die):
    path = shop.execute("PRAGMA database_list").fetchone()[2]
    run_child({"kind": "sqlite", "target": path, "order": "o-9", "die": die})
    with SQLiteStore(path) as store:
        expected = ["o-9"] if die == "after-commit" else []
        assert orders(store.connection) == expected
        assert job_ids(store.connection) == expected


@pytest.fixture
def service_db(postgres_url: str) -> Iterator[str]:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")
    PostgresStore(postgres_url, create=True).close()
    yield postgres_url


def pg_rows(url: str) -> tuple[list, list]:
    with psycopg.connect(url, autocommit=True) as conn:
        return ([r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")],
                [r[0] for r in conn.execute("SELECT id FROM lease.jobs ORDER BY seq")])


@pytest.mark.parametrize("die", ["before-commit", "after-commit"])
def test_a_service_killed_around_its_commit_leaves_both_rows_or_neither_postgres(
        service_db, die):
    run_child({"kind": "postgresql", "target": service_db, "order": "o-9", "die": die})
    expected = ["o-9"] if die == "after-commit" else []
    assert pg_rows(service_db) == (expected, expected)


# ----------------------------------------------------------------- PostgreSQL: enqueue_in


def test_postgres_the_job_and_its_wake_up_come_with_the_services_commit(service_db):
    with PostgresStore(service_db) as store, store.listener() as listener, \
            psycopg.connect(service_db, autocommit=True, row_factory=dict_row) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
            assert postgres.enqueue_in(conn, [event("o-1"), event("o-1")]) == [True, False]
            assert not listener.wait(0.2)  # NOTIFY waits for the COMMIT
            assert pg_rows(service_db) == ([], [])
        assert listener.wait(10)
        assert pg_rows(service_db) == (["o-1"], ["o-1"])
        [leased] = store.claim_jobs("w", 1000).leased
        assert leased.event == {"id": "o-1", "body": '{"order":"o-1"}'}


def test_postgres_a_rolled_back_service_transaction_leaves_no_job(service_db):
    with psycopg.connect(service_db) as conn:  # not autocommit: psycopg's default
        conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
        assert postgres.enqueue_in(conn, [event("o-1")], now_ms=T0) == [True]
        conn.rollback()
    assert pg_rows(service_db) == ([], [])


def test_postgres_a_connection_with_no_transaction_open_is_refused(service_db):
    for autocommit in (True, False):  # not autocommit and idle: the service began nothing
        with psycopg.connect(service_db, autocommit=autocommit) as conn, \
                pytest.raises(ValueError, match="open transaction"):
            postgres.enqueue_in(conn, [event("o-1")])
    assert pg_rows(service_db) == ([], [])


def test_postgres_a_bad_event_undoes_only_this_calls_rows(service_db):
    with psycopg.connect(service_db, autocommit=True) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
        with pytest.raises(ValueError, match="event key"):
            postgres.enqueue_in(conn, [event("o-1"), {"id": "o-2", "qty": 1, "key": ""}])
    assert pg_rows(service_db) == (["o-1"], [])


def test_postgres_a_database_without_the_queue_is_refused(postgres_url):
    with psycopg.connect(postgres_url, autocommit=True) as conn, conn.transaction(), \
            pytest.raises(NotAQueue, match="create=True"):
        postgres.enqueue_in(conn, [event("o-1")])


# ----------------------------------------------------------------- the README's example


def test_the_readme_example_delivers_each_customers_events_in_order(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "shop.db")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ann o-1:placed o-1:paid o-1:shipped",
                                        "bob o-2:placed o-2:cancelled"]
    con = sqlite3.connect(tmp_path / "shop.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2
    con.close()


def test_postgres_a_conflict_raises_so_the_order_never_commits_without_its_event(service_db):
    with psycopg.connect(service_db, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
            assert postgres.enqueue_in(conn, [event("o-1")]) == [True]
        with pytest.raises(Conflicts, match="event 2: job 'o-1'"), conn.transaction():
            conn.execute("INSERT INTO orders (id) VALUES ('o-2')")
            postgres.enqueue_in(conn, [event("o-2"), {**event("o-1"), "body": {"other": 1}}])
        with conn.transaction():  # this call's rows undone, the service's rows its own
            conn.execute("INSERT INTO orders (id) VALUES ('o-3')")
            with pytest.raises(Conflicts):
                postgres.enqueue_in(conn, [event("o-3"), {**event("o-1"), "key": "other"}])
            results = postgres.enqueue_in(conn, [event("o-3"), {**event("o-1"), "key": "x"}],
                                          on_conflict="return")
            assert results[0] is True and isinstance(results[1], worker.Conflict)
    assert pg_rows(service_db) == (["o-1", "o-3"], ["o-1", "o-3"])
