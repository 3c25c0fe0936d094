"""The asyncio dispatcher: many sends in flight, short claim/finish transactions.

It runs the product queue (``lease.sqlite``): lab events {"id", "qty"} and
payload events {"id", "body"} alike, with a ``RetryPolicy`` (by default
``lease.policy.DEFAULT_POLICY``, which rides out a receiver outage of hours),
to one ``lease.http.Destination`` (https to any host, an ACK policy, signed
requests) over one session, or through a ``send`` of the caller's.

Per job: ``claim_jobs`` (on the queue's thread) -> ``await send`` on the event
loop with no lock held, cut off before the lease runs out and extended
(fenced) at half of it -> ``finish_jobs`` (on the queue's thread) with a fresh
clock value, in a group commit. The outcome comes from
``lease.worker.classify_result`` and the delay from the policy's
``classify``: the contract's own rule with the policy's backoff.

Every attempt leaves its evidence in the same transaction as its finish:
when it started (the claim's clock value), how long the send took, the HTTP
status and the error it saw. A bad ACK or an unclassified error is logged
with the job's id and token, counted, recorded as evidence only, and leaves
the job leased: the lease expiry and the attempt budget recover it. The
dispatcher never dies of one job.

A Dispatcher runs once: ``state`` goes new -> running -> stopping -> stopped,
or to failed (``failure`` holds the exception) when ``run()`` itself dies, for
example of a bad clock value or a database error. ``stop()`` is final, even
before ``run()`` starts. ``health()`` and ``health_handler`` tell an
application which of these it is.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import signal
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, Optional, Union

import aiohttp
from aiohttp import web

from asyncworker.sender import new_session, send_http
from asyncworker.store import QueueThread, is_locked
from lease.http import Destination
from lease.policy import DEFAULT_POLICY, PRODUCT, RetryPolicy
from lease.sqlite import MAX_ERROR_CHARS, Attempt, Leased, claim_jobs, extend_lease, finish_jobs
from lease.worker import (
    MAX_BATCH,
    BadAck,
    Retryable,
    check_identifier,
    check_jitter,
    check_now,
    check_run_args,
    check_second_clock,
    claim,
    classify_error,
    classify_result,
    finish,
)

__all__ = [
    "Dispatcher",
    "DispatcherStats",
    "LeaseLost",
    "dispatcher_context",
    "health_handler",
    "retry_delay_ms",
    "run_once",
    "run_until_signalled",
]

log = logging.getLogger("asyncworker.dispatcher")

# (event {"id", "qty"} or {"id", "body": canonical JSON text}, claim token)
Send = Callable[[dict, int], Awaitable[object]]


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class LeaseLost(Exception):
    """An extension found the marker changed: someone else owns the job now."""


class _Judged(NamedTuple):
    """What one attempt came to: the outcome to finish with (None: evidence
    only, the job stays leased), its retry delay, and what the attempt saw."""

    outcome: Optional[str]
    delay_ms: int
    seen: Attempt


DEATH_REASONS = ("deadline", "exhausted", "permanent")


def _no_deaths() -> dict[str, int]:
    return dict.fromkeys(DEATH_REASONS, 0)


@dataclass
class DispatcherStats:
    """Counters an embedding service can read at any time."""

    claimed: int = 0  # tickets received
    claim_calls: int = 0  # claim transactions (each commits, even when empty)
    claim_batches: int = 0  # claim transactions that leased something
    finish_batches: int = 0  # finish transactions (group commits)
    ok: int = 0  # finished done
    retried: int = 0  # finished pending again, after a Retryable
    # Every job this dispatcher moved to dead: by its finishes, and by its
    # claims' quarantine (past the deadline or out of attempts while pending,
    # or while leased with the lease run out).
    dead: int = 0
    dead_by_reason: dict[str, int] = field(default_factory=_no_deaths)  # all three keys
    quarantined: int = 0  # the moves to dead made by this dispatcher's claims (part of dead)
    stale: int = 0  # a finish (or an extension) that found the lease gone
    bad_acks: int = 0  # answers that were no evidence: the job stays leased
    errors: int = 0  # jobs that failed (send or finish unclassified): the job stays leased
    lock_retries: int = 0  # another process held the write lock: waited and retried
    extended: int = 0  # leases pushed forward for sends still running
    in_flight: int = 0  # jobs claimed and not yet recorded (a finish may wait for its group)
    sending: int = 0  # send slots in use: claimed jobs whose send has not ended (<= concurrency)
    peak_sending: int = 0  # the most send slots in use at once (<= concurrency)

    def as_dict(self) -> dict[str, Any]:
        """Every counter, JSON-serialisable (``dead_by_reason`` a nested dict)."""
        return asdict(self)

    def count_dead(self, reason: str, n: int = 1) -> None:
        self.dead += n
        self.dead_by_reason[reason] += n


@dataclass(eq=False)  # identity: a job in flight is itself, whatever its ticket says
class _Held:
    """A job in flight. Only the queue's thread replaces ``ticket`` (on an
    extension), so the ticket a finish uses is always the one in the file."""

    ticket: dict
    event: dict  # what is sent: {"id", "qty"} or {"id", "body"}
    first_ms: int
    extend_at: int  # clock value at half of the current lease
    claimed_at: float = field(default_factory=time.perf_counter)
    task: Optional[asyncio.Task] = None
    cut: Optional[str] = None  # why the lease keeper cancelled the send: timeout | lost
    can_extend: bool = True
    send_over: bool = False  # its send slot has been given back
    handed_over: bool = False  # its finish is queued: the flusher records it


class Dispatcher:
    """Own it with ``async with Dispatcher(path, owner, url=...) as d: await d.run()``.

    Exactly one of ``url``, ``destination`` and ``send``. ``url`` is a
    ``lease.http.Destination`` with the defaults (https to any host, plain
    http to loopback, the echo-id ACK, unsigned); ``destination`` a whole
    one (an ACK policy, a CA file, secrets). Both send with ``send_http``
    and the claim token, over one session whose connections are kept alive,
    signed (with secrets) at this dispatcher's clock in seconds. ``send``
    is a coroutine function ``send(event, token)``. The event is the job as
    enqueued, {"id", "qty"} or {"id", "body"} with the body as its
    canonical JSON text. ``policy`` spaces the retries
    (``policy.classify``; a receiver's Retry-After is honoured up to its
    backoff cap, ``retry_delay_ms``); ``lease_ms`` defaults to the policy's lease
    (1 ms .. 1 h) and bounds each send. A job's budget (attempts, time to
    live) is the one it was enqueued with. ``clock`` returns milliseconds;
    ``jitter`` returns a uniform draw in 0..1 for each retry delay (the
    policy makes its jitter of it). ``poll_interval`` (seconds) is how long
    an idle dispatcher waits before it looks for work again. ``concurrency`` bounds
    the sends in flight; ``batch_size`` bounds the jobs one claim or finish
    transaction handles. ``create`` makes a missing queue file (by default a
    missing queue is FileNotFoundError, as for ``run_file``). ``latencies``,
    when a list, receives each job's claim-to-finish time in seconds.

    It runs once: after ``stop()`` (even one that came before ``run()``
    started), after ``run()`` returned or after a failure, ``run()`` does not
    dispatch again.
    """

    def __init__(
        self,
        queue_path: Union[str, os.PathLike],
        owner: str,
        *,
        url: Optional[str] = None,
        destination: Optional[Destination] = None,
        send: Optional[Send] = None,
        concurrency: int = 16,
        policy: RetryPolicy = DEFAULT_POLICY,
        lease_ms: Optional[int] = None,
        clock: Callable[[], int] = wall_clock_ms,
        jitter: Callable[[], float] = random.random,
        poll_interval: float = 0.05,
        batch_size: int = 64,
        create: bool = False,
        latencies: Optional[list[float]] = None,
    ) -> None:
        check_identifier("owner", owner)
        destination = _one_destination(url, destination, send)
        if type(concurrency) is not int or not 1 <= concurrency <= 10_000:
            raise ValueError(f"concurrency must be an int in 1..10000, got {concurrency!r}")
        if not isinstance(policy, RetryPolicy):
            raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        if lease_ms is None:
            lease_ms = policy.lease_ms
        if type(lease_ms) is not int or not 1 <= lease_ms <= PRODUCT.max_lease_ms:
            raise ValueError(f"lease_ms must be an int in 1..{PRODUCT.max_lease_ms}, "
                             f"got {lease_ms!r}")
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH}, got {batch_size!r}")
        if type(poll_interval) not in (int, float) or not 0 < poll_interval <= 60:
            raise ValueError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
        for name, fn in (("clock", clock), ("jitter", jitter), ("send", send)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable")
        self.owner = owner
        self.concurrency = concurrency
        self.policy = policy
        self.lease_ms = lease_ms
        self.poll_interval = float(poll_interval)
        self.batch_size = batch_size
        # When a list is given, each job's claim-to-finish time (s) is appended.
        self.latencies = latencies
        # Time kept back at the end of a lease for the finish transaction.
        self.finish_margin_ms = max(1, min(lease_ms // 5, 2_000))
        self.stats = DispatcherStats()
        self.destination = destination  # None with a send of the caller's
        self._send = send
        self._clock = clock
        self._jitter = jitter
        self._queue = QueueThread(queue_path, create=create)
        self._session: Optional[aiohttp.ClientSession] = None
        self._tasks: set[asyncio.Task] = set()
        self._sending: set[_Held] = set()
        self._slot_freed = asyncio.Event()
        self._claim_at_least = max(1, min(batch_size, concurrency // 8))
        self._to_finish: list[tuple[_Held, _Judged, asyncio.Future]] = []
        self._flusher: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()  # set once, never cleared: a stop is final
        self._running = False
        self._failure: Optional[BaseException] = None
        self._last_claim_ms: Optional[int] = None

    # --------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Dispatcher:
        await self._queue.open()
        if self.destination is not None:
            self._session = new_session(limit=self.concurrency,
                                        ssl_context=self.destination.ssl_context)
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
        """A stop was asked for, or run() is over: nothing more will be claimed."""
        return self._stop.is_set()

    @property
    def state(self) -> str:
        """new, running, stopping (sends in flight finish), stopped, or failed."""
        if self._failure is not None:
            return "failed"
        if self._running:
            return "stopping" if self._stop.is_set() else "running"
        return "stopped" if self._stop.is_set() else "new"

    @property
    def failure(self) -> Optional[BaseException]:
        """What made run() fail, or None."""
        return self._failure

    def health(self) -> dict[str, Any]:
        """The answer to "is it dispatching?", JSON-serialisable. ``last_claim_ms``
        is the clock value of the last claim transaction that committed."""
        failure = self._failure
        return {
            "state": self.state,
            "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
            "last_claim_ms": self._last_claim_ms,
            "sending": self.stats.sending,
            "in_flight": self.stats.in_flight,
        }

    def stop(self) -> None:
        """Claim nothing more; sends in flight finish within their leases.
        Final: a stop that comes before run() starts makes run() return at once."""
        self._stop.set()

    def abort(self) -> None:
        """Stop at once: cancel the sends in flight, leaving leases that expire."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()

    async def run(self, *, until_idle: bool = False) -> DispatcherStats:
        """Dispatch until stop() (or, with until_idle, until every job is done or dead).

        Drained means nothing pending and nothing leased: retry delays and the
        leases of a dispatcher that died are waited out, not skipped. Once only:
        after a stop (even one before this call) or a previous run it returns
        the stats at once; after a failure it raises RuntimeError. Whatever
        makes it fail (the lease keeper's death included) is raised, once every
        queued finish is written, and ``state`` says "failed" from that moment.
        """
        if self._running:
            raise RuntimeError("this dispatcher is already running")
        if self._failure is not None:
            raise RuntimeError(f"this dispatcher failed: {self._failure!r}") from self._failure
        if self._stop.is_set():
            return self.stats
        self._running = True
        try:
            await self._dispatch(until_idle)
        except Exception as exc:
            self._failure = self._failure or exc
            raise
        finally:
            self._stop.set()  # it runs once
            self._running = False
        if self._failure is not None:  # the lease keeper died and aborted the run
            raise self._failure
        return self.stats

    async def _dispatch(self, until_idle: bool) -> None:
        stop_wait = asyncio.ensure_future(self._stop.wait())
        keeper = asyncio.create_task(self._keep_leases(), name="lease keeper")
        keeper.add_done_callback(self._keeper_died)
        try:
            while not self._stop.is_set():
                free = self.concurrency - self.stats.sending
                if free < self._claim_at_least and self.stats.sending:
                    # Wait for a few slots, then claim them in one transaction: fewer,
                    # fuller claim transactions for the same sends in flight.
                    await self._slot_or_stop(stop_wait, None)
                    continue
                if await self._claim_some():
                    continue
                if until_idle and not self._tasks and await self._queue.is_drained():
                    break
                await self._slot_or_stop(stop_wait, self.poll_interval)
            if self._tasks:  # graceful: in-flight sends end within their leases
                await asyncio.wait(self._tasks)
        except Exception as exc:
            self._failure = self._failure or exc  # failed from now, not once unwound
            raise
        finally:
            stop_wait.cancel()
            if self._tasks:  # cancelled or failed: abort what is in flight
                self.abort()
            await self._settle()
            keeper.remove_done_callback(self._keeper_died)
            keeper.cancel()

    async def _slot_or_stop(self, stop_wait: asyncio.Future, timeout: Optional[float]) -> None:
        """Wait until a send ends (a slot is free), a job ends, stop(), or the timeout."""
        self._slot_freed.clear()
        slot = asyncio.ensure_future(self._slot_freed.wait())
        try:
            await asyncio.wait({slot, stop_wait}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            slot.cancel()

    def _keeper_died(self, keeper: asyncio.Task) -> None:
        """Without its lease keeper no send is cut off in time: the run fails at
        once (``state``), and run() raises the keeper's error once it has unwound.
        Not logged here: whoever awaits run() (or dispatcher_context) reports it once."""
        error = None if keeper.cancelled() else keeper.exception()
        if error is not None:
            self._failure = self._failure or error
            self.abort()

    async def _settle(self) -> None:
        """Wait for the jobs to unwind and for every queued finish to be written."""
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self._flusher is not None:
            await asyncio.wait({self._flusher})

    # --------------------------------------------------------------- one job

    def _now(self) -> int:
        return check_now(self._clock(), "clock value")

    def _backoff(self) -> float:
        """A short jittered pause before retrying a locked database (seconds)."""
        return 0.001 + 0.009 * check_jitter(self._jitter())

    async def _claim_some(self) -> bool:
        """Claim as many jobs as there are free slots (up to batch_size), in one
        transaction; start a task for each. False when there was nothing to claim."""
        while not self._stop.is_set():
            first_ms = self._now()
            limit = min(self.concurrency - self.stats.sending, self.batch_size)
            try:
                leased, moved = await self._queue.try_call(claim_jobs, self.owner, first_ms,
                                                           self.lease_ms, limit)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc):
                    raise
                self.stats.lock_retries += 1
                await asyncio.sleep(self._backoff())
                continue
            self._claimed(first_ms, leased, moved)
            return bool(leased)
        return False

    def _claimed(self, first_ms: int, leased: list[Leased], moved: dict[str, int]) -> None:
        """Count a committed claim (its quarantine moves too) and start its jobs."""
        stats = self.stats
        stats.claim_calls += 1
        self._last_claim_ms = first_ms
        for reason, n in moved.items():
            stats.count_dead(reason, n)
            stats.quarantined += n
        if not leased:
            return
        stats.claimed += len(leased)
        stats.claim_batches += 1
        stats.in_flight += len(leased)
        stats.sending += len(leased)  # a slot per job from its claim to its send's end
        stats.peak_sending = max(stats.peak_sending, stats.sending)
        for job in leased:
            ticket = job.ticket
            held = _Held(ticket, job.event, first_ms, _half_way(first_ms, ticket["lease_until"]))
            held.task = asyncio.create_task(
                self._work(held), name=f"job {ticket['id']} token {ticket['token']}")
            self._tasks.add(held.task)
            held.task.add_done_callback(functools.partial(self._job_done, held))

    def _job_done(self, held: _Held, task: asyncio.Task) -> None:
        # A done callback, so it runs even for a task cancelled before its first step.
        self._tasks.discard(task)
        self._send_done(held)
        if not held.handed_over:  # no finish queued: the job ends here, left leased
            self.stats.in_flight -= 1
        self._slot_freed.set()

    def _send_done(self, held: _Held) -> None:
        # The slot is free as soon as the send is over: the finish is written
        # by the flusher, in a group, while the next sends already run.
        if not held.send_over:
            held.send_over = True
            self.stats.sending -= 1
            self._slot_freed.set()

    async def _work(self, held: _Held) -> None:
        try:
            await self._finish(held, await self._judged_send(held))
        except Exception:
            self.stats.errors += 1
            log.exception("job failed id=%s token=%s", held.ticket["id"], held.ticket["token"])

    async def _judged_send(self, held: _Held) -> _Judged:
        """Send, and judge what came of it; the send's own duration is its latency.

        The lease keeper may cancel the send: at the end of its lease (a
        timeout, retried like any Retryable) or when an extension finds the
        lease gone (LeaseLost). Any other cancellation is a shutdown: it
        propagates.
        """
        ticket = held.ticket
        error: Optional[BaseException] = None
        self._sending.add(held)
        started = time.perf_counter()
        try:
            try:
                classify_result(await self._call_send(held.event, ticket["token"]))
            except asyncio.CancelledError:
                if held.cut is None:
                    raise
                _uncancel()
                error = (LeaseLost(f"lease of {ticket['id']} token {ticket['token']} is gone")
                         if held.cut == "lost"
                         else Retryable("the send did not finish within its lease"))
            except Exception as exc:
                error = exc
        finally:
            latency_ms = round((time.perf_counter() - started) * 1000)
            self._sending.discard(held)
            self._send_done(held)
        if error is None:
            return _Judged("ok", 0, Attempt(held.first_ms, latency_ms))
        return self._judge_error(held, error, Attempt(
            held.first_ms, latency_ms, _http_status(error), _error_text(error)))

    def _judge_error(self, held: _Held, error: BaseException, seen: Attempt) -> _Judged:
        """A failed send's outcome and delay by the policy. A lost lease is
        finished as a retry, which its fence refuses as stale: the attempt is
        recorded and counted like any late finish. A bad ACK or an
        unclassified error proves nothing: evidence only, the job stays leased."""
        ticket = held.ticket
        if isinstance(error, LeaseLost):
            log.info("lease lost id=%s token=%s", ticket["id"], ticket["token"])
            return _Judged("retry", self.policy.delay_ms(ticket["attempt"], self._jitter()),
                           seen)
        verdict = self.policy.classify(error, ticket["attempt"], self._jitter())
        if verdict is not None:
            outcome, delay_ms = verdict
            if outcome == "retry":
                delay_ms = retry_delay_ms(delay_ms, _retry_after_ms(error),
                                          self.policy.backoff_cap_ms)
            return _Judged(outcome, delay_ms, seen)
        if isinstance(error, BadAck):
            self.stats.bad_acks += 1
            log.warning("bad ACK id=%s token=%s: %s", ticket["id"], ticket["token"], error)
        else:
            self.stats.errors += 1
            log.error("send failed id=%s token=%s: %r", ticket["id"], ticket["token"], error)
        return _Judged(None, 0, seen)

    async def _call_send(self, event: dict, token: int) -> object:
        if self._send is not None:
            return await self._send(event, token)
        destination = self.destination
        assert destination is not None
        # The clock is read for a signature only: an unsigned send reads it no more than before.
        stamp = self._now() // 1000 if destination.secrets else None
        return await send_http(destination, event, timeout=self.lease_ms / 1000, token=token,
                               session=self._session, timestamp=stamp)

    # --------------------------------------------------------------- leases

    async def _keep_leases(self) -> None:
        """One task watches every send in flight: it extends a lease at half of
        it, and cuts a send off before its lease ends (keeping time for the
        finish). One task instead of a timer per job keeps the per-job cost low."""
        tick = max(0.005, min(self.finish_margin_ms, self.lease_ms // 4) / 2000)
        while True:
            await asyncio.sleep(tick)
            if self._sending:
                await self._tend(list(self._sending))

    async def _tend(self, sending: list[_Held]) -> None:
        now = self._now()
        for held in sending:
            if held.cut is not None:
                continue
            if held.ticket["lease_until"] - self.finish_margin_ms <= now:
                self._cut(held, "timeout")
            elif held.can_extend and now >= held.extend_at:
                await self._extend(held)

    async def _extend(self, held: _Held) -> None:
        try:
            renewed = await self._queue.try_call(_extend_held, held, self._now(),
                                                 self.lease_ms)
        except sqlite3.OperationalError as exc:
            if not is_locked(exc):
                raise
            self.stats.lock_retries += 1  # tried again at the next tick
            return
        if renewed is None:
            self._cut(held, "lost")
            return
        self.stats.extended += 1
        held.can_extend = renewed  # False once the lease is capped at the deadline
        held.extend_at = _half_way(self._now(), held.ticket["lease_until"])

    def _cut(self, held: _Held, why: str) -> None:
        held.cut = why
        if held.task is not None and held in self._sending:
            held.task.cancel()

    # --------------------------------------------------------------- finishes

    async def _finish(self, held: _Held, judged: _Judged) -> None:
        """Queue this outcome (or evidence only) for the next group commit and wait for it.

        Finishes that arrive while a group is being written form the next
        group: one transaction for all of them, started as soon as the queue's
        thread is free, never held back waiting for more. The flusher task
        owns the outcome once it is queued: cancelling this job (an abort)
        cannot lose it, and the flusher counts it, written or failed.
        """
        result: asyncio.Future = asyncio.get_running_loop().create_future()
        self._to_finish.append((held, judged, result))
        held.handed_over = True
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_finishes(), name="finish flusher")
        await result

    async def _flush_finishes(self) -> None:
        while self._to_finish:
            group = self._to_finish[: self.batch_size]
            del self._to_finish[: self.batch_size]
            results: list[Optional[_Recorded]]
            try:
                results = list(await self._finish_group(group))
            except Exception:
                # Counted and logged here, once: the jobs' own tasks only wait. An
                # evidence-only item was counted already, as the bad ACK or error it is.
                self.stats.errors += sum(1 for _, judged, _ in group
                                         if judged.outcome is not None)
                log.exception("finish failed, %d jobs left leased: %s", len(group),
                              _some_ids([held for held, _, _ in group]))
                results = [None] * len(group)
            for (held, judged, result), status in zip(group, results, strict=True):
                self.stats.in_flight -= 1
                if status is not None and judged.outcome is not None:
                    self._count(*status)
                    if self.latencies is not None:
                        self.latencies.append(time.perf_counter() - held.claimed_at)
                if not result.done():
                    result.set_result(status)

    async def _finish_group(self, group: list) -> list[_Recorded]:
        """finish_jobs with a fresh clock value; a locked database is retried while
        any lease in the group is still live (a finish after it would be False)."""
        helds = [held for held, _, _ in group]
        judged = [judged for _, judged, _ in group]
        while True:
            now = check_now(self._clock(), "clock value")
            for held in helds:
                check_second_clock(held.first_ms, now)
            try:
                statuses = await self._queue.try_call(_finish_helds, helds, judged, now)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc):
                    raise
                self.stats.lock_retries += 1
                if all(now >= held.ticket["lease_until"] for held in helds):
                    return [(False, None)] * len(group)
                await asyncio.sleep(self._backoff())
                continue
            self.stats.finish_batches += 1
            return statuses

    def _count(self, status: Union[str, bool], reason: Optional[str]) -> None:
        stats = self.stats
        if status is False:
            stats.stale += 1
        elif status == "done":
            stats.ok += 1
        elif status == "pending":
            stats.retried += 1
        else:
            assert reason is not None
            stats.count_dead(reason)


