"""Ordered delivery per key, as every store applies it: jobs with the same
``key`` are claimed one at a time in intake order; a job is not claimed while
an earlier job of its key is pending (a retry's wait included), leased, or
dead but not cancelled; jobs without a key and jobs of other keys flow as
before. A dead first job blocks its key until it is redriven (first in line
again) or cancelled (the next goes). Each test runs on every store.

The property at the end runs random programs (intake, claims by several
owners, finishes ok/retry/permanent, lease expiry, redrive, cancel) against
a model that knows only the rule, on both stores."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.store import Store
from lease.worker import Conflict
from tests.support.queues import T0

from .helpers import claim_one, job, tickets_of

POLICY = RetryPolicy(max_attempts=5, ttl_ms=600_000)


def keyed(job_id: str, key: str | None, qty: int = 1) -> dict:
    event: dict[str, Any] = {"id": job_id, "qty": qty}
    if key is not None:
        event["key"] = key
    return event


def enqueue(store: Store, *events: dict, now: int = T0, policy: RetryPolicy = POLICY) -> None:
    assert store.enqueue_events(list(events), policy, now_ms=now) == [True] * len(events)


def claim_ids(store: Store, now: int, limit: int = 100, owner: str = "w",
              lease_ms: int = 1000) -> list[str]:
    claimed = store.claim_jobs(owner, lease_ms, limit, now_ms=now)
    return [ticket["id"] for ticket in tickets_of(claimed)]


def claim_tickets(store: Store, now: int, limit: int = 100, lease_ms: int = 1000) -> dict:
    return {t["id"]: t for t in tickets_of(store.claim_jobs("w", lease_ms, limit, now_ms=now))}


def finish(store: Store, ticket: dict, outcome: str, now: int, delay: int = 0) -> object:
    [result] = store.finish_jobs([(ticket, outcome, delay, Attempt(now))], now_ms=now)
    return result


def test_a_key_is_delivered_one_job_at_a_time_in_intake_order_beside_the_others(store):
    enqueue(store, keyed("z-1", "cust-1"), keyed("a-2", "cust-1"), keyed("b-1", "cust-2"),
            keyed("free", None), keyed("m-3", "cust-1"))
    tickets = claim_tickets(store, T0)
    assert sorted(tickets) == ["b-1", "free", "z-1"]  # one per key, and the unkeyed job
    assert claim_ids(store, T0 + 1) == []  # a-2 waits behind the leased z-1
    assert finish(store, tickets["z-1"], "ok", T0 + 2) == ("done", None)
    second = claim_tickets(store, T0 + 3)
    assert list(second) == ["a-2"]  # the next of cust-1, not m-3
    assert finish(store, second["a-2"], "ok", T0 + 4) == ("done", None)
    assert claim_ids(store, T0 + 5) == ["m-3"]


def test_a_retry_keeps_its_place_first_in_line_through_its_wait(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"), keyed("other", "o"))
    tickets = claim_tickets(store, T0, lease_ms=60_000)
    assert finish(store, tickets["k-1"], "retry", T0 + 1, delay=5000) == ("pending", "retry")
    assert claim_ids(store, T0 + 2) == []  # k-1 waits for its retry; k-2 waits for k-1
    assert claim_ids(store, T0 + 5001) == ["k-1"]


def test_an_expired_lease_is_taken_again_before_the_next_of_its_key(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"))
    first = claim_one(store, "a", T0, lease_ms=1000)
    assert claim_ids(store, T0 + 1000, owner="b") == ["k-1"]
    assert finish(store, first, "ok", T0 + 1001) is False  # the first lease is stale
    assert job(store, "k-2")["held"] == 1


def test_a_dead_first_blocks_its_key_until_redriven_first_in_line(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"), keyed("k-3", "k"), keyed("o-1", "o"))
    tickets = claim_tickets(store, T0)
    assert finish(store, tickets["k-1"], "permanent", T0 + 1) == ("dead", "permanent")
    assert finish(store, tickets["o-1"], "permanent", T0 + 1) == ("dead", "permanent")
    assert claim_ids(store, T0 + 2) == []
    snap = store.snapshot(T0 + 2)
    assert (snap["blocked_keys"], snap["blocked_jobs"]) == (2, 2)
    assert store.redrive_jobs(["k-1"], 60_000, "fixed", now_ms=T0 + 3) == [True]
    again = claim_tickets(store, T0 + 4)
    assert list(again) == ["k-1"]
    assert finish(store, again["k-1"], "ok", T0 + 5) == ("done", None)
    assert claim_ids(store, T0 + 6) == ["k-2"]
    snap = store.snapshot(T0 + 6)
    assert (snap["blocked_keys"], snap["blocked_jobs"]) == (1, 0)


def test_idle_is_nothing_claimable_now_or_later_and_names_the_dead_heads(store):
    """Idle: no job a claim may take now or later without an operator. A retry's
    wait or a lease is work to come; jobs behind a dead head are not."""
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"), keyed("k-3", "k"), keyed("m-1", "m"),
            keyed("o-1", None))
    assert not store.is_idle() and store.blocked_heads() == []
    tickets = claim_tickets(store, T0)
    assert sorted(tickets) == ["k-1", "m-1", "o-1"] and not store.is_idle()  # leased
    finish(store, tickets["k-1"], "permanent", T0 + 1)
    finish(store, tickets["m-1"], "retry", T0 + 1, delay=60_000)
    finish(store, tickets["o-1"], "ok", T0 + 1)
    assert not store.is_idle()  # m-1 waits out its retry delay: claimable later
    assert store.blocked_heads() == [{"key": "k", "endpoint": None, "id": "k-1",
                                      "reason": "permanent", "waiting": 2}]
    finish(store, claim_tickets(store, T0 + 70_000)["m-1"], "ok", T0 + 70_001)
    assert store.is_idle() and not store.is_drained()  # only k-2 and k-3 left, behind k-1
    assert store.blocked_heads(1) == store.blocked_heads()
    assert store.cancel_jobs(["k-1"], "give up", now_ms=T0 + 70_002) == [True]
    assert not store.is_idle() and store.blocked_heads() == []  # k-2 is first now
    with pytest.raises(ValueError):
        store.blocked_heads(0)


def test_cancelling_a_dead_first_lets_the_next_go(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"))
    tickets = claim_tickets(store, T0)
    finish(store, tickets["k-1"], "permanent", T0 + 1)
    assert store.cancel_jobs(["k-1"], "give up", now_ms=T0 + 2) == [True]
    assert claim_ids(store, T0 + 3) == ["k-2"]
    assert store.snapshot(T0 + 3)["blocked_keys"] == 0


def test_cancelling_a_pending_first_lets_the_next_go(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"))
    assert store.cancel_jobs(["k-1"], "not needed", now_ms=T0 + 1) == [True]
    assert claim_ids(store, T0 + 2) == ["k-2"]


def test_a_cancelled_job_redriven_goes_back_to_its_place(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"), keyed("k-3", "k"))
    assert store.cancel_jobs(["k-1"], "hold it", now_ms=T0 + 1) == [True]
    assert [job(store, i)["held"] for i in ("k-1", "k-2", "k-3")] == [0, 0, 1]
    assert store.redrive_jobs(["k-1"], 60_000, "after all", now_ms=T0 + 2) == [True]
    assert [job(store, i)["held"] for i in ("k-1", "k-2", "k-3")] == [0, 1, 1]
    assert claim_ids(store, T0 + 3) == ["k-1"]


def test_a_cancelled_job_is_not_redriven_while_a_later_one_of_its_key_is_on_the_wire(store):
    enqueue(store, keyed("k-1", "k"), keyed("k-2", "k"))
    store.cancel_jobs(["k-1"], "hold it", now_ms=T0 + 1)
    tickets = claim_tickets(store, T0 + 2)
    assert list(tickets) == ["k-2"]
    [refused] = store.redrive_jobs(["k-1"], 60_000, "too soon", now_ms=T0 + 3)
    assert isinstance(refused, ValueError) and "being delivered" in str(refused)
    assert job(store, "k-1")["reason"] == "cancelled"
    assert finish(store, tickets["k-2"], "ok", T0 + 4) == ("done", None)
    assert store.redrive_jobs(["k-1"], 60_000, "now", now_ms=T0 + 5) == [True]
    assert claim_ids(store, T0 + 6) == ["k-1"]


def test_a_job_held_past_its_deadline_dies_and_then_blocks_its_key(store):
    short = RetryPolicy(max_attempts=5, ttl_ms=1000)
    enqueue(store, keyed("k-1", "k"), policy=POLICY)
    enqueue(store, keyed("k-2", "k"), keyed("k-3", "k"), policy=short)
    tickets = claim_tickets(store, T0, lease_ms=5000)
    assert claim_ids(store, T0 + 1000) == []  # the quarantine: k-2 and k-3 past their deadline
    assert job(store, "k-2")["reason"] == "deadline"
    assert finish(store, tickets["k-1"], "ok", T0 + 1001) == ("done", None)
    assert store.snapshot(T0 + 1001)["blocked_keys"] == 1
    assert store.redrive_jobs(["k-3", "k-2"], 60_000, "late", now_ms=T0 + 1002) == [True, True]
    assert claim_ids(store, T0 + 1003) == ["k-2"]


def test_an_id_with_another_key_is_a_conflict(store):
    enqueue(store, keyed("x", "k"), keyed("y", None))
    results = store.enqueue_events([keyed("x", "k"), keyed("x", "other"), keyed("x", None),
                                    keyed("y", "k")], POLICY, now_ms=T0)
    assert results[0] is False
    assert all(isinstance(r, Conflict) for r in results[1:])
    assert "key 'k'" in str(results[1])
    assert job(store, "x")["ordering_key"] == "k"


@pytest.mark.parametrize("key", ["", " ", "a b", "x" * 256, "é", 7, None])
def test_a_bad_key_is_refused_with_nothing_written(store, key):
    with pytest.raises(ValueError, match="event key"):
        store.enqueue_events([keyed("ok", "k"), {"id": "bad", "qty": 1, "key": key}], POLICY,
                             now_ms=T0)
    assert store.counts()["pending"] == 0


def test_a_payload_event_takes_a_key_too(store):
    assert store.enqueue_events([{"id": "order:1", "body": {"n": 1}, "key": "c-1"},
                                 {"id": "order:2", "body": {"n": 2}, "key": "c-1"}],
                                POLICY, now_ms=T0) == [True, True]
    claimed = store.claim_jobs("w", 1000, 10, now_ms=T0)
    assert [(j.ticket["id"], j.event) for j in claimed.leased] == [
        ("order:1", {"id": "order:1", "body": '{"n":1}'})]


def test_many_keys_in_one_claim_batch_are_each_claimed_once(store):
    enqueue(store, *[keyed(f"j-{n}-{k}", f"key-{k}") for n in range(3) for k in range(20)])
    assert sorted(claim_ids(store, T0, limit=1000)) == sorted(f"j-0-{k}" for k in range(20))


# ----------------------------------------------------------------- the property


class Model:
    """The rule alone: a job's key, its place, and whether it is in line."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.key: dict[str, str | None] = {}

    def add(self, job_id: str, key: str | None) -> None:
        self.order.append(job_id)
        self.key[job_id] = key


