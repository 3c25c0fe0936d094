"""An intake that meets a conflict, on every store: by default each Conflict
comes back in the results and the others are written; with
``on_conflict="raise"`` the whole call is refused (Conflicts, naming each
conflicting event) and nothing of it is written."""

from __future__ import annotations

import pytest

from lease.policy import DEFAULT_POLICY
from lease.records import Conflicts
from lease.store import Store
from lease.worker import Conflict
from tests.support.queues import T0

EVENTS = [{"id": "d-1", "body": {"v": 1}}, {"id": "d-2", "qty": 2},
          {"id": "d-1", "body": {"v": 3}}, {"id": "old", "qty": 1},
          {"id": "old", "qty": 9}]


def pending(store: Store) -> list[str]:
    return sorted(job["id"] for job in store.jobs_with_status("pending"))


def test_on_conflict_raise_refuses_the_whole_intake_and_names_each_conflict(store: Store):
    assert store.enqueue_events([{"id": "old", "qty": 1}], now_ms=T0) == [True]
    with pytest.raises(Conflicts) as refused:
        store.enqueue_events(EVENTS, DEFAULT_POLICY, now_ms=T0, on_conflict="raise")
    assert [index for index, _ in refused.value.conflicts] == [2, 4]
    assert refused.value.results[:2] == [True, True] and refused.value.results[3] is False
    assert "2 of 5 events conflict, nothing was enqueued: event 3: job 'd-1'" in str(
        refused.value)
    assert "event 5: job 'old'" in str(refused.value)
    assert isinstance(refused.value, Conflict)  # ``except Conflict`` catches it too
    assert pending(store) == ["old"]  # nothing of the refused call


def test_on_conflict_return_gives_each_conflict_and_writes_the_rest(store: Store):
    assert store.enqueue_events([{"id": "old", "qty": 1}], now_ms=T0) == [True]
    results = store.enqueue_events(EVENTS, now_ms=T0)  # the default
    assert [type(r).__name__ if isinstance(r, Conflict) else r for r in results] == [
        True, True, "Conflict", False, "Conflict"]
    assert pending(store) == ["d-1", "d-2", "old"]


def test_on_conflict_must_be_named(store: Store):
    with pytest.raises(ValueError, match="on_conflict must be one of"):
        store.enqueue_events(EVENTS, now_ms=T0, on_conflict="skip")
    assert pending(store) == []
