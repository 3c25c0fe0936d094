"""``python -m asyncworker.bench.cpu``: is the dispatcher ever the bottleneck?

A ratio against the receiver only holds still when its two sides are
measured side by side: the receiver's own rate swings with whatever else the
machine does. So one receiver process (``asyncworker serve``) serves every
run, and the plain clients and the dispatcher alternate against it in pairs,
A B A B ..., each in a fresh child process. Each pair gives one ratio; the
table shows the median of the pairs and their spread (min..max).

The limit is the cheapest client: the dispatcher's own HTTP client
(``asyncworker.wire``) keeping C requests in flight, the same bytes and
headers, no queue. A client that spends more CPU per request leaves the
receiver less of the machine and reads as a lower limit; the aiohttp client
(a ``ClientSession``, the same requests) did about half the wire client's
rate at nearly four times its CPU per request, so it stays in the table as an informational
column only, judged by nothing.

The receiver runs on half of the machine's CPUs and every client on the
other half (``asyncworker.bench.split_cpus``; ``--no-pin`` leaves them to the
scheduler, which on two cores gave the same plain client two rates a third
apart, run by run).

CPU per job is the steadier figure on a shared machine: each child reads its
own user + system time (every thread of it, ``getrusage``) around the work
alone, so the dispatcher's CPU per job stands beside the wire client's CPU
per request of the same pair.

Two figures need no receiver: the in-process send, batched (jobs/s on
SQLite), and the peak RSS with 100,000 jobs queued and 256 in flight. The
queues are filled by the parent, so a child's time, CPU and peak RSS are the
dispatching alone. Each in-process case alternates with the store alone (claim
and finish of the same batch on the same journal, one thread, no event loop):
the most any dispatcher of one file can do on the machine in those minutes,
which a shared machine moves by half or more between sittings.

``profile`` runs the two plain clients, the c64 dispatcher and the in-process one
under py-spy (``pip install py-spy``; only samples holding the GIL: CPU, not
waits) and prints the top entries of each, by own time and by total time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncworker.bench.measure import cpu_s, cpus_of, placements, receiver_apart
from asyncworker.eventloop import LOOPS
from lease.clock import wall_clock_ms

__all__ = ["CpuBench", "fill_queue", "run_cpu_bench"]

# (label, concurrency, receiver latency ms, requests per run, body bytes): 0 bytes,
# lab events
RECEIVER_CASES = (("c64, 0 ms", 64, 0, 4000, 0), ("c256, 50 ms", 256, 50, 6000, 0),
                  ("c64, 0 ms, 4 KB payloads", 64, 0, 4000, 4000))
QUICK_CASES = (("c64, 0 ms", 64, 0, 300, 0), ("c256, 50 ms", 256, 50, 600, 0),
               ("c64, 0 ms, 4 KB payloads", 64, 0, 300, 4000))
LIMIT_CLIENT = "wire"  # the plain client whose rate is the limit and whose CPU the ratios divide by
CPU_TARGET = 2.0  # dispatcher CPU per job / the wire client's CPU per request, at most
RATE_TARGET = 0.9  # dispatcher / min(the wire client's rate, concurrency / latency), at least
RUNTIME_CPU_TARGET = 1.0  # the runtime alone (a store in memory) / the wire client's CPU, at most
STORE_SHARE_TARGET = 0.9  # in-process batch 64 / the store alone at its batch, at least
INPROCESS_TARGET = 20_000.0  # jobs/s, in-process send, batched, SQLite
INPROCESS_ROUNDS = 3  # in-process runs per case, each beside the store alone
RSS_TARGET_MB = 150.0


def _sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _loop_thread_s() -> float:
    """The CPU time (user + system) of the calling thread: read on the event
    loop's, it is the loop's share, and the rest of the process's is the
    store's threads'. time.thread_time, not /proc's clock ticks (10 ms): a
    quick run's loop spends less than one."""
    return time.thread_time()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def fill_queue(path: Path, n: int, prefix: str = "job", journal: str | None = None,
               body_bytes: int = 0) -> None:
    """A product queue of n lab events, every one ready now (``journal``: "wal"
    for a file in WAL mode); with ``body_bytes``, payload events instead, each
    body an order of about that many bytes of canonical JSON."""
    from lease.stores import open_store

    store = open_store(path, create=True, journal=journal)
    try:
        for start in range(0, n, 5000):
            store.enqueue_events([_event(f"{prefix}-{i}", i, body_bytes)
                                  for i in range(start, min(n, start + 5000))])
    finally:
        store.close()


