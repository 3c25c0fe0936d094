"""Payloads through a crash: enqueued, sent by a dispatcher process that is
SIGKILLed mid-run, recovered by a second one. The receiver sees every body
exactly as enqueued (byte for byte its canonical text) and applies each
once, absorbing the resends of the jobs the dead process never finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from lease import worker
from lease.http import ID_HEADER
from lease.policy import DEFAULT_POLICY, canonical_body
from lease.sqlite import enqueue_events, open_store, reads
from tests.support.dispatching import CHILD, child_result

KILL_AT = 30  # the receiver kills the first dispatcher when this request arrives


def bodies(n: int) -> dict[str, dict]:
    """Bodies that a careless round trip would change: key order, non-ASCII,
    escapes, floats, nesting, an empty object, one near the 64 KiB cap."""
    made: dict[str, dict] = {}
    for i in range(n):
        made[f"order:{i}/tenant-{i % 3}"] = {
            "z": i, "a": [1.5, -0.0, 10**20, None, True], "text": f"Grüße {i} \u2603 \"q\" \\ \n",
            "nested": {"b": {"c": [{}] * (i % 4)}}, "emoji": "\U0001f600",
        }
    made["empty"] = {}
    made["big"] = {"blob": "é" * 32_000}  # 64,000 bytes of UTF-8
    return made


class DedupingReceiver(BaseHTTPRequestHandler):
    """Applies each job once (by its webhook-id), keeps the raw body it applied;
    at request KILL_AT it SIGKILLs the dispatcher before answering."""

    server: ThreadingHTTPServer

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        state: ReceiverState = self.server.state  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        job_id = self.headers[ID_HEADER]
        with state.lock:
            state.requests += 1
            if job_id in state.applied:
                state.duplicates += 1
            else:
                state.applied[job_id] = body
            kill = state.requests == KILL_AT and state.victim is not None
        if kill:
            assert state.victim is not None
            os.kill(state.victim, signal.SIGKILL)  # applied, never acknowledged
            state.killed.set()
            return
        answer = json.dumps({"id": job_id}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class ReceiverState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.duplicates = 0
        self.applied: dict[str, bytes] = {}
        self.victim: int | None = None
        self.killed = threading.Event()


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a connection of the killed process, broken mid-answer


def spawn(spec: dict, state: ReceiverState | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, CHILD, "dispatcher", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if state is not None:
        state.victim = proc.pid  # known before the child can send anything
    return proc


def test_payloads_survive_a_sigkill_and_are_applied_once(queue_path: Path):
    sent = bodies(120)
    con = open_store(queue_path)
    try:
        events = [{"id": job_id, "body": body} for job_id, body in sent.items()]
        assert enqueue_events(con, events, int(time.time() * 1000), DEFAULT_POLICY) == [
            True] * len(sent)
    finally:
        con.close()
    state = ReceiverState()
    server = QuietServer(("127.0.0.1", 0), DedupingReceiver)
    server.state = state  # type: ignore[attr-defined]
    serving = threading.Thread(target=server.serve_forever, name="receiver")
    serving.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/events"
    try:
        first = spawn({"path": str(queue_path), "owner": "dispatcher-1", "url": url,
                       "lease_ms": 1000, "concurrency": 8}, state)
        code, _ = child_result(first)
        assert code == -signal.SIGKILL and state.killed.is_set()
        # A writer's open: the process may have died inside a transaction, and
        # only a writer rolls its hot journal back (a reader is refused).
        con = worker.open_queue(queue_path)
        try:
            mid = reads.counts(con)
        finally:
            con.close()
        assert mid["leased"] >= 1 and mid["done"] < len(sent)  # killed with sends in flight
        second = spawn({"path": str(queue_path), "owner": "dispatcher-2", "url": url,
                        "lease_ms": 1000, "concurrency": 8})
        code, stats = child_result(second)
        assert code == 0 and stats is not None and stats["ok"] == len(sent) - mid["done"]
    finally:
        server.shutdown()
        server.server_close()
        serving.join()
    assert set(state.applied) == set(sent) and state.duplicates >= 1
    for job_id, body in sent.items():
        text = canonical_body(body)[0]
        assert state.applied[job_id] == text.encode()  # byte for byte
        assert json.loads(state.applied[job_id]) == body
    con = reads.open_readonly(queue_path)
    try:
        assert reads.counts(con) == {"pending": 0, "leased": 0, "done": len(sent), "dead": 0}
        stored = {row["id"]: row["body"] for row in reads.jobs_with_status(con, "done")}
    finally:
        con.close()
    assert stored == {job_id: canonical_body(body)[0] for job_id, body in sent.items()}
