"""What only the PostgreSQL store has to prove: many writers at once on one
real server (processes, connections, forced interleavings), the server's
clock, migrations between hosts, the claim's plan, the wake-ups and the
mapping of the server's errors. The rules both stores share are the
conformance suite's (tests/conformance)."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any, Generic, TypeVar

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncworker.devtools.postgres_server import database_of, free_port
from lease.endpoints import Endpoint
from lease.policy import PRODUCT, RetryPolicy
from lease.postgres import CHANNEL, SCHEMA_VERSION, PostgresStore, enqueue_in, redact
from lease.postgres.schema import DUE_SINCE, FLIGHT_SINCE, MIGRATIONS, PRIORITY_SINCE
from lease.postgres.statements import (
    FINISH_IF_STILL_LEASED,
    LOCK_KEYS_OF,
    PICK_AND_LEASE,
    QUARANTINE,
    array_text,
)
from lease.records import Attempt, Busy, Claimed, NotAQueue, StoreError
from lease.retrying import PATIENT
from lease.rules import WORKER_BEAT_MS
from lease.stores import open_store
from tests.support.queues import T0
from tests.support.waiting import WAIT_S, wait_until

T = TypeVar("T")

LEASE_MS = 60_000


def ev(job_id: str, qty: int = 1) -> dict:
    return {"id": job_id, "qty": qty}


def seen(now: int = T0) -> Attempt:
    return Attempt(now, 1)


@pytest.fixture
def admin(postgres_url: str) -> Iterator[psycopg.Connection]:
    """A connection of the test's own on the queue's database."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def make_store(postgres_url: str) -> Iterator[Callable[..., PostgresStore]]:
    """PostgresStores on the test's database ("hosts"), all closed after it;
    the first one creates the queue."""
    opened: list[PostgresStore] = []

    def make(**options: Any) -> PostgresStore:
        store = PostgresStore(postgres_url, create=True, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def lock_waiters(admin: psycopg.Connection) -> int:
    """Sessions on this database waiting for a row lock."""
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'").fetchone()
    assert row is not None
    return int(row[0])


class Background(Generic[T]):
    """A call on a thread of its own: its result, or what it raised."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.result: T | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the test by value()
            self.error = exc

    def value(self) -> T:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the background call did not return"
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


# ------------------------------------------------------------------ races


def _claim_rounds(url: str, owners: list[str], rounds: int, barrier: Any, out: Any) -> None:
    """A dispatcher host: one store, a connection per owner, every owner
    claiming at the barrier, round after round (the parent enqueues between)."""
    with PostgresStore(url, threads=len(owners)) as store:

        def claimer(owner: str) -> None:
            for _ in range(rounds):
                barrier.wait()
                claimed = store.claim_jobs(owner, LEASE_MS, 15)
                out.put([job.ticket for job in claimed.leased])

        threads = [threading.Thread(target=claimer, args=(owner,)) for owner in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def test_processes_and_connections_claiming_at_once_lease_each_job_once_per_round(
        postgres_url: str, make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    hosts, per_host, rounds, jobs = 3, 2, 12, 40
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(hosts * per_host + 1)
    out = spawn.Queue()
    children = [spawn.Process(target=_claim_rounds, args=(
        postgres_url, [f"h{h}t{t}" for t in range(per_host)], rounds, barrier, out))
        for h in range(hosts)]
    for child in children:
        child.start()
    try:
        for round_ in range(rounds):
            ids = [f"r{round_}-{n}" for n in range(jobs)]
            assert store.enqueue_events([ev(job_id) for job_id in ids]) == [True] * jobs
            barrier.wait(timeout=60)
            tickets = [t for _ in range(hosts * per_host) for t in out.get(timeout=60)]
            leased = sorted(t["id"] for t in tickets)
            assert leased == sorted(ids), f"round {round_}: each job leased exactly once"
            assert {t["token"] for t in tickets} == {1}
            results = store.finish_jobs([(t, "ok", 0, seen()) for t in tickets])
            assert results == [("done", None)] * jobs
        for child in children:
            child.join(timeout=60)
            assert child.exitcode == 0, f"a claiming host failed ({child.exitcode})"
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    assert store.counts() == {"pending": 0, "leased": 0, "done": rounds * jobs, "dead": 0}


def test_a_stale_finish_waiting_on_a_reclaim_never_wins(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """The re-claim holds the row (its hook runs before COMMIT) while the old
    owner's finish, judged by a clock that still sees its lease, waits for
    it: the finish reads the re-claimed row and is stale."""
    first, second = make_store(), make_store()
    for n in range(20):
        job_id = f"j{n}"
        first.enqueue_events([ev(job_id)], now_ms=T0)
        [old] = first.claim_jobs("a", 1000, now_ms=T0).leased
        finish: list[Background] = []

        def race(point: str, finish: list = finish, ticket: dict = old.ticket) -> None:
            if point == "after-claim":
                finish.append(Background(lambda: first.finish_jobs(
                    [(ticket, "ok", 0, seen())], now_ms=T0 + 999)))
                wait_until(lambda: lock_waiters(admin) == 1, "the finish waits for the row")

        [new] = second.claim_jobs("b", 1000, now_ms=T0 + 1000, fault=race).leased
        assert finish[0].value() == [False]
        assert (new.ticket["id"], new.ticket["token"]) == (job_id, 2)
        assert second.finish_jobs([(new.ticket, "ok", 0, seen())], now_ms=T0 + 1001) == [
            ("done", None)]
        history = second.job_history(job_id)
        assert history is not None
        assert [(a["owner"], a["result"]) for a in history["attempts"]] == [
            ("a", "stale"), ("b", "done")]
    assert first.stale_finishes() == 20


def test_a_reclaim_racing_a_finish_in_flight_skips_the_row(
        make_store: Callable[..., PostgresStore]) -> None:
    """The finish holds the row (its hook runs before COMMIT) while another
    host, whose clock says the lease is over, claims: SKIP LOCKED passes the
    row by, never waiting, and the finish commits done."""
    first, second = make_store(), make_store()
    for n in range(20):
        job_id = f"j{n}"
        first.enqueue_events([ev(job_id)], now_ms=T0)
        [old] = first.claim_jobs("a", 1000, now_ms=T0).leased
        claims: list[Claimed] = []

        def race(point: str, claims: list = claims) -> None:
            if point == "after-finish":
                claims.append(Background(lambda: second.claim_jobs(
                    "b", 1000, now_ms=T0 + 1000)).value())

        assert first.finish_jobs([(old.ticket, "ok", 0, seen())], now_ms=T0 + 999,
                                 fault=race) == [("done", None)]
        [claimed] = claims
        assert claimed.leased == [] and claimed.moved == {"deadline": 0, "exhausted": 0}
        assert second.claim_jobs("b", 1000, now_ms=T0 + 1000).leased == []


def test_a_finish_and_a_reclaim_at_once_exactly_one_wins(
        make_store: Callable[..., PostgresStore]) -> None:
    """Unforced: both on their own connections, released by a barrier, many
    times; either the finish is done and nothing is claimed, or the job is
    re-leased and the finish is stale; never both, never neither."""
    first, second = make_store(), make_store()
    barrier = threading.Barrier(2)
    for n in range(60):
        first.enqueue_events([ev(f"j{n}")], now_ms=T0)
        [old] = first.claim_jobs("a", 1000, now_ms=T0).leased

        def finish(ticket: dict = old.ticket) -> list:
            barrier.wait(WAIT_S)
            return first.finish_jobs([(ticket, "ok", 0, seen())], now_ms=T0 + 999)

        def claim() -> Claimed:
            barrier.wait(WAIT_S)
            return second.claim_jobs("b", 1000, now_ms=T0 + 1000)

        finishing, claiming = Background(finish), Background(claim)
        [finished], claimed = finishing.value(), claiming.value()
        won = (finished == ("done", None), bool(claimed.leased))
        assert won in ((True, False), (False, True)), won
        if won[1]:
            [new] = claimed.leased
            second.finish_jobs([(new.ticket, "ok", 0, seen())], now_ms=T0 + 1001)
    assert first.counts()["done"] == 60


class PausedBeforePick(PostgresStore):
    """The PostgreSQL store whose claims, once their quarantine has run on the
    server, call ``pause`` before their pick is sent."""

    def __init__(self, url: str, pause: Callable[[], None]) -> None:
        super().__init__(url)
        self.pause = pause

    def _before_pick(self, pipeline: psycopg.Pipeline) -> None:
        pipeline.sync()  # the quarantine's statements have run, the pick is not sent
        self.pause()


@pytest.mark.parametrize(("max_attempts", "attempts", "ttl_ms", "reason"), [
    (1, 1, LEASE_MS, "exhausted"),
    (PRODUCT.max_attempts, PRODUCT.max_attempts, LEASE_MS, "exhausted"),
    (3, 1, 1000, "deadline")], ids=["budget", "budget-at-the-cap", "deadline"])
def test_a_row_the_quarantine_skipped_is_not_leased_by_the_pick_after_its_lock_ends(
        make_store: Callable[..., PostgresStore], postgres_url: str, max_attempts: int,
        attempts: int, ttl_ms: int, reason: str) -> None:
    """A stale finish in a group holds the job's row (the group's hook runs
    before COMMIT) while another host's claim runs its quarantine, which
    skips the locked row; the finish commits before the claim's pick. The
    pick, on a snapshot of its own, must not lease the job past its budget
    (attempt max + 1: at the cap, a ticket no finish accepts) or past its
    deadline (a lease that ends before it begins): the next claim quarantines
    it."""
    first = make_store()
    first.enqueue_events([ev("doomed")], RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl_ms),
                         now_ms=T0)
    first.enqueue_events([ev("other")], RetryPolicy(ttl_ms=LEASE_MS), now_ms=T0)
    for attempt in range(1, attempts):  # each of these leases runs out at once
        assert claim_one(first, "a", T0 + attempt - 1, 1)["id"] == "doomed"
    doomed = claim_one(first, "a", T0 + attempts - 1, 500)
    assert (doomed["id"], doomed["attempt"]) == ("doomed", attempts)
    other = claim_one(first, "a", T0 + attempts - 1, LEASE_MS)
    now = T0 + 1000  # the doomed job's lease is over; in the deadline case its deadline too
    holding, release = threading.Event(), threading.Event()

    def hold(point: str) -> None:
        if point == "after-finish":
            holding.set()
            assert release.wait(WAIT_S), "never released"

    finishing = Background(lambda: first.finish_jobs(
        [(other, "ok", 0, seen()), (doomed, "ok", 0, seen())], now_ms=now, fault=hold))
    assert holding.wait(WAIT_S), "the finish never held the rows"

    def let_the_finish_commit() -> None:
        release.set()
        assert finishing.value() == [("done", None), False]

    with closing(PausedBeforePick(postgres_url, let_the_finish_commit)) as second:
        claimed = second.claim_jobs("b", LEASE_MS, 10, now_ms=now)
    # (attempt, lease_until - now) of each job leased: none
    assert [(job.ticket["attempt"], job.ticket["lease_until"] - now)
            for job in claimed.leased] == []
    assert claimed.moved == {"deadline": 0, "exhausted": 0}  # the quarantine skipped it
    row = job_row(first, "doomed")
    assert (row["status"], row["attempts"], row["owner"]) == ("leased", attempts, "a")
    assert first.claim_jobs("c", LEASE_MS, 10, now_ms=now).moved == {
        "deadline": 0, "exhausted": 0, reason: 1}
    row = job_row(first, "doomed")
    assert (row["status"], row["reason"], row["attempts"]) == ("dead", reason, attempts)


def claim_one(store: PostgresStore, owner: str, now_ms: int, lease_ms: int) -> dict:
    [leased] = store.claim_jobs(owner, lease_ms, now_ms=now_ms).leased
    return leased.ticket


def job_row(store: PostgresStore, job_id: str) -> dict:
    found = store.job_history(job_id)
    assert found is not None
    return dict(found["job"])


# ------------------------------------------------------------------ the clock


def server_ms(admin: psycopg.Connection) -> int:
    row = admin.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
                        ).fetchone()
    assert row is not None
    return int(row[0])


def test_without_a_clock_leases_are_judged_by_the_server(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    store = make_store()
    assert store.enqueue_events([ev("a")]) == [True]
    before = server_ms(admin)
    claimed = store.claim_jobs("w", 300)
    after = server_ms(admin)
    assert before <= claimed.now_ms <= after
    [job] = claimed.leased
    assert job.ticket["lease_until"] == claimed.now_ms + 300
    assert store.claim_jobs("x", 300).leased == []  # live by the server's clock
    wait_until(lambda: store.now_ms() > job.ticket["lease_until"], "the lease ends")
    [again] = store.claim_jobs("x", 300).leased
    assert (again.ticket["owner"], again.ticket["token"]) == ("x", 2)
    assert store.finish_jobs([(job.ticket, "ok", 0, seen(claimed.now_ms))]) == [False]


def test_hosts_with_skewed_clocks_share_jobs_on_the_server_clock(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """Two hosts whose own clocks are ten minutes apart: judged by their own
    clocks the fast one steals a live lease; by the server's, neither can."""
    skew = 10 * 60_000
    slow = make_store(clock=lambda: server_ms(admin) - skew)
    fast = make_store(clock=lambda: server_ms(admin) + skew)
    slow.enqueue_events([ev("stolen")])
    [held] = slow.claim_jobs("slow", 60_000).leased
    [stolen] = fast.claim_jobs("fast", 60_000).leased  # its clock says the lease is over
    assert stolen.ticket["token"] == held.ticket["token"] + 1

    on_slow, on_fast = make_store(), make_store()  # the same hosts, the server's clock
    on_slow.enqueue_events([ev("kept")])
    [kept] = on_slow.claim_jobs("slow", 60_000).leased
    assert on_fast.claim_jobs("fast", 60_000).leased == []
    assert on_slow.finish_jobs([(kept.ticket, "ok", 0, seen())]) == [("done", None)]


