"""Shared by several test modules."""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT_S = 10.0  # the bound on waiting for another connection's state: generous


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a condition another connection or process makes true; fail naming it."""
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.005)

