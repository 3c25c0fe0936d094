"""Shared by several test modules."""

from __future__ import annotations

import os
import pty
import sqlite3
import subprocess
from pathlib import Path

from lease import worker
from lease.sqlite import reads

T0 = 1_000_000  # a clock value well inside the contract's range


class Clock:
    """An injected millisecond clock: returns its values in order, then repeats the last."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def _named(con: sqlite3.Connection, sql: str, args: tuple = ()) -> list[dict]:
    cursor = con.execute(sql, args)
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def rows(con: sqlite3.Connection, table: str = "jobs") -> list[dict]:
    """A table's rows in seq order; jobs whole, with their bodies."""
    source = reads._jobs(con) if table == "jobs" else table
    return _named(con, f"SELECT * FROM {source} ORDER BY seq")


def job(con: sqlite3.Connection, job_id: str) -> dict:
    found = _named(con, f"SELECT * FROM {reads._jobs(con)} WHERE id = ?", (job_id,))
    assert found, job_id
    return found[0]


def job_rows(path: Path) -> dict[str, dict]:
    """Every job of a queue file, by id, read through a fresh connection."""
    con = worker.open_queue(path, create=False)
    try:
        return {r["id"]: r for r in rows(con)}
    finally:
        con.close()


def run_on_a_terminal(args: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """Run a command with its stderr on a pseudo-terminal (stdout piped):
    what it did, and everything it drew on the terminal."""
    master, slave = pty.openpty()
    try:
        try:
            proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=slave, text=True,
                                  timeout=120)
        finally:
            os.close(slave)
        screen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(master)
    return proc, screen.decode()


def add(con: sqlite3.Connection, job_id: str = "snack-1", qty: int = 7, *, now: int = T0,
        ttl: int = 60_000, max_attempts: int = 3) -> None:
    assert worker.enqueue(con, {"id": job_id, "qty": qty}, now, ttl, max_attempts) is True



def dead_after_410_and_a_timeout(name: str) -> str:
    """A new queue at ``name`` (a path or a URL) with four dead deliveries:
    gone:0..2 after an HTTP 410, slow after a timeout; all finished now."""
    from lease.policy import RetryPolicy
    from lease.records import Attempt
    from lease.stores import open_store

    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": f"gone:{i}", "body": {"n": i}} for i in range(3)]
                             + [{"id": "slow", "body": {"n": 9}}], RetryPolicy(max_attempts=1))
        claimed = store.claim_jobs("d1", 60_000, 4)
        gone = Attempt(claimed.now_ms, 5, 410, "HTTPError: 410 Gone")
        slow = Attempt(claimed.now_ms, 9000, None, "TimeoutError: timed out")
        store.finish_jobs([(one.ticket, "permanent", 0,
                            slow if one.ticket["id"] == "slow" else gone)
                           for one in claimed.leased])
    return name
