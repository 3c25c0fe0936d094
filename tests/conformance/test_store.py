"""The contract's rules as every store applies them, through the store interface:
intake (duplicates, conflicts, payloads), claim order and the quarantine's
reasons, the whole-marker fence on extend and finish, budgets and deadlines,
the evidence of every attempt, redrive and cancel with their audit rows,
prune. Each test runs on every store (the ``store`` fixture), with the same
now_ms values."""

from __future__ import annotations

import json
import random

import pytest

from lease.policy import DEFAULT_POLICY, MAX_BODY_BYTES, PRODUCT, RetryPolicy, canonical_body
from lease.records import MAX_ERROR_CHARS, Attempt
from lease.worker import MAX_BATCH, MAX_NOW_MS, Conflict
from tests.support.queues import T0

from .helpers import (
    body_event,
    claim_one,
    dump,
    history,
    job,
    job_rows,
    maybe_claim,
    tickets_of,
)

LAB = {"id": "snack-1", "qty": 4}


def lab(job_id: str, qty: int = 1) -> dict:
    return {"id": job_id, "qty": qty}


def enqueue(store, *events: dict, now: int = T0, ttl: int = 60_000,
            max_attempts: int = 3) -> None:
    policy = RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl)
    assert store.enqueue_events(list(events), policy, now_ms=now) == [True] * len(events)


def finish(store, ticket: dict, outcome: str, now: int, delay: int = 0, **seen: object):
    [result] = store.finish_jobs([(ticket, outcome, delay, Attempt(T0, **seen))], now_ms=now)
    return result


# ----------------------------------------------------------------- intake


def test_a_new_job_is_a_whole_pending_row(store):
    enqueue(store, lab("snack-7", 7), body_event("order:7", n=1), ttl=5000, max_attempts=4)
    [snack, order] = job_rows(store)
    empty = {"owner": None, "lease_until": None, "reason": None, "done_by": None,
             "done_started_ms": None, "done_latency_ms": None, "done_http_status": None,
             "endpoint": None, "message": None, "event_type": None, "trace": None,
             "priority": 0}
    assert snack == {"seq": 1, "id": "snack-7", "qty": 7, "status": "pending", "attempts": 0,
                     "max_attempts": 4, "token": 0, "available_at": T0, "deadline": T0 + 5000,
                     "body": None, "digest": None, "ordering_key": None, "held": 0, **empty}
    text, digest = canonical_body({"n": 1})
    assert order == {**snack, "seq": 2, "id": "order:7", "qty": 0, "body": text,
                     "digest": digest}


def test_a_payload_round_trips_and_a_resend_is_a_duplicate(store):
    body = {"order": 7, "items": [{"sku": "crisps", "n": 2}], "note": "café ✓", "x": 1.5}
    assert store.enqueue_events([body_event("order:7", **body)], now_ms=T0) == [True]
    reordered = dict(reversed(list(body.items())))
    assert store.enqueue_events([{"id": "order:7", "body": reordered}], now_ms=T0 + 5) == [False]
    [leased] = store.claim_jobs("d1", 30_000, now_ms=T0 + 10).leased
    assert leased.body == canonical_body(body)[0]
    assert leased.event == {"id": "order:7", "body": leased.body}
    assert json.loads(leased.body) == body
    assert leased.ticket["qty"] == 0


def test_another_body_for_the_same_id_is_a_conflict(store):
    store.enqueue_events([body_event("tenant/7", a=1)], now_ms=T0)
    before = dump(store, T0)
    [result] = store.enqueue_events([body_event("tenant/7", a=2)], now_ms=T0 + 1)
    assert isinstance(result, Conflict) and "other content" in str(result)
    assert "body sha256" in str(result)
    assert dump(store, T0) == before


def test_a_duplicate_never_resets_the_budget(store):
    store.enqueue_events([body_event("a", v=1)], RetryPolicy(max_attempts=5), now_ms=T0)
    store.claim_jobs("d1", 1000, now_ms=T0 + 1)
    before = dump(store, T0 + 2)
    assert store.enqueue_events([body_event("a", v=1)],
                                RetryPolicy(max_attempts=50, ttl_ms=10**9),
                                now_ms=T0 + 2) == [False]
    assert dump(store, T0 + 2) == before


def test_duplicates_and_conflicts_within_one_call_and_the_rest_go_on(store):
    results = store.enqueue_events(
        [lab("a", 1), lab("a", 1), lab("a", 2), body_event("b", x=1), body_event("b", x=1),
         body_event("b", x=2), lab("c", 3)], now_ms=T0)
    assert results[:2] == [True, False] and results[3:5] == [True, False]
    assert [type(r) for r in (results[2], results[5])] == [Conflict, Conflict]
    assert str(results[2]) == "job 'a' exists with other content (qty 1, not qty 2)"
    assert results[6] is True
    assert [(r["id"], r["qty"]) for r in job_rows(store)] == [("a", 1), ("b", 0), ("c", 3)]


def test_lab_and_payload_events_share_one_queue(store):
    results = store.enqueue_events([LAB, body_event("evt-1", k=1)], now_ms=T0)
    assert results == [True, True]
    [result] = store.enqueue_events([{"id": "snack-1", "qty": 5}], now_ms=T0)
    assert isinstance(result, Conflict)
    claimed = store.claim_jobs("d1", 1000, 5, now_ms=T0)
    assert [leased.event for leased in claimed.leased] == [
        {"id": "snack-1", "qty": 4}, {"id": "evt-1", "body": '{"k":1}'}]


