"""The endpoint benchmarks' verdicts come from what was observed: ``judge``
fed figures that meet every target says "met" for each, and fed figures that
fail one target says "not met" for that one (and only that one)."""

from __future__ import annotations

import copy
import io

import pytest

from asyncworker.bench import endpoints as bench
from asyncworker.bench.endpoints import judge, print_endpoint_table


def _run(claim_ms: float, rate: float) -> dict:
    return {"claim_ms": claim_ms, "claim_p99_ms": claim_ms * 2, "rate": rate, "jobs": 640,
            "claims": 10, "round_ms": [claim_ms] * 3, "round_rates": [rate] * 3,
            "cpu_ms": claim_ms / 2, "round_cpu_ms": [claim_ms / 2] * 3}


GOOD = {
    "claim": {"store": "sqlite", "deliveries": 1_000_000, "endpoints": 10_000, "capped": 100,
              "cap": 4, "held": 400, "capped_in_flight": [4], "built_s": {"many": 1.0},
              "intake_many_per_s": 800, "intake_single_per_s": 20_000,
              "plain": _run(2.0, 10_000.0), "single": _run(2.2, 9_800.0),
              "many": _run(3.0, 9_000.0), "own": _run(2.0, 10_100.0)},
    "fair": {"deliveries": 1_000_000, "b": 100, "b_served": 100, "a_before_b_last": 100,
             "claims": 4, "seconds": 0.2},
    "fanout": {"fan": 50, "messages": 1000, "plain_enqueue_ms": 2.0, "plain_commits": [1],
               "plain_rows": [1], "fanned_enqueue_ms": 3.0, "fanned_commits": [1],
               "fanned_rows": [50], "expected": 50_000, "leased_once": 50_000, "missing": 0,
               "twice": 0, "unexpected": 0, "mismatched": 0, "enqueue_s": 1.0,
               "drain_rate": 5000.0},
    "blocked": {"backlog": 5000, "healthy": 5000, "cap": 8, "disabled": False,
                "served": 5000, "claims": 79, "stalled_at": None, "seconds": 1.0},
    "disabled": {"backlog": 5000, "healthy": 5000, "cap": None, "disabled": True,
                 "served": 5000, "claims": 79, "stalled_at": None, "seconds": 1.0},
    "slow": {"n": 3000, "concurrency": 64, "slow_s": 10.0, "slow_cap": 8,
             "absent": [1000, 1100], "present": [980, 1050], "ratio": 0.97,
             "ratios": [0.98, 0.95], "slow_peak": 8},
    "capped": {"seconds": 20.0, "processes": 3, "cap": 8, "rate_cap": 50.0, "burst": 50,
               "latency_s": 0.05, "requests": 1000, "peak": 8, "most_in_1s": 60,
               "rate": 49.0},
}


def _verdicts(results: dict) -> dict[str, bool]:
    return {key: met for key, _, _, met in judge(results)}


def _with(path: tuple[str, ...], value: object) -> dict:
    results = copy.deepcopy(GOOD)
    node = results
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return results


def test_figures_within_every_target_are_met() -> None:
    assert _verdicts(GOOD) == dict.fromkeys(
        ("claim", "claim_cpu", "own", "single", "fair", "blocked", "disabled", "fan_one",
         "fan_all", "slow", "cap", "window", "rate"), True)


