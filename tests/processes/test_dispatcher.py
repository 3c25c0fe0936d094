"""The asyncio dispatcher: overlap, no lock during a send, leases, errors, shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from asyncworker import Dispatcher, QueueThread, dispatcher_context, send_http
from lease import worker
from lease.policy import DEFAULT_POLICY, LAB_POLICY, RetryPolicy
from lease.sqlite import SCHEMA_VERSION, enqueue_events, open_store, schema_version
from lease.worker import Busy, Conflict, Permanent, Retryable
from tests.support.dispatching import CHILD, FakeClock, child_result, fill, statuses
from tests.support.queues import T0, add, job, rows
from tests.support.servers import HostileServer, ReceiverProcess, ack_for


def inbox_rows(path: Path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT id, qty, seen FROM inbox ORDER BY id").fetchall()
    finally:
        con.close()


async def test_sends_really_overlap(queue_path: Path):
    n = 8
    barrier = threading.Barrier(n, timeout=20)

    def all_at_once(request, sock):
        barrier.wait()  # passes only when n requests are in flight together
        ack_for()(request, sock)

    fill(queue_path, n)
    with HostileServer(all_at_once) as server:
        async with Dispatcher(queue_path, "d1", url=server.url, concurrency=n,
                              lease_ms=30_000) as d:
            stats = await d.run(until_idle=True)
    assert not barrier.broken
    assert (stats.ok, stats.peak_sending, stats.claimed) == (n, n, n)
    assert statuses(queue_path)["done"] == n


async def test_no_lock_held_during_a_send(queue_path: Path):
    fill(queue_path, 4, prefix="orig")
    writes: list[str] = []

    async def send(event: dict, token: int) -> bool:
        await asyncio.sleep(0.05)
        if event["id"].startswith("orig"):
            other = sqlite3.connect(queue_path, timeout=0, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # fails at once if anyone holds the lock
                other.execute("ROLLBACK")
                assert worker.enqueue(other, {"id": "during-" + event["id"], "qty": 1},
                                      int(time.time() * 1000), 60_000)
                writes.append(event["id"])
            finally:
                other.close()
        return True

    # One slot: while a send runs, this dispatcher has no other transaction of its own.
    async with Dispatcher(queue_path, "d1", send=send, concurrency=1) as d:
        stats = await d.run(until_idle=True)
    assert len(writes) == 4 and (stats.ok, stats.errors, stats.claimed) == (8, 0, 8)
    assert statuses(queue_path) == {"pending": 0, "leased": 0, "done": 8, "dead": 0}


async def test_send_outliving_its_lease_is_stale_then_recovered(queue_path: Path, tmp_path):
    clock = FakeClock(T0)
    con = worker.open_queue(queue_path)
    add(con, "snack-7", 7, now=T0)
    con.close()
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        async def send(event: dict, token: int) -> object:
            acked = await send_http(rx.url, event, timeout=5, token=token)
            if token == 1:
                clock.now += 1000  # the process stalled: the answer comes after the lease
            return acked

        async with Dispatcher(queue_path, "d1", send=send, lease_ms=1000, clock=clock,
                              poll_interval=0.01) as d:
            stats = await d.run(until_idle=True)
        received = rx.stats()
    assert (stats.stale, stats.ok, stats.claimed) == (1, 1, 2)
    assert (received["applied"], received["duplicates"], received["stock"]) == (1, 1, 7)
    con = worker.open_queue(queue_path)
    row = job(con, "snack-7")
    con.close()
    assert (row["status"], row["token"], row["attempts"]) == ("done", 2, 2)


async def test_lease_is_extended_while_a_send_runs(queue_path: Path):
    fill(queue_path, 1)

    async def slow(event: dict, token: int) -> bool:
        await asyncio.sleep(1.5)  # outlives the 1 s lease it was claimed with
        return True

    async with Dispatcher(queue_path, "d1", send=slow, lease_ms=1000) as d:
        stats = await d.run(until_idle=True)
    assert stats.extended >= 1 and (stats.ok, stats.stale, stats.claimed) == (1, 0, 1)
    con = worker.open_queue(queue_path)
    assert job(con, "job-0")["token"] == 1 and job(con, "job-0")["status"] == "done"
    con.close()


async def test_refused_extension_stops_waiting_for_the_send(queue_path: Path):
    fill(queue_path, 1, max_attempts=1)
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def never(event: dict, token: int) -> bool:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return True

    async def operator_ends_the_job() -> None:
        await started.wait()
        con = worker.open_queue(queue_path)
        row = job(con, "job-0")
        ticket = {"id": row["id"], "qty": row["qty"], "owner": row["owner"],
                  "token": row["token"], "attempt": row["attempts"],
                  "lease_until": row["lease_until"]}
        assert worker.finish(con, ticket, "permanent", int(time.time() * 1000)) == "dead"
        con.close()

    async with Dispatcher(queue_path, "d1", send=never, lease_ms=600) as d:
        stats, _ = await asyncio.gather(d.run(until_idle=True), operator_ends_the_job())
    assert cancelled.is_set()
    assert (stats.stale, stats.ok, stats.extended) == (1, 0, 0)


async def test_bad_acks_and_errors_leave_jobs_leased_and_the_dispatcher_goes_on(queue_path):
    fill(queue_path, 3, max_attempts=1)

    async def send(event: dict, token: int) -> object:
        return {"job-0": "yes", "job-2": True}.get(event["id"]) or _boom()

    async with Dispatcher(queue_path, "d1", send=send, lease_ms=200,
                          poll_interval=0.01) as d:
        stats = await d.run(until_idle=True)  # waits out the two leases left behind
    assert (stats.bad_acks, stats.errors, stats.ok) == (1, 1, 1)
    con = worker.open_queue(queue_path)
    assert [(r["id"], r["status"], r["reason"]) for r in rows(con)] == [
        ("job-0", "dead", "exhausted"), ("job-1", "dead", "exhausted"), ("job-2", "done", None)]
    con.close()


def _boom() -> bool:
    raise RuntimeError("unclassified")


async def test_retry_permanent_and_budget_are_counted(queue_path: Path):
    fill(queue_path, 3, max_attempts=2)
    tries: dict[str, int] = {}

    async def send(event: dict, token: int) -> bool:
        tries[event["id"]] = tries.get(event["id"], 0) + 1
        if event["id"] == "job-0" and tries["job-0"] == 1:
            raise Retryable("503")
        if event["id"] == "job-1":
            raise Permanent("409")
        if event["id"] == "job-2":
            raise Retryable("always")
        return True

    async with Dispatcher(queue_path, "d1", send=send, jitter=lambda: 0.0,
                          poll_interval=0.01) as d:
        stats = await d.run(until_idle=True)
    assert (stats.ok, stats.retried, stats.dead, stats.quarantined) == (1, 2, 2, 0)
    assert stats.dead_by_reason == {"deadline": 0, "exhausted": 1, "permanent": 1}
    con = worker.open_queue(queue_path)
    assert [(r["status"], r["reason"]) for r in rows(con)] == [
        ("done", None), ("dead", "permanent"), ("dead", "exhausted")]
    con.close()


async def test_graceful_stop_finishes_what_is_in_flight(queue_path: Path):
    fill(queue_path, 20)
    release = asyncio.Event()
    in_send = 0

    async def send(event: dict, token: int) -> bool:
        nonlocal in_send
        in_send += 1
        await release.wait()
        return True

    async with Dispatcher(queue_path, "d1", send=send, concurrency=4) as d:
        running = asyncio.create_task(d.run())
        while in_send < 4:
            await asyncio.sleep(0.01)
        d.stop()
        release.set()
        stats = await running
    assert (stats.claimed, stats.ok) == (4, 4)
    assert statuses(queue_path) == {"pending": 16, "leased": 0, "done": 4, "dead": 0}


async def test_abort_leaves_only_leases_that_expire(queue_path: Path):
    fill(queue_path, 3)

    async def hang(event: dict, token: int) -> bool:
        await asyncio.Event().wait()
        return True

    async with Dispatcher(queue_path, "d1", send=hang, concurrency=3, lease_ms=60_000) as d:
        running = asyncio.create_task(d.run())
        while d.stats.in_flight < 3:
            await asyncio.sleep(0.01)
        d.abort()
        stats = await running
    assert (stats.ok, stats.in_flight) == (0, 0)
    assert statuses(queue_path)["leased"] == 3


async def test_queue_operations_for_an_embedding_service(queue_path: Path):
    worker.open_queue(queue_path).close()
    async with Dispatcher(queue_path, "d1", send=_never_called) as d:
        with pytest.raises(ValueError):  # every event is checked before anything goes in
            await d.queue.enqueue_many([{"id": "b", "qty": 1}, {"id": "b", "qty": 0}], T0, 1000)
        results = await d.queue.enqueue_many(
            [{"id": "a", "qty": 1}, {"id": "a", "qty": 1}, {"id": "a", "qty": 2},
             {"id": "c", "qty": 3}], T0, 1000)
        assert results[:2] == [True, False] and results[3] is True
        assert isinstance(results[2], Conflict)
        assert await d.queue.enqueue({"id": "d", "qty": 4}, T0, 1000) is True
        snap = await d.queue.snapshot(T0 + 100)
        assert snap["by_status"] == {"pending": 3, "leased": 0, "done": 0, "dead": 0}
        assert snap["oldest_unfinished_age_ms"] == 100
        assert await d.queue.snapshot(T0 + 1000) and not await d.queue.is_drained()


async def _never_called(event: dict, token: int) -> bool:
    raise AssertionError("no send expected")


async def test_an_aiohttp_application_owns_the_dispatcher(queue_path: Path, tmp_path: Path):
    fill(queue_path, 5)
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        d = Dispatcher(queue_path, "svc", url=rx.url, concurrency=2)
        app = web.Application()
        app.cleanup_ctx.append(dispatcher_context(d))
        runner = web.AppRunner(app)
        await runner.setup()  # the dispatcher starts with the application
        try:
            for _ in range(500):
                if d.stats.ok == 5:
                    break
                await asyncio.sleep(0.01)
        finally:
            await runner.cleanup()  # and stops with it
        assert d.stats.ok == 5 and rx.stats()["applied"] == 5
    assert statuses(queue_path)["done"] == 5


@pytest.mark.parametrize("kwargs", [
    {"url": "http://10.1.2.3/events"}, {"url": "ftp://127.0.0.1:1/x"},
    {"url": "https://user:pw@127.0.0.1/x"}, {"url": b"http://127.0.0.1/events"},
    {"destination": "http://127.0.0.1:1/events"},
    {"url": None}, {"send": _never_called, "url": "http://127.0.0.1:1/events"},
    {"send": _never_called, "concurrency": 0}, {"send": _never_called, "concurrency": True},
    {"send": _never_called, "lease_ms": 0}, {"send": _never_called, "lease_ms": 3_600_001},
    {"send": _never_called, "lease_ms": 1000.0}, {"send": _never_called, "policy": None},
    {"send": _never_called, "policy": {"max_attempts": 25}},
    {"send": _never_called, "poll_interval": 0}, {"send": "nope"},
])
def test_bad_configuration_is_refused(queue_path: Path, kwargs):
    with pytest.raises(ValueError):
        Dispatcher(queue_path, "d1", **kwargs)
    with pytest.raises(ValueError):
        Dispatcher(queue_path, "bad owner", send=_never_called)


async def test_missing_queue_is_an_error_and_is_not_created(tmp_path: Path):
    missing = tmp_path / "missing.db"
    with pytest.raises(FileNotFoundError):
        async with Dispatcher(missing, "d1", send=_never_called):
            pass
    assert not missing.exists()


# ---------------------------------------------------------------- real processes


def _spawn(spec: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, CHILD, "dispatcher", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_crash_after_ack_across_two_dispatcher_processes(queue_path: Path, tmp_path: Path):
    fill(queue_path, 1)  # job-0, qty 1
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        first = _spawn({"path": str(queue_path), "owner": "dispatcher-1", "url": rx.url,
                        "lease_ms": 500, "die_after_acks": 1})
        code, _ = child_result(first)
        assert code == 73
        assert statuses(queue_path)["leased"] == 1 and rx.stats()["applied"] == 1
        second = _spawn({"path": str(queue_path), "owner": "dispatcher-2", "url": rx.url,
                         "lease_ms": 500})
        code, stats = child_result(second)
        assert code == 0 and stats["ok"] == 1
        received = rx.stats()
    assert (received["process_requests"], received["applied"], received["duplicates"]) == (2, 1, 1)
    assert inbox_rows(tmp_path / "inbox.db") == [("job-0", 1, 2)]
    con = worker.open_queue(queue_path)
    row = job(con, "job-0")
    con.close()
    assert (row["status"], row["token"], row["owner"]) == ("done", 2, None)


def test_two_dispatcher_processes_share_one_file(queue_path: Path, tmp_path: Path):
    worker.open_queue(queue_path).close()
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        # Both wait on an empty queue first, so neither gets a head start.
        procs = [_spawn({"path": str(queue_path), "owner": f"dispatcher-{n}", "url": rx.url,
                         "concurrency": 16, "lease_ms": 10_000, "until_idle": False})
                 for n in (1, 2)]
        try:
            events = {f"job-{i}": i % 1000 + 1 for i in range(500)}
            con = worker.open_queue(queue_path)
            worker.enqueue_many(con, [{"id": i, "qty": q} for i, q in events.items()],
                                int(time.time() * 1000), 60_000)  # all at once: saturated
            con.close()
            deadline = time.monotonic() + 120
            while statuses(queue_path)["done"] < 500 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
        results = [child_result(p) for p in procs]
        received = rx.stats()
    assert [code for code, _ in results] == [0, 0]
    claimed = [stats["claimed"] for _, stats in results]
    print(f"fairness: claimed {claimed}, lock retries "
          f"{[s['lock_retries'] for _, s in results]}, peak in flight at receiver "
          f"{received['process_peak_in_flight']}")
    assert sum(claimed) == 500 and sum(s["ok"] for _, s in results) == 500
    assert min(claimed) > 0, "one process never got in"
    assert statuses(queue_path) == {"pending": 0, "leased": 0, "done": 500, "dead": 0}
    rows_in_inbox = inbox_rows(tmp_path / "inbox.db")
    assert [(i, q) for i, q, _ in rows_in_inbox] == sorted(events.items())
    assert received["stock"] == sum(events.values()) and received["applied"] == 500


def test_sigterm_stops_gracefully_and_a_restart_completes(queue_path: Path, tmp_path: Path):
    fill(queue_path, 200)
    with ReceiverProcess(tmp_path / "inbox.db", "--latency-ms", "20") as rx:
        proc = _spawn({"path": str(queue_path), "owner": "d1", "url": rx.url,
                       "concurrency": 4, "lease_ms": 10_000})
        while statuses(queue_path)["done"] < 10:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code, stats = child_result(proc)
        assert code == 0 and stats is not None
        mid = statuses(queue_path)
        assert mid["leased"] == 0  # nothing half-finished: in-flight sends were finished
        assert 0 < mid["done"] < 200 and mid["done"] == stats["ok"]
        again = _spawn({"path": str(queue_path), "owner": "d2", "url": rx.url,
                        "concurrency": 16, "lease_ms": 10_000})
        code, stats2 = child_result(again)
        received = rx.stats()
    assert code == 0 and stats2["ok"] == 200 - mid["done"]
    assert statuses(queue_path)["done"] == 200
    assert received["applied"] == 200 and received["duplicates"] == 0


async def test_a_locked_database_is_waited_out(queue_path: Path):
    fill(queue_path, 1)
    open_store(queue_path).close()  # migrated: the lock below is met by the claim
    holder = sqlite3.connect(queue_path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another process's long write transaction
    released = threading.Timer(1.6, holder.execute, ("ROLLBACK",))
    released.start()
    try:
        async with Dispatcher(queue_path, "d1", send=_ok) as d:
            stats = await d.run(until_idle=True)
    finally:
        released.join()
        holder.close()
    assert stats.lock_retries >= 1 and (stats.ok, stats.errors) == (1, 0)


async def _ok(event: dict, token: int) -> bool:
    return True


async def test_queue_calls_wait_out_a_short_lock(queue_path: Path):
    """call() rides out another process's write lock; run() reports it at once, as Busy."""
    import sqlite3 as sq

    from asyncworker import AsyncStore

    open_store(queue_path).close()  # migrated: opening needs no write lock
    holder = sq.connect(queue_path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    released = threading.Timer(0.3, holder.execute, ("ROLLBACK",))
    try:
        async with AsyncStore(queue_path) as queue:
            with pytest.raises(Busy, match="locked"):
                await queue.run(lambda s: s.enqueue_events([{"id": "a", "qty": 1}], now_ms=T0))
            released.start()
            assert await queue.enqueue({"id": "a", "qty": 1}, T0, 1000) is True
    finally:
        released.join()
        holder.close()


async def test_create_makes_a_missing_queue_and_latencies_are_recorded(tmp_path: Path):
    path = tmp_path / "new.db"
    latencies: list[float] = []
    async with Dispatcher(path, "d1", send=_ok, create=True, latencies=latencies) as d:
        now = int(time.time() * 1000)  # the dispatcher runs on the wall clock
        assert await d.queue.enqueue_many([{"id": "a", "qty": 1}, {"id": "b", "qty": 2}], now,
                                          60_000) == [True, True]
        stats = await d.run(until_idle=True)
    assert path.is_file() and stats.ok == 2
    assert len(latencies) == 2 and all(0 <= s < 60 for s in latencies)


# ---------------------------------------------------------------- the product queue


async def test_opening_migrates_a_contract_file_and_keeps_its_jobs(queue_path: Path):
    fill(queue_path, 3, now=T0)
    con = worker.open_queue(queue_path)
    assert schema_version(con) == 0
    before = rows(con)
    con.close()
    async with QueueThread(queue_path):
        pass
    con = worker.open_queue(queue_path)
    try:
        assert schema_version(con) == SCHEMA_VERSION
        after = rows(con)
        kept = [{k: row[k] for k in before[0]} for row in after]
        assert kept == before  # every row as it was, the new columns beside them
        assert all(set(row) > set(before[0]) for row in after)
    finally:
        con.close()


async def test_opening_waits_out_a_short_lock_to_migrate(queue_path: Path):
    worker.open_queue(queue_path).close()  # a contract file: opening it migrates it
    holder = sqlite3.connect(queue_path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    released = threading.Timer(1.5, holder.execute, ("ROLLBACK",))  # past open's own 1 s wait
    released.start()
    try:
        async with QueueThread(queue_path) as queue:
            assert await queue.run(lambda s: s.schema_version()) == SCHEMA_VERSION
    finally:
        released.join()
        holder.close()


async def test_a_newer_file_is_refused_untouched(queue_path: Path):
    open_store(queue_path).close()
    con = sqlite3.connect(queue_path)
    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    con.close()
    content = queue_path.read_bytes()
    with pytest.raises(ValueError, match="newer than this code") as refused:
        async with Dispatcher(queue_path, "d1", send=_never_called):
            pass
    assert "\n" not in str(refused.value)
    assert queue_path.read_bytes() == content


async def test_the_queue_thread_takes_product_events(queue_path: Path):
    open_store(queue_path).close()
    async with QueueThread(queue_path) as queue:
        results = await queue.enqueue_events(
            [{"id": "order:1", "body": {"b": 1, "a": [2]}},
             {"id": "order:1", "body": {"a": [2], "b": 1}},  # the same body: a duplicate
             {"id": "order:1", "body": {"a": 3}}, {"id": "lab-1", "qty": 4}],
            T0, RetryPolicy(max_attempts=40, ttl_ms=7 * 86_400_000), not_before_ms=T0 + 500)
        assert results[:2] == [True, False] and isinstance(results[2], Conflict)
        assert results[3] is True
        with pytest.raises(ValueError, match="body"):
            await queue.enqueue_events([{"id": "x", "body": []}], T0)
    con = open_store(queue_path)
    try:
        order = job(con, "order:1")
        assert (order["max_attempts"], order["available_at"], order["deadline"], order["body"]) == (
            40, T0 + 500, T0 + 500 + 7 * 86_400_000, '{"a":[2],"b":1}')
        assert con.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 2  # nothing of "x"
    finally:
        con.close()


async def test_a_payload_whose_text_changed_after_its_intake_is_never_sent(queue_path: Path):
    """The dispatcher sends a stored body checked by its intake's digest: a
    text changed in the file since (here to other canonical JSON) is refused
    before any connection, and the attempt's evidence says why."""
    con = open_store(queue_path)
    try:
        assert enqueue_events(con, [{"id": "order:1", "body": {"a": 1}},
                                    {"id": "order:2", "body": {"a": 2}}],
                              int(time.time() * 1000), RetryPolicy(max_attempts=1)) == [True, True]
        con.execute("UPDATE bodies SET body = '{\"a\":3}'"
                    " WHERE seq = (SELECT seq FROM jobs WHERE id = 'order:2')")
    finally:
        con.close()
    with HostileServer(ack_for("order:1")) as server:
        async with Dispatcher(queue_path, "d1", url=server.url, lease_ms=200,
                              poll_interval=0.01) as d:
            stats = await d.run(until_idle=True)
    assert [request.body for request in server.requests] == [b'{"a":1}']
    assert (stats.ok, stats.errors) == (1, 1)
    con = open_store(queue_path)
    try:
        assert (job(con, "order:2")["status"], job(con, "order:2")["reason"]) == (
            "dead", "exhausted")
        (error,) = con.execute("SELECT error FROM attempts WHERE id = 'order:2'").fetchone()
    finally:
        con.close()
    assert "digest" in error


@pytest.mark.parametrize(("policy", "draw", "delay"), [
    (RetryPolicy(backoff_base_ms=7000), 0.25, 4375),  # 7000 * (0.5 + 0.5 * 0.25)
    (LAB_POLICY, 0.25, 25),  # the lab's full jitter: 100 * 0.25
    (None, 0.0, 500),  # the default: 1 s, half of it at the least
])
async def test_a_retry_is_spaced_by_the_policy(queue_path: Path, policy, draw, delay):
    con = open_store(queue_path)
    enqueue_events(con, [{"id": "flaky", "qty": 1}], T0)
    con.close()

    async def refuse(event: dict, token: int) -> bool:
        raise Retryable("503")

    extra = {} if policy is None else {"policy": policy}
    async with Dispatcher(queue_path, "d1", send=refuse, clock=FakeClock(T0),
                          jitter=lambda: draw, **extra) as d:
        assert d.lease_ms == (policy or DEFAULT_POLICY).lease_ms
        running = asyncio.create_task(d.run())
        while d.stats.retried < 1:
            await asyncio.sleep(0.01)
        d.stop()
        await running
    con = open_store(queue_path)
    try:
        assert (job(con, "flaky")["status"], job(con, "flaky")["available_at"]) == (
            "pending", T0 + delay)
    finally:
        con.close()


def test_lease_ms_defaults_to_the_policy_and_can_be_given(queue_path: Path):
    assert Dispatcher(queue_path, "d1", send=_never_called).lease_ms == 30_000
    assert Dispatcher(queue_path, "d1", send=_never_called,
                      policy=RetryPolicy(lease_ms=3_600_000)).lease_ms == 3_600_000
    assert Dispatcher(queue_path, "d1", send=_never_called, policy=LAB_POLICY,
                      lease_ms=1234).lease_ms == 1234
