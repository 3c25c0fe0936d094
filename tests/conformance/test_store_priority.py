"""Priorities within a queue, on every store: an event's ``priority`` (an
int in -100..100, 0 when absent) decides which of the jobs a claim may
lease it takes first, the higher first; within a priority the order is the
one without priorities (seq for the queue's own jobs; for an endpoint's
deliveries the time they became due, then seq). An ordering key's line
stays in intake order: a later job of a key never overtakes its head,
whatever its priority. Endpoints keep their fair turns: the priority orders
each endpoint's deliveries, not the rotation across endpoints."""

from __future__ import annotations

from typing import Any

import pytest

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.store import Store
from tests.support.queues import T0

from .helpers import job, job_rows, tickets_of

POLICY = RetryPolicy(max_attempts=5, ttl_ms=600_000)


def event(job_id: str, priority: int | None = None, key: str | None = None,
          **more: Any) -> dict:
    found: dict[str, Any] = {"id": job_id, "qty": 1, **more}
    if priority is not None:
        found["priority"] = priority
    if key is not None:
        found["key"] = key
    return found


def enqueue(store: Store, *events: dict, now: int = T0) -> None:
    assert store.enqueue_events(list(events), POLICY, now_ms=now) == [True] * len(events)


def claim(store: Store, now: int, limit: int = 100, endpoints: Any = None,
          lease_ms: int = 60_000) -> list[dict]:
    return tickets_of(store.claim_jobs("w", lease_ms, limit, now_ms=now, endpoints=endpoints))


def ids(tickets: list[dict]) -> list[str]:
    return [ticket["id"] for ticket in tickets]


def finish(store: Store, ticket: dict, outcome: str, now: int, delay: int = 0) -> object:
    [result] = store.finish_jobs([(ticket, outcome, delay, Attempt(now))], now_ms=now)
    return result


# ----------------------------------------------------------------- the queue's own jobs


def test_the_higher_priority_is_claimed_first(store):
    enqueue(store, event("zero"), event("five", 5), event("low", -3), event("five-b", 5),
            event("top", 100), event("bottom", -100))
    assert ids(claim(store, T0, limit=2)) == ["top", "five"]  # the batch itself, not its order
    assert ids(claim(store, T0 + 1)) == ["five-b", "zero", "low", "bottom"]


def test_within_one_priority_the_claim_keeps_intake_order(store):
    names = ["m", "c", "x", "a", "q", "b"]
    enqueue(store, *(event(name, 7) for name in names), event("plain"))
    taken = [ids(claim(store, T0 + i, limit=1)) for i in range(len(names) + 1)]
    assert taken == [[name] for name in [*names, "plain"]]


def test_a_job_not_due_yet_waits_whatever_its_priority(store):
    enqueue(store, event("urgent", 50), event("plain"))
    [urgent] = claim(store, T0, limit=1)
    assert finish(store, urgent, "retry", T0 + 1, delay=5000) == ("pending", "retry")
    assert ids(claim(store, T0 + 2)) == ["plain"]
    assert ids(claim(store, T0 + 5001)) == ["urgent"]


def test_a_key_s_head_blocks_its_later_high_priority_job(store):
    enqueue(store, event("k-1", key="k"), event("k-2", 100, key="k"), event("free"))
    first = claim(store, T0, limit=1)
    assert ids(first) == ["k-1"]  # the head, though k-2 has the higher priority
    assert ids(claim(store, T0 + 1)) == ["free"]  # k-2 waits behind the leased k-1
    assert finish(store, first[0], "ok", T0 + 2) == ("done", None)
    assert ids(claim(store, T0 + 3)) == ["k-2"]


def test_a_priority_survives_a_retry_and_a_redrive(store):
    enqueue(store, event("plain"), event("urgent", 9))
    [urgent] = claim(store, T0, limit=1)
    assert urgent["id"] == "urgent"
    assert finish(store, urgent, "retry", T0 + 1) == ("pending", "retry")
    assert job(store, "urgent")["priority"] == 9
    [again] = claim(store, T0 + 2, limit=1)
    assert again["id"] == "urgent"
    assert finish(store, again, "permanent", T0 + 3) == ("dead", "permanent")
    assert store.redrive_jobs(["urgent"], 600_000, "fixed", now_ms=T0 + 4) == [True]
    assert job(store, "urgent")["priority"] == 9
    assert ids(claim(store, T0 + 5)) == ["urgent", "plain"]


