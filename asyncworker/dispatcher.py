"""The asyncio dispatcher: many sends in flight, short claim/finish transactions.

It runs the product queue (``lease.sqlite``): lab events {"id", "qty"} and
payload events {"id", "body"} alike, with a ``RetryPolicy`` (by default
``lease.policy.DEFAULT_POLICY``, which rides out a receiver outage of hours),
to one ``lease.http.Destination`` (https to any host, an ACK policy, signed
requests) over one session, or through a ``send`` of the caller's; or it
serves the queue's endpoints (``endpoints="*"`` or their names: each delivery
to its own endpoint's destination, secrets and static headers, over the
endpoint's own pool; ``asyncworker.routes``).

Per job: ``claim_jobs`` (on the queue's thread) -> ``await send`` on the event
loop with no lock held, cut off before the lease runs out and extended
(fenced) at half of it -> ``finish_jobs`` (on the queue's thread) with a fresh
clock value, in a group commit. While every slot is busy a few claimed
jobs wait in line (``prefetch``), so a send that ends starts the next at
once instead of leaving its slot idle for a claim's durable commit; their
leases are kept like those of the sends in flight. The outcome comes from
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
before ``run()`` starts. ``health()`` and ``asyncworker.metrics.health_handler``
tell an application which of these it is; ``check_health()`` (and the
handler) also asks the store whether it answers. ``d.metrics`` is its
Prometheus registry (``asyncworker.metrics``: ``/metrics`` and ``/healthz``
for an aiohttp app; that module reads the dispatcher and never imports this one).

Logs (logger ``asyncworker.dispatcher``): every retry, dead job, stale
finish, lost lease, bad ACK, send error and finish failure is one record
whose facts are ``extra=`` fields (id, token, owner, attempt, outcome,
status, reason, http_status, error, delay_ms, and a delivery's endpoint); a
job done is a debug record. No record holds a job's body, a secret or a
static header's value. Serving endpoints, each change of an endpoint's
circuit is one record (read from the breaker's audit rows with the endpoint
refresh), and a failed attempt while its circuit is not closed, or after the
breaker's threshold of failures in a row, is counted in one summary record
per endpoint per ``summary_s`` instead of a record of its own
(``asyncworker.routes``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncworker import tracing
from asyncworker.finisher import BUSY, GroupFinisher, Judged, Recorded
from asyncworker.leases import (
    Held,
    LeaseKeeper,
    StoreTime,
    finish_margin_ms,
    half_way,
)
from asyncworker.metrics import HEALTH_TIMEOUT_S, DispatcherMetrics, EndpointFigures
from asyncworker.routes import REFRESH_S, SUMMARY_S, EndpointRoutes, Route
from asyncworker.sender import deliver
from asyncworker.store import AsyncStore, Target
from asyncworker.wire import WireClient
from lease.breaker import signal_of
from lease.clock import wall_clock_ms
from lease.endpoints import check_served
from lease.http import Destination
from lease.policy import DEFAULT_POLICY, PRODUCT, RetryPolicy, retry_delay_ms
from lease.records import Attempt, Claimed
from lease.store import Store
from lease.worker import (
    MAX_BATCH,
    BadAck,
    Busy,
    Retryable,
    check_identifier,
    check_jitter,
    check_now,
    check_run_args,
    check_second_clock,
    claim,
    classify_result,
    cycle_result,
    finish,
    lab_event,
    lab_verdict,
)

__all__ = [
    "Dispatcher",
    "DispatcherStats",
    "LeaseLost",
    "dispatcher_context",
    "retry_delay_ms",
    "run_once",
    "run_until_signalled",
]

log = logging.getLogger("asyncworker.dispatcher")

MAX_PREFETCH = 10_000

# (event {"id", "qty"} or {"id", "body": canonical JSON text}, claim token)
Send = Callable[[dict, int], Awaitable[object]]


class LeaseLost(Exception):
    """An extension found the marker changed: someone else owns the job now."""


DEATH_REASONS = ("deadline", "exhausted", "permanent")


STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx", "none")


def status_class(http_status: int | None) -> str:
    """An answer's class ("2xx", ...), or "none": no answer (a transport error,
    a timeout, a send cut off by its lease)."""
    if http_status is None or not 100 <= http_status <= 599:
        return "none"
    return f"{http_status // 100}xx"


def _no_answers() -> dict[str, int]:
    return dict.fromkeys(STATUS_CLASSES, 0)


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
    stale: int = 0  # a finish (or an extension, or a release) that found the lease gone
    # outcomes not recorded: the store stayed busy past every lease of their group (the
    # job stays leased, its lease runs out); no fence judged them, so not stale
    unrecorded_busy: int = 0
    bad_acks: int = 0  # answers that were no evidence: the job stays leased
    errors: int = 0  # jobs that failed (send or finish unclassified): the job stays leased
    lock_retries: int = 0  # the store was busy (a write lock, a lost connection): retried
    extended: int = 0  # leases pushed forward for sends still running
    in_flight: int = 0  # jobs claimed and not yet recorded (a finish may wait for its group)
    sending: int = 0  # send slots in use: claimed jobs whose send has not ended (<= concurrency)
    peak_sending: int = 0  # the most send slots in use at once (<= concurrency)
    waiting: int = 0  # claimed jobs waiting for a send slot (<= prefetch)
    left_leased: int = 0  # jobs an abort left leased, never finished: their leases run out
    # deliveries claimed for an endpoint this dispatcher does not know, even after reading
    # the endpoints again (removed since): left leased, never sent; their leases run out
    unknown_endpoint: int = 0
    # deliveries claimed and given back unsent (Store.release_jobs): their endpoint's
    # circuit opened, or a Retry-After paused it, after their claim; no attempt spent
    released: int = 0
    # every send that ended, by its answer's HTTP status class ("none": no answer)
    answers: dict[str, int] = field(default_factory=_no_answers)

    def as_dict(self) -> dict[str, Any]:
        """Every counter, JSON-serialisable (``dead_by_reason`` a nested dict)."""
        return asdict(self)

    def count_dead(self, reason: str, n: int = 1) -> None:
        self.dead += n
        self.dead_by_reason[reason] += n


class SendSlots:
    """The bound on sends in flight, and the few claimed jobs that wait for one.

    A job takes a slot when its send starts and gives it back the moment the
    send ends (its finish is written in a group while the next sends already
    run). The slot is a flag on the job itself (``Held.has_slot``): no object
    per job, and ``give_back`` is idempotent.

    A few claimed jobs (at most ``prefetch``) wait in line (``waiting``) while
    the slots are busy, and a slot given back goes straight to the first of
    them: a send that ends starts the next one at once, without waiting for a
    claim transaction (several milliseconds of a durable commit, during which
    the slots would stand idle). ``room`` is how many jobs a claim may take.
    ``freed`` is set only when the dispatch loop has something to do: room for
    at least ``wake_at`` jobs (a claim is worth making) or no send in flight; a
    wake-up per send that ended would cost the loop a round (and a task) per job."""

    def __init__(self, size: int, stats: DispatcherStats, wake_at: int = 1,
                 prefetch: int = 0) -> None:
        self.size = size
        self.wake_at = wake_at
        self.prefetch = prefetch
        self._stats = stats  # sending, peak_sending and waiting are the slots' own figures
        self.waiting: deque[Held] = deque()
        self.line = 0  # how many may wait, as the last claim measured it
        self.ended = 0  # sends ended so far: the line's length is read off it
        self._ended_at_claim = 0
        self._span_before = 0
        self.freed = asyncio.Event()

    @property
    def used(self) -> int:
        return self._stats.sending

    @property
    def free(self) -> int:
        return self.size - self._stats.sending

    @property
    def room(self) -> int:
        """Jobs a claim may take now: the free slots, and the line's free places."""
        return self.size - self._stats.sending + max(0, self.line - len(self.waiting))

    def measure_line(self) -> None:
        """After each claim: the line is twice as long as the most sends that
        ended between two claims, of the last two such spans (at most
        ``prefetch``). Twice, because sends end in bursts as large as the
        slots (a receiver answers a group it committed at once) while claims
        come every few sends that ended: a line as long as one span stayed
        shorter than a burst, and the slots it could not fill stood idle
        through the claim after it. Two spans, because one alone swings
        between none and many. A dispatcher that has been idle has none, so it
        claims no more than it can send at once and leaves the rest to the
        dispatchers beside it."""
        span = self.ended - self._ended_at_claim
        self.line = min(self.prefetch, 2 * max(span, self._span_before))
        self._span_before = span
        self._ended_at_claim = self.ended

    def take(self, held: Held) -> None:
        assert self.free > 0, "a send started with every slot in use"
        stats = self._stats
        stats.sending += 1
        if stats.sending > stats.peak_sending:
            stats.peak_sending = stats.sending
        held.has_slot = True

    def wait(self, held: Held) -> None:
        assert len(self.waiting) < self.prefetch, "a claim took more jobs than there is room"
        self.waiting.append(held)
        self._stats.waiting = len(self.waiting)

    def give_back(self, held: Held) -> Held | None:
        """Free ``held``'s slot; the first job waiting for one, its slot taken, or None."""
        if not held.has_slot:
            return None
        held.has_slot = False
        self._stats.sending -= 1
        self.ended += 1
        following = None
        if self.waiting:
            following = self.waiting.popleft()
            self._stats.waiting = len(self.waiting)
            self.take(following)
        if self.room >= self.wake_at or not self._stats.sending:
            self.freed.set()
        return following

    def take_waiting(self, route: object) -> list[Held]:
        """Take the jobs of ``route`` out of the line (their endpoint may not be sent to)."""
        taken = [held for held in self.waiting if held.route is route]
        if taken:
            self.waiting = deque(held for held in self.waiting if held.route is not route)
            self._stats.waiting = len(self.waiting)
            if self.room >= self.wake_at:
                self.freed.set()
        return taken

    def drop_waiting(self) -> list[Held]:
        """Empty the line (an abort): its jobs are never sent, their leases expire."""
        dropped = list(self.waiting)
        self.waiting.clear()
        self._stats.waiting = 0
        return dropped


