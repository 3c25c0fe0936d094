"""``asyncworker bench``: throughput and latency, each figure beside its limit.

Every scenario runs in a fresh child process (``python -m asyncworker.bench
SCENARIO JSON``), so its peak RSS is its own; the parent prints one table
measured in one run on this machine. Nothing here is a test: the figures
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
import contextlib
import json
import os
import platform
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from asyncworker import eventloop
from lease import worker

# The durable commit and the sync loop, measured in this many alternating pairs.
SYNC_PAIRS = 3

# ----------------------------------------------------------------- helpers


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    ordered = sorted(latencies)
    return {"p50_ms": round(ordered[len(ordered) // 2] * 1000, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2)}


def _cpu_s() -> float:
    """This process's user + system CPU time, every thread of it. getrusage,
    not os.times: os.times counts in clock ticks (10 ms), and a short run's
    few milliseconds would read as nothing."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _now() -> int:
    return int(time.time() * 1000)


def _fill(path: Path, n: int) -> None:
    con = worker.open_queue(path)
    try:
        for start in range(0, n, 5000):
            events = [{"id": f"job-{i}", "qty": i % 1000 + 1}
                      for i in range(start, min(n, start + 5000))]
            worker.enqueue_many(con, events, _now(), 60_000, 3)
    finally:
        con.close()


def cpus_of(pid: int = 0) -> list[int]:
    """The CPUs process ``pid`` may run on (0: the calling thread), by Linux's
    ``sched_getaffinity``, as the benchmarks' placement is."""
    return sorted(os.sched_getaffinity(pid))


def split_cpus() -> Optional[tuple[frozenset[int], frozenset[int]]]:
    """This thread's CPUs in two halves by number, the receiver's and its
    clients'; None where there is nothing to split (one CPU). By number, not
    by physical core: where two numbers are one core's hyperthreads, the
    halves share cores.

    Left to the scheduler on two cores, a receiver and its client shared a
    core in some runs and not in others: the same plain client did
    7,100-11,900 requests a second against one receiver, run by run, in two
    clusters, and a ratio read whichever its pair drew. Apart, it did
    10,800-11,200 in eight runs out of eight."""
    cpus = cpus_of()
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


@contextlib.contextmanager
def on_cpus(cpus: Optional[frozenset[int]]) -> Iterator[None]:
    """Run this thread on ``cpus`` for the block, so that the processes and
    threads it starts there inherit them from their first instruction; None:
    as it was."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def placement(receiver_cpus: Sequence[int], client_cpus: Sequence[int]) -> str:
    """Where a run found the receiver and its clients, for a table's header."""
    receiver, clients = (",".join(map(str, sorted(cpus))) for cpus in (receiver_cpus,
                                                                       client_cpus))
    if set(receiver_cpus) & set(client_cpus):
        return f"the receiver on CPU {receiver} and its clients on CPU {clients}, shared"
    return f"the receiver on CPU {receiver}, its clients on CPU {clients}"


def placements(rows: list[dict]) -> str:
    """The placements the rows against a receiver report, each once."""
    seen = dict.fromkeys(placement(*row["placement"]) for row in rows if "placement" in row)
    return "; ".join(seen) or "no receiver"


class Receiver:
    """``asyncworker serve`` on loopback, its own process, on ``cpus`` (None:
    wherever the scheduler puts it)."""

    def __init__(self, folder: Path, latency_ms: int, *, group: int = 64, loop: str = "auto",
                 cpus: Optional[frozenset[int]] = None) -> None:
        with on_cpus(cpus):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncworker", "serve", "--inbox",
                 str(folder / "inbox.db"), "--latency-ms", str(latency_ms), "--group",
                 str(group), "--loop", loop], stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.close()
            raise RuntimeError("the receiver did not start")

    def cpus(self) -> list[int]:
        """The CPUs the receiver's process may run on, as it reports them."""
        return cpus_of(self.proc.pid)

    def placement(self) -> list[list[int]]:
        """[its CPUs, the calling thread's]: where a client started from this
        thread runs against it, as a table's header reports it."""
        return [self.cpus(), cpus_of()]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def receiver_apart(folder: Path, latency_ms: int, *, group: int = 64, loop: str = "auto",
                   pin: bool = True) -> Iterator[Receiver]:
    """A receiver on one half of the CPUs, and this thread on the other half
    while it serves, so that every client it starts runs there
    (``split_cpus``); ``pin`` False: both left to the scheduler."""
    receiver_cpus, client_cpus = (split_cpus() if pin else None) or (None, None)
    with Receiver(folder, latency_ms, group=group, loop=loop, cpus=receiver_cpus) as receiver, \
            on_cpus(client_cpus):
        yield receiver


