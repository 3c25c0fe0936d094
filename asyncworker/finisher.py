"""The finish group committer: the outcomes of many jobs in one transaction.

Finishes that arrive while a group is being written form the next group:
one transaction for all of them, started as soon as the last one is written.
While a claim is in flight, the next group also waits for it: the outcomes
of up to ``HOLD_CLAIMS`` claims' sends cost one durable commit instead of
several, and on a SQLite file's one connection a finish queued ahead of a
claim would keep the sends that claim feeds waiting for its commit (what
that wait bought, measured: docs/benchmarks.md, "What the finish group's
wait bought"). Once an outcome is queued
this committer owns it: cancelling the job's task (an abort) cannot lose
it, and it is counted here, written or failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from asyncworker.leases import Held, StoreTime
from asyncworker.store import AsyncStore
from lease.records import Attempt
from lease.store import Store
from lease.worker import MAX_BATCH, Busy, check_second_clock

__all__ = ["BUSY", "Judged", "Recorded", "GroupFinisher"]

log = logging.getLogger("asyncworker.finisher")

# (status or False for stale, reason: the cause if dead); ("leased", None) for evidence only;
# BUSY when nothing was recorded: the store stayed busy past every lease of the group
Recorded = tuple[str | bool, str | None]
STALE: Recorded = (False, None)
BUSY: Recorded = ("unrecorded", "busy")
HOLD_CLAIMS = 4  # the most claims a finish group waits for; its size is that many batches
NO_WAIT = float("inf")  # no group waits for a claim


class Judged(NamedTuple):
    """What one attempt came to: the outcome to finish with (None: evidence
    only, the job stays leased), its retry delay, and what the attempt saw."""

    outcome: str | None
    delay_ms: int
    seen: Attempt


class GroupFinisher:
    """``finisher.add(held, judged)`` hands one outcome over; ``on_recorded``
    gets what was recorded, or ``on_failed`` the group whose transaction
    failed (its jobs stay leased). ``on_committed`` gets each committed
    group's transaction time in seconds. Nothing per job waits for its group:
    no future, no wake-up of the job's task.

    ``claim_in_flight`` gives the future of the dispatcher's claim in flight,
    or None: a group waits for it, for up to ``HOLD_CLAIMS`` claims, and
    holds up to ``HOLD_CLAIMS`` × ``batch_size`` outcomes. It stops waiting
    once it is full, once no claim is in flight, and before any of its leases
    is within ``margin_ms`` of its end. Without it (a finisher with no
    claims beside it) a group is at most ``batch_size`` and never waits."""

    def __init__(self, queue: AsyncStore, store_time: StoreTime, batch_size: int, *,
                 on_recorded: Callable[[Held, Judged, Recorded], None],
                 on_failed: Callable[[list[Held], list[Judged]], None],
                 on_committed: Callable[[float], None],
                 on_busy: Callable[[], None],
                 claim_in_flight: Callable[[], asyncio.Future | None] | None = None,
                 margin_ms: int = 0) -> None:
        self._queue = queue
        self._time = store_time
        self.batch_size = batch_size
        self.group_size = batch_size if claim_in_flight is None else min(
            MAX_BATCH, HOLD_CLAIMS * batch_size)
        self._claim_in_flight = claim_in_flight
        self._margin_ms = margin_ms
        self._on_recorded = on_recorded
        self._on_failed = on_failed
        self._on_committed = on_committed
        self._on_busy = on_busy
        self._to_finish: list[tuple[Held, Judged]] = []
        self._flusher: asyncio.Task | None = None
        # While a group waits for a claim: the earliest lease end it waits by, and a
        # future that an outcome whose lease ends sooner completes, to wake it.
        self._waits_until = NO_WAIT
        self._sooner: asyncio.Future | None = None

    def add(self, held: Held, judged: Judged) -> None:
        """Queue one outcome; from here this committer owns it and counts it."""
        self._to_finish.append((held, judged))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="finish flusher")
        elif held.ticket["lease_until"] < self._waits_until:
            self._wake_sooner()  # the group's wait was timed by a later lease

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self._to_finish and (self._flusher is None or self._flusher.done())

    async def settle(self) -> None:
        """Wait until every queued finish is written (or has failed)."""
        if self._flusher is not None:
            await asyncio.wait({self._flusher})

    async def _flush(self) -> None:
        while self._to_finish:
            await self._after_claims()
            group = self._to_finish[: self.group_size]
            del self._to_finish[: self.group_size]
            helds = [held for held, _ in group]
            judged = [one for _, one in group]
            try:
                recorded = await self._write(helds, judged)
            except Exception:
                self._on_failed(helds, judged)
                continue
            on_recorded = self._on_recorded
            for (held, one), result in zip(group, recorded, strict=True):
                on_recorded(held, one, result)

    async def _after_claims(self) -> None:
        """Wait for the claims in flight, one after another (at most
        HOLD_CLAIMS), while the group is not full and every lease it holds has
        more than the margin left: the outcomes their sends bring join it. An
        outcome whose lease ends sooner wakes the wait to time it again; a
        wait that runs out ends it."""
        claim_in_flight = self._claim_in_flight
        if claim_in_flight is None:  # no claims beside this finisher
            return
        claims = 0
        while claims < HOLD_CLAIMS:
            claim = claim_in_flight()
            if claim is None or len(self._to_finish) >= self.group_size:
                return
            try:
                now = self._time.now()
            except (RuntimeError, ValueError):  # a bad clock value: the group's write says so
                return
            earliest = min(held.ticket["lease_until"] for held, _ in self._to_finish)
            left_ms = earliest - self._margin_ms - now
            if left_ms <= 0:
                return
            self._waits_until = earliest
            self._sooner = sooner = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait({claim, sooner}, timeout=left_ms / 1000,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._waits_until, self._sooner = NO_WAIT, None
            if claim.done():
                claims += 1
            elif not sooner.done():
                return  # the margin of a lease it holds has come

    def _wake_sooner(self) -> None:
        if self._sooner is not None and not self._sooner.done():
            self._sooner.set_result(None)

    async def _write(self, helds: list[Held], judged: list[Judged]) -> list[Recorded]:
        """finish_jobs, each job with its newest ticket, at a clock value read
        afresh for every try: a retry must not judge by a time already past. A
        Busy store is retried while any lease in the group may still be live (a
        finish after all of them would be stale anyway)."""
        items = [(held.ticket, *one) for held, one in zip(helds, judged, strict=True)]

        def finish(store: Store) -> tuple[list, float]:
            now = self._time.given()
            if now is not None:
                for held in helds:
                    check_second_clock(held.first_ms, now)
            started = time.perf_counter()  # the transaction's own time, on its thread
            return store.finish_jobs(items, now_ms=now), time.perf_counter() - started

        def live() -> bool:
            return any(self._time.now() < held.ticket["lease_until"] for held in helds)

        try:
            found, seconds = await self._queue.call(finish, keep_trying=live,
                                                    on_busy=lambda _: self._on_busy())
        except Busy:
            return [BUSY] * len(helds)
        self._on_committed(seconds)
        return [one or STALE for one in found]

