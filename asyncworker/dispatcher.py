"""The asyncio dispatcher: many sends in flight, short claim/finish transactions.

Per job: ``claim`` (on the queue's thread) -> ``await send`` on the event loop
with no lock held, cut off before the lease runs out and extended (fenced) at
half of it -> ``finish`` (on the queue's thread) with a fresh clock value.
The outcome and delay come from ``lease.worker.classify_result`` /
``classify_error``, the very functions ``run_once`` uses.

A bad ACK or an unclassified error is logged with the job's id and token,
counted, and leaves the job leased: the lease expiry and the attempt budget
recover it. The dispatcher never dies of one job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sqlite3
import time
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

import aiohttp

from asyncworker.sender import new_session, send_http
from asyncworker.store import QueueThread, is_locked
from lease.http import check_url
from lease.worker import (
    MAX_BATCH,
    MAX_MS,
    BadAck,
    Retryable,
    check_identifier,
    check_jitter,
    check_now,
    check_run_args,
    check_second_clock,
    claim,
    claim_many,
    classify_error,
    classify_result,
    extend,
    finish,
    finish_many,
)

__all__ = [
    "Dispatcher",
    "DispatcherStats",
    "LeaseLost",
    "dispatcher_context",
    "run_once",
    "run_until_signalled",
]

log = logging.getLogger("asyncworker.dispatcher")

Send = Callable[[dict, int], Awaitable[object]]  # (event {"id", "qty"}, claim token)
Verdict = tuple[str, int]


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class LeaseLost(Exception):
    """An extension found the marker changed: someone else owns the job now."""


@dataclass
class DispatcherStats:
    """Counters an embedding service can read at any time."""

    claimed: int = 0
    claim_batches: int = 0  # claim transactions that leased something
    finish_batches: int = 0  # finish transactions
    ok: int = 0
    retried: int = 0
    permanent: int = 0
    dead: int = 0  # a retry that met the attempt budget or the deadline
    stale: int = 0  # a finish (or an extension) that found the lease gone
    bad_acks: int = 0
    errors: int = 0
    lock_retries: int = 0
    extended: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Held:
    """The ticket of a job in flight; an extension replaces it."""

    ticket: dict
    first_ms: int


class Dispatcher:
    """Own it with ``async with Dispatcher(path, owner, url=...) as d: await d.run()``.

    Exactly one of ``url`` (the default sender, ``send_http`` with the claim
    token) and ``send`` (a coroutine function ``send(event, token)``).
    ``clock`` returns milliseconds; ``jitter`` returns a ratio in 0..1 for
    each retry delay. ``poll_interval`` (seconds) is how long an idle
    dispatcher waits before it looks for work again.
    """

    def __init__(
        self,
        queue_path: Union[str, os.PathLike],
        owner: str,
        *,
        url: Optional[str] = None,
        send: Optional[Send] = None,
        concurrency: int = 16,
        lease_ms: int = 30_000,
        clock: Callable[[], int] = wall_clock_ms,
        jitter: Callable[[], float] = random.random,
        poll_interval: float = 0.05,
        batch_size: int = 64,
        create: bool = False,
    ) -> None:
        check_identifier("owner", owner)
        if (url is None) == (send is None):
            raise ValueError("give exactly one of url and send")
        if url is not None:
            check_url(url)
        if type(concurrency) is not int or not 1 <= concurrency <= 10_000:
            raise ValueError(f"concurrency must be an int in 1..10000, got {concurrency!r}")
        if type(lease_ms) is not int or not 1 <= lease_ms <= MAX_MS:
            raise ValueError(f"lease_ms must be an int in 1..{MAX_MS}, got {lease_ms!r}")
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH}, got {batch_size!r}")
        if type(poll_interval) not in (int, float) or not 0 < poll_interval <= 60:
            raise ValueError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
        for name, fn in (("clock", clock), ("jitter", jitter), ("send", send)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable")
        self.owner = owner
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.poll_interval = float(poll_interval)
        self.batch_size = batch_size
        # Time kept back at the end of a lease for the finish transaction.
        self.finish_margin_ms = max(1, min(lease_ms // 5, 2_000))
        self.stats = DispatcherStats()
        self._url = url
        self._send = send
        self._clock = clock
        self._jitter = jitter
        self._queue = QueueThread(queue_path, create=create)
        self._session: Optional[aiohttp.ClientSession] = None
        self._tasks: set[asyncio.Task] = set()
        self._finishing: set[asyncio.Future] = set()
        self._to_finish: list[tuple[_Held, Verdict, asyncio.Future]] = []
        self._flusher: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()

    # --------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Dispatcher:
        await self._queue.open()
        if self._send is None:
            self._session = new_session(limit=self.concurrency)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
        await self._settle()
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._queue.close()

    @property
    def queue(self) -> QueueThread:
        """The queue's connection thread: enqueue, redrive, snapshot, ..."""
        return self._queue

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Claim nothing more; sends in flight finish within their leases."""
        self._stop.set()

    def abort(self) -> None:
        """Stop at once: cancel the sends in flight, leaving leases that expire."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()

    async def run(self, *, until_idle: bool = False) -> DispatcherStats:
        """Dispatch until stop() (or, with until_idle, until every job is done or dead).

        Drained means nothing pending and nothing leased: retry delays and the
        leases of a dispatcher that died are waited out, not skipped.
        """
        self._stop.clear()
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                if len(self._tasks) >= self.concurrency:
                    await asyncio.wait({*self._tasks, stop_wait},
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                if await self._claim_some():
                    continue
                if until_idle and not self._tasks and await self._queue.is_drained():
                    break
                await asyncio.wait({*self._tasks, stop_wait}, timeout=self.poll_interval,
                                   return_when=asyncio.FIRST_COMPLETED)
            if self._tasks:  # graceful: in-flight sends end within their leases
                await asyncio.wait(self._tasks)
        finally:
            stop_wait.cancel()
            if self._tasks:  # run() itself was cancelled: abort what is in flight
                self.abort()
            await self._settle()
        return self.stats

    async def _settle(self) -> None:
        """Wait for cancelled jobs to unwind and for every shielded finish to land."""
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self._finishing:
            await asyncio.wait(self._finishing)

    # --------------------------------------------------------------- one job

    def _now(self) -> int:
        return check_now(self._clock(), "clock value")

    def _backoff(self) -> float:
        """A short jittered pause before retrying a locked database (seconds)."""
        return 0.002 + 0.02 * check_jitter(self._jitter())

    async def _claim_some(self) -> bool:
        """Claim as many jobs as there are free slots (up to batch_size), in one
        transaction; start a task for each. False when there was nothing to claim."""
        while not self._stop.is_set():
            first_ms = self._now()
            limit = min(self.concurrency - len(self._tasks), self.batch_size)
            try:
                tickets = await self._queue.call(claim_many, self.owner, first_ms,
                                                 self.lease_ms, limit)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc):
                    raise
                self.stats.lock_retries += 1
                await asyncio.sleep(self._backoff())
                continue
            if not tickets:
                return False
            self.stats.claimed += len(tickets)
            self.stats.claim_batches += 1
            for ticket in tickets:
                task = asyncio.create_task(self._work(_Held(ticket, first_ms)),
                                           name=f"job {ticket['id']} token {ticket['token']}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return True
        return False

    async def _work(self, held: _Held) -> None:
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            verdict = await self._judged_send(held)
            if verdict is not None:
                # Shielded: an abort must not lose an outcome already known.
                finishing = asyncio.ensure_future(self._finish(held, verdict))
                self._finishing.add(finishing)
                finishing.add_done_callback(self._finishing.discard)
                finishing.add_done_callback(_ignore_result)
                await asyncio.shield(finishing)
        except LeaseLost:
            stats.stale += 1
            log.info("lease lost id=%s token=%s", held.ticket["id"], held.ticket["token"])
        except Exception:
            stats.errors += 1
            log.exception("job failed id=%s token=%s", held.ticket["id"], held.ticket["token"])
        finally:
            stats.in_flight -= 1

    async def _judged_send(self, held: _Held) -> Optional[Verdict]:
        """The send's (outcome, delay), or None when the job must stay leased."""
        ticket = held.ticket
        try:
            return classify_result(await self._send_within_lease(held))
        except LeaseLost:
            raise
        except Exception as error:
            verdict = classify_error(error, ticket["attempt"], self._jitter())
            if verdict is not None:
                return verdict
            if isinstance(error, BadAck):
                self.stats.bad_acks += 1
                log.warning("bad ACK id=%s token=%s: %s", ticket["id"], ticket["token"], error)
            else:
                self.stats.errors += 1
                log.error("send failed id=%s token=%s: %r", ticket["id"], ticket["token"], error)
            return None

    async def _send_within_lease(self, held: _Held) -> object:
        """Await the send; extend the lease at half of it; give up before it ends."""
        event = {"id": held.ticket["id"], "qty": held.ticket["qty"]}
        sending = asyncio.ensure_future(self._call_send(event, held.ticket["token"]))
        can_extend = True
        try:
            while True:
                now = self._now()
                lease_until = held.ticket["lease_until"]
                budget = lease_until - self.finish_margin_ms - now
                if budget <= 0:
                    raise Retryable("the send did not finish within its lease")
                wait_ms = min(budget, max(1, (lease_until - now) // 2)) if can_extend else budget
                done, _ = await asyncio.wait({sending}, timeout=wait_ms / 1000)
                if done:
                    return sending.result()
                if can_extend:
                    renewed = await self._queue.call(extend, held.ticket, self._now(),
                                                     self.lease_ms)
                    if renewed is False:
                        raise LeaseLost(f"lease of {event['id']} token "
                                        f"{held.ticket['token']} is gone")
                    assert isinstance(renewed, dict)
                    self.stats.extended += 1
                    can_extend = renewed["lease_until"] > lease_until  # capped at the deadline
                    held.ticket = renewed
        finally:
            if not sending.done():
                sending.cancel()
                sending.add_done_callback(_ignore_result)

    async def _call_send(self, event: dict, token: int) -> object:
        if self._send is not None:
            return await self._send(event, token)
        assert self._url is not None
        return await send_http(self._url, event, timeout=self.lease_ms / 1000, token=token,
                               session=self._session)

    async def _finish(self, held: _Held, verdict: Verdict) -> None:
        """Queue this outcome for the next group commit and wait for its result.

        Finishes that arrive while a group is being written form the next
        group: one transaction for all of them, started as soon as the queue's
        thread is free, never held back waiting for more.
        """
        result: asyncio.Future = asyncio.get_running_loop().create_future()
        self._to_finish.append((held, verdict, result))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_finishes(), name="finish flusher")
        status = await result
        self._count(verdict[0], status)

    async def _flush_finishes(self) -> None:
        while self._to_finish:
            group = self._to_finish[: self.batch_size]
            del self._to_finish[: self.batch_size]
            try:
                statuses = await self._finish_group(group)
            except Exception as exc:
                for _, _, result in group:
                    result.set_exception(exc)
            else:
                for (_, _, result), status in zip(group, statuses, strict=True):
                    result.set_result(status)

    async def _finish_group(self, group: list) -> list:
        """finish_many with a fresh clock value; a locked database is retried while
        any lease in the group is still live (a finish after it would be False)."""
        while True:
            now = check_now(self._clock(), "clock value")
            for held, _, _ in group:
                check_second_clock(held.first_ms, now)
            items = [(held.ticket, outcome, delay) for held, (outcome, delay), _ in group]
            try:
                statuses = await self._queue.call(finish_many, items, now)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc):
                    raise
                self.stats.lock_retries += 1
                if all(now >= held.ticket["lease_until"] for held, _, _ in group):
                    return [False] * len(group)
                await asyncio.sleep(self._backoff())
                continue
            self.stats.finish_batches += 1
            return statuses

    def _count(self, outcome: str, status: Union[str, bool]) -> None:
        stats = self.stats
        if status is False:
            stats.stale += 1
        elif status == "done":
            stats.ok += 1
        elif status == "pending":
            stats.retried += 1
        elif outcome == "permanent":
            stats.permanent += 1
        else:
            stats.dead += 1


def _ignore_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def run_once(
    queue: QueueThread,
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict], Awaitable[object]],
    jitter: float,
    lease_ms: int = 1000,
) -> Optional[dict]:
    """The async twin of ``lease.run_once``: the same contract, the same rules.

    ``queue`` is an open QueueThread; ``send`` is a coroutine function.
    """
    check_run_args(owner, clock, send, jitter, lease_ms)
    first_ms = check_now(clock(), "clock value")
    ticket = await queue.call(claim, owner, first_ms, lease_ms)
    if ticket is None:
        return None
    try:
        verdict = classify_result(await send({"id": ticket["id"], "qty": ticket["qty"]}))
    except BaseException as error:
        classified = classify_error(error, ticket["attempt"], jitter)
        if classified is None:
            raise
        verdict = classified
    second_ms = check_second_clock(first_ms, clock())
    outcome, delay_ms = verdict
    status = await queue.call(finish, ticket, outcome, second_ms, delay_ms)
    return {"id": ticket["id"], "token": ticket["token"], "status": status or "stale"}


