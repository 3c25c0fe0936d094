"""OpenTelemetry's SDK for the tests: a tracer provider set for one test,
its spans kept in memory, and the API's globals as they were afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


def _unset() -> None:
    # The API lets a process set its provider once; a test sets its own and
    # gives it back (OpenTelemetry's own tests do the same).
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@contextmanager
def recording() -> Iterator[InMemorySpanExporter]:
    """A provider of the SDK, current for the block; every span ended in it, kept."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _unset()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        _unset()


def traceparent(context: trace.SpanContext) -> str:
    """The W3C header naming that span."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The spans of that name, in the order they ended."""
    return [span for span in exporter.get_finished_spans() if span.name == name]
