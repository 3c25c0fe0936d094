"""Named queues, the pure parts: names, URLs, paths, and the statements'
rewriting for a named queue's schema; the SQLite listing on real files."""

from __future__ import annotations

import ast
import re
import sqlite3
from pathlib import Path

import pytest

from lease.postgres import redact
from lease.postgres.queues import (
    MIGRATION_LOCK,
    Queue,
    in_schema,
    key_lock,
    migration_lock,
)
from lease.postgres.statements import KEY_LOCK, LOCK_KEYS, PICK_AND_LEASE
from lease.queues import (
    check_queue_name,
    family,
    queue_target,
    split_url,
    sqlite_path,
    with_url_queue,
)
from lease.sqlite import SQLiteStore
from lease.stores import list_queues, open_store

POSTGRES_DRIVER = Path(__file__).resolve().parents[2] / "lease" / "postgres"
SQL_WORD = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|LOCK|WITH)\b")


def _statement_texts() -> list[str]:
    """Every string literal of the driver that holds SQL (f-strings' literal
    parts too): whatever reaches the server is made of these."""
    texts = []
    for path in sorted(POSTGRES_DRIVER.glob("*.py")):
        if path.name == "queues.py":  # the listing names every schema, on a plain connection
            continue
        tree = ast.parse(path.read_text())
        prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):  # docstrings are prose, not statements
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in prose and SQL_WORD.search(node.value):
                texts.append(node.value)
    return texts


def test_every_statement_of_the_driver_names_the_named_queues_schema_alone():
    texts = _statement_texts()
    assert len(texts) > 100  # the driver's statements were found
    left = [text for text in texts if re.search(r"\blease\b", in_schema(text, "lease_orders"))]
    assert left == []
    qualified = [text for text in texts if "lease." in text]
    assert all("lease_orders." in in_schema(text, "lease_orders") for text in qualified)


@pytest.mark.parametrize(("written", "named"), [
    ("SELECT * FROM lease.jobs j JOIN lease.attempts a USING (id)",
     "SELECT * FROM lease_orders.jobs j JOIN lease_orders.attempts a USING (id)"),
    ("SELECT to_regclass('lease.schema_migrations')",
     "SELECT to_regclass('lease_orders.schema_migrations')"),
    ("SELECT 1 FROM information_schema.columns WHERE table_schema = 'lease'",
     "SELECT 1 FROM information_schema.columns WHERE table_schema = 'lease_orders'"),
    ("CREATE SCHEMA IF NOT EXISTS lease", "CREATE SCHEMA IF NOT EXISTS lease_orders"),
    ("DROP INDEX lease.jobs_ready", "DROP INDEX lease_orders.jobs_ready"),
    # a column and a status are not the schema
    ("UPDATE lease.jobs SET lease_until = 1 WHERE status = 'leased' AND jobs.lease_until > 0",
     "UPDATE lease_orders.jobs SET lease_until = 1 WHERE status = 'leased' "
     "AND jobs.lease_until > 0"),
])
def test_in_schema_rewrites_the_schema_and_nothing_else(written, named):
    assert in_schema(written, "lease_orders") == named
    assert in_schema(named, "lease_orders") == named  # twice is once
    assert in_schema(written, "lease") is written  # the default queue: untouched


def test_a_named_queues_key_locks_and_migration_lock_are_its_own():
    assert str(KEY_LOCK) in LOCK_KEYS
    named = in_schema(LOCK_KEYS, "lease_orders")
    assert f"pg_advisory_xact_lock({key_lock('lease_orders')}," in named
    assert f"pg_advisory_xact_lock({KEY_LOCK}," not in named
    locks = {key_lock(f"lease_q{n}") for n in range(200)}
    assert KEY_LOCK not in locks and all(0 < lock < 2**31 for lock in locks)
    migrations = {migration_lock(f"lease_q{n}") for n in range(200)}
    assert MIGRATION_LOCK not in migrations and all(0 < lock < 2**63 for lock in migrations)
    assert Queue(None).migration_lock == MIGRATION_LOCK
    assert in_schema(PICK_AND_LEASE, "lease") == PICK_AND_LEASE


def test_a_queue_is_named_by_its_schema_and_channel():
    default, orders = Queue(None), Queue("orders")
    assert (default.schema, default.channel, default.connect_kwargs) == ("lease", "lease_jobs", {})
    assert (orders.schema, orders.channel) == ("lease_orders", "lease_jobs_orders")
    assert "cursor_factory" in orders.connect_kwargs
    assert Queue("default").name is None


@pytest.mark.parametrize("name", ["orders", "a", "q_2", "a" * 40])
def test_a_queue_name(name):
    assert check_queue_name(name) == name


@pytest.mark.parametrize("name", ["", "Orders", "2q", "_q", "a-b", "a.b", "a" * 41, "ö",
                                  "orders\n", 7, b"orders"])
