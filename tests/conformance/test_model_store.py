"""Model-based test of every store: payload and lab events, budgets of days and
tens of attempts, the evidence of every attempt, cancel, prune and redrive,
against the contract's model extended by what the product adds.

The machine speaks to the store interface only, so every store runs it; after
every step the queue the interface shows equals the model row for row: each
job's whole row (its seq as its place in the queue), each job's attempts in
the order they were written, the redrive and cancel audit rows in order, the
stale finishes, the counts and the snapshot.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lease.policy import RetryPolicy, canonical_body
from lease.records import Attempt
from lease.worker import Conflict
from tests.support.model import Model

from .conftest import Queues
from .helpers import history, job_rows

IDS = ["order-1", "tenant_7", "3f2b8c1e-9a4d"]  # valid for lab and payload events alike
OWNERS = ["o1", "o2"]
BODIES = [None, {"v": 1}, {"v": 2, "w": [1, "x"]}]  # None: a lab {"id", "qty"} event
SEEN = [(None, None, None), (12, 200, None), (3, 503, "receiver answered 503"),
        (None, None, "ConnectionRefusedError: [Errno 111]")]  # latency, status, error
DAY = 86_400_000
PRIORITIES = [None, None, 0, 3, -3, 100]  # None: an event without one (0)


class StoreModel(Model):
    """The contract's model, plus what the product adds."""

    def __init__(self) -> None:
        super().__init__()
        self.cancels: list[tuple] = []
        # every attempt written, by job id and in the order of writing: what
        # job_history shows (an id's rows outlive its job until prune takes them)
        self.attempts: dict[str, list[dict]] = {}
        self.stale = 0

    def claim_order(self, job: dict) -> tuple[int, int]:
        """The higher priority first, then seq."""
        return (-job["priority"], job["seq"])

    def enqueue_event(self, job_id: str, body: dict | None, now: int,
                      policy: RetryPolicy, available_at: int, priority: int = 0) -> object:
        text, digest = canonical_body(body) if body is not None else (None, None)
        qty = 0 if body is not None else 1
        job = self.jobs.get(job_id)
        if job is not None:
            # a duplicate keeps its priority: how a job is scheduled is no content
            return False if (job["qty"], job["digest"]) == (qty, digest) else Conflict
        self.enqueue(job_id, qty, available_at, policy.ttl_ms, policy.max_attempts)
        self.jobs[job_id].update(body=text, digest=digest, done_by=None, done_started_ms=None,
                                 done_latency_ms=None, done_http_status=None,
                                 ordering_key=None, held=0,  # unkeyed: never held
                                 endpoint=None, message=None, event_type=None,
                                 trace=None,  # enqueued outside any span
                                 priority=priority)
        return True

    def record(self, ticket: dict, outcome: str | None, result: object, now: int,
               seen: Attempt) -> None:
        """A finish's evidence: the delivering attempt on its job's row, any
        other one an attempts row; both in the history, in the order written."""
        written = self.attempts.setdefault(ticket["id"], [])
        if result is not False and result[0] == "done":  # type: ignore[index]
            self.jobs[ticket["id"]].update(
                done_by=ticket["owner"], done_started_ms=seen.started_ms,
                done_latency_ms=seen.latency_ms, done_http_status=seen.http_status)
            written.append(self._attempt(ticket, "ok", "done", None, now,
                                         seen._replace(error=None)))
            return
        status, reason = ("stale", None) if result is False else result  # type: ignore[misc]
        if result is False:
            self.stale += 1
        written.append(self._attempt(ticket, outcome or "none", status, reason, now, seen))

    @staticmethod
    def _attempt(ticket: dict, outcome: str, result: str, reason: str | None, now: int,
                 seen: Attempt) -> dict:
        return {"token": ticket["token"], "attempt": ticket["attempt"],
                "owner": ticket["owner"], "started_ms": seen.started_ms, "ended_ms": now,
                "outcome": outcome, "result": result, "reason": reason,
                "http_status": seen.http_status, "error": seen.error,
                "latency_ms": seen.latency_ms}

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
            self.attempts.pop(job["id"], None)
        return len(old)

    def rows(self) -> list[dict]:
        """The jobs as the interface shows them: in seq order, the seq a rank."""
        ordered = sorted(self.jobs.values(), key=lambda job: job["seq"])
        return [{**job, "seq": rank} for rank, job in enumerate(ordered, 1)]

    def snapshot(self, now: int) -> dict[str, Any]:
        jobs = list(self.jobs.values())
        by_status = Counter(job["status"] for job in jobs)
        unfinished = [job["available_at"] for job in jobs
                      if job["status"] in ("pending", "leased")]
        ready = [job["available_at"] for job in jobs
                 if job["status"] == "pending" and job["available_at"] <= now]
        return {
            "jobs": len(jobs),
            "by_status": {s: by_status[s] for s in ("pending", "leased", "done", "dead")},
            "oldest_unfinished_age_ms": max(0, now - min(unfinished)) if unfinished else None,
            "oldest_ready_age_ms": now - min(ready) if ready else None,
            "expired_leases": sum(1 for job in jobs if job["status"] == "leased"
                                  and job["lease_until"] <= now),
            "live_leases": sum(1 for job in jobs if job["status"] == "leased"
                               and job["lease_until"] > now),
            "attempts": {str(k): v for k, v in sorted(Counter(
                job["attempts"] for job in jobs).items())},
            "dead_by_reason": dict(Counter(job["reason"] for job in jobs
                                           if job["status"] == "dead")),
            "redrives": len(self.audits),
            "redriven_jobs": len({audit["id"] for audit in self.audits}),
            "redrives_last_day": sum(1 for audit in self.audits if audit["at_ms"] > now - DAY),
            "cancels": len(self.cancels),
            "cancels_last_day": sum(1 for cancel in self.cancels if cancel[2] > now - DAY),
            "attempts_recorded": sum(len(rows) for rows in self.attempts.values()),
            "stale_finishes": self.stale,
            "blocked_keys": 0,  # no keys here: tests/conformance/test_store_ordering.py
            "blocked_jobs": 0,
        }