# ----------------------------------------------------------------- scenarios


def scenario_commit(folder: Path, n: int) -> dict:
    """The storage's limit: durable commits/s with the queue's own settings, one
    row changed per commit, on a queue of n jobs (the size the loops below run on:
    a commit on a bigger file costs a little more)."""
    path = folder / "q.db"
    _fill(path, n)
    con = worker.open_queue(path)
    started, cpu = time.perf_counter(), _cpu_s()
    for i in range(n):
        con.execute("BEGIN IMMEDIATE")
        con.execute("UPDATE jobs SET qty = 1001 - qty WHERE seq = ?", (i + 1,))  # a real change
        con.execute("COMMIT")
    elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
    con.close()
    return {"rate": n / elapsed, "commits_per_job": 1.0, "cpu_us": cpu / n * 1e6}


def scenario_sync(folder: Path, n: int) -> dict:
    """The sync run_once loop with an in-process send."""
    path = folder / "q.db"
    _fill(path, n)
    con = worker.open_queue(path)
    latencies = []
    started, cpu = time.perf_counter(), _cpu_s()
    for _ in range(n):
        begun = time.perf_counter()
        result = worker.run_once(con, "bench", _now, lambda event: True, 0.5, 30_000)
        assert result is not None and result["status"] == "done"
        latencies.append(time.perf_counter() - begun)
    elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
    con.close()
    return {"rate": n / elapsed, "commits_per_job": 2.0, "cpu_us": cpu / n * 1e6,
            **_percentiles(latencies)}


async def _dispatch(path: Path, *, url: Optional[str] = None, send: Any = None,
                    concurrency: int, batch: int, lease_ms: int = 30_000) -> dict:
    from asyncworker.dispatcher import Dispatcher

    latencies: list[float] = []
    async with Dispatcher(path, "bench", url=url, send=send, concurrency=concurrency,
                          lease_ms=lease_ms, batch_size=batch, latencies=latencies,
                          poll_interval=0.01) as d:
        started, cpu = time.perf_counter(), _cpu_s()
        stats = await d.run(until_idle=True)
        elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
    commits = stats.claim_calls + stats.finish_batches + stats.extended
    return {"rate": stats.ok / elapsed, "ok": stats.ok, "cpu_us": cpu / max(1, stats.ok) * 1e6,
            "commits_per_job": round(commits / max(1, stats.ok), 3),
            "peak_sending": stats.peak_sending, **_percentiles(latencies)}


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
    """The receiver's own rate, from a plain concurrent client (no queue at all)."""
    from asyncworker.sender import new_session, send_http

    async def fire(url: str) -> list[float]:
        gate = asyncio.Semaphore(concurrency)
        latencies: list[float] = []
        async with new_session(limit=concurrency) as session:
            async def one(i: int) -> None:
                async with gate:
                    begun = time.perf_counter()
                    await send_http(url, {"id": f"r-{i}", "qty": 1}, timeout=30,
                                    session=session)
                    latencies.append(time.perf_counter() - begun)

            await asyncio.gather(*(one(i) for i in range(n)))
        return latencies

    with receiver_apart(folder, latency_ms, group=group, pin=pin) as receiver:
        started, cpu = time.perf_counter(), _cpu_s()
        latencies = eventloop.run(fire(receiver.url))
        elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
        where = receiver.placement()
    return {"rate": n / elapsed, "cpu_us": cpu / n * 1e6, "placement": where,
            **_percentiles(latencies)}


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
    worker.enqueue_many(con, [{"id": f"live-{i}", "qty": 1} for i in range(probes)], _now(),
                        60_000)
    for start in range(0, waiting, 5000):
        worker.enqueue_many(con, [{"id": f"wait-{i}", "qty": 1}
                                  for i in range(start, min(waiting, start + 5000))], _now(),
                            60_000)
    claims, finishes = [], []
    for _ in range(probes):
        begun = time.perf_counter()
        ticket = worker.claim(con, "bench", _now(), 30_000)
        claims.append(time.perf_counter() - begun)
        assert ticket is not None
        begun = time.perf_counter()
        worker.finish(con, ticket, "ok", _now())
        finishes.append(time.perf_counter() - begun)
    con.close()
    return {"claim_ms": round(statistics.median(claims) * 1000, 3),
            "finish_ms": round(statistics.median(finishes) * 1000, 3)}


