"""The crash-after-ACK story with ordered keys, across real processes: a
dispatcher (asyncworker's Dispatcher, tests/support/child.py) is killed right after
the receiver committed the head of a key; the second dispatcher resends that
head (a duplicate, absorbed by the receiver's inbox) before anything behind
it. The receiver here is a real HTTP server on loopback that records the
order in which requests arrive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lease.postgres import PostgresStore
from lease.sqlite import SQLiteStore
from lease.store import Store

ROOT = Path(__file__).resolve().parents[2]


class Recorder(ThreadingHTTPServer):
    """Every request's id in the order it arrived; an inbox that applies each
    id once (committed before the answer), and the ACK naming the id."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.arrivals: list[str] = []
        self.applied: dict[str, int] = {}
        self.duplicates = 0


class _Handler(BaseHTTPRequestHandler):
    server: Recorder

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        event = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.arrivals.append(event["id"])
            if event["id"] in self.server.applied:
                self.server.duplicates += 1
            else:
                self.server.applied[event["id"]] = event["qty"]
        body = json.dumps({"id": event["id"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, name="recorder", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def dispatcher(spec: dict) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "tests/support/child.py", "dispatcher",
                           json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.returncode, done.stderr


@pytest.fixture(params=["sqlite", "postgresql"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Store]]:
    if request.param == "sqlite":
        target = str(tmp_path / "queue.db")
        store: Store = SQLiteStore(target, create=True)
    else:
        target = str(request.getfixturevalue("postgres_url"))
        store = PostgresStore(target, create=True)
    try:
        yield target, store
    finally:
        store.close()


def test_the_head_acked_before_a_crash_is_resent_before_anything_behind_it(queue, recorder):
    target, store = queue
    events = [{"id": f"cust-{n}", "qty": n, "key": "customer-7"} for n in (1, 2, 3)]
    assert store.enqueue_events(events) == [True] * 3
    url = f"http://127.0.0.1:{recorder.server_address[1]}/events"

    code, err = dispatcher({"path": target, "owner": "dispatcher-1", "url": url,
                            "lease_ms": 500, "die_after_acks": 1})
    assert code == 73, err  # killed after the receiver committed the head's ACK
    assert recorder.arrivals == ["cust-1"]
    assert [row["id"] for row in store.jobs_with_status("leased")] == ["cust-1"]

    code, err = dispatcher({"path": target, "owner": "dispatcher-2", "url": url,
                            "lease_ms": 500})
    assert code == 0, err
    # the head again (its lease ran out unrecorded), absorbed, then the rest in order
    assert recorder.arrivals == ["cust-1", "cust-1", "cust-2", "cust-3"]
    assert recorder.duplicates == 1 and recorder.applied == {"cust-1": 1, "cust-2": 2,
                                                             "cust-3": 3}
    assert store.counts()["done"] == 3
    history = store.job_history("cust-1")
    assert history is not None and history["job"]["token"] == 2
    assert history["job"]["ordering_key"] == "customer-7"
