"""Shared fixtures: real queue files in tmp_path, an injected clock, row snapshots."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from lease import worker

T0 = 1_000_000  # a clock value well inside the contract's range


class Clock:
    """An injected millisecond clock: returns its values in order, then repeats the last."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def rows(con: sqlite3.Connection, table: str = "jobs") -> list[dict]:
    return [dict(r) for r in con.execute(f"SELECT * FROM {table} ORDER BY seq")]


def job(con: sqlite3.Connection, job_id: str) -> dict:
    row = con.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    assert row is not None, job_id
    return dict(row)


@pytest.fixture
def queue_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
def con(queue_path: Path):
    connection = worker.open_queue(queue_path)
    yield connection
    connection.close()


def add(con: sqlite3.Connection, job_id: str = "snack-1", qty: int = 7, *, now: int = T0,
        ttl: int = 60_000, max_attempts: int = 3) -> None:
    assert worker.enqueue(con, {"id": job_id, "qty": qty}, now, ttl, max_attempts) is True


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "the chaos soak (tests/test_soak.py)")
    group.addoption("--soak-jobs", type=int, default=1000,
                    help="jobs in the chaos soak (default 1000: the short CI run)")
    group.addoption("--soak-seed", type=int, default=20261129, help="seed of the chaos")
