"""The dispatcher's life and its figures: stop is final, a failure shows at once,
every death is counted once by its reason, slots never exceed the concurrency."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncworker import Dispatcher, dispatcher_context, health_handler
from lease import worker
from lease.worker import Permanent, Retryable
from tests.support.dispatching import FakeClock, fill, statuses, until
from tests.support.queues import T0, add


async def _ok(event: dict, token: int) -> bool:
    return True


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "asyncworker.dispatcher" and r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- finish failures (defect 3)


async def test_a_failed_finish_is_counted_once_per_job_and_logged_once_per_group(
        queue_path: Path, caplog: pytest.LogCaptureFixture):
    fill(queue_path, 3, now=T0)
    clock = FakeClock(T0)

    async def send(event: dict, token: int) -> bool:
        clock.now = T0 - 1  # the clock stepped back: every finish is refused (ValueError)
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=clock, concurrency=3) as d:
        running = asyncio.create_task(d.run())
        await until(lambda: d.stats.errors >= 3 and d.stats.in_flight == 0)
        d.stop()
        stats = await running
    assert (stats.errors, stats.ok, stats.stale, stats.finish_batches) == (3, 0, 0, 0)
    logged = _errors(caplog)
    assert logged and all(r.exc_info is not None for r in logged)  # a traceback per group
    named = re.findall(r"job-\d", " ".join(r.getMessage() for r in logged))
    assert sorted(named) == ["job-0", "job-1", "job-2"]  # each job named once
    assert statuses(queue_path)["leased"] == 3  # left leased: the lease expiry recovers them


# ---------------------------------------------------------------- stop is final (defect 4)


async def test_a_stop_before_run_starts_is_kept(queue_path: Path):
    worker.open_queue(queue_path).close()
    async with Dispatcher(queue_path, "d1", send=_ok) as d:
        running = asyncio.create_task(d.run())
        d.stop()  # before the task's first step
        async with asyncio.timeout(10):
            stats = await running
        assert stats.claim_calls == 0 and d.state == "stopped"
        assert await asyncio.wait_for(d.run(), 10) is stats  # stop is final


async def test_an_application_cleaned_up_at_once_stops_its_dispatcher(queue_path: Path):
    worker.open_queue(queue_path).close()
    d = Dispatcher(queue_path, "svc", send=_ok)
    context = dispatcher_context(d)(web.Application())
    await anext(context)  # started: the run task exists and has not taken a step
    async with asyncio.timeout(10):  # no new task: the cleanup comes first
        assert await anext(context, None) is None
    assert d.state == "stopped" and d.stats.claim_calls == 0


async def test_state_goes_new_running_stopping_stopped(queue_path: Path):
    fill(queue_path, 1)
    release = asyncio.Event()

    async def send(event: dict, token: int) -> bool:
        await release.wait()
        return True

    async with Dispatcher(queue_path, "d1", send=send) as d:
        assert d.state == "new" and not d.stopping
        running = asyncio.create_task(d.run())
        await until(lambda: d.stats.sending == 1)
        assert d.state == "running"
        with pytest.raises(RuntimeError, match="already running"):
            await d.run()
        d.stop()
        assert d.state == "stopping"  # the send in flight finishes within its lease
        release.set()
        stats = await running
        assert d.state == "stopped" and d.failure is None and stats.ok == 1


# ---------------------------------------------------------------- failures show (defect 5)


async def _health_when(client: aiohttp.ClientSession, url: object,
                       condition: Callable[[dict], bool]) -> tuple[int, dict]:
    give_up = time.monotonic() + 20
    while True:
        async with client.get(str(url)) as response:
            answer = await response.json()
            if condition(answer):
                return response.status, answer
        assert time.monotonic() < give_up, f"health never matched: {answer}"
        await asyncio.sleep(0.01)


def _app(d: Dispatcher) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", health_handler(d))
    app.cleanup_ctx.append(dispatcher_context(d))
    return app


async def test_a_crashed_run_is_logged_and_answered_at_once(
        queue_path: Path, caplog: pytest.LogCaptureFixture):
    worker.open_queue(queue_path).close()
    d = Dispatcher(queue_path, "svc", send=_ok, clock=lambda: -1)  # a bad clock value
    server = TestServer(_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            status, answer = await _health_when(client, server.make_url("/health"),
                                                lambda a: a["state"] not in ("new", "running"))
        # While the application still serves, not only at its shutdown:
        assert (status, answer["state"], d.state, d.stopping) == (503, "failed", "failed", True)
        assert answer["failure"].startswith("ValueError") and "clock value" in answer["failure"]
        assert isinstance(d.failure, ValueError)
        [record] = _errors(caplog)
        assert record.exc_info is not None and record.exc_info[1] is d.failure
    finally:
        with pytest.raises(ValueError, match="clock value"):
            await server.close()  # and raised again at cleanup
    with pytest.raises(RuntimeError, match="failed"):
        await d.run()


async def test_health_is_200_while_running_and_503_once_stopped(queue_path: Path):
    worker.open_queue(queue_path).close()
    d = Dispatcher(queue_path, "svc", send=_ok, poll_interval=0.01)
    server = TestServer(_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            url = server.make_url("/health")
            status, answer = await _health_when(
                client, url, lambda a: a["last_claim_ms"] is not None)
            assert status == 200 and answer["state"] == "running"
            assert answer["failure"] is None and (answer["sending"], answer["in_flight"]) == (0, 0)
            assert abs(answer["last_claim_ms"] - time.time() * 1000) < 60_000
            d.stop()
            status, answer = await _health_when(client, url, lambda a: a["state"] == "stopped")
            assert status == 503
    finally:
        await server.close()


async def test_a_dead_lease_keeper_fails_the_run(queue_path: Path):
    fill(queue_path, 1)
    clock = FakeClock(int(time.time() * 1000))

    async def send(event: dict, token: int) -> bool:
        clock.now = -1  # from now on only the lease keeper reads the clock, and fails
        await asyncio.Event().wait()
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=clock, concurrency=1) as d:
        with pytest.raises(ValueError, match="clock value"):
            await asyncio.wait_for(d.run(), 20)  # was: returned as if all went well
        assert d.state == "failed" and isinstance(d.failure, ValueError)
        assert (d.stats.in_flight, d.stats.sending) == (0, 0)
    assert statuses(queue_path)["leased"] == 1


async def test_a_run_is_failed_from_the_moment_it_fails(queue_path: Path):
    fill(queue_path, 1)
    clock = FakeClock(int(time.time() * 1000))
    seen: list[str] = []

    async def send(event: dict, token: int) -> bool:
        clock.now = -1  # the next claim (a slot is free) reads a bad clock value
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(d.state)  # the run aborts this send while it unwinds
            raise
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=clock, concurrency=2) as d:
        with pytest.raises(ValueError, match="clock value"):
            await asyncio.wait_for(d.run(), 20)
    assert seen == ["failed"]


# ---------------------------------------------------------------- deaths (defect 6)


async def test_every_death_of_the_run_is_counted_by_its_reason(queue_path: Path):
    now = T0 + 100_000
    con = worker.open_queue(queue_path)
    for i in range(2):  # leased by a dispatcher that died, out of attempts
        add(con, f"spent-{i}", now=now - 10_000, max_attempts=1)
        assert worker.claim(con, "gone", now - 5_000, 1_000) is not None
    for i in range(3):  # past their deadline while pending
        add(con, f"late-{i}", now=T0, ttl=60_000)
    add(con, "refused", now=now)
    add(con, "once", now=now, max_attempts=1)
    add(con, "short", now=now - 59_990, ttl=60_000)  # 10 ms left: a retry cannot fit
    add(con, "fine", now=now)
    con.close()

    async def send(event: dict, token: int) -> bool:
        if event["id"] == "refused":
            raise Permanent("409")
        if event["id"] in ("once", "short"):
            raise Retryable("503")
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=FakeClock(now),
                          jitter=lambda: 1.0, poll_interval=0.01) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert (stats.ok, stats.dead, stats.quarantined, stats.claimed) == (1, 8, 5, 4)
    assert stats.dead_by_reason == {"deadline": 4, "exhausted": 3, "permanent": 1}
    assert stats.as_dict()["dead_by_reason"] == stats.dead_by_reason
    assert "permanent" not in stats.as_dict() and "peak_in_flight" not in stats.as_dict()
    assert statuses(queue_path) == {"pending": 0, "leased": 0, "done": 1, "dead": 8}


# ---------------------------------------------------------------- slots (defect 11)


async def test_send_slots_never_exceed_the_concurrency(queue_path: Path):
    concurrency = 4
    fill(queue_path, 40)
    now_sending = 0
    seen: list[tuple[int, int, int]] = []
    d: Dispatcher

    async def send(event: dict, token: int) -> bool:
        nonlocal now_sending
        now_sending += 1
        seen.append((now_sending, d.stats.sending, d.stats.in_flight))
        await asyncio.sleep(0.005)
        now_sending -= 1
        return True

    async with Dispatcher(queue_path, "d1", send=send, concurrency=concurrency,
                          batch_size=64) as d:
        stats = await d.run(until_idle=True)
    assert stats.ok == 40 and stats.peak_sending == concurrency
    assert all(sends <= slots <= concurrency and slots <= in_flight
               for sends, slots, in_flight in seen)
    assert (stats.sending, stats.in_flight) == (0, 0)
