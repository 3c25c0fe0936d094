"""The product's SQLite queue (lease.sqlite): migrations from real old files,
payloads, wider budgets, the evidence of every attempt, cancels, retention."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from lease import observe, worker
from lease import sqlite as store
from lease.policy import DEFAULT_POLICY, MAX_BODY_BYTES, PRODUCT, RetryPolicy, canonical_body
from lease.sqlite import Attempt
from lease.worker import Conflict

from .conftest import T0, rows

OLD_FILE = Path(__file__).parent / "data" / "queue-v0.db"  # written by the contract-only code
LAB_SCHEMA = """CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token INTEGER NOT NULL,
  available_at INTEGER NOT NULL, deadline INTEGER NOT NULL,
  owner TEXT, lease_until INTEGER, reason TEXT);
CREATE TABLE redrives (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL);"""


@pytest.fixture
def db(tmp_path: Path):
    con = store.open_store(tmp_path / "queue.db")
    yield con
    con.close()


def lab_columns(con: sqlite3.Connection) -> list[tuple]:
    names = ", ".join(worker._COLUMNS["jobs"])
    return con.execute(f"SELECT {names} FROM jobs ORDER BY seq").fetchall()


def body_event(job_id: str, **body: object) -> dict:
    return {"id": job_id, "body": body}


# ----------------------------------------------------------------- migrations


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
    assert con.execute("SELECT * FROM redrives ORDER BY seq").fetchall() == redrives_before
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
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "new.db"]


def test_a_crash_inside_the_migration_leaves_the_old_version_whole(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    shutil.copy(OLD_FILE, path)
    broken = store._MIGRATIONS[1] + ("CREATE TABLE attempts (x)",)  # fails: exists already
    monkeypatch.setitem(store._MIGRATIONS, 1, broken)
    with pytest.raises(sqlite3.OperationalError):
        store.open_store(path)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 0
    assert [r[1] for r in con.execute("PRAGMA table_info(jobs)")] == worker._COLUMNS["jobs"]
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


# ----------------------------------------------------------------- intake


def test_a_payload_round_trips_and_a_resend_is_a_duplicate(db):
    body = {"order": 7, "items": [{"sku": "crisps", "n": 2}], "note": "café ✓", "x": 1.5}
    assert store.enqueue_events(db, [body_event("order:7", **body)], T0) == [True]
    reordered = dict(reversed(list(body.items())))
    assert store.enqueue_events(db, [{"id": "order:7", "body": reordered}], T0 + 5) == [False]
    [job] = store.claim_jobs(db, "d1", T0 + 10, 30_000)[0]
    assert job.body == canonical_body(body)[0]
    assert job.event == {"id": "order:7", "body": job.body}
    import json
    assert json.loads(job.body) == body
    assert job.ticket["qty"] == 0


def test_another_body_for_the_same_id_is_a_conflict(db):
    store.enqueue_events(db, [body_event("tenant/7", a=1)], T0)
    before = rows(db)
    [result] = store.enqueue_events(db, [body_event("tenant/7", a=2)], T0 + 1)
    assert isinstance(result, Conflict) and "other content" in str(result)
    assert rows(db) == before


def test_a_duplicate_never_resets_the_budget(db):
    store.enqueue_events(db, [body_event("a", v=1)], T0, RetryPolicy(max_attempts=5))
    store.claim_jobs(db, "d1", T0 + 1, 1000)
    before = rows(db)
    assert store.enqueue_events(db, [body_event("a", v=1)], T0 + 2,
                                RetryPolicy(max_attempts=50, ttl_ms=10**9)) == [False]
    assert rows(db) == before


def test_lab_and_payload_events_share_one_queue(db):
    results = store.enqueue_events(db, [{"id": "snack-1", "qty": 4}, body_event("evt-1", k=1)],
                                   T0)
    assert results == [True, True]
    [result] = store.enqueue_events(db, [{"id": "snack-1", "qty": 5}], T0)
    assert isinstance(result, Conflict)
    jobs, _ = store.claim_jobs(db, "d1", T0, 1000, 5)
    assert [job.event for job in jobs] == [{"id": "snack-1", "qty": 4},
                                           {"id": "evt-1", "body": '{"k":1}'}]


@pytest.mark.parametrize(("event", "message"), [
    ({"id": "a", "body": []}, "JSON object"),
    ({"id": "a", "body": {"x": float("nan")}}, "not JSON"),
    ({"id": "a", "body": {1: "x"}}, "keys must be str"),
    ({"id": "a", "body": {"t": (1, 2)}}, "does not survive"),
    ({"id": "a", "body": {"s": {1, 2}}}, "not JSON"),
    ({"id": "a", "body": {"s": "\ud800"}}, "lone surrogate"),
    ({"id": "a", "body": {"x": "y" * MAX_BODY_BYTES}}, "more than"),
    ({"id": "a b", "body": {}}, "visible ASCII"),
    ({"id": "x" * 256, "body": {}}, "1-255"),
    ({"id": "a", "qty": 0}, "qty"),
    ({"id": "order:1", "qty": 1}, "event id must be 1-64 ASCII"),  # a lab event: lab ids
    ({"id": "a", "qty": 1, "body": {}}, "keys id and qty, or id and body"),
    ({"id": "a"}, "keys"),
    ("a", "must be a dict"),
])
def test_bad_events_are_refused_and_nothing_is_written(db, event, message):
    before = rows(db)
    with pytest.raises(ValueError, match=message):
        store.enqueue_events(db, [{"id": "fine", "qty": 1}, event], T0)
    assert rows(db) == before == [] and not db.in_transaction


def test_real_ids_are_accepted(db):
    ids = ["3f2b8c1e-9a4d-4c7b-8e2f-1a2b3c4d5e6f", "order:123", "tenant/7", "msg_2KWPBgLlAfx",
           "a.b@c+d=e", "x" * 255]
    assert store.enqueue_events(db, [body_event(i) for i in ids], T0) == [True] * len(ids)


def test_a_stream_that_fails_midway_enqueues_nothing(db):
    def events():
        yield {"id": "a", "qty": 1}
        yield {"id": "b", "qty": 2}
        raise OSError("the pipe broke")

    with pytest.raises(OSError):
        store.enqueue_events(db, events(), T0)
    assert rows(db) == [] and not db.in_transaction


def test_not_before_delays_the_first_attempt(db):
    store.enqueue_events(db, [body_event("later")], T0, not_before_ms=T0 + 60_000)
    assert store.claim_jobs(db, "d1", T0 + 59_999, 1000)[0] == []
    [job] = store.claim_jobs(db, "d1", T0 + 60_000, 1000)[0]
    assert job.ticket["id"] == "later"
    assert rows(db)[0]["deadline"] == T0 + 60_000 + DEFAULT_POLICY.ttl_ms
    with pytest.raises(ValueError, match="not_before_ms"):
        store.enqueue_events(db, [body_event("past")], T0, not_before_ms=T0 - 1)


def test_the_policy_allows_budgets_for_real_outages(db):
    policy = RetryPolicy(max_attempts=50, ttl_ms=7 * 86_400_000, lease_ms=3_600_000,
                         backoff_cap_ms=6 * 3_600_000)
    store.enqueue_events(db, [body_event("long")], T0, policy)
    [job] = store.claim_jobs(db, "d1", T0, policy.lease_ms)[0]
    assert job.ticket["lease_until"] == T0 + 3_600_000
    assert policy.delay_ms(40, 1.0) == 6 * 3_600_000
    for bad in (dict(max_attempts=101), dict(ttl_ms=31 * 86_400_000), dict(jitter=1.5),
                dict(backoff_base_ms=10, backoff_cap_ms=5), dict(lease_ms=0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_equal_jitter_never_waits_less_than_half_a_step():
    policy = DEFAULT_POLICY
    assert policy.delay_ms(1, 0.0) == 500 and policy.delay_ms(1, 1.0) == 1000
    assert policy.delay_ms(13, 0.0) == 1_800_000  # the cap, halved
    least = sum(policy.delay_ms(n, 0.0) for n in range(1, policy.max_attempts))
    assert least > 6 * 3_600_000  # the budget outlasts six hours whatever the draws


# ----------------------------------------------------------------- evidence


def claim_one(db, owner: str = "d1", now: int = T0, lease: int = 30_000):
    [job] = store.claim_jobs(db, owner, now, lease)[0]
    return job.ticket


def test_each_finish_records_what_its_attempt_saw(db):
    store.enqueue_events(db, [body_event("e1")], T0, RetryPolicy(max_attempts=3))
    ticket = claim_one(db)
    [result] = store.finish_jobs(db, [(ticket, "retry", 1000, Attempt(
        T0, latency_ms=12, http_status=503, error="receiver answered 503"))], T0 + 20)
    assert result == ("pending", "retry")
    ticket = claim_one(db, now=T0 + 1020)
    [result] = store.finish_jobs(db, [(ticket, "ok", 0, Attempt(T0 + 1020, 7, 200))], T0 + 1030)
    assert result == ("done", None)
    history = observe.job_history(db, "e1")
    assert history is not None
    assert [(a["attempt"], a["outcome"], a["result"], a["http_status"], a["error"])
            for a in history["attempts"]] == [
        (1, "retry", "pending", 503, "receiver answered 503"), (2, "ok", "done", 200, None)]
    assert history["attempts"][0]["started_ms"] == T0
    assert history["attempts"][0]["ended_ms"] == T0 + 20
    assert history["attempts"][0]["latency_ms"] == 12


def test_a_stale_finish_is_refused_recorded_and_counted(db):
    store.enqueue_events(db, [body_event("e1")], T0)
    old = claim_one(db, "d1", T0, 100)
    new = claim_one(db, "d2", T0 + 100, 30_000)
    before = rows(db)
    assert store.finish_jobs(db, [(old, "ok", 0, Attempt(T0, 90, 200))], T0 + 150) == [False]
    assert rows(db) == before  # the newer lease is untouched
    assert store.stale_finishes(db) == 1
    assert store.finish_jobs(db, [(new, "ok", 0, Attempt(T0 + 100))], T0 + 200) == [
        ("done", None)]
    results = [a["result"] for a in observe.job_history(db, "e1")["attempts"]]
    assert results == ["stale", "done"]
    assert observe.snapshot(db, T0 + 300)["stale_finishes"] == 1


def test_an_attempt_that_proved_nothing_is_recorded_and_the_job_stays_leased(db):
    store.enqueue_events(db, [body_event("e1")], T0)
    ticket = claim_one(db)
    before = rows(db)
    assert store.finish_jobs(db, [(ticket, None, 0, Attempt(
        T0, 5, 200, "BadAck: answer is not JSON"))], T0 + 10) == [("leased", None)]
    assert rows(db) == before
    [attempt] = observe.job_history(db, "e1")["attempts"]
    assert (attempt["outcome"], attempt["result"]) == ("none", "leased")


def test_error_text_is_capped(db):
    store.enqueue_events(db, [body_event("e1")], T0)
    ticket = claim_one(db)
    store.finish_jobs(db, [(ticket, "permanent", 0, Attempt(T0, error="x" * 5000))], T0 + 1)
    [attempt] = observe.job_history(db, "e1")["attempts"]
    assert len(attempt["error"]) == store.MAX_ERROR_CHARS


def test_dead_jobs_show_their_last_error(db):
    store.enqueue_events(db, [body_event("e1"), body_event("e2")], T0,
                         RetryPolicy(max_attempts=1))
    jobs, _ = store.claim_jobs(db, "d1", T0, 1000, 2)
    store.finish_jobs(db, [(jobs[0].ticket, "retry", 0, Attempt(T0, error="refused")),
                           (jobs[1].ticket, "permanent", 0, Attempt(T0, http_status=410))],
                      T0 + 1)
    dead = {job["id"]: (job["reason"], job["last_error"]) for job in observe.dead_jobs(db)}
    assert dead == {"e1": ("exhausted", "refused"), "e2": ("permanent", "HTTP 410")}


def test_finish_items_are_checked_before_anything_is_written(db):
    store.enqueue_events(db, [body_event("e1")], T0)
    ticket = claim_one(db)
    before = (rows(db), rows(db, "attempts"))
    for bad in ([(ticket, "ok", 0)], [(ticket, "ok", 0, None)],
                [(ticket, "maybe", 0, Attempt(T0))], [(ticket, "ok", -1, Attempt(T0))],
                [(ticket, "ok", 0, Attempt(T0, error=b"bytes"))],  # type: ignore[arg-type]
                [(ticket, "ok", 0, Attempt(T0)), ({**ticket, "qty": -1}, "ok", 0, Attempt(T0))]):
        with pytest.raises(ValueError):
            store.finish_jobs(db, bad, T0 + 1)
        assert (rows(db), rows(db, "attempts")) == before


def test_extend_uses_the_whole_marker_and_the_product_lease(db):
    store.enqueue_events(db, [body_event("e1")], T0)
    ticket = claim_one(db, lease=1000)
    renewed = store.extend_lease(db, ticket, T0 + 500, 3_600_000)
    assert isinstance(renewed, dict) and renewed["lease_until"] == T0 + 500 + 3_600_000
    assert store.extend_lease(db, ticket, T0 + 600, 1000) is False  # the old marker
    with pytest.raises(ValueError):
        store.extend_lease(db, renewed, T0 + 700, PRODUCT.max_lease_ms + 1)


# ----------------------------------------------------------------- the operator


def make_dead(db, *ids: str) -> None:
    store.enqueue_events(db, [body_event(i) for i in ids], T0, RetryPolicy(ttl_ms=10))
    store.claim_jobs(db, "d1", T0 + 10, 1000)  # the quarantine: all dead/deadline


def test_redrive_with_product_ids_notes_and_budgets(db):
    make_dead(db, "order:1", "order:2")
    results = store.redrive_jobs(db, ["order:1", "order:2", "order:1", "nope"], T0 + 20,
                                 5 * 86_400_000, "receiver fixed, see ticket #42")
    assert results[:2] == [True, True]
    assert [str(r) for r in results[2:]] == ["job 'order:1' is pending, not dead",
                                             "job 'nope' does not exist"]
    assert rows(db)[0]["deadline"] == T0 + 20 + 5 * 86_400_000
    assert [r["note"] for r in rows(db, "redrives")] == ["receiver fixed, see ticket #42"] * 2
    with pytest.raises(ValueError, match="note"):
        store.redrive_jobs(db, ["order:1"], T0, 1000, "line\nbreak")


def test_cancel_pending_or_dead_with_an_audit_row(db):
    make_dead(db, "dead-1")
    store.enqueue_events(db, [body_event("pending-1"), body_event("leased-1"),
                              body_event("done-1")], T0 + 20)
    jobs, _ = store.claim_jobs(db, "d1", T0 + 20, 30_000, 3)
    leased = {job.ticket["id"]: job.ticket for job in jobs}
    store.finish_jobs(db, [(leased["done-1"], "ok", 0, Attempt(T0 + 20))], T0 + 21)
    # put pending-1 back to pending: its lease runs out and nobody reclaims it yet
    store.finish_jobs(db, [(leased["pending-1"], "retry", 10**6, Attempt(T0 + 20))], T0 + 21)
    results = store.cancel_jobs(db, ["dead-1", "pending-1", "leased-1", "done-1", "dead-1",
                                     "ghost"], T0 + 30, "customer withdrew the order")
    assert results[:2] == [True, True]
    assert [str(r) for r in results[2:]] == [
        "job 'leased-1' is leased: only a pending or dead job can be cancelled",
        "job 'done-1' is done: only a pending or dead job can be cancelled",
        "job 'dead-1' is already cancelled", "job 'ghost' does not exist"]
    by_id = {r["id"]: r for r in rows(db)}
    assert (by_id["dead-1"]["status"], by_id["dead-1"]["reason"]) == ("dead", "cancelled")
    assert (by_id["pending-1"]["status"], by_id["pending-1"]["reason"]) == ("dead", "cancelled")
    assert [(c["id"], c["was"]) for c in rows(db, "cancels")] == [
        ("dead-1", "dead/deadline"), ("pending-1", "pending/retry")]
    assert store.redrive_jobs(db, ["pending-1"], T0 + 40, 1000, "reopened") == [True]
    history = observe.job_history(db, "pending-1")
    assert [c["note"] for c in history["cancels"]] == ["customer withdrew the order"]
    assert observe.snapshot(db, T0 + 50)["cancels"] == 2


@pytest.mark.parametrize("point", ["after-audit", "after-cancel", "after-commit"])
def test_cancel_is_atomic_with_its_audit_row(db, point):
    make_dead(db, "a", "b")
    before = (rows(db), rows(db, "cancels"))

    def fault(where: str) -> None:
        if where == point:
            raise KeyError(where)

    with pytest.raises(KeyError):
        store.cancel_jobs(db, ["a", "b"], T0 + 20, "n", fault=fault)
    if point == "after-commit":
        assert len(rows(db, "cancels")) == 2
    else:
        assert (rows(db), rows(db, "cancels")) == before


def test_prune_removes_only_old_done_jobs_with_their_evidence(db):
    store.enqueue_events(db, [body_event(f"j{n}") for n in range(5)], T0)
    jobs, _ = store.claim_jobs(db, "d1", T0, 30_000, 5)
    items = [(job.ticket, "ok", 0, Attempt(T0)) for job in jobs[:3]]
    items.append((jobs[3].ticket, "permanent", 0, Attempt(T0)))
    store.finish_jobs(db, items[:2], T0 + 10)  # j0, j1 done at T0+10
    store.finish_jobs(db, items[2:], T0 + 500)  # j2 done and j3 dead at T0+500; j4 leased
    assert store.prune_done(db, T0 + 11, limit=1) == 1
    assert store.prune_done(db, T0 + 11) == 1
    assert store.prune_done(db, T0 + 11) == 0
    assert sorted(r["id"] for r in rows(db)) == ["j2", "j3", "j4"]
    assert {r["id"] for r in rows(db, "attempts")} == {"j3"}  # j2's attempt is on its row
    assert [r["done_by"] for r in rows(db) if r["id"] == "j2"] == ["d1"]
    # an id whose job was pruned is new again
    assert store.enqueue_events(db, [body_event("j0", again=True)], T0 + 600) == [True]


def test_prune_leaves_dead_and_live_jobs(db):
    make_dead(db, "d")
    store.enqueue_events(db, [body_event("p")], T0)
    assert store.prune_done(db, worker.MAX_NOW_MS) == 0
    assert len(rows(db)) == 2


def test_prune_keeps_a_job_that_finished_exactly_at_the_cutoff(db):
    store.enqueue_events(db, [body_event("edge")], T0)
    ticket = claim_one(db)
    store.finish_jobs(db, [(ticket, "ok", 0, Attempt(T0))], T0 + 100)
    assert store.prune_done(db, T0 + 100) == 0  # "before the cutoff": strictly
    assert store.prune_done(db, T0 + 101) == 1


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
