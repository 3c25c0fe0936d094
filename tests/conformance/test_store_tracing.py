"""The trace context an intake ran in (lease.tracing), kept with its jobs on
every store: a claim hands it back, a fan-out gives it to every delivery."""

from __future__ import annotations

from opentelemetry import trace

from lease.endpoints import Endpoint
from lease.store import Store
from lease.tracing import carrier_of
from tests.support.queues import T0
from tests.support.tracing import recording, traceparent


def kept_by_id(store: Store, **options: object) -> dict[str, str | None]:
    claimed = store.claim_jobs("d1", 10_000, 100, now_ms=T0, **options)  # type: ignore[arg-type]
    return {job.ticket["id"]: job.trace for job in claimed.leased}


def test_an_intake_inside_a_span_keeps_its_context_and_one_outside_keeps_none(store: Store):
    with recording():
        with trace.get_tracer("shop").start_as_current_span("place orders") as span:
            assert store.enqueue_events([{"id": "a", "qty": 1},
                                         {"id": "b", "body": {"n": 2}}], now_ms=T0) == [True] * 2
        assert store.enqueue_events([{"id": "c", "qty": 3}], now_ms=T0) == [True]
    kept = kept_by_id(store)
    sent = traceparent(span.get_span_context())
    assert {job_id: (carrier_of(text) or {}).get("traceparent") for job_id, text in
            kept.items()} == {"a": sent, "b": sent, "c": None}


def test_every_delivery_of_a_message_keeps_its_intakes_context(store: Store):
    for name in ("crm", "shop"):
        store.add_endpoint(Endpoint(name, "http://127.0.0.1:1/events"), now_ms=T0)
    with recording(), trace.get_tracer("shop").start_as_current_span("pay") as span:
        assert store.enqueue_events([{"id": "m", "body": {"paid": True}}], now_ms=T0) == [True]
    kept = kept_by_id(store, endpoints="*")
    sent = traceparent(span.get_span_context())
    assert {job_id: (carrier_of(text) or {}).get("traceparent")
            for job_id, text in kept.items()} == {"m@crm": sent, "m@shop": sent}
