"""The batched operations equal the same single calls in sequence at the same now_ms.

Hypothesis builds random queue states (rows written directly, so states the
API rarely reaches are covered too); the batch runs on one copy of the file,
the single calls on another, and the tickets, results and every row must match.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lease import worker
from lease.worker import Conflict
from tests.support.queues import T0, add, rows

OWNERS = ["owner-a", "owner-b"]


@st.composite
def job_rows(draw) -> list[dict]:
    jobs = []
    for n in range(draw(st.integers(0, 10))):
        max_attempts = draw(st.integers(1, 4))
        attempts = draw(st.integers(0, max_attempts + 1))
        deadline = T0 + draw(st.integers(-50, 400))
        status = draw(st.sampled_from(["pending", "leased", "done", "dead"]))
        leased = status == "leased" and attempts > 0
        status = "pending" if status == "leased" and not leased else status
        lease_until = min(T0 + draw(st.integers(-100, 300)), deadline) if leased else None
        jobs.append({
            "id": f"j{n}", "qty": draw(st.integers(1, 1000)), "status": status,
            "attempts": attempts, "max_attempts": max_attempts, "token": attempts,
            "available_at": T0 + draw(st.integers(-100, 200)), "deadline": deadline,
            "owner": draw(st.sampled_from(OWNERS)) if leased else None,
            "lease_until": lease_until,
            "reason": draw(st.sampled_from(["deadline", "exhausted", "permanent"]))
            if status == "dead" else None,
        })
    return jobs


class Twin:
    """Two identical queue files: one for the batch, one for the single calls."""

    def __init__(self, jobs: list[dict]) -> None:
        self.folder = Path(tempfile.mkdtemp())
        con = worker.open_queue(self.folder / "a.db")
        for job in jobs:
            con.execute(f"INSERT INTO jobs ({', '.join(job)}) VALUES "
                        f"({', '.join('?' * len(job))})", list(job.values()))
        con.close()
        shutil.copy(self.folder / "a.db", self.folder / "b.db")
        self.a = worker.open_queue(self.folder / "a.db")
        self.b = worker.open_queue(self.folder / "b.db")

    def same_rows(self) -> bool:
        return rows(self.a) == rows(self.b) and rows(self.a, "redrives") == rows(self.b,
                                                                               "redrives")

    def close(self) -> None:
        self.a.close()
        self.b.close()
        shutil.rmtree(self.folder)


def sequential_claims(con: sqlite3.Connection, owner: str, now: int, lease: int,
                      limit: int) -> list[dict]:
    tickets = []
    for _ in range(limit):
        ticket = worker.claim(con, owner, now, lease)
        if ticket is None:
            break
        tickets.append(ticket)
    return tickets


@settings(max_examples=150, deadline=None)
@given(jobs=job_rows(), owner=st.sampled_from(OWNERS), now=st.integers(T0 - 100, T0 + 500),
       lease=st.integers(1, 300), limit=st.integers(1, 12))
def test_claim_many_equals_claims_in_sequence(jobs, owner, now, lease, limit):
    twin = Twin(jobs)
    try:
        batch = worker.claim_many(twin.a, owner, now, lease, limit)
        assert batch == sequential_claims(twin.b, owner, now, lease, limit)
        assert twin.same_rows()
    finally:
        twin.close()


@settings(max_examples=150, deadline=None)
@given(jobs=job_rows(), now0=st.integers(T0 - 50, T0 + 100), data=st.data())
def test_finish_many_equals_finishes_in_sequence(jobs, now0, data):
    twin = Twin(jobs)
    try:
        tickets = worker.claim_many(twin.a, "owner-a", now0, 200, 8)
        assert tickets == worker.claim_many(twin.b, "owner-a", now0, 200, 8)
        pool = tickets + [{**t, "token": t["token"] + 1} for t in tickets] + \
            [{**t, "owner": "owner-b"} for t in tickets]
        items = data.draw(st.lists(st.tuples(
            st.sampled_from(pool) if pool else st.nothing(),
            st.sampled_from(["ok", "retry", "permanent"]), st.integers(0, 300)),
            max_size=10)) if pool else []
        now1 = data.draw(st.integers(now0, now0 + 250))
        batch = worker.finish_many(twin.a, items, now1)
        assert batch == [worker.finish(twin.b, t, o, now1, d) for t, o, d in items]
        assert twin.same_rows()
    finally:
        twin.close()


@settings(max_examples=100, deadline=None)
@given(jobs=job_rows(), events=st.lists(st.tuples(st.sampled_from([f"j{n}" for n in range(14)]),
                                                  st.integers(1, 3)), max_size=12),
       ttl=st.integers(1, 1000), max_attempts=st.integers(1, 16))
def test_enqueue_many_equals_enqueues_in_sequence(jobs, events, ttl, max_attempts):
    twin = Twin(jobs)
    try:
        batch = worker.enqueue_many(twin.a, [{"id": i, "qty": q} for i, q in events], T0, ttl,
                                    max_attempts)
        single: list = []
        for i, q in events:
            try:
                single.append(worker.enqueue(twin.b, {"id": i, "qty": q}, T0, ttl, max_attempts))
            except Conflict as exc:
                single.append(exc)
        assert [type(r) for r in batch] == [type(r) for r in single]
        assert [str(r) for r in batch] == [str(r) for r in single]
        assert twin.same_rows()
    finally:
        twin.close()


@settings(max_examples=150, deadline=None)
@given(jobs=job_rows(), now=st.integers(T0 - 100, T0 + 500), limit=st.integers(1, 12))
def test_claim_batch_reports_exactly_the_quarantine_moves(jobs, now, limit):
    twin = Twin(jobs)
    try:
        before = {r["id"]: r["status"] for r in rows(twin.a)}
        tickets, moved = worker.claim_batch(twin.a, "owner-a", now, 100, limit)
        assert tickets == worker.claim_many(twin.b, "owner-a", now, 100, limit)
        assert twin.same_rows()
        newly_dead = [r["reason"] for r in rows(twin.a)
                      if r["status"] == "dead" and before[r["id"]] != "dead"]
        assert moved == {"deadline": newly_dead.count("deadline"),
                         "exhausted": newly_dead.count("exhausted")}
    finally:
        twin.close()


@settings(max_examples=100, deadline=None)
@given(jobs=job_rows(), now0=st.integers(T0 - 50, T0 + 100), data=st.data())
def test_finish_batch_names_the_reason_the_row_got(jobs, now0, data):
    twin = Twin(jobs)
    try:
        tickets = worker.claim_many(twin.a, "owner-a", now0, 200, 8)
        items = [(t, data.draw(st.sampled_from(["ok", "retry", "permanent"])),
                  data.draw(st.integers(0, 300))) for t in tickets]
        items += items[:1]  # the same ticket again: stale the second time
        now1 = data.draw(st.integers(now0, now0 + 250))
        results = worker.finish_batch(twin.a, items, now1)
        by_id = {r["id"]: r for r in rows(twin.a)}
        for (ticket, _, _), found in zip(items, results, strict=True):
            if found is not False:
                row = by_id[ticket["id"]]
                assert found == (row["status"], row["reason"])
        assert results[len(tickets):] in ([], [False])
    finally:
        twin.close()


@settings(max_examples=150, deadline=None)
@given(jobs=job_rows(), ids=st.lists(st.sampled_from([f"j{n}" for n in range(12)]), max_size=12),
       now=st.integers(T0, T0 + 500), ttl=st.integers(1, 60_000))
def test_redrive_many_equals_redrives_in_sequence(jobs, ids, now, ttl):
    twin = Twin(jobs)
    try:
        batch = worker.redrive_many(twin.a, ids, now, ttl, "bulk")
        single: list = []
        for job_id in ids:
            try:
                single.append(worker.redrive(twin.b, job_id, now, ttl, "bulk"))
            except ValueError as exc:
                single.append(exc)
        assert [type(r) for r in batch] == [type(r) for r in single]
        assert [str(r) for r in batch] == [str(r) for r in single]
        assert twin.same_rows()
    finally:
        twin.close()


# ----------------------------------------------------------------- the batch contract


def test_batches_validate_everything_first(con, queue_path):
    add(con, "a", 1)
    add(con, "b", 2)
    ticket = worker.claim(con, "o", T0)
    before = queue_path.read_bytes()
    bad_calls = [
        lambda: worker.claim_many(con, "o", T0, 1000, 0),
        lambda: worker.claim_many(con, "o", T0, 1000, True),
        lambda: worker.claim_many(con, "o", T0, 1000, 10_001),
        lambda: worker.claim_many(con, "bad owner", T0, 1000, 2),
        lambda: worker.finish_many(con, [(ticket, "ok", 0), (ticket, "nope", 0)], T0 + 1),
        lambda: worker.finish_many(con, [(ticket, "ok", 0), [ticket, "ok", 0]], T0 + 1),
        lambda: worker.finish_many(con, ((ticket, "ok", 0),), T0 + 1),
        lambda: worker.finish_many(con, [(ticket, "ok", -1)], T0 + 1),
        lambda: worker.finish_many(con, [(ticket, "ok", 0)], True),
        lambda: worker.enqueue_many(con, [{"id": "c", "qty": 1}, {"id": "d", "qty": 0}], T0, 9),
        lambda: worker.enqueue_many(con, ({"id": "c", "qty": 1},), T0, 9),
        lambda: worker.redrive_many(con, ("a",), T0, 9, "n"),
        lambda: worker.redrive_many(con, ["a", "bad id"], T0, 9, "n"),
        lambda: worker.redrive_many(con, ["a"] * 10_001, T0, 9, "n"),
        lambda: worker.redrive_many(con, ["a"], T0, 0, "n"),
        lambda: worker.redrive_many(con, ["a"], T0, 9, "bad note"),
        lambda: worker.claim_batch(con, "o", T0, 1000, 0),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
        assert queue_path.read_bytes() == before and not con.in_transaction


@pytest.mark.parametrize("point", ["after-claim", "after-commit"])
def test_claim_many_fault_points(con, point):
    for n in range(3):
        add(con, f"j{n}", 1)
    before = rows(con)

    def fault(where: str) -> None:
        if where == point:
            raise KeyError(where)

    with pytest.raises(KeyError):
        worker.claim_many(con, "o", T0, 1000, 5, fault=fault)
    after = rows(con)
    if point == "after-claim":
        assert after == before
    else:
        assert [r["status"] for r in after] == ["leased"] * 3
    assert not con.in_transaction


@pytest.mark.parametrize("point", ["after-finish", "after-commit"])
def test_finish_many_fault_points(con, point):
    for n in range(3):
        add(con, f"j{n}", 1)
    tickets = worker.claim_many(con, "o", T0, 1000, 3)
    before = rows(con)

    def fault(where: str) -> None:
        if where == point:
            raise KeyError(where)

    with pytest.raises(KeyError):
        worker.finish_many(con, [(t, "ok", 0) for t in tickets], T0 + 1, fault=fault)
    after = rows(con)
    assert after == before if point == "after-finish" else [r["status"] for r in after] == [
        "done"] * 3


@pytest.mark.parametrize("point", ["after-audit", "after-redrive", "after-commit"])
def test_redrive_many_fault_points(con, point):
    for n in range(3):
        add(con, f"j{n}", 1, ttl=5)
    worker.claim_many(con, "o", T0 + 5, 1000, 4)  # the quarantine: all three dead
    before = (rows(con), rows(con, "redrives"))

    def fault(where: str) -> None:
        if where == point:
            raise KeyError(where)

    with pytest.raises(KeyError):
        worker.redrive_many(con, ["j0", "j1", "j2"], T0 + 6, 1000, "n", fault=fault)
    if point == "after-commit":
        assert [r["status"] for r in rows(con)] == ["pending"] * 3
        assert len(rows(con, "redrives")) == 3
    else:
        assert (rows(con), rows(con, "redrives")) == before
    assert not con.in_transaction


def test_redrive_many_of_many_jobs_is_one_transaction_per_call(con):
    worker.enqueue_many(con, [{"id": f"j{n}", "qty": 1} for n in range(5000)], T0, 5)
    worker.claim_many(con, "o", T0 + 5, 1000, 1)
    statements: list[str] = []
    con.set_trace_callback(statements.append)
    results = worker.redrive_many(con, [f"j{n}" for n in range(5000)], T0 + 6, 1000, "bulk")
    con.set_trace_callback(None)
    assert results == [True] * 5000
    assert statements.count("BEGIN IMMEDIATE") == 1 and statements.count("COMMIT") == 1
    assert len(rows(con, "redrives")) == 5000


def test_no_hooks_when_a_batch_changes_nothing(con):
    calls: list[str] = []
    add(con, "gone", 1, ttl=5)
    assert worker.claim_many(con, "o", T0 + 5, 1000, 4, fault=calls.append) == []
    assert worker.finish_many(con, [], T0 + 5, fault=calls.append) == []
    assert isinstance(worker.redrive_many(con, ["nope"], T0 + 5, 9, "n", fault=calls.append)[0],
                      ValueError)
    assert worker.redrive_many(con, [], T0 + 5, 9, "n", fault=calls.append) == []
    assert calls == [] and rows(con)[0]["status"] == "dead"  # the quarantine was committed
