"""The runtime on PostgreSQL under fire: every fault on a real server of the
test's own, with the real receiver (``asyncworker.make_app`` on an inbox file)
applying each job's effect.

The server restarted (fast and immediate) while a dispatcher runs; a
connection killed by ``pg_terminate_backend`` during a claim, a finish and an
extension, at the store's fault hooks (a store of the test's own passes a
hook that waits until the backend is really gone); the server frozen
(SIGSTOP on the postmaster and every backend) for longer than a lease; the
listener's connection lost. After each: the dispatcher did not fail, every
job is done, each effect is applied once at the receiver, and what could
not be recorded within its lease was not recorded after it.

A transaction cut at COMMIT is the hard case: did it commit? The client
cannot know, and the store says Busy either way (``PostgresStore._tx``).
That is safe because every call is fenced by the whole marker:

- cut before the server committed: nothing happened, and the retry does it;
- committed, the answer lost: a retried *finish* finds the job no longer
  leased by its ticket and is refused as stale. The job is done once, its
  effect applied once, and the retry is counted as a stale finish (one
  ``stale`` attempt row, ``stale_finishes`` + 1, ``stats.stale`` + 1): the
  count overstates, honestly, what went wrong. A retried *claim* leases
  other jobs; the jobs of the claim whose answer was lost stay leased by
  nobody who knows it, and come back when that lease expires (attempt 2).
  A retried *extension* carries the old lease end, which no longer
  matches: the keeper takes the lease as lost and cuts the send, whose
  finish is then refused as stale; the job comes back when the extended
  lease expires, and the receiver's inbox absorbs the second delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web

from asyncworker import Dispatcher, DispatcherStats, make_app
from asyncworker.devtools.postgres_server import PostgresServer
from lease.policy import RetryPolicy
from lease.postgres import CHANNEL, PostgresStore
from lease.stores import open_store
from lease.worker import Busy

pytestmark = pytest.mark.timeout(120)

TARGET = "lease-under-fire"  # the application_name of the dispatcher's connections
POLICY = RetryPolicy(max_attempts=10, ttl_ms=600_000, lease_ms=2_000,
                     backoff_base_ms=50, backoff_cap_ms=200)
JOBS = 200
RUN_TIMEOUT_S = 90


# ------------------------------------------------------------------ the parts


def named(url: str) -> str:
    """The server's URL with the dispatcher's application_name: its backends
    can be told apart from the test's own in pg_stat_activity."""
    return f"{url}?application_name={TARGET}"


def enqueue(url: str, n: int = JOBS, prefix: str = "job") -> dict[str, int]:
    orders = {f"{prefix}-{i}": i % 50 + 1 for i in range(n)}
    with open_store(url, create=True) as store:
        assert store.enqueue_events([{"id": k, "qty": q} for k, q in orders.items()],
                                    POLICY) == [True] * n
    return orders


@contextlib.asynccontextmanager
async def receiver(inbox: Path) -> AsyncIterator[str]:
    """The project's receiver in this process, on loopback; its events URL."""
    runner = web.AppRunner(make_app(str(inbox)))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/events"
    finally:
        await runner.cleanup()


def terminate(url: str, where: str) -> int:
    """pg_terminate_backend on the dispatcher's backends that match ``where``,
    each waited for until it is gone (PostgreSQL 14's timeout form): when
    this returns, the connection is really cut. How many there were."""
    with psycopg.connect(url, autocommit=True) as admin:
        pids = [pid for (pid,) in admin.execute(
            f"SELECT pid FROM pg_stat_activity WHERE application_name = %s AND {where}",
            (TARGET,))]
        for pid in pids:
            row = admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
            assert row is not None and row[0] is True, f"backend {pid} survived its terminate"
    return len(pids)


class Once:
    """A fault hook that acts at one point, the first time it is reached
    (``after`` times passed first), and remembers that it did."""

    def __init__(self, point: str, action: Callable[[], None], after: int = 0) -> None:
        self.point = point
        self.action = action
        self.skip = after
        self.fired = 0

    def __call__(self, point: str) -> None:
        if point != self.point or self.fired:
            return
        if self.skip:
            self.skip -= 1
            return
        self.fired += 1
        self.action()


