"""The SQLite scenarios of ``asyncworker bench``: throughput and latency, each
figure beside its limit.

Every scenario runs in a fresh child process (``python -m
asyncworker.bench.sqlite SCENARIO JSON``), so its peak RSS is its own; the
parent (``asyncworker.bench.command``) prints one table measured in one run on
this machine. Nothing here is a test: the figures
are for reading, and the ratios say how close each path comes to the limit
it cannot pass (the storage's durable commit rate, the receiver's own rate,
or concurrency / latency).

Two measurements write SQL of their own, on purpose: the raw commit (the
storage's limit, which by definition does not go through the queue's API) and
the bulk load of finished rows behind the history figure. Everything else
uses the public API.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncworker import eventloop
from asyncworker.bench.measure import (
    cpu_s,
    percentiles,
    receiver_apart,
    redrive_dead_letters,
    rss_mb,
)
from lease import worker
from lease.clock import wall_clock_ms


def _fill(path: Path, n: int) -> None:
    con = worker.open_queue(path)
    try:
        for start in range(0, n, 5000):
            events = [{"id": f"job-{i}", "qty": i % 1000 + 1}
                      for i in range(start, min(n, start + 5000))]
            worker.enqueue_many(con, events, wall_clock_ms(), 60_000, 3)
    finally:
        con.close()





# ----------------------------------------------------------------- scenarios


def scenario_commit(folder: Path, n: int) -> dict:
    """The storage's limit: durable commits/s with the queue's own settings, one
    row changed per commit, on a queue of n jobs (the size the loops below run on:
    a commit on a bigger file costs a little more)."""
    path = folder / "q.db"
    _fill(path, n)
    con = worker.open_queue(path)
    started, cpu = time.perf_counter(), cpu_s()
    for i in range(n):
        con.execute("BEGIN IMMEDIATE")
        con.execute("UPDATE jobs SET qty = 1001 - qty WHERE seq = ?", (i + 1,))  # a real change
        con.execute("COMMIT")
    elapsed, cpu = time.perf_counter() - started, cpu_s() - cpu
    con.close()
    return {"rate": n / elapsed, "commits_per_job": 1.0, "cpu_us": cpu / n * 1e6}


def scenario_sync(folder: Path, n: int) -> dict:
    """The sync run_once loop with an in-process send."""
    path = folder / "q.db"
    _fill(path, n)
    con = worker.open_queue(path)
    latencies = []
    started, cpu = time.perf_counter(), cpu_s()
    for _ in range(n):
        begun = time.perf_counter()
        result = worker.run_once(con, "bench", wall_clock_ms, lambda event: True, 0.5, 30_000)
        assert result is not None and result["status"] == "done"
        latencies.append(time.perf_counter() - begun)
    elapsed, cpu = time.perf_counter() - started, cpu_s() - cpu
    con.close()
    return {"rate": n / elapsed, "commits_per_job": 2.0, "cpu_us": cpu / n * 1e6,
            **percentiles(latencies)}


async def _dispatch(path: Path, *, url: str | None = None, send: Any = None,
                    concurrency: int, batch: int, lease_ms: int = 30_000) -> dict:
    from asyncworker.dispatcher import Dispatcher

    latencies: list[float] = []
    async with Dispatcher(path, "bench", url=url, send=send, concurrency=concurrency,
                          lease_ms=lease_ms, batch_size=batch, latencies=latencies,
                          poll_interval=0.01) as d:
        started, cpu = time.perf_counter(), cpu_s()
        stats = await d.run(until_idle=True)
        elapsed, cpu = time.perf_counter() - started, cpu_s() - cpu
    commits = stats.claim_calls + stats.finish_batches + stats.extended
    return {"rate": stats.ok / elapsed, "ok": stats.ok, "cpu_us": cpu / max(1, stats.ok) * 1e6,
            "commits_per_job": round(commits / max(1, stats.ok), 3),
            "peak_sending": stats.peak_sending, **percentiles(latencies)}


def scenario_async(folder: Path, n: int, concurrency: int, batch: int,
                   send_ms: float = 0.0) -> dict:
    """The async dispatcher with an in-process send (optionally taking send_ms)."""
    path = folder / "q.db"
    _fill(path, n)

    async def send(event: dict, token: int) -> bool:
        if send_ms:
            await asyncio.sleep(send_ms / 1000)
        return True

    return eventloop.run(_dispatch(path, send=send, concurrency=concurrency, batch=batch))


def scenario_receiver_limit(folder: Path, n: int, concurrency: int, latency_ms: int,
                            group: int = 64, pin: bool = True) -> dict:
    """The receiver's own rate, from the cheapest client: the dispatcher's own
    HTTP client (``asyncworker.wire``) with no queue at all, C requests in
    flight, the same bytes and headers a dispatcher sends. A costlier client
    (aiohttp's) runs out of its own core first and measures itself, not the
    receiver (``python -m asyncworker.bench.cpu`` shows both)."""
    from asyncworker.wire import WireClient
    from lease.http import Destination, request_parts

    async def fire(url: str) -> list[float]:
        destination = Destination(url)
        latencies: list[float] = []
        next_i = iter(range(n))
        async with WireClient(limit=concurrency) as client:
            async def worker() -> None:
                for i in next_i:
                    outgoing = request_parts({"id": f"r-{i}", "qty": 1}, i + 1, None)
                    begun = time.perf_counter()
                    status, _, _ = await client.post(destination, outgoing, 30.0)
                    latencies.append(time.perf_counter() - begun)
                    if status != 200:
                        raise RuntimeError(f"the receiver answered {status}")

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies

    with receiver_apart(folder, latency_ms, group=group, pin=pin) as receiver:
        started, cpu = time.perf_counter(), cpu_s()
        latencies = eventloop.run(fire(receiver.url))
        elapsed, cpu = time.perf_counter() - started, cpu_s() - cpu
        where = receiver.placement()
    return {"rate": n / elapsed, "cpu_us": cpu / n * 1e6, "placement": where,
            **percentiles(latencies)}


def scenario_receiver(folder: Path, n: int, concurrency: int, latency_ms: int,
                      pin: bool = True) -> dict:
    """The async dispatcher against the receiver process on loopback."""
    path = folder / "q.db"
    _fill(path, n)
    with receiver_apart(folder, latency_ms, pin=pin) as receiver:
        result = eventloop.run(_dispatch(path, url=receiver.url, concurrency=concurrency,
                                         batch=64))
        result["placement"] = receiver.placement()
    return result


def scenario_history(folder: Path, finished: int, probes: int, waiting: int = 0) -> dict:
    """claim + finish latency with `finished` done rows behind the live ones, and
    `waiting` pending rows queued after them."""
    path = folder / "q.db"
    worker.open_queue(path).close()
    raw = sqlite3.connect(path)
    raw.execute("BEGIN")
    raw.executemany(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline, owner, lease_until, reason) VALUES (?, 1, 'done', 1, 3, 1, 0, 1, NULL,"
        " NULL, NULL)", ((f"old-{i}",) for i in range(finished)))
    raw.execute("COMMIT")
    raw.close()
    con = worker.open_queue(path)
    worker.enqueue_many(con, [{"id": f"live-{i}", "qty": 1} for i in range(probes)],
                        wall_clock_ms(), 60_000)
    for start in range(0, waiting, 5000):
        worker.enqueue_many(con, [{"id": f"wait-{i}", "qty": 1}
                                  for i in range(start, min(waiting, start + 5000))],
                            wall_clock_ms(), 60_000)
    claims, finishes = [], []
    for _ in range(probes):
        begun = time.perf_counter()
        ticket = worker.claim(con, "bench", wall_clock_ms(), 30_000)
        claims.append(time.perf_counter() - begun)
        assert ticket is not None
        begun = time.perf_counter()
        worker.finish(con, ticket, "ok", wall_clock_ms())
        finishes.append(time.perf_counter() - begun)
    con.close()
    return {"claim_ms": round(statistics.median(claims) * 1000, 3),
            "finish_ms": round(statistics.median(finishes) * 1000, 3)}


def scenario_redrive(folder: Path, n: int) -> dict:
    """A bulk redrive of n dead jobs on a SQLite file (``redrive_dead_letters``)."""
    from lease.stores import open_store

    with open_store(folder / "q.db", create=True) as store:
        return redrive_dead_letters(store, n)


def scenario_peer(folder: Path, n: int, peer: str) -> dict:
    """A peer queue doing the same work: enqueue n, then consume each with an ack."""
    started = time.perf_counter()
    if peer == "huey":
        from huey import SqliteHuey

        huey = SqliteHuey("bench", filename=str(folder / "huey.db"), results=False)

        @huey.task()
        def job(i: int) -> int:
            return i

        for i in range(n):
            job(i)
        consumed = 0
        while (task := huey.dequeue()) is not None:
            huey.execute(task)
            consumed += 1
    elif peer == "persist-queue":
        from persistqueue import SQLiteAckQueue

        queue = SQLiteAckQueue(str(folder / "pq"), auto_commit=True, multithreading=False)
        for i in range(n):
            queue.put({"id": f"job-{i}", "qty": 1})
        consumed = 0
        while queue.size:
            queue.ack(queue.get(block=False))
            consumed += 1
    elif peer == "litequeue":
        from litequeue import LiteQueue

        queue = LiteQueue(str(folder / "lq.db"))
        for i in range(n):
            queue.put(json.dumps({"id": f"job-{i}", "qty": 1}))
        consumed = 0
        while (message := queue.pop()) is not None:  # pop is chosen at run time
            queue.done(message.message_id)
            consumed += 1
    else:
        raise ValueError(f"unknown peer {peer!r}")
    elapsed = time.perf_counter() - started
    assert consumed == n, (peer, consumed)
    return {"rate": n / elapsed, "note": "enqueue + consume with ack"}


def scenario_ours_end_to_end(folder: Path, n: int, bulk: bool) -> dict:
    """Ours doing the peers' work: enqueue n (one durable commit each, or one
    enqueue_many), then the async dispatcher until every job is done."""
    path = folder / "q.db"
    started = time.perf_counter()
    con = worker.open_queue(path)
    events = [{"id": f"job-{i}", "qty": 1} for i in range(n)]
    if bulk:
        worker.enqueue_many(con, events, wall_clock_ms(), 60_000)
    else:
        for event in events:
            worker.enqueue(con, event, wall_clock_ms(), 60_000)
    con.close()

    async def send(event: dict, token: int) -> bool:
        return True

    result = eventloop.run(_dispatch(path, send=send, concurrency=64, batch=64))
    return {"rate": n / (time.perf_counter() - started), "commits_per_job": None,
            "note": f"dispatch alone {result['rate']:.0f}/s"}


SCENARIOS: dict[str, Callable[..., dict]] = {
    "commit": scenario_commit,
    "sync": scenario_sync,
    "async": scenario_async,
    "receiver_limit": scenario_receiver_limit,
    "receiver": scenario_receiver,
    "history": scenario_history,
    "redrive": scenario_redrive,
    "peer": scenario_peer,
    "ours_end_to_end": scenario_ours_end_to_end,
}


def run_child(name: str, params: dict) -> dict:
    """Run one scenario in a fresh process; return its figures plus its peak RSS."""
    out = subprocess.run([sys.executable, "-m", "asyncworker.bench.sqlite", name,
                          json.dumps(params)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"scenario {name} {params} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def child_main(name: str, params_json: str) -> None:
    # every scenario, a peer's too, in a process set up as asyncworker run's
    eventloop.tune_gc()
    folder = Path(tempfile.mkdtemp(prefix="asyncworker-bench-"))
    try:
        result = SCENARIOS[name](folder, **json.loads(params_json))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["rss_mb"] = round(rss_mb(), 1)
    print(json.dumps(result))




if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
