"""Shared fixtures: real queue files in tmp_path, an injected clock, row snapshots."""

from __future__ import annotations

import asyncio
import os
import pty
import sqlite3
import subprocess
from pathlib import Path
from typing import Awaitable, Callable

import pytest

from lease import observe, worker
from lease.sqlite import open_store

# A real PostgreSQL server, started lazily by the suite (or TEST_DATABASE_URL):
# the fixtures postgres_server, postgres_url and make_postgres_server.
pytest_plugins = ["tests.postgres_server"]

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
    source = observe._jobs(con) if table == "jobs" else table
    return _named(con, f"SELECT * FROM {source} ORDER BY seq")


def job(con: sqlite3.Connection, job_id: str) -> dict:
    found = _named(con, f"SELECT * FROM {observe._jobs(con)} WHERE id = ?", (job_id,))
    assert found, job_id
    return found[0]


@pytest.fixture
def queue_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
def con(queue_path: Path):
    connection = worker.open_queue(queue_path)
    yield connection
    connection.close()


@pytest.fixture
def queue(tmp_path: Path) -> Path:
    """A product queue file, made and closed: for tests that drive the CLI."""
    path = tmp_path / "queue.db"
    open_store(path).close()
    return path


def job_rows(path: Path) -> dict[str, dict]:
    """Every job of a queue file, by id, read through a fresh connection."""
    con = worker.open_queue(path, create=False)
    try:
        return {r["id"]: r for r in rows(con)}
    finally:
        con.close()


@pytest.fixture(params=["sync", "async", "aiohttp"])
def send(request: pytest.FixtureRequest) -> Callable[..., Awaitable[object]]:
    """Each sender (sync; async on its own client; async on a caller's aiohttp
    session), as an awaitable taking a destination (a lab URL or a
    Destination) first: ``await send(destination, event, timeout=...)``. The
    lab sender's own tests (test_sender*.py) keep fixtures of their own shape."""
    from asyncworker import new_session
    from asyncworker import send_http as async_send
    from lease import http as sync_http

    if request.param == "async":
        return async_send
    if request.param == "aiohttp":  # the async sender on a caller's aiohttp session
        async def via_aiohttp(destination: object, event: dict, **kwargs: object) -> object:
            async with new_session() as session:
                return await async_send(destination, event, session=session, **kwargs)

        return via_aiohttp

    async def via_thread(destination: object, event: dict, **kwargs: object) -> object:
        return await asyncio.to_thread(sync_http.send_http, destination, event, **kwargs)

    return via_thread


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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "the chaos soak (tests/test_soak.py)")
    group.addoption("--soak-jobs", type=int, default=1000,
                    help="jobs in the chaos soak (default 1000: the short CI run)")
    group.addoption("--soak-seconds", type=float, default=None,
                    help="seconds of chaos in the PostgreSQL soak (default 25: the short run)")
    group.addoption("--soak-seed", type=int, default=20261129, help="seed of the chaos")
