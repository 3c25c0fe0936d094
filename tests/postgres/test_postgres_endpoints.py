"""Endpoints as data on PostgreSQL: what only many writers on one real server
can prove (caps and buckets held across connections claiming at once), the
migration of a version-3 queue, the fair claim, and secrets kept out of every
read. The rules both stores share are the conformance suite's."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from lease.endpoints import TURN, Endpoint, EndpointError
from lease.postgres import SCHEMA_VERSION, PostgresStore, enqueue_in
from lease.postgres.schema import MIGRATIONS
from lease.postgres.statements import ORDERED_READS, TAKE_DUE
from lease.records import Attempt, Conflict, Leased, StoreError
from lease.rules import WORKER_BEAT_MS
from tests.support.queues import T0
from tests.support.waiting import WAIT_S, wait_until

LEASE_MS = 600_000  # longer than any test: no lease here ends by itself
SECRET = "whsec_" + "c2VjcmV0LXNpZ25pbmcta2V5LTEyMzQ1Njc4OTA="
HEADER_VALUE = "Bearer very-private-token-4711"


class ManualClock:
    """The stores' clock: the value the test last set, shared by every store."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def admin(postgres_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def make_store(postgres_url: str) -> Iterator[Callable[..., PostgresStore]]:
    """PostgresStores on the test's database (other connections, other
    "hosts"), all closed after it; the first one creates the queue."""
    opened: list[PostgresStore] = []

    def make(**options: Any) -> PostgresStore:
        store = PostgresStore(postgres_url, create=True, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def endpoint(name: str, **fields: Any) -> Endpoint:
    return Endpoint(name, f"https://{name.lower()}.example/hook", **fields)


def ids(leased: list[Leased]) -> list[str]:
    return [job.ticket["id"] for job in leased]


def finish_all(store: PostgresStore, leased: list[Leased], now: int = T0) -> None:
    if leased:
        results = store.finish_jobs([(job.ticket, "ok", 0, Attempt(now, 1)) for job in leased],
                                    now_ms=now)
        assert results == [("done", None)] * len(leased)


def run_threads(count: int, work: Callable[[int], None]) -> None:
    """``work(n)`` on ``count`` threads started at once; what any raised, raised."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            barrier.wait(WAIT_S)
            work(n)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 6)
        assert not thread.is_alive(), "a claiming thread did not finish"
    if errors:
        raise errors[0]


def live_leases(admin: psycopg.Connection, name: str) -> int:
    row = admin.execute("SELECT count(*) FROM lease.jobs WHERE endpoint = %s"
                        " AND status = 'leased'", (name,)).fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ the migration


def test_a_version_3_queue_migrates_and_its_jobs_keep_working(
        postgres_url: str, admin: psycopg.Connection) -> None:
    with admin.transaction():  # the queue as the version-3 code made it, with its jobs
        admin.execute("CREATE SCHEMA lease")
        admin.execute("CREATE TABLE lease.schema_migrations (version integer PRIMARY KEY,"
                      " applied_at timestamptz NOT NULL DEFAULT now())")
        for version in (1, 2, 3):
            for statement in MIGRATIONS[version]:
                admin.execute(statement)
            admin.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)",
                          (version,))
        admin.execute("INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,"
                      " available_at, deadline, ordering_key, held) VALUES"
                      " ('old', 1, 'pending', 0, 3, 0, %s, %s, 'k', 0)", (T0, T0 + 60_000))
    with PostgresStore(postgres_url, read_only=True) as looking:  # read as it is
        assert looking.schema_version() == 3
        assert [job["id"] for job in looking.list_jobs(key="k")] == ["old"]
        assert looking.endpoints() == [] and looking.endpoint_stats() == []
    with PostgresStore(postgres_url) as store:
        assert store.schema_version() == SCHEMA_VERSION == 9
        [old] = store.list_jobs()
        assert (old["endpoint"], old["message"], old["event_type"], old["ordering_key"]) == (
            None, None, None, "k")
        assert store.enqueue_events([{"id": "new", "qty": 1, "key": "k"}], now_ms=T0) == [True]
        assert store.claim_jobs("w", 1000, 10, now_ms=T0, endpoints="*").leased == []
        claimed = store.claim_jobs("w", 1000, 10, now_ms=T0)  # run --url's claim
        assert ids(claimed.leased) == ["old"]  # "new" waits behind it in its key's line
        assert [(job.endpoint, job.message) for job in claimed.leased] == [(None, None)]
        finish_all(store, claimed.leased)
        [new] = store.claim_jobs("w", 1000, 10, now_ms=T0).leased
        assert new.event == {"id": "new", "qty": 1} and new.endpoint is None
    tables = {t for (t,) in admin.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'lease'")}
    assert {"endpoints", "endpoint_audit"} <= tables
    assert [v for (v,) in admin.execute(
        "SELECT version FROM lease.schema_migrations ORDER BY version")] == list(
            range(1, SCHEMA_VERSION + 1))


# ------------------------------------------------------------------ own jobs and deliveries


def test_an_own_claim_never_takes_a_delivery_nor_an_endpoint_claim_an_own_job(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    assert store.enqueue_events([{"id": "own", "qty": 1}], now_ms=T0) == [True]
    store.add_endpoint(endpoint("A"), now_ms=T0)
    store.add_endpoint(endpoint("B", types=("paid",)), now_ms=T0)
    assert store.enqueue_events([{"id": "m1", "qty": 2, "type": "paid"},
                                 {"id": "m2", "qty": 3}], now_ms=T0) == [True, True]
    assert sorted(job["id"] for job in store.list_jobs()) == ["m1@A", "m1@B", "m2@A", "own"]
    own = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0)
    assert ids(own.leased) == ["own"]
    deliveries = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0, endpoints="*")
    assert sorted(ids(deliveries.leased)) == ["m1@A", "m1@B", "m2@A"]
    assert {(job.endpoint, job.message, job.event["id"]) for job in deliveries.leased} == {
        ("A", "m1", "m1"), ("B", "m1", "m1"), ("A", "m2", "m2")}
    assert store.claim_jobs("w", LEASE_MS, 10, now_ms=T0).leased == []
    assert store.claim_jobs("w", LEASE_MS, 10, now_ms=T0, endpoints=("B",)).leased == []


def test_a_finish_steps_the_breaker_of_deliveries_only_whatever_the_ids(
        make_store: Callable[..., PostgresStore]) -> None:
    """A finish looks for deliveries among the ids that hold an '@' only
    (every delivery's does): the queue's own jobs without one, and one with
    one, fail beside a delivery, and the breaker counts the delivery's
    failure alone."""
    store = make_store()
    assert store.enqueue_events([{"id": "plain", "qty": 1}, {"id": "a@A", "body": {}}],
                                now_ms=T0) == [True, True]
    store.add_endpoint(endpoint("A"), now_ms=T0)
    assert store.enqueue_events([{"id": "m1", "qty": 1}], now_ms=T0) == [True]
    own = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0).leased
    assert sorted(ids(own)) == ["a@A", "plain"]
    [delivery] = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0, endpoints="*").leased
    failed = Attempt(T0, 3, 503)
    assert store.finish_jobs([(job.ticket, "retry", 0, failed) for job in [*own, delivery]],
                             now_ms=T0 + 1) == [("pending", "retry")] * 3
    [state] = store.endpoints()
    assert state["circuit"]["failures"] == 1


def test_a_message_is_judged_whole_at_intake(make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    assert store.enqueue_events([{"id": "x@A", "body": {}}], now_ms=T0) == [True]
    store.add_endpoint(endpoint("A"), now_ms=T0)
    store.add_endpoint(endpoint("B", types=("paid",)), now_ms=T0)
    results = store.enqueue_events([
        {"id": "m", "qty": 1, "type": "paid", "key": "k"},
        {"id": "m", "qty": 1, "type": "paid", "key": "k"},  # the same: a duplicate
        {"id": "m", "qty": 1, "type": "refund", "key": "k"},  # another type: a conflict
        {"id": "x", "qty": 1},  # its delivery's id is a job of the queue's own
        {"id": "lonely", "qty": 1, "type": "refund"},  # no subscriber of B's; A takes all
    ], now_ms=T0)
    assert results[:2] == [True, False] and results[4] is True
    assert isinstance(results[2], Conflict) and isinstance(results[3], Conflict)
    assert store.enqueue_events([{"id": "m", "qty": 1, "type": "paid", "key": "k"}],
                                now_ms=T0) == [False]
    rows = {job["id"]: job for job in store.list_jobs()}
    assert sorted(rows) == ["lonely@A", "m@A", "m@B", "x@A"]
    assert (rows["m@B"]["ordering_key"], rows["m@B"]["event_type"], rows["m@B"]["message"]) == (
        "k", "paid", "m")
    assert sorted(job["id"] for job in store.list_jobs(key="k")) == ["m@A", "m@B"]
    with pytest.raises(ValueError, match="too long"):
        store.enqueue_events([{"id": "y" * 255, "body": {}}], now_ms=T0)


def test_every_delivery_of_a_message_commits_or_rolls_back_with_the_services_row(
        make_store: Callable[..., PostgresStore], postgres_url: str) -> None:
    store = make_store()
    for name in ("audit", "billing", "crm"):
        store.add_endpoint(endpoint(name, types=("*",) if name == "audit" else ("order.paid",)),
                           now_ms=T0)
    with psycopg.connect(postgres_url) as shop:
        shop.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        shop.commit()
        paid = {"id": "o-1", "qty": 1, "type": "order.paid"}
        shop.execute("INSERT INTO orders VALUES ('o-1')")
        assert enqueue_in(shop, [paid], now_ms=T0) == [True]
        shop.rollback()
        assert store.list_jobs() == []
        shop.execute("INSERT INTO orders VALUES ('o-1')")
        assert enqueue_in(shop, [paid, {"id": "o-2", "qty": 1}], now_ms=T0) == [True, True]
        shop.commit()
    assert sorted(job["id"] for job in store.list_jobs()) == [
        "o-1@audit", "o-1@billing", "o-1@crm", "o-2@audit"]


# ------------------------------------------------------------------ caps across connections


def test_connections_claiming_deliveries_at_once_lease_each_once_per_round(
        make_store: Callable[..., PostgresStore]) -> None:
    """Endpoints without limits, claims at once on several connections until
    each finds nothing: every delivery leased once in the first round (by the
    due part of a claim), and once again, by its next token, in a second
    round after every lease ran out (by the run-out part): never twice,
    whichever claims took them."""
    threads, lease_ms = 4, 1_000
    first = make_store()
    names = ("a", "b", "c")
    for name in names:
        first.add_endpoint(endpoint(name, types=(name,)), now_ms=T0)
    assert all(first.enqueue_events([{"id": f"m{n}", "qty": 1, "type": names[n % 3]}
                                     for n in range(300)], now_ms=T0))
    stores = [make_store() for _ in range(threads)]
    for token, now in ((1, T0), (2, T0 + 2 * lease_ms)):
        leased: list[list[Leased]] = [[] for _ in range(threads)]

        def claim(n: int, leased: list[list[Leased]] = leased, now: int = now) -> None:
            while got := stores[n].claim_jobs(f"w{n}", lease_ms, 7, now_ms=now,
                                              endpoints="*").leased:
                leased[n] += got

        run_threads(threads, claim)
        taken = [job for jobs in leased for job in jobs]
        assert sorted(job.message for job in taken) == sorted(f"m{n}" for n in range(300))
        assert {job.ticket["token"] for job in taken} == {token}


def test_a_claim_passes_over_deliveries_another_transaction_holds(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """A due delivery and a run-out lease, each changed by a transaction
    not committed yet (an operator's cancel, a stale finish): a claim passes
    over both without waiting, leases the rest, and never leases either one,
    whatever that transaction comes to."""
    store = make_store()
    store.add_endpoint(endpoint("e", types=("t",)), now_ms=T0)
    assert all(store.enqueue_events([{"id": f"m{n}", "qty": 1, "type": "t"}
                                     for n in range(4)], now_ms=T0))
    gone = store.claim_jobs("gone", 1, 2, now_ms=T0, endpoints="*").leased
    assert sorted(job.message for job in gone) == ["m0", "m1"]
    with psycopg.connect(admin.info.dsn) as holder:  # a transaction left open
        holder.execute("UPDATE lease.jobs SET status = 'dead', reason = 'cancelled'"
                       " WHERE message IN ('m0', 'm2')")
        claimed: list[Leased] = []
        claim = threading.Thread(target=lambda: claimed.extend(store.claim_jobs(
            "w", LEASE_MS, 4, now_ms=T0 + 10, endpoints="*").leased))
        claim.start()
        claim.join(WAIT_S)
        waited = claim.is_alive()
        holder.commit()
    claim.join(WAIT_S)
    assert not waited, "the claim waited for another transaction's rows"
    assert sorted(job.message for job in claimed) == ["m1", "m3"]
    assert sorted(job["id"] for job in store.jobs_with_status("dead")) == sorted(
        job_id for (job_id,) in admin.execute(
            "SELECT id FROM lease.jobs WHERE message IN ('m0', 'm2')"))


def test_the_cap_holds_across_connections_claiming_at_once(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    cap, threads = 3, 8
    first = make_store()
    first.add_endpoint(endpoint("A", max_in_flight=cap), now_ms=T0)
    first.add_endpoint(endpoint("B"), now_ms=T0)
    first.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(60)], now_ms=T0)
    stores = [make_store() for _ in range(threads)]
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # committed states, as another connection sees them
        with psycopg.connect(admin.info.dsn, autocommit=True) as conn:
            while not stop.is_set():
                seen.append(live_leases(conn, "A"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(6):  # rounds: claims at once, never finished, then all finished
            leased: list[list[Leased]] = [[] for _ in range(threads)]

            def claim(n: int, leased: list[list[Leased]] = leased) -> None:
                for _ in range(4):
                    leased[n] += stores[n].claim_jobs(f"w{n}", LEASE_MS, 2, now_ms=T0,
                                                      endpoints=("A",)).leased

            run_threads(threads, claim)
            taken = [job for jobs in leased for job in jobs]
            assert len(taken) <= cap  # never more at once, whoever claimed
            # a claim skips an endpoint another holds: one more, alone, fills the cap
            taken += stores[0].claim_jobs("w0", LEASE_MS, cap, now_ms=T0,
                                          endpoints=("A",)).leased
            # no lease ended and none was finished: every claim's leases are live
            assert len(taken) == live_leases(admin, "A") == cap
            finish_all(first, taken)
    finally:
        stop.set()
        watcher.join(WAIT_S)
    assert seen and max(seen) == cap
    assert first.counts()["done"] == 6 * cap


def test_the_bucket_is_never_overspent_by_claims_at_once(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    clock = ManualClock(T0)
    threads = 8
    first = make_store(clock=clock)
    first.add_endpoint(endpoint("A", rate=4.0, burst=6))  # a full bucket: 6 tokens
    first.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(200)])
    stores = [make_store(clock=clock) for _ in range(threads)]
    expected = [6, 4, 2, 6]  # the burst, then what 1 s, 0.5 s and 5 s (capped) refill
    for step, tokens in zip([0, 1000, 500, 5000], expected, strict=True):
        clock.now += step
        leased: list[list[Leased]] = [[] for _ in range(threads)]

        def claim(n: int, leased: list[list[Leased]] = leased) -> None:
            for _ in range(3):
                leased[n] += stores[n].claim_jobs(f"w{n}", LEASE_MS, 2,
                                                  endpoints="*").leased

        run_threads(threads, claim)
        taken = [job for jobs in leased for job in jobs]
        assert len(taken) <= tokens  # never overspent, whoever claimed
        # a claim skips an endpoint another holds: one more, alone, spends the rest
        taken += stores[0].claim_jobs("w0", LEASE_MS, 10, endpoints="*").leased
        assert len(taken) == tokens
        level = admin.execute("SELECT tokens FROM lease.endpoints WHERE name = 'A'").fetchone()
        assert level is not None and 0 <= level[0] < 1
        finish_all(first, taken, clock.now)


def test_one_probe_at_a_time_across_connections_claiming_at_once(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    threads = 8
    first = make_store()
    first.add_endpoint(endpoint("down"), now_ms=T0)
    first.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(40)], now_ms=T0)
    failed = first.claim_jobs("w", LEASE_MS, 5, now_ms=T0, endpoints="*").leased
    first.finish_jobs([(job.ticket, "retry", 0, Attempt(T0, 3, None, "connection refused"))
                       for job in failed], now_ms=T0 + 1)  # five in a row: open
    stores = [make_store() for _ in range(threads)]
    for _ in range(3):  # each cool-down's end: claims at once, then the probe fails
        [state] = first.endpoints()
        assert state["circuit"]["state"] == "open"
        probe_at = state["circuit"]["open_until_ms"]
        leased: list[list[Leased]] = [[] for _ in range(threads)]

        def claim(n: int, leased: list[list[Leased]] = leased, at: int = probe_at) -> None:
            for k in range(3):
                leased[n] += stores[n].claim_jobs(f"w{n}", LEASE_MS, 5, now_ms=at + k,
                                                  endpoints="*").leased

        run_threads(threads, claim)
        [probe] = [job for jobs in leased for job in jobs]  # one, whoever claimed
        assert live_leases(admin, "down") == 1
        assert first.endpoints()[0]["circuit"]["state"] == "half-open"
        # while it is out, a claim alone takes nothing either
        assert stores[0].claim_jobs("w0", LEASE_MS, 5, now_ms=probe_at + 10,
                                    endpoints="*").leased == []
        first.finish_jobs([(probe.ticket, "retry", 0, Attempt(probe_at + 10, 3, 503))],
                          now_ms=probe_at + 11)


class PausedClaims(PostgresStore):
    """A store whose claims of deliveries stop, their first endpoints judged
    and locked, nothing leased yet, until the test lets them go."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.judged = threading.Event()
        self.go = threading.Event()

    def _before_lease(self) -> None:
        self.judged.set()
        assert self.go.wait(WAIT_S), "the test never let the claim go"


def test_a_claim_passes_over_an_endpoint_another_claim_is_judging_without_waiting(
        postgres_url: str, make_store: Callable[..., PostgresStore],
        admin: psycopg.Connection) -> None:
    """A claim holds its endpoints' rows from their judgement to its
    commit; another claim meanwhile passes over them (it does not wait, and
    does not count the leases the first has not written yet), so the cap
    holds whoever claims."""
    cap = 2
    first = make_store()
    first.add_endpoint(endpoint("A", max_in_flight=cap), now_ms=T0)
    first.add_endpoint(endpoint("B"), now_ms=T0)
    first.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(10)], now_ms=T0)
    paused = PausedClaims(postgres_url)
    try:
        held: list[Leased] = []
        claim = threading.Thread(target=lambda: held.extend(paused.claim_jobs(
            "paused", LEASE_MS, 5, now_ms=T0, endpoints=("A",)).leased))
        claim.start()
        try:
            assert paused.judged.wait(WAIT_S), "the paused claim never judged its endpoints"
            other = first.claim_jobs("other", LEASE_MS, 5, now_ms=T0, endpoints="*").leased
            # A is passed over (B's share is the whole claim) and no claim waited
            assert {job.endpoint for job in other} == {"B"} and len(other) == 5
            assert lock_waiters(admin) == 0
        finally:
            paused.go.set()
            claim.join(WAIT_S)
        assert not claim.is_alive()
        assert [job.endpoint for job in held] == ["A"] * cap == ["A"] * live_leases(admin, "A")
    finally:
        paused.close()


def lock_waiters(admin: psycopg.Connection) -> int:
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'").fetchone()
    assert row is not None
    return int(row[0])


def plan(admin: psycopg.Connection, statement: str, args: Any, settings: str = "") -> dict:
    """EXPLAIN ANALYZE of a statement, run and rolled back (after ``settings``)."""
    with admin.transaction(force_rollback=True):
        if settings:
            admin.execute(settings)
        row = admin.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}",
                            args).fetchone()
    assert row is not None
    found = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return dict(found[0]["Plan"])


def nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def above(node: dict, index: str) -> list[str]:
    """The node types from the plan's top down to the first scan of ``index``."""
    if node.get("Index Name") == index:
        return [node["Node Type"]]
    for child in node.get("Plans", []):
        found = above(child, index)
        if found:
            return [node["Node Type"], *found]
    return []


def test_each_endpoint_s_due_deliveries_are_read_in_priority_order_up_to_its_share(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    """Thousands due per endpoint, of many priorities: the claim's read of
    each endpoint's share scans jobs_endpoint_due in the order it takes the
    rows and stops at the share, nothing of the backlog sorted; its leases
    run out are read the same way, in jobs_in_flight's order; each part locks
    the rows its scan reads, nothing sorted between them."""
    store = make_store()
    names = ["e0", "e1", "e2"]
    for name in names:
        store.add_endpoint(endpoint(name, types=(name,)), now_ms=T0)
    store.enqueue_events([{"id": f"m{n}", "qty": 1, "type": names[n % 3],
                           "priority": n % 201 - 100} for n in range(6000)], now_ms=T0)
    # two leases of e0 run out: the first of its share, whatever their priority
    run_out = store.claim_jobs("gone", 1, 2, now_ms=T0, endpoints=("e0",)).leased
    admin.execute("ANALYZE lease.jobs")
    args = {"names": names, "lims": [5, 5, 5], "now": T0 + 10, "owner": "w",
            "lease_ms": LEASE_MS, "before": 0, "beat": WORKER_BEAT_MS}
    top = plan(admin, TAKE_DUE, args, settings=ORDERED_READS)
    scans = [n for n in nodes(top) if n.get("Index Name") == "jobs_endpoint_due"]
    assert [(scan["Actual Loops"], scan["Actual Rows"] <= 5) for scan in scans] == [(3, True)]
    [late] = [n for n in nodes(top) if n.get("Index Name") == "jobs_in_flight"]
    assert late["Actual Rows"] <= 1, late  # two rows over three loops
    for index in ("jobs_endpoint_due", "jobs_in_flight"):
        assert above(top, index)[-3:] == ["Limit", "LockRows", "Index Scan"], index
    with admin.transaction(force_rollback=True):
        admin.execute(ORDERED_READS)
        got = admin.execute(TAKE_DUE, args).fetchall()
    priorities = dict(admin.execute("SELECT seq, priority FROM lease.jobs").fetchall())
    # each endpoint's top level (e0 has 98, e1 99, e2 100: 201 levels over 3
    # endpoints), e0's leases run out first
    assert sorted((row[8], priorities[row[0]]) for row in got
                  if row[1] not in ids(run_out)) == sorted(
        [*[("e0", 98)] * 3, *[("e1", 99)] * 5, *[("e2", 100)] * 5])
    assert {row[1] for row in got} >= set(ids(run_out))


def test_a_claim_of_deliveries_runs_on_its_generic_plan(
        make_store: Callable[..., PostgresStore]) -> None:
    """Once its statements are prepared on the connection (the 6th run),
    a claim of deliveries plans none of them again: left to choose,
    PostgreSQL planned the round's statement anew at every run."""
    store = make_store()  # one thread: one connection
    store.add_endpoint(endpoint("e", types=("t",)), now_ms=T0)
    assert all(store.enqueue_events([{"id": f"m{n}", "qty": 1, "type": "t"}
                                     for n in range(40)], now_ms=T0))
    for _ in range(12):
        leased = store.claim_jobs("w", LEASE_MS, 3, now_ms=T0, endpoints="*").leased
        assert len(leased) == 3
        finish_all(store, leased)
    with store._pool.connection() as conn:
        plans = conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                             " WHERE statement LIKE '%%unnest($1::text[], $2::bigint[])%%'"
                             ).fetchall()
    assert plans == [(7, 0)]


