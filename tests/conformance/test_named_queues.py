"""Named queues beside each other: the default queue and two named ones in one
PostgreSQL database, or in one SQLite file and the two beside it, the same
ids in each; what one queue's claim, finish, dead letter and redrive change,
the others never see."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lease.records import Attempt
from lease.store import Store
from lease.stores import list_queues, open_store
from tests.conformance.conftest import ManualClock
from tests.conformance.helpers import dump
from tests.support.queues import T0

NAMES = (None, "orders", "mail")
IDS = ["a", "b", "c"]


@pytest.fixture(params=["sqlite", "postgresql"])
def home(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The default queue's location: a file, or a fresh database."""
    if request.param == "sqlite":
        return str(tmp_path / "q.db")
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def three(home: str) -> Iterator[dict[str | None, Store]]:
    """The default queue and two named ones, each holding jobs a, b and c."""
    with contextlib.ExitStack() as stack:
        stores = {name: stack.enter_context(contextlib.closing(
            open_store(home, create=True, queue=name, clock=ManualClock(T0))))
            for name in NAMES}
        for name, store in stores.items():
            assert store.enqueue_events([{"id": job_id, "body": {"queue": str(name)}}
                                         for job_id in IDS], now_ms=T0) == [True] * 3
        yield stores


def _others(three: dict[str | None, Store], name: str | None) -> dict:
    return {other: dump(store, T0 + 10_000) for other, store in three.items() if other != name}


@pytest.mark.parametrize("name", NAMES)
def test_a_claim_finish_dead_and_redrive_change_their_queue_alone(three, name):
    before = _others(three, name)
    store = three[name]
    claimed = store.claim_jobs("w", 5_000, 10, now_ms=T0 + 1)
    assert sorted(job.event["id"] for job in claimed.leased) == IDS
    assert {json.loads(job.event["body"])["queue"] for job in claimed.leased} == {str(name)}
    by_id = {job.event["id"]: job.ticket for job in claimed.leased}
    seen = Attempt(T0 + 2, 1, 200)
    refused = Attempt(T0 + 2, 1, 410)
    store.finish_jobs([(by_id["a"], "ok", 0, seen), (by_id["b"], "permanent", 0, refused),
                       (by_id["c"], "retry", 10, Attempt(T0 + 2, 1, 503))], now_ms=T0 + 3)
    assert [row["id"] for row in store.dead_jobs()] == ["b"]
    assert store.redrive_jobs(["b"], 60_000, "fixed", now_ms=T0 + 4) == [True]
    assert store.cancel_jobs(["c"], "not wanted", now_ms=T0 + 5) == [True]
    counts = store.counts()
    assert (counts["done"], counts["pending"], counts["dead"]) == (1, 1, 1)
    assert _others(three, name) == before  # the neighbours, row for row and figure for figure


def test_each_queue_is_listed_by_its_name(three, home):
    assert list_queues(home) == ["default", "mail", "orders"]


def test_a_named_queue_is_never_created_by_a_read(home):
    open_store(home, create=True).close()
    with pytest.raises(Exception, match="no queue|not found|No such file"):
        open_store(home, queue="orders", read_only=True)
    assert list_queues(home) == ["default"]
