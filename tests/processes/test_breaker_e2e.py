"""Three dispatcher processes share one endpoint's breaker (store state):
while its circuit is open none of them sends to it, but for one probe at a
time; back up, every delivery reaches it once. The receiver is a real HTTP
server in this process that answers 503 while "down" and counts each request.

The breaker's own cool-down (5 s, doubled after a failed probe) is waited
out, not injected: the test waits for conditions (the circuit open, the
first probe refused, every delivery done), about 15 s in all."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from lease.breaker import BREAKER
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.sqlite import SQLiteStore
from tests.support.servers import stop_process
from tests.support.waiting import wait_until

MESSAGES = 60
POLICY = RetryPolicy(max_attempts=100, backoff_base_ms=50, backoff_cap_ms=400,
                     ttl_ms=600_000)
WAIT_S = 60.0
CONCURRENCY = 1  # each process: one send, and a claim of at most three (its line)


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.down = True
        self.refused: list[float] = []  # when each request answered 503 came (wall clock ms)
        self.applied: dict[str, int] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/events"


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        server = self.server
        with server.lock:
            if server.down:
                server.refused.append(time.time() * 1000)
                body, status = b"down", 503
            else:
                event_id = self.headers["webhook-id"]
                server.applied[event_id] = server.applied.get(event_id, 0) + 1
                body, status = json.dumps({"id": event_id}).encode(), 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def dispatcher(queue: Path, owner: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncworker", "run", str(queue), "--owner", owner,
         "--concurrency", str(CONCURRENCY), "--lease-ms", "5000", "--backoff-base-ms", "50",
         "--backoff-cap-ms", "400", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def breaker_rows(queue: Path) -> list[dict]:
    with SQLiteStore(queue, read_only=True) as store:
        return [row for row in store.endpoint_audit("flaky") if row["actor"] == "breaker"]


def done(queue: Path) -> int:
    with SQLiteStore(queue, read_only=True) as store:
        return store.counts()["done"]


def test_three_dispatchers_share_one_breaker_one_probe_at_a_time(tmp_path):
    queue = tmp_path / "queue.db"
    rx = Receiver()
    serving = threading.Thread(target=rx.serve_forever, daemon=True)
    serving.start()
    procs: list[subprocess.Popen] = []
    try:
        with SQLiteStore(queue, create=True, journal="wal") as store:
            store.add_endpoint(Endpoint("flaky", rx.url))
            events = [{"id": f"m-{n}", "qty": 1} for n in range(MESSAGES)]
            assert store.enqueue_events(events, POLICY) == [True] * MESSAGES
        procs = [dispatcher(queue, f"d{n}") for n in range(3)]
        wait_until(lambda: [row["action"] for row in breaker_rows(queue)][:1] == ["opened"],
                   "the circuit opened", WAIT_S)
        opened_ms = breaker_rows(queue)[0]["at_ms"]
        wait_until(lambda: "reopened" in [row["action"] for row in breaker_rows(queue)],
                   "the first probe refused", WAIT_S)
        with rx.lock:
            rx.down = False
            refused = list(rx.refused)
        wait_until(lambda: done(queue) == MESSAGES, "every delivery done", WAIT_S)
    finally:
        outputs = [stop_process(proc, signal.SIGTERM) for proc in procs]
        rx.shutdown()
        rx.server_close()
    for _, err in outputs:
        assert "Traceback" not in err, err
    # Before it opened: the threshold's failures and the sends already on their way
    # (each process: one in flight and at most two claimed behind it). After: nothing
    # but the probe, one (the second probe went through once it was back).
    in_flight_at_open = 3 * (CONCURRENCY + 2)
    assert len(refused) <= BREAKER.open_after + in_flight_at_open + 1, len(refused)
    after = [at for at in refused if at > opened_ms + 1000]
    assert len(after) == 1, (len(refused), after, opened_ms)  # one probe, by one process
    assert rx.applied == {f"m-{n}": 1 for n in range(MESSAGES)}
    actions = [row["action"] for row in breaker_rows(queue)]
    assert actions == ["opened", "reopened", "closed"], actions
    # each process logged each change at most once, whichever process's finish made it
    for _, err in outputs:
        assert sum("circuit opened:" in line for line in err.splitlines()) <= 1
        assert sum("circuit closed" in line for line in err.splitlines()) <= 1
    print(f"\nthree dispatchers: {len(refused)} requests while down "
          f"({len(after)} after the circuit opened), "
          f"log lines per process: {[len(err.splitlines()) for _, err in outputs]}")
    with contextlib.suppress(Exception):
        serving.join(timeout=5)