class FaultyStore(PostgresStore):
    """The product's PostgreSQL store, with a fault hook on one operation."""

    def __init__(self, url: str, operation: str, hook: Once) -> None:
        super().__init__(url, threads=1)
        self.operation = operation
        self.hook = hook

    def _fault(self, operation: str, fault: Any) -> Any:
        return self.hook if operation == self.operation else fault

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: int | None = None, fault: Any = None) -> Any:
        return super().claim_jobs(owner, lease_ms, limit, now_ms=now_ms,
                                  fault=self._fault("claim", fault))

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Any = None) -> list:
        return super().finish_jobs(items, now_ms=now_ms, fault=self._fault("finish", fault))

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Any = None) -> Any:
        return super().extend_lease(ticket, lease_ms, now_ms=now_ms,
                                    fault=self._fault("extend", fault))


def cut_own_transaction(url: str) -> Callable[[], None]:
    """Terminate the backend whose transaction is open and waiting for its
    COMMIT: the one the hook runs inside (the listener is idle, outside one)."""
    def act() -> None:
        assert terminate(url, "state = 'idle in transaction'") == 1
    return act


def lose_the_answer() -> None:
    """What the store raises when the connection drops after the server
    committed and before its answer arrived (``PostgresStore._tx``)."""
    raise Busy("PostgreSQL queue: connection lost: server closed the connection unexpectedly")


def inbox_figures(inbox: Path) -> tuple[dict[str, int], int, dict[str, int]]:
    """(id -> qty applied, the effect's stock, id -> requests seen) of the inbox."""
    con = sqlite3.connect(inbox)
    try:
        applied = dict(con.execute("SELECT id, qty FROM inbox").fetchall())
        stock = con.execute("SELECT stock FROM effect").fetchone()[0]
        seen = dict(con.execute("SELECT id, seen FROM inbox").fetchall())
    finally:
        con.close()
    return applied, stock, seen


def assert_all_done_once(url: str, inbox: Path, orders: dict[str, int]) -> list[dict]:
    """Every job done, each effect applied once with its own quantity; the jobs' rows."""
    with open_store(url, read_only=True) as store:
        counts = store.counts()
        done = store.jobs_with_status("done")
    assert counts == {"pending": 0, "leased": 0, "done": len(orders), "dead": 0}, counts
    applied, stock, _ = inbox_figures(inbox)
    assert applied == orders, "an effect missing, invented or with another quantity"
    assert stock == sum(orders.values()), "an effect applied twice"
    return done


