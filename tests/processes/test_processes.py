"""Tier 3: real child processes on one queue file, killed for real."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lease import worker
from tests.support.dispatching import CHILD
from tests.support.queues import T0, add, rows
from tests.support.servers import ReceiverProcess

ROUNDS = 20


def integrity_ok(path: Path) -> bool:
    con = sqlite3.connect(path)
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


def test_two_processes_race_claim_exactly_one_wins(queue_path: Path):
    con = worker.open_queue(queue_path)
    env = {**os.environ, "RACE_NOW": str(T0)}
    children = [
        subprocess.Popen([sys.executable, CHILD, "race", str(queue_path), f"racer-{n}",
                          str(ROUNDS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
        for n in (1, 2)
    ]
    try:
        winners: list[str] = []
        for round_no in range(ROUNDS):
            add(con, f"job-{round_no}", 1)
            for child in children:  # both released together, as close as two pipes allow
                child.stdin.write("go\n")
                child.stdin.flush()
            answers = [json.loads(child.stdout.readline()) for child in children]
            tickets = [a for a in answers if a is not None]
            assert len(tickets) == 1, answers
            assert tickets[0]["id"] == f"job-{round_no}" and tickets[0]["token"] == 1
            winners.append(tickets[0]["owner"])
        assert all(r["status"] == "leased" and r["token"] == 1 for r in rows(con))
    finally:
        for child in children:
            child.stdin.close()
            try:
                child.wait(timeout=30)
            finally:
                child.kill()
                child.stdout.close()
        con.close()
    assert [child.returncode for child in children] == [0, 0]
    assert integrity_ok(queue_path)


def _setup(path: Path, op: str) -> list:
    """Prepare the file for one call of `op`; return that call's arguments (JSON-able)."""
    con = worker.open_queue(path)
    try:
        add(con, "j", 2, ttl=5000)
        add(con, "k", 3, ttl=5000)
        if op == "enqueue":
            return [{"id": "n", "qty": 1}, T0, 1000, 3]
        if op == "claim":
            return ["o", T0, 1000]
        ticket = worker.claim(con, "o", T0, 1000)
        if op == "finish":
            return [ticket, "retry", T0 + 1, 10]
        if op == "extend":
            return [ticket, T0 + 1, 2000]
        worker.finish(con, ticket, "permanent", T0 + 1)
        return ["j", T0 + 2, 1000, "fix"]
    finally:
        con.close()


def _state(path: Path) -> tuple:
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    try:
        return (rows(con), rows(con, "redrives"))
    finally:
        con.close()


CRASH_POINTS = [
    ("enqueue", "after-enqueue"), ("enqueue", "after-commit"),
    ("claim", "after-claim"), ("claim", "after-commit"),
    ("finish", "after-finish"), ("finish", "after-commit"),
    ("extend", "after-extend"), ("extend", "after-commit"),
    ("redrive", "after-audit"), ("redrive", "after-redrive"), ("redrive", "after-commit"),
]


@pytest.mark.parametrize("how", ["exit", "sigkill"])
@pytest.mark.parametrize(("op", "point"), CRASH_POINTS)
def test_crash_inside_fault_hook_is_atomic(tmp_path: Path, op: str, point: str, how: str):
    ref = tmp_path / "ref.db"
    args = _setup(ref, op)
    con = worker.open_queue(ref)
    getattr(worker, op)(con, *args)
    con.close()
    after = _state(ref)

    path = tmp_path / "q.db"
    _setup(path, op)
    before = _state(path)
    spec = {"path": str(path), "op": op, "args": args, "point": point, "how": how}
    child = subprocess.run([sys.executable, CHILD, "crash", json.dumps(spec)], timeout=30)
    assert child.returncode == (73 if how == "exit" else -signal.SIGKILL)
    assert integrity_ok(path)
    state = _state(path)  # read by a fresh connection: a hot journal is rolled back here
    assert state == (after if point == "after-commit" else before)
    if op == "redrive":  # no audit row without its state change, and no change without audit
        jobs, audits = state
        assert (jobs[0]["status"] == "pending") == (len(audits) == 1)


def _dispatch(spec: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHILD, "dispatch", json.dumps(spec)],
                          capture_output=True, text=True, timeout=60)


