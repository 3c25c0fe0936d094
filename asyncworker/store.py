"""One thread owns the queue's sqlite3 connection; coroutines hand it whole calls.

Each call is a complete function of ``lease`` (``claim``, ``finish``, ...),
so a transaction never spans an ``await``: the event loop never waits inside
a transaction, and no two coroutines interleave statements on the one
connection. The queue's SQL lives in ``lease`` alone: this thread runs
``lease``'s functions and nothing else.

The queue is opened as a product queue (``lease.sqlite.open_store``): a file
written by the contract alone is migrated forward, in one transaction, to
the schema with payloads and the evidence of every attempt. That is
intended: the contract's functions still work on a migrated file, but a
file once opened here is never at the contract's version again.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar, Union

from lease import observe
from lease.policy import DEFAULT_POLICY, RetryPolicy
from lease.sqlite import enqueue_events, open_store
from lease.worker import Conflict, enqueue, enqueue_many, redrive

T = TypeVar("T")

BUSY_TIMEOUT_MS = 5
LOCK_PATIENCE = 5.0  # seconds call() keeps retrying a locked database


def is_locked(error: BaseException) -> bool:
    """A competing process holds the write lock: transient, worth a retry."""
    return isinstance(error, sqlite3.OperationalError) and (
        "locked" in str(error) or "busy" in str(error)
    )


class QueueThread:
    """``async with QueueThread(path) as queue: await queue.call(claim, owner, now)``."""

    def __init__(self, path: Union[str, os.PathLike], *, create: bool = False) -> None:
        self._path = path
        self._create = create
        self._executor: Optional[ThreadPoolExecutor] = None
        self._con: Optional[sqlite3.Connection] = None

    async def open(self) -> QueueThread:
        # The connection is made on the thread that will use it, and only there.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue")
        try:
            # Migrating a contract file takes the write lock once: wait out a
            # short lock as every call does.
            self._con = await self._patiently(open_store, self._path, create=self._create)
            await self.try_call(_short_busy_wait)
        except BaseException:
            if self._con is not None:
                self._executor.submit(self._con.close).result()
                self._con = None
            self._executor.shutdown(wait=True)
            self._executor = None
            raise
        return self

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        con, self._con = self._con, None
        if con is not None:
            await asyncio.wrap_future(executor.submit(con.close))
        executor.shutdown(wait=True)

    async def __aenter__(self) -> QueueThread:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            raise RuntimeError("the queue is not open")
        return await asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))

    async def try_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(con, *args, **kwargs)`` once on the connection's thread and await
        it; a locked database raises (the caller decides how to retry)."""
        return await self._run(self._with_con, fn, *args, **kwargs)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """try_call, retried with a short jittered pause while another process
        holds the write lock, for up to LOCK_PATIENCE seconds."""
        return await self._patiently(self._with_con, fn, *args, **kwargs)

    async def _patiently(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        give_up = time.monotonic() + LOCK_PATIENCE
        while True:
            try:
                return await self._run(fn, *args, **kwargs)
            except sqlite3.OperationalError as exc:
                if not is_locked(exc) or time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(0.001 + 0.009 * random.random())

    def _with_con(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        assert self._con is not None
        return fn(self._con, *args, **kwargs)

    # The operations an embedding service needs, each one thread hop.

    async def enqueue(self, event: dict, now_ms: int, ttl_ms: int,
                      max_attempts: int = 3) -> bool:
        return await self.call(enqueue, event, now_ms, ttl_ms, max_attempts)

    async def enqueue_many(self, events: list, now_ms: int, ttl_ms: int,
                           max_attempts: int = 3) -> list[Union[bool, Conflict]]:
        """All in one transaction (``lease.enqueue_many``): per event True (new),
        False (duplicate) or the Conflict that refused it."""
        return await self.call(enqueue_many, list(events), now_ms, ttl_ms, max_attempts)

    async def enqueue_events(self, events: list, now_ms: int,
                             policy: RetryPolicy = DEFAULT_POLICY, *,
                             not_before_ms: Optional[int] = None) -> list[Union[bool, Conflict]]:
        """The product's intake (``lease.sqlite.enqueue_events``): {"id", "qty"}
        or {"id", "body"} events with the policy's budget, all in one
        transaction; per event True (new), False (duplicate) or its Conflict."""
        return await self.call(enqueue_events, list(events), now_ms, policy,
                               not_before_ms=not_before_ms)

    async def redrive(self, job_id: str, now_ms: int, ttl_ms: int, note: str) -> bool:
        return await self.call(redrive, job_id, now_ms, ttl_ms, note)

    async def snapshot(self, now_ms: int) -> dict:
        return await self.call(observe.snapshot, now_ms)

    async def is_drained(self) -> bool:
        return await self.call(observe.is_drained)


def _short_busy_wait(con: sqlite3.Connection) -> None:
    # SQLite's own busy handler sleeps in growing steps (1, 2, 5, 10 ... 100 ms):
    # a process that waits on it keeps missing the short gaps between another
    # process's transactions and starves. A 5 ms busy wait, then our own short
    # jittered retry, keeps both in the race (see the fairness test).
    con.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