# the partial indexes of live rows (none holds a done row)
PARTIAL = {"jobs_fair", "jobs_live", "jobs_in_flight", "jobs_serving", "jobs_leased_until"}


def test_a_small_endpoint_is_served_beside_a_large_backlog(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    store.add_endpoint(endpoint("A", types=("a",)), now_ms=T0)
    store.add_endpoint(endpoint("B", types=("b",)), now_ms=T0)
    assert all(store.enqueue_events([{"id": f"a{n}", "qty": 1, "type": "a"}
                                     for n in range(1000)], now_ms=T0))
    assert all(store.enqueue_events([{"id": f"b{n}", "qty": 1, "type": "b"}
                                     for n in range(10)], now_ms=T0))
    served_b: list[int] = []
    for claim in range(5):
        leased = store.claim_jobs("w", LEASE_MS, 8, now_ms=T0, endpoints="*").leased
        assert len(leased) == 8
        served_b += [claim] * sum(1 for job in leased if job.endpoint == "B")
        finish_all(store, leased)
    assert served_b[:1] == [0] and len(served_b) == 10 and served_b[-1] <= 2


def jobs_index_rows_read(admin: psycopg.Connection) -> int:
    """Index entries read on lease.jobs, every index, by the sessions that reported."""
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute("SELECT sum(idx_tup_read) FROM pg_stat_user_indexes"
                        " WHERE relname = 'jobs'").fetchone()
    assert row is not None
    return int(row[0])


def test_a_claim_reads_each_endpoints_due_deliveries_from_the_start_of_its_range(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    setup = make_store()
    for n in range(64):
        setup.add_endpoint(endpoint(f"E{n}", types=(f"t{n}",)), now_ms=T0)
    setup.enqueue_events([{"id": f"m{k}", "qty": 1, "type": f"t{k % 64}"} for k in range(640)],
                         now_ms=T0)
    setup.close()  # its session's figures reach the statistics as it ends
    admin.execute("ANALYZE lease.jobs")  # ten due rows an endpoint, as it reads them
    before = jobs_index_rows_read(admin)
    claimer = make_store()
    leased = claimer.claim_jobs("w", LEASE_MS, 64, now_ms=T0 + 1, endpoints="*").leased
    taken = Counter(job.endpoint for job in leased)  # a turn of each, in the rotation's order
    assert len(leased) == 64 and set(taken.values()) == {TURN} and len(taken) == 64 // TURN
    claimer.close()
    wait_until(lambda: jobs_index_rows_read(admin) > before,
               "the claim's index reads in the statistics")
    # each endpoint's first due rows, then the 64 leased, not each endpoint's
    # ten fetched by bitmap and sorted
    assert jobs_index_rows_read(admin) - before <= 3 * 64


def test_a_disabled_endpoint_waits_and_the_others_go_on(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    store.add_endpoint(endpoint("A"), now_ms=T0)
    store.add_endpoint(endpoint("B"), now_ms=T0)
    store.update_endpoint("A", {"enabled": False}, note="paused", actor="ops", now_ms=T0)
    store.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(3)], now_ms=T0)
    leased = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0, endpoints="*").leased
    assert sorted(ids(leased)) == ["m0@B", "m1@B", "m2@B"]
    store.update_endpoint("A", {"enabled": True}, now_ms=T0)
    leased = store.claim_jobs("w", LEASE_MS, 10, now_ms=T0, endpoints="*").leased
    assert sorted(ids(leased)) == ["m0@A", "m1@A", "m2@A"]
    assert [(row["action"], row["fields"]) for row in store.endpoint_audit("A")] == [
        ("add", []), ("disable", ["enabled"]), ("enable", ["enabled"])]


