"""The runtime over the store interface: any Store, its clock, its calls side by side.

The dispatcher speaks only to ``lease.store.Store`` (through ``AsyncStore``);
these tests give it stores of their own that hold a call at a chosen moment,
so the interleavings that a pool of connections allows happen for certain.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from asyncworker import AsyncStore, Dispatcher
from lease.policy import RetryPolicy
from lease.sqlite import SQLiteStore
from tests.support.dispatching import FakeClock
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=5, ttl_ms=600_000)


class HeldExtension(SQLiteStore):
    """A store whose extension starts, then waits until the test lets it commit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extension_started = threading.Event()
        self.let_extension_commit = threading.Event()

    def extend_lease(self, ticket, lease_ms, **kwargs):
        self.extension_started.set()
        assert self.let_extension_commit.wait(10), "the test never let the extension commit"
        return super().extend_lease(ticket, lease_ms, **kwargs)


async def test_a_finish_waits_for_the_extension_in_flight_and_uses_its_ticket(tmp_path: Path):
    """A send that ends while its lease is being extended: the finish must use
    the extended ticket. Queued with the ticket it had, it would be refused as
    stale by its own extension, and a delivered job would be retried."""
    path = tmp_path / "queue.db"
    clock = FakeClock(T0)
    stores: list[HeldExtension] = []

    def open_held() -> HeldExtension:
        stores.append(HeldExtension(path, create=True))
        return stores[0]

    async def send(event: dict, token: int) -> bool:
        clock.now = T0 + 6_000  # past half of the 10 s lease: the keeper extends now
        await asyncio.to_thread(stores[0].extension_started.wait, 10)
        stores[0].let_extension_commit.set()  # the send is over; the extension commits
        return True

    async with Dispatcher(open_held, "d1", send=send, clock=clock, lease_ms=10_000) as d:
        await d.queue.enqueue_events([{"id": "a", "qty": 1}], T0, POLICY)
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert (stats.extended, stats.ok, stats.stale) == (1, 1, 0)
    with SQLiteStore(path) as store:
        assert store.counts()["done"] == 1 and store.stale_finishes() == 0


async def test_a_store_function_must_open_a_store(tmp_path: Path):
    with pytest.raises(ValueError, match="not a Store"):
        async with AsyncStore(lambda: object()):
            pass
    with pytest.raises(ValueError, match="a path, a postgresql:// URL or a function"):
        AsyncStore(42)  # type: ignore[arg-type]


async def test_a_sqlite_file_has_one_thread(tmp_path: Path):
    with pytest.raises(ValueError, match="1 for a SQLite file"):
        AsyncStore(tmp_path / "queue.db", threads=2)