class StoreMachine(RuleBasedStateMachine):
    def __init__(self, queues: Queues) -> None:
        super().__init__()
        self.stack = contextlib.ExitStack()
        self.store = self.stack.enter_context(queues.fresh())
        self.model = StoreModel()
        self.now = 1_000
        self.tickets: list[dict] = []

    def teardown(self) -> None:
        self.stack.close()

    def _finish(self, items: list) -> None:
        """Finish ``items`` (ticket, outcome, delay, Attempt) on the store and the model."""
        expected: list = []
        for ticket, outcome, delay, seen in items:
            if outcome is None:
                expected.append(("leased", None))
            else:
                status = self.model.finish(ticket, outcome, self.now, delay)
                job = self.model.jobs.get(ticket["id"])
                expected.append(False if status is False else (status, job and job["reason"]))
            self.model.record(ticket, outcome, expected[-1], self.now, seen)
        assert self.store.finish_jobs(items, now_ms=self.now) == expected

    @rule(job_id=st.sampled_from(IDS), body=st.sampled_from(BODIES),
          ttl=st.sampled_from([50, 500, 3 * DAY, 30 * DAY]),
          max_attempts=st.sampled_from([1, 2, 25, 50]), delay=st.sampled_from([0, 0, 100]),
          priority=st.sampled_from(PRIORITIES))
    def enqueue(self, job_id: str, body: dict | None, ttl: int, max_attempts: int,
                delay: int, priority: int | None) -> None:
        policy = RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl)
        event: dict[str, Any] = {"id": job_id, "qty": 1} if body is None \
            else {"id": job_id, "body": body}
        if priority is not None:
            event["priority"] = priority
        expected = self.model.enqueue_event(job_id, body, self.now, policy, self.now + delay,
                                            priority or 0)
        [got] = self.store.enqueue_events([event], policy, now_ms=self.now,
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
        claimed = self.store.claim_jobs(owner, lease, limit, now_ms=self.now)
        assert [leased.ticket for leased in claimed.leased] == expected
        assert [leased.body for leased in claimed.leased] == [
            self.model.jobs[t["id"]]["body"] for t in expected]
        assert claimed.now_ms == self.now
        self.tickets.extend(expected)

    @rule(owner=st.sampled_from(OWNERS), outcome=st.sampled_from(["ok", "ok", "retry",
                                                                 "permanent"]),
          seen=st.sampled_from(SEEN))
    def deliver(self, owner: str, outcome: str, seen: tuple) -> None:
        """The common path: claim one and finish it at once."""
        before = len(self.tickets)
        self.claim(owner, 1000, 1)
        if len(self.tickets) > before:
            self._finish([(self.tickets[-1], outcome, 0, Attempt(self.now, *seen))])

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        items = data.draw(st.lists(st.tuples(
            st.sampled_from(self.tickets),
            st.sampled_from(["ok", "retry", "permanent", None]),
            st.sampled_from([0, 30, 3_600_000]),
            st.sampled_from(SEEN)), min_size=1, max_size=3))
        self._finish([(t, o, d, Attempt(self.now, *seen)) for t, o, d, seen in items])

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), lease=st.sampled_from([10, 3_600_000]))
    def extend(self, data: st.DataObject, lease: int) -> None:
        ticket = data.draw(st.sampled_from(self.tickets))
        expected = self.model.extend(ticket, self.now, lease)
        got = self.store.extend_lease(ticket, lease, now_ms=self.now)
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
        [got] = self.store.redrive_jobs([job_id], ttl, "fixed it, #42", now_ms=self.now)
        assert (ValueError if isinstance(got, ValueError) else got) == expected

    @rule(job_id=st.sampled_from(IDS))
    def cancel(self, job_id: str) -> None:
        expected = self.model.cancel(job_id, self.now, "withdrawn")
        [got] = self.store.cancel_jobs([job_id], "withdrawn", now_ms=self.now)
        assert (ValueError if isinstance(got, ValueError) else got) == expected

    @rule(age=st.sampled_from([0, 100, DAY]), limit=st.integers(1, 3))
    def prune(self, age: int, limit: int) -> None:
        before = max(0, self.now - age)
        expected = self.model.prune(before, limit)
        assert self.store.prune_done(before, limit) == expected

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
    def queue_equals_model(self) -> None:
        rows = job_rows(self.store)
        assert rows == self.model.rows()
        histories = {row["id"]: history(self.store, row["id"]) for row in rows}
        for job_id, found in histories.items():
            assert found["attempts"] == self.model.attempts.get(job_id, []), job_id
        redrives = sorted((audit["seq"], job_id, audit["token"], audit["at_ms"], audit["note"])
                          for job_id, found in histories.items() for audit in found["redrives"])
        assert [r[1:] for r in redrives] == [(a["id"], a["token"], a["at_ms"], a["note"])
                                             for a in self.model.audits]
        cancels = sorted((c["seq"], job_id, c["token"], c["at_ms"], c["note"], c["was"])
                         for job_id, found in histories.items() for c in found["cancels"])
        assert [c[1:] for c in cancels] == self.model.cancels
        assert self.store.stale_finishes() == self.model.stale
        assert self.store.snapshot(self.now) == self.model.snapshot(self.now)


def test_store_matches_its_model(queues: Queues) -> None:
    run_state_machine_as_test(lambda: StoreMachine(queues),
                              settings=queues.settings(150, 25, stateful_step_count=50))
