"""The CPU benchmark's smoke run: tiny sizes, the figures not judged (the
benchmark itself runs by hand: ``python -m asyncworker.bench.cpu``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest

from asyncworker.bench.cpu import (
    QUICK_CASES,
    CpuBench,
    MemoryStore,
    _loop_thread_s,
    fill_queue,
    run_cpu_bench,
    top_frames,
)
from asyncworker.bench.measure import cpu_s, split_cpus
from lease.policy import stored_body
from lease.stores import open_store


@pytest.mark.timeout(300)
def test_the_quick_bench_prints_each_case_with_its_paired_ratios_and_targets():
    out = io.StringIO()
    rows = run_cpu_bench(pairs=1, quick=True, out=out)
    table = [line for line in out.getvalue().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| case") and len(table) == 1 + 20
    for label in ("c64, 0 ms", "c256, 50 ms", "in-process, batch 64", "256 in flight",
                  "c64, 0 ms, a WAL file", "c256, 50 ms, a WAL file",
                  "in-process, batch 64, c64, a WAL file", "in-process, batch 256, c256",
                  "in-process, batch 256, c256, a WAL file",
                  "c64, 0 ms: the runtime alone", "c256, 50 ms: the runtime alone",
                  "c64, 0 ms: a plain client on the dispatcher's HTTP client",
                  "c64, 0 ms, 4 KB payloads: a plain client on the dispatcher's HTTP client",
                  "c64, 0 ms, 4 KB payloads, a WAL file",
                  "c64, 0 ms, 4 KB payloads: the runtime alone",
                  "the store alone: claim + finish, 12", "the store alone: claim + finish, 64",
                  "64 jobs a transaction, 4 KB payloads"):
        assert any(line.startswith(f"| {label}") or label in line for line in table), label
    assert all("met" in line for line in table[1:3] + table[5:7] + table[9:11] + table[13:18])
    assert not any("met" in line for line in table[3:5] + table[7:9] + table[11:13])
    paired = [row for row in rows if "rate_ratio" in row]
    assert [row["case"] for row in paired] == ["c64, 0 ms", "c256, 50 ms",
                                               "c64, 0 ms, 4 KB payloads"]
    halves = split_cpus()
    assert halves is not None
    for row in paired:
        # every client of the case ran on the other half from its receiver
        assert row["placement"] == [sorted(half) for half in halves]
        assert row["rate_ratio"]["min"] <= row["rate_ratio"]["median"] <= row["rate_ratio"]["max"]
        assert row["rate_ratio"]["median"] > 0 and row["dispatcher_us"] > 0
        assert row["client_us"] >= 0 and row["limit"] > 0 and row["runtime_us"] > 0
        assert row["runtime_ratio"]["min"] <= row["runtime_ratio"]["median"]
        assert row["wal_us"] > 0 and row["wal_rate_ratio"]["median"] > 0
        assert row["wire_us"] > 0 and row["wire_rate_ratio"]["median"] > 0
        assert row["over_wire"]["median"] == pytest.approx(
            row["dispatcher_us"] / row["wire_us"], rel=1e-9)  # one pair: its own ratio
        # the event loop's thread: part of the process's CPU, the store's threads the rest
        # (the thread's clock and the process's are read apart: 1 ms of slack over the run)
        jobs = {label: n for label, _, _, n, _ in QUICK_CASES}[row["case"]]
        slack_us = 0.001 / jobs * 1e6
        for kind, total in (("default", "dispatcher_us"), ("wal", "wal_us"),
                            ("runtime", "runtime_us")):
            assert 0 < row[f"{kind}_loop_us"] <= row[total] * 1.05 + slack_us, (kind, row)
            # sends in flight on average: some, never more than the concurrency
            assert 0 < row[f"{kind}_sending"] <= (64 if row["case"].startswith("c64") else 256)
    assert all(line.count("|") == 10 for line in table), table  # 9 columns each
    assert table[0].split(" | ")[3] == "sends in flight, mean"
    assert table[0].split(" | ")[5] == "of it, the event loop's thread"
    batched, batched_wal, bigger, bigger_wal, rss = rows[3:8]
    assert [row["jobs"] for row in rows[8:]] == [600, 600, 600]
    assert rows[-1]["case"] == "store alone 64, 4000 B bodies"
    assert batched["jobs"] == batched_wal["jobs"] == rss["jobs"] == 2000
    assert bigger["jobs"] == bigger_wal["jobs"] == 2000
    for row in (batched, batched_wal, bigger, bigger_wal):  # one round: its own ratio
        assert row["rates"]["min"] == row["rate"] == row["rates"]["max"] > 0
        assert row["over_store"]["median"] == pytest.approx(row["rate"] / row["store_rate"],
                                                            rel=1e-9)
    in_process = [line for line in table if line.startswith("| in-process")]
    assert len(in_process) == 4
    assert all("the store alone at this batch" in line for line in in_process)
    assert 0 < rss["rss_mb"] < 1000


def test_the_queue_it_fills_holds_every_job_ready(tmp_path):
    fill_queue(tmp_path / "q.db", 12, prefix="x")
    store = open_store(tmp_path / "q.db")
    try:
        assert store.counts()["pending"] == 12
    finally:
        store.close()


def test_its_payloads_are_orders_of_about_the_size_asked(tmp_path):
    fill_queue(tmp_path / "q.db", 3, prefix="x", body_bytes=4000)
    store = open_store(tmp_path / "q.db")
    try:
        bodies = [job.body for job in store.claim_jobs("w", 1000, 10).leased]
    finally:
        store.close()
    assert len(bodies) == 3 and len(set(bodies)) == 3
    for body in bodies:
        assert body is not None and 3600 <= len(body) <= 4400
        assert json.loads(body)["lines"][0]["sku"].startswith("sku-")


def test_the_runtime_alone_hands_out_the_payloads_a_queue_would(tmp_path):
    fill_queue(tmp_path / "q.db", 2, prefix="x", body_bytes=4000)
    store = open_store(tmp_path / "q.db")
    try:
        stored = store.claim_jobs("w", 1000, 10).leased
    finally:
        store.close()
    alone = MemoryStore(2, "x", 4000).claim_jobs("w", 1000, 10).leased
    assert [(job.event, job.digest) for job in alone] == [
        (job.event, job.digest) for job in stored]
    for job in alone:
        assert stored_body(job.event["body"], job.digest) == job.event["body"].encode()
    assert [job.event for job in MemoryStore(1, "x").claim_jobs("w", 1000).leased] == [
        {"id": "x-0", "qty": 1}]


def test_py_spy_stacks_become_own_and_total_time_entries():
    raw = ("MainThread;main (asyncworker/bench/cpu.py:1);_post (asyncworker/sender.py:9) 3\n"
           "MainThread;main (asyncworker/bench/cpu.py:2);select (selectors.py:4) 1\n"
           "not a stack line\n")
    assert top_frames(raw, 5) == [" 75.0%  _post (asyncworker/sender.py:9)",
                                  " 25.0%  select (selectors.py:4)"]
    assert top_frames(raw, 1, inclusive=True) == ["100.0%  main (asyncworker/bench/cpu.py)"]


def test_bad_arguments_are_one_line_refusals():
    with pytest.raises(ValueError, match="pairs must be at least 1"):
        CpuBench(0)
    out = subprocess.run([sys.executable, "-m", "asyncworker.bench.cpu", "--pairs", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--pairs must be at least 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_time_is_read_finer_than_a_clock_tick():
    """A quick run's plain client spends a few milliseconds of CPU: read in
    clock ticks (os.times, 10 ms) it was often nothing, and its ratios divided
    by zero. 2 ms of work must read as about 2 ms, never only as 0 or 10
    (three tries: another thread of this process may be busy during one)."""
    for read in (cpu_s, _loop_thread_s):  # the process's, and the loop's thread's
        readings = []
        for _ in range(3):
            started, thread_started = read(), time.thread_time()
            while time.thread_time() - thread_started < 0.002:
                pass
            readings.append(read() - started)
        assert any(0.0015 < spent < 0.008 for spent in readings), (read.__name__, readings)
