"""What only the SQLite driver's endpoint claim has: a cost in statements
that does not grow with the number of endpoints, and the same outcome when
an older SQLite writes the endpoints a row at a time. The claim's rules are
tested on every store in tests/conformance/test_endpoints.py."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lease.endpoints import TURN, Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.sqlite import SQLiteStore
from lease.sqlite import endpoints as driver
from lease.sqlite.statements import DUE_EACH, DUE_FIRST_EACH, PICK_READY
from tests.support.queues import T0

URL = "http://127.0.0.1:9/events"
POLICY = RetryPolicy(max_attempts=5, ttl_ms=3_600_000)
LIMIT = 64


def queue(path: Path, endpoints: int, deliveries: int, **fields: object) -> SQLiteStore:
    """A queue with ``endpoints`` endpoints subscribed to every type and
    ``deliveries`` deliveries to each, the endpoints added in one transaction
    (one commit each would make the test slow, not different)."""
    store = SQLiteStore(str(path), create=True, clock=lambda: T0)
    con = store.connection
    con.execute("BEGIN IMMEDIATE")
    for n in range(endpoints):
        driver.add_endpoint(con, Endpoint(f"e{n:04d}", URL, **fields), T0, None, None)
    con.execute("COMMIT")
    store.enqueue_events([{"id": f"m{i}", "body": {"n": i}} for i in range(deliveries)],
                         POLICY, now_ms=T0)
    return store


@contextmanager
def statements(con: sqlite3.Connection) -> Iterator[list[str]]:
    """Every statement SQLite runs on ``con`` meanwhile (an executemany: one a row)."""
    ran: list[str] = []
    con.set_trace_callback(ran.append)
    try:
        yield ran
    finally:
        con.set_trace_callback(None)


def claims_statements(store: SQLiteStore, claims: int = 3) -> list[int]:
    """The statements of each of ``claims`` claims of LIMIT, each finished
    done after (the finish not counted)."""
    counts = []
    for n in range(claims):
        now = T0 + 1 + n
        with statements(store.connection) as ran:
            leased = store.claim_jobs("w1", 30_000, LIMIT, now_ms=now, endpoints="*").leased
        assert len(leased) == LIMIT
        counts.append(len(ran))
        store.finish_jobs([(job.ticket, "ok", 0, Attempt(now, 1, 200)) for job in leased],
                          now_ms=now)
    return counts


@pytest.mark.parametrize("fields", [{}, {"rate": 1000.0, "burst": 1000}, {"max_in_flight": 500}],
                         ids=["plain", "rate", "cap"])
def test_a_claim_runs_as_many_statements_with_500_endpoints_as_with_one(tmp_path, fields):
    one = queue(tmp_path / "one.db", 1, 4 * LIMIT, **fields)
    many = queue(tmp_path / "many.db", 500, TURN, **fields)
    try:
        counts = claims_statements(one)
        assert claims_statements(many) == counts
        # begin, the pause's probe, quarantine, rotation, shares, rows, rotated,
        # leases, the owner's row, commit; a rate endpoint's bucket one more
        assert counts == [11 if "rate" in fields else 10] * 3
    finally:
        one.close()
        many.close()


def test_endpoints_with_less_than_a_turn_each_cost_one_more_look_whatever_their_number(
        tmp_path):
    """Half a turn each: the claim's first look at the rotation fills half of
    it, a second look (the rotation and the shares: two statements) the
    rest, with 100 endpoints as with 500 (three claims do not go round
    either rotation)."""
    one = queue(tmp_path / "one.db", 1, 4 * LIMIT)
    few = queue(tmp_path / "few.db", 100, TURN // 2)
    many = queue(tmp_path / "many.db", 500, TURN // 2)
    try:
        counts = claims_statements(one)
        assert claims_statements(few) == claims_statements(many) == [n + 2 for n in counts]
    finally:
        one.close()
        few.close()
        many.close()


def endpoint_rows(store: SQLiteStore) -> list[tuple]:
    return store.connection.execute(
        "SELECT name, served_at, has_work, tokens, refilled_ms, circuit FROM endpoints"
        " ORDER BY name").fetchall()


def test_an_older_sqlite_writes_the_endpoints_a_row_at_a_time_to_the_same_end(
        tmp_path, monkeypatch):
    """UPDATE ... FROM is SQLite 3.33's: before it, each endpoint examined is
    written by a statement of its own, with the same values."""
    found = []
    for label, update_from in (("new", True), ("old", False)):
        monkeypatch.setattr(driver, "UPDATE_FROM", update_from)
        store = queue(tmp_path / f"{label}.db", 70, 1, rate=2.0, burst=3)
        try:
            # a batch of 70 (the claim's limit), one delivery each, then
            # endpoints with nothing left: out of the rotation
            first = store.claim_jobs("w1", 30_000, 70, now_ms=T0 + 10, endpoints="*").leased
            store.finish_jobs([(job.ticket, "ok", 0, Attempt(T0 + 10, 1, 200))
                               for job in first], now_ms=T0 + 10)
            again = store.claim_jobs("w1", 30_000, 70, now_ms=T0 + 20, endpoints="*").leased
            found.append((sorted(job.ticket["id"] for job in first), again,
                          endpoint_rows(store)))
        finally:
            store.close()
    assert found[0] == found[1]
    leased, again, rows = found[0]
    assert len(leased) == 70 and again == []
    assert {row[2] for row in rows} == {0}  # has_work: none left
    assert {row[3] for row in rows} == {2.0}  # 3 tokens, one spent


@pytest.mark.parametrize("statement", ["own", "due", "due_first"])
def test_the_claim_reads_in_priority_order_by_its_index_with_nothing_sorted(tmp_path, statement):
    """The picks' ORDER BY (the higher priority first) is their index's order:
    SQLite's plan scans it and builds no temporary B-tree to sort."""
    with SQLiteStore(tmp_path / "q.db", create=True) as store:
        sql, args = {
            "own": (PICK_READY, {"now": T0, "limit": LIMIT}),
            "due": (DUE_EACH.format(names="(?)"), ["e0", T0, LIMIT, 0]),
            "due_first": (DUE_FIRST_EACH.format(names="(?)"), ["e0", T0, 1, 0]),
        }[statement]
        plan = " | ".join(str(row[3]) for row in store.connection.execute(
            "EXPLAIN QUERY PLAN " + sql, args))
    assert "jobs_own" in plan or "jobs_endpoint_due" in plan, plan
    assert "TEMP B-TREE" not in plan, plan