def test_a_bad_queue_name_is_a_clear_value_error(name):
    with pytest.raises(ValueError, match="a queue's name is a lowercase letter"):
        check_queue_name(name)


def test_no_name_and_default_are_the_default_queue():
    assert check_queue_name(None) is None
    assert check_queue_name("default") is None


def test_a_url_names_its_queue_by_a_parameter_libpq_never_sees():
    assert split_url("postgresql://h/db") == ("postgresql://h/db", None)
    assert split_url("postgresql://h/db?queue=orders") == ("postgresql://h/db", "orders")
    assert split_url("postgresql://u@h/db?sslmode=require&queue=orders&application_name=x") == (
        "postgresql://u@h/db?sslmode=require&application_name=x", "orders")
    assert split_url("postgresql://h/db?options=-c%20a%3D1&queue=orders") == (
        "postgresql://h/db?options=-c%20a%3D1", "orders")  # the others as written
    assert split_url("postgresql://h/db", "orders") == ("postgresql://h/db", "orders")
    assert split_url("postgresql://h/db?queue=orders", "orders")[1] == "orders"
    with pytest.raises(ValueError, match="two queue names"):
        split_url("postgresql://h/db?queue=orders", "mail")
    with pytest.raises(ValueError, match="more than once"):
        split_url("postgresql://h/db?queue=a&queue=b")
    with pytest.raises(ValueError, match="a queue's name"):
        split_url("postgresql://h/db?queue=Bad")


def test_a_url_given_a_queue_name():
    assert with_url_queue("postgresql://h/db", "orders") == "postgresql://h/db?queue=orders"
    assert with_url_queue("postgresql://h/db?sslmode=require", "orders") == \
        "postgresql://h/db?sslmode=require&queue=orders"
    assert with_url_queue("postgresql://h/db?queue=orders", None) == \
        "postgresql://h/db?queue=orders"  # no name given: the URL's own
    assert queue_target("postgres://h/db", None) == "postgres://h/db"
    with pytest.raises(ValueError, match="two queue names"):
        queue_target("postgresql://h/db?queue=orders", "mail")


def test_redact_shows_the_queue_after_the_url_and_never_the_password():
    shown = redact("postgresql://u:secret@h/db?password=secret2&queue=orders")
    assert shown == "postgresql://u@h/db queue orders"
    assert redact("postgresql://u:secret@h/db") == "postgresql://u@h/db"


def test_a_named_queues_file_is_beside_the_default_queues(tmp_path):
    assert sqlite_path("/data/queue.db", "orders") == "/data/queue.orders.db"
    assert sqlite_path("/data/queue", "orders") == "/data/queue.orders"
    assert sqlite_path("queue.db", None) == "queue.db"
    assert queue_target("/data/q.sqlite3", "mail") == "/data/q.mail.sqlite3"
    base = tmp_path / "queue.db"
    assert family(tmp_path / "queue.orders.db") == (str(tmp_path / "queue.orders.db"), None)
    base.write_bytes(b"")
    assert family(tmp_path / "queue.orders.db") == (str(base), "orders")
    assert family(tmp_path / "queue.Bad.db") == (str(tmp_path / "queue.Bad.db"), None)
    assert family(base) == (str(base), None)


def test_queues_beside_a_file_are_isolated_and_listed(tmp_path):
    base = tmp_path / "queue.db"
    with open_store(base, create=True) as default, \
            open_store(base, create=True, queue="orders") as orders, \
            open_store(base, create=True, queue="mail") as mail:
        assert default.enqueue_events([{"id": "a", "qty": 1}], now_ms=1_000) == [True]
        assert orders.enqueue_events([{"id": "a", "qty": 2}], now_ms=1_000) == [True]
        [leased] = orders.claim_jobs("w", 5_000, 10, now_ms=1_000).leased
        assert leased.event == {"id": "a", "qty": 2}
        assert (default.counts()["pending"], default.counts()["leased"]) == (1, 0)
        assert sum(mail.counts().values()) == 0
    assert (tmp_path / "queue.orders.db").is_file() and (tmp_path / "queue.mail.db").is_file()
    (tmp_path / "queue.notes.db").write_text("not a queue")  # beside, named alike: ignored
    sqlite3.connect(tmp_path / "queue.other.db").close()  # an empty SQLite file: ignored
    (tmp_path / "other.x.db").write_text("")
    assert list_queues(base) == ["default", "mail", "orders"]
    assert list_queues(tmp_path / "queue.orders.db") == ["default", "mail", "orders"]
    assert (tmp_path / "queue.other.db").stat().st_size == 0  # the listing wrote nothing


def test_named_queues_without_the_default_one(tmp_path):
    base = tmp_path / "q.db"
    SQLiteStore(tmp_path / "q.orders.db", create=True).close()
    assert list_queues(base) == ["orders"]
    assert not base.exists()