@pytest.mark.parametrize(("event", "message"), [
    ({"id": "a", "body": []}, "JSON object"),
    ({"id": "a", "body": {"x": float("nan")}}, "not JSON"),
    ({"id": "a", "body": {1: "x"}}, "keys must be str"),
    ({"id": "a", "body": {"t": (1, 2)}}, "does not survive"),
    ({"id": "a", "body": {"s": {1, 2}}}, "not JSON"),
    ({"id": "a", "body": {"s": "\ud800"}}, "lone surrogate"),
    ({"id": "a", "body": {"x": "y" * MAX_BODY_BYTES}}, "more than"),
    ({"id": "a b", "body": {}}, "visible ASCII"),
    ({"id": "x" * 256, "body": {}}, "1-255"),
    ({"id": "a", "qty": 0}, "qty"),
    ({"id": "order:1", "qty": 1}, "event id must be 1-64 ASCII"),  # a lab event: lab ids
    ({"id": "a", "qty": 1, "body": {}}, "keys id and qty, or id and body"),
    ({"id": "a"}, "keys"),
    ("a", "must be a dict"),
])
def test_bad_events_are_refused_and_nothing_is_written(store, event, message):
    before = dump(store, T0)
    with pytest.raises(ValueError, match=message):
        store.enqueue_events([{"id": "fine", "qty": 1}, event], now_ms=T0)
    assert dump(store, T0) == before and job_rows(store) == []
    assert store.enqueue_events([{"id": "fine", "qty": 1}], now_ms=T0) == [True]


def test_real_ids_are_accepted(store):
    ids = ["3f2b8c1e-9a4d-4c7b-8e2f-1a2b3c4d5e6f", "order:123", "tenant/7", "msg_2KWPBgLlAfx",
           "a.b@c+d=e", "x" * 255]
    assert store.enqueue_events([body_event(i) for i in ids], now_ms=T0) == [True] * len(ids)
    assert [r["id"] for r in job_rows(store)] == ids


def test_a_stream_that_fails_midway_enqueues_nothing(store):
    def events():
        yield {"id": "a", "qty": 1}
        yield {"id": "b", "qty": 2}
        raise OSError("the pipe broke")

    with pytest.raises(OSError):
        store.enqueue_events(events(), now_ms=T0)
    assert job_rows(store) == []
    assert store.enqueue_events([{"id": "a", "qty": 1}], now_ms=T0) == [True]


def test_a_long_stream_is_read_as_it_comes_and_progress_is_told(store):
    told: list[int] = []
    events = ({"id": f"j{n}", "qty": 1} for n in range(2500))
    results = store.enqueue_events(events, now_ms=T0, on_progress=told.append)
    assert results == [True] * 2500 and told == [1000, 2000]
    assert store.counts() == {"pending": 2500, "leased": 0, "done": 0, "dead": 0}


def test_not_before_delays_the_first_attempt(store):
    store.enqueue_events([body_event("later")], now_ms=T0, not_before_ms=T0 + 60_000)
    assert store.claim_jobs("d1", 1000, now_ms=T0 + 59_999).leased == []
    assert claim_one(store, "d1", T0 + 60_000, 1000)["id"] == "later"
    assert job(store, "later")["deadline"] == T0 + 60_000 + DEFAULT_POLICY.ttl_ms
    with pytest.raises(ValueError, match="not_before_ms"):
        store.enqueue_events([body_event("past")], now_ms=T0, not_before_ms=T0 - 1)


