"""The endpoints' story end to end, with real processes: three receivers (one
healthy, one slow and capped, one down until late), two dispatcher processes
serving every endpoint of one queue, one of them SIGKILLed mid-run. Every
(message, endpoint) is applied exactly once at its receiver: the inbox's
effect is the sum of the messages' quantities, once."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.sqlite import SQLiteStore
from tests.support.servers import ReceiverProcess, free_port, stop_process
from tests.support.waiting import wait_until

MESSAGES = 60
POLICY = RetryPolicy(max_attempts=100, backoff_base_ms=50, backoff_cap_ms=400,
                     ttl_ms=600_000)
WAIT_S = 120.0  # two loaded cores, three receivers, two dispatchers


def dispatcher(queue: Path, owner: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncworker", "run", str(queue), "--owner", owner,
         "--concurrency", "8", "--lease-ms", "3000", "--backoff-base-ms", "50",
         "--backoff-cap-ms", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def inbox(path: Path) -> tuple[dict[str, int], int]:
    """(id -> qty) of what the inbox applied, and its effect."""
    if not path.exists():
        return {}, 0
    with sqlite3.connect(path) as con:
        applied = dict(con.execute("SELECT id, qty FROM inbox").fetchall())
        [stock] = con.execute("SELECT stock FROM effect").fetchone()
    return applied, stock


def statuses(queue: Path) -> dict[str, int]:
    with SQLiteStore(queue, read_only=True) as store:
        return store.counts()


def down_attempts(queue: Path) -> int:
    with sqlite3.connect(queue) as con:
        return con.execute("SELECT COUNT(*) FROM attempts a JOIN jobs j ON j.id = a.id"
                           " WHERE j.endpoint = 'down'").fetchone()[0]


def test_every_message_reaches_every_endpoint_once_through_a_slow_a_down_and_a_kill(
        tmp_path):
    queue = tmp_path / "queue.db"
    down_port = free_port()
    events = [{"id": f"m-{n}", "qty": n % 7 + 1} for n in range(MESSAGES)]
    expected = {event["id"]: event["qty"] for event in events}
    with ReceiverProcess(tmp_path / "healthy.db") as healthy, \
            ReceiverProcess(tmp_path / "slow.db", "--latency-ms", "150") as slow:
        with SQLiteStore(queue, create=True, journal="wal") as store:
            store.add_endpoint(Endpoint("healthy", healthy.url))
            store.add_endpoint(Endpoint("slow", slow.url, max_in_flight=2))
            store.add_endpoint(Endpoint("down", f"http://127.0.0.1:{down_port}/events"))
            assert store.enqueue_events(events, POLICY) == [True] * MESSAGES
            assert store.counts()["pending"] == 3 * MESSAGES
        first, second = dispatcher(queue, "first"), dispatcher(queue, "second")
        down = None
        try:
            wait_until(lambda: len(inbox(healthy.inbox)[0]) >= MESSAGES // 3,
                       "the healthy receiver applied a third", WAIT_S)
            first.send_signal(signal.SIGKILL)  # mid-run: leases held, sends on the wire
            assert first.wait(timeout=30) == -signal.SIGKILL
            wait_until(lambda: down_attempts(queue) >= 5, "attempts at the down endpoint",
                       WAIT_S)
            down = ReceiverProcess(tmp_path / "down.db", "--port", str(down_port))
            wait_until(lambda: statuses(queue)["done"] == 3 * MESSAGES,
                       f"every delivery done: {statuses(queue)}", WAIT_S)
        finally:
            stop_process(first, signal.SIGKILL)
            out, err = stop_process(second)
            if down is not None:
                down.stop()
        assert "Traceback" not in err, err
        for receiver in (healthy, slow, down):
            assert receiver is not None
            applied, stock = inbox(receiver.inbox)
            assert applied == expected  # every message, with its own quantity
            assert stock == sum(expected.values())  # each applied once
    assert statuses(queue) == {"pending": 0, "leased": 0, "done": 3 * MESSAGES, "dead": 0}
