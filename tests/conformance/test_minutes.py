"""The per-minute rollup, on every store: each finish adds its outcomes (done,
retried, dead) and its send latencies to its minute's row for its endpoint
('' for the queue's own jobs), in its own transaction; a stale finish and an
evidence-only item add nothing; rows of several dispatchers sum; prune
deletes the minutes before its cutoff."""

from __future__ import annotations

import pytest

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.rules import LATENCY_BOUNDS_MS, MINUTE_MS
from tests.conformance.helpers import body_event
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=2, ttl_ms=3_600_000)
MINUTE = T0 - T0 % MINUTE_MS
EMPTY = [0] * (len(LATENCY_BOUNDS_MS) + 1)


def buckets(**at: int) -> list[int]:
    """A histogram with ``at`` as {"b<index>": count}."""
    out = list(EMPTY)
    for name, count in at.items():
        out[int(name[1:])] = count
    return out


def test_a_finish_adds_its_outcomes_and_latencies_to_its_minute(store):
    store.enqueue_events([body_event(f"j{i}", n=i) for i in range(4)], POLICY, now_ms=MINUTE)
    ok, again, bad, evidence = store.claim_jobs("d1", 120_000, 4, now_ms=MINUTE).leased
    store.finish_jobs([(ok.ticket, "ok", 0, Attempt(MINUTE, 4, 200)),
                       (again.ticket, "retry", 0, Attempt(MINUTE, 70, 503)),
                       (bad.ticket, "permanent", 0, Attempt(MINUTE, None, None, "refused")),
                       (evidence.ticket, None, 0, Attempt(MINUTE, 1, 200))],
                      now_ms=MINUTE + 59_999)
    assert store.minutes(MINUTE) == [
        {"minute_ms": MINUTE, "endpoint": "", "done": 1, "retried": 1, "dead": 1,
         "buckets": buckets(b2=1, b6=1)}]  # 4 ms <= 5; 70 ms <= 100
    assert store.minutes(MINUTE + MINUTE_MS) == []


def test_minutes_of_several_dispatchers_sum_per_endpoint(store):
    store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/c", types=("user",)), now_ms=T0)
    store.enqueue_events([{**body_event(f"m{i}", n=i), "type": "user"} for i in range(2)],
                         POLICY, now_ms=MINUTE)
    first = store.claim_jobs("d1", 30_000, 1, now_ms=MINUTE, endpoints="*").leased
    second = store.claim_jobs("d2", 30_000, 1, now_ms=MINUTE, endpoints="*").leased
    for leased in (first, second):
        store.finish_jobs([(one.ticket, "ok", 0, Attempt(MINUTE, 100_000, 200))
                           for one in leased], now_ms=MINUTE + 1)
    assert [(row["endpoint"], row["done"], row["buckets"][-1])
            for row in store.minutes(MINUTE)] == [("crm", 2, 2)]  # 100 s: above the last
    assert [row["done"] for row in store.minutes(MINUTE, "crm")] == [2]
    assert store.minutes(MINUTE, "") == []


def test_a_stale_finish_adds_nothing(store):
    store.enqueue_events([body_event("a", n=1)], POLICY, now_ms=MINUTE)
    [one] = store.claim_jobs("d1", 1_000, 1, now_ms=MINUTE).leased
    store.claim_jobs("d2", 30_000, 1, now_ms=MINUTE + 2_000)  # the lease ran out: taken
    assert store.finish_jobs([(one.ticket, "ok", 0, Attempt(MINUTE, 5, 200))],
                             now_ms=MINUTE + 3_000) == [False]
    assert store.minutes(MINUTE) == []


def test_prune_deletes_the_minutes_before_its_cutoff(store):
    store.enqueue_events([body_event("a", n=1), body_event("b", n=2)], POLICY, now_ms=MINUTE)
    a, b = store.claim_jobs("d1", 600_000, 2, now_ms=MINUTE).leased
    store.finish_jobs([(a.ticket, "ok", 0, Attempt(MINUTE, 5, 200))], now_ms=MINUTE)
    later = MINUTE + 5 * MINUTE_MS
    store.finish_jobs([(b.ticket, "ok", 0, Attempt(later, 5, 200))], now_ms=later)
    assert store.prune_done(MINUTE + MINUTE_MS) == 1
    assert [row["minute_ms"] for row in store.minutes(0)] == [later]


@pytest.mark.parametrize("since, endpoint", [(-1, None), (T0, "bad name!"), (T0, 5)])
def test_a_bad_query_is_refused(store, since, endpoint):
    with pytest.raises(ValueError):
        store.minutes(since, endpoint)