def redrive_dead_letters(store: Any, n: int) -> dict:
    """On an empty queue of ``store``: n jobs that die in one claim's
    quarantine (deadline), then all of them redriven as ``asyncworker redrive
    --reason deadline`` does it: their ids from the dead letters, MAX_BATCH a
    transaction (``asyncworker.cli.apply_in_chunks``), each release with its
    audit row. Timed: the redrive's transactions, and each of them, the time
    it holds the queue's write lock (SQLite) or its rows (PostgreSQL)."""
    from asyncworker.cli import apply_in_chunks
    from lease.policy import RetryPolicy

    born = store.now_ms() - 1000
    for start in range(0, n, worker.MAX_BATCH):
        store.enqueue_events([{"id": f"dead-{i}", "qty": i % 1000 + 1}
                              for i in range(start, min(n, start + worker.MAX_BATCH))],
                             RetryPolicy(ttl_ms=1), now_ms=born)
    assert store.claim_jobs("bench", 1000, now_ms=born + 1).moved["deadline"] == n
    ids = [job["id"] for job in store.dead_jobs("deadline")]
    spans: list[float] = []

    def redrive(chunk: list[str]) -> list:
        begun = time.perf_counter()
        answers = store.redrive_jobs(chunk, 3_600_000, "bench")
        spans.append(time.perf_counter() - begun)
        return list(answers)

    started, cpu = time.perf_counter(), _cpu_s()
    results = apply_in_chunks(ids, redrive, "redriven")
    elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
    if len(results) != n or not all(answer is True for _, answer in results):
        raise RuntimeError(f"{sum(a is True for _, a in results)} of {n} jobs redriven")
    return {"rate": n / elapsed, "cpu_us": cpu / n * 1e6, "seconds": round(elapsed, 3),
            "transactions": len(spans),
            "transaction_ms": round(statistics.median(spans) * 1000, 1),
            "longest_ms": round(max(spans) * 1000, 1),
            "note": f"{len(spans)} transaction{'s' if len(spans) > 1 else ''} of up to "
                    f"{worker.MAX_BATCH:,} ids: "
                    f"{elapsed:.2f} s, each {statistics.median(spans) * 1000:,.0f} ms "
                    f"(longest {max(spans) * 1000:,.0f})"}


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
        worker.enqueue_many(con, events, _now(), 60_000)
    else:
        for event in events:
            worker.enqueue(con, event, _now(), 60_000)
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
    out = subprocess.run([sys.executable, "-m", "asyncworker.bench", name, json.dumps(params)],
                         capture_output=True, text=True, timeout=600)
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
    result["rss_mb"] = round(_rss_mb(), 1)
    print(json.dumps(result))


# ----------------------------------------------------------------- the table


def _peers_installed() -> list[str]:
    import importlib.util

    modules = {"huey": "huey", "persist-queue": "persistqueue", "litequeue": "litequeue"}
    return [peer for peer, module in modules.items() if importlib.util.find_spec(module)]