def _stored(job_id: str, i: int, body_bytes: int) -> tuple[dict, str | None]:
    """The event as a store hands it back ({"id", "body"} with its text), and its digest."""
    from lease.policy import check_product_event

    if not body_bytes:
        return {"id": job_id, "qty": 1}, None
    intake = check_product_event(_event(job_id, i, body_bytes))
    return {"id": job_id, "body": intake.body}, intake.digest


def _event(job_id: str, i: int, body_bytes: int) -> dict:
    if not body_bytes:
        return {"id": job_id, "qty": i % 1000 + 1}
    line = {"sku": f"sku-{i % 977:05d}", "qty": i % 7 + 1, "price_cents": 1999 + i % 500}
    lines = max(1, body_bytes // 48)  # a line is about 48 bytes of canonical JSON
    return {"id": job_id, "body": {"order": i, "customer": f"customer-{i % 97}",
                                   "lines": [line] * lines}}


# ----------------------------------------------------------------- the children


async def _plain_client(url: str, n: int, concurrency: int, prefix: str,
                        body_bytes: int = 0, client: str = "aiohttp") -> dict:
    """The receiver's own limit: C requests in flight over kept-alive
    connections, the same body and headers the dispatcher sends, no queue.
    With ``body_bytes``, the payloads a filled queue holds (``fill_queue``),
    made canonical before the clock starts, as a store holds them.
    ``client``: "wire" (the dispatcher's own ``WireClient``, no queue: the
    limit the targets are judged by) or "aiohttp" (a ``ClientSession``:
    informational)."""
    if client == "wire":
        return await _plain_wire_client(url, n, concurrency, prefix, body_bytes)
    import aiohttp

    from lease.http import request_parts

    events = [_stored(f"{prefix}-{i}", i, body_bytes) for i in range(n)]
    next_i = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def worker() -> None:
            for i in next_i:
                event, digest = events[i]
                outgoing = request_parts(event, i + 1, digest)
                async with session.post(url, data=outgoing.body,
                                        headers=outgoing.headers) as answer:
                    await answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"the receiver answered {answer.status}")

        started, cpu, system = time.perf_counter(), cpu_s(), _sys_s()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {"seconds": time.perf_counter() - started, "cpu_s": cpu_s() - cpu,
                "sys_s": _sys_s() - system, "jobs": n}


async def _plain_wire_client(url: str, n: int, concurrency: int, prefix: str,
                             body_bytes: int) -> dict:
    from asyncworker.wire import WireClient
    from lease.http import Destination, request_parts

    destination = Destination(url)
    events = [_stored(f"{prefix}-{i}", i, body_bytes) for i in range(n)]
    next_i = iter(range(n))
    async with WireClient(limit=concurrency) as client:

        async def worker() -> None:
            for i in next_i:
                event, digest = events[i]
                outgoing = request_parts(event, i + 1, digest)
                status, _, _ = await client.post(destination, outgoing, 30.0)
                if status != 200:
                    raise RuntimeError(f"the receiver answered {status}")

        started, cpu, system = time.perf_counter(), cpu_s(), _sys_s()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {"seconds": time.perf_counter() - started, "cpu_s": cpu_s() - cpu,
                "sys_s": _sys_s() - system, "jobs": n}


