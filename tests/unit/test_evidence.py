"""The evidence of every attempt, written by the dispatcher with its finish.

Each attempt's row says which token and owner made it, when it started (the
claim's clock value), what it came to (outcome, result, reason), the HTTP
status or the error it saw, and how long its send took. A bad ACK and an
unclassified error are recorded too (evidence only: the job stays leased),
and a finish refused as stale is recorded and counted durably.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncworker import Dispatcher
from lease import worker
from lease.policy import RetryPolicy, canonical_body
from lease.records import MAX_ERROR_CHARS
from lease.sqlite import open_store, reads, stale_finishes
from lease.worker import LeaseError, Permanent, Retryable
from tests.support.dispatching import FakeClock, attempts, enqueue, until, wall_ms
from tests.support.queues import T0

BODY = {"order": 7, "lines": [{"sku": "tea", "qty": 2}], "note": "für Zoë"}


def with_status(error: LeaseError, status: object) -> LeaseError:
    """An error as the senders raise it for an HTTP answer."""
    error.http_status = status  # type: ignore[attr-defined]
    return error


def history(path: Path, job_id: str) -> list[tuple]:
    """Each attempt of the job as (token, owner, outcome, result, reason, http_status, error)."""
    return [(a["token"], a["owner"], a["outcome"], a["result"], a["reason"], a["http_status"],
             a["error"]) for a in attempts(path, job_id)]


async def test_every_attempt_of_a_run_is_in_the_history(queue_path: Path):
    enqueue(queue_path, [{"id": i, "qty": 1} for i in ("fine", "flaky", "garbled", "broken",
                                                       "gone")] + [{"id": "slow:1", "body": BODY}])
    release, stalled = asyncio.Event(), asyncio.Event()
    seen_events: list[dict] = []
    stalled_at = 0.0

    async def first(event: dict, token: int) -> object:
        nonlocal stalled_at
        name = event["id"]
        if name == "flaky":
            raise with_status(Retryable("HTTP 503 from the receiver"), 503)
        if name == "garbled":
            return {"id": "fine"}  # an answer that is no ACK
        if name == "broken":
            raise RuntimeError("the receiver's client library crashed")
        if name == "gone":
            raise with_status(Permanent("HTTP 404"), 404)
        if name == "slow:1":
            seen_events.append(event)
            stalled_at = time.perf_counter()
            stalled.set()
            await release.wait()  # stalled past its lease: the job is claimed again meanwhile
        return True

    async def second(event: dict, token: int) -> bool:
        return True

    # d1's clock stands still (a stalled process); d2 comes later, when every
    # lease of d1 has run out and the retry is due.
    d1 = Dispatcher(queue_path, "d1", send=first, clock=FakeClock(T0), lease_ms=1000,
                    jitter=lambda: 0.0, poll_interval=0.01)
    async with d1:
        running = asyncio.create_task(d1.run())
        await until(lambda: stalled.is_set() and d1.stats.in_flight == 1)
        async with Dispatcher(queue_path, "d2", send=second, clock=FakeClock(T0 + 5000),
                              lease_ms=1000, poll_interval=0.01) as d2:
            stats2 = await asyncio.wait_for(d2.run(until_idle=True), 30)
        stall_ms = (time.perf_counter() - stalled_at) * 1000
        release.set()
        await until(lambda: d1.stats.stale == 1)
        d1.stop()
        stats1 = await running
    assert seen_events == [{"id": "slow:1", "body": canonical_body(BODY)[0]}]
    assert (stats1.ok, stats1.retried, stats1.dead, stats1.bad_acks, stats1.errors,
            stats1.stale) == (1, 1, 1, 1, 1, 1)
    assert (stats2.ok, stats2.stale) == (4, 0)

    ok_d2 = (2, "d2", "ok", "done", None, None, None)
    assert history(queue_path, "fine") == [(1, "d1", "ok", "done", None, None, None)]
    assert history(queue_path, "flaky") == [
        (1, "d1", "retry", "pending", "retry", 503, "Retryable: HTTP 503 from the receiver"),
        ok_d2]
    assert history(queue_path, "garbled") == [
        (1, "d1", "none", "leased", None, None,
         "BadAck: send returned {'id': 'fine'}, not True"), ok_d2]
    assert history(queue_path, "broken") == [
        (1, "d1", "none", "leased", None, None,
         "RuntimeError: the receiver's client library crashed"), ok_d2]
    assert history(queue_path, "gone") == [
        (1, "d1", "permanent", "dead", "permanent", 404, "Permanent: HTTP 404")]
    # d2's finish came first; d1's, from the stalled send, was refused by the fence.
    assert history(queue_path, "slow:1") == [ok_d2, (1, "d1", "ok", "stale", None, None, None)]

    every = [a for job in ("fine", "flaky", "garbled", "broken", "gone", "slow:1")
             for a in attempts(queue_path, job)]
    assert all(type(a["latency_ms"]) is int and a["latency_ms"] >= 0 for a in every)
    assert all(a["started_ms"] == (T0 if a["owner"] == "d1" else T0 + 5000) for a in every)
    late = attempts(queue_path, "slow:1")[1]
    assert late["latency_ms"] >= stall_ms - 1  # the send's own duration, stall included
    con = reads.open_readonly(queue_path)
    try:
        assert stale_finishes(con) == 1
        snap = reads.snapshot(con, T0 + 6000)
        assert (snap["stale_finishes"], snap["attempts_recorded"]) == (1, 10)
        [dead] = reads.dead_jobs(con)
        assert (dead["id"], dead["last_error"]) == ("gone", "Permanent: HTTP 404")
    finally:
        con.close()


class Unprintable(Retryable):
    def __str__(self) -> str:
        raise RuntimeError("no text")


async def test_odd_exceptions_still_leave_evidence_and_never_cost_the_group(queue_path: Path):
    enqueue(queue_path, [{"id": f"odd-{i}", "qty": 1} for i in range(6)] + [
        {"id": "plain", "qty": 1}], RetryPolicy(max_attempts=1))
    raised = {
        "odd-0": with_status(Retryable("status as text"), "503"),
        "odd-1": with_status(Retryable("status as a bool"), True),
        "odd-2": with_status(Retryable("status out of range"), 10**13),
        "odd-3": with_status(Retryable("x" * 100_000), 503),
        "odd-4": Unprintable(),
        "odd-5": Retryable(),
    }

    async def send(event: dict, token: int) -> bool:
        if event["id"] in raised:
            raise raised[event["id"]]
        return True

    async with Dispatcher(queue_path, "d1", send=send, clock=FakeClock(T0), batch_size=64,
                          concurrency=8, poll_interval=0.01) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    # One value a finish would refuse would fail its whole group: errors, jobs left leased.
    assert (stats.ok, stats.dead, stats.errors) == (1, 6, 0)
    seen = {f"odd-{i}": attempts(queue_path, f"odd-{i}")[0] for i in range(6)}
    assert [seen[f"odd-{i}"]["http_status"] for i in range(6)] == [None, None, None, 503,
                                                                   None, None]
    assert seen["odd-3"]["error"] == ("Retryable: " + "x" * 100_000)[:MAX_ERROR_CHARS]
    assert [seen[f"odd-{i}"]["error"] for i in (4, 5)] == ["Unprintable", "Retryable"]
    assert all(a["result"] == "dead" and a["reason"] == "exhausted" for a in seen.values())


async def test_a_lost_lease_is_a_refused_finish_on_record(queue_path: Path):
    enqueue(queue_path, [{"id": "taken", "qty": 3}], now=wall_ms())  # on the wall clock
    started = asyncio.Event()

    async def never(event: dict, token: int) -> bool:
        started.set()
        await asyncio.Event().wait()
        return True

    async def operator_ends_the_job() -> None:
        await started.wait()
        con = open_store(queue_path)
        try:
            keys = ("id", "qty", "owner", "token", "attempt", "lease_until")
            row = con.execute("SELECT id, qty, owner, token, attempts, lease_until FROM jobs"
                              " WHERE id = 'taken'").fetchone()
            ticket = dict(zip(keys, row, strict=True))
            assert worker.finish(con, ticket, "permanent", wall_ms()) == "dead"
        finally:
            con.close()

    async with Dispatcher(queue_path, "d1", send=never, lease_ms=600) as d:
        stats, _ = await asyncio.wait_for(
            asyncio.gather(d.run(until_idle=True), operator_ends_the_job()), 30)
    assert (stats.stale, stats.ok, stats.retried) == (1, 0, 0)
    first = attempts(queue_path, "taken")
    assert [(a["token"], a["outcome"], a["result"], a["error"]) for a in first] == [
        (1, "retry", "stale", "LeaseLost: lease of taken token 1 is gone")]
    con = reads.open_readonly(queue_path)
    try:
        assert stale_finishes(con) == 1
    finally:
        con.close()


async def test_a_send_cut_at_the_end_of_its_lease_says_so(queue_path: Path):
    enqueue(queue_path, [{"id": "slow", "qty": 3}], RetryPolicy(max_attempts=1))
    clock = FakeClock(T0)
    cut_at = T0 + 4000 - 800  # the lease's end less the time kept for the finish

    async def stuck(event: dict, token: int) -> bool:
        clock.now = cut_at  # the lease keeper's next look cuts it off
        await asyncio.Event().wait()
        return True

    async with Dispatcher(queue_path, "d1", send=stuck, clock=clock, lease_ms=4000) as d:
        assert d.finish_margin_ms == 800
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert stats.dead_by_reason["exhausted"] == 1
    [cut] = attempts(queue_path, "slow")
    assert (cut["outcome"], cut["result"], cut["reason"], cut["error"], cut["ended_ms"]) == (
        "retry", "dead", "exhausted", "Retryable: the send did not finish within its lease",
        cut_at)
