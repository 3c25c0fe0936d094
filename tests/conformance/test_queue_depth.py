"""The queue's depth, on every store: what a metrics scrape reads (jobs by
status, how many are ready now and the oldest's age, the blocked keys, and
the same per endpoint), the same figures on SQLite and PostgreSQL.

Every call passes ``now_ms``: "ready now" and an age are judged by the values
the test gives, never by the machine's clock."""

from __future__ import annotations

import pytest

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.helpers import body_event
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=5, ttl_ms=3_600_000)
ZERO = {"pending": 0, "leased": 0, "done": 0, "dead": 0}


def keyed(job_id: str, key: str | None, event_type: str | None = None) -> dict:
    event = body_event(job_id, n=1)
    if key is not None:
        event["key"] = key
    if event_type is not None:
        event["type"] = event_type
    return event


def finish(store, leased, outcome: str, now: int, delay: int = 0) -> None:
    store.finish_jobs([(one.ticket, outcome, delay, Attempt(now, 1, 200 if outcome == "ok"
                                                            else 500)) for one in leased],
                      now_ms=now)


def test_an_empty_queue_is_all_zeros_and_no_age(store):
    assert store.queue_depth(T0) == {"by_status": ZERO, "ready": 0,
                                     "oldest_ready_age_ms": None, "blocked_keys": 0,
                                     "endpoints": []}


def test_the_queues_own_jobs_by_status_ready_now_and_the_oldest_age(store):
    store.enqueue_events([keyed("a", None), keyed("b", None)], POLICY, now_ms=T0)
    store.enqueue_events([keyed("later", None)], POLICY, now_ms=T0 + 10,
                         not_before_ms=T0 + 60_000)
    store.enqueue_events([keyed("c", None), keyed("d", None)], POLICY, now_ms=T0 + 20)
    leased = store.claim_jobs("w", 30_000, 2, now_ms=T0 + 100).leased
    assert sorted(one.ticket["id"] for one in leased) == ["a", "b"]
    finish(store, leased[:1], "ok", T0 + 200)
    depth = store.queue_depth(T0 + 1000)
    assert depth["by_status"] == {"pending": 3, "leased": 1, "done": 1, "dead": 0}
    # "later" is pending but not due: not ready, and not the oldest ready
    assert (depth["ready"], depth["oldest_ready_age_ms"]) == (2, 1000 - 20)
    # once it is due it counts, and the age runs with the clock given
    later = store.queue_depth(T0 + 60_000)
    assert (later["ready"], later["oldest_ready_age_ms"]) == (3, 60_000 - 20)
    # a retry waiting out its delay is pending, not ready
    finish(store, leased[1:], "retry", T0 + 300, delay=100_000)
    again = store.queue_depth(T0 + 1000)
    assert again["by_status"]["pending"] == 4 and again["ready"] == 2


def test_blocked_keys_are_the_keys_whose_first_is_dead(store):
    store.enqueue_events([keyed("k-1", "k"), keyed("k-2", "k"), keyed("o-1", "o"),
                          keyed("free", None)], POLICY, now_ms=T0)
    leased = {one.ticket["id"]: one for one in store.claim_jobs("w", 30_000, 10,
                                                                 now_ms=T0).leased}
    assert sorted(leased) == ["free", "k-1", "o-1"]
    finish(store, [leased["k-1"], leased["free"]], "permanent", T0 + 1)
    finish(store, [leased["o-1"]], "ok", T0 + 1)
    depth = store.queue_depth(T0 + 2)
    assert depth["blocked_keys"] == 1
    assert depth["by_status"] == {"pending": 1, "leased": 0, "done": 1, "dead": 2}
    # k-2 waits behind its dead head: pending and due, but no claim may take it:
    # not ready, so the oldest ready age does not grow with a blocked key
    assert (depth["ready"], depth["oldest_ready_age_ms"]) == (0, None)
    assert store.cancel_jobs(["k-1"], "give up", now_ms=T0 + 3) == [True]
    after = store.queue_depth(T0 + 4)
    assert (after["blocked_keys"], after["ready"], after["oldest_ready_age_ms"]) == (0, 1, 4)


def test_per_endpoint_figures_every_endpoint_listed_its_state_and_its_deliveries(store):
    store.add_endpoint(Endpoint("billing", "http://127.0.0.1:9/b", types=("invoice",)),
                       now_ms=T0)
    store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/c"), now_ms=T0)
    store.add_endpoint(Endpoint("idle", "http://127.0.0.1:9/i", types=("never",)),
                       now_ms=T0)
    store.enqueue_events([keyed("m1", None, "invoice"), keyed("m2", None, "user")], POLICY,
                         now_ms=T0)
    leased = store.claim_jobs("w", 30_000, 10, now_ms=T0 + 10, endpoints=("crm",)).leased
    assert sorted(one.ticket["id"] for one in leased) == ["m1@crm", "m2@crm"]
    finish(store, [one for one in leased if one.ticket["id"] == "m1@crm"], "ok", T0 + 20)
    store.update_endpoint("billing", {"enabled": False}, now_ms=T0 + 30)

    depth = store.queue_depth(T0 + 100)
    # the totals hold every delivery
    assert depth["by_status"] == {"pending": 1, "leased": 1, "done": 1, "dead": 0}
    assert (depth["ready"], depth["oldest_ready_age_ms"]) == (1, 100)
    assert depth["endpoints"] == [
        {"name": "billing", "enabled": False, "circuit": "closed",
         "by_status": {**ZERO, "pending": 1}, "ready": 1, "oldest_ready_age_ms": 100},
        {"name": "crm", "enabled": True, "circuit": "closed",
         "by_status": {**ZERO, "leased": 1, "done": 1}, "ready": 0,
         "oldest_ready_age_ms": None},
        {"name": "idle", "enabled": True, "circuit": "closed", "by_status": ZERO,
         "ready": 0, "oldest_ready_age_ms": None},
    ]


def test_a_bad_now_is_refused(store):
    with pytest.raises(ValueError):
        store.queue_depth(-1)