# ------------------------------------------------------------------ the operator


def test_removal_refuses_live_deliveries_or_cancels_the_pending_ones(
        make_store: Callable[..., PostgresStore]) -> None:
    store = make_store()
    store.add_endpoint(endpoint("A"), now_ms=T0)
    store.enqueue_events([{"id": f"m{n}", "qty": 1} for n in range(3)], now_ms=T0)
    with pytest.raises(EndpointError, match="3 deliveries still to send"):
        store.remove_endpoint("A", now_ms=T0)
    [one] = store.claim_jobs("w", LEASE_MS, 1, now_ms=T0, endpoints="*").leased
    with pytest.raises(EndpointError, match="on the wire"):
        store.remove_endpoint("A", cancel_live=True, now_ms=T0)
    assert store.counts() == {"pending": 2, "leased": 1, "done": 0, "dead": 0}
    finish_all(store, [one])
    assert store.remove_endpoint("A", cancel_live=True, note="gone", actor="ops",
                                 now_ms=T0) == 2
    assert store.endpoints() == []
    history = store.job_history("m1@A")
    assert history is not None and [(c["note"], c["actor"]) for c in history["cancels"]] == [
        ("gone", "ops")]
    assert [row["action"] for row in store.endpoint_audit()] == ["add", "remove"]
    with pytest.raises(EndpointError, match="no endpoint named 'A'"):
        store.update_endpoint("A", {"url": "https://a.example/other"}, now_ms=T0)


