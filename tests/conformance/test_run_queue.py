"""The synchronous API on any store: ``lease.stores.run_store_once`` (claim, send with
no transaction open, finish with the attempt's evidence) and ``run_queue``,
which owns its store for one cycle, on a file's path or a postgresql:// URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from lease.policy import RetryPolicy
from lease.stores import open_store, run_queue, run_store_once
from lease.worker import BadAck, Permanent, Retryable
from tests.support.queues import T0

from .helpers import history, job

POLICY = RetryPolicy(max_attempts=3, ttl_ms=600_000, backoff_base_ms=100, backoff_cap_ms=100,
                     jitter=0.0)


def enqueue(store, *events: dict) -> None:
    assert store.enqueue_events(list(events), POLICY, now_ms=T0) == [True] * len(events)


class Clock:
    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def __call__(self) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def test_an_ack_is_done_with_its_evidence(store):
    enqueue(store, {"id": "order:1", "body": {"n": 1}})
    sent: list[dict] = []

    def send(event: dict) -> bool:
        sent.append(event)
        return True

    result = run_store_once(store, "w1", send, 0.5, 5_000, policy=POLICY, clock=Clock(T0, T0 + 7))
    assert result == {"id": "order:1", "token": 1, "status": "done"}
    assert sent == [{"id": "order:1", "body": '{"n":1}'}]
    row = job(store, "order:1")
    assert (row["status"], row["done_by"], row["done_started_ms"]) == ("done", "w1", T0)
    assert run_store_once(store, "w1", send, 0.5, 5_000, clock=Clock(T0 + 8)) is None  # no work


def test_a_retryable_failure_waits_by_the_policy_and_is_recorded(store):
    enqueue(store, {"id": "a", "qty": 2})

    def send(event: dict) -> bool:
        raise Retryable("the receiver is down")

    result = run_store_once(store, "w1", send, 0.5, 5_000, policy=POLICY, clock=Clock(T0, T0 + 1))
    assert result == {"id": "a", "token": 1, "status": "pending"}
    row = job(store, "a")
    assert row["available_at"] == T0 + 1 + 100  # the policy's delay, jitter 0 (whole step)
    [attempt] = history(store, "a")["attempts"]
    assert (attempt["outcome"], attempt["result"], attempt["error"]) == (
        "retry", "pending", "Retryable: the receiver is down")


def test_a_refusal_is_dead_and_a_bad_ack_propagates_leaving_the_job_leased(store):
    enqueue(store, {"id": "a", "qty": 1}, {"id": "b", "qty": 1})

    def refuse(event: dict) -> bool:
        raise Permanent("HTTP 410")

    assert run_store_once(store, "w1", refuse, 0.5, 5_000, clock=Clock(T0))["status"] == "dead"
    with pytest.raises(BadAck):
        run_store_once(store, "w1", lambda event: "maybe", 0.5, 5_000, clock=Clock(T0 + 1))
    row = job(store, "b")
    assert (row["status"], row["owner"]) == ("leased", "w1")  # its lease expiry recovers it
    [attempt] = history(store, "b")["attempts"]
    assert (attempt["outcome"], attempt["result"]) == ("none", "leased")
    assert attempt["error"].startswith("BadAck: send returned 'maybe'")


def test_an_error_that_is_not_ours_propagates_with_its_evidence_kept(store):
    enqueue(store, {"id": "a", "qty": 1})

    def broken(event: dict) -> bool:
        raise KeyError("oops")

    with pytest.raises(KeyError):
        run_store_once(store, "w1", broken, 0.5, 5_000, clock=Clock(T0))
    [attempt] = history(store, "a")["attempts"]
    assert attempt["error"] == "KeyError: 'oops'" and job(store, "a")["status"] == "leased"


def test_the_store_clock_judges_without_an_injected_one(store):
    """No clock: the store's own (this host's for a file, the server's for a database)."""
    now = store.now_ms()
    assert store.enqueue_events([{"id": "a", "qty": 1}], POLICY) == [True]
    assert run_store_once(store, "w1", lambda event: True, 0.5, 5_000)["status"] == "done"
    assert abs(job(store, "a")["done_started_ms"] - now) < 60_000


@pytest.mark.parametrize("bad", [{"jitter": 2.0}, {"owner": "a b"}, {"lease_ms": 0},
                                 {"lease_ms": 3_600_001}, {"send": None}, {"clock": 5}])
def test_bad_arguments_are_refused_before_anything_is_claimed(store, bad):
    enqueue(store, {"id": "a", "qty": 1})
    args = {"owner": "w1", "send": lambda event: True, "jitter": 0.5, "lease_ms": 5_000, **bad}
    clock = args.pop("clock", None)
    with pytest.raises(ValueError):
        run_store_once(store, args["owner"], args["send"], args["jitter"], args["lease_ms"],
                 clock=clock)
    assert job(store, "a")["status"] == "pending"


def test_run_queue_owns_its_store_on_a_path_and_on_a_url(kind, location):
    with open_store(location, create=True) as store:  # now, by the store's own clock
        assert store.enqueue_events([{"id": "a", "qty": 1}], POLICY) == [True]
    assert run_queue(location, "w1", lambda event: True, 0.5, 5_000)["status"] == "done"
    assert run_queue(location, "w1", lambda event: True, 0.5, 5_000) is None


def test_run_queue_never_creates_a_missing_queue(tmp_path: Path):
    missing = tmp_path / "nothing.db"
    with pytest.raises(FileNotFoundError):
        run_queue(missing, "w1", lambda event: True, 0.5)
    assert not missing.exists()


def test_an_http_refusal_keeps_its_status_in_the_evidence(store):
    enqueue(store, {"id": "a", "qty": 1})

    def gone(event: dict) -> bool:
        error = Permanent("HTTP 410 Gone")
        error.http_status = 410  # type: ignore[attr-defined]
        raise error

    run_store_once(store, "w1", gone, 0.5, 5_000, clock=Clock(T0))
    [attempt] = history(store, "a")["attempts"]
    assert (attempt["http_status"], attempt["result"], attempt["reason"]) == (
        410, "dead", "permanent")

