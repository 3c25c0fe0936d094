"""A dispatcher's Prometheus metrics and its health, over HTTP.

Every dispatcher has a registry of its own (``d.metrics.registry``), never
the process's global one: two dispatchers in one process do not collide.
The counters and gauges are read from ``d.stats`` when scraped, so
``DispatcherStats`` stays the one source of truth; only the three histograms
are observed where things happen (a send's own duration, and each committed
claim and finish transaction's time on the store's thread).

``metrics_app(d)`` is an aiohttp application serving ``/metrics`` and
``/healthz`` (``health_handler(d)``); ``add_metrics_routes(app, d)`` mounts both on an embedding
application's router; ``start_metrics_server(d, host, port)`` serves them on
the running event loop (``asyncworker run --metrics``).

Metric names (prefix ``asyncworker_``), each the figure of ``d.stats`` named:

- counters: ``jobs_claimed_total`` (claimed), ``jobs_done_total`` (ok),
  ``jobs_retried_total`` (retried), ``jobs_dead_total{reason}``
  (dead_by_reason: deadline, exhausted, permanent; they sum to dead),
  ``jobs_quarantined_total`` (quarantined), ``stale_completions_refused_total``
  (stale), ``outcomes_unrecorded_busy_total`` (unrecorded_busy: the store
  stayed busy past every lease of their group, nothing recorded),
  ``bad_acks_total`` (bad_acks), ``errors_total`` (errors),
  ``store_busy_retries_total`` (lock_retries), ``lease_extensions_total``
  (extended), ``claim_transactions_leasing_total`` (claim_batches);
- gauges: ``jobs_in_flight`` (in_flight), ``sends_in_flight`` (sending),
  ``sends_in_flight_peak`` (peak_sending), ``jobs_waiting_for_slot`` (waiting),
  ``send_slots`` (the concurrency),
  ``dispatcher_state{state}`` (1 for the current one of new, running,
  stopping, stopped, failed), ``last_claim_timestamp_seconds`` (the store's
  time of the last committed claim; absent before the first);
- histograms (seconds, 1 ms .. 60 s): ``send_duration_seconds`` (every send
  that ended, cut off by its lease included; its count is the sends),
  ``claim_transaction_duration_seconds`` (its count is claim_calls),
  ``finish_transaction_duration_seconds`` (its count is finish_batches).

A dispatcher serving endpoints (``Dispatcher(endpoints=...)``) also counts
``deliveries_unknown_endpoint_total`` (unknown_endpoint), and keeps the
figures of each delivery per endpoint (``EndpointFigures``). With
``by_endpoint`` the per-delivery metrics (``PER_DELIVERY``, ``jobs_dead``
and ``send_duration_seconds``) carry an ``endpoint`` label instead of one
total: one series per endpoint it has served, bounded by the queue's
endpoints table (a death the claim's quarantine made has ``endpoint=""``:
the claim counts those by reason alone). Without it they are the totals,
as for a dispatcher with one ``--url``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

__all__ = ["BUCKETS", "CONDITIONS", "HEALTH_TIMEOUT_S", "DispatcherMetrics", "EndpointFigures",
           "LoopHistogram", "Observed", "add_metrics_routes", "health_handler", "metrics_app",
           "start_metrics_server", "status_handler", "status_of"]

HEALTH_TIMEOUT_S = 2.0  # how long /healthz waits for the store's answer

PREFIX = "asyncworker_"
# Seconds, from a local commit (about a millisecond) to the longest send worth waiting for.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0)
STATES = ("new", "running", "stopping", "stopped", "failed")
# What an endpoint's deliveries may do now (asyncworker.routes.condition_of): closed
# (sent), paused (a Retry-After runs), open (none sent until its cool-down ends),
# half-open (one probe at a time), disabled (none, until an operator enables it).
CONDITIONS = ("closed", "paused", "open", "half-open", "disabled")



class Observed(Protocol):
    """What this module reads of a dispatcher (``asyncworker.dispatcher.Dispatcher``
    is one): the dispatcher imports this module, never the other way round."""

    @property
    def stats(self) -> Any: ...  # a DispatcherStats: the figures named below

    @property
    def concurrency(self) -> int: ...

    @property
    def state(self) -> str: ...

    @property
    def last_claim_ms(self) -> int | None: ...

    @property
    def metrics(self) -> DispatcherMetrics: ...

    async def check_health(self, timeout_s: float = ...) -> dict[str, Any]: ...


# (metric name without _total, the DispatcherStats field, help)
COUNTERS = (
    ("jobs_claimed", "claimed", "Jobs leased by this dispatcher's claims."),
    ("jobs_done", "ok", "Jobs finished done."),
    ("jobs_retried", "retried", "Jobs finished pending again, to be retried after a delay."),
    ("jobs_quarantined", "quarantined",
     "Jobs this dispatcher's claims moved to dead (past their deadline or out of attempts)."),
    ("stale_completions_refused", "stale",
     "Finishes (or extensions) refused because the lease was gone: the job is someone else's."),
    ("outcomes_unrecorded_busy", "unrecorded_busy",
     "Outcomes not recorded: the store stayed busy past every lease of their group (the "
     "job stays leased until its lease runs out; no fence judged it, so not stale)."),
    ("bad_acks", "bad_acks", "Answers that were no evidence of delivery: the job stays leased."),
    ("errors", "errors", "Jobs whose send or finish failed unclassified: the job stays leased."),
    ("store_busy_retries", "lock_retries",
     "Store calls retried because the store was busy (a write lock, a lost connection)."),
    ("lease_extensions", "extended", "Leases pushed forward for sends still running."),
    ("claim_transactions_leasing", "claim_batches", "Claim transactions that leased a job."),
)
# the counters that are a sum over deliveries: labelled by endpoint when asked
PER_DELIVERY = frozenset({"claimed", "ok", "retried", "stale", "unrecorded_busy", "bad_acks",
                          "errors"})
UNKNOWN_ENDPOINT = ("deliveries_unknown_endpoint", "unknown_endpoint",
                    "Deliveries claimed for an endpoint this dispatcher does not know (removed "
                    "since): left leased, their lease expiry and budget recover them.")
GAUGES = (
    ("jobs_in_flight", "in_flight", "Jobs claimed and not yet recorded."),
    ("sends_in_flight", "sending", "Send slots in use: claimed jobs whose send has not ended."),
    ("sends_in_flight_peak", "peak_sending", "The most send slots in use at once."),
    ("jobs_waiting_for_slot", "waiting", "Claimed jobs waiting for a send slot (at most the "
                                         "prefetch)."),
)


class _StatsCollector:
    """The counters and gauges, read from the dispatcher at scrape time (on the
    event loop, where the figures change: a scrape sees one consistent moment)."""

    def __init__(self, dispatcher: Observed, metrics: DispatcherMetrics) -> None:
        self._d = dispatcher
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        d, stats, metrics = self._d, self._d.stats, self._metrics
        by_endpoint = metrics.by_endpoint
        figures = sorted(metrics.endpoints.items()) if by_endpoint else []
        for name, figure, text in COUNTERS:
            if by_endpoint and figure in PER_DELIVERY:
                family = CounterMetricFamily(PREFIX + name, text, labels=["endpoint"])
                for endpoint, figured in figures:
                    family.add_metric([endpoint], getattr(figured, figure))
                yield family
            else:
                yield CounterMetricFamily(PREFIX + name, text, value=getattr(stats, figure))
        if metrics.serving_endpoints:
            name, figure, text = UNKNOWN_ENDPOINT
            yield CounterMetricFamily(PREFIX + name, text, value=getattr(stats, figure))
        answers = CounterMetricFamily(
            PREFIX + "send_answers", "Sends that ended, by the HTTP status class of their "
            "answer (none: no answer, a transport error or a timeout).", labels=["class"])
        for status_class, n in stats.answers.items():
            answers.add_metric([status_class], n)
        yield answers
        yield CounterMetricFamily(PREFIX + "deliveries_released", "Deliveries claimed and "
                                  "given back unsent (their endpoint's circuit opened or paused "
                                  "after their claim): no attempt spent.", value=stats.released)
        text = "Jobs this dispatcher moved to dead, by its finishes and its claims' quarantine."
        if by_endpoint:
            dead = CounterMetricFamily(PREFIX + "jobs_dead", text, labels=["endpoint", "reason"])
            by_finish: dict[str, int] = {}
            for endpoint, figured in figures:
                for reason, n in sorted(figured.dead_by_reason.items()):
                    dead.add_metric([endpoint, reason], n)
                    by_finish[reason] = by_finish.get(reason, 0) + n
            # the claim's quarantine names no endpoint: the rest of each reason
            for reason, n in sorted(stats.dead_by_reason.items()):
                dead.add_metric(["", reason], n - by_finish.get(reason, 0))
        else:
            dead = CounterMetricFamily(PREFIX + "jobs_dead", text, labels=["reason"])
            for reason, n in sorted(stats.dead_by_reason.items()):
                dead.add_metric([reason], n)
        yield dead
        for name, figure, text in GAUGES:
            yield GaugeMetricFamily(PREFIX + name, text, value=getattr(stats, figure))
        yield GaugeMetricFamily(PREFIX + "send_slots", "Sends in flight at most (concurrency).",
                                value=d.concurrency)
        state = GaugeMetricFamily(PREFIX + "dispatcher_state",
                                  "1 for the dispatcher's current state.", labels=["state"])
        current = d.state
        for name in STATES:
            state.add_metric([name], 1 if name == current else 0)
        yield state
        last = GaugeMetricFamily(PREFIX + "last_claim_timestamp_seconds",
                                 "The store's time of the last committed claim (unix seconds).")
        if d.last_claim_ms is not None:
            last.add_metric([], d.last_claim_ms / 1000)
        yield last
        if metrics.serving_endpoints and metrics.circuits is not None:
            yield from _circuit_families(metrics.circuits()["endpoints"], by_endpoint)


def _circuit_families(circuits: dict[str, dict[str, Any]], by_endpoint: bool
                      ) -> Iterator[Metric]:
    """The endpoints' circuits as last read from the store (the same figures
    in every dispatcher of the queue: take their max, never their sum)."""
    by_condition = dict.fromkeys(CONDITIONS, 0)
    for circuit in circuits.values():
        by_condition[circuit["condition"]] = by_condition.get(circuit["condition"], 0) + 1
    family = GaugeMetricFamily(
        PREFIX + "endpoints_by_circuit", "The endpoints served, by what their deliveries may "
        "do now: closed, paused (Retry-After), open, half-open (a probe), disabled.",
        labels=["state"])
    for condition, n in by_condition.items():
        family.add_metric([condition], n)
    yield family
    text = ("Attempts the breaker kept from being spent: deliveries that came due while "
            "their endpoint's circuit was open (the store's count).")
    if by_endpoint:
        state = GaugeMetricFamily(PREFIX + "endpoint_circuit", "1 for the endpoint's "
                                  "current state: closed, paused, open, half-open, disabled.",
                                  labels=["endpoint", "state"])
        saved = CounterMetricFamily(PREFIX + "endpoint_attempts_saved", text,
                                    labels=["endpoint"])
        for name, circuit in sorted(circuits.items()):
            for condition in CONDITIONS:
                state.add_metric([name, condition], 1 if circuit["condition"] == condition else 0)
            saved.add_metric([name], circuit.get("attempts_saved") or 0)
        yield state
        yield saved
    else:
        yield CounterMetricFamily(PREFIX + "endpoint_attempts_saved", text,
                                  value=sum(circuit.get("attempts_saved") or 0
                                            for circuit in circuits.values()))


class LoopHistogram:
    """A histogram observed on the event loop alone: no lock and no label
    lookup per observation, one bisect into the buckets. It is exposed as
    prometheus_client's own Histogram is (``_bucket`` cumulative with ``+Inf``,
    ``_count``, ``_sum``, ``_created``), read at scrape time on the same loop,
    so a scrape sees the figures of one moment."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(float(bound) for bound in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._created = time.time()

    @property
    def sum(self) -> float:
        """The sum of every amount observed (for sends: seconds spent sending)."""
        return self._sum

    def observe(self, amount: float) -> None:
        # The first bound at or above the amount: prometheus's "le" (<=).
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.documentation, "histogram")
        self.add_samples(family, {})
        yield family

    def add_samples(self, family: Metric, labels: dict[str, str]) -> None:
        """This histogram's samples, with ``labels`` on each, to ``family``."""
        total = 0
        for bound, n in zip((*map(floatToGoString, self._bounds), "+Inf"), self._counts,
                            strict=True):
            total += n
            family.add_sample(family.name + "_bucket", {**labels, "le": bound}, total)
        family.add_sample(family.name + "_count", labels, total)
        family.add_sample(family.name + "_sum", labels, self._sum)
        family.add_sample(family.name + "_created", labels, self._created)


