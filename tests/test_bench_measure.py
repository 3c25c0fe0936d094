"""How the benchmarks hold a ratio still: a receiver and its clients on two
halves of the CPUs, so that a ratio against the receiver does not read how
the scheduler happened to place them (``asyncworker.bench.split_cpus``), and
a limit and what it bounds measured in alternating pairs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncworker import bench
from asyncworker.bench import Receiver, on_cpus, placement, receiver_apart, split_cpus

ALLOWED = frozenset(os.sched_getaffinity(0))


def _threads_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs each thread of process ``pid`` may run on."""
    return {int(tid): frozenset(os.sched_getaffinity(int(tid)))
            for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_cpus_split_in_two_halves_that_cover_them(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 1, 3, 7, 2})
    assert split_cpus() == (frozenset({1, 2}), frozenset({3, 5, 7}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4})
    assert split_cpus() is None  # one CPU: nothing to put apart
    assert placement(None) == "the receiver and its clients left to the scheduler"
    assert placement((frozenset({0}), frozenset({1, 2}))) == (
        "the receiver on CPU 0, its clients on CPU 1,2")


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


def test_the_bench_table_says_where_the_receiver_ran(monkeypatch: pytest.MonkeyPatch):
    import io

    out = io.StringIO()
    bench.print_table([], out, pin=True)
    assert placement(split_cpus()) in out.getvalue().splitlines()[0]
    out = io.StringIO()
    bench.print_table([], out, pin=False)
    assert "left to the scheduler" in out.getvalue().splitlines()[0]


def test_the_sync_loop_is_judged_by_the_pair_of_the_median_ratio():
    """The durable commit and the sync loop alternate; the row shows the pair
    whose ratio is the median, so its two figures and its ratio agree."""
    from asyncworker.bench import median_pair

    pairs = [({"rate": 1000.0}, {"rate": 450.0}), ({"rate": 800.0}, {"rate": 440.0}),
             ({"rate": 1200.0}, {"rate": 420.0})]
    (limit, measured), ratios = median_pair(pairs)
    assert (limit["rate"], measured["rate"]) == (1000.0, 450.0)  # 0.45, between 0.35 and 0.55
    assert ratios == [0.35, 0.45, 0.55]
    assert median_pair(pairs[:1]) == (pairs[0], [0.45])
    with pytest.raises(ValueError, match="no pairs"):
        median_pair([])
