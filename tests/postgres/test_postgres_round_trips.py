"""How many times a claim and a finish wait for the server: counted by a
proxy from the protocol (tests.support.round_trips). On loopback a round trip
costs tens of microseconds; across a network, hundreds, so each one is part
of the claim's price wherever the server is not on the same host."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from urllib.parse import urlencode, urlsplit, urlunsplit

import pytest

from lease.endpoints import Endpoint
from lease.postgres import PostgresStore
from lease.records import Attempt, Claimed
from tests.support.round_trips import RoundTrips

LEASE_MS = 600_000
WARM_CYCLES = 8  # past psycopg's prepare threshold: the statements are prepared before counting


def through(url: str, port: int) -> str:
    """``url`` with its host and port the proxy's, without TLS."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@127.0.0.1:{port}" if user else f"127.0.0.1:{port}"
    query = "&".join(q for q in (parts.query, urlencode(
        {"sslmode": "disable", "gssencmode": "disable"})) if q)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


@pytest.fixture
def counted(postgres_url: str) -> Iterator[tuple[PostgresStore, RoundTrips]]:
    """A queue of jobs of its own and one endpoint's deliveries, and a store
    that reaches it through the proxy."""
    with PostgresStore(postgres_url, create=True) as setup:
        # the own jobs first: an intake with no endpoint makes jobs of the queue's own
        setup.enqueue_events({"id": f"own-{i}", "qty": 1} for i in range(400))
        setup.add_endpoint(Endpoint("only", "https://only.example/hook"))
        setup.enqueue_events({"id": f"m-{i}", "qty": 1} for i in range(400))
    parts = urlsplit(postgres_url)
    with RoundTrips(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy, \
            PostgresStore(through(postgres_url, proxy.port)) as store:
        yield store, proxy


def trips(proxy: RoundTrips, call: Callable[[], Claimed | None]) -> tuple[int, Claimed | None]:
    before = proxy.count
    result = call()
    return proxy.count - before, result


def finish(store: PostgresStore, claimed: Claimed, outcome: str = "ok") -> None:
    results = store.finish_jobs([(job.ticket, outcome, 0, Attempt(
        claimed.now_ms, 1, 503 if outcome == "retry" else 200)) for job in claimed.leased])
    assert results == [("done" if outcome == "ok" else "pending",
                        None if outcome == "ok" else "retry")] * len(claimed.leased)


def cycle(store: PostgresStore, proxy: RoundTrips, endpoints: str | None,
          outcome: str = "ok") -> tuple[int, int]:
    """The round trips of one claim of 8 and of its finish."""
    claim_trips, claimed = trips(proxy, lambda: store.claim_jobs(
        "w", LEASE_MS, 8, endpoints=endpoints))
    assert claimed is not None and len(claimed.leased) == 8
    finish_trips, _ = trips(proxy, lambda: finish(store, claimed, outcome))
    return claim_trips, finish_trips


def test_a_claim_of_deliveries_waits_once_more_than_a_plain_claim_and_its_finish_no_more(
        counted: tuple[PostgresStore, RoundTrips]) -> None:
    store, proxy = counted
    for _ in range(WARM_CYCLES):
        cycle(store, proxy, None)
        cycle(store, proxy, "*")
    plain = cycle(store, proxy, None)
    deliveries = cycle(store, proxy, "*")
    # the same figures again: nothing counted depends on the moment
    assert cycle(store, proxy, None) == plain
    assert cycle(store, proxy, "*") == deliveries
    # a plain claim waits for its BEGIN, its clock and the queue's pause,
    # its quarantine and pick (which records the claim on its owner's row),
    # and its COMMIT
    assert plain[0] == 4
    # the rotation goes in the quarantine's round trip; then one statement
    # picks and leases the endpoint's share
    assert deliveries[0] == plain[0] + 1
    assert deliveries[1] == plain[1]


def test_a_finish_of_retries_waits_as_often_as_a_finish_of_jobs_done(
        counted: tuple[PostgresStore, RoundTrips]) -> None:
    """A retry writes an attempts row, and a delivery's failures step its
    endpoint's circuit (written, maybe opened and audited): writes whose
    results nothing reads, sent in the round trip of the finish's rollup. A
    circuit that moves is locked first, in a round trip of its own (the lock
    order: endpoint rows, then keys, then job rows)."""
    store, proxy = counted
    for _ in range(WARM_CYCLES):
        cycle(store, proxy, None)
        cycle(store, proxy, "*")
    done = cycle(store, proxy, None)[1]
    assert done >= 2
    assert cycle(store, proxy, None, "retry")[1] == done
    assert cycle(store, proxy, "*", "retry")[1] == done + 1
    assert store.endpoint_stats()[0]["retried"] == 8  # the failures were written
