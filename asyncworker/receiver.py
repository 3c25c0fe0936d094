"""The receiving side: ``POST /events`` into a deduplicating inbox, answered after COMMIT.

| request                                   | answer                                   |
| ----------------------------------------- | ---------------------------------------- |
| new ``{"id", "qty"}``                       | 200 ``{"id", "qty", "status": "applied"}`` |
| same id and qty again                     | 200 ``{"id", "qty", "status": "duplicate"}`` |
| same id, another qty                      | 409 ``{"error": ...}``                     |
| ``X-Lease-Token`` lower than one already seen | 409 ``{"error": "stale token ..."}``        |
| bad JSON, content type, keys, types, token | 400 ``{"error": ...}``                     |
| a body over 4 KiB                          | 413 ``{"error": ...}``                     |

``GET /stats`` (JSON) and ``GET /metrics`` (Prometheus text) show the counters.
Fault injection (latency, 503 before commit, a dropped connection after
commit) is off unless asked for, and seeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from asyncworker.inbox import APPLIED, CONFLICT, DUPLICATE, STALE, Inbox, InboxClosed
from lease.http import TOKEN_HEADER, check_url
from lease.worker import MAX_TOKEN, check_event

BODY_LIMIT = 4096


@dataclass(frozen=True)
class Faults:
    """Injected faults, each with a probability; all off by default."""

    latency_ms: int = 0
    p_503: float = 0.0
    p_drop: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if type(self.latency_ms) is not int or not 0 <= self.latency_ms <= 60_000:
            raise ValueError(f"latency_ms must be an int in 0..60000, got {self.latency_ms!r}")
        for name in ("p_503", "p_drop"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a probability in 0..1, got {value!r}")


class Counters:
    """Request counters of this process (the inbox's own totals are durable)."""

    NAMES = ("requests", "rejected", "too_large", "injected_503", "dropped_after_commit",
             "unavailable", "in_flight", "peak_in_flight")

    def __init__(self) -> None:
        self.values = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] += n

    def enter(self) -> None:
        self.values["in_flight"] += 1
        self.values["peak_in_flight"] = max(self.values["peak_in_flight"],
                                            self.values["in_flight"])

    def leave(self) -> None:
        self.values["in_flight"] -= 1


INBOX = web.AppKey("inbox", Inbox)
COUNTERS = web.AppKey("counters", Counters)
FAULTS = web.AppKey("faults", Faults)
RANDOM = web.AppKey("random", random.Random)
REGISTRY = web.AppKey("registry", CollectorRegistry)