def median_pair(pairs: list[tuple[dict, dict]]) -> tuple[tuple[dict, dict], list[float]]:
    """Of (limit, measured) runs taken in alternation, the pair whose ratio
    (measured rate / limit rate) is the median, and every pair's ratio, sorted."""
    if not pairs:
        raise ValueError("no pairs to take a median of")
    ranked = sorted(pairs, key=lambda pair: pair[1]["rate"] / pair[0]["rate"])
    return ranked[len(ranked) // 2], [measured["rate"] / limit["rate"]
                                      for limit, measured in ranked]


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def run_bench(*, quick: bool = False, peers: bool = False, out: Any = None,
              store: Optional[str] = None, pin: bool = True) -> list[dict]:
    """Measure everything once and print the table; return the rows. ``pin``:
    each receiver on half of the CPUs and its clients on the other (False:
    both left to the scheduler). With
    ``store`` (a ``postgresql://`` URL, or ``postgres`` for a server started
    for the run) the PostgreSQL table follows, from the same run
    (``asyncworker.bench_postgres``)."""
    out = out or sys.stdout
    size = (lambda full, small: small) if quick else (lambda full, small: full)
    rows: list[dict] = []

    def row(label: str, result: dict, limit: Optional[float], limit_label: str) -> None:
        ratio = result.get("rate", 0) / limit if limit else None
        rows.append({"scenario": label, **result, "limit": limit, "limit_label": limit_label,
                     "ratio": ratio})
        print(f"  measured: {label}", file=sys.stderr, flush=True)

    # The storage's limit and the sync loop alternate, A B A B: the disk's commit
    # rate moves by a third between minutes, and the loop is judged by its pair's.
    (commit, sync), ratios = median_pair([
        (run_child("commit", {"n": size(2000, 100)}), run_child("sync", {"n": size(2000, 100)}))
        for _ in range(size(SYNC_PAIRS, 1))])
    commits_per_s = commit["rate"]
    cycle = commits_per_s / 2  # one claim and one finish commit per job
    row("durable commit (queue settings)", commit, commits_per_s, "itself")
    row("sync run_once loop", sync, cycle, "raw claim+finish cycle")
    if len(ratios) > 1:
        rows[-1]["limit_label"] += (f" of its pair; median of {len(ratios)} pairs: "
                                    f"{2 * ratios[0]:.2f} .. {2 * ratios[-1]:.2f}")
    row("async in-process, batch 1", run_child(
        "async", {"n": size(2000, 100), "concurrency": 64, "batch": 1}), cycle,
        "raw claim+finish cycle")
    row("async in-process, batch 64", run_child(
        "async", {"n": size(40_000, 500), "concurrency": 64, "batch": 64}), 10_000.0,
        "target 10,000/s")

    limits = {}
    for latency in (0, 50):
        # The denominator of many rows: the median of three runs, not one sample.
        samples = sorted((run_child("receiver_limit", {"n": size(4000, 100), "concurrency": 64,
                                                       "latency_ms": latency, "pin": pin})
                          for _ in range(3)), key=lambda r: r["rate"])
        limit = samples[1]
        limits[latency] = limit["rate"]
        spread = f"median of 3: {samples[0]['rate']:,.0f} .. {samples[2]['rate']:,.0f}"
        row(f"receiver limit, plain client c64, {latency} ms", limit, None, "")
        rows[-1]["note"] = spread
    ungrouped = run_child("receiver_limit", {"n": size(2000, 100), "concurrency": 64,
                                             "latency_ms": 0, "group": 1, "pin": pin})
    row("receiver, one commit per request, c64, 0 ms", ungrouped, limits[0],
        "grouped receiver limit")
    for latency in (0, 50):
        for concurrency in (1, 16, 64, 256):
            n = size(max(200, concurrency * (40 if latency else 30)), 40)
            if latency and concurrency == 1:
                n = size(60, 10)
            result = run_child("receiver", {"n": n, "concurrency": concurrency,
                                            "latency_ms": latency, "pin": pin})
            bound = limits[latency] if not latency else min(concurrency / 0.05, limits[0])
            label = "receiver limit" if not latency else f"min({concurrency}/0.05 s, limit)"
            row(f"async vs receiver c{concurrency}, {latency} ms", result, bound, label)

    small = run_child("history", {"finished": 1000, "probes": size(300, 30)})
    big = run_child("history", {"finished": size(200_000, 5000), "probes": size(300, 30)})
    rows.append({"scenario": "claim latency, 1,000 vs "
                 f"{size(200_000, 5000):,} finished rows",
                 "claim_small": small["claim_ms"], "claim_big": big["claim_ms"],
                 "finish_small": small["finish_ms"], "finish_big": big["finish_ms"],
                 "ratio": big["claim_ms"] / small["claim_ms"], "limit_label": "target <= 1.5",
                 "rss_mb": big["rss_mb"]})
    long_queue = run_child("history", {"finished": 0, "probes": size(300, 30),
                                       "waiting": size(100_000, 5000)})
    rows.append({"scenario": f"claim latency, 1,000 vs {size(100_000, 5000):,} pending rows",
                 "claim_small": small["claim_ms"], "claim_big": long_queue["claim_ms"],
                 "finish_small": small["finish_ms"], "finish_big": long_queue["finish_ms"],
                 "ratio": long_queue["claim_ms"] / small["claim_ms"],
                 "limit_label": "flat as the queue grows", "rss_mb": long_queue["rss_mb"]})
    print("  measured: history", file=sys.stderr, flush=True)
    redriven = size(100_000, 2000)
    row(f"bulk redrive, {redriven:,} dead jobs", run_child("redrive", {"n": redriven}), None,
        "")
    rss = run_child("async", {"n": size(100_000, 1000), "concurrency": 256, "batch": 64,
                              "send_ms": 2})
    row(f"{size(100_000, 1000):,} queued, 256 in flight (2 ms send)", rss, None, "")
    rows[-1]["limit_label"] = "target RSS < 150 MB"

    if peers:
        n = size(5000, 100)
        row(f"ours: enqueue {n} one by one + dispatch",
            run_child("ours_end_to_end", {"n": n, "bulk": False}), None, "")
        row(f"ours: enqueue_many {n} + dispatch",
            run_child("ours_end_to_end", {"n": n, "bulk": True}), None, "")
        for peer in _peers_installed():
            row(f"peer {peer}: enqueue {n} + consume/ack",
                run_child("peer", {"n": n, "peer": peer}), None, "")
    print_table(rows, out)
    from asyncworker.bench_cpu import run_cpu_bench

    out.write("\nCPU per job, paired against one receiver (python -m asyncworker.bench_cpu): "
              "the plain client and the dispatcher alternate, A B A B, each in a fresh "
              "process; the ratios are the medians of the pairs (min..max)\n")
    out.flush()
    rows += [{"scenario": f"cpu: {row['case']}", **row}
             for row in run_cpu_bench(pairs=1 if quick else 5, quick=quick, out=out, pin=pin)]
    if store is not None:
        from asyncworker.bench_postgres import run_postgres_bench

        rows += run_postgres_bench(store, quick=quick, peers=peers, out=out)
    return rows


