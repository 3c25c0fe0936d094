"""Tier 2: run_once and run_file, one claim-send-finish cycle on a real file.

`runner` is the front end under test; the same table runs against every one.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from asyncworker import QueueThread
from asyncworker import run_once as aio_run_once
from lease import worker
from lease.sqlite import open_store
from lease.worker import BadAck, Permanent, Retryable
from tests.support.queues import T0, Clock, add, job, rows


@pytest.fixture(params=["sync", "async"])
def runner(request, queue_path):
    """run_once(con, owner, clock, send, jitter, lease_ms) of the front end under test.

    The async twin runs on its own QueueThread over the same file; the test's
    `con` only prepares and reads the file.
    """
    if request.param == "sync":
        return worker.run_once
    # A QueueThread opens the product queue, which migrates a contract file at its
    # first open: migrate it before the test looks at the file's bytes.
    open_store(queue_path).close()

    def run(con, owner, clock, send, jitter, lease_ms=1000):
        async def go():
            async def async_send(event):
                return send(event)

            async with QueueThread(queue_path) as queue:
                return await aio_run_once(queue, owner, clock, async_send, jitter, lease_ms)

        return asyncio.run(go())

    return run


class Recorder:
    """A send that records what it got and answers with a fixed value or error."""

    def __init__(self, answer: object = True, *, action=None) -> None:
        self.answer = answer
        self.action = action
        self.events: list[dict] = []

    def __call__(self, event: dict) -> object:
        self.events.append(dict(event))
        if self.action is not None:
            self.action(event)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_no_work_is_none_and_no_send(runner, con):
    send, clock = Recorder(), Clock(T0)
    assert runner(con, "o", clock, send, 0.5) is None
    assert send.events == [] and clock.calls == 1


def test_ok(runner, con):
    add(con, "snack-7", 7)
    send = Recorder(True)
    result = runner(con, "disp-1", Clock(T0, T0 + 20), send, 0.5, 300)
    assert result == {"id": "snack-7", "token": 1, "status": "done"}
    assert send.events == [{"id": "snack-7", "qty": 7}]
    row = job(con, "snack-7")
    assert (row["status"], row["available_at"], row["owner"], row["lease_until"]) == (
        "done", T0 + 20, None, None)
    assert not con.in_transaction


class Truthy:
    def __bool__(self) -> bool:
        return True


@pytest.mark.parametrize("answer", [1, "True", None, False, Truthy(), {"ok": True}, 1.0])
def test_non_true_ack_is_badack_and_stays_leased(runner, con, answer):
    add(con, "j", 1)
    clock = Clock(T0, T0 + 5)
    with pytest.raises(BadAck):
        runner(con, "o", clock, Recorder(answer), 0.5, 400)
    row = job(con, "j")
    assert (row["status"], row["owner"], row["token"], row["lease_until"]) == (
        "leased", "o", 1, T0 + 400)
    assert clock.calls == 1  # no second clock read, no finish
    assert not con.in_transaction


@pytest.mark.parametrize(("attempt_before", "jitter", "delay"),
                         [(0, 0.5, 50), (1, 1, 200), (2, 0.25, 100), (0, 0, 0)])
def test_retryable_uses_retry_delay(runner, con, attempt_before, jitter, delay):
    add(con, "j", 1, max_attempts=5)
    con.execute("UPDATE jobs SET attempts = ?, token = ?", (attempt_before, attempt_before))
    result = runner(con, "o", Clock(T0, T0 + 7), Recorder(Retryable("503")), jitter)
    assert result == {"id": "j", "token": attempt_before + 1, "status": "pending"}
    row = job(con, "j")
    assert (row["reason"], row["available_at"]) == ("retry", T0 + 7 + delay)
    assert delay == worker.retry_delay(attempt_before + 1, 100, 1000, jitter)


def test_permanent(runner, con):
    add(con, "j", 1)
    result = runner(con, "o", Clock(T0, T0 + 1), Recorder(Permanent("409")), 0.5)
    assert result == {"id": "j", "token": 1, "status": "dead"}
    assert job(con, "j")["reason"] == "permanent"


def test_unknown_error_propagates_as_is(runner, con):
    add(con, "j", 1)
    error = ConnectionAbortedError("boom")
    with pytest.raises(ConnectionAbortedError) as raised:
        runner(con, "o", Clock(T0, T0 + 1), Recorder(error), 0.5)
    assert raised.value is error
    assert job(con, "j")["status"] == "leased"


@pytest.mark.parametrize("second", [T0 - 1, True, float(T0 + 1), -1, None, worker.MAX_NOW_MS + 1])
def test_bad_second_clock_keeps_claim(runner, con, second):
    add(con, "j", 1)
    send = Recorder(True)
    with pytest.raises(ValueError):
        runner(con, "o", Clock(T0, second), send, 0.5)
    assert len(send.events) == 1
    row = job(con, "j")
    assert (row["status"], row["token"], row["owner"]) == ("leased", 1, "o")
    assert not con.in_transaction


def test_equal_second_clock_is_fine(runner, con):
    add(con, "j", 1)
    assert runner(con, "o", Clock(T0, T0), Recorder(True), 0.5)["status"] == "done"


@pytest.mark.parametrize("jitter", [True, -0.1, 1.5, float("nan"), float("inf"), "0.5", None])
def test_bad_jitter_first_before_clock(runner, con, queue_path, jitter):
    add(con, "j", 1)
    before = queue_path.read_bytes()
    clock, send = Clock(T0), Recorder()
    with pytest.raises(ValueError):
        runner(con, "o", clock, send, jitter)
    assert clock.calls == 0 and send.events == []
    assert queue_path.read_bytes() == before


@pytest.mark.parametrize("first", [True, -1, 1.5, None, worker.MAX_NOW_MS + 1])
def test_bad_first_clock_claims_nothing(runner, con, queue_path, first):
    add(con, "j", 1)
    before = queue_path.read_bytes()
    with pytest.raises(ValueError):
        runner(con, "o", Clock(first), Recorder(), 0.5)
    assert queue_path.read_bytes() == before


@pytest.mark.parametrize("args", [("", 0.5, 1000), ("o", 0.5, 0), ("o", 0.5, True),
                                  ("o\n", 0.5, 1000), ("o", 0.5, 60001)])
def test_bad_arguments(runner, con, queue_path, args):
    add(con, "j", 1)
    owner, jitter, lease_ms = args
    before = queue_path.read_bytes()
    with pytest.raises(ValueError):
        runner(con, owner, Clock(T0), Recorder(), jitter, lease_ms)
    assert queue_path.read_bytes() == before


def test_send_mutating_its_dict_cannot_move_the_marker(runner, con):
    add(con, "mine", 3)
    add(con, "other", 4)

    def mutate(event: dict) -> None:
        event["id"], event["qty"] = "other", 4
        event["extra"] = True

    result = runner(con, "o", Clock(T0, T0 + 1), Recorder(True, action=mutate), 0.5)
    assert result == {"id": "mine", "token": 1, "status": "done"}
    assert job(con, "mine")["status"] == "done"
    assert job(con, "other")["status"] == "pending" and job(con, "other")["token"] == 0


def test_send_runs_with_no_lock_held(runner, con, queue_path):
    add(con, "j", 1)

    def write_meanwhile(event: dict) -> None:
        other = sqlite3.connect(queue_path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # fails at once if any write lock is held
            other.execute("ROLLBACK")
            assert worker.enqueue(other, {"id": "during-send", "qty": 2}, T0, 1000) is True
        finally:
            other.close()
        assert not con.in_transaction

    result = runner(con, "o", Clock(T0, T0 + 1), Recorder(True, action=write_meanwhile), 0.5)
    assert result["status"] == "done"
    assert [r["id"] for r in rows(con)] == ["j", "during-send"]
    assert job(con, "during-send")["status"] == "pending"


def test_late_result_is_stale_and_keeps_lease(runner, con):
    add(con, "j", 1)
    result = runner(con, "o", Clock(T0, T0 + 1000), Recorder(True), 0.5, 1000)
    assert result == {"id": "j", "token": 1, "status": "stale"}
    assert job(con, "j")["status"] == "leased"


def test_result_after_reclaim_is_stale(runner, con, queue_path):
    add(con, "j", 1)

    def reclaimed_elsewhere(event: dict) -> None:
        other = worker.open_queue(queue_path)
        try:
            assert worker.claim(other, "thief", T0 + 100, 1000)["token"] == 2
        finally:
            other.close()

    result = runner(con, "o", Clock(T0, T0 + 50), Recorder(True, action=reclaimed_elsewhere),
                    0.5, 100)
    assert result == {"id": "j", "token": 1, "status": "stale"}
    row = job(con, "j")
    assert (row["status"], row["owner"], row["token"]) == ("leased", "thief", 2)


# --------------------------------------------------------------------- run_file


def test_run_file_missing_creates_nothing(tmp_path: Path):
    missing = tmp_path / "nope.db"
    with pytest.raises(FileNotFoundError):
        worker.run_file(missing, "o", Clock(T0), Recorder(), 0.5)
    assert not missing.exists()
    with pytest.raises(FileNotFoundError):
        worker.run_file(tmp_path, "o", Clock(T0), Recorder(), 0.5)
    assert list(tmp_path.iterdir()) == []


def test_run_file_bad_args_do_not_open(tmp_path: Path, monkeypatch):
    path = tmp_path / "q.db"
    path.touch()
    monkeypatch.setattr(worker, "open_queue", lambda *a, **k: pytest.fail("opened"))
    with pytest.raises(ValueError):
        worker.run_file(path, "o", Clock(T0), Recorder(), 2)


@pytest.fixture
def opened(monkeypatch) -> list[sqlite3.Connection]:
    seen: list[sqlite3.Connection] = []
    real = worker.open_queue

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(worker, "open_queue", spy)
    return seen


def _closed(con: sqlite3.Connection) -> bool:
    try:
        con.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


def test_run_file_closes_on_success(queue_path: Path, opened):
    setup = worker.open_queue(queue_path)
    add(setup, "j", 2)
    setup.close()
    assert worker.run_file(queue_path, "o", Clock(T0, T0 + 1), Recorder(True), 0.5) == {
        "id": "j", "token": 1, "status": "done"}
    assert len(opened) == 2 and _closed(opened[1])
    assert worker.run_file(str(queue_path), "o", Clock(T0 + 2), Recorder(True), 0.5) is None
    assert len(opened) == 3 and _closed(opened[2])


def test_run_file_closes_on_error(queue_path: Path, opened):
    setup = worker.open_queue(queue_path)
    add(setup, "j", 2)
    setup.close()
    with pytest.raises(BadAck):
        worker.run_file(queue_path, "o", Clock(T0, T0 + 1), Recorder("yes"), 0.5)
    assert len(opened) == 2 and _closed(opened[1])
