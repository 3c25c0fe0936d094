"""The chaos soak: three dispatcher processes, a faulty receiver, random SIGKILLs
and restarts, until every job is done or dead; then every request is accounted for.

Short by default (1,000 jobs, a few seconds); longer with ``--soak-jobs``:
    python -m pytest -m soak -s --soak-jobs 20000
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lease import worker
from lease.sqlite import reads
from tests.support.servers import ReceiverProcess

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

DISPATCHERS = 3


def start_receiver(inbox: Path, port: int, seed: int) -> ReceiverProcess:
    return ReceiverProcess(inbox, "--port", str(port), "--latency-ms", "2", "--p-503", "0.05",
                           "--p-drop", "0.05", "--seed", str(seed))


def start_dispatcher(queue: Path, url: str, name: str) -> subprocess.Popen:
    with (queue.parent / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "asyncworker", "run", str(queue), "--url", url, "--owner",
             name, "--concurrency", "8", "--lease-ms", "800", "--poll-ms", "10",
             # the lab's backoff (100 ms to 1 s): many retries in a short soak
             "--backoff-base-ms", "100", "--backoff-cap-ms", "1000", "--jitter", "1"],
            stdout=subprocess.DEVNULL, stderr=log)


def wait_until_ready(queue: Path, name: str) -> None:
    """The banner is printed once a signal means a graceful stop."""
    log = queue.parent / f"{name}.log"
    deadline = time.monotonic() + 60
    while "run: owner" not in log.read_text():
        assert time.monotonic() < deadline, f"{name} never became ready"
        time.sleep(0.01)


def unfinished(queue: Path) -> int:
    con = reads.open_readonly(queue)  # looks without a write: never waits on the dispatchers
    try:
        counts = reads.counts(con)
    finally:
        con.close()
    return counts["pending"] + counts["leased"]


def test_chaos_soak(tmp_path: Path, request: pytest.FixtureRequest):
    jobs = request.config.getoption("--soak-jobs")
    rng = random.Random(request.config.getoption("--soak-seed"))
    queue, inbox = tmp_path / "queue.db", tmp_path / "inbox.db"
    orders = {f"s-{i}": rng.randint(1, 50) for i in range(jobs)}
    con = worker.open_queue(queue)
    worker.enqueue_many(con, [{"id": i, "qty": q} for i, q in orders.items()],
                        int(time.time() * 1000), 60_000, 16)
    con.close()

    receiver = start_receiver(inbox, 0, rng.randrange(10**6))
    lifetimes: list[dict] = []
    names = [f"d{n}-0" for n in range(DISPATCHERS)]
    procs = [start_dispatcher(queue, receiver.url, name) for name in names]
    faults = {"dispatcher SIGKILLs": 0, "receiver restarts": 0}
    give_up = time.monotonic() + 600
    try:
        while unfinished(queue):
            assert time.monotonic() < give_up, "the soak did not converge"
            time.sleep(rng.uniform(0.1, 0.4))
            roll = rng.random()
            if roll < 0.6:
                n = rng.randrange(DISPATCHERS)
                procs[n].send_signal(signal.SIGKILL)
                procs[n].wait()
                generation = int(names[n].split("-")[1]) + 1
                names[n] = f"d{n}-{generation}"
                procs[n] = start_dispatcher(queue, receiver.url, names[n])
                faults["dispatcher SIGKILLs"] += 1
            elif roll < 0.8:
                lifetimes.append(receiver.final_counters())
                receiver = start_receiver(inbox, receiver.port, rng.randrange(10**6))
                faults["receiver restarts"] += 1
        for name in names:  # one restarted just now may still be starting up
            wait_until_ready(queue, name)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        # 0, or 3 when jobs went dead in that dispatcher's run (checked below)
        exits = [proc.wait(timeout=60) for proc in procs]
        assert set(exits) <= {0, 3}, exits
        lifetimes.append(receiver.final_counters())
    finally:
        for proc in [*procs, receiver.proc]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    con = sqlite3.connect(queue)
    final = {r[0]: (r[1], r[2], r[3]) for r in
             con.execute("SELECT id, status, reason, qty FROM jobs")}
    con.close()
    con = sqlite3.connect(inbox)
    applied = dict(con.execute("SELECT id, qty FROM inbox").fetchall())
    seen = con.execute("SELECT COALESCE(SUM(seen), 0) FROM inbox").fetchone()[0]
    stock = con.execute("SELECT stock FROM effect").fetchone()[0]
    con.close()

    # The inbox's figures are durable: the last lifetime's are the soak's. The
    # process_* ones start at 0 in each lifetime: they add up.
    inbox_figures = lifetimes[-1]
    total = {k: sum(life[k] for life in lifetimes) for k in lifetimes[0]
             if k.startswith("process_")}
    done = {i for i, (status, _, _) in final.items() if status == "done"}
    dead = {i: reason for i, (status, reason, _) in final.items() if status == "dead"}
    lost = sorted(done - set(applied))
    report = {**faults, "jobs": jobs, "done": len(done), "dead": len(dead),
              "requests": total["process_requests"], "applied": inbox_figures["applied"],
              "duplicates absorbed": inbox_figures["duplicates"],
              "stale senders": inbox_figures["stale_senders"],
              "injected 503": total["process_injected_503"],
              "dropped after commit": total["process_dropped_after_commit"], "lost": len(lost)}
    print("\nchaos soak:", json.dumps(report))

    assert set(final) == set(orders), "a job was lost or invented"
    assert 3 not in exits or dead, "a dispatcher said jobs went dead, and none did"
    assert all(status in ("done", "dead") for status, _, _ in final.values())
    assert all(reason in ("exhausted", "deadline", "permanent") for reason in dead.values())
    assert lost == [], "a done job whose effect is not in the inbox"
    assert set(applied) <= set(orders)
    assert all(applied[i] == orders[i] for i in applied), "an effect with another quantity"
    assert stock == sum(applied.values())
    assert (inbox_figures["applied"], inbox_figures["stock"]) == (len(applied), stock)
    assert inbox_figures["applied"] + inbox_figures["duplicates"] == seen
    refused = (inbox_figures["conflicts"] + inbox_figures["stale_senders"]
               + total["process_rejected"] + total["process_too_large"]
               + total["process_timed_out"] + total["process_incomplete"]
               + total["process_injected_503"]
               + total["process_unavailable"])
    assert total["process_requests"] == (
        inbox_figures["applied"] + inbox_figures["duplicates"] + refused)
    assert faults["dispatcher SIGKILLs"] + faults["receiver restarts"] >= 1
