"""The PostgreSQL outbox keeps the trace context of the service's span (lease.tracing)."""

from __future__ import annotations

import psycopg
from opentelemetry import trace

from lease.postgres import PostgresStore, enqueue_in
from lease.tracing import carrier_of
from tests.support.queues import T0
from tests.support.tracing import recording, traceparent


def test_the_outbox_keeps_the_span_of_the_services_transaction(postgres_url: str) -> None:
    tracer = trace.get_tracer("shop")
    with PostgresStore(postgres_url, create=True) as store:
        with psycopg.connect(postgres_url) as shop, recording(), \
                tracer.start_as_current_span("place") as span, shop.transaction():
            assert enqueue_in(shop, [{"id": "o-1", "qty": 1}], now_ms=T0) == [True]
        [job] = store.claim_jobs("d1", 10_000, 1, now_ms=T0).leased
    assert carrier_of(job.trace) == {"traceparent": traceparent(span.get_span_context())}
