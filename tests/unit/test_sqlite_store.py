"""What only the SQLite store has: a file, its bytes, its version in PRAGMA
user_version, and migrations from the contract's own files. The rules every
store shares are tested once for all stores in tests/conformance/."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from lease import sqlite as store
from lease import worker
from lease.sqlite import SQLiteStore, schema
from tests.support import DATA
from tests.support.queues import T0

OLD_FILE = DATA / "queue-v0.db"  # written by the contract-only code
LAB_SCHEMA = """CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token INTEGER NOT NULL,
  available_at INTEGER NOT NULL, deadline INTEGER NOT NULL,
  owner TEXT, lease_until INTEGER, reason TEXT);
CREATE TABLE redrives (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL);"""


def lab_columns(con: sqlite3.Connection) -> list[tuple]:
    names = ", ".join(worker.CONTRACT_COLUMNS["jobs"])
    return con.execute(f"SELECT {names} FROM jobs ORDER BY seq").fetchall()


def body_event(job_id: str, **body: object) -> dict:
    return {"id": job_id, "body": body}


def test_a_file_written_by_the_contract_code_migrates_with_every_row_kept(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    old = sqlite3.connect(path)
    jobs_before = lab_columns(old)
    redrives_before = old.execute("SELECT * FROM redrives ORDER BY seq").fetchall()
    assert old.execute("PRAGMA user_version").fetchone()[0] == 0
    old.close()
    assert {row[3] for row in jobs_before} == {"pending", "leased", "done", "dead"}
    assert {row[11] for row in jobs_before if row[3] == "dead"} == {
        "permanent", "deadline", "exhausted"}

    con = store.open_store(path)
    assert store.schema_version(con) == store.SCHEMA_VERSION
    assert lab_columns(con) == jobs_before
    assert con.execute("SELECT seq, id, token, at_ms, note FROM redrives"
                       " ORDER BY seq").fetchall() == redrives_before
    # who made those redrives was never recorded: the new column says so
    assert {row[0] for row in con.execute("SELECT actor FROM redrives")} == {None}
    assert con.execute("SELECT COUNT(*) FROM jobs WHERE body IS NOT NULL"
                       " OR digest IS NOT NULL").fetchone()[0] == 0
    assert store.migrate(con) == store.SCHEMA_VERSION  # a second open changes nothing
    con.close()


def test_the_contract_functions_still_work_on_a_migrated_file(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    store.open_store(path).close()
    con = worker.open_queue(path)
    assert worker.enqueue_many(con, [{"id": "lab-1", "qty": 3}, {"id": "lab-2", "qty": 4}],
                               T0 + 500_000, 60_000) == [True, True]
    ticket = worker.claim(con, "lab", T0 + 500_000)  # the old jobs are past their deadline
    assert ticket is not None and ticket["id"] == "lab-1"
    assert worker.finish(con, ticket, "ok", T0 + 500_001) == "done"
    con.close()
    run = worker.run_file(path, "lab", lambda: T0 + 500_002, lambda event: True, 0.5)
    assert run == {"id": "lab-2", "token": 1, "status": "done"}


def test_the_checkers_schema_without_indexes_migrates(tmp_path):
    path = tmp_path / "checker.db"
    raw = sqlite3.connect(path)
    raw.executescript(LAB_SCHEMA)
    raw.execute("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
                " deadline) VALUES ('a', 1, 'pending', 0, 3, 0, 1, 99)")
    raw.commit()
    raw.close()
    con = store.open_store(path)
    assert lab_columns(con) == [(1, "a", 1, "pending", 0, 3, 0, 1, 99, None, None, None)]
    con.close()


def test_a_newer_file_is_refused_untouched(tmp_path):
    path = tmp_path / "new.db"
    store.open_store(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {store.SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    before = path.read_bytes()
    with pytest.raises(ValueError, match="newer than this code"):
        store.open_store(path)
    with pytest.raises(ValueError, match="newer than this code"):
        SQLiteStore(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "new.db"]


def test_a_crash_inside_the_migration_leaves_the_old_version_whole(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    broken = schema.MIGRATIONS[1] + ("CREATE TABLE attempts (x)",)  # fails: exists already
    monkeypatch.setitem(schema.MIGRATIONS, 1, broken)
    with pytest.raises(sqlite3.OperationalError):
        store.open_store(path)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 0
    assert [r[1] for r in con.execute("PRAGMA table_info(jobs)")] == worker.CONTRACT_COLUMNS["jobs"]
    con.close()


def test_a_damaged_version_1_file_is_refused(tmp_path):
    path = tmp_path / "q.db"
    store.open_store(path).close()
    raw = sqlite3.connect(path)
    raw.execute("DROP TABLE cancels")
    raw.commit()
    raw.close()
    with pytest.raises(ValueError, match="cancels"):
        store.open_store(path)


def test_an_intake_on_a_contract_file_migrates_it_in_its_own_transaction(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    before = path.read_bytes()
    con = worker.open_queue(path)  # the contract's open: no migration
    with pytest.raises(ValueError):
        store.enqueue_events(con, [body_event("fine"), {"id": "bad"}], T0)
    assert path.read_bytes() == before  # refused halfway: the old version, whole
    assert store.enqueue_events(con, [body_event("fine")], T0) == [True]
    assert store.schema_version(con) == store.SCHEMA_VERSION
    con.close()


def test_a_store_that_leaves_the_migration_to_its_first_intake(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    before = path.read_bytes()
    with SQLiteStore(path, migrate=False) as queue:
        assert queue.schema_version() == 0
        with pytest.raises(ValueError):
            queue.enqueue_events([body_event("fine"), {"id": "bad"}], now_ms=T0)
        assert path.read_bytes() == before
        assert queue.enqueue_events([body_event("fine")], now_ms=T0) == [True]
        assert queue.schema_version() == store.SCHEMA_VERSION


def test_a_refused_call_leaves_the_file_byte_for_byte(tmp_path):
    """The conformance suite compares what the interface shows; here, the bytes."""
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True) as queue:
        queue.enqueue_events([body_event("a"), {"id": "b", "qty": 2}], now_ms=T0)
        [job] = queue.claim_jobs("d1", 1000, now_ms=T0).leased
        before = path.read_bytes()
        for call in (lambda: queue.enqueue_events([body_event("c"), {"id": "d"}], now_ms=T0),
                     lambda: queue.claim_jobs("bad owner", 1000, now_ms=T0),
                     lambda: queue.extend_lease({**job.ticket, "qty": -1}, 10, now_ms=T0),
                     lambda: queue.finish_jobs([(job.ticket, "maybe", 0, None)], now_ms=T0),
                     lambda: queue.redrive_jobs(["a"], 0, "n", now_ms=T0),
                     lambda: queue.cancel_jobs(["a"], "bad\nnote", now_ms=T0),
                     lambda: queue.prune_done(-1)):
            with pytest.raises(ValueError):
                call()
            assert path.read_bytes() == before
            assert not queue.connection.in_transaction


def test_a_version_2_file_migrates_to_ordered_keys_with_every_row_kept(tmp_path):
    path = tmp_path / "v2.db"
    con = worker.open_queue(path)
    with worker.immediate(con):
        for version in (1, 2):
            for statement in schema.MIGRATIONS[version]:
                con.execute(statement)
        con.execute("PRAGMA user_version = 2")
    worker.enqueue_many(con, [{"id": "old-1", "qty": 1}, {"id": "old-2", "qty": 2}], T0, 60_000)
    con.close()
    with SQLiteStore(path) as migrated:
        assert migrated.schema_version() == store.SCHEMA_VERSION
        rows = migrated.jobs_with_status("pending")
        assert [(r["id"], r["ordering_key"], r["held"]) for r in rows] == [
            ("old-1", None, 0), ("old-2", None, 0)]
        assert migrated.enqueue_events([{"id": "new", "qty": 1, "key": "k"}],
                                       now_ms=T0) == [True]
        claimed = migrated.claim_jobs("w", 1000, 10, now_ms=T0)
        assert [j.ticket["id"] for j in claimed.leased] == ["old-1", "old-2", "new"]
    newer = sqlite3.connect(path)
    newer.execute(f"PRAGMA user_version = {store.SCHEMA_VERSION + 1}")
    newer.close()
    with pytest.raises(worker.NotAQueue, match="newer"):
        SQLiteStore(path)


def version_3_file(path: Path) -> sqlite3.Connection:
    """A queue as version 3 wrote it, its payloads on the jobs' rows; open."""
    con = worker.open_queue(path)
    with worker.immediate(con):
        for version in (1, 2, 3):
            for statement in schema.MIGRATIONS[version]:
                con.execute(statement)
        con.execute("PRAGMA user_version = 3")
        # as version 3 wrote them: the body on the job's row
        for job_id, status, body in (("a", "pending", '{"n":1}'), ("b", "done", '{"n":2}'),
                                     ("lab", "pending", None)):
            con.execute("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
                        " available_at, deadline, body, digest) VALUES (?, 0, ?, 0, 5, 0, ?, ?,"
                        " ?, ?)", (job_id, status, T0, T0 + 60_000, body,
                                   None if body is None else f"digest-{job_id}"))
    return con


