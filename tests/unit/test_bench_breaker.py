"""The breaker benchmarks' verdicts come from what was observed: ``judge_breaker``
fed figures that meet every target says "met" for each, and fed figures that
fail one target says "not met" for that one (and only that one)."""

from __future__ import annotations

import copy
import io

import pytest

from asyncworker.bench import breaker as bench
from asyncworker.bench.breaker import breaker_cooldowns, judge_breaker, print_breaker_table

GOOD = {
    "outage": {"n": 10_000, "down_s": 20.0, "mode": "refuse", "concurrency": 16,
               "seconds": 38.0, "retried": 60, "done": 10_000, "dead": 0, "probes": 3,
               "failed_probes": 2,
               "changes": [[0.04, "opened", 5000], [5.05, "reopened", 10000],
                           [15.05, "reopened", 20000], [35.06, "closed", 0]],
               "log_lines": 40, "log_at": [[0.0, 40]], "log_kinds": [["retry", 40]],
               "requests_down": 3, "applied": 10_000, "duplicates": 0, "recovered_s": 16.9,
               "cooldown_at_return_ms": 20_000, "down_at_s": 0.7, "finished": True},
    "neighbours": {"down_s": 15.0, "warm_s": 3.0, "messages": 20_000, "concurrency": 64,
                   "absent": [600], "present": [640], "ratio": 1.07, "ratios": [1.07],
                   "backlog_left": 5000},
    "shared": {"processes": 3, "concurrency": 16, "down_s": 20.0, "seconds": 38.0,
               "requests_down": 60, "before_open": 58, "while_open": 2,
               "claimed_before_open": 0, "most_at_once": 1, "probes_at_once": 1,
               "probes": 2, "changes": [], "opened_after_s": 0.2, "sample": []},
}


def _verdicts(results: dict) -> dict[str, bool]:
    return {key: met for key, _, _, met in judge_breaker(results)}


def _with(path: tuple[str, ...], value: object) -> dict:
    results = copy.deepcopy(GOOD)
    node = results
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return results


def test_figures_within_every_target_are_met() -> None:
    assert _verdicts(GOOD) == dict.fromkeys(
        ("waste", "logs", "recovery", "dead", "once", "neighbours", "shared"), True)


@pytest.mark.parametrize(("path", "value", "failed"), [
    # 104 attempts reached nothing: more than 1 % of 10,000 + the 3 probes
    (("outage", "retried"), 104, "waste"),
    # 51 log records from the outage
    (("outage", "log_lines"), 51, "logs"),
    # the last delivery done 22.1 s after the return, its cool-down then 20 s
    (("outage", "recovered_s"), 22.1, "recovery"),
    # ... the run gave up before every delivery was done
    (("outage", "finished"), False, "recovery"),
    # ... the breaker never opened (no cool-down to add)
    (("outage", "cooldown_at_return_ms"), None, "recovery"),
    # one delivery dead
    (("outage", "dead"), 1, "dead"),
    # one delivery never applied, or one sent again after its 200
    (("outage", "applied"), 9_999, "once"),
    (("outage", "duplicates"), 1, "once"),
    # the healthy endpoints slowed below 0.9 of their rate without the outage
    (("neighbours", "ratio"), 0.89, "neighbours"),
    # ... or their backlog ran out inside the window (the rate is not theirs)
    (("neighbours", "backlog_left"), 0, "neighbours"),
    # a request while open beyond the probes
    (("shared", "while_open"), 3, "shared"),
    # two requests at once while open
    (("shared", "most_at_once"), 2, "shared"),
])
def test_a_figure_that_fails_its_target_is_not_met(path: tuple[str, ...], value: object,
                                                   failed: str) -> None:
    verdicts = _verdicts(_with(path, value))
    assert verdicts[failed] is False
    assert all(met for key, met in verdicts.items() if key != failed)


def test_the_bounds_themselves_are_met() -> None:
    at_bounds = copy.deepcopy(GOOD)
    at_bounds["outage"]["retried"] = 103  # 1 % of 10,000 + 3 probes
    at_bounds["outage"]["log_lines"] = bench.TARGET_LOG_LINES
    at_bounds["outage"]["recovered_s"] = 22.0  # 2 s + the 20 s cool-down
    at_bounds["neighbours"]["ratio"] = bench.TARGET_NEIGHBOUR_RATIO
    assert all(_verdicts(at_bounds).values())


def test_the_cool_downs_follow_the_breakers_rule() -> None:
    audit = [{"at_ms": 1000, "action": "add", "actor": None},
             {"at_ms": 2000, "action": "opened", "actor": "breaker"},
             {"at_ms": 7000, "action": "reopened", "actor": "breaker"},
             {"at_ms": 17000, "action": "reopened", "actor": "breaker"},
             {"at_ms": 37000, "action": "closed", "actor": "breaker"},
             {"at_ms": 40000, "action": "opened", "actor": "breaker"}]
    assert breaker_cooldowns(audit) == [(2000, "opened", 5000), (7000, "reopened", 10000),
                                        (17000, "reopened", 20000), (37000, "closed", 0),
                                        (40000, "opened", 5000)]
    assert bench._cooldown_at(breaker_cooldowns(audit), 20_000) == 20000
    assert bench._cooldown_at(breaker_cooldowns(audit), 1_500) is None


def test_requests_at_once() -> None:
    assert bench._most_at_once([]) == 0
    assert bench._most_at_once([(0.0, 1.0), (1.0, 2.0)]) == 1  # one ends as the next starts
    assert bench._most_at_once([(0.0, 1.0), (0.5, 2.0), (0.7, 0.8)]) == 3


def test_only_the_scenarios_measured_are_judged() -> None:
    assert [key for key, *_ in judge_breaker({"shared": GOOD["shared"]})] == ["shared"]
    assert judge_breaker({}) == []


def test_the_printed_verdict_is_the_judged_one() -> None:
    out = io.StringIO()
    print_breaker_table(_with(("outage", "log_lines"), 149), out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("  ")
             and not line.startswith("  outage")]
    assert len(lines) == 7
    assert [line[2:9] for line in lines] == ["met    ", "not met", "met    ", "met    ",
                                             "met    ", "met    ", "met    "]
    assert "149 records" in lines[1]