# ------------------------------------------------------------------ migrations


def tables(admin: psycopg.Connection) -> list[str]:
    return [f"{schema}.{name}" for schema, name in admin.execute(
        "SELECT table_schema, table_name FROM information_schema.tables"
        " WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        " ORDER BY table_schema, table_name")]


ALL_VERSIONS = list(range(1, SCHEMA_VERSION + 1))


def migrations(admin: psycopg.Connection) -> list[int]:
    return [v for (v,) in admin.execute(
        "SELECT version FROM lease.schema_migrations ORDER BY version")]


def test_a_fresh_database_is_made_a_queue_once_and_reopened_as_it_is(
        postgres_url: str, admin: psycopg.Connection) -> None:
    admin.execute("CREATE TABLE public.jobs (id int)")  # the service's own: no collision
    with PostgresStore(postgres_url, create=True) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert store.enqueue_events([ev("a")], now_ms=T0) == [True]
    assert tables(admin) == ["lease.attempts", "lease.cancels", "lease.endpoint_audit",
                             "lease.endpoints", "lease.jobs", "lease.minutes", "lease.pause",
                             "lease.queue_audit", "lease.redrives",
                             "lease.schema_migrations", "lease.tallies", "lease.workers",
                             "public.jobs"]
    for create in (True, False):
        with PostgresStore(postgres_url, create=create) as store:
            assert store.counts()["pending"] == 1
    assert migrations(admin) == ALL_VERSIONS


def _old_queue(admin: psycopg.Connection, version: int) -> None:
    """Inside a transaction: the queue's schema as the code of ``version`` left
    it, its migrations recorded, no rows."""
    admin.execute("CREATE SCHEMA lease")
    admin.execute("CREATE TABLE lease.schema_migrations (version integer PRIMARY KEY,"
                  " applied_at timestamptz NOT NULL DEFAULT now())")
    for applied in range(1, version + 1):
        for statement in MIGRATIONS[applied]:
            admin.execute(statement)
        admin.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)", (applied,))


def test_a_version_1_queue_is_read_as_it_is_and_migrated_by_a_writer(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():  # a queue as the first version made it
        _old_queue(admin, 1)
        admin.execute("INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,"
                      " available_at, deadline, reason) VALUES ('old', 1, 'dead', 1, 1, 1, 5, 9,"
                      " 'exhausted')")
        admin.execute("INSERT INTO lease.redrives (id, token, at_ms, note) VALUES"
                      " ('old', 1, 3, 'then')")
    with PostgresStore(postgres_url, read_only=True) as looking:
        assert looking.schema_version() == 1
        history = looking.job_history("old")
        assert history is not None
        assert history["redrives"] == [{"seq": 1, "token": 1, "at_ms": 3, "note": "then"}]
    assert migrations(admin) == [1]
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert store.redrive_jobs(["old"], 60_000, "now", now_ms=T0, actor="ops") == [True]
        history = store.job_history("old")
        assert history is not None
        assert [(r["note"], r["actor"]) for r in history["redrives"]] == [
            ("then", None), ("now", "ops")]
    assert migrations(admin) == ALL_VERSIONS


def test_a_version_4_queue_gains_the_console_and_trace_with_its_rows_kept(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():
        _old_queue(admin, 4)
        admin.execute("INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,"
                      " available_at, deadline) VALUES ('old', 1, 'pending', 0, 3, 0, 5, %s)",
                      (T0 + 60_000,))
    with PostgresStore(postgres_url, read_only=True) as looking:  # read as it is
        assert looking.schema_version() == 4
        assert looking.paused() is None and looking.queue_audit() == []
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert admin.execute("SELECT id, trace FROM lease.jobs").fetchall() == [("old", None)]
        assert store.pause("hold", now_ms=T0) is True
        assert store.claim_jobs("w", 1000, 10, now_ms=T0).leased == []
    assert migrations(admin) == ALL_VERSIONS


def test_a_version_6_queue_gains_priorities_its_jobs_at_0(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():
        _old_queue(admin, PRIORITY_SINCE - 1)
        admin.execute("INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,"
                      " available_at, deadline) VALUES ('old', 1, 'pending', 0, 3, 0, 5, %s)",
                      (T0 + 60_000,))
    with PostgresStore(postgres_url, read_only=True) as looking:  # read as it is
        assert looking.schema_version() == PRIORITY_SINCE - 1
        assert "priority" not in looking.list_jobs()[0]
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert [(r["id"], r["priority"]) for r in store.list_jobs()] == [("old", 0)]
        indexes = dict(admin.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'lease'"
            " AND indexname IN ('jobs_own_due', 'jobs_endpoint_due')").fetchall())
        assert "(priority DESC, seq)" in indexes["jobs_own_due"]
        assert "(endpoint, priority DESC, available_at, seq)" in indexes["jobs_endpoint_due"]
        assert store.enqueue_events([{"id": "urgent", "qty": 1, "priority": 3}],
                                    now_ms=T0) == [True]
        claimed = store.claim_jobs("w", 1000, 10, now_ms=T0)
        assert [j.ticket["id"] for j in claimed.leased] == ["urgent", "old"]
    with PostgresStore(postgres_url) as again:  # migrated once: nothing more to do
        assert again.schema_version() == SCHEMA_VERSION
    assert migrations(admin) == ALL_VERSIONS


def test_a_version_7_queue_claims_its_due_jobs_and_run_out_leases_by_their_indexes(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():
        _old_queue(admin, DUE_SINCE - 1)
        admin.execute("""INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,
  available_at, deadline, owner, lease_until, priority, ordering_key) VALUES
  ('due', 1, 'pending', 0, 3, 0, 5, %(end)s, NULL, NULL, 0, NULL),
  ('urgent', 1, 'pending', 0, 3, 0, 5, %(end)s, NULL, NULL, 2, 'k'),
  ('run-out', 1, 'leased', 1, 3, 1, 5, %(end)s, 'gone', %(t0)s, 0, NULL),
  ('live', 1, 'leased', 1, 3, 1, 5, %(end)s, 'busy', %(later)s, 0, NULL)""",
                      {"end": T0 + 600_000, "t0": T0, "later": T0 + 60_000})
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION > DUE_SINCE
        indexes = {name for (name,) in admin.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'lease'")}
        assert {"jobs_own_due", "jobs_keyed"} <= indexes and "jobs_ready" not in indexes
        claimed = store.claim_jobs("w", 1000, 10, now_ms=T0 + 1)
        assert [job.ticket["id"] for job in claimed.leased] == ["urgent", "due", "run-out"]
        assert store.finish_jobs([(job.ticket, "ok", 0, Attempt(T0 + 1))
                                  for job in claimed.leased], now_ms=T0 + 2) == [
            ("done", None)] * 3
        assert [job["id"] for job in store.jobs_with_status("leased")] == ["live"]
    assert migrations(admin) == ALL_VERSIONS


def test_a_version_8_queue_reads_an_endpoint_s_leases_in_the_claim_s_order(
        postgres_url: str, admin: psycopg.Connection) -> None:
    """Version 9 rebuilds jobs_in_flight with seq after the lease end (the
    plan test of tests/postgres/test_postgres_endpoints.py says a claim then
    reads it unsorted): a version 8 queue is migrated, and of deliveries
    leased together (one lease end) and run out, a claim takes the first in
    seq order."""
    with admin.transaction():
        _old_queue(admin, FLIGHT_SINCE - 1)
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION >= FLIGHT_SINCE
        row = admin.execute("SELECT indexdef FROM pg_indexes WHERE schemaname = 'lease'"
                            " AND indexname = 'jobs_in_flight'").fetchone()
        assert row is not None and "(endpoint, lease_until, seq)" in row[0]
        store.add_endpoint(Endpoint("e", "http://127.0.0.1:9/hook", types=("t",)), now_ms=T0)
        assert all(store.enqueue_events([{"id": f"m{n}", "qty": 1, "type": "t"}
                                         for n in range(6)], now_ms=T0))
        gone = store.claim_jobs("gone", 1, 6, now_ms=T0, endpoints="*").leased
        assert len({job.ticket["lease_until"] for job in gone}) == 1
        again = store.claim_jobs("w", 1000, 4, now_ms=T0 + 5, endpoints="*").leased
        assert [job.message for job in again] == ["m0", "m1", "m2", "m3"]
    assert migrations(admin) == ALL_VERSIONS


def test_a_version_2_queue_migrates_to_ordered_keys_and_a_newer_one_is_refused(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():  # a queue as the second version made it
        _old_queue(admin, 2)
        admin.execute("INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,"
                      " available_at, deadline) VALUES ('old', 1, 'pending', 0, 3, 0, 5, %s)",
                      (T0 + 60_000,))
    with PostgresStore(postgres_url, read_only=True) as looking:
        assert looking.schema_version() == 2
        assert "blocked_keys" not in looking.snapshot(now_ms=T0)  # read as it is
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION == 9
        [old] = store.jobs_with_status("pending")
        assert (old["ordering_key"], old["held"]) == (None, 0)
        assert store.enqueue_events([{"id": "new", "qty": 1, "key": "k"}], now_ms=T0) == [True]
        claimed = store.claim_jobs("w", 1000, 10, now_ms=T0)
        assert [j.ticket["id"] for j in claimed.leased] == ["old", "new"]
        assert store.snapshot(now_ms=T0)["blocked_keys"] == 0
    assert migrations(admin) == ALL_VERSIONS
    admin.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)",
                  (SCHEMA_VERSION + 1,))
    with pytest.raises(NotAQueue, match="newer"):
        PostgresStore(postgres_url)


def test_two_hosts_creating_the_queue_at_once_migrate_it_once(postgres_url: str,
                                                              admin: psycopg.Connection) -> None:
    for _ in range(5):
        admin.execute("DROP SCHEMA IF EXISTS lease CASCADE")
        barrier = threading.Barrier(3)

        def create(barrier: threading.Barrier = barrier) -> object:
            barrier.wait(WAIT_S)
            with PostgresStore(postgres_url, create=True) as store:
                return store.schema_version()

        hosts = [Background(create) for _ in range(3)]
        assert [host.value() for host in hosts] == [SCHEMA_VERSION] * 3
        assert migrations(admin) == ALL_VERSIONS


def test_a_database_without_a_queue_is_refused_and_left_as_it_is(
        postgres_url: str, admin: psycopg.Connection) -> None:
    name = database_of(postgres_url)
    cases: list[dict[str, Any]] = [{}, {"read_only": True}, {"read_only": True, "create": True}]
    for options in cases:
        with pytest.raises(NotAQueue, match=f"no queue in .*{name}: asyncworker init "):
            PostgresStore(postgres_url, **options)
    with pytest.raises(NotAQueue, match="asyncworker init"):
        open_store(postgres_url)
    assert tables(admin) == []


def test_a_newer_or_foreign_schema_is_refused_untouched(postgres_url: str,
                                                        admin: psycopg.Connection) -> None:
    PostgresStore(postgres_url, create=True).close()
    admin.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)",
                  (SCHEMA_VERSION + 1,))
    before = tables(admin)
    cases: list[dict[str, Any]] = [{"create": True}, {"read_only": True}]
    for options in cases:
        with pytest.raises(NotAQueue, match=f"version {SCHEMA_VERSION + 1}, newer than"):
            PostgresStore(postgres_url, **options)
    assert tables(admin) == before and migrations(admin) == [*ALL_VERSIONS, SCHEMA_VERSION + 1]

    admin.execute("DROP SCHEMA lease CASCADE")
    admin.execute("CREATE SCHEMA lease")
    admin.execute("CREATE TABLE lease.jobs (id text)")  # somebody else's
    with pytest.raises(NotAQueue, match="holds other tables in schema lease"):
        PostgresStore(postgres_url, create=True)
    assert tables(admin) == ["lease.jobs"]


def test_a_read_only_store_writes_nothing(postgres_url: str, admin: psycopg.Connection) -> None:
    with PostgresStore(postgres_url, create=True) as store:
        store.enqueue_events([ev("a")], now_ms=T0)
    with PostgresStore(postgres_url, read_only=True) as looking:
        assert looking.counts()["pending"] == 1
        assert looking.snapshot(now_ms=T0)["jobs"] == 1
        with pytest.raises(StoreError, match="read-only transaction"):
            looking.claim_jobs("w", 1000, now_ms=T0)
        with pytest.raises(StoreError, match="read-only transaction"):
            looking.enqueue_events([ev("b")], now_ms=T0)
    row = admin.execute("SELECT count(*), max(token) FROM lease.jobs").fetchone()
    assert row == (1, 0)


# ------------------------------------------------------------------ the claim's cost


def plan(admin: psycopg.Connection, statement: str, args: dict) -> dict:
    """EXPLAIN ANALYZE of a statement, run and rolled back."""
    with admin.transaction(force_rollback=True):
        row = admin.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}",
                            args).fetchone()
    assert row is not None
    found = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return dict(found[0]["Plan"])


def nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def ctes(top: dict, *names: str) -> list[dict]:
    """The plan's nodes of these CTEs, in that order."""
    found = {n["Subplan Name"]: n for n in nodes(top) if "Subplan Name" in n}
    return [found[f"CTE {name}"] for name in names]


def test_the_claim_reads_the_partial_indexes_however_many_jobs_are_done(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    store = make_store()
    args = {"now": T0 + 10, "limit": 10, "owner": "w", "lease_ms": 1000,
            "beat": WORKER_BEAT_MS}
    store.enqueue_events([ev(f"live{n}") for n in range(20)], now_ms=T0)
    small = plan(admin, PICK_AND_LEASE, args)
    admin.execute("""INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,
  available_at, deadline) SELECT 'done' || g, 1, 'done', 1, 3, 1, %s, %s
  FROM generate_series(1, 100000) g""", (T0, T0 + 60_000))
    admin.execute("ANALYZE lease.jobs")
    big = plan(admin, PICK_AND_LEASE, args)
    # the UPDATE finds its rows by their primary key; of a queue of 20 rows
    # with no statistics yet, the planner may read the whole table instead
    assert read_only_partial_indexes(big), [(n.get("Index Name"), n["Node Type"])
                                            for n in nodes(big)]
    for top in (small, big):
        [pick] = ctes(top, "picked")
        assert pick["Actual Rows"] == 10
        # the pick reads a few pages of the live rows, not the 100,000 done ones
        for part in ctes(top, "due", "run_out"):
            assert read_only_partial_indexes(part), part
            assert part["Shared Hit Blocks"] + part.get("Shared Read Blocks", 0) <= 50, part
    # with 20 live rows a sort of them all may cost less than the claim's order
    # by jobs_own_due (the priority's statistics know no physical order): a
    # partial index of the live rows either way, never the done ones
    assert {"jobs_own_due", "jobs_live"} & {n.get("Index Name") for n in nodes(big)}
    for _, statement in QUARANTINE:
        assert read_only_partial_indexes(plan(admin, statement, args))


def test_the_claim_takes_its_batch_in_priority_order_by_one_index_scan(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """Thousands ready, of three priorities: the pick reads its batch in the
    order it takes it (jobs_own_due), nothing sorted, a few pages read; of
    the leases run out (none) it reads nothing."""
    store = make_store()
    store.enqueue_events([{"id": f"j{n}", "qty": 1, "priority": n % 3} for n in range(3000)],
                         now_ms=T0)
    admin.execute("ANALYZE lease.jobs")
    top = plan(admin, PICK_AND_LEASE, {"now": T0 + 10, "limit": 10, "owner": "w",
                                       "lease_ms": 1000, "beat": WORKER_BEAT_MS})
    pick, due, run_out = ctes(top, "picked", "due", "run_out")
    assert pick["Actual Rows"] == due["Actual Rows"] == 10
    assert "jobs_own_due" in {n.get("Index Name") for n in nodes(due)}
    assert not [n for n in nodes(due) if n["Node Type"] == "Sort"], due
    assert due["Shared Hit Blocks"] + due.get("Shared Read Blocks", 0) <= 50, due
    assert run_out["Actual Rows"] == 0


def test_the_claim_passes_over_no_live_lease(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """512 live leases at the front of the queue (its oldest jobs): the pick
    reads its 10 due jobs and no lease, neither from the due jobs' index nor
    from the leases' (whose live ones end after the claim's time). A pick of
    the due jobs and the leases run out by one index of both read every live
    lease first, a heap fetch each, on every claim."""
    store = make_store()
    store.enqueue_events([ev(f"j{n}") for n in range(600)], now_ms=T0)
    for _ in range(8):
        assert len(store.claim_jobs("holder", LEASE_MS, 64, now_ms=T0).leased) == 64
    admin.execute("VACUUM ANALYZE lease.jobs")
    top = plan(admin, PICK_AND_LEASE, {"now": T0 + 10, "limit": 10, "owner": "w",
                                       "lease_ms": 1000, "beat": WORKER_BEAT_MS})
    due, run_out = ctes(top, "due", "run_out")
    assert due["Actual Rows"] == 10 and run_out["Actual Rows"] == 0
    passed_over = [n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0)
                   for part in (due, run_out) for n in nodes(part)]
    assert sum(passed_over) == 0, top


PARTIAL = {"jobs_live", "jobs_live_deadline", "jobs_leased_until", "jobs_pending_spent",
           "jobs_own_due"}


def read_only_partial_indexes(top: dict) -> bool:
    """No scan of the whole table: rows found through the partial indexes, and
    the row to update by its primary key."""
    kinds = {n["Node Type"] for n in nodes(top)}
    indexes = {n["Index Name"] for n in nodes(top) if "Index Name" in n}
    return "Seq Scan" not in kinds and indexes <= PARTIAL | {"jobs_pkey"} and bool(
        indexes & PARTIAL)


def test_a_finish_finds_its_rows_by_key_however_many_leases_are_live(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    store = make_store()
    store.enqueue_events([ev(f"j{n}") for n in range(2000)], now_ms=T0)
    admin.execute("ANALYZE lease.jobs")  # statistics that saw no lease
    assert len(store.claim_jobs("holder", LEASE_MS, 1000, now_ms=T0).leased) == 1000
    mine = [job.ticket for job in store.claim_jobs("w", LEASE_MS, 10, now_ms=T0).leased]
    seqs = dict(admin.execute("SELECT id, seq FROM lease.jobs WHERE id = ANY(%s)",
                              ([ticket["id"] for ticket in mine],)).fetchall())
    top = plan(admin, FINISH_IF_STILL_LEASED, {
        "now": T0 + 1, "seq": [seqs[ticket["id"]] for ticket in mine],
        "status": ["done"] * 10, "reason": [None] * 10, "available_at": [T0 + 1] * 10,
        **{field: [ticket[key] for ticket in mine] for field, key in (
            ("qty", "qty"), ("owner", "owner"), ("token", "token"), ("attempt", "attempt"),
            ("lease_until", "lease_until"))},
        "started_ms": [T0] * 10, "latency_ms": [1] * 10, "http_status": [200] * 10})
    assert top["Actual Rows"] == 10  # each finished
    # each row by its key: never a scan of the 1,010 live leases, per item
    scans = [n for n in nodes(top) if n.get("Relation Name") == "jobs"
             and n["Node Type"] != "ModifyTable"]
    assert scans and all(n.get("Index Name") == "jobs_pkey" and n["Actual Rows"] <= 1
                         for n in scans), scans


def test_a_finish_looks_for_the_keys_of_keyed_jobs_only(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """The keys' locks of a finish of 200 jobs without a key (of 5,000) read
    the index of the keyed jobs (empty but for one), not the 200 jobs' every
    row version by id; a keyed job's key is found."""
    store = make_store()
    store.enqueue_events([{"id": "keyed", "qty": 1, "key": "k"}]
                         + [ev(f"j{n}") for n in range(5000)], now_ms=T0)
    claimed = store.claim_jobs("w", LEASE_MS, 201, now_ms=T0).leased
    store.finish_jobs([(job.ticket, "retry", 0, Attempt(T0)) for job in claimed], now_ms=T0)
    admin.execute("ANALYZE lease.jobs")
    ids = [f"j{n}" for n in range(200)]
    for wanted, found in ((ids, 0), ([*ids, "keyed"], 1)):
        top = plan(admin, LOCK_KEYS_OF.replace("%s::text[]", "%(ids)s::text[]"),
                   {"ids": array_text(sorted(wanted))})
        read = [n for n in nodes(top) if "Index Name" in n or n.get("Relation Name") == "jobs"]
        assert {n.get("Index Name") for n in read} == {"jobs_keyed"}, [
            (n.get("Index Name"), n["Node Type"]) for n in nodes(top)]
        assert read[0]["Actual Rows"] == found


def scans(conn: psycopg.Connection) -> tuple[int, int]:
    """The sequential scans of lease.jobs this backend counted, and the rows
    they read (pg_stat_xact_user_tables: its counts not yet reported)."""
    row = conn.execute("SELECT seq_scan, seq_tup_read FROM pg_stat_xact_user_tables"
                       " WHERE relid = 'lease.jobs'::regclass", prepare=False).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("endpoints", [0, 5])
def test_a_big_intake_finds_its_ids_by_key_whatever_its_statistics_and_plans(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection,
        endpoints: int) -> None:
    """Statistics of a queue of 20 jobs, every statement prepared at once and
    planned generically, the lookups' plans made by an intake of one event:
    then an intake of 1,500 events (a fan-out to 5 endpoints:
    7,500 deliveries) in three chunks looks its ids up through the indexes,
    never a scan of the table (each row compared with every id: rows x ids),
    and leaves the service's setting as it found it."""
    store = make_store()
    for n in range(endpoints):
        store.add_endpoint(Endpoint(f"ep{n}", "http://127.0.0.1:9/hook"))
    store.enqueue_events([ev(f"old{n}") for n in range(20)], now_ms=T0)
    admin.execute("ANALYZE lease.jobs")
    with psycopg.connect(admin.info.dsn) as conn:
        conn.prepare_threshold = 0
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.commit()
        with conn.transaction():  # the lookups' plans made, and kept, by a small intake
            assert enqueue_in(conn, [ev("first")], now_ms=T0) == [True]
        with conn.transaction():
            before = scans(conn)  # the backend's counts not yet reported, the small intake's
            assert enqueue_in(conn, [ev(f"new{n}") for n in range(1500)], now_ms=T0) \
                == [True] * 1500
            after = scans(conn)
            setting = conn.execute("SHOW enable_seqscan").fetchone()
    assert after == before
    assert setting == ("on",)
    assert store.counts()["pending"] == 1521 * max(1, endpoints)  # one delivery an endpoint


# ------------------------------------------------------------------ wake-ups


def listener_pids(admin: psycopg.Connection) -> list[int]:
    return [pid for (pid,) in admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND query = %s", (f"LISTEN {CHANNEL}",))]


def test_the_listener_wakes_on_new_work_and_times_out_without(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    with closing(store.listener()) as listener:
        began = time.monotonic()
        assert listener.wait(0.2) is False
        assert time.monotonic() - began >= 0.2
        for n in range(3):
            store.enqueue_events([ev(f"n{n}")], now_ms=T0)
        assert listener.wait(WAIT_S) is True
        more = 0
        while listener.wait(0.2):  # those already arrived were taken as one
            more += 1
        assert more <= 2  # never more wake-ups than notifications
        store.enqueue_events([ev("n0")], now_ms=T0)  # not new: nothing to wake for
        assert listener.wait(0.2) is False
        store.enqueue_events([ev("dies", 2)], now_ms=T0)
        listener.wait(WAIT_S)
        [job] = store.claim_jobs("w", 1000, now_ms=T0).leased
        store.finish_jobs([(job.ticket, "permanent", 0, seen())], now_ms=T0 + 1)
        assert listener.wait(0.2) is False
        assert store.redrive_jobs([job.ticket["id"]], 60_000, "again", now_ms=T0 + 2) == [True]
        assert listener.wait(WAIT_S) is True


def test_the_listener_reconnects_when_its_connection_is_terminated(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    store = make_store()
    with closing(store.listener()) as listener:
        [pid] = listener_pids(admin)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert listener.wait(WAIT_S) is True  # reconnected: poll once
        [again] = listener_pids(admin)
        assert again != pid
        store.enqueue_events([ev("a")], now_ms=T0)
        assert listener.wait(WAIT_S) is True


def test_the_listener_rides_out_a_server_restart(make_postgres_server: Callable[..., Any]
                                                 ) -> None:
    server = make_postgres_server()
    with PostgresStore(server.url, create=True) as store, closing(store.listener()) as listener:
        server.stop("fast")
        assert listener.wait(0.3) is False  # nothing to connect to: times out
        server.start()
        assert listener.wait(WAIT_S) is True
        PATIENT.call(lambda: store.enqueue_events([ev("a")], now_ms=T0))
        assert listener.wait(WAIT_S) is True


# ------------------------------------------------------------------ errors


@contextmanager
def row_locked(admin_url: str, job_id: str) -> Iterator[psycopg.Connection]:
    """Another session holding a job's row lock until the block ends."""
    with psycopg.connect(admin_url) as other:
        other.execute("SELECT 1 FROM lease.jobs WHERE id = %s FOR UPDATE", (job_id,))
        yield other


def test_a_lock_timeout_is_busy_and_changes_nothing(postgres_url: str,
                                                    admin: psycopg.Connection) -> None:
    with PostgresStore(postgres_url, create=True) as store:
        store.enqueue_events([ev("a")], now_ms=T0)
        [job] = store.claim_jobs("w", 1000, now_ms=T0).leased
    admin.execute(f"ALTER DATABASE {database_of(postgres_url)} SET lock_timeout = '50ms'")
    with PostgresStore(postgres_url) as store:
        with row_locked(postgres_url, "a"), pytest.raises(Busy, match="lock timeout"):
            store.finish_jobs([(job.ticket, "ok", 0, seen())], now_ms=T0 + 1)
        assert store.job_history("a")["attempts"] == []  # type: ignore[index]
        assert store.finish_jobs([(job.ticket, "ok", 0, seen())], now_ms=T0 + 1) == [
            ("done", None)]


def test_a_serialization_failure_is_busy(postgres_url: str, admin: psycopg.Connection) -> None:
    """At REPEATABLE READ (a server default some operators set), a row another
    session changed after the transaction's snapshot cannot be locked."""
    with PostgresStore(postgres_url, create=True) as store:
        store.enqueue_events([ev("a")], now_ms=T0)
        [job] = store.claim_jobs("w", 1000, now_ms=T0).leased
    admin.execute(f"ALTER DATABASE {database_of(postgres_url)}"
                  " SET default_transaction_isolation = 'repeatable read'")
    with PostgresStore(postgres_url) as store:
        with row_locked(postgres_url, "a") as other:
            extending = Background(lambda: store.extend_lease(job.ticket, 5000, now_ms=T0 + 1))
            wait_until(lambda: lock_waiters(admin) == 1, "the extension waits for the row")
            other.execute("UPDATE lease.jobs SET max_attempts = max_attempts WHERE id = 'a'")
            other.commit()
            with pytest.raises(Busy, match="could not serialize"):
                extending.value()
        assert PATIENT.call(lambda: store.extend_lease(job.ticket, 5000, now_ms=T0 + 1)) == {
            **job.ticket, "lease_until": T0 + 5001}


def test_a_terminated_backend_is_busy_and_the_next_call_works(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with PostgresStore(postgres_url, create=True) as store:
        store.enqueue_events([ev("a")], now_ms=T0)
        [job] = store.claim_jobs("w", 1000, now_ms=T0).leased
        with row_locked(postgres_url, "a"):
            finishing = Background(lambda: store.finish_jobs([(job.ticket, "ok", 0, seen())],
                                                             now_ms=T0 + 1))
            wait_until(lambda: lock_waiters(admin) == 1, "the finish waits for the row")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE datname = current_database() AND wait_event_type = 'Lock'")
            with pytest.raises(Busy, match="connection lost"):
                finishing.value()
        assert store.finish_jobs([(job.ticket, "ok", 0, seen())], now_ms=T0 + 1) == [
            ("done", None)]
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                      " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        assert PATIENT.call(store.counts)["done"] == 1  # the pool replaces its connection


def test_an_unreachable_server_is_a_clear_error_without_the_password() -> None:
    url = f"postgresql://who:s3cret@127.0.0.1:{free_port()}/q?password=s3cret"
    with pytest.raises(StoreError) as refused:
        PostgresStore(url)
    text = str(refused.value)
    assert "s3cret" not in text and "\n" not in text
    assert text.startswith("cannot connect to postgresql://who@127.0.0.1:"), text
    assert redact("postgres://u:p@h1:5,h2:6/db?sslmode=require&password=p") == (
        "postgres://u@h1:5,h2:6/db?sslmode=require")


def test_bad_arguments_are_refused_before_any_connection_is_used(
        make_store: Callable[..., PostgresStore]) -> None:
    with pytest.raises(ValueError, match="threads must be in 1..1000"):
        make_store(threads=0)
    store = make_store()
    with pytest.raises(ValueError, match="owner must be"):
        store.claim_jobs("no spaces", 1000)
    with pytest.raises(ValueError, match="timeout_s must be"), closing(store.listener()) as lis:
        lis.wait(float("nan"))


# ------------------------------------------------------------------ intake


def test_the_intake_streams_and_is_all_or_nothing(make_store: Callable[..., PostgresStore],
                                                  admin: psycopg.Connection) -> None:
    store = make_store()
    drawn = [0]
    progress: list[tuple[int, int]] = []

    def events(n: int, bad_at: int | None = None) -> Iterator[dict]:
        for i in range(n):
            drawn[0] += 1
            yield {"id": f"e{i}", "qty": 0 if i == bad_at else 1}

    with pytest.raises(ValueError, match="event qty must be in 1..1000"):
        store.enqueue_events(events(5000, bad_at=2345), now_ms=T0,
                             on_progress=lambda n: progress.append((n, drawn[0])))
    assert progress == [(1000, 1000), (2000, 2000)]  # read as it goes, never whole
    assert store.counts()["pending"] == 0
    drawn[0] = 0
    began = time.perf_counter()
    results = store.enqueue_events(events(20_000), now_ms=T0)
    took = time.perf_counter() - began
    assert results == [True] * 20_000
    assert store.enqueue_events(events(20_000), now_ms=T0) == [False] * 20_000
    seqs = [seq for (seq,) in admin.execute("SELECT seq FROM lease.jobs ORDER BY id COLLATE \"C\"")]
    assert len(seqs) == 20_000 and took < 30  # a duplicate draws no seq; generous bound
    order = [job_id for (job_id,) in admin.execute("SELECT id FROM lease.jobs ORDER BY seq")]
    assert order == [f"e{i}" for i in range(20_000)]


def test_an_attempts_error_text_postgresql_cannot_hold_is_kept_readable(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    store.enqueue_events([ev("a")], now_ms=T0)
    [job] = store.claim_jobs("w", 1000, now_ms=T0).leased
    odd = Attempt(T0, 3, None, "Boom: a\x00b \udc80 c")
    assert store.finish_jobs([(job.ticket, "retry", 0, odd)], now_ms=T0 + 1) == [
        ("pending", "retry")]
    history = store.job_history("a")
    assert history is not None
    assert history["attempts"][0]["error"] == "Boom: a\ufffdb ? c"


# Text with what an array's text must escape or quote: quotes, backslashes,
# braces, commas, blanks, the word NULL, and any other character PostgreSQL
# text can hold (not NUL, no lone surrogate: neither is UTF-8).
_ELEMENT_TEXT = st.text(alphabet=st.one_of(
    st.sampled_from('"\\{},  NULLnull\t\n'),
    st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))), max_size=12)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.one_of(st.none(), _ELEMENT_TEXT), max_size=70),
       ints=st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), max_size=70))
def test_an_array_sent_as_text_reads_back_as_the_list_it_was(
        admin: psycopg.Connection, texts: list, ints: list) -> None:
    """The columns of every unnest(...) statement go as their array's text
    (array_text): the server reads back each element as it was, a text's
    quotes and backslashes, the string 'NULL' and None apart."""
    text, numbers = array_text(texts), array_text(ints)
    assert isinstance(text, str) and isinstance(numbers, str)
    assert admin.execute("SELECT %s::text[], %s::bigint[]", (text, numbers)).fetchone() == (
        texts, ints)


def test_an_array_of_anything_else_goes_as_the_list_it_is(admin: psycopg.Connection) -> None:
    assert array_text([True, None]) == [True, None]
    assert array_text([1, 2.5]) == [1, 2.5]
    assert admin.execute("SELECT %s::float8[]", (array_text([1.5, None]),)).fetchone() == (
        [1.5, None],)