class EndpointFigures:
    """One endpoint's share of a dispatcher's per-delivery figures, counted on
    the event loop as ``DispatcherStats``' totals are (each delivery counts in
    both), and its sends' durations."""

    __slots__ = ("claimed", "ok", "retried", "dead_by_reason", "stale", "unrecorded_busy",
                 "bad_acks", "errors", "send")

    def __init__(self) -> None:
        self.claimed = self.ok = self.retried = self.stale = 0
        self.unrecorded_busy = self.bad_acks = self.errors = 0
        self.dead_by_reason: dict[str, int] = {}
        self.send = LoopHistogram(PREFIX + "send_duration_seconds", "", BUCKETS)

    def count_dead(self, reason: str) -> None:
        self.dead_by_reason[reason] = self.dead_by_reason.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        figures = {name: getattr(self, name) for name in self.__slots__ if name != "send"}
        figures["dead_by_reason"] = dict(figures["dead_by_reason"])
        return figures


class _EndpointSends:
    """``send_duration_seconds`` with an ``endpoint`` label: one histogram per endpoint."""

    def __init__(self, metrics: DispatcherMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        total = self._metrics.send
        family = Metric(total.name, total.documentation, "histogram")
        for endpoint, figures in sorted(self._metrics.endpoints.items()):
            figures.send.add_samples(family, {"endpoint": endpoint})
        yield family


class DispatcherMetrics:
    """A dispatcher's registry: the stats' collector and the three histograms.
    ``observe_send`` and friends are the histograms' own bound ``observe``,
    called on the dispatcher's event loop: no lock per job.

    ``serving_endpoints``: the dispatcher serves a queue's endpoints, and
    ``endpoints`` holds each one's figures (``figures_of``); ``by_endpoint``
    (only then): the per-delivery metrics are labelled by endpoint."""

    def __init__(self, dispatcher: Observed, *, serving_endpoints: bool = False,
                 by_endpoint: bool = False) -> None:
        # No describe(): the collector reads the dispatcher only when scraped,
        # never while the dispatcher is still being built.
        self.serving_endpoints = serving_endpoints
        self.by_endpoint = serving_endpoints and by_endpoint
        self.endpoints: dict[str, EndpointFigures] = {}
        # the circuits of the endpoints served, as the dispatcher last read them
        self.circuits: Callable[[], dict[str, Any]] | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(dispatcher, self))
        self.send = LoopHistogram(PREFIX + "send_duration_seconds",
                                  "Each send's own duration, from its start to its answer, "
                                  "error or cut-off.", BUCKETS)
        self.claim = LoopHistogram(PREFIX + "claim_transaction_duration_seconds",
                                   "Each committed claim transaction's time on the store.",
                                   BUCKETS)
        self.finish = LoopHistogram(PREFIX + "finish_transaction_duration_seconds",
                                    "Each committed finish transaction's (group commit's) "
                                    "time on the store.", BUCKETS)
        self.registry.register(_EndpointSends(self) if self.by_endpoint else self.send)
        for histogram in (self.claim, self.finish):
            self.registry.register(histogram)
        self.observe_send = self.send.observe
        self.observe_claim = self.claim.observe
        self.observe_finish = self.finish.observe

    def figures_of(self, endpoint: str) -> EndpointFigures:
        """The endpoint's figures, made when the dispatcher first knows it and
        kept (a counter never goes back, even across its removal and return)."""
        figures = self.endpoints.get(endpoint)
        if figures is None:
            figures = self.endpoints[endpoint] = EndpointFigures()
        return figures

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for (Prometheus text by
        default, OpenMetrics when asked) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def add_metrics_routes(app: web.Application, dispatcher: Observed) -> None:
    """``GET /metrics`` (Prometheus), ``GET /healthz`` (200 healthy, 503 not) and
    ``GET /status`` (JSON: the endpoints whose circuit is not closed, by name)."""

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = dispatcher.metrics.exposition(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type,
                                                "Cache-Control": "no-store"})

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", health_handler(dispatcher))
    app.router.add_get("/status", status_handler(dispatcher))