def test_a_version_3_file_moves_its_bodies_to_their_table_with_every_row_kept(tmp_path):
    path = tmp_path / "v3.db"
    con = version_3_file(path)
    before = con.execute("SELECT seq, body FROM jobs WHERE body IS NOT NULL"
                         " ORDER BY seq").fetchall()
    con.close()
    assert len(before) == 2
    with SQLiteStore(path) as migrated:
        raw = migrated.connection
        assert migrated.schema_version() == store.SCHEMA_VERSION
        assert raw.execute("SELECT seq, body FROM bodies ORDER BY seq").fetchall() == before
        assert raw.execute("SELECT COUNT(*) FROM jobs WHERE body IS NOT NULL").fetchone() == (0,)
        assert [(r["id"], r["body"]) for r in migrated.list_jobs()] == [
            ("a", '{"n":1}'), ("b", '{"n":2}'), ("lab", None)]
        history = migrated.job_history("b")
        assert history is not None and history["job"]["body"] == '{"n":2}'
        claimed = migrated.claim_jobs("w", 1000, 10, now_ms=T0)
        assert [job.event for job in claimed.leased] == [
            {"id": "a", "body": '{"n":1}'}, {"id": "lab", "qty": 0}]
        # a pruned job takes its body with it; the others keep theirs
        assert migrated.prune_done(T0 + 1) == 1
        assert raw.execute("SELECT seq, body FROM bodies").fetchall() == [before[0]]