async def dispatch(queue: Any, url: str, *, during: Callable[[Dispatcher], Any] | None = None,
                   **options: Any) -> DispatcherStats:
    """One dispatcher until every job is done or dead; ``during(d)`` runs
    beside it (a coroutine function: the fault), and must end first."""
    options = {"concurrency": 16, "policy": POLICY, "poll_interval": 0.02, **options}
    async with Dispatcher(queue, "under-fire", url=url, **options) as d:
        running = asyncio.create_task(d.run(until_idle=True))
        if during is not None:
            await during(d)
        stats = await asyncio.wait_for(running, RUN_TIMEOUT_S)
    assert d.state == "stopped" and d.failure is None
    assert stats.errors == 0, stats
    return stats


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, f"never: {what}"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ restarts


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_a_dispatcher_rides_out_a_server_restart(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path, mode: str):
    """The server stops (fast: sessions rolled back; immediate: no checkpoint,
    WAL replayed at the next start) while jobs are in flight and starts
    again: the pool reconnects, Busy is retried, nothing is lost or doubled."""
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"

    async def restart(d: Dispatcher) -> None:
        await until(lambda: d.stats.ok >= JOBS // 4, "a quarter of the jobs done")
        await asyncio.to_thread(server.stop, mode)
        await asyncio.sleep(0.5)  # the dispatcher meets a server that is gone
        await asyncio.to_thread(server.start)

    async with receiver(inbox) as url:
        stats = await dispatch(named(server.url), url, during=restart)
    assert stats.lock_retries >= 1, "the restart went unnoticed: no fault was tested"
    assert stats.ok + stats.stale >= JOBS
    assert_all_done_once(server.url, inbox, orders)


# ------------------------------------------------------------------ a connection cut


async def test_a_claim_cut_before_commit_is_rolled_back_and_claimed_again(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"
    hook = Once("after-claim", cut_own_transaction(server.url), after=2)
    async with receiver(inbox) as url:
        stats = await dispatch(lambda: FaultyStore(named(server.url), "claim", hook), url)
    assert hook.fired == 1 and stats.lock_retries >= 1
    assert (stats.ok, stats.stale, stats.claimed) == (JOBS, 0, JOBS)  # the cut lease never was
    done = assert_all_done_once(server.url, inbox, orders)
    assert {row["attempts"] for row in done} == {1}


async def test_a_claim_whose_answer_was_lost_is_recovered_by_lease_expiry(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    """The claim committed, its answer never came: the retry leases other
    jobs, and the lost claim's jobs come back once their lease runs out."""
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"
    hook = Once("after-commit", lose_the_answer, after=1)
    async with receiver(inbox) as url:
        stats = await dispatch(lambda: FaultyStore(named(server.url), "claim", hook), url)
    assert hook.fired == 1 and stats.lock_retries >= 1
    done = assert_all_done_once(server.url, inbox, orders)
    again = [row for row in done if row["attempts"] == 2]
    assert again, "no job was leased by the claim whose answer was lost"
    assert {row["attempts"] for row in done} == {1, 2}
    assert stats.ok == JOBS and stats.stale == 0
    with open_store(server.url, read_only=True) as store:
        for row in again:  # its first attempt left no evidence: nobody knew it had it
            history = store.job_history(row["id"])
            assert history is not None and len(history["attempts"]) == 1


async def test_a_finish_cut_before_commit_is_retried_and_recorded_once(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"
    hook = Once("after-finish", cut_own_transaction(server.url), after=3)
    async with receiver(inbox) as url:
        stats = await dispatch(lambda: FaultyStore(named(server.url), "finish", hook), url)
    assert hook.fired == 1 and stats.lock_retries >= 1
    assert (stats.ok, stats.stale) == (JOBS, 0)  # the retry won: the cut had changed nothing
    done = assert_all_done_once(server.url, inbox, orders)
    assert {row["attempts"] for row in done} == {1}
    with open_store(server.url, read_only=True) as store:
        assert store.stale_finishes() == 0


async def test_a_finish_that_committed_but_lost_its_answer_is_never_applied_twice(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    """The COMMIT went through and the answer was lost: the retried finish is
    refused by the fence (the job is no longer leased by that ticket) and
    counted as stale, once per job of the group; each job is done once."""
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"
    groups: list[int] = []

    class Counting(FaultyStore):
        def finish_jobs(self, items: list, **kwargs: Any) -> list:
            groups.append(len(items))
            return super().finish_jobs(items, **kwargs)

    hook = Once("after-commit", lose_the_answer, after=3)
    async with receiver(inbox) as url:
        stats = await dispatch(lambda: Counting(named(server.url), "finish", hook), url)
    assert hook.fired == 1
    lost_group = groups[3]  # the 4th finish lost its answer: its retry is the 5th call
    assert groups[4] == lost_group  # the same group, retried whole
    assert stats.stale == lost_group and stats.ok == JOBS - lost_group
    done = assert_all_done_once(server.url, inbox, orders)
    assert {row["attempts"] for row in done} == {1}
    with open_store(server.url, read_only=True) as store:
        assert store.stale_finishes() == lost_group
        stale_rows = [a for row in done for a in store.job_history(row["id"])["attempts"]
                      if a["result"] == "stale"]
    assert len(stale_rows) == lost_group


async def test_an_extension_cut_before_commit_is_tried_again_at_the_next_tick(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    server = make_postgres_server()
    orders = enqueue(server.url, 8)
    hook = Once("after-extend", cut_own_transaction(server.url))
    sent: list[str] = []

    async def slow(event: dict, token: int) -> bool:
        sent.append(event["id"])
        await asyncio.sleep(1.5)  # three quarters of a lease: each send is extended
        return True

    async with Dispatcher(lambda: FaultyStore(named(server.url), "extend", hook), "slow",
                          send=slow, concurrency=8, policy=POLICY, poll_interval=0.02) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), RUN_TIMEOUT_S)
    assert d.failure is None and hook.fired == 1
    assert stats.extended >= len(orders) and stats.lock_retries >= 1
    assert (stats.ok, stats.stale, stats.errors) == (len(orders), 0, 0)
    assert sorted(sent) == sorted(orders)  # no send was cut: each job sent once
    with open_store(server.url, read_only=True) as store:
        assert store.counts()["done"] == len(orders)


async def test_an_extension_whose_answer_was_lost_costs_its_attempt_and_nothing_more(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    """The extension committed, its answer was lost: the keeper's retry
    carries the old lease end, is refused, and the send is cut as a lost
    lease; the job comes back after the extended lease and is applied once."""
    server = make_postgres_server()
    orders = enqueue(server.url, 4)
    inbox = tmp_path / "inbox.db"
    hook = Once("after-commit", lose_the_answer)
    async with receiver(inbox) as url:
        slow_url = url  # the receiver answers at once; the send's wait is ours

        async def slow(event: dict, token: int) -> object:
            await asyncio.sleep(1.5)
            from asyncworker.sender import send_http
            return await send_http(slow_url, event, timeout=5, token=token)

        async with Dispatcher(lambda: FaultyStore(named(server.url), "extend", hook), "slow",
                              send=slow, concurrency=4, policy=POLICY,
                              poll_interval=0.02) as d:
            stats = await asyncio.wait_for(d.run(until_idle=True), RUN_TIMEOUT_S)
    assert d.failure is None and hook.fired == 1
    assert stats.stale >= 1 and stats.ok == len(orders)
    done = assert_all_done_once(server.url, inbox, orders)
    assert max(row["attempts"] for row in done) == 2


# ------------------------------------------------------------------ a stalled network


def freeze(server: PostgresServer) -> list[int]:
    """SIGSTOP the postmaster (first: it forks nothing more) and every child."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    children = server.processes()[1:]
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    return [server.pid, *children]


def thaw(pids: list[int]) -> None:
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_a_server_stalled_longer_than_a_lease_records_nothing_after_it(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    """Every process of the server stopped for twice a lease: the sends
    finish meanwhile, their finishes wait on the frozen connections, and
    when the server answers again it judges them by its own clock: past the
    lease, each is refused as stale. The jobs are claimed again after their
    leases and each effect is applied once (the inbox absorbs the repeat)."""
    server = make_postgres_server()
    orders = enqueue(server.url)
    inbox = tmp_path / "inbox.db"

    async def stall(d: Dispatcher) -> None:
        # frozen at the first job done: the sends then in flight end during the
        # freeze (a quiet machine could finish a quarter of the jobs, and more,
        # before the freeze takes hold)
        await until(lambda: d.stats.ok >= 1, "a first job done")
        pids = freeze(server)
        try:
            await asyncio.sleep(2 * POLICY.lease_ms / 1000)
        finally:
            thaw(pids)

    async with receiver(inbox) as url:
        stats = await dispatch(named(server.url), url, during=stall)
    assert stats.stale >= 1, "no finish was caught by the stall: no fault was tested"
    assert stats.extended == 0  # each lease is the claim's own: its end is claim + lease
    done = assert_all_done_once(server.url, inbox, orders)
    with open_store(server.url, read_only=True) as store:
        assert store.stale_finishes() == stats.stale
        for row in done:  # the attempt that made it done finished within its lease
            assert row["available_at"] - row["done_started_ms"] < POLICY.lease_ms, row
        # a send the receiver acknowledged, refused stale: its job was
        # delivered again, and the inbox absorbed the repeat (a send that
        # failed during the freeze, refused stale as well, reached no inbox)
        acked_then_stale = {job_id for job_id in orders if any(
            a["outcome"] == "ok" and a["result"] == "stale"
            for a in store.job_history(job_id)["attempts"])}
    _, _, seen = inbox_figures(inbox)
    assert all(seen[job_id] >= 2 for job_id in acked_then_stale), acked_then_stale
    assert sum(seen.values()) >= len(orders) + len(acked_then_stale)


# ------------------------------------------------------------------ the listener


async def test_a_lost_listener_connection_is_made_again_and_wakes_the_dispatcher(
        make_postgres_server: Callable[..., PostgresServer]):
    """The listener's backend terminated: it reconnects, LISTENs again, and
    the next NOTIFY wakes an idle dispatcher long before its 30 s poll."""
    server = make_postgres_server()
    with open_store(server.url, create=True):
        pass
    sent = threading.Event()

    async def send(event: dict, token: int) -> bool:
        sent.set()
        return True

    listening = f"query = 'LISTEN {CHANNEL}'"

    def backends() -> int:
        with psycopg.connect(server.url, autocommit=True) as admin:
            row = admin.execute(f"SELECT count(*) FROM pg_stat_activity WHERE "
                                f"application_name = %s AND {listening}", (TARGET,)).fetchone()
        return 0 if row is None else int(row[0])

    async with Dispatcher(named(server.url), "idle", send=send, poll_interval=30,
                          policy=POLICY) as d:
        running = asyncio.create_task(d.run())
        await until(lambda: backends() == 1, "the listener listening")
        await asyncio.sleep(0.3)  # idle: waiting out its poll
        assert await asyncio.to_thread(terminate, server.url, listening) == 1
        await until(lambda: backends() == 1, "the listener listening again", 30)
        await asyncio.sleep(0.3)  # the reconnect's own poll is over: idle again
        enqueued = time.monotonic()
        await d.queue.enqueue_events([{"id": "wake", "qty": 1}], None, POLICY)
        assert await asyncio.to_thread(sent.wait, 20), "the NOTIFY never woke the dispatcher"
        woke = time.monotonic() - enqueued
        d.stop()
        await running
    assert d.failure is None and woke < 10