class Dispatcher:
    """Own it with ``async with Dispatcher(queue, owner, url=...) as d: await d.run()``.

    ``queue`` is a SQLite file's path, a ``postgresql://`` URL, or a function that opens a
    ``lease.store.Store`` of the caller's. Exactly one of ``url``, ``destination`` and ``send``.
    ``url`` is a ``lease.http.Destination`` with the defaults (https to any host, plain http to
    loopback, the echo-id ACK, unsigned); ``destination`` a whole one (an ACK policy, a CA file,
    secrets). Both send with ``deliver`` (``send_http`` answering the delivered status, which
    the attempt records) and the claim token, over one session whose connections are kept
    alive, signed (with secrets) at this host's clock in seconds. ``send``
    is a coroutine function ``send(event, token)``. The event is the job as enqueued, {"id",
    "qty"} or {"id", "body"} with the body as its canonical JSON text. ``policy`` spaces the
    retries (``policy.judge``: a receiver's Retry-After is honoured up to its backoff cap);
    ``lease_ms`` defaults to the policy's lease (1 ms .. 1 h). ``send_timeout_ms`` bounds
    each send, any length from 1 ms up to the policy's time to live (its retry budget); a
    send longer than the lease keeps its lease by extension (fenced, at half of it) while
    it runs, and starts only when the lease left covers its timeout plus the margin kept
    for the finish, or the lease can still be extended (one capped by the job's deadline
    cannot). By default (None) each send is bounded by its lease: what the lease leaves
    when it starts, less that margin (an HTTP send's timeout; a ``send`` of the caller's
    is cut off then). A send that cannot start is an attempt judged a retry that says why,
    never sent. A job's budget (attempts, time to live) is the one it was enqueued with.

    Time: leases are judged by the store's clock (the database server's for
    PostgreSQL), unless ``clock`` (milliseconds) is given, which then judges
    every call. ``jitter`` returns a uniform draw in 0..1 for each retry delay
    (the policy makes its jitter of it). ``poll_interval`` (seconds) is how
    long an idle dispatcher waits before it looks for work again; a
    PostgreSQL store also wakes it when work is enqueued or redriven.
    ``concurrency`` bounds the sends in flight; ``batch_size`` bounds the jobs
    one claim handles, and a finish records what up to four claims sent
    (four times as many, at most 10,000); ``prefetch`` (by default twice the
    concurrency, at most twice ``batch_size``; 0: none) how many claimed jobs may
    wait for a send slot, so that a send that ends starts the next at once
    instead of waiting for a claim's commit. Their leases are kept as those
    of the sends in flight; a graceful stop sends them; a dispatcher that
    dies leaves them, like its sends, to their lease expiry. ``threads`` is
    the store calls at once (PostgreSQL; a SQLite file has one). ``create`` makes a missing
    queue (by default a missing queue is FileNotFoundError for a file,
    NotAQueue for a database). ``latencies``, when a list, receives each
    job's claim-to-finish time in seconds.

    Endpoints (instead of url, destination or send): ``endpoints="*"`` serves
    the deliveries of every endpoint of the queue, a list of names those of
    the named ones (``Store.claim_jobs(endpoints=...)``). Each delivery goes to
    its endpoint's ``Destination`` (URL, ACK policy, CA file, signed with its
    secrets, its static headers sent) over a connection pool of its own; the
    receiver sees the message's id, the token is the delivery's own lease's.
    The endpoints are read at the start (``async with``), every ``refresh_s``
    seconds, and at once when a claim hands back a delivery of one it does not
    know; one that is still unknown (removed since) has its delivery left
    leased, never sent (its lease expiry and budget recover it), counted in
    ``stats.unknown_endpoint`` and logged once. The sends in flight stay
    bounded by ``concurrency`` in all; how the slots are shared is the
    claim's (each endpoint's ``max_in_flight``, rate and fair share are
    judged in the store), so an endpoint capped at 8 holds at most 8 of them.
    The per-delivery metrics carry an ``endpoint`` label (one series per
    endpoint served); ``endpoint_label=False`` drops it (totals only, for a
    queue of very many endpoints). ``summary_s`` (10 s) is how often at most
    an endpoint's failed attempts in an outage are summed in one log line
    (on the injected clock when there is one).

    It runs once: after ``stop()`` (even one that came before ``run()``
    started), after ``run()`` returned or after a failure, ``run()`` does not
    dispatch again.
    """

    def __init__(
        self,
        queue_path: Target,
        owner: str,
        *,
        url: str | None = None,
        destination: Destination | None = None,
        send: Send | None = None,
        concurrency: int = 16,
        policy: RetryPolicy = DEFAULT_POLICY,
        lease_ms: int | None = None,
        send_timeout_ms: int | None = None,
        clock: Callable[[], int] | None = None,
        jitter: Callable[[], float] = random.random,
        poll_interval: float = 0.05,
        batch_size: int = 64,
        create: bool = False,
        latencies: list[float] | None = None,
        threads: int | None = None,
        prefetch: int | None = None,
        endpoints: str | tuple[str, ...] | list[str] | None = None,
        refresh_s: float = REFRESH_S,
        endpoint_label: bool = True,
        summary_s: float = SUMMARY_S,
    ) -> None:
        check_identifier("owner", owner)
        destination = _one_destination(url, destination, send, endpoints)
        served = check_served(endpoints)
        if type(refresh_s) not in (int, float) or not 0 < refresh_s <= 3600:
            raise ValueError(f"refresh_s must be in (0, 3600] seconds, got {refresh_s!r}")
        if type(summary_s) not in (int, float) or not 0 < summary_s <= 3600:
            raise ValueError(f"summary_s must be in (0, 3600] seconds, got {summary_s!r}")
        if type(endpoint_label) is not bool:
            raise ValueError(f"endpoint_label must be a bool, got {endpoint_label!r:.40}")
        if type(concurrency) is not int or not 1 <= concurrency <= 10_000:
            raise ValueError(f"concurrency must be an int in 1..10000, got {concurrency!r}")
        if not isinstance(policy, RetryPolicy):
            raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        if lease_ms is None:
            lease_ms = policy.lease_ms
        if type(lease_ms) is not int or not 1 <= lease_ms <= PRODUCT.max_lease_ms:
            raise ValueError(f"lease_ms must be an int in 1..{PRODUCT.max_lease_ms}, "
                             f"got {lease_ms!r}")
        send_timeout_ms = _send_timeout_ms(send_timeout_ms, policy)
        if type(batch_size) is not int or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH}, got {batch_size!r}")
        if prefetch is None:
            prefetch = min(MAX_PREFETCH, 2 * min(concurrency, batch_size))
        if type(prefetch) is not int or not 0 <= prefetch <= MAX_PREFETCH:
            raise ValueError(f"prefetch must be an int in 0..{MAX_PREFETCH}, got {prefetch!r}")
        if type(poll_interval) not in (int, float) or not 0 < poll_interval <= 60:
            raise ValueError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
        for name, fn in (("clock", clock), ("jitter", jitter), ("send", send)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable")
        self.owner = owner
        self.concurrency = concurrency
        self.policy = policy
        self.lease_ms = lease_ms
        self.send_timeout_ms = send_timeout_ms  # None: each send is bounded by its lease
        self.poll_interval = float(poll_interval)
        self.batch_size = batch_size
        # When a list is given, each job's claim-to-finish time (s) is appended.
        self.latencies = latencies
        # Time kept back at the end of a lease for the finish transaction.
        self.finish_margin_ms = finish_margin_ms(lease_ms)
        self.stats = DispatcherStats()
        # reads stats when scraped: one source of truth
        self.metrics = DispatcherMetrics(self, serving_endpoints=served is not None,
                                         by_endpoint=endpoint_label)
        self.destination = destination  # None with a send of the caller's, or endpoints
        # "*" or endpoint names: the deliveries of the queue's endpoints; None: its own jobs
        self.served = served
        self.refresh_s = float(refresh_s)
        self._send = send
        self._clock = clock
        self._jitter = jitter
        self._time = StoreTime(clock)
        self._queue = AsyncStore(queue_path, create=create, threads=threads, listen=True)
        self._session: WireClient | None = None
        self._tasks: dict[asyncio.Task, Held] = {}  # each job's task, and the job
        self._claim_at_least = max(1, min(batch_size, concurrency // 8))
        self.prefetch = prefetch
        self._slots = SendSlots(concurrency, self.stats, wake_at=self._claim_at_least,
                                prefetch=prefetch)
        self._keeper = LeaseKeeper(self._queue, self._time, lease_ms, self.finish_margin_ms,
                                   on_extended=self._count_extended, on_busy=self._count_busy,
                                   on_failure=self._keeper_failed)
        # A finish group waits for the claim in flight (asyncworker.finisher).
        self._claim_in_flight: asyncio.Future | None = None
        self._finisher = GroupFinisher(
            self._queue, self._time, batch_size, on_recorded=self._recorded,
            on_failed=self._finish_failed, on_committed=self._count_group,
            on_busy=self._count_busy, margin_ms=self.finish_margin_ms,
            claim_in_flight=lambda: self._claim_in_flight)
        self._stop = asyncio.Event()  # set once, never cleared: a stop is final
        self._aborted = False
        self._interrupted = False  # an abort came while run() was dispatching
        self._left_leased: list[dict] = []  # what an abort left leased: id, token, lease_until
        self._running = False
        self._failure: BaseException | None = None
        self._last_claim_ms: int | None = None
        # set once the first claim committed: the store answers and the work has begun
        self.first_claim = asyncio.Event()
        self._routes: EndpointRoutes | None = None
        self._to_release: list[Held] = []  # claimed, never to be sent: given back in a batch
        self._releaser: asyncio.Task | None = None
        # a read of the circuits asked for at once (a failure's finish recorded), one at a time
        self._confirming: asyncio.Task | None = None
        self._confirm_wanted = False
        # the tracer of the provider set now (asyncworker.tracing), read once a claim
        # that leased something: a provider set later is honoured from the next claim
        self._tracer: Any = None
        if served is not None:
            self._routes = EndpointRoutes(
                self._queue, served, pool_limit=concurrency,
                figures_of=self.metrics.figures_of, keep_trying=lambda: not self._stop.is_set(),
                on_busy=self._count_busy, refresh_s=self.refresh_s, owner=owner,
                summary_s=float(summary_s), summary_clock=self._summary_clock,
                on_held_back=self._hold_back)
            self.metrics.circuits = self.circuits

    def _summary_clock(self) -> float:
        """Seconds for the summaries of failed attempts: the injected clock's
        when there is one (a test's time runs as it says), else monotonic."""
        given = self._time.given()
        return time.monotonic() if given is None else given / 1000

    # --------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Dispatcher:
        await self._queue.open()
        try:
            await self._time.read(self._queue)
            if self._routes is not None:  # the endpoints it serves, before the first claim
                await self._routes.load()
                if self._routes.missing:
                    log.warning("no such endpoint (yet): %s", ", ".join(self._routes.missing),
                                extra={"owner": self.owner})
                await self._routes.watch()  # the circuits as found, a non-closed one said
        except BaseException:
            await self._queue.close()
            raise
        if self.destination is not None:
            self._session = WireClient(limit=self.concurrency)
        return self

    def _register(self, store: Store) -> None:
        """This dispatcher's host and pid on its owner's row (Store.register_worker)."""
        store.register_worker(self.owner, socket.gethostname() or "-", os.getpid(),
                              now_ms=self._time.given())

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
        await self._settle()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._routes is not None:
            await self._routes.close()
        await self._queue.close()

    @property
    def endpoints(self) -> list[str]:
        """The names of the endpoints it knows now (empty without ``endpoints=``)."""
        return [] if self._routes is None else self._routes.names

    def circuits(self) -> dict[str, Any]:
        """The circuits of the endpoints it serves as last read (every
        ``refresh_s``): ``as_of_ms`` (the store's time of the read, None
        before one), ``endpoints`` {name: its circuit (``Store.endpoints``'
        "circuit") with ``condition`` (``asyncworker.routes.CONDITIONS``),
        ``enabled`` and ``disabled_why``}."""
        routes = self._routes
        if routes is None:
            return {"as_of_ms": None, "endpoints": {}}
        return {"as_of_ms": routes.circuits_ms, "endpoints": dict(routes.circuits)}

    @property
    def queue(self) -> AsyncStore:
        """The store, off the event loop: enqueue, redrive, snapshot, ..."""
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
    def failure(self) -> BaseException | None:
        """What made run() fail, or None."""
        return self._failure

    @property
    def aborted(self) -> bool:
        """abort() came while run() was dispatching (a second signal, say): the
        run was interrupted, and ``left_leased`` names what it left."""
        return self._interrupted

    @property
    def left_leased(self) -> list[dict]:
        """The jobs an abort left leased, never finished, each as {"id", "token",
        "lease_until"} (its latest ticket's): they wait for their leases to run
        out, then any dispatcher claims them again."""
        return list(self._left_leased)

    def _leave_leased(self, tickets: list[dict]) -> None:
        self.stats.left_leased += len(tickets)
        self._left_leased += [{"id": t["id"], "token": t["token"],
                               "lease_until": t["lease_until"]} for t in tickets]

    @property
    def last_claim_ms(self) -> int | None:
        """The store's time of the last claim transaction that committed, or None."""
        return self._last_claim_ms

    def health(self) -> dict[str, Any]:
        """The answer to "is it dispatching?", JSON-serialisable, without asking
        the store. ``last_claim_ms`` is the store's time of the last claim
        transaction that committed; ``last_claim_age_s`` how long ago that was
        on the clock leases are judged by (None before the first claim). An
        idle dispatcher claims every poll interval; one whose slots are all
        busy claims only when a send ends, so an old claim alone is no fault."""
        failure = self._failure
        return {
            "state": self.state,
            "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
            "last_claim_ms": self._last_claim_ms,
            "last_claim_age_s": self._last_claim_age_s(),
            "sending": self.stats.sending,
            "in_flight": self.stats.in_flight,
        }

    async def check_health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, Any]:
        """``health()`` plus the store's answer to a cheap call (its clock) within
        ``timeout_s``: ``store`` {"reachable", "error", "seconds"}, and ``healthy``:
        running and the store reachable."""
        store = await self._probe_store(timeout_s)
        answer = self.health()  # after the probe: the state as of the answer
        answer["store"] = store
        answer["healthy"] = answer["state"] == "running" and store["reachable"]
        return answer

    async def _probe_store(self, timeout_s: float) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._queue.run(lambda store: store.now_ms()), timeout_s)
        except TimeoutError:
            return {"reachable": False, "error": f"no answer within {timeout_s:g} s",
                    "seconds": None}
        except Exception as exc:  # whatever the store raised, the answer is "unreachable"
            error = " ".join(f"{type(exc).__name__}: {exc}".split())
            return {"reachable": False, "error": error, "seconds": None}
        return {"reachable": True, "error": None,
                "seconds": round(time.perf_counter() - started, 6)}

    def _last_claim_age_s(self) -> float | None:
        if self._last_claim_ms is None:
            return None
        try:
            now = self._time.now()
        except (RuntimeError, ValueError):  # the clock not read yet, or a bad clock value
            return None
        return max(0, now - self._last_claim_ms) / 1000

    def stop(self) -> None:
        """Claim nothing more; the jobs claimed (in flight, or waiting for a slot)
        are sent and finished within their leases.
        Final: a stop that comes before run() starts makes run() return at once."""
        self._stop.set()

    def abort(self) -> None:
        """Stop at once: cancel the sends in flight, leaving leases that expire.
        A claim that commits after the abort sends nothing: its jobs are left
        leased too. Each job left so is in ``left_leased`` (and counted in
        ``stats.left_leased``); queued finishes are still written."""
        self._stop.set()
        self._aborted = True
        self._interrupted = self._interrupted or self._running
        dropped = self._slots.drop_waiting()
        for held in dropped:  # never sent: left leased, to expire
            self._keeper.unwatch(held)
            self.stats.in_flight -= 1
        self._leave_leased([held.ticket for held in dropped])
        for task in self._tasks:
            task.cancel()

    async def run(self, *, until_idle: bool = False) -> DispatcherStats:
        """Dispatch until stop() (or, with until_idle, until the queue is idle).

        Idle means nothing its claims may take now or later without an operator
        (``Store.is_idle_for`` what it serves: the queue's own jobs, or the
        deliveries of the enabled endpoints it serves): every job done or
        dead, or waiting behind a dead first job of its ordering key
        (``Store.blocked_heads`` names those keys); a disabled endpoint's
        deliveries wait for an operator; a paused queue's pending jobs are not
        idle, they wait for the resume (its claims lease nothing). Retry delays
        and the leases of a dispatcher that died are waited out, not skipped. Once only:
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
        await self._queue.call(  # the console's dispatchers at work
            self._register, on_busy=lambda _: self._count_busy())
        stop_wait = asyncio.ensure_future(self._stop.wait())
        keeper = asyncio.create_task(self._keeper.run(), name="lease keeper")
        keeper.add_done_callback(self._keeper_died)
        refresher = None if self._routes is None else asyncio.create_task(
            self._routes.run(), name="endpoints refresher")
        try:
            while not self._stop.is_set():
                if self._slots.room < self._claim_at_least and self._slots.used:
                    # Wait for a few slots, then claim them in one transaction: fewer,
                    # fuller claim transactions for the same sends in flight.
                    await self._wait(stop_wait, None)
                    continue
                if await self._claim_some():
                    continue
                if until_idle and not self._tasks:
                    await self._finisher.settle()  # the last outcomes written first
                    if await self._queue.is_idle_for(self.served):
                        break
                await self._wait(stop_wait, self.poll_interval, work=True)
            await self._all_sent()  # graceful: claimed jobs are sent, within their leases
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
            if refresher is not None:
                refresher.cancel()
            if self._routes is not None:
                self._routes.summarize(every=True)  # the failures counted and not yet said

    async def _wait(self, stop_wait: asyncio.Future, timeout: float | None, *,
                    work: bool = False) -> None:
        """Wait until a slot is free (a send ended), stop(), the timeout, or, when
        idle (``work``), a wake-up from the store: work was enqueued or redriven."""
        self._slots.freed.clear()
        waits = {asyncio.ensure_future(self._slots.freed.wait())}
        if work:
            self._queue.work_arrived.clear()
            waits.add(asyncio.ensure_future(self._queue.work_arrived.wait()))
        try:
            await asyncio.wait(waits | {stop_wait}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    def _keeper_died(self, keeper: asyncio.Task) -> None:
        """Without its lease keeper no send is cut off in time: the run fails at
        once (``state``), and run() raises the keeper's error once it has unwound.
        Not logged here: whoever awaits run() (or dispatcher_context) reports it once."""
        error = None if keeper.cancelled() else keeper.exception()
        if error is not None:
            self._keeper_failed(error)

    def _keeper_failed(self, error: BaseException) -> None:
        self._failure = self._failure or error
        self.abort()

    async def _settle(self) -> None:
        """Wait for the jobs to unwind and for every queued finish and release to be written."""
        await self._all_sent()
        await self._finisher.settle()
        if self._releaser is not None:
            await asyncio.wait({self._releaser})
        if self._confirming is not None:
            self._confirming.cancel()

    async def _all_sent(self) -> None:
        """Wait until no job's task is left: a send that ends may start a job
        from the line, so one wait on the tasks of the moment is not enough."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    # --------------------------------------------------------------- claims

    async def _claim_some(self) -> bool:
        """Claim as many jobs as there are free slots (up to batch_size), in one
        transaction; start a task for each. False when there was nothing to claim
        (or a stop came while the store was busy)."""
        limit = min(self._slots.room, self.batch_size)
        asked = self._time.asked()

        served = self.served

        def claim(store: Store) -> tuple[Claimed, float]:
            started = time.perf_counter()  # the transaction's own time, on its thread
            if served is None:  # the queue's own jobs: the call as it was before endpoints
                claimed = store.claim_jobs(self.owner, self.lease_ms, limit,
                                           now_ms=self._time.given())
            else:
                claimed = store.claim_jobs(self.owner, self.lease_ms, limit,
                                           now_ms=self._time.given(), endpoints=served)
            return claimed, time.perf_counter() - started

        self._claim_in_flight = in_flight = asyncio.get_running_loop().create_future()
        try:
            claimed, seconds = await self._queue.call(
                claim, keep_trying=lambda: not self._stop.is_set(),
                on_busy=lambda _: self._count_busy(), draw=self._draw)
        except Busy:
            return False  # stopping
        finally:
            self._claim_in_flight = None
            in_flight.set_result(None)  # a finish group waiting for it goes ahead
        if not self._time.injected:
            self._time.observe(claimed.now_ms, asked)
        routes = self._routes
        if routes is not None and any(routes.get(job.endpoint) is None
                                      for job in claimed.leased):
            await routes.refresh()  # an endpoint added since: read them again, at once
        self._slots.measure_line()
        # all of it given back (its endpoint's circuit opened): no claim at once again
        return self._claimed(claimed, seconds) > 0

    def _claimed(self, claimed: Claimed, seconds: float) -> int:
        """Count a committed claim (its quarantine moves too) and start its jobs."""
        stats = self.stats
        stats.claim_calls += 1
        self.metrics.observe_claim(seconds)
        self._last_claim_ms = claimed.now_ms
        self.first_claim.set()
        for reason, n in claimed.moved.items():
            stats.count_dead(reason, n)
            stats.quarantined += n
        moved = {reason: n for reason, n in claimed.moved.items() if n}
        if moved:  # no ids: the claim's quarantine counts its moves by reason
            log.warning("quarantined", extra={"owner": self.owner, "dead": sum(moved.values()),
                                              "reasons": moved})
        if not claimed.leased:
            return 0
        stats.claimed += len(claimed.leased)
        self._tracer = tracing.tracer()
        stats.claim_batches += 1
        if self._aborted:  # it committed while the abort came: nothing more is sent
            self._leave_leased([job.ticket for job in claimed.leased])
            log.warning("claimed during an abort, left leased to expire: %s",
                        _some_ids([job.ticket for job in claimed.leased]),
                        extra={"owner": self.owner, "jobs": len(claimed.leased),
                               "status": "leased"})
            return 0
        stats.in_flight += len(claimed.leased)
        first_ms = claimed.now_ms
        slots, watch, start = self._slots, self._keeper.watch, self._start
        routes = self._routes
        route: Route | None = None
        held_back = 0
        for job in claimed.leased:
            ticket = job.ticket
            if routes is not None:
                route = routes.get(job.endpoint)
                if route is None:
                    self._unknown_endpoint(job.endpoint, ticket)
                    continue
                route.figures.claimed += 1
            held = Held(ticket, job.event, first_ms, half_way(first_ms, ticket["lease_until"]),
                        job.digest, route, job.trace)
            held.can_extend = ticket["lease_until"] - first_ms >= self.lease_ms  # else capped
            if route is not None and not route.may_send(first_ms):
                self._release([held])  # its circuit opened since this claim began
                held_back += 1
                continue
            watch(held)  # its lease is kept from the claim, whether it sends or waits
            if slots.free:
                slots.take(held)
                start(held)
            else:
                slots.wait(held)
        return len(claimed.leased) - held_back

    def _unknown_endpoint(self, endpoint: str | None, ticket: dict) -> None:
        """A delivery of an endpoint it does not have, even after reading them
        again (removed since): never sent, left leased; its lease expiry and
        its attempt budget recover it. Logged once per endpoint."""
        self.stats.in_flight -= 1
        self.stats.unknown_endpoint += 1
        assert self._routes is not None
        if self._routes.tell_unknown(endpoint):
            log.warning("delivery of an unknown endpoint left leased (further ones of this "
                        "endpoint are counted, not logged)",
                        extra={"id": ticket["id"], "token": ticket["token"], "owner": self.owner,
                               "endpoint": endpoint, "status": "leased"})

    def _start(self, held: Held) -> None:
        """The job's task: its send, with the slot it holds."""
        held.task = task = asyncio.create_task(self._work(held))
        self._tasks[task] = held
        task.add_done_callback(self._job_done)

    def _give_back(self, held: Held) -> None:
        """The send is over: its slot goes to the first job waiting for one."""
        following = self._slots.give_back(held)
        if following is not None:
            self._start(following)

    def _job_done(self, task: asyncio.Task) -> None:
        # A done callback, so it runs even for a task cancelled before its first step.
        held = self._tasks.pop(task)
        self._keeper.unwatch(held)  # cancelled before its first step: never unwatched
        self._give_back(held)
        if not held.handed_over:  # no finish queued: the job ends here, left leased
            self.stats.in_flight -= 1
            if task.cancelled():  # an abort cut it off: its lease runs out
                self._leave_leased([held.ticket])
        if not self._tasks:  # the last one ended: the dispatch loop looks again (drained?)
            self._slots.freed.set()

    # --------------------------------------------------------------- one job

    async def _work(self, held: Held) -> None:
        """Send, judge, and hand the outcome to the finisher: the task ends there
        (the finisher owns the outcome from then on, and counts it). A delivery
        whose endpoint's circuit opened since its claim is given back instead,
        unsent (``_release``)."""
        route = held.route
        if route is not None and not route.may_send(self._time.now()):
            self._keeper.unwatch(held)
            self._give_back(held)
            self._release([held])
            return
        try:
            judged = await self._judged_send(held)
            if held.span is not None:
                tracing.end_attempt(held.span, judged.outcome, judged.seen.http_status,
                                    judged.seen.error)
                held.span = None
            if route is not None:
                self._judged(held, route, judged)
            await held.settled()  # an extension in flight first: its ticket is the store's
        except Exception as exc:
            self._abandon_span(held)
            self.stats.errors += 1
            if held.route is not None:
                held.route.figures.errors += 1
            log.exception("job failed", extra=self._facts(held, status="leased",
                                                          error=_error_line(exc)))
            self._confirm(held)  # no finish will confirm what it told its circuit
            return
        except BaseException:  # cancelled: no finish either
            self._abandon_span(held)
            self._confirm(held)
            raise
        held.handed_over = True
        self._finisher.add(held, judged)

    async def _judged_send(self, held: Held) -> Judged:
        """Send, and judge what came of it; the send's own duration is its latency.

        The lease keeper may cancel the send: at the end of its lease (a
        timeout, retried like any Retryable) or when an extension finds the
        lease gone (LeaseLost). Any other cancellation is a shutdown: it
        propagates. A job the keeper cut off while it waited for a slot is
        not sent at all, and judged the same way.
        """
        ticket = held.ticket
        error: BaseException | None = None
        if self._tracer is not None:
            self._start_span(self._tracer, held)
        started = time.perf_counter()
        try:
            window_ms, short = (0, None) if held.cut else self._keeper.window(
                held, self.send_timeout_ms)
            if held.cut is not None:
                error = self._cut_error(held, "the job waited for a send slot until its lease"
                                              " was nearly over; not sent")
            elif short is not None:
                error = Retryable(short)
            else:
                try:
                    sending = self._call_send(held, ticket["token"], window_ms)
                    if held.span is not None:
                        sending = tracing.within(held.span, sending)
                    classify_result(await sending)
                except asyncio.CancelledError:
                    if held.cut is None:
                        raise
                    _uncancel()
                    error = self._cut_error(held, "the send did not finish within its lease")
                except Exception as exc:
                    error = exc
        finally:
            took = time.perf_counter() - started
            self._keeper.unwatch(held)
            self._give_back(held)
        self.metrics.observe_send(took)  # a send that ended: not one a shutdown cancelled
        if held.route is not None:
            held.route.figures.send.observe(took)
        seen = Attempt.of(held.first_ms, round(took * 1000), error, held.http_status)
        self.stats.answers[status_class(seen.http_status)] += 1
        if error is None:
            return Judged("ok", 0, seen)
        return self._judge_error(held, error, seen)

    def _judged(self, held: Held, route: Route, judged: Judged) -> None:
        """What an attempt tells its endpoint's circuit, as this dispatcher
        knows it, before the finish is written: when it may not send from now
        on, the endpoint's deliveries waiting in line are given back."""
        signal = signal_of(judged.outcome, judged.seen)
        if signal is None:
            return
        assert self._routes is not None
        if self._routes.judged(route, signal, judged.seen, self._time.now(), held):
            self._hold_back(route)

    def _hold_back(self, route: Route) -> None:
        """``route``'s endpoint may not be sent to now: what waits in line for it
        is given back (the sends on the wire end as they do)."""
        taken = self._slots.take_waiting(route)
        for held in taken:
            self._keeper.unwatch(held)
        if taken:
            self._release(taken)

    def _release(self, helds: list[Held]) -> None:
        """Give these claimed, unsent deliveries back to the store, in batches
        of one store call each; from here this path owns them and counts them."""
        for held in helds:
            held.handed_over = True  # not the finisher's: counted when released
        self._to_release += helds
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_all(), name="releaser")

    async def _release_all(self) -> None:
        while self._to_release:
            group = self._to_release[:MAX_BATCH]
            del self._to_release[:MAX_BATCH]
            for held in group:
                await held.settled()  # an extension in flight first: its ticket is the store's
            await self._release_group(group)

    async def _release_group(self, group: list[Held]) -> None:
        """One release transaction; a delivery it could not give back (its
        lease gone, or the store failing) is left to its lease's end."""
        stats = self.stats
        stats.in_flight -= len(group)
        tickets = [held.ticket for held in group]

        def live() -> bool:
            return any(self._time.now() < ticket["lease_until"] for ticket in tickets)

        try:
            results = await self._queue.release_jobs(tickets, reason="circuit",
                                                     keep_trying=live,
                                                     on_busy=lambda _: self._count_busy())
        except Busy:
            results = [False] * len(group)
        except Exception as exc:
            self._leave_leased(tickets)
            log.warning("release failed, %d deliveries left leased: %s", len(group),
                        _some_ids(tickets), extra={"owner": self.owner, "jobs": len(group),
                                                   "status": "leased",
                                                   "error": _error_line(exc)})
            return
        released = sum(1 for result in results if result is True)
        stats.released += released
        stats.stale += len(group) - released

    def _confirm(self, held: Held) -> None:
        """``held``'s finish is written (or failed): a change of its endpoint's
        circuit it made at this dispatcher is checked against the store at once."""
        route, routes = held.route, self._routes
        if route is None or routes is None or not routes.confirmed(route, held):
            return
        self._confirm_wanted = True  # reads asked for while one runs: one more after it
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(self._read_circuits(routes),
                                                   name="circuits read")

    async def _read_circuits(self, routes: EndpointRoutes) -> None:
        while self._confirm_wanted:
            self._confirm_wanted = False
            await routes.watch()

    @staticmethod
    def _cut_error(held: Held, timeout: str) -> Exception:
        """What the lease keeper's cut means: the lease is gone, or it ran out."""
        ticket = held.ticket
        if held.cut == "lost":
            return LeaseLost(f"lease of {ticket['id']} token {ticket['token']} is gone")
        return Retryable(timeout)

    def _judge_error(self, held: Held, error: BaseException, seen: Attempt) -> Judged:
        """A failed send's outcome and delay by the policy. A lost lease is
        finished as a retry, which its fence refuses as stale: the attempt is
        recorded and counted like any late finish. A bad ACK or an
        unclassified error proves nothing: evidence only, the job stays leased."""
        ticket = held.ticket
        if isinstance(error, LeaseLost):
            log.warning("lease lost", extra=self._facts(held, seen))
            return Judged("retry", self.policy.delay_ms(ticket["attempt"], self._draw()), seen)
        verdict = self.policy.judge(error, ticket["attempt"], self._draw())
        if verdict is not None:
            return Judged(verdict[0], verdict[1], seen)
        figures = None if held.route is None else held.route.figures
        if isinstance(error, BadAck):
            self.stats.bad_acks += 1
            if figures is not None:
                figures.bad_acks += 1
            log.warning("bad ACK", extra=self._facts(held, seen, status="leased"))
        else:
            self.stats.errors += 1
            if figures is not None:
                figures.errors += 1
            log.error("send failed", extra=self._facts(held, seen, status="leased"))
        return Judged(None, 0, seen)

    async def _call_send(self, held: Held, token: int, window_ms: int) -> object:
        """The send, bounded by ``window_ms``: its own timeout, or what its lease leaves."""
        if self._send is not None:
            if self.send_timeout_ms is None:  # the lease keeper's cut is its bound
                return await self._send(held.event, token)
            return await _within(self._send(held.event, token), window_ms / 1000)
        route = held.route
        if route is not None:
            return await self._send_to_endpoint(held, route, token, window_ms)
        destination = self.destination
        assert destination is not None
        # A signature's time is this host's (or the injected clock's): the
        # receiver checks it against its own clock, not the store's.
        stamp = (self._time.given() or wall_clock_ms()) // 1000 if destination.secrets else None
        held.http_status = await deliver(
            destination, held.event, timeout=window_ms / 1000, token=token, session=self._session,
            timestamp=stamp, digest=held.digest,
            trace_headers=None if held.span is None else tracing.request_headers(held.span))
        return True  # delivered: its status is the attempt's evidence

    async def _send_to_endpoint(self, held: Held, route: Route, token: int,
                                window_ms: int) -> object:
        """A delivery, to its endpoint's destination (its newest configuration:
        URL, ACK policy, secrets, static headers) over the endpoint's own pool."""
        destination = route.destination
        stamp = (self._time.given() or wall_clock_ms()) // 1000 if destination.secrets else None
        assert self._routes is not None
        self._routes.sending(route)
        try:
            held.http_status = await deliver(
                destination, held.event, timeout=window_ms / 1000, token=token,
                session=route.client, timestamp=stamp, digest=held.digest,
                trace_headers=None if held.span is None else tracing.request_headers(held.span))
        finally:
            self._routes.sent(route)
        return True

    def _draw(self) -> float:
        return check_jitter(self._jitter())

    def _start_span(self, tracer: Any, held: Held) -> None:
        """This attempt's span (tracing is on), linked to the intake's context."""
        route = held.route
        destination = self.destination if route is None else route.destination
        server = None if destination is None else (destination.route.host,
                                                   destination.route.port)
        held.span = tracing.start_attempt(tracer, held.ticket, held.event["id"], held.trace,
                                          None if route is None else route.name, server,
                                          self.owner)

    @staticmethod
    def _abandon_span(held: Held) -> None:
        if held.span is not None:
            tracing.abandon_attempt(held.span)
            held.span = None

    # --------------------------------------------------------------- counting

    def _count_busy(self) -> None:
        self.stats.lock_retries += 1

    def _count_group(self, seconds: float) -> None:
        self.stats.finish_batches += 1
        self.metrics.observe_finish(seconds)

    def _count_extended(self) -> None:
        self.stats.extended += 1

    def _recorded(self, held: Held, judged: Judged, recorded: Recorded) -> None:
        stats = self.stats
        stats.in_flight -= 1
        self._confirm(held)
        if judged.outcome is None:  # evidence only: counted as the bad ACK or error it is
            return
        route = held.route
        if route is not None:
            _count_endpoint(route.figures, recorded)
        status, reason = recorded
        if route is not None and status is not False and recorded != BUSY:
            # what the attempt told its endpoint's breaker, as this dispatcher saw it
            signal = signal_of(judged.outcome, judged.seen)
            if signal == "failure":
                assert self._routes is not None
                if self._routes.failed(route, judged.seen, held.ticket["id"]) \
                        and status == "pending":
                    stats.retried += 1  # counted in its endpoint's summary, not logged alone
                    if self.latencies is not None:
                        self.latencies.append(time.perf_counter() - held.claimed_at)
                    return
            elif signal == "success":
                EndpointRoutes.answered(route)
        if status == "done":
            stats.ok += 1
            if log.isEnabledFor(logging.DEBUG):  # never built per job at info
                log.debug("done", extra=self._facts(held, judged.seen, status="done",
                                                    latency_ms=judged.seen.latency_ms))
        elif recorded == BUSY:  # no fence judged it: left leased, its lease runs out
            stats.unrecorded_busy += 1
            log.warning("outcome not recorded: the store was busy", extra=self._facts(
                held, judged.seen, outcome=judged.outcome, status="leased", reason="busy"))
            return
        elif status is False:
            stats.stale += 1
            log.warning("stale finish refused", extra=self._facts(
                held, judged.seen, outcome=judged.outcome, status="stale"))
        elif status == "pending":
            stats.retried += 1
            log.info("retry", extra=self._facts(held, judged.seen, outcome=judged.outcome,
                                                status="pending", delay_ms=judged.delay_ms))
        else:
            assert reason is not None
            stats.count_dead(reason)
            log.warning("dead", extra=self._facts(held, judged.seen, outcome=judged.outcome,
                                                  status="dead", reason=reason))
        if self.latencies is not None:
            self.latencies.append(time.perf_counter() - held.claimed_at)

    def _finish_failed(self, helds: list[Held], judged: list[Judged]) -> None:
        """Counted and logged here, once: the jobs' own tasks only wait. An
        evidence-only item was counted already, as the bad ACK or error it is.
        Called while the group's exception is being handled: it is the record's."""
        self.stats.in_flight -= len(helds)
        self.stats.errors += sum(1 for one in judged if one.outcome is not None)
        for held in helds:
            self._confirm(held)
        for held, one in zip(helds, judged, strict=True):
            if held.route is not None and one.outcome is not None:
                held.route.figures.errors += 1
        log.exception("finish failed, %d jobs left leased: %s", len(helds),
                      _some_ids([held.ticket for held in helds]),
                      extra={"owner": self.owner, "jobs": len(helds), "status": "leased",
                             "error": _error_line(sys.exc_info()[1])})

    def _facts(self, held: Held, seen: Attempt | None = None,
               **more: object) -> dict[str, object]:
        """A job's facts for a log record's ``extra=``: what an operator needs to
        find the attempt (id, token, owner, attempt) and what it saw. Never its body."""
        ticket = held.ticket
        facts: dict[str, object] = {"id": ticket["id"], "token": ticket["token"],
                                    "owner": self.owner, "attempt": ticket["attempt"]}
        if held.route is not None:
            facts["endpoint"] = held.route.name
        if seen is not None:
            if seen.http_status is not None:
                facts["http_status"] = seen.http_status
            if seen.error is not None:
                facts["error"] = seen.error
        facts.update(more)
        return facts


