"""A receiver outage of ten minutes, on a scaled clock: the default policy loses
nothing, the lab's would have lost everything.

The clock is injected and virtual: it stands still while any job is in
flight (a send takes no scaled time, so no lease runs out under it) and
moves one second per reading while the dispatcher is idle, waiting for its
retries to come due. Ten minutes of outage pass in about a second of real
time, with no sleep and no dependence on the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncworker import Dispatcher, DispatcherStats
from lease.http import ID_HEADER
from lease.policy import DEFAULT_POLICY, LAB_POLICY, RetryPolicy, canonical_body
from lease.sqlite import enqueue_events, open_store, reads
from tests.support.queues import T0

OUTAGE_MS = 10 * 60_000
STEP_MS = 1_000


class VirtualClock:
    """Milliseconds that move STEP_MS per reading, but only while ``busy()`` is false."""

    def __init__(self, start: int) -> None:
        self.now = start
        self.busy: Callable[[], bool] = lambda: False

    def __call__(self) -> int:
        if not self.busy():
            self.now += STEP_MS
        return self.now


class OutageReceiver:
    """Refuses every request with a 503 until the clock reaches ``until_ms``,
    then applies each job once (by its webhook-id) and answers its ACK."""

    def __init__(self, clock: VirtualClock, until_ms: int) -> None:
        self.clock = clock
        self.until_ms = until_ms
        self.refused = 0
        self.received: Counter[str] = Counter()
        self.applied: dict[str, bytes] = {}

    async def handle(self, request: web.Request) -> web.Response:
        job_id = request.headers[ID_HEADER]
        body = await request.read()
        if self.clock.now < self.until_ms:
            self.refused += 1
            return web.Response(status=503, text="down for maintenance")
        self.received[job_id] += 1
        self.applied.setdefault(job_id, body)  # a duplicate is absorbed, not applied again
        return web.json_response({"id": job_id})


def events(n: int) -> list[dict]:
    """Half lab events, half payload events."""
    return [{"id": f"lab-{i}", "qty": i + 1} if i % 2 else
            {"id": f"order:{i}", "body": {"order": i, "note": "outage"}} for i in range(n)]


async def run_through_outage(path: Path, n: int, policy: RetryPolicy | None,
                             draw: float = 0.0) -> tuple[DispatcherStats, OutageReceiver,
                                                         VirtualClock]:
    """Enqueue n jobs with the policy's budget and dispatch them until idle
    through the outage; policy None: the Dispatcher's default."""
    con = open_store(path)
    try:
        assert enqueue_events(con, events(n), T0, policy or DEFAULT_POLICY) == [True] * n
    finally:
        con.close()
    clock = VirtualClock(T0)
    receiver = OutageReceiver(clock, T0 + OUTAGE_MS)
    app = web.Application()
    app.router.add_post("/events", receiver.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    extra = {} if policy is None else {"policy": policy}
    try:
        async with Dispatcher(path, "d1", url=str(server.make_url("/events")), clock=clock,
                              jitter=lambda: draw, concurrency=64, poll_interval=0.001,
                              **extra) as d:
            clock.busy = lambda: d.stats.in_flight > 0
            stats = await asyncio.wait_for(d.run(until_idle=True), 50)
    finally:
        await server.close()
    return stats, receiver, clock


async def test_the_default_policy_rides_out_a_ten_minute_outage(queue_path: Path):
    n = 40
    # The worst draw for the budget (0.0): every delay its shortest, half its
    # step, so the outage spends as many attempts as it can.
    stats, receiver, clock = await run_through_outage(queue_path, n, None, 0.0)
    assert clock.now > T0 + OUTAGE_MS  # the outage really was sat through
    assert (stats.ok, stats.dead, stats.stale, stats.errors, stats.bad_acks) == (n, 0, 0, 0, 0)
    assert stats.dead_by_reason == {"deadline": 0, "exhausted": 0, "permanent": 0}
    assert receiver.refused == stats.retried > n * 5  # every job was refused many times
    assert set(receiver.received.values()) == {1}  # each delivered once after it
    con = reads.open_readonly(queue_path)
    try:
        assert reads.counts(con) == {"pending": 0, "leased": 0, "done": n, "dead": 0}
        spent = []
        for event in events(n):
            history = reads.job_history(con, event["id"])
            assert history is not None
            *refused, accepted = history["attempts"]
            assert all((a["outcome"], a["result"], a["http_status"]) == ("retry", "pending", 503)
                       for a in refused)
            assert (accepted["outcome"], accepted["result"]) == ("ok", "done")
            assert accepted["started_ms"] >= T0 + OUTAGE_MS
            spent.append(history["job"]["attempts"])
            sent = receiver.applied[event["id"]]
            if "body" in event:  # the payload is what was enqueued, byte for byte
                assert sent == canonical_body(event["body"])[0].encode()
            else:
                assert json.loads(sent) == event
    finally:
        con.close()
    # The policy's claim: ten minutes spend at most 12 of the 25 attempts.
    assert max(spent) <= 12 < DEFAULT_POLICY.max_attempts


@pytest.mark.parametrize("draw", [0.0, 1.0])
async def test_the_lab_policy_would_have_lost_every_job(queue_path: Path, draw: float):
    n = 10
    stats, receiver, clock = await run_through_outage(queue_path, n, LAB_POLICY, draw)
    assert (stats.ok, stats.dead) == (0, n)
    assert stats.dead_by_reason["exhausted"] == n  # three quick tries, all in the outage
    assert not receiver.received and clock.now < T0 + OUTAGE_MS