class MemoryStore:
    """The runtime alone: a store that keeps ``n`` ready jobs in a list and
    forgets every outcome, with no SQL, no commit and no durability. Only for
    this benchmark's diagnostic row: the dispatcher's CPU per job on it,
    beside the wire client's, is what the runtime itself costs; the
    difference to a real store is the store's."""

    kind = "memory"
    name = "memory"
    threads = 1

    def __init__(self, n: int, prefix: str, body_bytes: int = 0) -> None:
        self._ids = [f"{prefix}-{i}" for i in range(n)]
        self._bodies = [_stored(job_id, i, body_bytes) for i, job_id in enumerate(self._ids)]
        self._next = 0

    def now_ms(self) -> int:
        return wall_clock_ms()

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: int | None = None, fault: Any = None) -> Any:
        from lease.records import Claimed, Leased

        now = self.now_ms() if now_ms is None else now_ms
        start = self._next
        taken = self._ids[start:start + limit]
        self._next += len(taken)
        leased = []
        for i, job_id in enumerate(taken, start):
            event, digest = self._bodies[i]
            leased.append(Leased({"id": job_id, "qty": 1, "owner": owner, "token": 1,
                                  "attempt": 1, "lease_until": now + lease_ms},
                                 event.get("body"), digest))
        return Claimed(leased, {"deadline": 0, "exhausted": 0}, now)

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Any = None) -> list:
        return [("done", None)] * len(items)

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Any = None) -> Any:
        return {**ticket, "lease_until": (now_ms or self.now_ms()) + lease_ms}

    def is_drained(self) -> bool:
        return self._next >= len(self._ids)

    def is_idle(self) -> bool:  # no ordering keys here: idle is drained
        return self.is_drained()

    def is_idle_for(self, endpoints: object) -> bool:  # no endpoints here either
        return self.is_drained()

    def blocked_heads(self, limit: int = 0) -> list:
        return []

    def close(self) -> None:
        pass

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def register_worker(self, owner: str, host: str, pid: int, *,
                        now_ms: int | None = None) -> None:
        pass  # a dispatcher's run registers itself: nothing to keep here

    def _not_here(self, *args: object, **kwargs: object) -> Any:
        raise NotImplementedError("the benchmark's memory store claims and finishes only")

    # the rest of lease.store.Store: not called by a dispatcher's run
    enqueue_events = redrive_jobs = cancel_jobs = prune_done = counts = snapshot = _not_here
    release_jobs = _not_here
    job_history = dead_jobs = jobs_with_status = list_jobs = stale_finishes = _not_here
    schema_version = queue_depth = _not_here
    add_endpoint = update_endpoint = remove_endpoint = endpoint_configs = _not_here
    endpoints = endpoint_stats = endpoint_audit = recover_endpoint = _not_here
    pause = resume = paused = queue_audit = workers = minutes = _not_here


async def _dispatch(queue: str, concurrency: int, batch: int, *, url: str | None = None,
                    send_ms: float = 0.0) -> dict:
    """The dispatcher on ``queue``: a file, a URL, or ``memory:N:PREFIX:BODY_BYTES``
    (``MemoryStore``)."""
    from asyncworker.dispatcher import Dispatcher

    async def send(event: dict, token: int) -> bool:
        if send_ms:
            await asyncio.sleep(send_ms / 1000)
        return True

    target: Any = queue
    if queue.startswith("memory:"):
        _, n, prefix, body_bytes = queue.split(":", 3)
        target = lambda: MemoryStore(int(n), prefix, int(body_bytes))  # noqa: E731
    async with Dispatcher(target, "bench", url=url, send=None if url else send,
                          concurrency=concurrency, batch_size=batch, lease_ms=30_000,
                          poll_interval=0.01) as d:
        started, cpu, system, loop_s = time.perf_counter(), cpu_s(), _sys_s(), _loop_thread_s()
        stats = await d.run(until_idle=True)
        seconds, used_s = time.perf_counter() - started, cpu_s() - cpu
        sys_s = _sys_s() - system
        loop_now = _loop_thread_s()
        # the seconds spent sending, over the run's: how many sends were in flight on average
        sending_mean = d.metrics.send.sum / seconds
    if stats.ok == 0 or stats.errors or stats.bad_acks:
        raise RuntimeError(f"the dispatcher did not deliver cleanly: {stats.as_dict()}")
    return {"seconds": seconds, "cpu_s": used_s, "sys_s": sys_s, "jobs": stats.ok,
            "loop_cpu_s": loop_now - loop_s,
            "peak_sending": stats.peak_sending, "sending_mean": sending_mean,
            "claims_per_job": stats.claim_calls / stats.ok,
            "finishes_per_job": stats.finish_batches / stats.ok}


def _store_alone(queue: str, per_transaction: int) -> dict:
    """The store's own share: claim_jobs and finish_jobs of ``per_transaction``
    jobs each, one thread, no event loop, until the queue is empty."""
    from lease.records import Attempt
    from lease.stores import open_store

    store = open_store(queue)
    jobs = 0
    started, cpu, system = time.perf_counter(), cpu_s(), _sys_s()
    try:
        while (claimed := store.claim_jobs("bench", 30_000, per_transaction)).leased:
            seen = Attempt.of(claimed.now_ms, 1, None)
            store.finish_jobs([(job.ticket, "ok", 0, seen) for job in claimed.leased])
            jobs += len(claimed.leased)
    finally:
        store.close()
    return {"seconds": time.perf_counter() - started, "cpu_s": cpu_s() - cpu,
            "sys_s": _sys_s() - system, "jobs": jobs}


