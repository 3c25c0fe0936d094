"""The trace context of an intake, kept with its jobs: W3C Trace Context.

An event enqueued inside an active OpenTelemetry span keeps that span's
context (its ``traceparent``, and its ``tracestate`` if any) with every job
the intake makes, a fan-out's deliveries included; each attempt to send it is
then a span linked to that context (``asyncworker.tracing``).

OpenTelemetry is optional: ``opentelemetry-api`` (the ``tracing`` extra) is
imported on first use, and without it, or outside a span, nothing is kept.
The format is W3C's whatever propagator the application set globally: the
stored text and the request's headers must mean the same thing to every
reader, the receiver of another vendor's stack included.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_TRACE_CHARS", "api", "capture", "carrier_of"]

# traceparent is 55 characters; W3C caps tracestate at 32 members of at most
# 256 characters, but asks for 512 to be propagated: what is kept beyond that
# is dropped rather than stored with every job
MAX_TRACE_CHARS = 1024
_TRACE_HEADERS = ("traceparent", "tracestate")


class _Api:
    """What of opentelemetry-api is used, imported once."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()


_loaded: _Api | None = None
_missing = False


def api() -> Any:
    """opentelemetry-api, loaded on first use; None when it is not installed."""
    global _loaded, _missing
    if _loaded is not None or _missing:
        return _loaded
    try:
        _loaded = _Api()
    except ImportError:
        _missing = True
    return _loaded


def capture() -> str | None:
    """The current span's context as kept with a job (a small JSON object of
    ``traceparent`` and ``tracestate``), or None outside a span or without
    opentelemetry-api. Called once per intake, whatever its size."""
    otel = api()
    if otel is None or not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.propagator.inject(carrier)
    if "tracestate" in carrier and len(carrier["tracestate"]) > MAX_TRACE_CHARS - 100:
        del carrier["tracestate"]  # the parent alone is what a link needs
    return json.dumps(carrier, separators=(",", ":"), sort_keys=True) if carrier else None


def carrier_of(text: str | None) -> dict[str, str] | None:
    """The headers a kept context stands for; None for none, or for a text
    that is not one (a tracing fault never stops a send)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if type(value) is not dict:
        return None
    carrier = {name: value[name] for name in _TRACE_HEADERS
               if type(value.get(name)) is str}
    return carrier if "traceparent" in carrier else None