def _in_line(row: dict) -> bool:
    return row["status"] in ("pending", "leased") or (
        row["status"] == "dead" and row["reason"] != "cancelled")


def _rows(store: Store) -> dict[str, dict]:
    return {row["id"]: row for status in ("pending", "leased", "done", "dead")
            for row in store.jobs_with_status(status)}


def check_claim(before: dict[str, dict], model: Model, claimed: list[str]) -> None:
    """Each claimed job: no earlier job of its key was in line when it was
    claimed (pending, leased, or dead and not cancelled), and no two of a key."""
    keys = [model.key[job_id] for job_id in claimed if model.key[job_id] is not None]
    assert len(keys) == len(set(keys)), claimed
    for job_id in claimed:
        key = model.key[job_id]
        if key is None:
            continue
        for earlier in model.order[:model.order.index(job_id)]:
            if model.key[earlier] == key:
                assert not _in_line(before[earlier]), (job_id, earlier, before[earlier])


def check_free(store: Store, model: Model, now: int) -> None:
    """No job waits for another key: with nothing claimable left at ``now``,
    every pending job due is behind an earlier job of its own key."""
    rows = _rows(store)
    for job_id, row in rows.items():
        if row["status"] != "pending" or row["available_at"] > now:
            continue
        key = model.key[job_id]
        assert key is not None, f"{job_id} has no key and was not claimed"
        earlier = model.order[:model.order.index(job_id)]
        assert any(model.key[e] == key and _in_line(rows[e]) for e in earlier), job_id


