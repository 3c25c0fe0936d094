"""The operator's observations on every store: pages of jobs by filter with
keyset pagination, the snapshot's figures of the moment and of the last day,
and who made each audited change."""

from __future__ import annotations

import pytest

from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.support.queues import T0

from .helpers import claim_one, history

DAY = 86_400_000


def enqueue(store, *ids: str, now: int = T0, ttl: int = 10 * DAY) -> None:
    events = [{"id": job_id, "qty": 1} for job_id in ids]
    policy = RetryPolicy(max_attempts=3, ttl_ms=ttl)
    assert store.enqueue_events(events, policy, now_ms=now) == [True] * len(ids)


def kill(store, ticket: dict, now: int, error: str = "Permanent: HTTP 410") -> None:
    seen = Attempt(now, 5, 410, error)
    [result] = store.finish_jobs([(ticket, "permanent", 0, seen)], now_ms=now)
    assert result == ("dead", "permanent")


def ids(rows: list[dict]) -> list[str]:
    return [row["id"] for row in rows]


def test_a_page_of_jobs_by_status_reason_and_id_prefix(store):
    enqueue(store, "order-1", "order-2", "user-1", "order-3")
    kill(store, claim_one(store, "o", T0 + 1), T0 + 2)  # order-1
    assert ids(store.list_jobs()) == ["order-1", "order-2", "user-1", "order-3"]
    assert ids(store.list_jobs(status="pending")) == ["order-2", "user-1", "order-3"]
    assert ids(store.list_jobs(id_prefix="order-")) == ["order-1", "order-2", "order-3"]
    assert ids(store.list_jobs(status="pending", id_prefix="order")) == ["order-2", "order-3"]
    [dead] = store.list_jobs(status="dead", reason="permanent")
    assert dead["id"] == "order-1" and dead["last_error"] == "Permanent: HTTP 410"
    assert store.list_jobs(status="dead", reason="exhausted") == []
    assert store.list_jobs(id_prefix="order-1x") == []
    assert all("last_error" in row for row in store.list_jobs())
    assert [row["last_error"] for row in store.list_jobs(status="pending")] == [None] * 3


def test_keyset_pages_cover_every_job_once_in_order(store):
    enqueue(store, *[f"j{n:03d}" for n in range(23)])
    seen: list[str] = []
    after = None
    while True:
        page = store.list_jobs(after_seq=after, limit=5)
        if not page:
            break
        assert len(page) <= 5
        seen += ids(page)
        after = page[-1]["seq"]
    assert seen == [f"j{n:03d}" for n in range(23)]
    # a job enqueued between pages appears on a later page, never an earlier one twice
    enqueue(store, "late", now=T0 + 1)
    assert ids(store.list_jobs(after_seq=after)) == ["late"]


def test_dead_jobs_and_a_page_of_one_ordering_key(store):
    """The operator's bulk by key: only that key's dead jobs, compared exactly
    (another case, a longer key, no key at all are other lines), with the
    reason and the limit as before; a page of jobs by key the same way."""
    policy = RetryPolicy(max_attempts=3, ttl_ms=100)
    assert store.enqueue_events([{"id": "g-1", "qty": 1, "key": "custG"}], policy,
                                now_ms=T0) == [True]
    kill(store, claim_one(store, "o", T0), T0 + 1)  # g-1: dead/permanent, custG blocked
    keyed = [("e-1", "custE"), ("f-1", "custF"), ("e-2", "custE"), ("free", None),
             ("low-1", "custe"), ("e-3", "custE"), ("long-1", "custE2")]
    events = [{"id": job_id, "qty": 1, **({} if key is None else {"key": key})}
              for job_id, key in keyed]
    assert store.enqueue_events(events, policy, now_ms=T0 + 2) == [True] * len(keyed)
    moved = store.claim_jobs("o", 1000, 10, now_ms=T0 + 102)  # every one past its deadline
    assert moved.leased == [] and moved.moved == {"deadline": len(keyed), "exhausted": 0}
    assert store.enqueue_events([{"id": "e-late", "qty": 1, "key": "custE"}],
                                now_ms=T0 + 103) == [True]  # pending behind dead e-1
    assert ids(store.dead_jobs()) == ["g-1", *(job_id for job_id, _ in keyed)]
    mine = store.dead_jobs(key="custE")
    assert ids(mine) == ["e-1", "e-2", "e-3"]
    assert {(row["ordering_key"], row["reason"], row["last_error"]) for row in mine} == {
        ("custE", "deadline", None)}
    assert ids(store.dead_jobs("deadline", key="custE")) == ["e-1", "e-2", "e-3"]
    assert ids(store.dead_jobs("deadline", 2, key="custE")) == ["e-1", "e-2"]
    assert store.dead_jobs("permanent", key="custE") == []
    [gone] = store.dead_jobs("permanent", key="custG")
    assert (gone["id"], gone["last_error"]) == ("g-1", "Permanent: HTTP 410")
    assert ids(store.dead_jobs(key="custe")) == ["low-1"]
    assert store.dead_jobs(key="cust") == [] and store.dead_jobs(key="nobody") == []
    assert ids(store.list_jobs(key="custE")) == ["e-1", "e-2", "e-3", "e-late"]
    assert ids(store.list_jobs(status="pending", key="custE")) == ["e-late"]
    first = store.list_jobs(status="dead", key="custE", limit=2)
    assert ids(first) == ["e-1", "e-2"]
    assert ids(store.list_jobs(status="dead", key="custE", after_seq=first[-1]["seq"])) == [
        "e-3"]
    assert ids(store.list_jobs(status="dead", key="custE", id_prefix="e-3")) == ["e-3"]
    assert ids(store.list_jobs(status="dead", reason="permanent", key="custE")) == []


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, 7, "caf\u00e9", "tab\t"])
def test_a_bad_ordering_key_filter_is_refused(store, key):
    with pytest.raises(ValueError, match="key"):
        store.dead_jobs(key=key)
    with pytest.raises(ValueError, match="key"):
        store.list_jobs(key=key)