def _count_endpoint(figures: EndpointFigures, recorded: Recorded) -> None:
    """A recorded outcome in its endpoint's figures, as ``_recorded`` counts the totals."""
    status, reason = recorded
    if status == "done":
        figures.ok += 1
    elif recorded == BUSY:
        figures.unrecorded_busy += 1
    elif status is False:
        figures.stale += 1
    elif status == "pending":
        figures.retried += 1
    elif reason is not None:
        figures.count_dead(reason)


def _one_destination(url: str | None, destination: object, send: object,
                     endpoints: object = None) -> Destination | None:
    """The destination of exactly one of url, destination, send and endpoints
    (None: send, or each delivery's endpoint's)."""
    if sum(given is not None for given in (url, destination, send, endpoints)) != 1:
        raise ValueError("give exactly one of url, destination, send and endpoints")
    if url is not None:
        return Destination(url)  # every check of a destination, the type of url included
    if destination is not None and not isinstance(destination, Destination):
        raise ValueError(f"destination must be a lease.http.Destination, "
                         f"got {type(destination).__name__}")
    return destination


def _send_timeout_ms(value: object, policy: RetryPolicy) -> int | None:
    """The send timeout, checked: None (each send bounded by its lease), or
    1 ms .. the policy's time to live (no longer than the retry budget)."""
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= policy.ttl_ms:
        raise ValueError(f"send_timeout_ms must be an int in 1..{policy.ttl_ms} (the retry "
                         f"budget: the policy's time to live), got {value!r}")
    return value


