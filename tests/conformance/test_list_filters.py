"""list_jobs's console filters, on every store: a substring of the last
attempt's error, the last attempt's HTTP status (exactly or by class, a done
job's delivering one first), and a time range of available_at (when a done
or dead job finished); combined with the others and with keyset pages."""

from __future__ import annotations

import pytest

from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.helpers import body_event
from tests.support.queues import T0

POLICY = RetryPolicy(max_attempts=1, ttl_ms=3_600_000)


@pytest.fixture
def finished(store):
    """gone: dead 410 at T0+10; slow: dead on a timeout at T0+20; fine: done
    200 at T0+30; waiting: pending, never tried."""
    store.enqueue_events([body_event(i, n=1) for i in ("gone", "slow", "fine", "waiting")],
                         POLICY, now_ms=T0)
    leased = {one.ticket["id"]: one for one in
              store.claim_jobs("d1", 60_000, 3, now_ms=T0).leased}
    for job_id, outcome, at, seen in (
            ("gone", "permanent", 10, Attempt(T0, 5, 410, "HTTPError: 410 Gone")),
            ("slow", "retry", 20, Attempt(T0, 9000, None, "TimeoutError: timed out")),
            ("fine", "ok", 30, Attempt(T0, 7, 200))):
        store.finish_jobs([(leased[job_id].ticket, outcome, 0, seen)], now_ms=T0 + at)
    return store


def ids(rows):
    return [row["id"] for row in rows]


def test_the_error_text_is_a_case_sensitive_substring_of_the_last_error(finished):
    assert ids(finished.list_jobs(error="410")) == ["gone"]
    assert ids(finished.list_jobs(error="timed out")) == ["slow"]
    assert ids(finished.list_jobs(error="Error")) == ["gone", "slow"]
    assert ids(finished.list_jobs(error="error")) == []
    assert ids(finished.list_jobs(error="50%_")) == []  # no wildcard


def test_the_http_status_exactly_or_by_class(finished):
    assert ids(finished.list_jobs(http_status=410)) == ["gone"]
    assert ids(finished.list_jobs(http_status="4xx")) == ["gone"]
    assert ids(finished.list_jobs(http_status="2xx")) == ["fine"]
    assert ids(finished.list_jobs(http_status="200")) == ["fine"]
    assert ids(finished.list_jobs(http_status="5xx")) == []


def test_a_time_range_of_when_they_finished(finished):
    assert ids(finished.list_jobs(from_ms=T0 + 15)) == ["slow", "fine"]
    assert ids(finished.list_jobs(from_ms=T0 + 10, to_ms=T0 + 30)) == ["gone", "slow"]
    assert ids(finished.list_jobs(status="dead", to_ms=T0 + 15)) == ["gone"]


def test_filters_combine_and_page(finished):
    first = finished.list_jobs(error="Error", limit=1)
    assert ids(first) == ["gone"]
    assert ids(finished.list_jobs(error="Error", limit=1, after_seq=first[0]["seq"])) == [
        "slow"]
    assert ids(finished.list_jobs(error="Error", http_status="4xx", status="dead")) == ["gone"]


@pytest.mark.parametrize("query", [{"error": ""}, {"error": "a\nb"}, {"error": 5},
                                   {"http_status": 99}, {"http_status": "6xx"},
                                   {"http_status": "4XX"}, {"http_status": True},
                                   {"from_ms": -1}, {"from_ms": T0, "to_ms": T0}])
def test_a_bad_filter_is_refused(store, query):
    with pytest.raises(ValueError):
        store.list_jobs(**query)
