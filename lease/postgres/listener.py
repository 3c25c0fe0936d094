"""Wake-ups on the queue's channel: LISTEN on a connection of its own."""

from __future__ import annotations

import math
import time

import psycopg

from lease.postgres.schema import CHANNEL, connect, mapped
from lease.worker import (
    StoreError,
)


class Listener:
    """Wake-ups on the queue's channel (an intake, a redrive), on a connection of its own.

    ``wait(timeout_s)`` is True when a notification arrived (those already
    arrived are taken as one), False when the time ran out. When the connection drops,
    it reconnects with a growing pause and returns True once it has: what
    was NOTIFY'd meanwhile is lost, so the caller polls once and no work is
    stranded. Polling at the caller's own pace remains the fallback.
    """

    def __init__(self, url: str, name: str, channel: str = CHANNEL) -> None:
        self._url = url
        self.name = name
        self.channel = channel  # the queue's (lease.postgres.queues)
        self._pause_s = _MIN_PAUSE_S
        self._conn: psycopg.Connection | None = self._listen()
        self._closed = False

    def _listen(self) -> psycopg.Connection:
        conn = connect(self._url, self.name)
        try:
            with mapped(self.name):
                conn.execute(f"LISTEN {self.channel}")
        except BaseException:
            conn.close()
            raise
        return conn

    def wait(self, timeout_s: float) -> bool:
        if type(timeout_s) not in (int, float) or not 0 <= timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        if self._closed:
            raise StoreError(f"the listener of {self.name} is closed")
        give_up = time.monotonic() + timeout_s
        if self._conn is not None:
            try:
                woke = any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))
                if woke:
                    for _ in self._conn.notifies(timeout=0):  # the others: one wake-up
                        pass
                return woke
            except psycopg.Error:  # the connection dropped: reconnect, then poll once
                self._conn.close()
                self._conn = None
        return self._reconnect(give_up)

    def _reconnect(self, give_up: float) -> bool:
        """Connect again before ``give_up``, pausing longer after each failure."""
        while True:
            try:
                self._conn = self._listen()
                self._pause_s = _MIN_PAUSE_S
                return True
            except StoreError:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(self._pause_s, left))
                self._pause_s = min(_MAX_PAUSE_S, self._pause_s * 2)

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MIN_PAUSE_S = 0.05
_MAX_PAUSE_S = 5.0
