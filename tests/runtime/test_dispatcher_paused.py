"""A dispatcher on a paused queue keeps polling and leases nothing; ``run
--until-idle`` waits (a paused queue's pending jobs are not idle: they wait
for the resume), and sends once the queue is resumed from another connection. A dispatcher
registers its host and pid when it opens."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from asyncworker import Dispatcher
from lease.sqlite import SQLiteStore
from tests.support.dispatching import FakeClock, enqueue
from tests.support.queues import T0
from tests.support.waiting import WAIT_S


async def wait_for(condition, what: str) -> None:
    """Yield to the dispatcher until ``condition()`` holds (bounded by WAIT_S)."""
    async def until() -> None:
        while not condition():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(until(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_a_paused_queue_is_polled_not_leased_and_sent_once_resumed(queue_path: Path):
    enqueue(queue_path, [{"id": "a", "qty": 1}])
    with SQLiteStore(queue_path) as operator:
        operator.pause("hold", now_ms=T0)
    sent: list[str] = []

    async def send(event: dict, token: int) -> bool:
        sent.append(event["id"])
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=FakeClock(T0 + 1),
                          poll_interval=0.01) as d:
        run = asyncio.create_task(d.run(until_idle=True))
        await wait_for(lambda: d.stats.claim_calls >= 3, "three claims while paused")
        assert sent == [] and d.stats.claimed == 0 and not run.done()
        with SQLiteStore(queue_path) as operator:
            [me] = operator.workers(T0 + 1)  # registered when it opened
            assert (me["owner"], me["host"], me["pid"]) == ("d1", socket.gethostname(),
                                                           os.getpid())
            operator.resume("go", now_ms=T0 + 2)
        stats = await asyncio.wait_for(run, WAIT_S)
    assert sent == ["a"] and stats.ok == 1
