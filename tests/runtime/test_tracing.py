"""Tracing with OpenTelemetry (asyncworker.tracing, lease.tracing), seen through
the SDK's in-memory exporter: the intake's context kept, one span per attempt
linked to it, the request's traceparent, the receiver's span its child."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from asyncworker import Dispatcher, make_app, tracing
from asyncworker.receiving.idempotent import Event, receiver_app
from lease.http import Destination
from lease.policy import RetryPolicy
from lease.sqlite import SQLiteStore, enqueue_in
from lease.tracing import capture, carrier_of
from tests.support.dispatching import until
from tests.support.tracing import named, recording, traceparent

KEY = bytes(range(32))
QUICK = RetryPolicy(backoff_base_ms=1, backoff_cap_ms=1)  # a retry at once
ORDER = {"id": "order-1", "body": {"item": "tea", "qty": 2}}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Served:
    """An aiohttp app on 127.0.0.1 port 0; the headers of every request it got."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.headers: list[dict[str, str]] = []

        @web.middleware
        async def keep_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.headers.append({name.lower(): value for name, value in request.headers.items()})
            return await handler(request)

        app.middlewares.append(keep_headers)

    async def __aenter__(self) -> Served:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/events"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def failing_once() -> Callable[[sqlite3.Connection, Event], None]:
    """An effect that raises the first time (a 500: the sender retries)."""
    failures = [RuntimeError("the shop's disk hiccuped")]

    def effect(con: sqlite3.Connection, event: Event) -> None:
        if failures:
            raise failures.pop()

    return effect


def queue_with(path: Path, events: list[dict]) -> None:
    with SQLiteStore(path, create=True) as store:
        assert store.enqueue_events(events) == [True] * len(events)


def dispatcher(path: Path, url: str) -> Dispatcher:
    """Signed requests: the trace headers must leave the signature as it was."""
    return Dispatcher(str(path), "d1", destination=Destination(url, secrets=(KEY,)),
                      policy=QUICK, lease_ms=10_000, create=True)


async def deliver_all(path: Path, url: str) -> None:
    async with dispatcher(path, url) as d:
        stats = await d.run(until_idle=True)
    assert (stats.ok, stats.retried, stats.dead) == (1, 1, 0)


# ------------------------------------------------------------------ the intake's context


def test_capture_keeps_the_current_span_context_and_nothing_outside_one():
    with recording():
        assert capture() is None  # no span
        tracer = trace.get_tracer("shop")
        with tracer.start_as_current_span("place order") as span:
            kept = capture()
        assert kept is not None
        assert carrier_of(kept) == {"traceparent": traceparent(span.get_span_context())}
    assert capture() is None  # no provider, no span: nothing kept
    assert carrier_of("not json") is None
    assert carrier_of('{"tracestate": "a=b"}') is None  # no parent: nothing to link


def test_the_outbox_keeps_the_span_of_the_services_transaction(tmp_path: Path):
    path = tmp_path / "shop.db"
    SQLiteStore(path, create=True, shared=True).close()
    shop = sqlite3.connect(path, isolation_level=None)
    try:
        with recording(), trace.get_tracer("shop").start_as_current_span("place") as span:
            shop.execute("BEGIN IMMEDIATE")
            assert enqueue_in(shop, [ORDER]) == [True]
            shop.execute("COMMIT")
    finally:
        shop.close()
    with SQLiteStore(path) as store:
        [job] = store.claim_jobs("d1", 10_000, 1).leased
    assert carrier_of(job.trace) == {"traceparent": traceparent(span.get_span_context())}


# ------------------------------------------------------------------ the attempts and the receiver


