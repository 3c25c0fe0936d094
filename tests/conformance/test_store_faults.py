"""Every transaction of every store is all or nothing: a fault hook that raises
before COMMIT leaves nothing written (the evidence and the audit rows
included), one that raises after it leaves the whole change; the hook's own
exception comes out, and the store goes on working. A bad argument is a
ValueError before anything is written."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lease.policy import PRODUCT, RetryPolicy
from lease.records import Attempt
from lease.store import Store
from lease.worker import MAX_BATCH, MAX_NOW_MS
from tests.support.queues import T0

from .conftest import Queues
from .helpers import Boom, dump, fault_at, tickets_of

POINTS = {
    "claim": ["after-claim", "after-commit"],
    "extend": ["after-extend", "after-commit"],
    "finish": ["after-finish", "after-commit"],
    "redrive": ["after-audit", "after-redrive", "after-commit"],
    "cancel": ["after-audit", "after-cancel", "after-commit"],
}

Call = Callable[..., object]


def prepare(store: Store, name: str) -> Call:
    """A queue ready for one call of ``name`` that changes several rows, and
    that call, taking its fault hook."""
    store.enqueue_events([{"id": "j", "qty": 2}, {"id": "k", "body": {"v": 1}},
                          {"id": "gone", "qty": 1}], RetryPolicy(ttl_ms=5000), now_ms=T0)
    store.enqueue_events([{"id": "late", "qty": 1}], RetryPolicy(ttl_ms=10), now_ms=T0)
    if name == "claim":  # the quarantine (late) and two leases, in one transaction
        return lambda fault: store.claim_jobs("o", 1000, 2, now_ms=T0 + 10, fault=fault)
    tickets = tickets_of(store.claim_jobs("o", 1000, 2, now_ms=T0))
    if name == "extend":
        return lambda fault: store.extend_lease(tickets[0], 2000, now_ms=T0 + 1, fault=fault)
    if name == "finish":  # a retry, a delivery and a stale one: rows, evidence, the tally
        items = [(tickets[0], "retry", 10, Attempt(T0, 5, 503, "busy")),
                 (tickets[1], "ok", 0, Attempt(T0, 7, 200)),
                 ({**tickets[0], "token": 9}, "ok", 0, Attempt(T0))]
        return lambda fault: store.finish_jobs(items, now_ms=T0 + 1, fault=fault)
    store.finish_jobs([(tickets[0], "permanent", 0, Attempt(T0)),
                       (tickets[1], "permanent", 0, Attempt(T0))], now_ms=T0 + 1)
    ids = ["j", "k", "gone", "nope"]
    if name == "redrive":
        return lambda fault: store.redrive_jobs(ids, 1000, "fixed", now_ms=T0 + 2, fault=fault)
    return lambda fault: store.cancel_jobs(ids, "withdrawn", now_ms=T0 + 2, fault=fault)


@pytest.mark.parametrize(("name", "point"), [(n, p) for n, ps in POINTS.items() for p in ps])
def test_fault_points(store: Store, queues: Queues, name: str, point: str) -> None:
    with queues.fresh() as reference:  # the same call with no fault, on a queue of its own
        prepare(reference, name)(None)
        after = dump(reference, T0 + 20)

    call = prepare(store, name)
    before = dump(store, T0 + 20)
    seen: list[str] = []
    with pytest.raises(Boom) as raised:
        call(fault_at(point, seen))
    assert str(raised.value) == point  # the hook's own exception, not a wrapper
    assert seen == POINTS[name][: POINTS[name].index(point) + 1]
    assert dump(store, T0 + 20) == (after if point == "after-commit" else before)
    if point != "after-commit":  # nothing was left open: the same call now goes through
        call(None)
        assert dump(store, T0 + 20) == after


def test_an_interrupt_in_a_hook_rolls_back(store: Store) -> None:
    store.enqueue_events([{"id": "j", "qty": 1}], now_ms=T0)
    before = dump(store, T0)

    def interrupt(where: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.claim_jobs("o", 1000, now_ms=T0, fault=interrupt)
    assert dump(store, T0) == before
    assert tickets_of(store.claim_jobs("o", 1000, now_ms=T0))[0]["id"] == "j"


def test_no_hook_runs_when_a_call_changes_nothing(store: Store) -> None:
    calls: list[str] = []
    store.enqueue_events([{"id": "gone", "qty": 1}], RetryPolicy(ttl_ms=5), now_ms=T0)
    ticket = tickets_of(store.claim_jobs("o", 1000, now_ms=T0))[0]
    assert store.claim_jobs("o", 1000, now_ms=T0 + 5, fault=calls.append).leased == []
    assert store.finish_jobs([], now_ms=T0 + 5, fault=calls.append) == []
    assert store.finish_jobs([(ticket, "ok", 0, Attempt(T0))], now_ms=T0 + 5,
                             fault=calls.append) == [False]
    assert store.extend_lease(ticket, 10, now_ms=T0 + 5, fault=calls.append) is False
    assert isinstance(store.redrive_jobs(["nope"], 9, "n", now_ms=T0 + 5,
                                         fault=calls.append)[0], ValueError)
    assert store.redrive_jobs([], 9, "n", now_ms=T0 + 5, fault=calls.append) == []
    assert isinstance(store.cancel_jobs(["nope"], "n", now_ms=T0 + 5,
                                        fault=calls.append)[0], ValueError)
    assert calls == []
    assert store.counts()["dead"] == 1  # the quarantine was committed all the same


# ----------------------------------------------------------------- bad arguments


def ticket_bads(ticket: dict) -> list:
    bads: list = [{k: v for k, v in ticket.items() if k != "attempt"}, {**ticket, "extra": 1},
                  None, list(ticket.items()), {**ticket, "id": "a b"}, {**ticket, "id": ""},
                  {**ticket, "owner": "bad owner"}, {**ticket, "owner": None}]
    for key in ("qty", "token", "attempt", "lease_until"):
        bads += [{**ticket, key: bad} for bad in (True, -1, 1.0, "1", None)]
    return bads


DUE = T0 + 100  # every job's deadline: a bad claim at it must not quarantine one
NOW_BADS = [True, -1, 1.5, "1000", MAX_NOW_MS + 1]  # None: the store's clock, not bad


def bad_calls(store: Store, ticket: dict) -> list[Call]:
    seen = Attempt(T0)
    calls: list[Call] = [
        lambda: store.enqueue_events([{"id": "n", "qty": 1}], "policy", now_ms=T0),
        lambda: store.enqueue_events([{"id": "n", "qty": 1}], now_ms=T0, not_before_ms=T0 - 1),
        lambda: store.claim_jobs("bad owner", 1000, now_ms=DUE),
        lambda: store.claim_jobs("o", 0, now_ms=DUE),
        lambda: store.claim_jobs("o", PRODUCT.max_lease_ms + 1, now_ms=DUE),
        lambda: store.claim_jobs("o", 1000, 0, now_ms=DUE),
        lambda: store.claim_jobs("o", 1000, True, now_ms=DUE),
        lambda: store.claim_jobs("o", 1000, MAX_BATCH + 1, now_ms=DUE),
        lambda: store.claim_jobs("o", 1000, now_ms=DUE, fault="after-claim"),
        lambda: store.extend_lease(ticket, 0, now_ms=T0),
        lambda: store.extend_lease(ticket, 10, now_ms=T0, fault=1),
        lambda: store.finish_jobs(((ticket, "ok", 0, seen),), now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0)], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0, None)], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "done", 0, seen)], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "retry", -1, seen)], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "retry", PRODUCT.max_delay_ms + 1, seen)],
                                  now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0, Attempt(T0, error=b"x"))],
                                  now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0, Attempt(-5))], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0, seen),
                                   ({**ticket, "qty": -1}, "ok", 0, seen)], now_ms=T0),
        lambda: store.finish_jobs([(ticket, "ok", 0, seen)] * (MAX_BATCH + 1), now_ms=T0),
        lambda: store.redrive_jobs(("d",), 1000, "n", now_ms=T0),
        lambda: store.redrive_jobs(["d", "bad id"], 1000, "n", now_ms=T0),
        lambda: store.redrive_jobs(["d"] * (MAX_BATCH + 1), 1000, "n", now_ms=T0),
        lambda: store.redrive_jobs(["d"], 0, "n", now_ms=T0),
        lambda: store.redrive_jobs(["d"], PRODUCT.max_ttl_ms + 1, "n", now_ms=T0),
        lambda: store.redrive_jobs(["d"], 1000, "", now_ms=T0),
        lambda: store.redrive_jobs(["d"], 1000, "line\nbreak", now_ms=T0),
        lambda: store.cancel_jobs(["d", ""], "n", now_ms=T0),
        lambda: store.cancel_jobs(["d"], "x" * 501, now_ms=T0),
        lambda: store.cancel_jobs(["d"], "n", now_ms=T0, fault="x"),
        lambda: store.prune_done(-1),
        lambda: store.prune_done(T0, 0),
        lambda: store.prune_done(T0, MAX_BATCH + 1),
        lambda: store.snapshot(-1),
        lambda: store.dead_jobs("bad reason"),
        lambda: store.dead_jobs(limit=0),
        lambda: store.dead_jobs(key="bad key"),
        lambda: store.dead_jobs("deadline", key=""),
        lambda: store.list_jobs(status="dead", key="x" * 256),
        lambda: store.jobs_with_status("gone"),
        lambda: store.job_history("a b"),
    ]
    calls += [lambda bad=bad: store.extend_lease(bad, 10, now_ms=T0)
              for bad in ticket_bads(ticket)]
    calls += [lambda bad=bad: store.finish_jobs([(bad, "ok", 0, seen)], now_ms=T0)
              for bad in ticket_bads(ticket)]
    for bad in NOW_BADS:
        calls += [lambda bad=bad: store.enqueue_events([{"id": "n", "qty": 1}], now_ms=bad),
                  lambda bad=bad: store.claim_jobs("o", 1000, now_ms=bad),
                  lambda bad=bad: store.finish_jobs([(ticket, "ok", 0, seen)], now_ms=bad),
                  lambda bad=bad: store.redrive_jobs(["d"], 9, "n", now_ms=bad),
                  lambda bad=bad: store.cancel_jobs(["d"], "n", now_ms=bad)]
    return calls


def test_bad_arguments_are_refused_and_nothing_is_written(store: Store) -> None:
    store.enqueue_events([{"id": "d", "qty": 1}, {"id": "l", "qty": 2}, {"id": "due", "qty": 3}],
                         RetryPolicy(ttl_ms=100), now_ms=T0)
    dead = tickets_of(store.claim_jobs("o", 50, now_ms=T0))[0]
    store.finish_jobs([(dead, "permanent", 0, Attempt(T0))], now_ms=T0)
    ticket = tickets_of(store.claim_jobs("o", 50, now_ms=T0))[0]
    before = dump(store, T0 + 1)
    calls = bad_calls(store, ticket)
    assert len(calls) > 100
    for call in calls:
        with pytest.raises(ValueError):
            call()
        assert dump(store, T0 + 1) == before
    assert store.finish_jobs([(ticket, "ok", 0, Attempt(T0))], now_ms=T0 + 1) == [("done", None)]