class BadRequest(ValueError):
    """A request the inbox must never see; its message names the problem."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _no_duplicate_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise BadRequest(f"duplicate key in JSON object: {keys}")
    return dict(pairs)


def parse_event(content_type: str, body: bytes, token_header: Optional[str]) -> tuple:
    """(id, qty, token) of a valid request, else BadRequest naming the problem."""
    if content_type != "application/json":
        raise BadRequest(f"content type must be application/json, got {content_type!r}")
    try:
        event = json.loads(body, object_pairs_hook=_no_duplicate_keys,
                           parse_constant=_reject_constant)
    except BadRequest:
        raise
    except ValueError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    try:
        check_event(event)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return event["id"], event["qty"], _parse_token(token_header)


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not valid JSON")


def _parse_token(header: Optional[str]) -> Optional[int]:
    if header is None:
        return None
    # length first: int() of thousands of digits is slow, and refused past 4300
    if not (len(header) <= 16 and header.isascii() and header.isdigit()) or not (
            1 <= int(header) <= MAX_TOKEN):
        raise BadRequest(f"{TOKEN_HEADER} must be an integer in 1..{MAX_TOKEN}, got {header!r:.40}")
    return int(header)


async def post_event(request: web.Request) -> web.StreamResponse:
    counters = request.app[COUNTERS]
    counters.add("requests")
    counters.enter()
    try:
        return await _handle(request)
    finally:
        counters.leave()


async def _handle(request: web.Request) -> web.StreamResponse:
    app = request.app
    counters, faults, rng = app[COUNTERS], app[FAULTS], app[RANDOM]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        counters.add("too_large")
        return _error(413, f"body is larger than {BODY_LIMIT} bytes")
    try:
        event_id, qty, token = parse_event(request.content_type, body,
                                           request.headers.get(TOKEN_HEADER))
    except BadRequest as exc:
        counters.add("rejected")
        return _error(400, str(exc))
    if faults.latency_ms:
        await asyncio.sleep(faults.latency_ms / 1000)
    if faults.p_503 and rng.random() < faults.p_503:
        counters.add("injected_503")
        return _error(503, "injected: unavailable before commit")
    try:
        delivery = await app[INBOX].deliver(event_id, qty, token)
    except InboxClosed:
        counters.add("unavailable")
        return _error(503, "receiver is shutting down")
    if faults.p_drop and rng.random() < faults.p_drop:
        counters.add("dropped_after_commit")
        if request.transport is not None:
            request.transport.abort()  # committed, and no answer ever leaves
        return web.Response(status=200)
    if delivery.outcome == STALE:
        return _error(409, f"stale token {token} for {event_id!r}: "
                           f"token {delivery.max_token} was already seen")
    if delivery.outcome == CONFLICT:
        return _error(409, f"{event_id!r} was applied with qty {delivery.known_qty}, not {qty}")
    return web.json_response({"id": event_id, "qty": qty, "status": delivery.outcome})


def stats(app: web.Application) -> dict:
    """Every counter: this process's request counts and the inbox's durable totals."""
    totals = app[INBOX].totals
    outcomes = totals.outcomes
    return {
        **app[COUNTERS].values,
        "applied": outcomes[APPLIED],
        "duplicates": outcomes[DUPLICATE],
        "conflicts": outcomes[CONFLICT],
        "stale_senders": outcomes[STALE],
        "commits": totals.commits,
        "requests_per_commit": round(totals.grouped / totals.commits, 2) if totals.commits else 0,
        "inbox_rows": totals.rows,
        "inbox_seen": totals.seen,
        "stock": totals.stock,
    }


async def get_stats(request: web.Request) -> web.Response:
    return web.json_response(stats(request.app))


async def get_metrics(request: web.Request) -> web.Response:
    text = generate_latest(request.app[REGISTRY])
    return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})


class _StatsCollector:
    """Exposes stats() in the Prometheus text format, read at scrape time."""

    GAUGES = {"in_flight", "peak_in_flight", "inbox_rows", "stock", "requests_per_commit"}

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Any:
        for name, value in stats(self._app).items():
            metric = f"receiver_{name}"
            if name in self.GAUGES:
                yield GaugeMetricFamily(metric, f"receiver {name.replace('_', ' ')}", value=value)
            else:
                yield CounterMetricFamily(metric, f"receiver {name.replace('_', ' ')}",
                                          value=value)


def make_app(inbox_path: Union[str, os.PathLike], *, faults: Faults = Faults(),
             max_group: int = 64) -> web.Application:
    """The receiver as an aiohttp application; the inbox opens on startup."""
    app = web.Application(client_max_size=BODY_LIMIT)
    app[COUNTERS] = Counters()
    app[FAULTS] = faults
    app[RANDOM] = random.Random(faults.seed)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(app))
    app[REGISTRY] = registry

    async def inbox_context(app: web.Application) -> Any:
        app[INBOX] = await Inbox.open(str(inbox_path), max_group=max_group)
        yield
        await app[INBOX].close()

    app.cleanup_ctx.append(inbox_context)
    app.router.add_post("/events", post_event)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/metrics", get_metrics)
    return app



async def serve(inbox_path: Union[str, os.PathLike], host: str = "127.0.0.1", port: int = 0, *,
                faults: Faults = Faults(), max_group: int = 64) -> None:
    """Run the receiver until SIGINT or SIGTERM; print its URL on the first line
    and, on the way out, its final counters (JSON) on the last.

    The signal handlers are in place before anything else, and the URL is
    printed (and flushed) only once the inbox is open and the socket listens:
    a parent that reads the first line can send at once, or stop it at once.
    On a signal, requests in progress are answered, the inbox is closed
    cleanly, and the coroutine returns.
    """
    check_url(f"http://{_url_host(host)}:{port or 1}/events")  # loopback only
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    app = make_app(inbox_path, faults=faults, max_group=max_group)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"http://{_url_host(bound_host)}:{bound_port}/events", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()  # answers what is in progress, then closes the inbox
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    # The counters of this run, as the last line: a supervisor that restarts the
    # receiver can add up every request it ever answered.
    print(json.dumps(stats(app)), flush=True)
    print("receiver stopped", file=sys.stderr, flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
