"""A send and its lease: a send starts only when its lease can cover it, and a
send longer than the lease keeps it by extension, over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from asyncworker import Dispatcher
from lease.policy import DEFAULT_POLICY, RetryPolicy
from lease.sqlite import open_store
from tests.support.dispatching import FakeClock, attempts, enqueue, wall_ms
from tests.support.queues import T0, job
from tests.support.servers import HostileServer, ack_for

ONE_TRY = RetryPolicy(max_attempts=1, ttl_ms=1000)  # a deadline 1 s after the intake


async def test_a_send_never_starts_with_less_than_the_margin_left(queue_path: Path):
    """The lease is capped by the deadline and less than the finish's margin is
    left at the claim: the keeper, which ticks, has not cut it yet, but the send
    must not start (the receiver could apply it and the finish be refused)."""
    enqueue(queue_path, [{"id": "late", "qty": 3}], ONE_TRY)
    sent: list[str] = []

    async def send(event: dict, token: int) -> bool:
        sent.append(event["id"])
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=FakeClock(T0 + 300),
                          lease_ms=4000) as d:
        assert d.finish_margin_ms == 800 and d.send_timeout_ms is None
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert sent == [] and (stats.ok, stats.stale, stats.dead_by_reason["exhausted"]) == (0, 0, 1)
    [seen] = attempts(queue_path, "late")
    assert (seen["token"], seen["outcome"], seen["result"], seen["error"]) == (
        1, "retry", "dead", "Retryable: the lease left (700 ms, capped by the job's deadline) "
                           "does not cover the 800 ms kept for the finish; not sent")


@pytest.mark.parametrize("send_timeout_ms", [None, 150])
async def test_over_http_a_capped_lease_that_cannot_cover_the_send_sends_nothing(
        queue_path: Path, send_timeout_ms):
    """700 ms left, capped: less than the margin (the default: the lease bounds
    the send), or than a 150 ms timeout plus it. Not one byte reaches the receiver."""
    enqueue(queue_path, [{"id": "late", "qty": 3}], ONE_TRY)
    with HostileServer(ack_for()) as server:
        async with Dispatcher(queue_path, "d1", url=server.url, clock=FakeClock(T0 + 300),
                              lease_ms=4000, send_timeout_ms=send_timeout_ms) as d:
            stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert server.requests == [] and stats.dead_by_reason["exhausted"] == 1
    [seen] = attempts(queue_path, "late")
    needs = "" if send_timeout_ms is None else "the send's timeout (150 ms) plus "
    assert seen["error"] == (
        f"Retryable: the lease left (700 ms, capped by the job's deadline) does not cover "
        f"{needs}the 800 ms kept for the finish; not sent")


async def test_by_default_a_send_near_the_deadline_takes_what_its_lease_leaves(
        queue_path: Path):
    """A lease capped by a deadline 1 s ahead and no timeout of the send's own:
    it is bounded by the 1000 ms left less the 800 ms margin, and sent."""
    enqueue(queue_path, [{"id": "late", "qty": 3}], ONE_TRY)
    with HostileServer(ack_for()) as server:
        async with Dispatcher(queue_path, "d1", url=server.url, clock=FakeClock(T0),
                              lease_ms=4000) as d:
            stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert len(server.requests) == 1 and stats.ok == 1


@pytest.mark.parametrize(("claimed_at", "sends"), [(T0, 1), (T0 + 300, 0)])
async def test_a_capped_lease_must_cover_the_send_timeout_and_the_margin(
        queue_path: Path, claimed_at: int, sends: int):
    """1000 ms to the deadline covers a 150 ms timeout and the 800 ms margin;
    700 ms does not, though it is more than the margin alone."""
    enqueue(queue_path, [{"id": "late", "qty": 3}], ONE_TRY)
    sent: list[str] = []

    async def send(event: dict, token: int) -> bool:
        sent.append(event["id"])
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=FakeClock(claimed_at),
                          lease_ms=4000, send_timeout_ms=150) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert len(sent) == stats.ok == sends
    if not sends:
        [seen] = attempts(queue_path, "late")
        assert seen["error"] == (
            "Retryable: the lease left (700 ms, capped by the job's deadline) does not cover "
            "the send's timeout (150 ms) plus the 800 ms kept for the finish; not sent")


async def test_a_send_of_the_callers_is_bounded_by_the_send_timeout(queue_path: Path):
    enqueue(queue_path, [{"id": "stuck", "qty": 3}], RetryPolicy(max_attempts=1))

    async def stuck(event: dict, token: int) -> bool:
        await asyncio.Event().wait()
        return True

    async with Dispatcher(queue_path, "d1", send=stuck, clock=FakeClock(T0), lease_ms=60_000,
                          send_timeout_ms=100) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert stats.dead_by_reason["exhausted"] == 1
    [seen] = attempts(queue_path, "stuck")
    assert (seen["outcome"], seen["error"]) == ("retry", "Retryable: timed out after 0.1s")


@pytest.mark.parametrize("value", [0, -1, DEFAULT_POLICY.ttl_ms + 1, 1.5, True, "1000"])
def test_the_send_timeout_is_checked(queue_path: Path, value: object):
    with pytest.raises(ValueError, match=r"send_timeout_ms must be an int in 1\.\.259200000 "
                                         r"\(the retry budget"):
        Dispatcher(queue_path, "d1", url="http://127.0.0.1:1/events",
                   send_timeout_ms=value)  # type: ignore[arg-type]


def test_the_send_timeout_is_the_lease_unless_given(queue_path: Path):
    d = Dispatcher(queue_path, "d1", url="http://127.0.0.1:1/events", lease_ms=30_000)
    assert (d.send_timeout_ms, d.finish_margin_ms) == (None, 2_000)
    longest = Dispatcher(queue_path, "d1", url="http://127.0.0.1:1/events",
                         send_timeout_ms=DEFAULT_POLICY.ttl_ms)
    assert longest.send_timeout_ms == DEFAULT_POLICY.ttl_ms  # up to the budget, inclusive


LEASE_MS = 300


@contextlib.asynccontextmanager
async def slow_receiver(answer_after_s: float) -> AsyncIterator[tuple[str, list[str]]]:
    """A real aiohttp receiver on 127.0.0.1 that ACKs each event after a while."""
    seen: list[str] = []

    async def events(request: web.Request) -> web.Response:
        event = await request.json()
        seen.append(event["id"])
        await asyncio.sleep(answer_after_s)  # a receiver that is slow, not one that waits on us
        return web.json_response({"id": event["id"]})

    app = web.Application()
    app.router.add_post("/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/events", seen
    finally:
        await runner.cleanup()


async def test_an_http_send_longer_than_its_lease_keeps_the_lease_by_extension(
        queue_path: Path):
    """The receiver answers after three leases; a send timeout longer than
    that lets the one request finish, its lease extended (fenced) meanwhile."""
    enqueue(queue_path, [{"id": "slow", "qty": 3}], RetryPolicy(max_attempts=1), now=wall_ms())
    async with slow_receiver(3 * LEASE_MS / 1000) as (url, seen), Dispatcher(
            queue_path, "d1", url=url, lease_ms=LEASE_MS, send_timeout_ms=10 * LEASE_MS) as d:
        started = time.perf_counter()
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
        took = time.perf_counter() - started
    assert seen == ["slow"] and took >= 3 * LEASE_MS / 1000
    assert (stats.ok, stats.retried, stats.stale, stats.dead, stats.claimed) == (1, 0, 0, 0, 1)
    assert stats.extended >= 3  # each extension adds one lease from its own moment
    [seen_attempt] = attempts(queue_path, "slow")
    assert (seen_attempt["token"], seen_attempt["outcome"], seen_attempt["result"]) == (
        1, "ok", "done")
    assert seen_attempt["latency_ms"] >= 3 * LEASE_MS
    con = open_store(queue_path)
    try:
        assert (job(con, "slow")["status"], job(con, "slow")["token"]) == ("done", 1)
    finally:
        con.close()


async def test_without_a_send_timeout_an_http_send_ends_within_its_lease(queue_path: Path):
    """The default: what the lease leaves, less the margin. The same slow
    receiver is a timeout, after at most 240 ms."""
    enqueue(queue_path, [{"id": "slow", "qty": 3}], RetryPolicy(max_attempts=1), now=wall_ms())
    async with slow_receiver(3 * LEASE_MS / 1000) as (url, seen), Dispatcher(
            queue_path, "d1", url=url, lease_ms=LEASE_MS) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert seen == ["slow"] and stats.dead_by_reason["exhausted"] == 1
    [seen_attempt] = attempts(queue_path, "slow")
    timed_out = re.fullmatch(r"Retryable: timed out after (0\.[0-9]+)s", seen_attempt["error"])
    assert timed_out and 0 < float(timed_out.group(1)) <= (LEASE_MS - 60) / 1000