def child_main(argv: Sequence[str]) -> None:
    """One measured run on the event loop LOOP: ``LOOP client URL N C PREFIX BODY_BYTES
    aiohttp|wire``,
    ``LOOP dispatch QUEUE URL|- C BATCH SEND_MS`` or ``LOOP store QUEUE PER_TRANSACTION``."""
    from asyncworker import eventloop

    loop, kind, *args = argv
    eventloop.tune_gc()  # every child, the plain client's too, set up as asyncworker run's
    if kind == "store":
        queue, per_transaction = args
        result = _store_alone(queue, int(per_transaction))
    elif kind == "client":
        url, n, concurrency, prefix, body_bytes, client = args
        result = eventloop.run(_plain_client(url, int(n), int(concurrency), prefix,
                                             int(body_bytes), client), loop)
    elif kind == "dispatch":
        queue, url, concurrency, batch, send_ms = args
        result = eventloop.run(_dispatch(queue, int(concurrency), int(batch),
                                         url=None if url == "-" else url,
                                         send_ms=float(send_ms)), loop)
    else:
        raise SystemExit(f"unknown child {kind!r}")
    result["rss_mb"] = round(_rss_mb(), 1)
    result["cpus"] = cpus_of()  # where it ran: the table says so
    print(json.dumps(result))


# ----------------------------------------------------------------- the parent


def _child_command(loop: str, *args: object) -> list[str]:
    return [sys.executable, "-m", "asyncworker.bench.cpu", "--child", loop, *map(str, args)]


def _run(command: list[str], timeout: float = 600) -> dict:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command[3:])} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _remove_queue(queue: Path) -> None:
    """A queue file and what a WAL file leaves beside it."""
    for leftover in (queue, queue.with_name(queue.name + "-wal"),
                     queue.with_name(queue.name + "-shm")):
        leftover.unlink(missing_ok=True)


def _loop_us(result: dict) -> float:
    """A dispatcher run's CPU per job on its event loop's thread."""
    return float(result["loop_cpu_s"] / result["jobs"] * 1e6)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _us(run: dict) -> float:
    """A run's CPU per job (per request, for a plain client), in microseconds."""
    return float(run["cpu_s"] / run["jobs"] * 1e6)


def _rate(run: dict) -> float:
    return float(run["jobs"] / run["seconds"])


def receiver_limit(client_rate: float, concurrency: int, latency_ms: int) -> float:
    """What a client can ask of the receiver: the cheapest client's rate, and
    no more than C requests each ``latency_ms`` long allow."""
    if not latency_ms:
        return client_rate
    return min(client_rate, concurrency / (latency_ms / 1000))


# the dispatcher's runs in each pair: on a rollback-journal file, a WAL file, a store in memory
DISPATCHER_RUNS = ("dispatcher", "wal", "runtime")


def pair_figures(runs: dict[str, dict], concurrency: int, latency_ms: int) -> dict[str, float]:
    """One pair's figures from its runs (``LIMIT_CLIENT``, ``"aiohttp"`` and each
    of ``DISPATCHER_RUNS``): the limit is the wire client's rate (the receiver's
    own limit, measured with the cheapest client there is: the dispatcher's own
    HTTP client, no queue), and every CPU ratio divides by the wire client's
    CPU per request. The aiohttp client's figures stand beside them, judged
    by nothing: a heavier client leaves the receiver less of its core, so it
    understates what the receiver can take."""
    limit_run, aiohttp = runs[LIMIT_CLIENT], runs["aiohttp"]
    limit = receiver_limit(_rate(limit_run), concurrency, latency_ms)
    figures = {"limit": _rate(limit_run), "wire_us": _us(limit_run),
               "aiohttp_us": _us(aiohttp), "aiohttp_rate": _rate(aiohttp),
               "aiohttp_limit_ratio": _rate(aiohttp) / limit}
    for kind in DISPATCHER_RUNS:
        run = runs[kind]
        figures |= {f"{kind}_us": _us(run), f"{kind}_loop_us": _loop_us(run),
                    f"{kind}_sending": run["sending_mean"],
                    f"{kind}_rate_ratio": _rate(run) / limit,
                    f"{kind}_cpu_ratio": _us(run) / _us(limit_run),
                    f"{kind}_aiohttp_rate_ratio": _rate(run) / _rate(aiohttp),
                    f"{kind}_aiohttp_cpu_ratio": _us(run) / _us(aiohttp)}
    return figures


