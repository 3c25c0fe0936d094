"""The leases of the jobs in flight: the store's time, and the keeper that
extends a lease at half of it and cuts a send off before it ends.

One task (``LeaseKeeper.run``) watches every send in flight, instead of a
timer per job: the per-job cost stays low. An extension runs as its own task
and the job's finish waits for it (``Held.settled``): the ticket a finish
uses is always the newest one the store has, whether the store runs one
call at a time (SQLite) or many side by side (PostgreSQL).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncworker.store import AsyncStore
from lease.worker import Busy, check_now

__all__ = ["Held", "LeaseKeeper", "StoreTime", "finish_margin_ms"]

log = logging.getLogger("asyncworker.leases")


class StoreTime:
    """The clock leases are judged by, as this process can tell it.

    With an injected ``clock`` (tests, or a caller that wants its own) every
    store call is given that clock's value. Without one, the store judges by
    its own clock (the database server's for PostgreSQL) and this process
    follows it between calls: the store's time at the last reading plus the
    monotonic time elapsed since the reading was *asked for*. That estimate
    runs ahead of the store, never behind it, so a send is cut off early
    rather than late, whatever this host's wall clock says.
    """

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        self._clock = clock
        self._offset_ms: float | None = None

    @property
    def injected(self) -> bool:
        return self._clock is not None

    def given(self) -> int | None:
        """The value to hand a store call: the injected clock's, or None (the store's)."""
        if self._clock is None:
            return None
        return check_now(self._clock(), "clock value")

    def asked(self) -> float:
        """Call before a store call whose time will be ``observe``d."""
        return time.monotonic()

    def observe(self, store_ms: int, asked_at: float) -> None:
        self._offset_ms = store_ms - asked_at * 1000

    def now(self) -> int:
        """The store's time now (the injected clock's value, or the estimate)."""
        if self._clock is not None:
            return check_now(self._clock(), "clock value")
        if self._offset_ms is None:
            raise RuntimeError("the store's clock has not been read yet")
        return int(time.monotonic() * 1000 + self._offset_ms)

    async def read(self, queue: AsyncStore) -> None:
        """Read the store's clock once (before the first claim)."""
        if self._clock is None:
            asked = self.asked()
            self.observe(await queue.call(lambda s: s.now_ms()), asked)


class Held:
    """A job in flight. ``ticket`` is replaced only by its extension, on the
    event loop, and a finish waits for that extension first (``settled``).
    Identity: a job in flight is itself, whatever its ticket says. Slots: one
    is made per job, so it stays small."""

    __slots__ = ("ticket", "event", "digest", "first_ms", "extend_at", "claimed_at", "task",
                 "cut", "can_extend", "extension", "handed_over", "has_slot", "http_status",
                 "route", "trace", "span")

    def __init__(self, ticket: dict, event: dict, first_ms: int, extend_at: int,
                 digest: str | None = None, route: Any = None,
                 trace: str | None = None) -> None:
        self.ticket = ticket
        self.event = event  # what is sent: {"id", "qty"} or {"id", "body"}
        self.digest = digest  # a body's sha256 from its intake: its text's check
        self.first_ms = first_ms  # the store's time of the claim
        self.extend_at = extend_at  # the store's time at half of the current lease
        self.claimed_at = time.perf_counter()
        self.task: asyncio.Task | None = None
        self.cut: str | None = None  # why the lease keeper cancelled the send: timeout | lost
        self.can_extend = True
        self.extension: asyncio.Task | None = None
        self.handed_over = False  # its outcome is the finisher's: counted there
        self.has_slot = False  # it holds a send slot (from its claim to the end of its send)
        self.http_status: int | None = None  # the status of the answer taken as delivered
        # a delivery's endpoint (asyncworker.routes.Route): where it goes, and whose
        # figures it counts in; None for a job of the queue's own
        self.route = route
        self.trace = trace  # the intake's kept trace context (lease.tracing), or None
        self.span: Any = None  # this attempt's span while tracing is on (asyncworker.tracing)

    async def settled(self) -> None:
        """Wait for an extension in flight: after it, ``ticket`` is the store's."""
        if self.extension is not None and not self.extension.done():
            await asyncio.shield(self.extension)


