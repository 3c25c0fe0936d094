"""The metrics scenario: seven jobs through one dispatcher on an injected clock,
each ending another way (ok, refused, flaky, no ACK, a lease run out, a deadline
past). The metrics and the log tests both read what it comes to."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncworker import Dispatcher, DispatcherStats
from lease.policy import RetryPolicy
from lease.stores import open_store
from lease.worker import Permanent, Retryable
from tests.support.dispatching import FakeClock

T = 1_800_000_000_000  # the injected clock's start: every store call is judged by it
LEASE_MS = 1_000
BODY_MARK = "card-4111-1111-1111-1111"  # in a job's body: never in a log line


POLICY = RetryPolicy(max_attempts=5, backoff_base_ms=10, backoff_cap_ms=10, ttl_ms=600_000,
                     lease_ms=LEASE_MS)


SCENARIO_JOBS = [{"id": "ok-0", "qty": 1}, {"id": "ok-1", "qty": 2},
                 {"id": "ok-body", "body": {"card": BODY_MARK}}, {"id": "refused", "qty": 3},
                 {"id": "flaky", "qty": 4}, {"id": "badack", "qty": 5}, {"id": "slow", "qty": 6}]


SENDS = 10  # seven first attempts, then flaky, badack and slow once more


def _with_status(error: Exception, status: int) -> Exception:
    error.http_status = status  # type: ignore[attr-defined]  # as the HTTP sender sets it
    return error


class Script:
    """The receiver's side of the scenario, one job at a time (concurrency 1):
    refused is refused for good (HTTP 409), flaky fails once (503), badack's
    first answer is no ACK, and slow's first send outlives its lease."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: Counter[str] = Counter()
        self.stats: DispatcherStats | None = None  # the dispatcher's, once it exists

    async def __call__(self, event: dict, token: int) -> object:
        job = event["id"]
        self.sent[job] += 1
        first = self.sent[job] == 1
        if job == "refused":
            raise _with_status(Permanent("receiver refused with 409"), 409)
        if first and job == "flaky":
            raise _with_status(Retryable("receiver answered 503"), 503)
        if first and job == "badack":
            return "not an ACK"
        if first and job == "slow":
            # The earlier jobs' finishes written first (a PostgreSQL store writes them
            # side by side with this claim), so only this lease runs out:
            while self.stats is not None and self.stats.in_flight > 1:
                await asyncio.sleep(0.005)
            self.clock.now = T + LEASE_MS + 1  # the lease ran out under this send
        return True


def enqueue_scenario(target: str) -> None:
    """late's deadline is past before the first claim: that claim quarantines it."""
    with open_store(target, create=True) as store:
        assert store.enqueue_events([{"id": "late", "qty": 9}], RetryPolicy(ttl_ms=1_000),
                                    now_ms=T - 2_000) == [True]
        assert store.enqueue_events(SCENARIO_JOBS, POLICY, now_ms=T) == [True] * 7


async def run_scenario(target: str, then: Callable[[Dispatcher], Any] | None = None
                       ) -> tuple[DispatcherStats, Any]:
    """The scenario to the end (until idle); ``then(d)`` is awaited while the
    dispatcher is still open (stopped)."""
    enqueue_scenario(target)
    clock = FakeClock(T)
    script = Script(clock)
    async with Dispatcher(target, "metrics-1", send=script, clock=clock, policy=POLICY,
                          concurrency=1, batch_size=1, jitter=lambda: 0.0,
                          poll_interval=0.01) as d:
        script.stats = d.stats
        stats = await asyncio.wait_for(d.run(until_idle=True), 40)
        after = None if then is None else await then(d)
    assert sum(script.sent.values()) == SENDS
    return stats, after