def _pair_progress(figures: dict[str, float]) -> str:
    return (f"limit (the wire client) {figures['limit']:,.0f}/s, dispatcher "
            f"{figures['dispatcher_rate_ratio']:.2f} x it; CPU {figures['dispatcher_us']:.0f} "
            f"vs {figures['wire_us']:.0f} us (a WAL file {figures['wal_us']:.0f}, the runtime "
            f"alone {figures['runtime_us']:.0f}, the aiohttp client {figures['aiohttp_us']:.0f})")


class CpuBench:
    """The measurements, in one folder of their own (removed by ``close``)."""

    def __init__(self, pairs: int = 5, quick: bool = False, loop: str = "auto",
                 pin: bool = True) -> None:
        from asyncworker.eventloop import loop_in_use

        if pairs < 1:
            raise ValueError("pairs must be at least 1")
        self.pairs = pairs
        self.quick = quick
        self.pin = pin  # each receiver on half of the CPUs, the clients on the other
        self.loop = loop_in_use(loop)  # every child and the receiver on the same loop
        self.folder = Path(tempfile.mkdtemp(prefix="asyncworker-bench-cpu-"))
        self._runs = 0

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _queue(self, n: int, journal: str | None = None, body_bytes: int = 0) -> Path:
        self._runs += 1
        path = self.folder / f"q{self._runs}.db"
        fill_queue(path, n, prefix=f"run{self._runs}", journal=journal, body_bytes=body_bytes)
        return path

    def _dispatch_cpu(self, url: str, n: int, concurrency: int,
                      journal: str | None, body_bytes: int = 0) -> dict:
        """One dispatcher run against ``url`` on a fresh queue file, removed after."""
        queue = self._queue(n, journal, body_bytes)
        try:
            return _run(_child_command(self.loop, "dispatch", queue, url, concurrency, 64, 0))
        finally:
            _remove_queue(queue)

    def paired(self, label: str, concurrency: int, latency_ms: int, n: int,
               body_bytes: int = 0) -> dict:
        """A B A B ... against one receiver. In each pair the two plain clients
        (the wire client, whose rate is the limit, and the aiohttp one), then the
        dispatcher on a rollback-journal file, on a WAL file and on a store in
        memory (``MemoryStore``). ``body_bytes``: payload events of about that
        size for every run, not lab events. The row holds the medians of the
        pairs' figures (``pair_figures``), each ratio with its spread."""
        pairs: list[dict[str, float]] = []
        client_cpus: set[int] = set()  # every CPU a client of this case may have run on
        with receiver_apart(self.folder, latency_ms, loop=self.loop, pin=self.pin) as receiver:
            receiver_cpus = receiver.cpus()
            for pair in range(self.pairs):
                self._runs += 1
                runs = {client: _run(_child_command(
                            self.loop, "client", receiver.url, n, concurrency,
                            f"{client}{self._runs}", body_bytes, client))
                        for client in ("wire", "aiohttp")}
                runs["dispatcher"] = self._dispatch_cpu(receiver.url, n, concurrency, None,
                                                        body_bytes)
                runs["wal"] = self._dispatch_cpu(receiver.url, n, concurrency, "wal", body_bytes)
                runs["runtime"] = _run(_child_command(
                    self.loop, "dispatch", f"memory:{n}:mem{self._runs}:{body_bytes}",
                    receiver.url, concurrency, 64, 0))
                for run in runs.values():
                    client_cpus.update(run["cpus"])
                pairs.append(pair_figures(runs, concurrency, latency_ms))
                print(f"  {label} pair {pair + 1}: " + _pair_progress(pairs[-1]),
                      file=sys.stderr, flush=True)
        return {"case": label, "limit_client": LIMIT_CLIENT,
                "placement": [receiver_cpus, sorted(client_cpus)],
                **{name: (_spread([figures[name] for figures in pairs]) if "ratio" in name
                          else statistics.median(figures[name] for figures in pairs))
                   for name in pairs[0]}}

    def in_process(self, n: int, concurrency: int, batch: int, send_ms: float = 0.0,
                   journal: str | None = None) -> dict:
        queue = self._queue(n, journal)
        try:
            result = _run(_child_command(self.loop, "dispatch", queue, "-", concurrency, batch,
                                         send_ms))
        finally:
            _remove_queue(queue)
        result["rate"] = result["jobs"] / result["seconds"]
        result["us_per_job"] = result["cpu_s"] / result["jobs"] * 1e6
        result["loop_us"] = _loop_us(result)
        return result

    def in_process_paired(self, n: int, concurrency: int, batch: int,
                          journal: str | None = None,
                          rounds: int = INPROCESS_ROUNDS) -> dict:
        """The in-process send, and the store alone at the same batch on the same
        journal, alternating ``rounds`` times: the store's own rate is the most
        any dispatcher of one file can do on this machine in these minutes.
        The medians (rate, CPU, the loop's share), the dispatcher's rates'
        spread, the store's median rate and the paired ratios to it."""
        ours, alone = [], []
        for _ in range(rounds):
            ours.append(self.in_process(n, concurrency, batch, journal=journal))
            alone.append(self.store_alone(n, batch, journal=journal))
        rates = [result["rate"] for result in ours]
        return {"jobs": ours[0]["jobs"], "rate": statistics.median(rates),
                "rates": _spread(rates),
                "us_per_job": statistics.median(result["us_per_job"] for result in ours),
                "loop_us": statistics.median([result["loop_us"] for result in ours]),
                "store_rate": statistics.median(result["rate"] for result in alone),
                "over_store": _spread([one["rate"] / other["rate"]
                                       for one, other in zip(ours, alone, strict=True)])}

    def store_alone(self, n: int, per_transaction: int, body_bytes: int = 0,
                    journal: str | None = None) -> dict:
        queue = self._queue(n, journal, body_bytes)
        try:
            result = _run(_child_command(self.loop, "store", queue, per_transaction))
        finally:
            _remove_queue(queue)
        result["rate"] = result["jobs"] / result["seconds"]
        result["us_per_job"] = result["cpu_s"] / result["jobs"] * 1e6
        return result

    def profile(self, out: Any, top: int = 25, keep: Path | None = None) -> None:
        """py-spy on the two plain clients, the c64 dispatcher and the in-process
        one: the top entries by own time and by total time (the project's own
        frames); ``keep``: a folder for py-spy's raw stacks."""
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(py_spy).exists():
            raise RuntimeError("py-spy is not installed: pip install py-spy")
        n = 600 if self.quick else 8000
        with receiver_apart(self.folder, 0, loop=self.loop, pin=self.pin) as receiver:
            for title, child in {
                    "the wire client, c64": ("client", receiver.url, n, 64, "wired", 0,
                                             "wire"),
                    "the aiohttp client, c64": ("client", receiver.url, n, 64, "profiled", 0,
                                                "aiohttp"),
                    "the dispatcher, c64 against the receiver": (
                        "dispatch", self._queue(n), receiver.url, 64, 64, 0)}.items():
                self._profile_one(py_spy, title, child, out, top, keep)
        # no receiver: on every CPU, as the table's in-process rows
        self._profile_one(py_spy, "the dispatcher, in-process, batch 64",
                          ("dispatch", self._queue(n * 5), "-", 64, 64, 0), out, top, keep)

    def _profile_one(self, py_spy: str, title: str, child: tuple, out: Any, top: int,
                     keep: Path | None) -> None:
        self._runs += 1
        raw = (keep or self.folder) / f"profile-{self._runs}.txt"
        subprocess.run([py_spy, "record", "--format", "raw", "--rate", "250",
                        "--threads", "--gil", "-o", str(raw), "--",
                        *_child_command(self.loop, *child)],
                       check=True, capture_output=True, timeout=600)
        out.write(f"\n{title}: py-spy, own time, GIL held\n")
        for line in top_frames(raw.read_text(), top):
            out.write(f"  {line}\n")
        out.write(f"\n{title}: py-spy, total time, the project's frames\n")
        for line in top_frames(raw.read_text(), top, inclusive=True):
            out.write(f"  {line}\n")


