"""What the benchmarks share: how a run is measured (CPU, peak RSS,
percentiles), where a receiver and its clients run (``split_cpus``,
``receiver_apart``), the bulk redrive both stores measure, a PostgreSQL
server and a database of its own per scenario (``server_for``,
``database``), and how a figure is printed. The scenario modules
(``sqlite``, ``cpu``, ``postgres``, ``endpoints``) import it; it imports
none of them."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from lease import worker


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    ordered = sorted(latencies)
    return {"p50_ms": round(ordered[len(ordered) // 2] * 1000, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2)}


def cpu_s() -> float:
    """This process's user + system CPU time, every thread of it. getrusage,
    not os.times: os.times counts in clock ticks (10 ms), and a short run's
    few milliseconds would read as nothing."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime



def cpus_of(pid: int = 0) -> list[int]:
    """The CPUs process ``pid`` may run on (0: the calling thread), by Linux's
    ``sched_getaffinity``, as the benchmarks' placement is."""
    return sorted(os.sched_getaffinity(pid))


def split_cpus() -> tuple[frozenset[int], frozenset[int]] | None:
    """This thread's CPUs in two halves by number, the receiver's and its
    clients'; None where there is nothing to split (one CPU). By number, not
    by physical core: where two numbers are one core's hyperthreads, the
    halves share cores.

    Left to the scheduler on two cores, a receiver and its client shared a
    core in some runs and not in others: the same plain client's rate fell
    in two clusters run by run, and a ratio read whichever its pair drew;
    apart, it held still (docs/benchmarks.md, "A receiver and its clients
    apart")."""
    cpus = cpus_of()
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


@contextlib.contextmanager
def on_cpus(cpus: frozenset[int] | None) -> Iterator[None]:
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
                 cpus: frozenset[int] | None = None) -> None:
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


def redrive_dead_letters(store: Any, n: int) -> dict:
    """On an empty queue of ``store``: n jobs that die in one claim's
    quarantine (deadline), then all of them redriven as ``asyncworker redrive
    --reason deadline`` does it: their ids from the dead letters, MAX_BATCH a
    transaction (``asyncworker.operations.apply_in_chunks``), each release with its
    audit row. Timed: the redrive's transactions, and each of them, the time
    it holds the queue's write lock (SQLite) or its rows (PostgreSQL)."""
    from asyncworker.operations import apply_in_chunks
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

    started, cpu = time.perf_counter(), cpu_s()
    results = apply_in_chunks(ids, redrive, "redriven")
    elapsed, cpu = time.perf_counter() - started, cpu_s() - cpu
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


def median_pair(pairs: list[tuple[dict, dict]]) -> tuple[tuple[dict, dict], list[float]]:
    """Of (limit, measured) runs taken in alternation, the pair whose ratio
    (measured rate / limit rate) is the median, and every pair's ratio, sorted."""
    if not pairs:
        raise ValueError("no pairs to take a median of")
    ranked = sorted(pairs, key=lambda pair: pair[1]["rate"] / pair[0]["rate"])
    return ranked[len(ranked) // 2], [measured["rate"] / limit["rate"]
                                      for limit, measured in ranked]


def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


# ----------------------------------------------------------------- PostgreSQL


def admin_connection(url: str) -> Any:
    """An autocommit connection to ``url`` (psycopg, imported only here)."""
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=10)


@contextlib.contextmanager
def database(url: str) -> Iterator[str]:
    """A fresh database on the server of ``url`` for one scenario; dropped after."""
    from psycopg import sql

    name = f"bench_{secrets.token_hex(6)}"
    with admin_connection(url) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(
            sql.Identifier(name)))
    try:
        yield urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
    finally:
        with admin_connection(url) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@contextlib.contextmanager
def server_for(store: str) -> Iterator[str]:
    """The URL to measure on: the one given, or for ``postgres`` a server
    started for this run with durable settings, closed after it."""
    if store != "postgres":
        yield store
        return
    from asyncworker.devtools.postgres_server import PostgresServer

    # durable: every commit waits for its WAL flush (fsync and synchronous_commit on)
    with PostgresServer(fsync=True, settings={"synchronous_commit": "on",
                                              "shared_buffers": "256MB"}) as server:
        yield server.url
