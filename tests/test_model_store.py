"""Model-based test of the product queue (lease.sqlite): payload and lab events,
budgets of days and tens of attempts, the evidence of every attempt, cancel,
prune and redrive, against the contract's model extended by what the product
adds. After every step the file equals the model row for row."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lease import sqlite as store
from lease.policy import RetryPolicy, canonical_body
from lease.sqlite import Attempt
from lease.worker import Conflict

from .conftest import rows
from .test_model import Model

IDS = ["order-1", "tenant_7", "3f2b8c1e-9a4d"]  # valid for lab and payload events alike
OWNERS = ["o1", "o2"]
BODIES = [None, {"v": 1}, {"v": 2, "w": [1, "x"]}]  # None: a lab {"id", "qty"} event
DAY = 86_400_000


class StoreModel(Model):
    """The contract's model, plus what the product adds."""

    def __init__(self) -> None:
        super().__init__()
        self.cancels: list[tuple] = []
        self.attempt_rows: list[tuple[int, str]] = []  # (seq, job id) of each attempts row
        self.stale = 0

    def enqueue_event(self, job_id: str, body: Optional[dict], now: int,
                      policy: RetryPolicy, available_at: int) -> object:
        text, digest = canonical_body(body) if body is not None else (None, None)
        qty = 0 if body is not None else 1
        job = self.jobs.get(job_id)
        if job is not None:
            return False if (job["qty"], job["digest"]) == (qty, digest) else Conflict
        self.enqueue(job_id, qty, available_at, policy.ttl_ms, policy.max_attempts)
        self.jobs[job_id].update(body=text, digest=digest, done_by=None, done_started_ms=None,
                                 done_latency_ms=None, done_http_status=None, done_after=None)
        return True

    def record(self, ticket: dict, status: object, seen: Attempt) -> None:
        """A finish's evidence: on a done job's row (after the newest attempts
        row), else a new attempts row (a rowid: the largest + 1)."""
        last = max((seq for seq, _ in self.attempt_rows), default=0)
        if status == "done":
            self.jobs[ticket["id"]].update(done_by=ticket["owner"],
                                           done_started_ms=seen.started_ms,
                                           done_latency_ms=seen.latency_ms,
                                           done_http_status=seen.http_status, done_after=last)
        else:
            self.attempt_rows.append((last + 1, ticket["id"]))

    def cancel(self, job_id: str, now: int, note: str) -> object:
        job = self.jobs.get(job_id)
        if job is None or job["reason"] == "cancelled" or job["status"] not in (
                "pending", "dead"):
            return ValueError
        was = job["status"] if job["reason"] is None else f"{job['status']}/{job['reason']}"
        self.cancels.append((job_id, job["token"], now, note, was))
        job.update(status="dead", reason="cancelled", available_at=now)
        return True

    def prune(self, before: int, limit: int) -> int:
        old = sorted((job for job in self.jobs.values()
                      if job["status"] == "done" and job["available_at"] < before),
                     key=lambda job: (job["available_at"], job["seq"]))[:limit]
        for job in old:
            del self.jobs[job["id"]]
            self.audits = [a for a in self.audits if a["id"] != job["id"]]
            self.cancels = [c for c in self.cancels if c[0] != job["id"]]
            self.attempt_rows = [r for r in self.attempt_rows if r[1] != job["id"]]
        return len(old)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp())
        self.con = store.open_store(self.folder / "q.db")
        self.model = StoreModel()
        self.now = 1_000
        self.tickets: list[dict] = []

    def teardown(self) -> None:
        self.con.close()
        shutil.rmtree(self.folder)

    @rule(job_id=st.sampled_from(IDS), body=st.sampled_from(BODIES),
          ttl=st.sampled_from([50, 500, 3 * DAY, 30 * DAY]),
          max_attempts=st.sampled_from([1, 2, 25, 50]), delay=st.sampled_from([0, 0, 100]))
    def enqueue(self, job_id: str, body: Optional[dict], ttl: int, max_attempts: int,
                delay: int) -> None:
        policy = RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl)
        event = {"id": job_id, "qty": 1} if body is None else {"id": job_id, "body": body}
        expected = self.model.enqueue_event(job_id, body, self.now, policy, self.now + delay)
        [got] = store.enqueue_events(self.con, [event], self.now, policy,
                                     not_before_ms=self.now + delay if delay else None)
        assert (Conflict if isinstance(got, Conflict) else got) == expected

    @rule(owner=st.sampled_from(OWNERS), lease=st.sampled_from([10, 200, 3_600_000]),
          limit=st.integers(1, 3))
    def claim(self, owner: str, lease: int, limit: int) -> None:
        expected = []
        for _ in range(limit):
            ticket = self.model.claim(owner, self.now, lease)
            if ticket is None:
                break
            expected.append(ticket)
        jobs, _ = store.claim_jobs(self.con, owner, self.now, lease, limit)
        assert [job.ticket for job in jobs] == expected
        assert [job.body for job in jobs] == [self.model.jobs[t["id"]]["body"] for t in expected]
        self.tickets.extend(expected)

    @rule(owner=st.sampled_from(OWNERS), outcome=st.sampled_from(["ok", "ok", "retry",
                                                                 "permanent"]))
    def deliver(self, owner: str, outcome: str) -> None:
        """The common path: claim one and finish it at once."""
        before = len(self.tickets)
        self.claim(owner, 1000, 1)
        if len(self.tickets) > before:
            ticket = self.tickets[-1]
            status = self.model.finish(ticket, outcome, self.now, 0)
            job = self.model.jobs[ticket["id"]]
            assert store.finish_jobs(self.con, [(ticket, outcome, 0, Attempt(self.now))],
                                     self.now) == [(status, job["reason"])]
            self.model.record(ticket, status, Attempt(self.now))

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        items = data.draw(st.lists(st.tuples(
            st.sampled_from(self.tickets),
            st.sampled_from(["ok", "retry", "permanent", None]),
            st.sampled_from([0, 30, 3_600_000])), min_size=1, max_size=3))
        expected: list = []
        for ticket, outcome, delay in items:
            if outcome is None:
                expected.append(("leased", None))
                self.model.record(ticket, "leased", Attempt(self.now))
                continue
            status = self.model.finish(ticket, outcome, self.now, delay)
            job = self.model.jobs.get(ticket["id"])
            expected.append(False if status is False else (status, job and job["reason"]))
            self.model.record(ticket, status, Attempt(self.now, 1))
        got = store.finish_jobs(self.con, [(t, o, d, Attempt(self.now, 1, None, None))
                                           for t, o, d in items], self.now)
        assert got == expected
        self.model.stale += expected.count(False)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), lease=st.sampled_from([10, 3_600_000]))
    def extend(self, data: st.DataObject, lease: int) -> None:
        ticket = data.draw(st.sampled_from(self.tickets))
        expected = self.model.extend(ticket, self.now, lease)
        got = store.extend_lease(self.con, ticket, self.now, lease)
        assert got == expected
        if got:
            assert isinstance(got, dict)
            self.tickets.append(got)

    @rule(job_id=st.sampled_from(IDS), ttl=st.sampled_from([50, 7 * DAY]))
    def redrive(self, job_id: str, ttl: int) -> None:
        try:
            expected: object = self.model.redrive(job_id, self.now, ttl, "fixed it, #42")
        except ValueError:
            expected = ValueError
        [got] = store.redrive_jobs(self.con, [job_id], self.now, ttl, "fixed it, #42")
        assert (ValueError if isinstance(got, ValueError) else got) == expected

    @rule(job_id=st.sampled_from(IDS))
    def cancel(self, job_id: str) -> None:
        expected = self.model.cancel(job_id, self.now, "withdrawn")
        [got] = store.cancel_jobs(self.con, [job_id], self.now, "withdrawn")
        assert (ValueError if isinstance(got, ValueError) else got) == expected

    @rule(age=st.sampled_from([0, 100, DAY]), limit=st.integers(1, 3))
    def prune(self, age: int, limit: int) -> None:
        before = max(0, self.now - age)
        expected = self.model.prune(before, limit)
        assert store.prune_done(self.con, before, limit) == expected

    @rule(step=st.sampled_from([0, 1, 1, 10, 10, 100, 3_600_000, DAY]))
    def advance(self, step: int) -> None:
        self.now += step

    @rule(data=st.data())
    def advance_to_a_boundary(self, data: st.DataObject) -> None:
        marks = sorted({v for job in self.model.jobs.values()
                        for v in (job["lease_until"], job["deadline"], job["available_at"])
                        if v is not None and v > self.now})
        if marks:
            self.now = data.draw(st.sampled_from(marks))

    @invariant()
    def file_equals_model(self) -> None:
        assert rows(self.con) == sorted(self.model.jobs.values(), key=lambda j: j["seq"])
        assert [{k: v for k, v in r.items() if k != "seq"} for r in rows(self.con, "redrives")
                ] == [{k: v for k, v in a.items() if k != "seq"} for a in self.model.audits]
        assert [(c["id"], c["token"], c["at_ms"], c["note"], c["was"])
                for c in rows(self.con, "cancels")] == self.model.cancels
        assert store.stale_finishes(self.con) == self.model.stale
        assert [(r["seq"], r["id"]) for r in rows(self.con, "attempts")
                ] == self.model.attempt_rows
        assert not self.con.in_transaction


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50,
                                          deadline=None)
test_store_matches_its_model = StoreMachine.TestCase
