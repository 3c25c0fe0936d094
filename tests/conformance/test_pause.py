"""The queue's pause, on every store: while paused every claim (the queue's
own jobs and the deliveries) leases nothing and changes nothing, its
quarantine included; leases taken before run to their end; each pause and
resume is audited; a repeated one changes nothing."""

from __future__ import annotations

import pytest

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.helpers import body_event, job
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=5, ttl_ms=60_000)


def test_a_new_queue_is_not_paused_and_has_no_audit(store):
    assert store.paused() is None
    assert store.queue_audit() == []


def test_a_paused_queue_leases_none_of_its_own_jobs_until_resumed(store):
    store.enqueue_events([body_event("a", n=1), body_event("b", n=2)], POLICY, now_ms=T0)
    assert store.pause("deploying the receiver", actor="ops", now_ms=T0 + 1) is True
    assert store.paused() == {"since_ms": T0 + 1, "actor": "ops",
                              "note": "deploying the receiver"}
    claimed = store.claim_jobs("w", 30_000, 10, now_ms=T0 + 2)
    assert claimed.leased == [] and claimed.moved == {"deadline": 0, "exhausted": 0}
    assert store.counts()["pending"] == 2
    assert store.resume("receiver is back", now_ms=T0 + 3) is True
    assert store.paused() is None
    leased = store.claim_jobs("w", 30_000, 10, now_ms=T0 + 4).leased
    assert sorted(one.ticket["id"] for one in leased) == ["a", "b"]


def test_a_paused_claim_of_deliveries_leases_none(store):
    store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/c"), now_ms=T0)
    store.enqueue_events([{**body_event("m1", n=1), "type": "user"}], POLICY, now_ms=T0)
    store.pause("hold", now_ms=T0 + 1)
    assert store.claim_jobs("w", 30_000, 10, now_ms=T0 + 2, endpoints="*").leased == []
    store.resume("go", now_ms=T0 + 3)
    [one] = store.claim_jobs("w", 30_000, 10, now_ms=T0 + 4, endpoints="*").leased
    assert one.endpoint == "crm"


def test_a_paused_claim_changes_nothing_not_even_its_quarantine(store):
    store.enqueue_events([body_event("old", n=1)], POLICY, now_ms=T0)
    store.pause("hold", now_ms=T0 + 1)
    past_deadline = T0 + POLICY.ttl_ms + 1
    claimed = store.claim_jobs("w", 30_000, 10, now_ms=past_deadline)
    assert claimed.moved == {"deadline": 0, "exhausted": 0}
    assert job(store, "old")["status"] == "pending"
    store.resume("go", now_ms=past_deadline + 1)
    claimed = store.claim_jobs("w", 30_000, 10, now_ms=past_deadline + 2)
    assert claimed.moved["deadline"] == 1 and job(store, "old")["status"] == "dead"


def test_a_lease_taken_before_the_pause_still_finishes(store):
    store.enqueue_events([body_event("a", n=1)], POLICY, now_ms=T0)
    [one] = store.claim_jobs("w", 30_000, 1, now_ms=T0 + 1).leased
    store.pause("hold", now_ms=T0 + 2)
    [finished] = store.finish_jobs([(one.ticket, "ok", 0, Attempt(T0 + 1, 5, 200))],
                                   now_ms=T0 + 3)
    assert finished[0] == "done" and job(store, "a")["status"] == "done"


def test_each_change_is_audited_and_a_repeated_one_changes_nothing(store):
    assert store.pause("first", actor="ann", now_ms=T0) is True
    assert store.pause("again", actor="bob", now_ms=T0 + 1) is False
    assert store.paused() == {"since_ms": T0, "actor": "ann", "note": "first"}
    assert store.resume("back", actor="bob", now_ms=T0 + 2) is True
    assert store.resume("back again", now_ms=T0 + 3) is False
    assert store.queue_audit() == [
        {"at_ms": T0, "action": "pause", "note": "first", "actor": "ann"},
        {"at_ms": T0 + 2, "action": "resume", "note": "back", "actor": "bob"}]


@pytest.mark.parametrize("note, actor", [("", None), ("a\nb", None), ("ok", "x\x00")])
def test_a_bad_note_or_actor_is_refused_and_nothing_changes(store, note, actor):
    with pytest.raises(ValueError):
        store.pause(note, actor=actor, now_ms=T0)
    assert store.paused() is None and store.queue_audit() == []


def test_a_pause_holds_for_every_store_on_the_queue(make_store):
    first, second = make_store(), make_store()
    second.enqueue_events([body_event("a", n=1)], POLICY, now_ms=T0)
    first.pause("hold", now_ms=T0 + 1)
    assert second.claim_jobs("w", 30_000, 1, now_ms=T0 + 2).leased == []
    assert second.paused() is not None