async def run_until_signalled(dispatcher: Dispatcher, *, until_idle: bool = False,
                              on_stop: Optional[Callable[[str], None]] = None) -> DispatcherStats:
    """run() with SIGINT/SIGTERM handled: the first stops gracefully, a second aborts."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal() -> None:
        if dispatcher.stopping:
            dispatcher.abort()
            if on_stop:
                on_stop("aborting: sends in flight are cancelled, their leases will expire")
        else:
            dispatcher.stop()
            if on_stop:
                on_stop("stopping: no new claims; sends in flight finish within their leases")

    for signum in signals:
        loop.add_signal_handler(signum, on_signal)
    try:
        return await dispatcher.run(until_idle=until_idle)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def dispatcher_context(
    dispatcher: Dispatcher, *, until_idle: bool = False
) -> Callable[[Any], AsyncIterator[None]]:
    """An aiohttp cleanup context: the application owns the dispatcher.

    ``app.cleanup_ctx.append(dispatcher_context(d))`` starts it with the
    application and stops it gracefully on cleanup.
    """

    async def context(app: Any) -> AsyncIterator[None]:
        async with dispatcher:
            task = asyncio.create_task(dispatcher.run(until_idle=until_idle), name="dispatcher")
            yield
            dispatcher.stop()
            await task

    return context
