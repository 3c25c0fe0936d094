"""How the benchmarks hold a ratio still: a receiver and its clients on two
halves of the CPUs, so that a ratio against the receiver does not read how
the scheduler happened to place them (``asyncworker.bench.measure.split_cpus``), and
a limit and what it bounds measured in alternating pairs; what the bulk
redrive's row times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncworker.bench import command, measure, sqlite
from asyncworker.bench.measure import (
    Receiver,
    median_pair,
    on_cpus,
    placement,
    placements,
    receiver_apart,
    split_cpus,
)

ALLOWED = frozenset(os.sched_getaffinity(0))  # Linux's, as the benchmarks are


def _threads_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs each thread of process ``pid`` may run on."""
    return {int(tid): frozenset(os.sched_getaffinity(int(tid)))
            for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_cpus_split_in_two_halves_that_cover_them(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 1, 3, 7, 2})
    assert split_cpus() == (frozenset({1, 2}), frozenset({3, 5, 7}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4})
    assert split_cpus() is None  # one CPU: nothing to put apart


def test_a_table_says_where_its_rows_found_the_receiver_and_the_clients():
    assert placement([0], [2, 1]) == "the receiver on CPU 0, its clients on CPU 1,2"
    assert placement([0, 1], [0, 1]) == "the receiver on CPU 0,1 and its clients on CPU 0,1, shared"
    rows = [{"placement": [[0], [1]]}, {"rate": 5.0}, {"placement": [[0], [1]]},
            {"placement": [[0, 1], [0, 1]]}]
    assert placements(rows) == ("the receiver on CPU 0, its clients on CPU 1; "
                                "the receiver on CPU 0,1 and its clients on CPU 0,1, shared")
    assert placements([{"rate": 5.0}]) == "no receiver"


def test_on_cpus_moves_this_thread_for_the_block_and_back_even_on_an_error():
    first = frozenset({min(ALLOWED)})
    with pytest.raises(RuntimeError, match="inside"), on_cpus(first):
        assert os.sched_getaffinity(0) == first
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True, timeout=60)
        assert child.stdout.strip() == str(sorted(first))  # what it starts inherits them
        raise RuntimeError("inside")
    assert os.sched_getaffinity(0) == ALLOWED
    with on_cpus(None):
        assert os.sched_getaffinity(0) == ALLOWED


def test_every_thread_of_a_pinned_receiver_runs_on_its_cpus(tmp_path: Path):
    """Pinned from its first instruction: the threads it starts (its inbox's)
    inherit its CPUs, and the caller's own are given back after the start."""
    first = frozenset({min(ALLOWED)})
    with Receiver(tmp_path, 0, cpus=first) as receiver:
        assert receiver.url.startswith("http://127.0.0.1:")
        assert receiver.cpus() == sorted(first)
        threads = _threads_cpus(receiver.proc.pid)
        assert len(threads) > 1  # the loop's and the inbox's at least
        assert set(threads.values()) == {first}
    assert receiver.proc.poll() is not None  # stopped on the way out
    assert os.sched_getaffinity(0) == ALLOWED


def test_a_receiver_apart_and_its_clients_share_no_cpu(tmp_path: Path):
    halves = split_cpus()
    assert halves is not None, "this machine has one CPU: the benchmarks cannot pin"
    receiver_cpus, client_cpus = halves
    with receiver_apart(tmp_path, 0) as receiver:
        assert set(_threads_cpus(receiver.proc.pid).values()) == {receiver_cpus}
        assert os.sched_getaffinity(0) == client_cpus
    assert os.sched_getaffinity(0) == ALLOWED
    with receiver_apart(tmp_path, 0, pin=False) as receiver:
        assert set(_threads_cpus(receiver.proc.pid).values()) == {ALLOWED}
        assert os.sched_getaffinity(0) == ALLOWED


@pytest.mark.parametrize("pin", [True, False])
def test_a_receiver_scenario_reports_where_it_found_both_sides(tmp_path: Path, pin: bool):
    """What the table's header is made of: read from the receiver's process
    and the client's thread during the run, not assumed from the flag."""
    halves = split_cpus()
    assert halves is not None
    result = sqlite.scenario_receiver_limit(tmp_path, 40, 4, 0, pin=pin)
    assert result["rate"] > 0
    expected = [sorted(half) for half in halves] if pin else [sorted(ALLOWED)] * 2
    assert result["placement"] == expected
    assert os.sched_getaffinity(0) == ALLOWED


def test_the_sync_loop_is_judged_by_the_pair_of_the_median_ratio():
    """The durable commit and the sync loop alternate; the row shows the pair
    whose ratio is the median (not the median limit's pair, nor the median
    loop's), so its two figures and its ratio agree."""
    median_ratio = ({"rate": 1100.0}, {"rate": 480.0})  # 0.436
    median_limit = ({"rate": 1000.0}, {"rate": 400.0})  # 0.400
    median_loop = ({"rate": 900.0}, {"rate": 470.0})  # 0.522
    pair, ratios = median_pair([median_loop, median_limit, median_ratio])
    assert pair == median_ratio
    assert ratios == pytest.approx([0.4, 480 / 1100, 470 / 900])
    assert median_pair([median_loop]) == (median_loop, [pytest.approx(470 / 900)])
    with pytest.raises(ValueError, match="no pairs"):
        median_pair([])


def test_the_main_table_header_names_the_placements_its_rows_found():
    import io

    out = io.StringIO()
    command.print_table([{"scenario": "a", "rate": 1.0, "placement": [[0], [1]]},
                       {"scenario": "b", "rate": 2.0}], out)
    header = out.getvalue().splitlines()[0]
    assert header.endswith("against the receiver: the receiver on CPU 0, its clients on CPU 1")


def test_no_pin_reaches_both_benchmarks(monkeypatch: pytest.MonkeyPatch):
    """``--no-pin`` is passed on as pin=False, and its absence as pin=True."""
    from asyncworker import cli
    from asyncworker.bench import cpu as bench_cpu

    seen: list = []
    monkeypatch.setattr(command, "run_bench", lambda **kwargs: seen.append(("bench", kwargs)))
    monkeypatch.setattr(bench_cpu, "run_cpu_bench",
                        lambda **kwargs: seen.append(("cpu", kwargs)))
    assert cli.main(["bench", "--quick", "--no-pin"]) == 0
    assert cli.main(["bench", "--quick"]) == 0
    assert bench_cpu.main(["--quick", "--no-pin"]) == 0
    assert bench_cpu.main(["--quick"]) == 0
    assert [(kind, kwargs["pin"]) for kind, kwargs in seen] == [
        ("bench", False), ("bench", True), ("cpu", False), ("cpu", True)]


def test_the_bulk_redrive_row_times_every_dead_job_redriven_in_transactions_of_a_batch(
        tmp_path: Path):
    """``redrive_dead_letters``: n jobs dead by the quarantine, redriven as
    ``asyncworker redrive --reason deadline`` does, MAX_BATCH a transaction;
    every one of them pending again with its audit row."""
    from lease.stores import open_store
    from lease.worker import MAX_BATCH

    n = MAX_BATCH + 500
    with open_store(tmp_path / "q.db", create=True) as store:
        result = measure.redrive_dead_letters(store, n)
        assert store.counts() == {"pending": n, "leased": 0, "done": 0, "dead": 0}
        assert store.snapshot(store.now_ms())["redrives"] == n
    assert result["transactions"] == 2
    assert result["rate"] > 0 and result["longest_ms"] >= result["transaction_ms"] > 0
    assert result["note"].startswith(f"2 transactions of up to {MAX_BATCH:,} ids: ")
