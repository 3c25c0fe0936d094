"""The wall clock, once: milliseconds since the epoch on this host.

A SQLite queue judges its leases by it (every writer of a local file runs on
this host); the runtime and the command line read it for what they show and
time. PostgreSQL judges by the server's clock instead (``lease.postgres``).
"""

from __future__ import annotations

import time

__all__ = ["wall_clock_ms"]


def wall_clock_ms() -> int:
    return int(time.time() * 1000)