@pytest.mark.parametrize(("path", "value", "failed"), [
    # the claim with 10,000 endpoints 1.6 x the one endpoint's (target <= 1.5)
    (("claim", "many", "round_ms"), [2.2 * 1.6] * 3, "claim"),
    # ... its CPU
    (("claim", "many", "round_cpu_ms"), [1.1 * 1.6] * 3, "claim_cpu"),
    # the queue's own claim beside the deliveries slower than the plain queue's
    (("claim", "own", "round_rates"), [9_000.0] * 3, "own"),
    # one endpoint's claim slower than the plain queue's own
    (("claim", "single", "round_rates"), [9_000.0] * 3, "single"),
    # ... in two rounds of three (the median round's ratio decides)
    (("claim", "single", "round_rates"), [9_000.0, 10_000.0, 9_400.0], "single"),
    # B's last leased after the time allowed
    (("fair", "seconds"), bench.TARGET_FAIR_SECONDS + 0.5, "fair"),
    # B's last only after every one of A's
    (("fair", "a_before_b_last"), 1_000_000, "fair"),
    # B's deliveries not all leased (the run gave up)
    (("fair", "b_served"), 99, "fair"),
    # the healthy endpoint's claims stalled behind a capped or a disabled backlog
    (("blocked", "served"), 1031, "blocked"),
    (("disabled", "served"), 4999, "disabled"),
    # the intake of one message took two commits
    (("fanout", "fanned_commits"), [2], "fan_one"),
    # ... or some calls one, some two
    (("fanout", "fanned_commits"), [1, 2], "fan_one"),
    # ... or made 49 rows for 50 endpoints
    (("fanout", "fanned_rows"), [49], "fan_one"),
    # a delivery never leased, one leased twice, one not expected, one misnamed
    (("fanout", "missing"), 1, "fan_all"),
    (("fanout", "twice"), 1, "fan_all"),
    (("fanout", "unexpected"), 1, "fan_all"),
    (("fanout", "mismatched"), 1, "fan_all"),
    (("fanout", "leased_once"), 49_999, "fan_all"),
    # the healthy endpoint slowed below 0.9 of its rate alone by the slow one
    (("slow", "ratio"), 0.89, "slow"),
    # nine requests at once at a receiver capped at eight
    (("capped", "peak"), 9, "cap"),
    # 101 started in one second: more than burst (50) + rate (50)
    (("capped", "most_in_1s"), 101, "window"),
    # the rate more than 10 % off 50/s, either way
    (("capped", "rate"), 44.9, "rate"),
    (("capped", "rate"), 55.1, "rate"),
])
def test_a_figure_that_fails_its_target_is_not_met(path: tuple[str, ...], value: object,
                                                   failed: str) -> None:
    verdicts = _verdicts(_with(path, value))
    assert verdicts[failed] is False
    assert all(met for key, met in verdicts.items() if key != failed)


def test_the_bounds_themselves_are_met() -> None:
    at_bounds = copy.deepcopy(GOOD)
    at_bounds["claim"]["many"]["round_ms"] = [2.2 * bench.TARGET_CLAIM_RATIO] * 3
    at_bounds["claim"]["own"]["round_rates"] = [10_000.0 * bench.TARGET_NOT_LOWER] * 3
    at_bounds["fair"]["seconds"] = bench.TARGET_FAIR_SECONDS
    at_bounds["slow"]["ratio"] = bench.TARGET_SLOW_RATIO
    at_bounds["capped"]["most_in_1s"] = 100
    at_bounds["capped"]["rate"] = 45.0
    assert all(_verdicts(at_bounds).values())


def test_one_slow_round_of_three_is_not_the_verdict() -> None:
    # the machine's load moves between rounds: the median round's ratio decides
    results = _with(("claim", "own", "round_rates"), [4_000.0, 10_000.0, 10_200.0])
    assert _verdicts(results)["own"] is True
    results = _with(("claim", "many", "round_ms"), [9.0, 3.0, 3.1])
    assert _verdicts(results)["claim"] is True


def test_the_claim_cpu_is_judged_where_the_query_runs_in_process() -> None:
    # PostgreSQL's query runs in the server: this process's CPU is not its cost
    assert "claim_cpu" not in _verdicts(_with(("claim", "store"), "postgresql"))


def test_most_in_a_window_counts_every_start_within_a_second() -> None:
    assert bench.most_in_window([]) == 0
    assert bench.most_in_window([0.0, 0.5, 0.99, 1.0, 1.5]) == 3
    assert bench.most_in_window([5.0, 0.0, 0.2, 0.4]) == 3  # in any order


def test_only_the_scenarios_measured_are_judged() -> None:
    assert [key for key, *_ in judge({"fair": GOOD["fair"]})] == ["fair"]
    assert judge({}) == []


def test_commits_not_counted_judge_by_the_rows() -> None:
    # a store whose commits cannot be counted (PostgreSQL): the rows decide
    assert _verdicts(_with(("fanout", "fanned_commits"), []))["fan_one"] is True


def test_the_printed_verdict_is_the_judged_one() -> None:
    out = io.StringIO()
    print_endpoint_table("SQLite file", _with(("claim", "many", "round_ms"), [9.0] * 3), out)
    text = out.getvalue()
    lines = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(lines) == 13
    assert lines[0].startswith("  not met  claim latency, 10,000 endpoints / 1 endpoint")
    assert "x4.09" in lines[0]
    assert all(line.startswith("  met      ") for line in lines[1:])
    assert "1,000,000 ready deliveries" in text
