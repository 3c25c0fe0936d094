"""A claimed delivery given back unsent (``Store.release_jobs``), on every
store: pending again with no attempt spent, fenced by its ticket, counted in
its endpoint's attempts saved when its circuit was the reason, and claimed
again only when the circuit lets it."""

from __future__ import annotations

import pytest

from lease.breaker import BREAKER
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.helpers import body_event, history, job
from tests.support.queues import T0

URL = "http://127.0.0.1:9/events"
POLICY = RetryPolicy(max_attempts=3, ttl_ms=86_400_000)
REFUSED = Attempt(T0, 3, None, "connection refused by 127.0.0.1:9")
LEASE_MS = 30_000


def setup(store, n: int = 10, policy: RetryPolicy = POLICY, key: str | None = None) -> None:
    store.add_endpoint(Endpoint("down", URL), now_ms=T0)
    events = [body_event(f"m{i}", n=i) for i in range(n)]
    if key is not None:
        events = [{**event, "key": key} for event in events]
    store.enqueue_events(events, policy, now_ms=T0)


def claim(store, now: int, limit: int = 100) -> list:
    return store.claim_jobs("w1", LEASE_MS, limit, now_ms=now, endpoints="*").leased


def saved(store) -> int:
    return int(store.endpoints()[0]["circuit"]["attempts_saved"])


def test_a_release_gives_the_delivery_back_as_it_was_before_its_claim(store):
    setup(store, n=3)
    before = {row["id"]: row for row in store.jobs_with_status("pending")}
    leased = claim(store, T0 + 10)
    assert len(leased) == 3
    tickets = [one.ticket for one in leased]
    assert store.release_jobs(tickets[:2], reason="unsent", now_ms=T0 + 20) == [True, True]
    for ticket in tickets[:2]:
        row = job(store, ticket["id"])
        was = before[ticket["id"]]
        assert (row["status"], row["attempts"], row["owner"], row["lease_until"]) == (
            "pending", 0, None, None)
        # its token kept (the released ticket stays stale), its place kept
        assert (row["token"], row["available_at"], row["reason"]) == (
            ticket["token"], was["available_at"], was["reason"])
        assert history(store, ticket["id"])["attempts"] == []  # nothing was sent
    assert job(store, tickets[2]["id"])["status"] == "leased"
    assert saved(store) == 0  # "unsent" counts nowhere
    again = claim(store, T0 + 30)
    assert sorted(one.ticket["id"] for one in again) == sorted(t["id"] for t in tickets[:2])
    for one in again:  # the same attempt number, a new token
        assert one.ticket["attempt"] == 1 and one.ticket["token"] == 2
    # the released ticket finishes nothing
    [stale] = store.finish_jobs([(tickets[0], "ok", 0, Attempt(T0 + 40, 3, 200))],
                                now_ms=T0 + 40)
    assert stale is False


def test_a_stale_ticket_changes_nothing_and_says_so(store):
    setup(store, n=4)
    leased = claim(store, T0 + 10)
    first, second, third, fourth = (one.ticket for one in leased)
    store.finish_jobs([(second, "ok", 0, Attempt(T0 + 10, 3, 200))], now_ms=T0 + 15)
    wrong_token = {**third, "token": third["token"] + 1}
    unknown = {**first, "id": "m99@down"}
    results = store.release_jobs([first, first, second, wrong_token, unknown],
                                 reason="unsent", now_ms=T0 + 20)
    assert results == [True, False, False, False, False]
    assert job(store, second["id"])["status"] == "done"
    assert (job(store, third["id"])["status"], job(store, third["id"])["attempts"]) == (
        "leased", 1)
    # a lease that has run out is no longer the ticket's to give back
    ended = fourth["lease_until"]
    assert store.release_jobs([fourth], reason="unsent", now_ms=ended) == [False]
    assert job(store, fourth["id"])["status"] == "leased"
    assert store.release_jobs([], reason="unsent", now_ms=T0 + 30) == []


def test_the_attempt_given_back_is_not_spent_from_the_budget(store):
    setup(store, n=1, policy=RetryPolicy(max_attempts=1, ttl_ms=86_400_000))
    for k in range(3):  # claimed and released again and again: never exhausted
        [one] = claim(store, T0 + 10 + k)
        assert one.ticket["attempt"] == 1
        assert store.release_jobs([one.ticket], reason="unsent", now_ms=T0 + 10 + k) == [True]
    [one] = claim(store, T0 + 20)
    store.finish_jobs([(one.ticket, "ok", 0, Attempt(T0 + 20, 3, 200))], now_ms=T0 + 21)
    assert (job(store, one.ticket["id"])["status"], store.counts()["dead"]) == ("done", 0)


def test_released_for_the_circuit_counts_as_saved_and_waits_for_the_probe(store):
    setup(store, n=10)
    leased = claim(store, T0 + 10)
    failing, waiting = leased[:5], leased[5:]
    store.finish_jobs([(one.ticket, "retry", 60_000, REFUSED._replace(started_ms=T0 + 10))
                       for one in failing], now_ms=T0 + 11)
    assert store.endpoints()[0]["circuit"]["state"] == "open"
    assert store.release_jobs([one.ticket for one in waiting], reason="circuit",
                              now_ms=T0 + 12) == [True] * 5
    assert saved(store) == 5
    # due at once, but the circuit is open: no claim takes them until the cool-down ends
    assert claim(store, T0 + 11 + BREAKER.cooldown_ms - 1) == []
    [probe] = claim(store, T0 + 11 + BREAKER.cooldown_ms)
    assert probe.ticket["id"] in {one.ticket["id"] for one in waiting}
    assert probe.ticket["attempt"] == 1  # its first attempt: the release spent none


def test_the_first_of_an_ordering_line_stays_first(store):
    setup(store, n=3, key="k")
    [first] = claim(store, T0 + 10)
    assert store.release_jobs([first.ticket], reason="unsent", now_ms=T0 + 11) == [True]
    [again] = claim(store, T0 + 12)
    assert again.ticket["id"] == first.ticket["id"]


def test_a_job_of_the_queue_of_its_own_is_released_too(store):
    store.enqueue_events([{"id": "j1", "qty": 1}], POLICY, now_ms=T0)
    [one] = store.claim_jobs("w1", LEASE_MS, 1, now_ms=T0 + 1).leased
    assert store.release_jobs([one.ticket], reason="circuit", now_ms=T0 + 2) == [True]
    assert (job(store, "j1")["status"], job(store, "j1")["attempts"]) == ("pending", 0)


@pytest.mark.parametrize("tickets, reason", [
    ([{"id": "x"}], "unsent"),
    ("not a list", "unsent"),
    ([], "tired"),
])
def test_bad_arguments_are_refused(store, tickets, reason):
    with pytest.raises(ValueError):
        store.release_jobs(tickets, reason=reason, now_ms=T0)