def status_of(dispatcher: Observed) -> dict[str, Any]:
    """The dispatcher's state and its endpoints' circuits, as last read:
    ``endpoints`` {condition: [names]} for every condition but closed,
    ``closed`` how many are, and ``circuits`` each one that is not closed
    (since when, why, until when, attempts saved). Without endpoints,
    ``endpoints`` is empty."""
    circuits = dispatcher.metrics.circuits
    read = circuits() if circuits is not None else {"as_of_ms": None, "endpoints": {}}
    names: dict[str, list[str]] = {condition: [] for condition in CONDITIONS}
    details: dict[str, dict[str, Any]] = {}
    for name, circuit in sorted(read["endpoints"].items()):
        names[circuit["condition"]].append(name)
        if circuit["condition"] != "closed":
            details[name] = {key: circuit.get(key) for key in (
                "condition", "state", "since_ms", "why", "open_until_ms", "paused_until_ms",
                "failing_since_ms", "attempts_saved", "disabled_why")}
    closed = names.pop("closed")
    return {"state": dispatcher.state, "as_of_ms": read["as_of_ms"],
            "endpoints": names, "closed": len(closed), "circuits": details,
            "degraded": any(names.values())}


def status_handler(dispatcher: Observed) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler: ``status_of(dispatcher)`` as JSON, always 200 (a
    view, not a probe: an endpoint that is down is not the dispatcher's fault,
    and restarting the dispatcher would not bring it back; ``/healthz`` is
    the probe)."""

    async def status(request: web.Request) -> web.Response:
        return web.json_response(status_of(dispatcher), headers={"Cache-Control": "no-store"})

    return status


def health_handler(dispatcher: Observed, timeout_s: float = HEALTH_TIMEOUT_S
                   ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler: ``dispatcher.check_health()`` as JSON, 200 while it
    is running and its store answers within ``timeout_s``, 503 otherwise (new,
    stopping, stopped or failed, or the store unreachable)."""

    async def health(request: web.Request) -> web.Response:
        answer = await dispatcher.check_health(timeout_s)
        return web.json_response(answer, status=200 if answer["healthy"] else 503,
                                 headers={"Cache-Control": "no-store"})

    return health


def metrics_app(dispatcher: Observed) -> web.Application:
    app = web.Application()
    add_metrics_routes(app, dispatcher)
    return app


async def start_metrics_server(dispatcher: Observed, host: str,
                               port: int) -> tuple[web.AppRunner, str]:
    """Serve ``metrics_app`` on the running loop; returns the runner (clean it
    up) and the bound base URL (port 0 picks a free port). No access log:
    every scrape would be a line."""
    runner = web.AppRunner(metrics_app(dispatcher), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return runner, f"http://{shown_host}:{bound[1]}"