STEP = st.one_of(
    st.tuples(st.just("enqueue"), st.lists(st.sampled_from(["a", "b", "c", None]),
                                          min_size=1, max_size=4)),
    st.tuples(st.just("claim"), st.sampled_from(["w1", "w2", "w3"]), st.integers(1, 4)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.sampled_from(["ok", "retry",
                                                                        "permanent"])),
    st.tuples(st.just("expire")),
    st.tuples(st.just("redrive"), st.integers(0, 6)),
    st.tuples(st.just("cancel"), st.integers(0, 6)),
    st.tuples(st.just("recall"), st.integers(0, 6)),  # cancelled, then redriven
)


def test_no_job_is_claimed_before_every_earlier_job_of_its_key_is_done(queues):
    @given(st.lists(STEP, min_size=1, max_size=30))
    @queues.settings(100, 15)
    def run(program: list) -> None:
        with queues.fresh() as store:
            play(store, program)

    run()


def play(store: Store, program: list) -> None:
    model = Model()
    leased: list[dict] = []
    now = T0
    for step in program:
        now += 1
        if step[0] == "enqueue":
            events = [keyed(f"j{len(model.order) + n}", key) for n, key in enumerate(step[1])]
            enqueue(store, *events, now=now)
            for event in events:
                model.add(event["id"], event.get("key"))
        elif step[0] == "claim":
            before = _rows(store)
            claimed = tickets_of(store.claim_jobs(step[1], 1000, step[2], now_ms=now))
            check_claim(before, model, [t["id"] for t in claimed])
            leased.extend(claimed)
        elif step[0] == "finish" and leased:
            ticket = leased.pop(step[1] % len(leased))
            finish(store, ticket, step[2], now, delay=0)
        elif step[0] == "expire":
            now += 1000  # every lease of this program ends
        elif step[0] in ("redrive", "cancel", "recall") and model.order:
            job_id = model.order[step[1] % len(model.order)]
            if step[0] in ("cancel", "recall"):
                store.cancel_jobs([job_id], "drop", now_ms=now)
            if step[0] in ("redrive", "recall"):
                store.redrive_jobs([job_id], 600_000, "again", now_ms=now)
    # drain: claim and deliver until nothing is claimable; the rule holds throughout
    for _ in range(200):
        now += 1000
        before = _rows(store)
        claimed = tickets_of(store.claim_jobs("drain", 1000, 100, now_ms=now))
        if not claimed:
            break
        check_claim(before, model, [t["id"] for t in claimed])
        for ticket in claimed:
            finish(store, ticket, "ok", now)
    check_free(store, model, now)
    snap = store.snapshot(now)
    rows = _rows(store)
    dead_firsts = {model.key[j] for j in model.order if model.key[j] is not None
                   and rows[j]["status"] == "dead" and rows[j]["reason"] != "cancelled"
                   and rows[j]["held"] == 0}
    assert snap["blocked_keys"] == len(dead_firsts)