def test_an_intake_writes_each_body_once_in_its_table(tmp_path):
    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True) as queue:
        raw = queue.connection
        assert queue.enqueue_events([body_event("a", n=1), {"id": "lab", "qty": 2},
                                     body_event("b", n=2), body_event("a", n=1)],
                                    now_ms=T0) == [True, True, True, False]
        assert raw.execute("SELECT j.id, b.body FROM bodies b JOIN jobs j USING (seq)"
                           " ORDER BY seq").fetchall() == [("a", '{"n":1}'), ("b", '{"n":2}')]
        assert raw.execute("SELECT COUNT(*) FROM jobs WHERE body IS NOT NULL").fetchone() == (0,)
        with pytest.raises(ValueError):  # a bad event: none of the batch is kept
            queue.enqueue_events([body_event("c", n=3), {"id": "bad"}], now_ms=T0)
        assert raw.execute("SELECT COUNT(*) FROM bodies").fetchone() == (2,)
        claimed = queue.claim_jobs("w", 1000, 10, now_ms=T0)
        assert [job.event for job in claimed.leased] == [
            {"id": "a", "body": '{"n":1}'}, {"id": "lab", "qty": 2}, {"id": "b", "body": '{"n":2}'}]


# The claim's pick of version 3, word for word: what an older dispatcher runs.
V3_PICK = """
SELECT seq, id, qty, attempts, token, deadline, body FROM jobs INDEXED BY jobs_ready
WHERE status IN ('pending', 'leased') AND held = 0
  AND ((status = 'pending' AND available_at <= :now)
    OR (status = 'leased' AND lease_until <= :now))
ORDER BY seq LIMIT :limit
"""


