"""``asyncworker bench``: the whole table, from one run on this machine.

The SQLite scenarios (``asyncworker.bench.sqlite``), each in a fresh child
process, then the CPU table (``asyncworker.bench.cpu``) and, with a store,
the PostgreSQL table (``asyncworker.bench.postgres``). With ``endpoints``, the
targets of endpoints as data instead (``asyncworker.bench.endpoints``), on
the SQLite file and, with a store, on PostgreSQL, then the circuit
breaker's (``asyncworker.bench.breaker``) on the SQLite file. This module is the top
of the benchmarks: it imports the scenario modules, none of them imports it.
"""

from __future__ import annotations

import os
import platform
import sqlite3
import sys
from typing import Any

from asyncworker.bench.measure import fmt, median_pair, placements
from asyncworker.bench.sqlite import run_child

# The durable commit and the sync loop, measured in this many alternating pairs.
SYNC_PAIRS = 3


def _peers_installed() -> list[str]:
    import importlib.util

    modules = {"huey": "huey", "persist-queue": "persistqueue", "litequeue": "litequeue"}
    return [peer for peer, module in modules.items() if importlib.util.find_spec(module)]



def run_bench(*, quick: bool = False, peers: bool = False, out: Any = None,
              store: str | None = None, pin: bool = True, endpoints: bool = False,
              full_size: bool = False) -> list[dict]:
    """Measure everything once and print the table; return the rows. ``pin``:
    each receiver on half of the CPUs and its clients on the other (False:
    both left to the scheduler). With
    ``store`` (a ``postgresql://`` URL, or ``postgres`` for a server started
    for the run) the PostgreSQL table follows, from the same run
    (``asyncworker.bench.postgres``). ``endpoints``: the endpoint targets
    alone (``asyncworker.bench.endpoints``), ``full_size`` with 1,000,000
    ready deliveries; one row per store and scenario."""
    out = out or sys.stdout
    if endpoints:
        from asyncworker.bench.breaker import print_breaker_table, run_breaker_scenarios
        from asyncworker.bench.endpoints import run_endpoint_bench

        found = run_endpoint_bench(full=full_size, quick=quick, store=store, out=out)
        measured = [{"scenario": f"endpoints {name}", "store": label, **figures}
                    for label, results in found.items() for name, figures in results.items()]
        if "SQLite file" in found:  # the breaker's, with the real dispatcher, on SQLite
            breaker = run_breaker_scenarios(full=full_size, quick=quick)
            out.write("\nThe circuit breaker, SQLite file, the real dispatcher and a receiver "
                      "that goes down\n")
            print_breaker_table(breaker, out)
            measured += [{"scenario": f"breaker {name}", "store": "SQLite file", **figures}
                         for name, figures in breaker.items()]
        if store is not None:
            out.write("PostgreSQL: the breaker's targets not measured (they run on the "
                      "SQLite file)\n")
        return measured
    if full_size:
        raise ValueError("--full-size sizes the endpoint benchmarks: give --endpoints too")
    size = (lambda full, small: small) if quick else (lambda full, small: full)
    rows: list[dict] = []

    def row(label: str, result: dict, limit: float | None, limit_label: str) -> None:
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
        row(f"receiver limit, wire client c64 (no queue), {latency} ms", limit, None, "")
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
    from asyncworker.bench.cpu import run_cpu_bench

    out.write("\nCPU per job, paired against one receiver (python -m asyncworker.bench.cpu): "
              "the wire client (no queue) and the dispatcher alternate, A B A B, each in a fresh "
              "process; the ratios are the medians of the pairs (min..max)\n")
    out.flush()
    rows += [{"scenario": f"cpu: {row['case']}", **row}
             for row in run_cpu_bench(pairs=1 if quick else 5, quick=quick, out=out, pin=pin)]
    if store is not None:
        from asyncworker.bench.postgres import run_postgres_bench

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
                          fmt(r["rss_mb"], 1), "", fmt(r["ratio"], 2), r["limit_label"]))
            continue
        lines.append((r["scenario"], fmt(r.get("rate")), fmt(r.get("cpu_us")),
                      fmt(r.get("p50_ms"), 2),
                      fmt(r.get("p99_ms"), 2), fmt(r.get("commits_per_job"), 3)
                      if r.get("commits_per_job") is not None else "-",
                      fmt(r.get("rss_mb"), 1), fmt(r.get("limit")), fmt(r.get("ratio"), 2),
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
