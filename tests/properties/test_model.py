"""Model-based test: a pure Python model of the contract beside a real queue file.

Hypothesis drives random sequences of enqueue (new, duplicate, conflicting),
claim and claim_many, finish and finish_many (fresh and stale tickets, every
outcome), extend, redrive, and a clock that moves — by small steps and to
exact boundaries (a lease's end, a deadline, a retry's available_at). After
every step the file equals the model row for row, and the invariants hold.
The model is written from the contract's text, independently of lease.worker.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lease import worker
from lease.worker import Conflict
from tests.support.model import Model
from tests.support.queues import rows

IDS = ["a", "b", "c", "d"]
OWNERS = ["o1", "o2"]


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp())
        self.con = worker.open_queue(self.folder / "q.db")
        self.model = Model()
        self.now = 1_000
        self.tickets: list[dict] = []
        self.max_token: dict[str, int] = {}
        self.done: set[str] = set()
        self.dead: set[str] = set()
        self.redrives = 0

    def teardown(self) -> None:
        self.con.close()
        shutil.rmtree(self.folder)

    # ------------------------------------------------------------- rules

    @rule(job_id=st.sampled_from(IDS), qty=st.integers(1, 2),
          ttl=st.sampled_from([1, 20, 100, 500]), max_attempts=st.integers(1, 3))
    def enqueue(self, job_id: str, qty: int, ttl: int, max_attempts: int) -> None:
        event = {"id": job_id, "qty": qty}
        try:
            expected: object = self.model.enqueue(job_id, qty, self.now, ttl, max_attempts)
        except Conflict:
            expected = Conflict
        try:
            got: object = worker.enqueue(self.con, event, self.now, ttl, max_attempts)
        except Conflict:
            got = Conflict
        assert got == expected

    @rule(owner=st.sampled_from(OWNERS), lease=st.sampled_from([1, 10, 50, 200]))
    def claim(self, owner: str, lease: int) -> None:
        expected = self.model.claim(owner, self.now, lease)
        got = worker.claim(self.con, owner, self.now, lease)
        assert got == expected
        if got is not None:
            self.tickets.append(got)

    @rule(owner=st.sampled_from(OWNERS), lease=st.sampled_from([1, 10, 50, 200]),
          limit=st.integers(1, 4))
    def claim_many(self, owner: str, lease: int, limit: int) -> None:
        expected = []
        for _ in range(limit):
            ticket = self.model.claim(owner, self.now, lease)
            if ticket is None:
                break
            expected.append(ticket)
        got = worker.claim_many(self.con, owner, self.now, lease, limit)
        assert got == expected
        self.tickets.extend(got)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "retry", "permanent"]),
          delay=st.sampled_from([0, 5, 30, 200]))
    def finish(self, data: st.DataObject, outcome: str, delay: int) -> None:
        ticket = data.draw(st.sampled_from(self.tickets))
        assert worker.finish(self.con, ticket, outcome, self.now, delay) == self.model.finish(
            ticket, outcome, self.now, delay)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def finish_many(self, data: st.DataObject) -> None:
        items = data.draw(st.lists(st.tuples(
            st.sampled_from(self.tickets), st.sampled_from(["ok", "retry", "permanent"]),
            st.sampled_from([0, 5, 30])), max_size=4))
        expected = [self.model.finish(t, o, self.now, d) for t, o, d in items]
        assert worker.finish_many(self.con, items, self.now) == expected

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), lease=st.sampled_from([1, 10, 100]))
    def extend(self, data: st.DataObject, lease: int) -> None:
        ticket = data.draw(st.sampled_from(self.tickets))
        expected = self.model.extend(ticket, self.now, lease)
        got = worker.extend(self.con, ticket, self.now, lease)
        assert got == expected
        if got:
            assert isinstance(got, dict)
            self.tickets.append(got)

    @rule(job_id=st.sampled_from(IDS), ttl=st.sampled_from([1, 50, 300]))
    def redrive(self, job_id: str, ttl: int) -> None:
        try:
            expected: object = self.model.redrive(job_id, self.now, ttl, "fix")
        except ValueError:
            expected = ValueError
        try:
            got: object = worker.redrive(self.con, job_id, self.now, ttl, "fix")
        except ValueError:
            got = ValueError
        assert got == expected
        if got is True:
            self.redrives += 1
            self.dead.discard(job_id)

    @precondition(lambda self: self.tickets)
    @rule(before=st.sampled_from([0, 1]), outcome=st.sampled_from(["ok", "retry", "permanent"]))
    def finish_latest_at_its_lease_end(self, before: int, outcome: str) -> None:
        """The newest ticket, finished exactly at (or 1 ms before) its lease's end."""
        ticket = self.tickets[-1]
        self.now = max(self.now, ticket["lease_until"] - before)
        assert worker.finish(self.con, ticket, outcome, self.now, 0) == self.model.finish(
            ticket, outcome, self.now, 0)

    @rule(step=st.sampled_from([0, 1, 4, 9, 10, 11, 50, 100, 499, 500]))
    def advance(self, step: int) -> None:
        self.now += step

    @rule(data=st.data())
    def advance_to_a_boundary(self, data: st.DataObject) -> None:
        marks = sorted({v for job in self.model.jobs.values()
                        for v in (job["lease_until"], job["deadline"], job["available_at"])
                        if v is not None and v > self.now})
        if marks:
            self.now = data.draw(st.sampled_from(marks))

    # ------------------------------------------------------------- invariants

    @invariant()
    def file_equals_model(self) -> None:
        assert rows(self.con) == sorted(self.model.jobs.values(), key=lambda j: j["seq"])
        assert rows(self.con, "redrives") == self.model.audits
        assert not self.con.in_transaction

    @invariant()
    def contract_invariants(self) -> None:
        for job in self.model.jobs.values():
            job_id = job["id"]
            assert job["token"] >= self.max_token.get(job_id, 0), "a token went down"
            self.max_token[job_id] = job["token"]
            if job_id in self.done:
                assert job["status"] == "done", "done is final"
            if job_id in self.dead:
                assert job["status"] == "dead", "dead leaves only by redrive"
            if job["status"] == "leased":
                assert job["owner"] is not None and job["lease_until"] <= job["deadline"]
                assert job["attempts"] <= job["max_attempts"]
            else:
                assert job["owner"] is None and job["lease_until"] is None
            if job["status"] == "done":
                self.done.add(job_id)
            if job["status"] == "dead":
                self.dead.add(job_id)
        assert len(self.model.audits) == self.redrives


QueueMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                          deadline=None)
test_queue_matches_its_model = QueueMachine.TestCase