def test_the_policy_allows_budgets_for_real_outages(store):
    policy = RetryPolicy(max_attempts=50, ttl_ms=7 * 86_400_000, lease_ms=3_600_000,
                         backoff_cap_ms=6 * 3_600_000)
    store.enqueue_events([body_event("long")], policy, now_ms=T0)
    assert claim_one(store, "d1", T0, policy.lease_ms)["lease_until"] == T0 + 3_600_000
    assert job(store, "long")["max_attempts"] == 50
    assert policy.delay_ms(40, 1.0) == 6 * 3_600_000
    for bad in (dict(max_attempts=101), dict(ttl_ms=31 * 86_400_000), dict(jitter=1.5),
                dict(backoff_base_ms=10, backoff_cap_ms=5), dict(lease_ms=0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_equal_jitter_never_waits_less_than_half_a_step():
    policy = DEFAULT_POLICY
    assert policy.delay_ms(1, 0.0) == 500 and policy.delay_ms(1, 1.0) == 1000
    assert policy.delay_ms(13, 0.0) == 1_800_000  # the cap, halved
    least = sum(policy.delay_ms(n, 0.0) for n in range(1, policy.max_attempts))
    assert least > 6 * 3_600_000  # the budget outlasts six hours whatever the draws


# ----------------------------------------------------------------- claim


def test_a_claim_leases_the_whole_row_and_returns_its_ticket(store):
    enqueue(store, lab("c-1", 2), ttl=5000)
    claimed = store.claim_jobs("owner-1", 700, now_ms=T0 + 10)
    assert claimed.now_ms == T0 + 10 and claimed.moved == {"deadline": 0, "exhausted": 0}
    assert tickets_of(claimed) == [{"id": "c-1", "qty": 2, "owner": "owner-1", "token": 1,
                                    "attempt": 1, "lease_until": T0 + 710}]
    row = job(store, "c-1")
    assert {k: row[k] for k in ("status", "attempts", "token", "available_at", "deadline",
                                "owner", "lease_until", "reason")} == {
        "status": "leased", "attempts": 1, "token": 1, "available_at": T0,
        "deadline": T0 + 5000, "owner": "owner-1", "lease_until": T0 + 710, "reason": None}


def test_claim_order_is_seq_not_id(store):
    enqueue(store, lab("z"), lab("a"), body_event("m"))
    assert [maybe_claim(store, "o", T0)["id"] for _ in range(3)] == ["z", "a", "m"]
    assert maybe_claim(store, "o", T0) is None


def test_a_claim_of_many_takes_them_in_order_up_to_its_limit(store):
    enqueue(store, *(lab(f"j{n}") for n in range(5)))
    assert [t["id"] for t in tickets_of(store.claim_jobs("o", 1000, 3, now_ms=T0))] == [
        "j0", "j1", "j2"]
    assert [t["id"] for t in tickets_of(store.claim_jobs("o", 1000, 3, now_ms=T0))] == [
        "j3", "j4"]
    assert tickets_of(store.claim_jobs("o", 1000, 3, now_ms=T0)) == []


def test_the_lease_is_capped_at_the_deadline(store):
    enqueue(store, lab("c"), ttl=300)
    assert claim_one(store, "o", T0 + 299, 1000)["lease_until"] == T0 + 300


def test_a_retry_is_available_at_its_time_not_before(store):
    enqueue(store, lab("r"))
    ticket = claim_one(store, "o", T0)
    assert finish(store, ticket, "retry", T0 + 1, 50) == ("pending", "retry")
    assert maybe_claim(store, "o", T0 + 50) is None  # available_at = T0 + 51
    again = claim_one(store, "o", T0 + 51)
    assert (again["token"], again["attempt"]) == (2, 2)


def test_an_expired_lease_is_claimed_again_at_equality(store):
    enqueue(store, lab("e"))
    first = claim_one(store, "owner-a", T0, 100)
    assert maybe_claim(store, "owner-b", T0 + 99) is None  # live
    second = claim_one(store, "owner-b", T0 + 100)  # lease_until == now: expired
    assert (second["token"], second["attempt"], second["owner"]) == (2, 2, "owner-b")
    assert first["token"] == 1


def test_the_quarantine_moves_a_missed_deadline_at_equality(store):
    enqueue(store, lab("d"), ttl=100)
    enqueue(store, lab("late"), ttl=101)
    claimed = store.claim_jobs("o", 1000, now_ms=T0 + 100)
    assert [t["id"] for t in tickets_of(claimed)] == ["late"]
    assert tickets_of(claimed)[0]["lease_until"] == T0 + 101
    assert claimed.moved == {"deadline": 1, "exhausted": 0}
    dead = job(store, "d")
    assert (dead["status"], dead["reason"], dead["owner"], dead["lease_until"]) == (
        "dead", "deadline", None, None)


def test_the_quarantine_reasons_and_a_deadline_wins_over_a_spent_budget(store):
    enqueue(store, lab("ex"), ttl=1000, max_attempts=1)
    enqueue(store, lab("both"), ttl=150, max_attempts=1)
    claim_one(store, "o", T0, 100)  # ex: lease to T0 + 100
    claim_one(store, "o", T0, 500)  # both: lease to its deadline, T0 + 150
    before = job(store, "ex")
    claimed = store.claim_jobs("o", 100, now_ms=T0 + 100)  # ex: lease over, budget spent
    assert claimed.leased == [] and claimed.moved == {"deadline": 0, "exhausted": 1}
    assert job(store, "ex") == {**before, "status": "dead", "reason": "exhausted",
                                "owner": None, "lease_until": None}
    claimed = store.claim_jobs("o", 100, now_ms=T0 + 150)  # both: spent and past deadline
    assert claimed.moved == {"deadline": 1, "exhausted": 0}
    assert job(store, "both")["reason"] == "deadline"
    assert {r["reason"] for r in store.dead_jobs()} == {"exhausted", "deadline"}
    assert [r["id"] for r in store.dead_jobs("deadline")] == ["both"]
    assert [r["id"] for r in store.dead_jobs(limit=1)] == ["ex"]


def test_a_claim_never_leases_a_job_at_its_budget_or_past_its_deadline(store):
    """Whatever the claim's limit, and with the jobs it may take behind them:
    a job whose lease ran out with its budget spent, or whose deadline has
    come (leased or pending), is never leased again, as attempt max + 1 or
    with a lease ending at or before now: the claim moves it to dead. A
    live lease with its budget spent is left alone."""
    enqueue(store, lab("spent"), max_attempts=1)
    enqueue(store, lab("late-leased"), lab("late-pending"), ttl=500)
    enqueue(store, lab("spent-live"), max_attempts=1)
    enqueue(store, lab("fresh-1"), lab("fresh-2"))
    assert [t["id"] for t in tickets_of(store.claim_jobs("o", 100, 2, now_ms=T0))] == [
        "spent", "late-leased"]
    assert finish(store, claim_one(store, "o", T0, 500), "retry", T0 + 1) == (
        "pending", "retry")  # late-pending: pending again, its deadline ahead
    assert claim_one(store, "o", T0, 10_000)["id"] == "spent-live"
    now = T0 + 500  # the leases of T0 are over, and the deadline of the late ones has come
    claimed = store.claim_jobs("p", 1000, 10, now_ms=now)
    fresh = tickets_of(claimed)
    assert [(t["id"], t["attempt"], t["lease_until"]) for t in fresh] == [
        ("fresh-1", 1, now + 1000), ("fresh-2", 1, now + 1000)]
    assert claimed.moved == {"deadline": 2, "exhausted": 1}
    assert {row["id"]: row["reason"] for row in store.dead_jobs()} == {
        "spent": "exhausted", "late-leased": "deadline", "late-pending": "deadline"}
    assert (job(store, "spent-live")["status"], job(store, "spent-live")["attempts"]) == (
        "leased", 1)
    for ticket in fresh:
        assert finish(store, ticket, "ok", now + 1) == ("done", None)
    claimed = store.claim_jobs("q", 1000, 10, now_ms=T0 + 10_000)  # spent-live's lease over
    assert (claimed.leased, claimed.moved) == ([], {"deadline": 0, "exhausted": 1})
    assert job(store, "spent-live")["reason"] == "exhausted"


def test_the_quarantine_is_committed_when_nothing_is_handed_out(store, make_store):
    enqueue(store, lab("gone"), ttl=10)
    calls: list[str] = []
    claimed = store.claim_jobs("o", 1000, now_ms=T0 + 10, fault=calls.append)
    assert claimed.leased == [] and claimed.moved == {"deadline": 1, "exhausted": 0}
    assert calls == []
    other = make_store()  # another connection sees it: committed
    assert (job(other, "gone")["status"], job(other, "gone")["reason"]) == ("dead", "deadline")


def test_a_claim_never_touches_a_live_lease(store):
    enqueue(store, lab("live"), ttl=1000, max_attempts=1)
    ticket = claim_one(store, "o", T0, 500)
    before = dump(store, T0 + 499)
    assert maybe_claim(store, "p", T0 + 499) is None
    assert dump(store, T0 + 499) == before
    assert finish(store, ticket, "ok", T0 + 499) == ("done", None)


# ----------------------------------------------------------------- finish


@pytest.mark.parametrize(
    ("outcome", "delay", "now", "expected"),
    [
        ("ok", 0, T0 + 5, {"status": "done", "reason": None, "available_at": T0 + 5}),
        ("ok", 900, T0 + 5, {"status": "done", "reason": None, "available_at": T0 + 5}),
        ("permanent", 30, T0 + 5, {"status": "dead", "reason": "permanent",
                                   "available_at": T0 + 5}),
        ("retry", 30, T0 + 5, {"status": "pending", "reason": "retry", "available_at": T0 + 35}),
        ("retry", 0, T0 + 5, {"status": "pending", "reason": "retry", "available_at": T0 + 5}),
        # deadline is T0 + 2000: now + delay == deadline is dead
        ("retry", 1995, T0 + 5, {"status": "dead", "reason": "deadline", "available_at": T0 + 5}),
        ("retry", 1994, T0 + 5, {"status": "pending", "reason": "retry",
                                 "available_at": T0 + 1999}),
    ],
)
def test_a_finish_writes_the_whole_row(store, outcome, delay, now, expected):
    enqueue(store, lab("f", 8), ttl=2000)
    ticket = claim_one(store, "owner-1", T0, 1000)
    before = job(store, "f")
    result = finish(store, ticket, outcome, now, delay)
    assert result == (expected["status"], expected["reason"])
    done = {"done_by": "owner-1", "done_started_ms": T0} if outcome == "ok" else {}
    after = job(store, "f")
    after.pop("done_after")
    before.pop("done_after")
    assert after == {**before, **expected, "owner": None, "lease_until": None, **done}


def test_a_retry_on_the_last_attempt_is_exhausted(store):
    enqueue(store, lab("f"), max_attempts=2)
    assert finish(store, claim_one(store, "o", T0), "retry", T0 + 1) == ("pending", "retry")
    assert finish(store, claim_one(store, "o", T0 + 1), "retry", T0 + 2) == ("dead", "exhausted")
    row = job(store, "f")
    assert (row["attempts"], row["token"]) == (2, 2)


def test_every_part_of_the_marker_fences_a_finish(store):
    enqueue(store, lab("p-1", 3), lab("l-1", 4), lab("d-1", 5))
    finish(store, claim_one(store, "owner-a", T0, 1000), "ok", T0 + 1)
    live = claim_one(store, "owner-a", T0, 1000)
    finish(store, claim_one(store, "owner-b", T0, 1000), "permanent", T0 + 1)
    before = job_rows(store)
    stale = [{**live, "qty": live["qty"] + 1}, {**live, "owner": "owner-b"},
             {**live, "token": live["token"] + 1}, {**live, "attempt": live["attempt"] + 1},
             {**live, "lease_until": live["lease_until"] + 1},
             {**live, "lease_until": live["lease_until"] - 1},
             {**live, "id": "p-1"}, {**live, "id": "d-1"}, {**live, "id": "missing"}]
    calls: list[str] = []
    for ticket in stale:
        for outcome in ("ok", "retry", "permanent"):
            items = [(ticket, outcome, 0, Attempt(T0))]
            assert store.finish_jobs(items, now_ms=T0 + 1, fault=calls.append) == [False]
    late = [(live, "ok", 0, Attempt(T0))]  # late by 0 ms: now == lease_until
    assert store.finish_jobs(late, now_ms=live["lease_until"], fault=calls.append) == [False]
    assert calls == []
    assert job_rows(store) == before
    assert store.stale_finishes() == len(stale) * 3 + 1
    assert finish(store, live, "ok", live["lease_until"] - 1) == ("done", None)
    assert finish(store, live, "ok", live["lease_until"] - 1) is False  # not leased now


def test_a_finish_at_the_deadline_is_stale(store):
    enqueue(store, lab("f"), ttl=100)
    ticket = claim_one(store, "o", T0, 1000)  # the lease ends at the deadline
    assert finish(store, ticket, "ok", T0 + 100) is False
    assert finish(store, ticket, "ok", T0 + 99) == ("done", None)


def test_a_finish_after_another_host_claimed_again_never_wins(make_store):
    one, two = make_store(), make_store()
    enqueue(one, lab("f"))
    old = claim_one(one, "owner-a", T0, 100)
    new = claim_one(two, "owner-b", T0 + 100, 100)
    assert finish(one, old, "ok", T0 + 150) is False
    assert finish(one, {**old, "owner": "owner-b"}, "ok", T0 + 150) is False
    assert finish(two, new, "ok", T0 + 150) == ("done", None)
    assert finish(one, old, "ok", T0 + 50) is False  # a done job is never overwritten
    assert (job(one, "f")["status"], job(one, "f")["token"]) == ("done", 2)
    assert one.stale_finishes() == two.stale_finishes() == 3


def test_two_hosts_claiming_at_once_get_different_jobs(make_store):
    one, two = make_store(), make_store()
    enqueue(one, *(lab(f"j{n}") for n in range(6)))
    first = tickets_of(one.claim_jobs("host-a", 1000, 4, now_ms=T0))
    second = tickets_of(two.claim_jobs("host-b", 1000, 4, now_ms=T0))
    assert [t["id"] for t in first] == ["j0", "j1", "j2", "j3"]
    assert [t["id"] for t in second] == ["j4", "j5"]
    assert two.counts() == {"pending": 0, "leased": 6, "done": 0, "dead": 0}


# ----------------------------------------------------------------- extend


def test_an_extension_moves_the_lease_and_keeps_the_token(store):
    enqueue(store, lab("x"), ttl=5000)
    ticket = claim_one(store, "o", T0, 1000)
    before = job(store, "x")
    renewed = store.extend_lease(ticket, 1000, now_ms=T0 + 500)
    assert renewed == {**ticket, "lease_until": T0 + 1500}
    assert job(store, "x") == {**before, "lease_until": T0 + 1500}
    assert finish(store, ticket, "ok", T0 + 600) is False  # the old ticket is stale now
    capped = store.extend_lease(renewed, 60_000, now_ms=T0 + 1400)
    assert isinstance(capped, dict) and capped["lease_until"] == T0 + 5000  # the deadline
    assert store.extend_lease(capped, 1, now_ms=T0 + 4001) == capped  # never backwards
    assert finish(store, capped, "ok", T0 + 4999) == ("done", None)


def test_an_extension_uses_the_whole_marker_and_the_product_lease(store):
    enqueue(store, body_event("e1"), lab("p-1"), ttl=2 * 3_600_000)
    ticket = claim_one(store, "d1", T0, 1000)
    renewed = store.extend_lease(ticket, 3_600_000, now_ms=T0 + 500)
    assert isinstance(renewed, dict) and renewed["lease_until"] == T0 + 500 + 3_600_000
    before = dump(store, T0 + 600)
    calls: list[str] = []
    for stale in (ticket, {**renewed, "token": 9}, {**renewed, "owner": "zz"},
                  {**renewed, "attempt": 2}, {**renewed, "qty": 1}, {**renewed, "id": "p-1"},
                  {**renewed, "id": "nope"}):
        assert store.extend_lease(stale, 1000, now_ms=T0 + 600, fault=calls.append) is False
    at_end = renewed["lease_until"]
    assert store.extend_lease(renewed, 1000, now_ms=at_end, fault=calls.append) is False
    assert calls == [] and dump(store, T0 + 600) == before
    with pytest.raises(ValueError):
        store.extend_lease(renewed, PRODUCT.max_lease_ms + 1, now_ms=T0 + 700)
    assert store.extend_lease(renewed, 1000, now_ms=at_end - 1, fault=calls.append)
    assert calls == ["after-extend", "after-commit"]


# ----------------------------------------------------------------- evidence


def test_each_finish_records_what_its_attempt_saw(store):
    store.enqueue_events([body_event("e1")], RetryPolicy(max_attempts=3), now_ms=T0)
    ticket = claim_one(store, "d1", T0)
    [result] = store.finish_jobs([(ticket, "retry", 1000, Attempt(
        T0, latency_ms=12, http_status=503, error="receiver answered 503"))], now_ms=T0 + 20)
    assert result == ("pending", "retry")
    ticket = claim_one(store, "d1", T0 + 1020)
    [result] = store.finish_jobs([(ticket, "ok", 0, Attempt(T0 + 1020, 7, 200))],
                                 now_ms=T0 + 1030)
    assert result == ("done", None)
    assert history(store, "e1")["attempts"] == [
        {"token": 1, "attempt": 1, "owner": "d1", "started_ms": T0, "ended_ms": T0 + 20,
         "outcome": "retry", "result": "pending", "reason": "retry", "http_status": 503,
         "error": "receiver answered 503", "latency_ms": 12},
        {"token": 2, "attempt": 2, "owner": "d1", "started_ms": T0 + 1020,
         "ended_ms": T0 + 1030, "outcome": "ok", "result": "done", "reason": None,
         "http_status": 200, "error": None, "latency_ms": 7}]
    assert store.snapshot(T0 + 2000)["attempts_recorded"] == 2


def test_the_history_is_in_the_order_of_writing(store):
    """Stale finishes before and after the delivery: the delivering attempt sits
    between them, whatever the clocks of the callers said."""
    enqueue(store, body_event("h"), body_event("other"))
    old = claim_one(store, "d1", T0, 100)
    new = claim_one(store, "d2", T0 + 100, 30_000)  # h again: old is stale
    assert finish(store, old, "ok", T0 + 150) is False
    assert finish(store, claim_one(store, "d3", T0 + 150), "retry", T0 + 160) == (
        "pending", "retry")  # "other": an attempts row of another job in between
    assert finish(store, new, "ok", T0 + 200) == ("done", None)
    assert finish(store, old, "retry", T0 + 300) is False
    assert [(a["owner"], a["result"]) for a in history(store, "h")["attempts"]] == [
        ("d1", "stale"), ("d2", "done"), ("d1", "stale")]


def test_the_history_is_in_the_order_of_one_finish_s_items(store):
    """One finish: evidence of job h, another job's retry, h delivered, h again
    (stale): h's delivering attempt sits between its own attempts of that
    finish, wherever the other job's row falls."""
    enqueue(store, body_event("h"), body_event("other"))
    h = claim_one(store, "d1", T0, 30_000)
    other = claim_one(store, "d1", T0, 30_000)
    assert {h["id"], other["id"]} == {"h", "other"}
    if h["id"] != "h":
        h, other = other, h
    assert store.finish_jobs([
        (h, None, 0, Attempt(T0 + 1, 5, 200, "BadAck: not JSON")),
        (other, "retry", 1000, Attempt(T0 + 2, 5, 503, "receiver answered 503")),
        (h, "ok", 0, Attempt(T0 + 3, 6, 200)),
        (h, "ok", 0, Attempt(T0 + 4, 7, 200)),
    ], now_ms=T0 + 10) == [("leased", None), ("pending", "retry"), ("done", None), False]
    assert [(a["started_ms"], a["result"]) for a in history(store, "h")["attempts"]] == [
        (T0 + 1, "leased"), (T0 + 3, "done"), (T0 + 4, "stale")]
    # the delivering attempt first in its finish, another job's row before it
    again = claim_one(store, "d2", T0 + 2000, 30_000)
    assert again["id"] == "other"
    assert store.finish_jobs([(again, "ok", 0, Attempt(T0 + 2001, 4, 200)),
                              (again, "retry", 0, Attempt(T0 + 2002, 4, 200))],
                             now_ms=T0 + 2010) == [("done", None), False]
    assert [(a["started_ms"], a["result"]) for a in history(store, "other")["attempts"]] == [
        (T0 + 2, "pending"), (T0 + 2001, "done"), (T0 + 2002, "stale")]


def test_a_stale_finish_is_refused_recorded_and_counted(store):
    store.enqueue_events([body_event("e1")], now_ms=T0)
    old = claim_one(store, "d1", T0, 100)
    new = claim_one(store, "d2", T0 + 100, 30_000)
    before = job_rows(store)
    assert store.finish_jobs([(old, "ok", 0, Attempt(T0, 90, 200))], now_ms=T0 + 150) == [False]
    assert job_rows(store) == before  # the newer lease is untouched
    assert store.stale_finishes() == 1
    assert finish(store, new, "ok", T0 + 200) == ("done", None)
    assert [a["result"] for a in history(store, "e1")["attempts"]] == ["stale", "done"]
    assert store.snapshot(T0 + 300)["stale_finishes"] == 1


def test_an_attempt_that_proved_nothing_is_recorded_and_the_job_stays_leased(store):
    store.enqueue_events([body_event("e1")], now_ms=T0)
    ticket = claim_one(store, "d1", T0)
    before = job_rows(store)
    assert store.finish_jobs([(ticket, None, 0, Attempt(T0, 5, 200, "BadAck: not JSON"))],
                             now_ms=T0 + 10) == [("leased", None)]
    assert job_rows(store) == before
    [attempt] = history(store, "e1")["attempts"]
    assert (attempt["outcome"], attempt["result"], attempt["error"]) == (
        "none", "leased", "BadAck: not JSON")
    assert finish(store, ticket, "ok", T0 + 20) == ("done", None)  # the lease was kept


def test_the_error_text_is_capped(store):
    store.enqueue_events([body_event("e1")], now_ms=T0)
    ticket = claim_one(store, "d1", T0)
    store.finish_jobs([(ticket, "permanent", 0, Attempt(T0, error="x" * 5000))], now_ms=T0 + 1)
    [attempt] = history(store, "e1")["attempts"]
    assert attempt["error"] == "x" * MAX_ERROR_CHARS


def test_dead_jobs_show_their_last_error(store):
    store.enqueue_events([body_event("e1"), body_event("e2"), body_event("e3")],
                         RetryPolicy(max_attempts=1), now_ms=T0)
    jobs = tickets_of(store.claim_jobs("d1", 1000, 3, now_ms=T0))
    store.finish_jobs([(jobs[0], "retry", 0, Attempt(T0, error="refused")),
                       (jobs[1], "permanent", 0, Attempt(T0, http_status=410)),
                       (jobs[2], "permanent", 0, Attempt(T0))], now_ms=T0 + 1)
    dead = {row["id"]: (row["reason"], row["last_error"]) for row in store.dead_jobs()}
    assert dead == {"e1": ("exhausted", "refused"), "e2": ("permanent", "HTTP 410"),
                    "e3": ("permanent", None)}


def test_a_batch_finish_is_single_finishes_in_sequence(store):
    enqueue(store, lab("a"), lab("b"))
    a, b = tickets_of(store.claim_jobs("o", 1000, 2, now_ms=T0))
    results = store.finish_jobs([(a, "retry", 10, Attempt(T0)), (a, "ok", 0, Attempt(T0)),
                                 (b, None, 0, Attempt(T0)), (b, "ok", 0, Attempt(T0))],
                                now_ms=T0 + 1)
    assert results == [("pending", "retry"), False, ("leased", None), ("done", None)]
    assert [a["result"] for a in history(store, "a")["attempts"]] == ["pending", "stale"]
    assert [a["result"] for a in history(store, "b")["attempts"]] == ["leased", "done"]


# ----------------------------------------------------------------- the operator


def make_dead(store, *ids: str) -> None:
    store.enqueue_events([body_event(i) for i in ids], RetryPolicy(ttl_ms=10), now_ms=T0)
    store.claim_jobs("d1", 1000, now_ms=T0 + 10)  # the quarantine: all dead/deadline


def test_a_redrive_writes_its_audit_row_keeps_the_token_and_gives_a_fresh_budget(store):
    enqueue(store, lab("d-1", 5))
    old = claim_one(store, "o", T0, 1000)
    finish(store, old, "permanent", T0 + 1)
    before = job(store, "d-1")
    calls: list[str] = []
    assert store.redrive_jobs(["d-1"], 900, "fixed the address", now_ms=T0 + 50,
                              fault=calls.append) == [True]
    assert calls == ["after-audit", "after-redrive", "after-commit"]
    assert job(store, "d-1") == {**before, "status": "pending", "attempts": 0,
                                 "available_at": T0 + 50, "deadline": T0 + 950,
                                 "reason": None}
    [audit] = history(store, "d-1")["redrives"]
    assert {k: audit[k] for k in ("token", "at_ms", "note")} == {
        "token": 1, "at_ms": T0 + 50, "note": "fixed the address"}
    assert finish(store, old, "ok", T0 + 51) is False  # a ticket from before stays stale
    ticket = claim_one(store, "o", T0 + 50)
    assert (ticket["id"], ticket["token"], ticket["attempt"]) == ("d-1", 2, 1)


def test_redrive_with_product_ids_notes_and_budgets(store):
    make_dead(store, "order:1", "order:2")
    results = store.redrive_jobs(["order:1", "order:2", "order:1", "nope"], 5 * 86_400_000,
                                 "receiver fixed, see ticket #42", now_ms=T0 + 20)
    assert results[:2] == [True, True]
    assert [str(r) for r in results[2:]] == ["job 'order:1' is pending, not dead",
                                             "job 'nope' does not exist"]
    assert job(store, "order:1")["deadline"] == T0 + 20 + 5 * 86_400_000
    assert [r["note"] for i in ("order:1", "order:2") for r in history(store, i)["redrives"]
            ] == ["receiver fixed, see ticket #42"] * 2
    assert store.snapshot(T0 + 30)["redrives"] == 2
    with pytest.raises(ValueError, match="note"):
        store.redrive_jobs(["order:1"], 1000, "line\nbreak", now_ms=T0)


def test_a_bulk_redrive_answers_every_place_in_order_duplicates_included(store):
    """MAX_BATCH ids in one redrive, each dead job named several times in a
    shuffled order among missing, live and refused ones: per place, True
    where a job is first redriven, and after it the refusal a redrive of it
    alone would then give; a keyed job refused while a later job of its key
    is on the wire is refused at every place, and stays dead. One audit row
    per redriven job."""
    dead = [f"dead-{n}" for n in range(2000)]
    make_dead(store, *dead)
    enqueue(store, lab("alive"), now=T0 + 10)
    assert store.enqueue_events([{"id": "k-1", "qty": 1, "key": "k"},
                                 {"id": "k-2", "qty": 1, "key": "k"}], now_ms=T0 + 10) == [
        True, True]
    assert store.cancel_jobs(["k-1"], "hold it", now_ms=T0 + 11) == [True]
    assert [t["id"] for t in tickets_of(store.claim_jobs("o", 60_000, 10, now_ms=T0 + 12))
            ] == ["alive", "k-2"]
    rng = random.Random(7)
    ids = [*dead * 4, "ghost-1", "ghost-2", "alive", "alive", "k-1", "k-1"]
    ids += rng.choices(dead, k=MAX_BATCH - len(ids))
    rng.shuffle(ids)
    results = store.redrive_jobs(ids, 60_000, "bulk", now_ms=T0 + 20)
    expected: list = []
    redriven: set = set()
    for job_id in ids:
        if job_id.startswith("ghost"):
            expected.append(f"job {job_id!r} does not exist")
        elif job_id == "alive":
            expected.append("job 'alive' is leased, not dead")
        elif job_id == "k-1":
            expected.append("k-1 refused")
        elif job_id in redriven:
            expected.append(f"job {job_id!r} is pending, not dead")
        else:
            redriven.add(job_id)
            expected.append(True)
    assert len(results) == len(ids) == MAX_BATCH
    k1 = [r for job_id, r in zip(ids, results, strict=True) if job_id == "k-1"]
    assert all(isinstance(r, ValueError) and "'k-1'" in str(r) for r in k1), k1
    assert "being delivered" in str(k1[0])
    said = [True if r is True else "k-1 refused" if job_id == "k-1" else str(r)
            for job_id, r in zip(ids, results, strict=True)]
    assert said == expected
    assert redriven == set(dead)
    assert [row["id"] for row in store.dead_jobs()] == ["k-1"]
    assert history(store, "k-1")["redrives"] == []
    snapshot = store.snapshot(T0 + 30)
    assert (snapshot["redrives"], snapshot["redriven_jobs"]) == (len(dead), len(dead))
    assert store.counts()["pending"] == len(dead)


def test_cancel_pending_or_dead_with_an_audit_row(store):
    make_dead(store, "dead-1")
    store.enqueue_events([body_event("pending-1"), body_event("leased-1"),
                          body_event("done-1")], now_ms=T0 + 20)
    leased = {t["id"]: t for t in tickets_of(store.claim_jobs("d1", 30_000, 3, now_ms=T0 + 20))}
    store.finish_jobs([(leased["done-1"], "ok", 0, Attempt(T0 + 20))], now_ms=T0 + 21)
    store.finish_jobs([(leased["pending-1"], "retry", 10**6, Attempt(T0 + 20))], now_ms=T0 + 21)
    calls: list[str] = []
    results = store.cancel_jobs(["dead-1", "pending-1", "leased-1", "done-1", "dead-1",
                                 "ghost"], "customer withdrew the order", now_ms=T0 + 30,
                                fault=calls.append)
    assert calls == ["after-audit", "after-cancel", "after-commit"]
    assert results[:2] == [True, True]
    assert [str(r) for r in results[2:]] == [
        "job 'leased-1' is leased: only a pending or dead job can be cancelled",
        "job 'done-1' is done: only a pending or dead job can be cancelled",
        "job 'dead-1' is already cancelled", "job 'ghost' does not exist"]
    for job_id, was in (("dead-1", "dead/deadline"), ("pending-1", "pending/retry")):
        row = job(store, job_id)
        assert (row["status"], row["reason"], row["available_at"]) == (
            "dead", "cancelled", T0 + 30)
        [audit] = history(store, job_id)["cancels"]
        assert {k: audit[k] for k in ("token", "at_ms", "note", "was")} == {
            "token": row["token"], "at_ms": T0 + 30, "note": "customer withdrew the order",
            "was": was}
    assert store.redrive_jobs(["pending-1"], 1000, "reopened", now_ms=T0 + 40) == [True]
    assert [c["note"] for c in history(store, "pending-1")["cancels"]] == [
        "customer withdrew the order"]
    assert store.snapshot(T0 + 50)["cancels"] == 2


def test_prune_removes_only_old_done_jobs_with_their_evidence(store):
    store.enqueue_events([body_event(f"j{n}") for n in range(5)], now_ms=T0)
    jobs = tickets_of(store.claim_jobs("d1", 30_000, 5, now_ms=T0))
    items = [(ticket, "ok", 0, Attempt(T0)) for ticket in jobs[:3]]
    items.append((jobs[3], "permanent", 0, Attempt(T0)))
    store.finish_jobs(items[:2], now_ms=T0 + 10)  # j0, j1 done at T0+10
    store.finish_jobs(items[2:], now_ms=T0 + 500)  # j2 done and j3 dead at T0+500; j4 leased
    assert store.snapshot(T0 + 600)["attempts_recorded"] == 4
    assert store.prune_done(T0 + 11, limit=1) == 1
    assert store.prune_done(T0 + 11) == 1
    assert store.prune_done(T0 + 11) == 0
    assert [r["id"] for r in job_rows(store)] == ["j2", "j3", "j4"]
    assert store.snapshot(T0 + 600)["attempts_recorded"] == 2
    assert job(store, "j2")["done_by"] == "d1"
    assert store.job_history("j0") is None
    # an id whose job was pruned is new again, with no evidence of the old one
    assert store.enqueue_events([body_event("j0", again=True)], now_ms=T0 + 600) == [True]
    assert history(store, "j0")["attempts"] == []
    assert [r["id"] for r in job_rows(store)] == ["j2", "j3", "j4", "j0"]


def test_prune_takes_a_jobs_audit_rows_with_it(store):
    make_dead(store, "r")
    store.redrive_jobs(["r"], 1000, "again", now_ms=T0 + 20)
    finish(store, claim_one(store, "d1", T0 + 20), "ok", T0 + 21)
    assert len(history(store, "r")["redrives"]) == 1
    assert store.prune_done(T0 + 22) == 1
    store.enqueue_events([body_event("r")], now_ms=T0 + 30)
    assert history(store, "r")["redrives"] == [] and history(store, "r")["cancels"] == []
    assert store.snapshot(T0 + 30)["redrives"] == 0


def test_prune_leaves_dead_and_live_jobs(store):
    make_dead(store, "d")
    store.cancel_jobs(["d"], "no", now_ms=T0 + 20)
    store.enqueue_events([body_event("p"), body_event("l")], now_ms=T0)
    claim_one(store, "d1", T0 + 30)
    assert store.prune_done(MAX_NOW_MS) == 0
    assert len(job_rows(store)) == 3


def test_prune_keeps_a_job_that_finished_exactly_at_the_cutoff(store):
    store.enqueue_events([body_event("edge")], now_ms=T0)
    finish(store, claim_one(store, "d1", T0), "ok", T0 + 100)
    assert store.prune_done(T0 + 100) == 0  # "before the cutoff": strictly
    assert store.prune_done(T0 + 101) == 1


# ----------------------------------------------------------------- observations


def test_the_observations_agree(store):
    assert store.is_drained() and store.counts() == {"pending": 0, "leased": 0, "done": 0,
                                                     "dead": 0}
    make_dead(store, "x")
    enqueue(store, lab("a"), lab("b"), lab("c"), now=T0 + 20)
    finish(store, claim_one(store, "o", T0 + 20, 100), "ok", T0 + 21)
    claim_one(store, "o", T0 + 20, 100)
    assert not store.is_drained()
    assert store.counts() == {"pending": 1, "leased": 1, "done": 1, "dead": 1}
    assert [r["id"] for r in store.jobs_with_status("leased")] == ["b"]
    assert store.snapshot(T0 + 200) == {
        "jobs": 4, "by_status": {"pending": 1, "leased": 1, "done": 1, "dead": 1},
        "oldest_unfinished_age_ms": 180, "oldest_ready_age_ms": 180, "expired_leases": 1,
        "live_leases": 0, "attempts": {"0": 2, "1": 2}, "dead_by_reason": {"deadline": 1},
        "redrives": 0, "redriven_jobs": 0, "redrives_last_day": 0, "cancels": 0,
        "cancels_last_day": 0, "attempts_recorded": 1,
        "stale_finishes": 0, "blocked_keys": 0, "blocked_jobs": 0}
    with pytest.raises(ValueError):
        store.jobs_with_status("gone")
    assert store.job_history("nobody") is None


def test_the_history_keeps_its_order_after_a_prune(store):
    """A prune deletes the newest attempts row of the queue (another job's): the
    attempts written after it still come after the delivery they followed."""
    enqueue(store, lab("a"), lab("b"))
    a = claim_one(store, "o", T0, 100)
    assert finish(store, a, "ok", T0 + 1) == ("done", None)
    assert finish(store, a, "ok", T0 + 2) is False  # the newest attempts row: a's
    b = claim_one(store, "o", T0 + 2, 100)
    assert finish(store, b, "ok", T0 + 3) == ("done", None)
    assert store.prune_done(T0 + 2) == 1  # a, with its attempts row
    assert finish(store, b, "ok", T0 + 4) is False
    assert [(x["result"], x["ended_ms"]) for x in history(store, "b")["attempts"]] == [
        ("done", T0 + 3), ("stale", T0 + 4)]