def test_crash_after_ack_is_recovered_and_applied_once(tmp_path: Path):
    """The story: dispatcher 1 dies right after the receiver committed; dispatcher 2
    recovers the job once the lease has run out; the request arrives twice and is
    applied once; the job ends done with token 2."""
    queue = tmp_path / "queue.db"
    con = worker.open_queue(queue)
    add(con, "snack-7", 7, ttl=60_000)
    con.close()
    with ReceiverProcess(tmp_path / "inbox.db") as receiver:
        first = _dispatch({"path": str(queue), "owner": "dispatcher-1", "url": receiver.url,
                           "clock": [T0, T0 + 10], "lease_ms": 1000, "die_after_ack": True})
        assert first.returncode == 73, first.stderr
        mid = receiver.stats()
        assert (mid["process_requests"], mid["applied"], mid["stock"]) == (1, 1, 7)
        con = worker.open_queue(queue)
        leased = rows(con)[0]
        con.close()
        assert (leased["status"], leased["owner"], leased["token"]) == ("leased", "dispatcher-1", 1)

        # The lease is still live for a second dispatcher at T0 + 999: nothing to do.
        early = _dispatch({"path": str(queue), "owner": "dispatcher-2", "url": receiver.url,
                           "clock": [T0 + 999], "lease_ms": 1000})
        assert early.returncode == 0 and json.loads(early.stdout) is None

        second = _dispatch({"path": str(queue), "owner": "dispatcher-2", "url": receiver.url,
                            "clock": [T0 + 1000, T0 + 1010], "lease_ms": 1000})
        assert second.returncode == 0, second.stderr
        assert json.loads(second.stdout) == {"id": "snack-7", "token": 2, "status": "done"}
        stats = receiver.stats()
    assert (stats["process_requests"], stats["applied"], stats["duplicates"]) == (2, 1, 1)
    assert (stats["inbox_rows"], stats["stock"]) == (1, 7)
    con = worker.open_queue(queue)
    done = rows(con)[0]
    con.close()
    assert (done["status"], done["token"], done["attempts"], done["owner"]) == (
        "done", 2, 2, None)
    assert integrity_ok(queue)


LEGAL_REASONS = {"pending": {None, "retry"}, "leased": {None}, "done": {None},
                 "dead": {"deadline", "exhausted", "permanent"}}


def assert_every_row_legal(path: Path, ids: list[str], ttl: int) -> None:
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        jobs = {r["id"]: dict(r) for r in con.execute("SELECT * FROM jobs")}
        audits = [dict(r) for r in con.execute("SELECT * FROM redrives ORDER BY seq")]
    finally:
        con.close()
    assert sorted(jobs) == sorted(ids), "a job was lost or invented"
    for job in jobs.values():
        assert job["reason"] in LEGAL_REASONS[job["status"]], job
        leased = job["status"] == "leased"
        assert (job["owner"] is not None) == leased and (job["lease_until"] is not None) == leased
        if leased:
            assert job["attempts"] >= 1 and job["lease_until"] <= job["deadline"], job
        assert job["token"] >= job["attempts"] and job["attempts"] <= job["max_attempts"], job
    latest: dict[str, dict] = {}
    for audit in audits:
        assert audit["id"] in jobs and audit["token"] <= jobs[audit["id"]]["token"]
        latest[audit["id"]] = audit
    for job_id, audit in latest.items():
        # a redrive sets deadline = at_ms + ttl, and nothing else moves a deadline:
        # the newest audit row of a job always comes with its state change
        assert jobs[job_id]["deadline"] == audit["at_ms"] + ttl, (jobs[job_id], audit)


def test_sigkill_at_random_moments_inside_multi_job_runs(tmp_path: Path):
    import random

    rng = random.Random(20261129)
    ids = [f"job-{i}" for i in range(40)]
    ttl = 60_000
    path = tmp_path / "queue.db"
    con = worker.open_queue(path)
    worker.enqueue_many(con, [{"id": i, "qty": 3} for i in ids], int(time.time() * 1000), ttl,
                        4)
    con.close()
    kills = 0
    for round_no in range(8):
        spec = {"path": str(path), "seed": round_no, "ids": ids, "ttl": ttl, "qty": 3}
        child = subprocess.Popen([sys.executable, CHILD, "churn", json.dumps(spec)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "churning"
            time.sleep(rng.uniform(0.01, 0.25))
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
            kills += 1
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
        assert_every_row_legal(path, ids, ttl)
    assert kills == 8
    # After the last kill, the work still finishes: leases expire, budgets end.
    con = worker.open_queue(path)
    try:
        now = int(time.time() * 1000) + 1000
        while worker.run_once(con, "recovery", lambda: now, lambda e: True, 0.5) is not None:
            pass
        statuses = {r[0] for r in con.execute("SELECT DISTINCT status FROM jobs")}
    finally:
        con.close()
    assert statuses <= {"done", "dead"}
    assert_every_row_legal(path, ids, ttl)
