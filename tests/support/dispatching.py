"""Shared by several test modules."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from lease import worker
from lease.policy import DEFAULT_POLICY, RetryPolicy
from lease.sqlite import enqueue_events, open_store, reads
from tests.support.queues import T0

CHILD = str(Path(__file__).with_name("child.py"))


def fill(path: Path, n: int, *, prefix: str = "job", ttl: int = 60_000, max_attempts: int = 3,
         now: int | None = None) -> dict[str, int]:
    """n pending jobs with quantities 1..n (mod 1000); returns {id: qty}."""
    con = worker.open_queue(path)
    try:
        start = int(time.time() * 1000) if now is None else now
        events = {f"{prefix}-{i}": i % 1000 + 1 for i in range(n)}
        for job_id, qty in events.items():
            worker.enqueue(con, {"id": job_id, "qty": qty}, start, ttl, max_attempts)
        return events
    finally:
        con.close()


def statuses(path: Path) -> dict[str, int]:
    con = worker.open_queue(path)
    try:
        return reads.counts(con)
    finally:
        con.close()


class FakeClock:
    """Milliseconds that move only when the test says so."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def child_result(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, dict | None]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return proc.returncode, json.loads(last) if last.startswith("{") else None


async def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll a condition that the code under test makes true; fail, not hang, if never."""
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "the condition was never reached"
        await asyncio.sleep(0.01)


def enqueue(path: Path, events: list[dict], policy: RetryPolicy = DEFAULT_POLICY,
            now: int = T0) -> None:
    con = open_store(path)
    try:
        assert enqueue_events(con, events, now, policy) == [True] * len(events)
    finally:
        con.close()


def wall_ms() -> int:
    return int(time.time() * 1000)


def attempts(path: Path, job_id: str) -> list[dict]:
    con = reads.open_readonly(path)
    try:
        found = reads.job_history(con, job_id)
    finally:
        con.close()
    assert found is not None
    return found["attempts"]

