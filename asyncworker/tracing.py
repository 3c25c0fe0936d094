"""Tracing with OpenTelemetry: every attempt a span, the receiver continuing it.

- **Intake** (``lease.tracing.capture``): an event enqueued inside a span
  keeps that span's W3C context with its jobs.
- **Each attempt** is a span of kind CLIENT, ``asyncworker send``, LINKED to
  the kept context, not its child: an attempt runs later, maybe many times,
  maybe after the intake's trace has ended, and a link says "caused by"
  without stretching the intake's trace over hours of retries. The span is
  the root of a trace of its own, current while the send runs (a caller's
  ``send`` instrumented by OpenTelemetry joins it), and the request carries
  its ``traceparent`` (and ``tracestate``). Those are transport headers, like
  ``Content-Type``: Standard Webhooks signs the id, the timestamp and the body,
  so the signature neither covers them nor changes with them.
- **The receiver** (``asyncworker.receiving``) runs its handling in a SERVER
  span, ``asyncworker receive``, the child of the attempt's span taken from
  the request's ``traceparent``: the attempt and its arrival read as one
  trace. A missing or malformed ``traceparent`` makes it a root span.

The attributes follow OpenTelemetry's semantic conventions where one fits
(``messaging.*`` for the message and its endpoint, ``http.*``,
``server.*`` and ``error.type`` for the request) and ``asyncworker.*`` for
what is the dispatcher's own: the job's id (a delivery's, ``MESSAGE@ENDPOINT``),
its attempt number, its lease token and the attempt's outcome (``ok``,
``retry``, ``permanent``, or ``unjudged`` for a bad ACK or an unclassified
error, which leave the job leased); at the receiver, the inbox's outcome
(``applied``, ``duplicate``, ``conflict``).

Off costs almost nothing: with opentelemetry-api missing, or no tracer
provider set (the API's default proxy), ``tracer()`` is None and the
dispatcher and the receivers skip every step of this module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any

from lease.tracing import api, carrier_of

__all__ = [
    "ATTEMPT",
    "OUTCOME",
    "RECEIVE_OUTCOME",
    "RECEIVE_SPAN",
    "SEND_SPAN",
    "abandon_attempt",
    "answered",
    "end_attempt",
    "noted",
    "receiving",
    "request_headers",
    "start_attempt",
    "tracer",
    "within",
]

SEND_SPAN = "asyncworker send"
RECEIVE_SPAN = "asyncworker receive"
JOB_ID = "asyncworker.job.id"
ATTEMPT = "asyncworker.attempt"
TOKEN = "asyncworker.lease.token"
OWNER = "asyncworker.dispatcher"
OUTCOME = "asyncworker.outcome"
RECEIVE_OUTCOME = "asyncworker.receive.outcome"
_SCOPE = "asyncworker"

_cached: tuple[object, Any] = (None, None)  # (provider, its tracer)


def tracer() -> Any | None:
    """The tracer of the provider set now, or None when tracing is off
    (opentelemetry-api missing, or no provider set). Read per attempt and per
    request, so a provider set after the dispatcher started is honoured."""
    global _cached
    otel = api()
    if otel is None:
        return None
    provider = otel.trace.get_tracer_provider()
    if provider is _cached[0]:
        return _cached[1]
    found = None
    if not isinstance(provider, otel.trace.ProxyTracerProvider | otel.trace.NoOpTracerProvider):
        found = provider.get_tracer(_SCOPE)
    _cached = (provider, found)
    return found


# ------------------------------------------------------------------ the attempt


def start_attempt(tracer: Any, ticket: dict, message: str, kept: str | None,
                  endpoint: str | None, server: tuple[str, int] | None, owner: str) -> Any:
    """An attempt's span, started: a root (a trace of its own) linked to the
    intake's kept context, if there is one."""
    otel = api()
    attributes: dict[str, Any] = {
        "messaging.system": "asyncworker",
        "messaging.operation.type": "send",
        "messaging.message.id": message,
        JOB_ID: ticket["id"],
        ATTEMPT: ticket["attempt"],
        TOKEN: ticket["token"],
        OWNER: owner,
    }
    if endpoint is not None:
        attributes["messaging.destination.name"] = endpoint
    if server is not None:  # an HTTP send of the dispatcher's own; never the URL's path
        attributes["http.request.method"] = "POST"
        attributes["server.address"], attributes["server.port"] = server
    return tracer.start_span(SEND_SPAN, context=_root(otel), kind=otel.trace.SpanKind.CLIENT,
                             links=_links(otel, kept), attributes=attributes)


def _root(otel: Any) -> Any:
    """A context with no span: the attempt does not join whatever span ran the loop."""
    return otel.trace.set_span_in_context(otel.trace.INVALID_SPAN)


def _links(otel: Any, kept: str | None) -> list:
    carrier = carrier_of(kept)
    if carrier is None:
        return []
    context = otel.trace.get_current_span(otel.propagator.extract(carrier)).get_span_context()
    return [otel.trace.Link(context)] if context.is_valid else []


def request_headers(span: Any) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
    otel = api()
    headers: dict[str, str] = {}
    otel.propagator.inject(headers, context=otel.trace.set_span_in_context(span))
    return headers


async def within(span: Any, sending: Awaitable[object]) -> object:
    """Await ``sending`` with ``span`` current, so a caller's instrumented send joins it."""
    with api().trace.use_span(span, end_on_exit=False):
        return await sending


def end_attempt(span: Any, outcome: str | None, http_status: int | None,
                error: str | None) -> None:
    """The attempt's span, ended with what came of it (``Attempt``'s evidence)."""
    otel = api()
    span.set_attribute(OUTCOME, outcome or "unjudged")
    if http_status is not None:
        span.set_attribute("http.response.status_code", http_status)
    if outcome != "ok":
        if error is not None:
            span.set_attribute("error.type", error.split(":", 1)[0])
        span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR, error))
    span.end()


def abandon_attempt(span: Any) -> None:
    """An attempt that ended in a cancellation or a failure of the dispatcher's own."""
    span.set_attribute(OUTCOME, "abandoned")
    span.end()


# ------------------------------------------------------------------ the receiver


def receiving(tracer: Any, headers: Mapping[str, str], method: str, path: str) -> Any:
    """The receiver's SERVER span as a context manager, current while it
    runs: the child of the sender's span named by ``traceparent``, or a root
    when there is none or it is malformed (W3C: ignored, never an error)."""
    otel = api()
    parent = otel.propagator.extract({name: headers[name] for name in
                                      ("traceparent", "tracestate") if name in headers})
    return tracer.start_as_current_span(
        RECEIVE_SPAN, context=parent, kind=otel.trace.SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path,
                    "messaging.system": "asyncworker", "messaging.operation.type": "process"})


def noted(span: Any, message: str, outcome: str) -> None:
    """What the inbox made of the event, on the receiver's span."""
    span.set_attribute("messaging.message.id", message)
    span.set_attribute(RECEIVE_OUTCOME, outcome)


def answered(span: Any, http_status: int) -> None:
    """The receiver's answer, on its span: a 5xx is an error of the receiver's."""
    span.set_attribute("http.response.status_code", http_status)
    if http_status >= 500:
        otel = api()
        span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR))