def half_way(now_ms: int, lease_until: int) -> int:
    return now_ms + (lease_until - now_ms) // 2


def finish_margin_ms(lease_ms: int) -> int:
    """The time kept back at the end of a lease for the finish transaction."""
    return max(1, min(lease_ms // 5, 2_000))


class LeaseKeeper:
    """Extends the leases of the sends it watches and cuts off those that
    cannot finish in time, keeping ``finish_margin_ms`` for the finish."""

    def __init__(self, queue: AsyncStore, store_time: StoreTime, lease_ms: int,
                 finish_margin_ms: int, *, on_extended: Callable[[], None],
                 on_busy: Callable[[], None],
                 on_failure: Callable[[BaseException], None]) -> None:
        self._queue = queue
        self._time = store_time
        self.lease_ms = lease_ms
        self.finish_margin_ms = finish_margin_ms
        self._on_extended = on_extended
        self._on_busy = on_busy
        self._on_failure = on_failure  # an extension that failed: no send is safe any more
        self._sending: set[Held] = set()
        self.tick_s = max(0.005, min(finish_margin_ms, lease_ms // 4) / 2000)

    def watch(self, held: Held) -> None:
        self._sending.add(held)

    def unwatch(self, held: Held) -> None:
        """The send is over: no extension starts for it from now on."""
        self._sending.discard(held)

    def is_sending(self, held: Held) -> bool:
        return held in self._sending

    def window(self, held: Held, timeout_ms: int | None) -> tuple[int, str | None]:
        """(how long the send may take, None), or (0, why it must not start now).

        Without a timeout of its own a send is bounded by its lease: what the
        lease leaves, less the finish's margin, and it starts only if that is
        more than nothing. With one, it starts when the lease left covers the
        timeout plus the margin, or when the lease can still be extended while
        it runs and more than the margin is left. A lease capped by the job's
        deadline cannot: a send that outlived it could be applied by the
        receiver and its finish refused as stale."""
        left = held.ticket["lease_until"] - self._time.now()
        margin = self.finish_margin_ms
        if timeout_ms is None:
            if left > margin:
                return left - margin, None
        elif left >= timeout_ms + margin or (held.can_extend and left > margin):
            return timeout_ms, None
        needs = f"the send's timeout ({timeout_ms} ms) plus " if timeout_ms else ""
        capped = "" if held.can_extend else ", capped by the job's deadline"
        return 0, (f"the lease left ({left} ms{capped}) does not cover {needs}the {margin} ms "
                   f"kept for the finish; not sent")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if self._sending:
                self._tend(list(self._sending))

    def _tend(self, sending: list[Held]) -> None:
        now = self._time.now()
        for held in sending:
            if held.cut is not None:
                continue
            if held.ticket["lease_until"] - self.finish_margin_ms <= now:
                self._cut(held, "timeout")
            elif held.can_extend and now >= held.extend_at and (
                    held.extension is None or held.extension.done()):
                held.extension = asyncio.create_task(
                    self._extend(held), name=f"extend {held.ticket['id']}")

    async def _extend(self, held: Held) -> None:
        ticket, now = held.ticket, self._time.given()
        try:
            renewed = await self._queue.run(lambda s: s.extend_lease(ticket, self.lease_ms,
                                                                     now_ms=now))
        except Busy:
            self._on_busy()  # tried again at the next tick
            return
        except Exception as exc:
            self._on_failure(exc)
            return
        if renewed is False:
            self._cut(held, "lost")
            return
        assert isinstance(renewed, dict)
        self._on_extended()
        held.can_extend = renewed["lease_until"] > ticket["lease_until"]  # False: capped
        held.ticket = renewed
        held.extend_at = half_way(self._time.now(), renewed["lease_until"])

    def _cut(self, held: Held, why: str) -> None:
        held.cut = why
        if held.task is not None and held in self._sending:
            held.task.cancel()