async def test_each_attempt_is_a_span_linked_to_the_intake_and_the_receiver_continues_it(
        tmp_path: Path):
    tracer = trace.get_tracer("shop")
    with recording() as exporter:
        app = receiver_app(tmp_path / "shop.db", failing_once(), secrets=[KEY])
        async with Served(app) as rx, dispatcher(tmp_path / "queue.db", rx.url) as d:
            with tracer.start_as_current_span("place order") as intake:
                # the intake's transaction runs on the store's thread: the span goes with it
                assert await d.queue.enqueue_events([ORDER]) == [True]
            with tracer.start_as_current_span("the service"):  # no parent of an attempt's
                stats = await d.run(until_idle=True)
        assert (stats.ok, stats.retried, stats.dead) == (1, 1, 0)
        sends, receives = named(exporter, tracing.SEND_SPAN), named(exporter, tracing.RECEIVE_SPAN)

    intake_context = intake.get_span_context()
    assert len(sends) == 2, "one span per attempt: the failed one and its retry"
    for number, send in enumerate(sends, start=1):
        assert send.kind is SpanKind.CLIENT
        assert send.parent is None, "an attempt is a root: linked to its intake, not its child"
        assert [(link.context.trace_id, link.context.span_id) for link in send.links] == [
            (intake_context.trace_id, intake_context.span_id)]
        assert send.context.trace_id != intake_context.trace_id
        assert send.attributes is not None
        assert send.attributes[tracing.ATTEMPT] == number
        assert send.attributes["messaging.message.id"] == "order-1"
        assert send.attributes["asyncworker.job.id"] == "order-1"
        assert send.attributes["server.address"] == "127.0.0.1"
    assert [send.attributes and send.attributes[tracing.OUTCOME] for send in sends] == [
        "retry", "ok"]
    assert [send.attributes and send.attributes["http.response.status_code"]
            for send in sends] == [500, 200]
    assert [send.status.status_code for send in sends] == [StatusCode.ERROR, StatusCode.UNSET]

    # the request carried its attempt's span, and the signature still verified
    assert [headers["traceparent"] for headers in rx.headers] == [
        traceparent(send.context) for send in sends]
    assert len(receives) == 2
    for send, receive in zip(sends, receives, strict=True):
        assert receive.kind is SpanKind.SERVER
        assert receive.parent is not None and receive.parent.span_id == send.context.span_id
        assert receive.context.trace_id == send.context.trace_id
    assert receives[0].attributes is not None and receives[1].attributes is not None
    assert receives[0].attributes["http.response.status_code"] == 500
    assert tracing.RECEIVE_OUTCOME not in receives[0].attributes  # the effect raised
    assert receives[1].attributes[tracing.RECEIVE_OUTCOME] == "applied"


async def test_without_a_provider_nothing_is_traced_and_everything_works(tmp_path: Path):
    path = tmp_path / "queue.db"
    queue_with(path, [ORDER])
    assert tracing.tracer() is None
    async with Served(receiver_app(tmp_path / "shop.db", failing_once(),
                                   secrets=[KEY])) as rx:
        await deliver_all(path, rx.url)
    assert len(rx.headers) == 2
    assert not any("traceparent" in headers for headers in rx.headers)


async def test_a_provider_set_while_the_dispatcher_runs_is_honoured_from_its_next_claim(
        tmp_path: Path):
    async with Served(receiver_app(tmp_path / "shop.db", lambda con, event: None)) as rx, \
            Dispatcher(str(tmp_path / "queue.db"), "d1", url=rx.url, create=True) as d:
        running = asyncio.create_task(d.run())
        await d.queue.enqueue_events([{"id": "before", "body": {}}])
        await until(lambda: d.stats.ok == 1)
        with recording() as exporter:
            await d.queue.enqueue_events([{"id": "after", "body": {}}])
            await until(lambda: d.stats.ok == 2)
            d.stop()
            await running
            sends = named(exporter, tracing.SEND_SPAN)
    assert [send.attributes and send.attributes["messaging.message.id"] for send in sends] == [
        "after"]


async def post(url: str, headers: dict[str, str], body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as session, session.post(
            url, data=json.dumps(body or {"item": "tea", "qty": 2}).encode(),
            headers={"Content-Type": "application/json", "webhook-id": "order-1",
                     **headers}) as answer:
        return await answer.json()


@pytest.mark.parametrize("receiver", ["idempotent", "serve"])
async def test_the_receiver_notes_applied_and_duplicate_and_ignores_a_malformed_traceparent(
        tmp_path: Path, receiver: str):
    app = receiver_app(tmp_path / "shop.db", lambda con, event: None) \
        if receiver == "idempotent" else make_app(tmp_path / "inbox.db")
    with recording() as exporter:
        async with Served(app) as rx:
            with trace.get_tracer("caller").start_as_current_span("caller") as caller:
                sent = traceparent(caller.get_span_context())
            first = await post(rx.url, {"traceparent": sent})
            again = await post(rx.url, {"traceparent": "00-not-a-trace-01"})
        receives = named(exporter, tracing.RECEIVE_SPAN)
    assert (first["status"], again["status"]) == ("applied", "duplicate")
    applied, duplicate = receives
    assert applied.parent is not None and applied.parent.span_id == caller.get_span_context(
        ).span_id
    assert applied.context.trace_id == caller.get_span_context().trace_id
    assert duplicate.parent is None, "a malformed traceparent is ignored: a root span"
    assert applied.attributes is not None and duplicate.attributes is not None
    assert applied.attributes[tracing.RECEIVE_OUTCOME] == "applied"
    assert duplicate.attributes[tracing.RECEIVE_OUTCOME] == "duplicate"
    assert duplicate.attributes["messaging.message.id"] == "order-1"


def test_a_static_header_cannot_name_the_trace_headers():
    for name in ("traceparent", "TraceState"):
        with pytest.raises(ValueError):
            Destination("http://127.0.0.1:1/events", headers={name: "x"})