def test_an_older_dispatcher_still_running_claims_nothing_once_the_bodies_moved(tmp_path):
    """Its pick would read NULL for every payload; it fails whole instead."""
    path = tmp_path / "v3.db"
    version_3_file(path).close()
    older = worker.open_queue(path)  # open across the migration, as a running process's
    try:
        assert [row[-1] for row in older.execute(V3_PICK, {"now": T0, "limit": 10})] == [
            '{"n":1}', None]
        SQLiteStore(path).close()  # the migration, by a newer process
        with pytest.raises(sqlite3.OperationalError, match="no such index: jobs_ready"):
            older.execute(V3_PICK, {"now": T0, "limit": 10})
    finally:
        older.close()
    with SQLiteStore(path) as queue:  # the newer code claims them, bodies and all
        assert [job.event for job in queue.claim_jobs("w", 1000, 10, now_ms=T0).leased] == [
            {"id": "a", "body": '{"n":1}'}, {"id": "lab", "qty": 0}]


def test_a_version_5_file_gains_the_console_and_trace_with_every_row_kept(tmp_path):
    path = tmp_path / "v5.db"
    con = worker.open_queue(path)
    with worker.immediate(con):
        for version in range(1, schema.CONSOLE_SINCE):
            for statement in schema.MIGRATIONS[version]:
                con.execute(statement)
        con.execute(f"PRAGMA user_version = {schema.CONSOLE_SINCE - 1}")
        con.execute("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
                    " available_at, deadline) VALUES ('a', 1, 'pending', 0, 5, 0, ?, ?)",
                    (T0, T0 + 60_000))
    con.close()
    with SQLiteStore(path, read_only=True) as looking:  # read as it is: no pause there
        assert looking.schema_version() == schema.CONSOLE_SINCE - 1
        assert looking.paused() is None and looking.queue_audit() == []
    with SQLiteStore(path) as migrated:
        assert migrated.schema_version() == store.SCHEMA_VERSION
        assert migrated.connection.execute("SELECT id, trace FROM jobs").fetchall() == [
            ("a", None)]
        assert migrated.paused() is None
        assert migrated.pause("hold", now_ms=T0) is True
        assert migrated.claim_jobs("w", 1000, 10, now_ms=T0).leased == []


def version_7_file(path: Path) -> None:
    """A queue as version 7 wrote it: a job of its own and a delivery, pending."""
    con = worker.open_queue(path)
    with worker.immediate(con):
        for version in range(1, schema.PRIORITY_SINCE):
            for statement in schema.MIGRATIONS[version]:
                con.execute(statement)
        con.execute(f"PRAGMA user_version = {schema.PRIORITY_SINCE - 1}")
        for job_id, endpoint in (("own", None), ("m@e1", "e1")):
            con.execute("INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
                        " available_at, deadline, endpoint, message) VALUES (?, 1, 'pending',"
                        " 0, 5, 0, ?, ?, ?, ?)", (job_id, T0, T0 + 60_000, endpoint,
                                                  None if endpoint is None else "m"))
    con.close()


# The claim's pick of version 7, word for word: what an older dispatcher runs.
V7_PICK = """SELECT seq, id FROM jobs INDEXED BY jobs_own
WHERE endpoint IS NULL AND status IN ('pending', 'leased') AND held = 0
  AND ((status = 'pending' AND available_at <= :now)
    OR (status = 'leased' AND lease_until <= :now))
ORDER BY seq LIMIT :limit"""


def test_a_version_7_file_gains_priorities_its_jobs_at_0(tmp_path):
    path = tmp_path / "v7.db"
    version_7_file(path)
    with SQLiteStore(path, read_only=True) as looking:  # read as it is: no priority there
        assert looking.schema_version() == schema.PRIORITY_SINCE - 1
        assert [row["id"] for row in looking.list_jobs()] == ["own", "m@e1"]
    older = worker.open_queue(path)  # open across the migration, as a running process's
    try:
        with SQLiteStore(path) as migrated:
            assert migrated.schema_version() == store.SCHEMA_VERSION
            assert [(r["id"], r["priority"]) for r in migrated.list_jobs()] == [
                ("own", 0), ("m@e1", 0)]
            indexes = dict(migrated.connection.execute(
                "SELECT name, sql FROM sqlite_master WHERE name IN"
                " ('jobs_own', 'jobs_endpoint_due')").fetchall())
            assert "(priority DESC)" in indexes["jobs_own"]  # then the rowid: seq
            assert "(endpoint, priority DESC, available_at)" in indexes["jobs_endpoint_due"]
            # an older dispatcher's pick still runs (the index kept its name)
            assert older.execute(V7_PICK, {"now": T0, "limit": 10}).fetchall() == [(1, "own")]
            assert migrated.enqueue_events([{"id": "urgent", "qty": 1, "priority": 3}],
                                           now_ms=T0) == [True]
            claimed = migrated.claim_jobs("w", 1000, 10, now_ms=T0)
            assert [job.ticket["id"] for job in claimed.leased] == ["urgent", "own"]
            assert schema.migrate(migrated.connection) == store.SCHEMA_VERSION  # once only
    finally:
        older.close()