def print_table(rows: list[dict], out: Any) -> None:
    header = ("scenario", "jobs/s", "CPU us/job", "p50 ms", "p99 ms", "commits/job", "RSS MB",
              "limit", "ratio", "limit is")
    lines = [header]
    for r in rows:
        if "claim_small" in r:
            lines.append((r["scenario"],
                          f"claim {r['claim_small']} -> {r['claim_big']} ms", "-",
                          f"finish {r['finish_small']} -> {r['finish_big']} ms", "", "",
                          _fmt(r["rss_mb"], 1), "", _fmt(r["ratio"], 2), r["limit_label"]))
            continue
        lines.append((r["scenario"], _fmt(r.get("rate")), _fmt(r.get("cpu_us")),
                      _fmt(r.get("p50_ms"), 2),
                      _fmt(r.get("p99_ms"), 2), _fmt(r.get("commits_per_job"), 3)
                      if r.get("commits_per_job") is not None else "-",
                      _fmt(r.get("rss_mb"), 1), _fmt(r.get("limit")), _fmt(r.get("ratio"), 2),
                      r.get("limit_label") or r.get("note", "")))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out.write(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
              f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}; against the "
              f"receiver: {placements(rows)}\n")
    for n, line in enumerate(lines):
        out.write("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True))
                  + " |\n")
        if n == 0:
            out.write("|" + "|".join("-" * (w + 2) for w in widths) + "|\n")
    out.flush()


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