def top_frames(raw: str, top: int, inclusive: bool = False) -> list[str]:
    """py-spy's raw (collapsed) stacks as the frames most often on top (or,
    ``inclusive``, the project's frames most often anywhere in a stack), with %."""
    own: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if inclusive:
            for frame in {re.sub(r":\d+\)$", ")", f) for f in frames
                          if "asyncworker/" in f or "lease/" in f}:
                own[frame] += int(count)
        else:
            own[frames[-1]] += int(count)
        total += int(count)
    return [f"{100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]


def _ratio(spread: dict) -> str:
    return f"{spread['median']:.2f} ({spread['min']:.2f}..{spread['max']:.2f})"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def paired_targets(row: dict, kind: str) -> str:
    """The targets of one of the dispatcher's runs in a paired row, judged
    from its measured medians: rate and CPU against the wire client for the
    dispatcher on a file, CPU alone for the runtime alone."""
    cpu = row[f"{kind}_cpu_ratio"]["median"]
    if kind == "runtime":
        return f"CPU <= {RUNTIME_CPU_TARGET:.1f} x {_verdict(cpu <= RUNTIME_CPU_TARGET)}"
    rate = row[f"{kind}_rate_ratio"]["median"]
    return (f"rate >= {RATE_TARGET} x {_verdict(rate >= RATE_TARGET)}, "
            f"CPU <= {CPU_TARGET:.1f} x {_verdict(cpu <= CPU_TARGET)}")


def _beside_aiohttp(row: dict, kind: str) -> str:
    """The informational column: the run beside the aiohttp client of the same pairs."""
    cpu = _ratio(row[f"{kind}_aiohttp_cpu_ratio"])
    if kind == "runtime":
        return f"{cpu} x its CPU"
    told = f"{_ratio(row[f'{kind}_aiohttp_rate_ratio'])} x its rate, {cpu} x its CPU"
    if kind != "dispatcher":
        return told
    return (f"{row['aiohttp_rate']:,.0f}/s ({row['aiohttp_limit_ratio']['median']:.2f} x the "
            f"limit), {row['aiohttp_us']:.0f} us/request; the dispatcher {told}")


PAIRED_LABELS = {"dispatcher": "", "wal": ", a WAL file (init --journal wal)",
                 "runtime": ": the runtime alone (a store in memory, no SQL)"}


def paired_line(row: dict, kind: str) -> str:
    """One of the dispatcher's runs in a paired case, as a table line."""
    rate = "-" if kind == "runtime" else _ratio(row[f"{kind}_rate_ratio"])
    limit = "-" if kind == "runtime" else f"{row['limit']:,.0f}"
    return (f"| {row['case']}{PAIRED_LABELS[kind]} | {limit} | {rate} | "
            f"{row[f'{kind}_sending']:.1f} | {row[f'{kind}_us']:.0f} | "
            f"{row[f'{kind}_loop_us']:.0f} | {row['wire_us']:.0f} | "
            f"{_ratio(row[f'{kind}_cpu_ratio'])} | {paired_targets(row, kind)} | "
            f"{_beside_aiohttp(row, kind)} |\n")


def in_process_line(label: str, result: dict, batch: int) -> str:
    """An in-process row: its rate, and at batch 64 its share of the store alone, judged."""
    spread, over = result["rates"], result["over_store"]
    share = f"the dispatcher {_ratio(over)} x it"
    if batch == 64:
        share = (f"{share}, >= {STORE_SHARE_TARGET} x "
                 f"{_verdict(over['median'] >= STORE_SHARE_TARGET)}")
    return (f"| {label} | - | {result['rate']:,.0f} jobs/s ({spread['min']:,.0f}.."
            f"{spread['max']:,.0f}) | - | {result['us_per_job']:.0f} | "
            f"{result['loop_us']:.0f} | - | - | >= 20,000/s "
            f"{_verdict(result['rate'] >= INPROCESS_TARGET)}; the store alone at this "
            f"batch {result['store_rate']:,.0f} jobs/s, {share} | - |\n")


# The store alone: (jobs a transaction, body bytes); 0 bytes: lab events.
STORE_CASES = ((12, 0), (64, 0), (64, 4000))


def _store_case(per_transaction: int, body_bytes: int) -> str:
    label = f"the store alone: claim + finish, {per_transaction} jobs a transaction"
    return label + (f", {body_bytes / 1000:.0f} KB payloads" if body_bytes else "")


def run_cpu_bench(*, pairs: int = 5, quick: bool = False, out: Any = None,
                  loop: str = "auto", pin: bool = True) -> list[dict]:
    """Measure every figure in one run and print the table; return its rows."""
    out = out or sys.stdout
    bench = CpuBench(pairs, quick, loop, pin)
    rows: list[dict] = []
    try:
        for case in QUICK_CASES if quick else RECEIVER_CASES:
            rows.append(bench.paired(*case))
        jobs, rounds = (2000, 1) if quick else (40_000, INPROCESS_ROUNDS)
        batched = bench.in_process_paired(jobs, 64, 64, rounds=rounds)
        batched_wal = bench.in_process_paired(jobs, 64, 64, journal="wal", rounds=rounds)
        bigger = bench.in_process_paired(jobs, 256, 256, rounds=rounds)
        bigger_wal = bench.in_process_paired(jobs, 256, 256, journal="wal", rounds=rounds)
        rss = bench.in_process(2000 if quick else 100_000, 256, 64, send_ms=2)
        stores = [bench.store_alone(600 if quick else 6000, k, size) for k, size in STORE_CASES]
    finally:
        bench.close()
    load = os.getloadavg()
    out.write(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
              f"{platform.python_version()}, {bench.loop}'s event loop, load average "
              f"{load[0]:.1f} {load[1]:.1f}; {placements(rows)}; "
              f"{pairs} pairs A B, medians (min..max); the limit: the wire client "
              f"(asyncworker.wire, no queue), the aiohttp client beside it\n")
    out.write("| case | receiver limit/s (the wire client) | dispatcher / limit | "
              "sends in flight, mean | CPU us/job: dispatcher | of it, the event loop's thread | "
              "wire client, us/request | CPU ratio | targets | beside the aiohttp client "
              "(no target) |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n")
    for row in rows:
        for kind in DISPATCHER_RUNS:
            out.write(paired_line(row, kind))
    for label, batch, result in (("in-process, batch 64, c64", 64, batched),
                                 ("in-process, batch 64, c64, a WAL file", 64, batched_wal),
                                 ("in-process, batch 256, c256", 256, bigger),
                                 ("in-process, batch 256, c256, a WAL file", 256, bigger_wal)):
        out.write(in_process_line(label, result, batch))
    out.write(f"| {rss['jobs']:,} queued, 256 in flight (2 ms send) | - | "
              f"{rss['rate']:,.0f} jobs/s | - | {rss['us_per_job']:.0f} | {rss['loop_us']:.0f} | "
              f"- | - | peak RSS "
              f"{rss['rss_mb']:.1f} MB < 150 {_verdict(rss['rss_mb'] < RSS_TARGET_MB)} | - |\n")
    for (k, size), store in zip(STORE_CASES, stores, strict=True):
        out.write(f"| {_store_case(k, size)} | - | "
                  f"{store['rate']:,.0f} jobs/s | - | {store['us_per_job']:.0f} | - | - | "
                  f"- | where the CPU goes (no target) | - |\n")
    out.flush()
    rows.append({"case": "in-process batched", **batched})
    rows.append({"case": "in-process batched, WAL", **batched_wal})
    rows.append({"case": "in-process batch 256", **bigger})
    rows.append({"case": "in-process batch 256, WAL", **bigger_wal})
    rows.append({"case": "rss", **rss})
    rows += [{"case": f"store alone {k}" + (f", {size} B bodies" if size else ""), **store}
             for (k, size), store in zip(STORE_CASES, stores, strict=True)]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        child_main(args[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m asyncworker.bench.cpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("table", "profile"), default="table")
    parser.add_argument("--pairs", type=int, default=5, help="A B pairs per case (default 5)")
    parser.add_argument("--quick", action="store_true", help="small runs: a smoke test")
    parser.add_argument("--keep", type=Path, help="profile: keep py-spy's raw stacks here")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the receiver and its clients to the scheduler (default: "
                             "the receiver on half of the CPUs, every client on the other)")
    parser.add_argument("--loop", choices=LOOPS, default="auto",
                        help="the event loop of the receiver and of every child (default auto: "
                             "uvloop when installed)")
    parsed = parser.parse_args(args)
    if parsed.pairs < 1:
        parser.error("--pairs must be at least 1")
    if parsed.what == "profile":
        bench = CpuBench(1, parsed.quick, parsed.loop, parsed.pin)
        try:
            bench.profile(sys.stdout, keep=parsed.keep)
        finally:
            bench.close()
        return 0
    run_cpu_bench(pairs=parsed.pairs, quick=parsed.quick, loop=parsed.loop, pin=parsed.pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