@pytest.mark.parametrize("bad", [
    {"status": "gone"}, {"reason": "no spaces"}, {"id_prefix": ""}, {"id_prefix": 7},
    {"after_seq": -1}, {"after_seq": "1"}, {"limit": 0}, {"limit": 1001}, {"limit": True},
    {"key": ""}, {"key": "a b"},
])
def test_a_bad_filter_is_refused(store, bad):
    with pytest.raises(ValueError):
        store.list_jobs(**bad)


def test_the_snapshot_tells_live_from_expired_leases_and_the_oldest_ready_job(store):
    enqueue(store, "a", "b", "c", now=T0)
    enqueue(store, "later", now=T0 + 100)
    claim_one(store, "o", T0 + 10, 1_000)  # a: live until T0 + 1010
    claim_one(store, "o", T0 + 20, 100)  # b: expires at T0 + 120
    snap = store.snapshot(T0 + 500)
    assert (snap["live_leases"], snap["expired_leases"]) == (1, 1)
    assert snap["oldest_ready_age_ms"] == 500  # c, ready since T0
    assert snap["oldest_unfinished_age_ms"] == 500


def test_no_ready_job_is_no_age(store):
    assert store.snapshot(T0)["oldest_ready_age_ms"] is None
    enqueue(store, "a")
    claim_one(store, "o", T0, 1_000)
    assert store.snapshot(T0 + 1)["oldest_ready_age_ms"] is None


def test_redrives_and_cancels_of_the_last_day_and_who_made_them(store):
    enqueue(store, "a", "b", "c")
    for now in (T0 + 1, T0 + 2, T0 + 3):
        kill(store, claim_one(store, "o", now), now)
    assert store.redrive_jobs(["a"], DAY, "old fix", now_ms=T0 + 10, actor="alice") == [True]
    assert store.cancel_jobs(["b"], "withdrawn", now_ms=T0 + 20, actor="ops-token") == [True]
    later = T0 + DAY + 15
    assert store.redrive_jobs(["c"], DAY, "new fix", now_ms=later) == [True]
    snap = store.snapshot(later)
    assert (snap["redrives"], snap["redrives_last_day"]) == (2, 1)
    assert (snap["cancels"], snap["cancels_last_day"]) == (1, 1)
    assert [r["actor"] for r in history(store, "a")["redrives"]] == ["alice"]
    assert [r["actor"] for r in history(store, "c")["redrives"]] == [None]
    [cancel] = history(store, "b")["cancels"]
    assert (cancel["actor"], cancel["note"], cancel["was"]) == (
        "ops-token", "withdrawn", "dead/permanent")


@pytest.mark.parametrize("actor", ["", "x" * 101, "a\nb", 7])
def test_a_bad_actor_is_refused_and_nothing_changes(store, actor):
    enqueue(store, "a")
    kill(store, claim_one(store, "o", T0 + 1), T0 + 1)
    with pytest.raises(ValueError, match="actor"):
        store.redrive_jobs(["a"], DAY, "fix", now_ms=T0 + 2, actor=actor)
    with pytest.raises(ValueError, match="actor"):
        store.cancel_jobs(["a"], "fix", now_ms=T0 + 2, actor=actor)
    assert store.counts()["dead"] == 1 and history(store, "a")["redrives"] == []
