"""The chaos soak on PostgreSQL: three dispatcher processes SIGKILLed and
restarted at random, the server restarted in immediate mode (no checkpoint:
WAL replayed, as after a crash) at random moments, the receiver restarted
and dropping answers after its commit, lab events and payloads fed all the
while; then every job is done or dead with a reason, every done job's
effect is applied exactly once, no stale completion was accepted, and every
request is accounted for.

Short by default (about 25 s of chaos); longer with ``--soak-seconds``:
    python -m pytest -m soak -s tests/soak/test_soak_postgres.py --soak-seconds 600

A dispatcher started while the server is down cannot open its queue and
exits 1 before it says it runs (``asyncworker run``'s refusal of a store it
cannot reach): the soak's supervisor starts it again, as systemd would, and
counts it. A dispatcher that exits on its own once running fails the soak.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from asyncworker.devtools.postgres_server import PostgresServer
from lease.policy import RetryPolicy
from lease.stores import open_store
from lease.worker import StoreError
from tests.support.servers import ReceiverProcess

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

T = TypeVar("T")
DISPATCHERS = 3
SHORT_SOAK_S = 25.0
BACKLOG = 400  # fed while fewer jobs than this are unfinished
BATCH = 60
MAX_ATTEMPTS = 16
TTL_MS = 600_000
BANNER = "run: owner"
CONVERGE_S = 300
POLICY = RetryPolicy(max_attempts=MAX_ATTEMPTS, ttl_ms=TTL_MS)


def soak_seconds(request: pytest.FixtureRequest) -> float:
    """--soak-seconds when the suite defines it, else the short run."""
    given = request.config.getoption("--soak-seconds", default=None)
    return float(given) if given else SHORT_SOAK_S


def patiently(fn: Callable[[], T], what: str, timeout_s: float = 60) -> T:
    """fn(), again while the server is coming back (in recovery, refusing)."""
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except StoreError as exc:
            assert time.monotonic() < give_up, f"{what}: the server never came back: {exc}"
            time.sleep(0.1)


class Host:
    """One dispatcher process and its log."""

    def __init__(self, folder: Path, slot: int, generation: int, queue: str, url: str) -> None:
        self.name = f"d{slot}-{generation}"
        self.log = folder / f"{self.name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncworker", "run", queue, "--url", url, "--owner",
                 self.name, "--concurrency", "8", "--lease-ms", "800", "--poll-ms", "10",
                 # the lab's backoff (100 ms to 1 s): many retries in a short soak
                 "--backoff-base-ms", "100", "--backoff-cap-ms", "1000", "--jitter", "1"],
                stdout=subprocess.DEVNULL, stderr=log)

    @property
    def ready(self) -> bool:
        return BANNER in self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Soak:
    def __init__(self, folder: Path, server: PostgresServer, rng: random.Random) -> None:
        self.folder = folder
        self.server = server
        self.rng = rng
        self.inbox = folder / "inbox.db"
        self.orders: dict[str, dict] = {}  # id -> the event enqueued
        self.faults = {"dispatcher SIGKILLs": 0, "server immediate restarts": 0,
                       "receiver restarts": 0, "starts refused while the server was down": 0}
        self.lifetimes: list[dict] = []
        patiently(lambda: open_store(server.url, create=True).close(), "init")
        self.receiver = self._receiver(0)
        self.generations = [0] * DISPATCHERS
        self.hosts = [self._host(n) for n in range(DISPATCHERS)]

    def _receiver(self, port: int) -> ReceiverProcess:
        return ReceiverProcess(self.inbox, "--port", str(port), "--latency-ms", "2",
                               "--p-503", "0.05", "--p-drop", "0.05",
                               "--seed", str(self.rng.randrange(10**6)))

    def _host(self, slot: int) -> Host:
        self.generations[slot] += 1
        return Host(self.folder, slot, self.generations[slot], self.server.url,
                    self.receiver.url)

    # -- the queue

    def feed(self) -> None:
        """BATCH new jobs, every other one a payload; an enqueue whose COMMIT
        a restart cut is simply tried again (the retry sees duplicates)."""
        start = len(self.orders)
        events = []
        for i in range(start, start + BATCH):
            if i % 2:
                events.append({"id": f"p-{i}", "body": {"order": i, "sku": "tea",
                                                        "note": "caf\u00e9 \u2603"}})
            else:
                events.append({"id": f"s-{i}", "qty": self.rng.randint(1, 50)})

        def enqueue() -> list:
            with open_store(self.server.url) as store:
                return store.enqueue_events(events, POLICY)

        results = patiently(enqueue, "enqueue")
        assert all(result in (True, False) for result in results), results
        self.orders.update((event["id"], event) for event in events)

    def unfinished(self) -> int:
        def count() -> int:
            with open_store(self.server.url, read_only=True) as store:
                counts = store.counts()
            return counts["pending"] + counts["leased"]

        return patiently(count, "counts")

    # -- the faults

    def supervise(self) -> None:
        """A dispatcher that exited on its own: refused at its start while the
        server was down (started again), or a failure of the soak."""
        for slot, host in enumerate(self.hosts):
            if host.proc.poll() is None:
                continue
            text = host.log.read_text()
            assert host.proc.returncode == 1 and BANNER not in text, \
                f"{host.name} died while running (exit {host.proc.returncode}):\n{text[-3000:]}"
            assert "Traceback" not in text, text[-3000:]
            self.faults["starts refused while the server was down"] += 1
            self.hosts[slot] = self._host(slot)

    def strike(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            slot = self.rng.randrange(DISPATCHERS)
            self.hosts[slot].kill()
            self.hosts[slot] = self._host(slot)
            self.faults["dispatcher SIGKILLs"] += 1
        elif roll < 0.7:
            self.server.stop("immediate")
            time.sleep(self.rng.uniform(0, 0.5))  # down a while: the dispatchers meet it
            self.server.start()
            self.faults["server immediate restarts"] += 1
        elif roll < 0.85:
            self.lifetimes.append(self.receiver.final_counters())
            self.receiver = self._receiver(self.receiver.port)
            self.faults["receiver restarts"] += 1

    def run(self, seconds: float) -> None:
        chaos_ends = time.monotonic() + seconds
        while time.monotonic() < chaos_ends:
            if self.unfinished() < BACKLOG:
                self.feed()
            time.sleep(self.rng.uniform(0.1, 0.4))
            self.supervise()
            self.strike()
        give_up = time.monotonic() + CONVERGE_S
        while self.unfinished():
            assert time.monotonic() < give_up, "the soak did not converge"
            self.supervise()
            time.sleep(0.1)

    def stop(self) -> list[int]:
        # One started in the last strikes may still be starting up, or may have
        # been refused at its start by a server restart that came while it was
        # importing (a slow start on a loaded machine): started again, as in the
        # chaos, until every slot runs.
        give_up = time.monotonic() + 60
        while not all(host.ready for host in self.hosts):
            assert time.monotonic() < give_up, \
                f"never all ready: {[h.name for h in self.hosts if not h.ready]}"
            self.supervise()
            time.sleep(0.01)
        for host in self.hosts:
            host.proc.send_signal(signal.SIGTERM)
        exits = [host.proc.wait(timeout=60) for host in self.hosts]
        self.lifetimes.append(self.receiver.final_counters())
        return exits

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        # stop() also reads and closes the receiver's pipes: left open, a failed
        # soak's pipes would be collected in a later test, as warnings of its own
        self.receiver.stop(signal.SIGKILL)


def test_chaos_soak_on_postgresql(make_postgres_server: Callable[..., PostgresServer],
                                  tmp_path: Path, request: pytest.FixtureRequest):
    server = make_postgres_server()
    seconds = soak_seconds(request)
    soak = Soak(tmp_path, server, random.Random(request.config.getoption("--soak-seed")))
    started = time.monotonic()
    try:
        soak.feed()
        soak.run(seconds)
        exits = soak.stop()
    finally:
        soak.close()
    elapsed = time.monotonic() - started
    assert set(exits) <= {0, 3}, exits  # 3: jobs went dead in that dispatcher's run

    with open_store(server.url, read_only=True) as store:
        rows = {row["id"]: row for status in ("done", "dead", "pending", "leased")
                for row in store.jobs_with_status(status)}
        stale_tally = store.stale_finishes()
        histories = {job_id: store.job_history(job_id) for job_id in rows}
    con = sqlite3.connect(soak.inbox)
    inbox = {job_id: (qty, digest) for job_id, qty, digest in
             con.execute("SELECT id, qty, digest FROM inbox")}
    seen = con.execute("SELECT COALESCE(SUM(seen), 0) FROM inbox").fetchone()[0]
    stock = con.execute("SELECT stock FROM effect").fetchone()[0]
    con.close()

    lifetimes = soak.lifetimes
    figures = lifetimes[-1]  # the inbox's figures are durable: the last lifetime's are the soak's
    total = {k: sum(life[k] for life in lifetimes) for k in lifetimes[0]
             if k.startswith("process_")}
    done = {i for i, row in rows.items() if row["status"] == "done"}
    dead = {i: row["reason"] for i, row in rows.items() if row["status"] == "dead"}
    stale_rows = sum(1 for history in histories.values() if history is not None
                     for attempt in history["attempts"] if attempt["result"] == "stale")
    lost = sorted(done - set(inbox))
    report = {**soak.faults, "seconds": round(elapsed, 1), "jobs": len(soak.orders),
              "payloads": sum(1 for event in soak.orders.values() if "body" in event),
              "done": len(done), "dead": len(dead), "dead by reason": {
                  reason: list(dead.values()).count(reason) for reason in set(dead.values())},
              "jobs/s": round(len(done) / elapsed, 1),
              "requests": total["process_requests"], "applied": figures["applied"],
              "duplicates absorbed": figures["duplicates"],
              "stale senders": figures["stale_senders"],
              "stale finishes refused": stale_tally,
              "injected 503": total["process_injected_503"],
              "dropped after commit": total["process_dropped_after_commit"], "lost": len(lost)}
    print("\nchaos soak on PostgreSQL:", json.dumps(report))

    assert set(rows) == set(soak.orders), "a job was lost or invented"
    assert all(row["status"] in ("done", "dead") for row in rows.values())
    assert all(reason in ("exhausted", "deadline", "permanent") for reason in dead.values())
    assert 3 not in exits or dead, "a dispatcher said jobs went dead, and none did"
    # every done job's effect applied exactly once, with the content enqueued
    assert lost == [], "a done job whose effect is not in the inbox"
    assert set(inbox) <= set(soak.orders)
    for job_id, (qty, digest) in inbox.items():
        assert (qty, digest) == (rows[job_id]["qty"], rows[job_id]["digest"]), job_id
    assert stock == sum(qty for qty, _ in inbox.values())
    assert (figures["applied"], figures["stock"]) == (len(inbox), stock)
    assert figures["applied"] + figures["duplicates"] == seen
    # no stale completion accepted: each refusal is in its job's history, and a
    # done job was completed by its last lease (no attempt carries a later token)
    assert stale_tally == stale_rows
    for job_id in done:
        history = histories[job_id]
        assert history is not None
        assert all(attempt["token"] <= rows[job_id]["token"]
                   for attempt in history["attempts"]), job_id
        assert sum(1 for a in history["attempts"] if a["result"] == "done") == 1, job_id
    # every request accounted for
    refused = (figures["conflicts"] + figures["stale_senders"]
               + total["process_rejected"] + total["process_too_large"]
               + total["process_timed_out"] + total["process_incomplete"]
               + total["process_injected_503"] + total["process_unavailable"])
    assert total["process_requests"] == figures["applied"] + figures["duplicates"] + refused
    assert figures["conflicts"] == 0
    assert soak.faults["dispatcher SIGKILLs"] >= 1 and soak.faults["server immediate restarts"] >= 1


def test_the_soak_stops_with_a_host_refused_at_its_last_start(
        make_postgres_server: Callable[..., PostgresServer], tmp_path: Path):
    """The soak's own supervisor: a dispatcher started just before a server
    restart (its imports slow on a loaded machine) is refused at its start and
    exits 1; the stop after the chaos starts it again instead of failing."""
    server = make_postgres_server()
    soak = Soak(tmp_path, server, random.Random(7))
    try:
        give_up = time.monotonic() + 120
        while not all(host.ready for host in soak.hosts):
            assert time.monotonic() < give_up, "the dispatchers never became ready"
            time.sleep(0.01)
        server.stop("immediate")
        soak.hosts[0].kill()
        soak.hosts[0] = soak._host(0)  # started while the server is down: refused
        assert soak.hosts[0].proc.wait(timeout=120) == 1
        server.start()
        exits = soak.stop()
    finally:
        soak.close()
    assert exits == [0, 0, 0]
    assert soak.faults["starts refused while the server was down"] == 1