def _one_destination(url: Optional[str], destination: object,
                     send: object) -> Optional[Destination]:
    """The destination of exactly one of url, destination and send (None: send)."""
    if sum(given is not None for given in (url, destination, send)) != 1:
        raise ValueError("give exactly one of url, destination and send")
    if url is not None:
        return Destination(url)  # every check of a destination, the type of url included
    if destination is not None and not isinstance(destination, Destination):
        raise ValueError(f"destination must be a lease.http.Destination, "
                         f"got {type(destination).__name__}")
    return destination


def retry_delay_ms(policy_delay_ms: int, retry_after_ms: Optional[int], cap_ms: int) -> int:
    """A retry's delay: the policy's, or longer when the receiver asked for
    longer (Retry-After), but never past the policy's backoff cap for that."""
    if retry_after_ms is None:
        return policy_delay_ms
    return max(policy_delay_ms, min(retry_after_ms, cap_ms))


def _some_ids(helds: list[_Held], most: int = 20) -> str:
    """id/token of the first few jobs, for a log line that stays one line."""
    named = " ".join(f"{held.ticket['id']}/{held.ticket['token']}" for held in helds[:most])
    return named if len(helds) <= most else f"{named} and {len(helds) - most} more"


def _half_way(now_ms: int, lease_until: int) -> int:
    return now_ms + (lease_until - now_ms) // 2


