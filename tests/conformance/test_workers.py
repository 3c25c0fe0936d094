"""The dispatchers at work, on every store: each claim records its owner's
last claim (an empty one only once a beat), a registration its host and pid,
the live leases counted per owner, and a dispatcher not seen for a day
hidden, then deleted by prune."""

from __future__ import annotations

import pytest

from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.rules import WORKER_BEAT_MS, WORKERS_KEPT_MS
from tests.conformance.helpers import body_event
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=5, ttl_ms=3 * WORKERS_KEPT_MS)


def by_owner(store, now_ms: int) -> dict[str, dict]:
    return {row["owner"]: row for row in store.workers(now_ms)}


def test_a_claim_records_its_owner_and_a_registration_its_host(store):
    assert store.workers(T0) == []
    store.register_worker("d1", "host-a", 4242, now_ms=T0)
    store.enqueue_events([body_event(f"j{i}", n=i) for i in range(3)], POLICY, now_ms=T0)
    store.claim_jobs("d1", 30_000, 2, now_ms=T0 + 5)
    store.claim_jobs("d2", 30_000, 5, now_ms=T0 + 6)  # never registered
    assert store.workers(T0 + 7) == [
        {"owner": "d1", "host": "host-a", "pid": 4242, "started_ms": T0,
         "last_claim_ms": T0 + 5, "last_claimed": 2, "live_leases": 2},
        {"owner": "d2", "host": None, "pid": None, "started_ms": None,
         "last_claim_ms": T0 + 6, "last_claimed": 1, "live_leases": 1}]


def test_live_leases_are_the_ones_not_finished_nor_run_out(store):
    store.enqueue_events([body_event(f"j{i}", n=i) for i in range(3)], POLICY, now_ms=T0)
    leased = store.claim_jobs("d1", 30_000, 3, now_ms=T0).leased
    store.finish_jobs([(leased[0].ticket, "ok", 0, Attempt(T0, 1, 200))], now_ms=T0 + 1)
    assert by_owner(store, T0 + 2)["d1"]["live_leases"] == 2
    assert by_owner(store, T0 + 30_000)["d1"]["live_leases"] == 0  # run out


def test_an_empty_claim_writes_only_once_a_beat(store):
    store.enqueue_events([body_event("a", n=1)], POLICY, now_ms=T0)
    store.claim_jobs("d1", 30_000, 1, now_ms=T0)
    store.claim_jobs("d1", 30_000, 1, now_ms=T0 + 1)  # nothing left: within the beat
    assert (by_owner(store, T0 + 2)["d1"]["last_claim_ms"],
            by_owner(store, T0 + 2)["d1"]["last_claimed"]) == (T0, 1)
    store.claim_jobs("d1", 30_000, 1, now_ms=T0 + WORKER_BEAT_MS)
    row = by_owner(store, T0 + WORKER_BEAT_MS)["d1"]
    assert (row["last_claim_ms"], row["last_claimed"]) == (T0 + WORKER_BEAT_MS, 0)


def test_a_paused_claim_is_still_seen_as_a_sign_of_life(store):
    store.pause("hold", now_ms=T0)
    store.claim_jobs("d1", 30_000, 1, now_ms=T0 + 1)
    assert by_owner(store, T0 + 2)["d1"]["last_claim_ms"] == T0 + 1


def test_a_dispatcher_not_seen_for_a_day_is_hidden_then_pruned(store):
    store.register_worker("old", "h", 1, now_ms=T0)
    store.claim_jobs("new", 30_000, 1, now_ms=T0 + WORKERS_KEPT_MS)
    assert set(by_owner(store, T0 + WORKERS_KEPT_MS)) == {"old", "new"}
    later = T0 + WORKERS_KEPT_MS + 1
    assert set(by_owner(store, later)) == {"new"}
    store.enqueue_events([body_event("a", n=1)], POLICY, now_ms=T0)
    [one] = store.claim_jobs("new", 30_000, 1, now_ms=later).leased
    store.finish_jobs([(one.ticket, "ok", 0, Attempt(later, 1, 200))], now_ms=later)
    assert store.prune_done(later + 1) == 1
    assert set(by_owner(store, T0)) == set()  # both gone: neither seen since the cutoff


def test_a_registration_again_replaces_host_and_pid(store):
    store.register_worker("d1", "host-a", 1, now_ms=T0)
    store.register_worker("d1", "host-b", 2, now_ms=T0 + 1)
    row = by_owner(store, T0 + 2)["d1"]
    assert (row["host"], row["pid"], row["started_ms"]) == ("host-b", 2, T0 + 1)


@pytest.mark.parametrize("owner, host, pid", [("", "h", 1), ("d", "", 1), ("d", "a\nb", 1),
                                              ("d", "h", -1), ("d", "h", "1")])
def test_a_bad_registration_is_refused(store, owner, host, pid):
    with pytest.raises(ValueError):
        store.register_worker(owner, host, pid, now_ms=T0)
    assert store.workers(T0) == []