def version_8_file(path: Path) -> None:
    """A queue as version 8 left it, with an endpoint's deliveries in every
    state: two done, one dead, one leased, one held behind its line's first,
    two due. Written through today's API, then given version 8's indexes
    back (the tables did not change)."""
    from lease.endpoints import Endpoint
    from lease.records import Attempt
    from lease.sqlite.statements import DUE_LINE, OWN_READY

    with SQLiteStore(path, create=True) as queue:
        queue.add_endpoint(Endpoint("e1", "http://127.0.0.1:9/hook"))
        queue.enqueue_events([{"id": f"m{i}", "qty": 1} for i in range(5)]
                             + [{"id": "k1", "qty": 1, "key": "k"},
                                {"id": "k2", "qty": 1, "key": "k"}], now_ms=T0)
        leased = queue.claim_jobs("w", 60_000, 4, now_ms=T0, endpoints="*").leased
        assert [job.ticket["id"] for job in leased] == ["m0@e1", "m1@e1", "m2@e1", "m3@e1"]
        queue.finish_jobs([(leased[0].ticket, "ok", 0, Attempt(T0, 1, 200)),
                           (leased[1].ticket, "ok", 0, Attempt(T0, 1, 200)),
                           (leased[2].ticket, "permanent", 0, Attempt(T0, 1, 410, "gone"))],
                          now_ms=T0 + 1)
        con = queue.connection
        with worker.immediate(con):
            con.execute("DROP INDEX jobs_endpoint_rest")
            con.execute("DROP INDEX jobs_of_endpoint")
            con.execute("CREATE INDEX jobs_by_endpoint ON jobs(endpoint, status)"
                        " WHERE endpoint IS NOT NULL")
            con.execute("DROP INDEX jobs_own")
            con.execute(f"CREATE INDEX jobs_own ON jobs(priority DESC, seq) WHERE {OWN_READY}")
            con.execute("DROP INDEX jobs_endpoint_due")
            con.execute("CREATE INDEX jobs_endpoint_due ON jobs(endpoint, priority DESC,"
                        f" available_at, seq) WHERE {DUE_LINE}")
            con.execute(f"PRAGMA user_version = {schema.REST_SINCE - 1}")


