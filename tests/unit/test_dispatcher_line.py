"""The line of claimed jobs waiting for a send slot (``prefetch``): a send that
ends starts the next job at once, an idle dispatcher hoards nothing, a stop
sends the line, an abort leaves it leased, and a lease that runs out in line
is never sent."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from asyncworker import Dispatcher
from asyncworker.dispatcher import DispatcherStats, SendSlots
from asyncworker.leases import Held
from lease.sqlite import SQLiteStore
from tests.support.dispatching import FakeClock, fill, statuses
from tests.support.queues import T0


def _held(n: int) -> Held:
    return Held({"id": f"job-{n}", "token": 1, "attempt": 1, "lease_until": T0 + 1000},
                {"id": f"job-{n}", "qty": 1}, T0, T0 + 500)


# ------------------------------------------------------------------ the slots alone


def test_an_idle_dispatcher_has_no_line():
    slots = SendSlots(4, DispatcherStats(), prefetch=4)
    slots.measure_line()
    assert (slots.line, slots.room) == (0, 4)
    for n in range(4):
        slots.take(_held(n))
    slots.measure_line()  # nothing ended since the claim before: still no line
    assert (slots.line, slots.room) == (0, 0)


def test_the_line_is_twice_the_most_sends_that_ended_between_two_claims():
    stats = DispatcherStats()
    slots = SendSlots(4, stats, prefetch=8)
    helds = [_held(n) for n in range(4)]
    for held in helds:
        slots.take(held)
    slots.measure_line()
    for held in helds[:2]:
        assert slots.give_back(held) is None  # nobody waits: the slot is free
    slots.measure_line()
    assert (slots.line, slots.room) == (4, 2 + 4)
    slots.give_back(helds[2])
    slots.give_back(helds[2])  # idempotent: a slot is given back once
    slots.measure_line()  # one ended since: the span before (2) still counts, twice
    assert (slots.ended, slots.line) == (3, 4)
    slots.measure_line()  # none ended: twice the span before (1)
    assert slots.line == 2
    slots.measure_line()  # none in either span: no line
    assert slots.line == 0
    assert stats.sending == 1


def test_a_line_never_outgrows_prefetch():
    slots = SendSlots(8, DispatcherStats(), prefetch=3)
    for n in range(8):
        held = _held(n)
        slots.take(held)
        slots.give_back(held)
    slots.measure_line()
    assert slots.line == 3
    unlined = SendSlots(8, DispatcherStats(), prefetch=0)
    held = _held(0)
    unlined.take(held)
    unlined.give_back(held)
    unlined.measure_line()
    assert (unlined.line, unlined.room) == (0, 8)


def test_a_slot_given_back_goes_to_the_first_in_line():
    stats = DispatcherStats()
    slots = SendSlots(1, stats, prefetch=2)
    sending, first, second = _held(0), _held(1), _held(2)
    slots.take(sending)
    slots.wait(first)
    slots.wait(second)
    assert stats.waiting == 2
    assert slots.give_back(sending) is first
    assert (first.has_slot, second.has_slot, stats.sending, stats.waiting) == (True, False, 1, 1)
    assert slots.drop_waiting() == [second]
    assert (stats.waiting, list(slots.waiting)) == (0, [])


@pytest.mark.parametrize("prefetch", [-1, 10_001, 1.5, "4", True])
def test_prefetch_must_be_a_count(queue_path: Path, prefetch: object):
    with pytest.raises(ValueError, match="prefetch must be an int in 0..10000"):
        Dispatcher(queue_path, "d1", send=_ok, prefetch=prefetch)  # type: ignore[arg-type]


def test_prefetch_defaults_to_twice_the_concurrency_at_most_twice_the_batch_size(
        queue_path: Path):
    assert Dispatcher(queue_path, "d1", send=_ok, concurrency=16).prefetch == 32
    assert Dispatcher(queue_path, "d1", send=_ok, concurrency=256, batch_size=64).prefetch == 128
    assert Dispatcher(queue_path, "d1", send=_ok, concurrency=10_000,
                      batch_size=10_000).prefetch == 10_000  # MAX_PREFETCH
    assert Dispatcher(queue_path, "d1", send=_ok, concurrency=8, prefetch=0).prefetch == 0


async def _ok(event: dict, token: int) -> bool:
    return True


# ------------------------------------------------------------------ a dispatcher's line


class Gates:
    """A send per job id that returns at once for ``instant`` ids and otherwise
    waits for its own gate; ``started`` lists the ids in the order sent."""

    def __init__(self, instant: set[str]) -> None:
        self.instant = instant
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.stats: DispatcherStats | None = None
        self.claims_at_start: dict[str, int] = {}  # each send's claim transactions so far

    async def send(self, event: dict, token: int) -> bool:
        self.started.append(event["id"])
        if self.stats is not None:
            self.claims_at_start[event["id"]] = self.stats.claim_calls
        if event["id"] not in self.instant:
            await self.gates.setdefault(event["id"], asyncio.Event()).wait()
        return True

    def open(self, job_id: str) -> None:
        self.gates.setdefault(job_id, asyncio.Event()).set()

    def open_all(self) -> None:
        for n in range(100):
            self.open(f"job-{n}")


async def _until(condition, what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _with_a_line(d: Dispatcher, gates: Gates) -> asyncio.Task:
    """Two instant sends, then two that hang in their slots and two in line."""
    running = asyncio.create_task(d.run())
    await _until(lambda: d.stats.sending == 2 and d.stats.waiting == 2, "a full line")
    assert gates.started == ["job-0", "job-1", "job-2", "job-3"]
    return running


async def test_a_send_that_ends_starts_the_first_in_line_without_a_claim(queue_path: Path):
    fill(queue_path, 10)
    gates = Gates({"job-0", "job-1"})
    async with Dispatcher(queue_path, "d1", send=gates.send, concurrency=2, prefetch=2) as d:
        gates.stats = d.stats
        running = await _with_a_line(d, gates)
        claims = d.stats.claim_calls
        gates.open("job-2")
        await _until(lambda: len(gates.started) == 5, "the next send")
        assert gates.started[-1] == "job-4"  # the first in line, in claim order
        assert gates.claims_at_start["job-4"] == claims  # started with no claim between
        gates.open_all()
        d.stop()
        stats = await running
    assert stats.ok == stats.claimed


async def test_a_graceful_stop_sends_the_line_too(queue_path: Path):
    fill(queue_path, 10)
    gates = Gates({"job-0", "job-1"})
    async with Dispatcher(queue_path, "d1", send=gates.send, concurrency=2, prefetch=2) as d:
        running = await _with_a_line(d, gates)
        d.stop()
        await asyncio.sleep(0.05)  # the run is waiting for its sends in flight now
        gates.open("job-2")
        gates.open("job-3")
        # the line's jobs start as those sends end, and still run after them
        await _until(lambda: len(gates.started) == 6, "the line's sends")
        await asyncio.sleep(0.05)
        gates.open_all()
        stats = await running
    assert (stats.claimed, stats.ok, stats.in_flight, stats.waiting) == (6, 6, 0, 0)
    assert sorted(gates.started) == [f"job-{n}" for n in range(6)]
    assert statuses(queue_path) == {"pending": 4, "leased": 0, "done": 6, "dead": 0}


async def test_an_abort_leaves_the_line_leased_and_unsent(queue_path: Path):
    fill(queue_path, 10)
    gates = Gates({"job-0", "job-1"})
    async with Dispatcher(queue_path, "d1", send=gates.send, concurrency=2, prefetch=2,
                          lease_ms=60_000) as d:
        running = await _with_a_line(d, gates)
        d.abort()
        stats = await running
    assert (stats.ok, stats.in_flight, stats.waiting) == (2, 0, 0)
    assert gates.started == ["job-0", "job-1", "job-2", "job-3"]  # the line never sent
    assert statuses(queue_path)["leased"] == 4  # two cut sends, two in line: they expire


async def test_a_claim_that_commits_after_an_abort_sends_nothing(queue_path: Path):
    fill(queue_path, 3)
    inside, release = threading.Event(), threading.Event()

    class SlowClaim(SQLiteStore):
        def claim_jobs(self, *args: Any, **kwargs: Any) -> Any:
            inside.set()
            release.wait(10)  # the claim is committing while the abort comes
            return super().claim_jobs(*args, **kwargs)

    gates = Gates(set())
    async with Dispatcher(lambda: SlowClaim(queue_path), "d1", send=gates.send,
                          concurrency=4, lease_ms=60_000) as d:
        running = asyncio.create_task(d.run())
        await _until(inside.is_set, "the claim")
        d.abort()
        release.set()
        stats = await running
    assert gates.started == []
    assert (stats.claimed, stats.in_flight, stats.sending, stats.waiting) == (3, 0, 0, 0)
    assert statuses(queue_path)["leased"] == 3  # left to their lease expiry


async def test_an_idle_dispatcher_claims_no_more_than_it_sends(queue_path: Path):
    fill(queue_path, 30)
    gates = Gates(set())
    async with Dispatcher(queue_path, "d1", send=gates.send, concurrency=4, prefetch=4,
                          poll_interval=0.005) as d:
        running = asyncio.create_task(d.run())
        await _until(lambda: d.stats.sending == 4, "four sends")
        await asyncio.sleep(0.2)  # many poll intervals: room enough to claim, if it would
        assert (d.stats.claimed, d.stats.waiting) == (4, 0)
        assert statuses(queue_path)["leased"] == 4  # the rest is left to other dispatchers
        gates.open_all()
        d.stop()
        await running


async def test_a_lease_that_runs_out_in_line_is_never_sent(queue_path: Path):
    clock = FakeClock(T0)
    fill(queue_path, 6, now=T0)
    gates = Gates({"job-0", "job-1"})
    async with Dispatcher(queue_path, "d1", send=gates.send, concurrency=2, prefetch=2,
                          lease_ms=1000, clock=clock) as d:
        running = await _with_a_line(d, gates)
        clock.now = T0 + 900  # past every lease's end less the finish margin: all cut off
        await _until(lambda: d.stats.retried == 4, "four retries")
        d.stop()
        stats = await running
    assert gates.started == ["job-0", "job-1", "job-2", "job-3"]  # job-4, job-5 never sent
    assert (stats.ok, stats.retried, stats.stale) == (2, 4, 0)
    with SQLiteStore(queue_path) as store:
        for job_id, said in (("job-2", "did not finish within its lease"),
                             ("job-4", "waited for a send slot")):
            history = store.job_history(job_id)
            assert history is not None
            assert (history["job"]["status"], history["job"]["attempts"]) == ("pending", 1)
            [attempt] = history["attempts"]
            assert attempt["outcome"] == "retry" and said in attempt["error"]
