"""The rollup's pure rules: a finish's additions per (minute, endpoint,
owner), the rows summed over owners, and percentiles from the buckets."""

from __future__ import annotations

from lease.records import Attempt
from lease.rules import LATENCY_BOUNDS_MS, minute_rollup, minute_rows, percentiles

N = len(LATENCY_BOUNDS_MS) + 1


def ticket(job_id: str, owner: str = "d1") -> dict:
    return {"id": job_id, "owner": owner, "token": 1, "attempt": 1, "lease_until": 1}


def test_a_finish_is_grouped_by_endpoint_and_owner_in_sorted_order():
    items = [(ticket("a"), "ok", 0, Attempt(0, 1)), (ticket("b", "d2"), "ok", 0, Attempt(0, 2)),
             (ticket("c"), "retry", 0, Attempt(0, 60_001)), (ticket("d"), "ok", 0, Attempt(0)),
             (ticket("e"), None, 0, Attempt(0, 1)), (ticket("f"), "ok", 0, Attempt(0, 1))]
    results = [("done", None), ("done", None), ("pending", None), ("dead", "exhausted"),
               ("leased", None), False]
    rows = minute_rollup(items, results, {"b": "crm"}, 125_000)
    first = [0] * N
    first[0], first[-1] = 1, 1
    assert rows == [(120_000, "", "d1", 1, 1, 1, *first),
                    (120_000, "crm", "d2", 1, 0, 0, *([0, 1] + [0] * (N - 2)))]


def test_rows_sum_over_owners():
    one = (60_000, "", "d1", 1, 0, 0, *([1] + [0] * (N - 1)))
    two = (60_000, "", "d2", 2, 1, 0, *([1] + [0] * (N - 1)))
    assert minute_rows([one, two]) == [{"minute_ms": 60_000, "endpoint": "", "done": 3,
                                        "retried": 1, "dead": 0,
                                        "buckets": [2] + [0] * (N - 1)}]


def test_percentiles_are_the_upper_bounds_of_their_buckets():
    assert percentiles([0] * N) == [None, None, None]
    histogram = [0] * N
    histogram[2], histogram[6], histogram[-1] = 60, 49, 1  # <= 5 ms, <= 100 ms, above 60 s
    assert percentiles(histogram) == [5, 100, 100]
    histogram[-1] = 10
    assert percentiles(histogram) == [5, 100, None]  # p99 above the last bound