def _uncancel() -> None:
    """We cancelled this send ourselves and handled it: withdraw that request
    (Python 3.11+), so structured timeouts around the job still work."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


def _extend_held(con: sqlite3.Connection, held: _Held, now_ms: int,
                 lease_ms: int) -> Optional[bool]:
    """On the queue's thread: extend, and replace the ticket right there, so a
    finish queued behind this call uses the new one. None: the lease is gone;
    otherwise whether the lease actually moved (False once capped)."""
    renewed = extend_lease(con, held.ticket, now_ms, lease_ms)
    if renewed is False:
        return None
    assert isinstance(renewed, dict)
    moved = renewed["lease_until"] > held.ticket["lease_until"]
    held.ticket = renewed
    return moved


_Recorded = tuple[Union[str, bool], Optional[str]]  # (status or False, reason: the cause if dead)


def _finish_helds(con: sqlite3.Connection, helds: list[_Held], judged: list[_Judged],
                  now_ms: int) -> list[_Recorded]:
    """On the queue's thread: finish_jobs with each job's current ticket and its
    attempt's evidence; per job its status and reason, (False, None) for a
    stale one, ("leased", None) for evidence only."""
    items = [(held.ticket, *one) for held, one in zip(helds, judged, strict=True)]
    return [result or (False, None) for result in finish_jobs(con, items, now_ms)]


def _http_status(error: BaseException) -> Optional[int]:
    """The HTTP status the sender put on its exception, if it is one."""
    try:
        status = getattr(error, "http_status", None)
    except Exception:  # a foreign exception's property: no status, not a lost finish
        return None
    return status if type(status) is int and 100 <= status <= 999 else None


def _retry_after_ms(error: BaseException) -> Optional[int]:
    """The wait the receiver asked for, as the sender put it on its exception."""
    try:
        wait = getattr(error, "retry_after_ms", None)
    except Exception:  # a foreign exception's property: no wait asked for
        return None
    return wait if type(wait) is int and wait >= 0 else None


def _error_text(error: BaseException) -> str:
    """The exception as evidence: its class and message, capped as it is kept."""
    name = type(error).__name__
    try:
        text = str(error)
    except Exception:  # a broken __str__ must not lose the finish: the class alone
        return name
    return f"{name}: {text}"[:MAX_ERROR_CHARS] if text else name


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
                              on_stop: Optional[Callable[[str], None]] = None,
                              on_ready: Optional[Callable[[], None]] = None) -> DispatcherStats:
    """run() with SIGINT/SIGTERM handled: the first stops gracefully, a second aborts.

    ``on_ready`` is called once the handlers are in place: from then on a
    signal is always a graceful stop, never the default sudden exit."""
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
    if on_ready is not None:
        on_ready()
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
    application and stops it gracefully on cleanup. If run() fails while the
    application serves, the error is logged with its traceback at once,
    ``dispatcher.state`` is "failed" (``health_handler`` answers 503), and
    the error is raised again at cleanup.
    """

    async def context(app: Any) -> AsyncIterator[None]:
        async with dispatcher:
            task = asyncio.create_task(dispatcher.run(until_idle=until_idle), name="dispatcher")
            task.add_done_callback(_log_failure)
            yield
            dispatcher.stop()
            await task

    return context


def _log_failure(task: asyncio.Task) -> None:
    """Nobody awaits the run task until cleanup: say at once that it died."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.error("dispatcher failed; it claims nothing more", exc_info=error)


def health_handler(dispatcher: Dispatcher) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler: ``dispatcher.health()`` as JSON, 200 while it is
    running, 503 otherwise (new, stopping, stopped or failed)."""

    async def health(request: web.Request) -> web.Response:
        answer = dispatcher.health()
        return web.json_response(answer, status=200 if answer["state"] == "running" else 503)

    return health