def test_a_version_8_file_counts_its_deliveries_from_the_claim_indexes_and_the_rest(tmp_path):
    path = tmp_path / "v8.db"
    version_8_file(path)
    with SQLiteStore(path, read_only=True) as looking:  # read as it is
        assert looking.schema_version() == schema.REST_SINCE - 1
        before = looking.endpoint_stats()
    older = worker.open_queue(path)  # open across the migration, as a running process's
    try:
        with SQLiteStore(path) as migrated:
            assert migrated.schema_version() == store.SCHEMA_VERSION
            names = {row[0] for row in migrated.connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index'")}
            assert {"jobs_endpoint_rest", "jobs_of_endpoint"} <= names
            assert "jobs_by_endpoint" not in names
            after = migrated.endpoint_stats()
            assert after == before
            assert {k: after[0][k] for k in ("ready", "in_flight", "done", "dead")} == {
                "ready": 3, "in_flight": 1, "done": 2, "dead": 1}  # ready: 2 due, 1 held
            # an older dispatcher's read of the old index fails whole, as an error
            with pytest.raises(sqlite3.OperationalError, match="no such index"):
                older.execute("SELECT COUNT(*) FROM jobs INDEXED BY jobs_by_endpoint"
                              " WHERE endpoint IS NOT NULL").fetchone()
            # the recovery reads the finished by the new index
            assert migrated.recover_endpoint("e1", T0, 60_000, "back", now_ms=T0 + 5) == [
                "m0@e1", "m1@e1", "m2@e1"]
            assert migrated.endpoint_stats()[0]["ready"] == 6
            assert schema.migrate(migrated.connection) == store.SCHEMA_VERSION  # once only
    finally:
        older.close()


def _index_pages(con: sqlite3.Connection, path: Path, name: str) -> dict[int, bytes]:
    """The bytes of every page of one index in the file, by page number
    (dbstat says which pages are the index's)."""
    numbers = [row[0] for row in con.execute("SELECT pageno FROM dbstat WHERE name = ?",
                                             (name,))]
    assert numbers, name
    size = con.execute("PRAGMA page_size").fetchone()[0]
    data = path.read_bytes()
    return {n: data[(n - 1) * size:n * size] for n in numbers}


def test_a_lease_of_deliveries_leaves_the_endpoint_rest_index_untouched(tmp_path):
    """The index of an endpoint's held and finished deliveries keeps its
    bytes through a claim of 64 deliveries (the index of every delivery by
    status it replaced rewrote two entries for each), and a finish adds to it."""
    from lease.endpoints import Endpoint
    from lease.records import Attempt

    path = tmp_path / "q.db"
    with SQLiteStore(path, create=True) as queue:
        queue.add_endpoint(Endpoint("e1", "http://127.0.0.1:9/hook"))
        queue.enqueue_events([{"id": f"m{i}", "qty": 1} for i in range(500)], now_ms=T0)
        first = queue.claim_jobs("w", 60_000, 64, now_ms=T0, endpoints="*").leased
        queue.finish_jobs([(job.ticket, "ok", 0, Attempt(T0, 1, 200)) for job in first],
                          now_ms=T0 + 1)
        before = _index_pages(queue.connection, path, "jobs_endpoint_rest")
        leased = queue.claim_jobs("w", 60_000, 64, now_ms=T0 + 2, endpoints="*").leased
        assert len(leased) == 64
        assert _index_pages(queue.connection, path, "jobs_endpoint_rest") == before
        queue.finish_jobs([(job.ticket, "ok", 0, Attempt(T0, 1, 200)) for job in leased],
                          now_ms=T0 + 3)
        assert _index_pages(queue.connection, path, "jobs_endpoint_rest") != before
        assert queue.endpoint_stats()[0]["done"] == 128


@pytest.mark.parametrize("status, index", [
    (None, "jobs_of_endpoint"), ("pending", "jobs_of_endpoint"), ("leased", "jobs_in_flight"),
    ("done", "jobs_endpoint_rest"), ("dead", "jobs_endpoint_rest"),
    ("dead_jobs", "jobs_endpoint_rest")])
def test_a_page_of_one_endpoints_deliveries_reads_an_index_of_that_endpoint(tmp_path, status,
                                                                           index):
    """The operator's pages of one endpoint (list_jobs, dead_jobs) read an
    index range of that endpoint, never every delivery of the queue: the
    statement run, as traced, planned again."""
    from lease.endpoints import Endpoint

    with SQLiteStore(tmp_path / "q.db", create=True) as queue:
        queue.add_endpoint(Endpoint("e1", "http://127.0.0.1:9/hook"))
        queue.enqueue_events([{"id": f"m{i}", "qty": 1} for i in range(5)], now_ms=T0)
        run: list[str] = []
        queue.connection.set_trace_callback(run.append)
        if status == "dead_jobs":
            queue.dead_jobs(endpoint="e1")
        else:
            queue.list_jobs(endpoint="e1", status=status)
        queue.connection.set_trace_callback(None)
        [page] = [sql for sql in run if "ORDER BY" in sql]
        plan = " | ".join(str(row[3]) for row in queue.connection.execute(
            "EXPLAIN QUERY PLAN " + page))
    assert f"USING INDEX {index} (endpoint=?)" in plan or \
        f"SEARCH j USING INDEX {index} (endpoint=? AND status=?)" in plan, plan
    assert "SCAN j" not in plan, plan
    if status == "leased":  # the leases' seqs first, then each row by its rowid
        assert "LIST SUBQUERY" in plan and "rowid=?" in plan, plan