def test_secrets_and_header_values_are_in_no_read_error_or_audit_row(
        make_store: Callable[..., PostgresStore], admin: psycopg.Connection) -> None:
    store = make_store()
    hooked = endpoint("A", secrets=(SECRET,), headers=(("Authorization", HEADER_VALUE),))
    store.add_endpoint(hooked, note="new customer", actor="ops", now_ms=T0)
    store.enqueue_events([{"id": "m", "qty": 1}], now_ms=T0)
    [job] = store.claim_jobs("w", LEASE_MS, 1, now_ms=T0, endpoints="*").leased
    store.finish_jobs([(job.ticket, "retry", 0, Attempt(T0, 1, 503, "HTTP 503"))], now_ms=T0)
    store.update_endpoint("A", {"headers": (("Authorization", HEADER_VALUE + "2"),)},
                          now_ms=T0)
    errors = []
    for changes in ({"headers": (("Authorization", HEADER_VALUE + "\n"),)},
                    {"headers": (("Host", HEADER_VALUE),)},
                    {"secrets": (SECRET[:-3],)}):
        with pytest.raises(ValueError) as refused:
            store.update_endpoint("A", changes, now_ms=T0)
        errors.append(str(refused.value))
    with pytest.raises(EndpointError) as taken:
        store.add_endpoint(hooked, now_ms=T0)
    errors.append(str(taken.value))
    # a row the server refuses: its message would show the row, secrets and all
    admin.execute("ALTER TABLE lease.endpoints ADD CONSTRAINT short CHECK (length(url) < 30)")
    with pytest.raises(StoreError, match="violates check constraint") as refused_row:
        store.add_endpoint(endpoint("Bee-long-name-endpoint", secrets=(SECRET,),
                                    headers=(("Authorization", HEADER_VALUE),)), now_ms=T0)
    errors.append(str(refused_row.value))
    reads = [store.endpoints(), store.endpoint_stats(), store.endpoint_audit(),
             store.list_jobs(), store.job_history("m@A"), store.snapshot(now_ms=T0),
             errors, repr(store.endpoint_configs()[0])]
    text = json.dumps(reads, default=str)
    for secret in (SECRET, SECRET[6:], HEADER_VALUE, "very-private"):
        assert secret not in text
    [shown] = store.endpoints()
    assert (shown["secrets"], shown["headers"]) == (1, ["Authorization"])
    [stats] = store.endpoint_stats()
    assert (stats["ready"], stats["retried"], stats["last_error"]) == (
        1, 1, {"error": "HTTP 503", "http_status": 503, "at_ms": T0})
    assert [row["fields"] for row in store.endpoint_audit("A")] == [[], ["headers"]]
    [config] = store.endpoint_configs(("A",))  # the dispatcher's, secrets and all
    assert config.secrets == (SECRET,)
    assert config.headers == (("Authorization", HEADER_VALUE + "2"),)