@pytest.mark.parametrize("bad", [True, False, 101, -101, "1", 1.0, None, 2**63])
def test_a_bad_priority_refuses_the_whole_batch(store, bad):
    with pytest.raises(ValueError, match="priority"):
        store.enqueue_events([event("good", 3), {"id": "bad", "qty": 1, "priority": bad}],
                             POLICY, now_ms=T0)
    assert job_rows(store) == []


def test_a_duplicate_keeps_the_first_intake_s_priority(store):
    """The priority is how a job is scheduled, not its content (as a delay
    is not): a resent event is a duplicate whatever its priority."""
    enqueue(store, event("a", 4))
    assert store.enqueue_events([event("a", 90)], POLICY, now_ms=T0) == [False]
    assert job(store, "a")["priority"] == 4


def test_the_rows_show_each_job_s_priority(store):
    enqueue(store, event("a"), event("b", -7), {"id": "c", "body": {"n": 1}, "priority": 12})
    assert [(row["id"], row["priority"]) for row in store.list_jobs()] == [
        ("a", 0), ("b", -7), ("c", 12)]


# ----------------------------------------------------------------- endpoints


def _endpoints(store: Store, *names: str) -> None:
    for name in names:
        store.add_endpoint(Endpoint(name, "http://127.0.0.1:9/events"), now_ms=T0)


def messages(leased: list[dict], store: Store) -> list[tuple[str, str]]:
    """(endpoint, message) of each leased delivery, in the order returned."""
    return [(job(store, t["id"])["endpoint"], job(store, t["id"])["message"]) for t in leased]


def test_each_delivery_inherits_its_message_s_priority(store):
    _endpoints(store, "e1", "e2")
    enqueue(store, event("m", 6))
    assert sorted((row["endpoint"], row["priority"]) for row in job_rows(store)) == [
        ("e1", 6), ("e2", 6)]


def test_an_endpoint_s_deliveries_are_claimed_the_higher_priority_first(store):
    _endpoints(store, "e1", "e2")
    enqueue(store, event("m1"), event("m2", 7), event("m3"), event("m4", 7))
    first = claim(store, T0, limit=2, endpoints="*")  # one each: the rotation's equal shares
    assert sorted(messages(first, store)) == [("e1", "m2"), ("e2", "m2")]
    assert messages(claim(store, T0 + 1, limit=3, endpoints=("e1",)), store) == [
        ("e1", "m4"), ("e1", "m1"), ("e1", "m3")]


def test_within_a_priority_an_endpoint_s_deliveries_go_in_the_order_they_became_due(store):
    _endpoints(store, "e1")
    enqueue(store, event("m1", 5), event("m2", 5))
    [m1] = claim(store, T0, limit=1, endpoints="*")
    assert messages([m1], store) == [("e1", "m1")]
    assert finish(store, m1, "retry", T0 + 1, delay=100) == ("pending", "retry")
    # both due now: m2 since T0, m1 since T0 + 101 (seq alone would take m1)
    assert messages(claim(store, T0 + 200, limit=1, endpoints="*"), store) == [("e1", "m2")]


def test_the_rotation_stays_fair_across_endpoints_whatever_their_priorities(store):
    _endpoints(store, "calm", "busy")
    store.update_endpoint("calm", {"types": ["calm"]}, now_ms=T0)
    store.update_endpoint("busy", {"types": ["busy"]}, now_ms=T0)
    enqueue(store, event("c1", type="calm"), *(event(f"b{i}", 90, type="busy")
                                              for i in range(3)))
    leased = claim(store, T0, limit=2, endpoints="*")
    assert sorted(messages(leased, store)) == [("busy", "b0"), ("calm", "c1")]
    assert messages(leased, store)[0] == ("busy", "b0")  # returned the higher priority first


def test_a_key_s_head_blocks_its_later_high_priority_delivery(store):
    _endpoints(store, "e1")
    enqueue(store, event("k1", key="k"), event("k2", 100, key="k"), event("free"))
    first = claim(store, T0, limit=1, endpoints="*")
    assert messages(first, store) == [("e1", "k1")]
    assert messages(claim(store, T0 + 1, endpoints="*"), store) == [("e1", "free")]
    assert finish(store, first[0], "ok", T0 + 2) == ("done", None)
    assert messages(claim(store, T0 + 3, endpoints="*"), store) == [("e1", "k2")]
