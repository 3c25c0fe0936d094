"""How a ``Busy`` store is retried, for every caller, synchronous or async.

A short jittered pause (1-10 ms: another writer's transaction is short), for
up to a patience, unless the caller gives up sooner. The policy is here once;
``BusyRetry.call`` runs it on a thread, ``BusyRetry.call_async`` on an event
loop.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from lease.worker import Busy

__all__ = ["BusyRetry", "PATIENT"]

T = TypeVar("T")


@dataclass(frozen=True)
class BusyRetry:
    """How a ``Busy`` store is retried, for every caller: a short jittered pause
    (1-10 ms: another writer's transaction is short), for up to ``patience_s``
    unless the caller gives up sooner (a finish whose leases have all ended)."""

    patience_s: float = 5.0
    min_pause_s: float = 0.001
    max_pause_s: float = 0.010

    def pause_s(self, draw: float) -> float:
        return self.min_pause_s + (self.max_pause_s - self.min_pause_s) * draw

    def give_up_at(self) -> float:
        """The monotonic time after which a call stops retrying."""
        return time.monotonic() + self.patience_s

    @staticmethod
    def still_trying(give_up: float, keep_trying: Callable[[], bool] | None) -> bool:
        """After a Busy: whether to try again (the caller's ``keep_trying``
        decides when it gives one, else the patience)."""
        return keep_trying() if keep_trying is not None else time.monotonic() < give_up

    def call(self, fn: Callable[[], T], *, on_busy: Callable[[Busy], None] | None = None,
             keep_trying: Callable[[], bool] | None = None,
             draw: Callable[[], float] = random.random,
             sleep: Callable[[float], None] = time.sleep) -> T:
        """``fn()``, retried while it raises Busy, for up to ``patience_s``
        (or as long as ``keep_trying()`` says)."""
        give_up = self.give_up_at()
        while True:
            try:
                return fn()
            except Busy as busy:
                if on_busy is not None:
                    on_busy(busy)
                if not self.still_trying(give_up, keep_trying):
                    raise
            sleep(self.pause_s(draw()))

    async def call_async(self, fn: Callable[[], Awaitable[T]], *,
                         on_busy: Callable[[Busy], None] | None = None,
                         keep_trying: Callable[[], bool] | None = None,
                         draw: Callable[[], float] = random.random) -> T:
        """``await fn()``, retried as ``call`` retries, pausing on the event loop."""
        give_up = self.give_up_at()
        while True:
            try:
                return await fn()
            except Busy as busy:
                if on_busy is not None:
                    on_busy(busy)
                if not self.still_trying(give_up, keep_trying):
                    raise
            await asyncio.sleep(self.pause_s(draw()))


PATIENT = BusyRetry()