async def _within(sending: Awaitable[object], seconds: float) -> object:
    """A send of the caller's, bounded as the HTTP senders bound theirs."""
    try:
        async with asyncio.timeout(seconds):
            return await sending
    except TimeoutError:
        raise Retryable(f"timed out after {seconds}s") from None


def _error_line(error: BaseException | None) -> str | None:
    """An exception as one line: its class and message, as evidence keeps it."""
    if error is None:
        return None
    return " ".join((Attempt.of(0, 0, error).error or "").split())


def _some_ids(tickets: list[dict], most: int = 20) -> str:
    """id/token of the first few jobs, for a log line that stays one line."""
    named = " ".join(f"{ticket['id']}/{ticket['token']}" for ticket in tickets[:most])
    return named if len(tickets) <= most else f"{named} and {len(tickets) - most} more"


def _uncancel() -> None:
    """We cancelled this send ourselves and handled it: withdraw that request
    (Python 3.11+), so structured timeouts around the job still work."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def run_once(
    queue: AsyncStore,
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict], Awaitable[object]],
    jitter: float,
    lease_ms: int = 1000,
) -> dict | None:
    """The async twin of ``lease.run_once`` (the contract's cycle on an event
    loop): the same steps (``lab_event``, ``lab_verdict``, ``cycle_result``).
    Its product sibling on any store is ``lease.stores.run_store_once``.

    ``queue`` is an open AsyncStore on a SQLite file (the contract's own
    functions run there); ``send`` is a coroutine function.
    """
    check_run_args(owner, clock, send, jitter, lease_ms)
    first_ms = check_now(clock(), "clock value")
    ticket = await queue.call_contract(claim, owner, first_ms, lease_ms)
    if ticket is None:
        return None
    try:
        verdict = classify_result(await send(lab_event(ticket)))
    except BaseException as error:
        verdict = lab_verdict(error, ticket["attempt"], jitter)
    second_ms = check_second_clock(first_ms, clock())
    outcome, delay_ms = verdict
    status = await queue.call_contract(finish, ticket, outcome, second_ms, delay_ms)
    return cycle_result(ticket, status)


async def run_until_signalled(dispatcher: Dispatcher, *, until_idle: bool = False,
                              on_stop: Callable[[str], None] | None = None,
                              on_ready: Callable[[], None] | None = None) -> DispatcherStats:
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
