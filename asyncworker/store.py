"""The store off the event loop: coroutines hand whole store calls to threads.

``AsyncStore`` opens a ``lease.store.Store`` (a SQLite file or a
``postgresql://`` URL) and runs each call on a thread of its own, so a
transaction never spans an ``await``: the event loop never waits inside a
transaction, and no two coroutines interleave statements on one
connection. A SQLite file has one thread, which owns its one connection
(SQLite has one writer at a time anyway); a PostgreSQL store has as many
threads as its pool has connections, so claims, extensions and finishes of
different jobs commit side by side. The store's SQL lives in the store alone.

``Busy`` (a SQLite write lock held by another process, a PostgreSQL
serialization failure or lost connection) is retried here, by the pause and
patience of ``lease.retrying.BusyRetry``; each caller only says how long the
answer is still worth having (``keep_trying``). With PostgreSQL a listener
thread turns the store's NOTIFY into ``work_arrived``, so an idle dispatcher
wakes when work is enqueued or redriven instead of at its next poll.

A SQLite file is opened as a product queue (``lease.sqlite.SQLiteStore``): a
file written by the contract alone is migrated forward, in one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, Union

from lease import worker
from lease.endpoints import Endpoint
from lease.policy import DEFAULT_POLICY, RetryPolicy
from lease.retrying import PATIENT, BusyRetry
from lease.sqlite.errors import store_errors
from lease.store import Store
from lease.stores import is_postgres_url, open_store
from lease.worker import Busy, Conflict

__all__ = ["AsyncStore", "QueueThread", "POSTGRES_THREADS"]

T = TypeVar("T")
# a SQLite file's path, a postgresql:// URL, or a function that opens a Store
Target = Union[str, "os.PathLike[str]", Callable[[], Store]]

BUSY_TIMEOUT_MS = 5
POSTGRES_THREADS = 4  # connections (and threads) of a dispatcher's PostgreSQL pool
LISTEN_TICK_S = 0.5  # how often the listener thread looks whether it should stop


class AsyncStore:
    """``async with AsyncStore(target) as queue: await queue.run(lambda s: s.counts())``."""

    def __init__(self, target: Target, *, create: bool = False,
                 threads: int | None = None, clock: Callable[[], int] | None = None,
                 listen: bool = False) -> None:
        """``target``: a SQLite file's path, a ``postgresql://`` URL, or a function
        that opens a Store of the caller's (called on a store thread; ``threads``
        then defaults to 1). ``listen``: wake ``work_arrived`` on the store's
        NOTIFY (PostgreSQL)."""
        if not isinstance(target, (str, os.PathLike)) and not callable(target):
            raise ValueError(f"queue must be a path, a postgresql:// URL or a function "
                             f"opening a store, got {type(target).__name__}")
        self._target = target
        self._create = create
        self._clock = clock
        self._listen = listen
        postgres = is_postgres_url(target)
        if threads is None:
            threads = POSTGRES_THREADS if postgres else 1
        if type(threads) is not int or not 1 <= threads <= 64 or (threads > 1 and not postgres):
            raise ValueError(f"threads must be an int in 1..64 (1 for a SQLite file), "
                             f"got {threads!r}")
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._store: Store | None = None
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        self.work_arrived = asyncio.Event()  # set by a NOTIFY; the waiter clears it

    @property
    def store(self) -> Store:
        if self._store is None:
            raise RuntimeError("the queue is not open")
        return self._store

    @property
    def kind(self) -> str:
        return self.store.kind

    async def open(self) -> AsyncStore:
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="queue")
        try:
            # A SQLite connection is made on the thread that will use it (there is
            # one); opening takes the write lock once to migrate: wait out a short
            # lock as every call does.
            self._store = await self._patiently(self._open_store)
            if self._store.kind == "sqlite":
                await self.run(_short_busy_wait)
            if self._listen and hasattr(self._store, "listener"):
                self._start_listener()
        except BaseException:
            await self.close()
            raise
        return self

    def _open_store(self) -> Store:
        target = self._target
        if isinstance(target, (str, os.PathLike)):
            return open_store(target, create=self._create, clock=self._clock,
                              threads=self.threads)
        store = target()
        if not isinstance(store, Store):
            raise ValueError(f"the store function returned {type(store).__name__}, not a Store")
        return store

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        self._closing.set()
        if self._listener is not None:
            await asyncio.to_thread(self._listener.join)
            self._listener = None
        store, self._store = self._store, None
        if store is not None:
            await asyncio.wrap_future(executor.submit(store.close))
        executor.shutdown(wait=True)

    async def __aenter__(self) -> AsyncStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ calls

    async def run(self, fn: Callable[[Store], T]) -> T:
        """``fn(store)`` once on a store thread; Busy is raised to the caller."""
        return await self._on_thread(fn, self.store)

    async def call(self, fn: Callable[[Store], T], *,
                   keep_trying: Callable[[], bool] | None = None,
                   on_busy: Callable[[Busy], None] | None = None,
                   retry: BusyRetry = PATIENT,
                   draw: Callable[[], float] = random.random) -> T:
        """``fn(store)``, retried after a short jittered pause while the store is
        Busy: for ``retry.patience_s``, or as long as ``keep_trying()`` says."""
        return await retry.call_async(lambda: self.run(fn), on_busy=on_busy,
                                      keep_trying=keep_trying, draw=draw)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a store thread, its answer handed straight to an
        asyncio future: one hop back to the loop per call, without the chained
        futures (and their locks and callbacks) of ``asyncio.wrap_future``.
        Cancelled before the thread starts it, it never runs, as with wrap_future."""
        if self._executor is None:
            raise RuntimeError("the queue is not open")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        work = self._executor.submit(_call_and_answer, loop, answer, fn, args)
        try:
            return await answer
        except asyncio.CancelledError:
            work.cancel()
            raise

    async def _patiently(self, fn: Callable[[], T]) -> T:
        return await PATIENT.call_async(lambda: self._on_thread(fn))

    # ------------------------------------------------------------ wake-ups

    def _start_listener(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self.store.listener()  # type: ignore[attr-defined]

        def listen() -> None:
            try:
                while not self._closing.is_set():
                    if listener.wait(LISTEN_TICK_S):
                        loop.call_soon_threadsafe(self.work_arrived.set)
            finally:
                listener.close()

        self._listener = threading.Thread(target=listen, name="queue listener", daemon=True)
        self._listener.start()

    # ------------------------------------------------------------ an embedding service's calls

    async def enqueue_events(self, events: list, now_ms: int | None = None,
                             policy: RetryPolicy = DEFAULT_POLICY, *,
                             not_before_ms: int | None = None) -> list[bool | Conflict]:
        """The product's intake: {"id", "qty"} or {"id", "body"} events (an
        optional "key", "type" and "priority" each) with the policy's budget,
        all in one transaction; per event True (new), False (duplicate) or its
        Conflict. ``now_ms`` None: the store's clock.
        The store's call runs in a copy of the caller's context: an intake
        awaited inside a span keeps that span's trace context (lease.tracing)."""
        events = list(events)
        context = contextvars.copy_context()
        return await self.call(lambda s: context.run(
            s.enqueue_events, events, policy, now_ms=now_ms, not_before_ms=not_before_ms))

    async def enqueue_many(self, events: list, now_ms: int | None, ttl_ms: int,
                           max_attempts: int = 3) -> list[bool | Conflict]:
        """Lab events {"id", "qty"} with an explicit budget, all in one transaction:
        per event True (new), False (duplicate) or the Conflict that refused it."""
        events = list(events)
        for event in events:
            worker.check_event(event)  # the lab's events, by the lab's rule
        policy = RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl_ms)
        return await self.enqueue_events(events, now_ms, policy)

    async def enqueue(self, event: dict, now_ms: int | None, ttl_ms: int,
                      max_attempts: int = 3) -> bool:
        [result] = await self.enqueue_many([event], now_ms, ttl_ms, max_attempts)
        if isinstance(result, Conflict):
            raise result
        return result

    async def redrive(self, job_id: str, ttl_ms: int, note: str, *,
                      now_ms: int | None = None) -> bool:
        """Redrive one dead job (audit row and release together); ValueError if
        it is missing or not dead."""
        [result] = await self.call(lambda s: s.redrive_jobs([job_id], ttl_ms, note,
                                                            now_ms=now_ms))
        if isinstance(result, ValueError):
            raise result
        return True

    async def release_jobs(self, tickets: list, *, reason: str, now_ms: int | None = None,
                           keep_trying: Callable[[], bool] | None = None,
                           on_busy: Callable[[Busy], None] | None = None) -> list:
        """Claimed jobs given back unsent (``Store.release_jobs``), in one
        transaction: per ticket True (released) or False (stale)."""
        tickets = list(tickets)
        return await self.call(lambda s: s.release_jobs(tickets, reason=reason, now_ms=now_ms),
                               keep_trying=keep_trying, on_busy=on_busy)

    async def snapshot(self, now_ms: int | None = None) -> dict:
        return await self.call(lambda s: s.snapshot(now_ms))

    async def is_drained(self) -> bool:
        return await self.call(lambda s: s.is_drained())

    async def is_idle(self) -> bool:
        return await self.call(lambda s: s.is_idle())

    async def is_idle_for(self, endpoints: str | tuple[str, ...] | None) -> bool:
        """Idle as far as a claim with these ``endpoints`` can tell (``Store.is_idle_for``).
        A store of before endpoints has only its own jobs: its ``is_idle`` is theirs."""

        def idle(store: Store) -> bool:
            if endpoints is None and not hasattr(store, "is_idle_for"):
                return store.is_idle()
            return store.is_idle_for(endpoints)

        return await self.call(idle)

    async def endpoint_configs(self, names: tuple[str, ...] | None = None, *,
                               keep_trying: Callable[[], bool] | None = None,
                               on_busy: Callable[[Busy], None] | None = None) -> list[Endpoint]:
        """The queue's endpoints (all, or the ones named that exist), secrets
        and static headers included: for a dispatcher that sends to them."""
        return await self.call(lambda s: s.endpoint_configs(names), keep_trying=keep_trying,
                               on_busy=on_busy)

    # ------------------------------------------------------------ the contract's functions

    async def call_contract(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A ``lease.worker`` function of a SQLite connection (``claim``,
        ``finish``, ...), run on the file's thread, riding out a held write lock."""
        store = self.store
        if store.kind != "sqlite":
            raise TypeError("the contract's functions run on a SQLite queue file only")
        connection = store.connection  # type: ignore[attr-defined]
        return await self.call(lambda _: _translate_locked(fn, connection, *args, **kwargs))


def _call_and_answer(loop: asyncio.AbstractEventLoop, answer: asyncio.Future,
                     fn: Callable[..., Any], args: tuple) -> None:
    """On a store thread: the call, and its result or exception to the loop."""
    try:
        result = fn(*args)
    except BaseException as exc:  # the caller's to handle, as a thread future would give it
        _to_loop(loop, _set_exception, answer, exc)
    else:
        _to_loop(loop, _set_result, answer, result)


def _to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)


def _set_result(answer: asyncio.Future, result: object) -> None:
    if not answer.done():  # cancelled while the call ran
        answer.set_result(result)


def _set_exception(answer: asyncio.Future, exc: BaseException) -> None:
    if not answer.done():
        answer.set_exception(exc)


QueueThread = AsyncStore  # the name of the SQLite-only runtime before the store interface


def _translate_locked(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """The contract raises sqlite3's own error for a held lock: in the store's words."""
    with store_errors():
        return fn(*args, **kwargs)


def _short_busy_wait(store: Store) -> None:
    # SQLite's own busy handler sleeps in growing steps (1, 2, 5, 10 ... 100 ms):
    # a process that waits on it keeps missing the short gaps between another
    # process's transactions and starves. A 5 ms busy wait, then our own short
    # jittered retry, keeps both in the race (see the fairness test).
    store.connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")  # type: ignore[attr-defined]
