"""The queue's own metrics: what is in it, not what one dispatcher did.

A dispatcher's metrics (``asyncworker.metrics``) count what its run did; they
end with it, and none of them says how deep the queue is. These are read from
the store (``Store.queue_depth``) when scraped: the page serves them at
``/metrics`` and ``asyncworker metrics QUEUE`` serves them alone.

A scrape's cost is bounded: the store is read at most once per ``interval_s``
(15 s by default, a Prometheus scrape interval), however many scrapers ask,
and one read at a time; between reads a scrape answers the last figures, and
``asyncworker_queue_figures_age_seconds`` says how old they are. The read is
one grouped scan of the jobs (a tenth of a second at a million on SQLite;
``asyncworker_queue_read_duration_seconds`` shows it).

Metric names (prefix ``asyncworker_queue_``):

- ``jobs{status}``: jobs (and deliveries) by status: pending, leased, done, dead;
- ``ready_jobs``: pending and due now; ``oldest_ready_age_seconds``: how long
  the oldest of them has been due (0 when none is);
- ``blocked_keys``: ordering keys whose first job is dead (``stats`` names them);
- ``endpoints{state}``: endpoints by state: closed, open, half-open (their
  circuit), disabled;
- per endpoint (with ``by_endpoint``, the default): ``endpoint_jobs{endpoint,
  status}``, ``endpoint_ready_jobs{endpoint}``,
  ``endpoint_oldest_ready_age_seconds{endpoint}``, ``endpoint_enabled{endpoint}``
  and ``endpoint_circuit{endpoint, state}`` (1 for its state). One series each
  per endpoint of the queue's endpoints table: drop them
  (``--no-endpoint-label``) for very many endpoints; ``endpoints{state}`` stays;
- ``read_duration_seconds`` (the last read's time), ``figures_age_seconds``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from lease.breaker import CLOSED, HALF_OPEN, OPEN
from lease.rules import STATUSES

__all__ = ["DEFAULT_INTERVAL_S", "ENDPOINT_STATES", "METRICS", "QueueMetrics", "queue_metrics_app",
           "queue_metrics_handler"]

DEFAULT_INTERVAL_S = 15.0
PREFIX = "asyncworker_queue_"
DISABLED = "disabled"
ENDPOINT_STATES = (CLOSED, OPEN, HALF_OPEN, DISABLED)


class QueueMetrics:
    """The figures of one queue, read by ``read`` (a coroutine giving
    ``Store.queue_depth()``) at most once per ``interval_s``."""

    def __init__(self, read: Callable[[], Awaitable[dict[str, Any]]], *,
                 interval_s: float = DEFAULT_INTERVAL_S, by_endpoint: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(interval_s, (int, float)) or not 0 <= interval_s <= 3600:
            raise ValueError(f"interval_s must be 0..3600 seconds, got {interval_s!r:.40}")
        self._read = read
        self.interval_s = float(interval_s)
        self.by_endpoint = by_endpoint
        self._clock = clock
        self._lock = asyncio.Lock()
        self._figures: dict[str, Any] | None = None
        self._read_at = 0.0
        self._read_s = 0.0
        self.reads = 0  # how many times the store was read

    async def figures(self) -> dict[str, Any]:
        """The last figures, read again when they are ``interval_s`` old."""
        async with self._lock:  # one read at a time; the others wait for it
            if self._figures is None or self._clock() - self._read_at >= self.interval_s:
                begun = self._clock()
                self._figures = await self._read()
                self._read_at = self._clock()
                self._read_s = self._read_at - begun
                self.reads += 1
            return self._figures

    async def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The scrape's body and its content type (text, or OpenMetrics when asked)."""
        figures = await self.figures()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Figures(self._families(figures)))
        encoder, content_type = choose_encoder(accept or "")
        return encoder(registry), content_type

    def _families(self, depth: dict[str, Any]) -> list[Metric]:
        families: list[Metric] = []

        def gauge(name: str, help_text: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=list(labels))
            families.append(family)
            return family

        jobs = gauge("jobs", "Jobs (and deliveries) in the queue by status.", ("status",))
        for status in STATUSES:
            jobs.add_metric([status], depth["by_status"].get(status, 0))
        gauge("ready_jobs", "Jobs pending and due now.").add_metric([], depth["ready"])
        gauge("oldest_ready_age_seconds", "How long the oldest ready job has been due "
              "(0 when none is).").add_metric([], _seconds(depth["oldest_ready_age_ms"]))
        gauge("blocked_keys", "Ordering keys whose first job is dead.").add_metric(
            [], depth["blocked_keys"])
        states = gauge("endpoints", "Endpoints by state: their circuit, or disabled.",
                       ("state",))
        counted = dict.fromkeys(ENDPOINT_STATES, 0)
        for row in depth["endpoints"]:
            counted[_state(row)] += 1
        for state, n in counted.items():
            states.add_metric([state], n)
        if self.by_endpoint and depth["endpoints"]:
            self._per_endpoint(depth["endpoints"], gauge)
        gauge("read_duration_seconds", "How long the last read of the store took.").add_metric(
            [], self._read_s)
        gauge("figures_age_seconds", "How old these figures are (read at most once per "
              "interval).").add_metric([], max(0.0, self._clock() - self._read_at))
        return families

    @staticmethod
    def _per_endpoint(rows: list[dict[str, Any]],
                      gauge: Callable[..., GaugeMetricFamily]) -> None:
        jobs = gauge("endpoint_jobs", "An endpoint's deliveries by status.",
                     ("endpoint", "status"))
        ready = gauge("endpoint_ready_jobs", "An endpoint's deliveries pending and due now.",
                      ("endpoint",))
        oldest = gauge("endpoint_oldest_ready_age_seconds", "How long an endpoint's oldest "
                       "ready delivery has been due (0 when none is).", ("endpoint",))
        enabled = gauge("endpoint_enabled", "1 when the endpoint is enabled.", ("endpoint",))
        circuit = gauge("endpoint_circuit", "1 for the endpoint's circuit state.",
                        ("endpoint", "state"))
        for row in rows:
            name = row["name"]
            for status in STATUSES:
                jobs.add_metric([name, status], row["by_status"].get(status, 0))
            ready.add_metric([name], row["ready"])
            oldest.add_metric([name], _seconds(row["oldest_ready_age_ms"]))
            enabled.add_metric([name], 1 if row["enabled"] else 0)
            for state in (CLOSED, OPEN, HALF_OPEN):
                circuit.add_metric([name, state], 1 if row["circuit"] == state else 0)


class _Figures:
    """A collector of families already built (one scrape's)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _seconds(ms: int | None) -> float:
    return 0.0 if ms is None else ms / 1000


def _state(row: dict[str, Any]) -> str:
    if not row["enabled"]:
        return DISABLED
    return row["circuit"] if row["circuit"] in ENDPOINT_STATES else CLOSED


METRICS = web.AppKey("queue_metrics", QueueMetrics)


async def queue_metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics of an application holding a ``QueueMetrics`` (``METRICS``)."""
    body, content_type = await request.app[METRICS].exposition(request.headers.get("Accept"))
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


def queue_metrics_app(metrics: QueueMetrics) -> web.Application:
    """An application serving ``/metrics`` of one queue (``asyncworker metrics``)."""
    app = web.Application()
    app[METRICS] = metrics
    app.router.add_get("/metrics", queue_metrics_handler)
    return app
