"""The receiving side: ``POST /events`` into a deduplicating inbox, answered after COMMIT.

With secrets (``lease.signing``: Standard Webhooks), every request is
verified first, on its whole body read within the limits below and before
the body is parsed or the inbox sees it: only a holder of a secret can write
into the inbox, and the id it signed (``webhook-id``) is the event's id.
``serve`` binds an address beyond loopback only with secrets, and serves
https with a certificate and its key; the limits are the same either way.

Two kinds of event arrive (see ``asyncworker.receiving.inbox``). A body that is exactly
``{"id", "qty"}`` is a lab event, checked by the contract's rule
(``lease.worker.check_event``); a ``webhook-id`` header, if sent, must be its
id. Any other JSON object is a payload event: its ``webhook-id`` header is its
id (``lease.policy.PRODUCT``'s rule), and it is deduplicated by that id and
the sha256 of its canonical body, so its keys may come in any order.

| request                                   | answer                                   |
| ----------------------------------------- | ---------------------------------------- |
| with secrets: a bad or no signature (kind) | 401 ``{"error": "signature <kind>: ..."}`` |
| new ``{"id", "qty"}``                       | 200 ``{"id", "qty", "status": "applied"}`` |
| same id and qty again                     | 200 ``{"id", "qty", "status": "duplicate"}`` |
| new payload event                         | 200 ``{"id", "status": "applied"}``        |
| same id and body again (any key order)    | 200 ``{"id", "status": "duplicate"}``      |
| same id, another qty or body              | 409 ``{"error": ...}``                     |
| the same, ``X-Lease-Token`` below one seen | 200 ``"duplicate"``, a stale sender counted |
| bad JSON, content type, keys, types, token | 400 ``{"error": ...}``                     |
| no, a bad or a second ``webhook-id``        | 400 ``{"error": ...}``                     |
| a body over 64 KiB (MAX_BODY_BYTES)       | 413 ``{"error": ...}``                     |
| a body not received within the read time  | 408 ``{"error": ...}``, connection closed  |
| a connection past the connection limit    | 503, connection closed                   |

A client that sends no complete request head within the read time is
disconnected; so a slow or half-open client holds a connection for a bounded
time, and never more than ``max_connections`` of them at once.

``GET /stats`` (JSON) and ``GET /metrics`` (Prometheus text) show the figures:
those of the inbox file (durable, the same across restarts) by their plain
names, those of this process prefixed ``process_`` (the refused signatures as
``process_refused_signature_<kind>``, in /metrics one counter labelled by
``kind``). They need no secret, and name no event and no payload.
Fault injection (latency, 503 before commit, a dropped connection after
commit) is off unless asked for, and seeded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from asyncworker import tracing
from asyncworker.logs import say
from asyncworker.receiving.inbox import (
    CONFLICT,
    DUPLICATE,
    STALE,
    Arrival,
    Delivery,
    Inbox,
    InboxClosed,
    check_max_group,
    probe_inbox,
)
from asyncworker.receiving.requests import Signatures, check_signature, error, read_body
from asyncworker.service import Notifier
from lease.http import ID_HEADER, TOKEN_HEADER, is_loopback
from lease.policy import MAX_BODY_BYTES, PRODUCT, canonical_body
from lease.signing import TOLERANCE_S, SignatureError
from lease.worker import (
    EVENT_KEYS,
    MAX_TOKEN,
    check_event,
    check_job_id,
    parse_json,
)

BODY_LIMIT = MAX_BODY_BYTES
EVENTS_PATH = "/events"
_OWN_PATHS = ("/stats", "/metrics")


@dataclass(frozen=True)
class Faults:
    """Injected faults, each with a probability; all off by default."""

    latency_ms: int = 0
    p_503: float = 0.0
    p_drop: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if type(self.latency_ms) is not int or not 0 <= self.latency_ms <= 60_000:
            raise ValueError(f"latency_ms must be an int in 0..60000, got {self.latency_ms!r}")
        for name in ("p_503", "p_drop"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a probability in 0..1, got {value!r}")


@dataclass(frozen=True)
class Limits:
    """What one client may hold: each bound keeps a slow one from starving the rest."""

    read_timeout: float = 10.0  # seconds for a request's head, and again for its body
    max_connections: int = 1024  # open at once; one more is answered 503 and closed

    def __post_init__(self) -> None:
        if type(self.read_timeout) not in (int, float) or not 0 < self.read_timeout <= 3600:
            raise ValueError(f"read_timeout must be seconds in (0, 3600], "
                             f"got {self.read_timeout!r}")
        if type(self.max_connections) is not int or not 1 <= self.max_connections <= 100_000:
            raise ValueError(f"max_connections must be an int in 1..100000, "
                             f"got {self.max_connections!r}")


class Counters:
    """Counts of this process alone (they start at 0 on each start); the inbox's
    totals are durable and live in the inbox file."""

    REFUSED_SIGNATURE = tuple(f"refused_signature_{kind}" for kind in SignatureError.KINDS)
    NAMES = ("requests", "rejected", "too_large", "timed_out", "incomplete", "injected_503",
             "dropped_after_commit", "unavailable", "bad_http", "refused_connections",
             *REFUSED_SIGNATURE, "in_flight", "peak_in_flight", "open_connections")
    GAUGES = ("in_flight", "peak_in_flight", "open_connections")

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
LIMITS = web.AppKey("limits", Limits)
RANDOM = web.AppKey("random", random.Random)
REGISTRY = web.AppKey("registry", CollectorRegistry)
SIGNATURES: web.AppKey[Signatures | None] = web.AppKey("signatures")
PATH = web.AppKey("path", str)


class BadRequest(ValueError):
    """A request the inbox must never see; its message names the problem."""


def parse_request(content_type: str, body: bytes, token_headers: list[str],
                  id_headers: list[str]) -> Arrival:
    """What the inbox is to decide for a valid request, else BadRequest naming
    the problem. A lab event has qty 1..1000 and no digest; a payload event
    qty 0 and its canonical body's digest.

    The JSON rules are the contract's (no duplicate keys, no NaN), on a body
    that must be UTF-8, as JSON on the wire must be (bytes alone would also be
    read as UTF-16, UTF-32 or with a byte order mark). ``token_headers`` and
    ``id_headers`` hold every X-Lease-Token and webhook-id header: none, or
    one; two are refused, since which one counts would be a guess.
    """
    if content_type != "application/json":
        raise BadRequest(f"content type must be application/json, got {content_type!r}")
    value = _parse_json(body)
    webhook_id = _one_header(ID_HEADER, id_headers)
    token = _parse_token(token_headers)
    try:
        if type(value) is dict and value.keys() == EVENT_KEYS:
            return _lab_event(value, webhook_id, token)
        return _payload_event(value, webhook_id, token)
    except ValueError as exc:  # a validator's message names the problem
        raise BadRequest(str(exc)) from None


def _parse_json(body: bytes) -> object:
    try:
        return parse_json(body)  # strict: UTF-8, no duplicate keys, no NaN, bounded depth
    except ValueError as exc:  # its message names the problem
        raise BadRequest(str(exc)) from None


def _lab_event(event: dict, webhook_id: str | None, token: int | None) -> Arrival:
    check_event(event)
    if webhook_id is not None and webhook_id != event["id"]:
        raise ValueError(f"{ID_HEADER} must be the event id {event['id']!r}, "
                         f"got {webhook_id!r:.80}")
    return Arrival(event["id"], event["qty"], token)


def _payload_event(body: object, webhook_id: str | None, token: int | None) -> Arrival:
    if webhook_id is None:
        raise ValueError(_not_a_lab_event(body))
    event_id = check_job_id(ID_HEADER, webhook_id, PRODUCT)
    _, digest = canonical_body(body)
    return Arrival(event_id, 0, token, digest)


def _not_a_lab_event(body: object) -> str:
    if type(body) is not dict:
        return f"event must be a dict (a JSON object), got {type(body).__name__}"
    return (f"event must have exactly the keys {sorted(EVENT_KEYS)}, got {sorted(body)!r:.200};"
            f" any other JSON object is a payload event, sent with a {ID_HEADER} header")


def _one_header(name: str, headers: list[str]) -> str | None:
    if len(headers) > 1:
        raise BadRequest(f"{name} must be sent once, got {len(headers)}")
    return headers[0] if headers else None


def _parse_token(headers: list[str]) -> int | None:
    header = _one_header(TOKEN_HEADER, headers)
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
        traced = tracing.tracer()
        if traced is None:
            return await _handle(request)
        # tracing on: a SERVER span continuing the sender's traceparent
        with tracing.receiving(traced, request.headers, request.method, request.path) as span:
            response = await _handle(request, span)
            tracing.answered(span, response.status)
            return response
    finally:
        counters.leave()


async def _handle(request: web.Request, span: Any = None) -> web.StreamResponse:
    app = request.app
    counters, faults, rng = app[COUNTERS], app[FAULTS], app[RANDOM]
    body = await read_body(request, app[LIMITS].read_timeout, counters.add)
    if isinstance(body, web.Response):
        return body
    refused = check_signature(app[SIGNATURES], request, body, counters.add)
    if refused is not None:
        return refused
    try:
        arrival = parse_request(request.content_type, body,
                                request.headers.getall(TOKEN_HEADER, []),
                                request.headers.getall(ID_HEADER, []))
    except BadRequest as exc:
        counters.add("rejected")
        return error(400, str(exc))
    if faults.latency_ms:
        await asyncio.sleep(faults.latency_ms / 1000)
    if faults.p_503 and rng.random() < faults.p_503:
        counters.add("injected_503")
        return error(503, "injected: unavailable before commit")
    try:
        delivery = await app[INBOX].deliver(*arrival)
    except InboxClosed:
        counters.add("unavailable")
        return error(503, "receiver is shutting down")
    if faults.p_drop and rng.random() < faults.p_drop:
        counters.add("dropped_after_commit")
        if request.transport is not None:
            request.transport.abort()  # committed, and no answer ever leaves
        return web.Response(status=200)
    if span is not None:
        tracing.noted(span, arrival.id, delivery.outcome)
    if delivery.outcome == CONFLICT:
        return error(409, _conflict(delivery))
    # a stale sender's event is the one applied: a duplicate to it (counted apart)
    status = DUPLICATE if delivery.outcome == STALE else delivery.outcome
    if arrival.digest is None:  # a lab event: its ACK as ever
        return web.json_response({"id": arrival.id, "qty": arrival.qty, "status": status})
    return web.json_response({"id": arrival.id, "status": status})


def _conflict(delivery: Delivery) -> str:
    if delivery.digest is None and delivery.known_digest is None:
        return f"{delivery.id!r} was applied with qty {delivery.known_qty}, not {delivery.qty}"
    return (f"{delivery.id!r} was applied with {_what(delivery.known_qty, delivery.known_digest)}"
            f", not {_what(delivery.qty, delivery.digest)}")


def _what(qty: int | None, digest: str | None) -> str:
    return f"qty {qty}" if digest is None else f"the body of sha256 {digest[:16]}..."


def stats(app: web.Application) -> dict:
    """Every figure. Those of the inbox file first: durable, they read the same
    before and after a restart. Then this process's own, named ``process_*``."""
    inbox = app[INBOX]
    totals = inbox.totals
    process = {**app[COUNTERS].values, "commits": inbox.commits,
               "requests_per_commit": round(inbox.grouped / inbox.commits, 2)
               if inbox.commits else 0}
    return {
        "applied": totals.applied,
        "duplicates": totals.duplicates,
        "conflicts": totals.conflicts,
        "stale_senders": totals.stale,
        "inbox_rows": totals.rows,
        "inbox_seen": totals.seen,
        "inbox_pruned": totals.pruned,
        "stock": totals.stock,
        **{f"process_{name}": value for name, value in process.items()},
    }


async def get_stats(request: web.Request) -> web.Response:
    await request.app[INBOX].refresh()  # a prune by another process shows at once
    return web.json_response(stats(request.app))


async def get_metrics(request: web.Request) -> web.Response:
    await request.app[INBOX].refresh()
    text = generate_latest(request.app[REGISTRY])
    return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})


class _StatsCollector:
    """Exposes stats() in the Prometheus text format, read at scrape time."""

    GAUGES = {"inbox_rows", "stock", "process_requests_per_commit",
              *(f"process_{name}" for name in Counters.GAUGES)}

    def __init__(self, app: web.Application) -> None:
        self._app = app

    REFUSED_SIGNATURE = {f"process_{name}": name.rsplit("_", 1)[1]
                         for name in Counters.REFUSED_SIGNATURE}

    def collect(self) -> Any:
        figures = stats(self._app)
        refused = CounterMetricFamily("receiver_process_refused_signature",
                                      "receiver requests refused for their signature, by kind",
                                      labels=["kind"])
        for name, kind in self.REFUSED_SIGNATURE.items():
            refused.add_metric([kind], figures.pop(name))
        yield refused
        for name, value in figures.items():
            metric = f"receiver_{name}"
            if name in self.GAUGES:
                yield GaugeMetricFamily(metric, f"receiver {name.replace('_', ' ')}", value=value)
            else:
                yield CounterMetricFamily(metric, f"receiver {name.replace('_', ' ')}",
                                          value=value)


def make_app(inbox_path: str | os.PathLike, *, faults: Faults = Faults(),
             max_group: int = 64, limits: Limits = Limits(),
             secrets: Sequence[bytes] | None = None, tolerance_s: int = TOLERANCE_S,
             clock: Callable[[], float] = time.time, path: str = EVENTS_PATH) -> web.Application:
    """The receiver as an aiohttp application; the inbox opens on startup.
    Events are posted to ``path``; ``GET /stats`` and ``/metrics`` at the root.

    With ``secrets`` (``lease.signing.read_secrets``), every event must be
    signed with one of them, its timestamp within ``tolerance_s`` of
    ``clock()``; else 401, before the body is parsed or the inbox sees it.

    ValueError at once, before anything is created or changed, for a bad
    option or an inbox path that holds no inbox (``inbox.probe_inbox``).
    """
    signatures = Signatures.of(secrets, tolerance_s, clock)
    check_path(path)
    probe_inbox(inbox_path)
    check_max_group(max_group)
    app = web.Application(client_max_size=BODY_LIMIT)
    app[SIGNATURES] = signatures
    app[PATH] = path
    app[COUNTERS] = Counters()
    app[FAULTS] = faults
    app[LIMITS] = limits
    app[RANDOM] = random.Random(faults.seed)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(app))
    app[REGISTRY] = registry

    async def inbox_context(app: web.Application) -> Any:
        app[INBOX] = await Inbox.open(os.fspath(inbox_path), max_group=max_group)
        yield
        await app[INBOX].close()

    app.cleanup_ctx.append(inbox_context)
    app.router.add_post(path, post_event)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/metrics", get_metrics)
    return app


def check_path(path: object) -> str:
    """The path events are posted to: absolute, plain, not one of the receiver's own."""
    if type(path) is not str or not path.startswith("/") or len(path) > 200 or any(
            c in path for c in "?#%\\ ") or not path.isascii() or not path.isprintable():
        raise ValueError(f"path must be an absolute URL path like /events or /hooks/orders, "
                         f"got {path!r:.80}")
    if path in _OWN_PATHS or "/." in path or "//" in path:
        raise ValueError(f"path {path!r:.80} cannot take events "
                         f"(/stats and /metrics are the receiver's)")
    return path


class Listener:
    """An app served on a socket bound at construction, before the app starts.

    ``Listener(app, host, port)`` raises OSError if the address cannot be
    bound (a port in use), with nothing else done; ``await start()`` opens the
    inbox and serves; ``await close()`` answers what is in progress, closes
    the inbox and the socket. The app's Limits apply to every connection,
    and with ``tls`` (``server_tls_context``) it serves https: the read time
    bounds the TLS handshake too.
    """

    def __init__(self, app: web.Application, host: str, port: int, *,
                 tls: ssl.SSLContext | None = None) -> None:
        limits = app[LIMITS]
        self.app, self._tls = app, tls
        self._sock = _bind(host, port, limits.max_connections)
        bound_host, bound_port = self._sock.getsockname()[:2]
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://{_url_host(bound_host)}:{bound_port}{app[PATH]}"
        # keepalive_timeout bounds the wait for a request head (on a new
        # connection and between requests); lingering_time the wait for the
        # unread rest of a body after the answer.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0,
                                     keepalive_timeout=limits.read_timeout,
                                     lingering_time=limits.read_timeout,
                                     logger=_connection_log(app[COUNTERS]))
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        await self._runner.setup()
        server = self._runner.server
        assert server is not None  # set by setup()
        gate = _ConnectionGate(server, self.app[LIMITS].max_connections, self.app[COUNTERS])
        # create_server listens on the socket again, with its own backlog (100
        # unless told): it is given the one _bind chose.
        self._server = await asyncio.get_running_loop().create_server(
            gate, sock=self._sock, ssl=self._tls, backlog=self.app[LIMITS].max_connections,
            ssl_handshake_timeout=self.app[LIMITS].read_timeout if self._tls else None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()  # closes the socket: no new connections
        else:
            self._sock.close()
        await self._runner.cleanup()  # answers what is in progress, then closes the inbox


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket; else OSError with the address as its filename:
    ``[Errno 98] Address already in use: '127.0.0.1:8080'``.

    Its backlog is the connections the receiver takes at once: a burst of
    that many clients connecting together is queued while the loop accepts.
    Past a full backlog the kernel drops a SYN, and its client tries again
    only a second later (a 1 s tail at concurrency 256 with asyncio's 100).
    The kernel caps it at net.core.somaxconn."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, f"{host}:{port}") from None
    try:
        # As asyncio does: a restart may bind a port whose last connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, exc.strerror, f"{host}:{port}") from None
    return sock


class _ClientFaults(logging.Filter):
    """A malformed request is its client's fault: aiohttp answers it 400 and
    would log it with a traceback; it is counted instead (process_bad_http)."""

    def __init__(self, counters: Counters) -> None:
        super().__init__()
        self._counters = counters

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            self._counters.add("bad_http")
            return False
        return True


def _connection_log(counters: Counters) -> logging.Logger:
    """The log of this app's connections: this module's logger, less the client faults."""
    log = logging.Logger(f"{__name__}.connections")
    log.parent = logging.getLogger(__name__)
    log.addFilter(_ClientFaults(counters))
    return log


class _ConnectionGate:
    """The listening socket's protocol factory: at most ``limit`` connections
    open at once. One more is answered 503 and closed at once, rather than left
    to wait unseen: a crowd of slow clients must not lock out the rest."""

    def __init__(self, server: web.Server, limit: int, counters: Counters) -> None:
        self._server, self._limit, self._counters = server, limit, counters

    def __call__(self) -> asyncio.Protocol:
        if self._counters.values["open_connections"] >= self._limit:
            self._counters.add("refused_connections")
            return _Refused()
        self._counters.add("open_connections")
        return _Counted(self._server(), self._counters)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, with its end counted."""

    def __init__(self, inner: asyncio.Protocol, counters: Counters) -> None:
        self._inner, self._counters = inner, counters

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._counters.add("open_connections", -1)
        self._inner.connection_lost(exc)


_BUSY = json.dumps({"error": "too many connections, try again later"}).encode()


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                        % (len(_BUSY), _BUSY))
        transport.close()


async def serve(inbox_path: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, *,
                faults: Faults = Faults(), max_group: int = 64, limits: Limits = Limits(),
                secrets: Sequence[bytes] | None = None, tolerance_s: int = TOLERANCE_S,
                path: str = EVENTS_PATH, tls_cert: str | os.PathLike | None = None,
                tls_key: str | os.PathLike | None = None) -> None:
    """Run the receiver until SIGINT or SIGTERM; print its URL on the first line
    and, on the way out, its final figures (JSON) on the last.

    A host that is not loopback is served only with ``secrets``: on a network,
    anyone can connect, and only a signature tells a sender from the rest.
    With ``tls_cert`` and ``tls_key`` (PEM files) it serves https.

    Before anything is created or printed: ValueError (message ready to print)
    for a host that is not loopback without secrets, one of tls_cert and
    tls_key without the other, a certificate or key that does not load, a bad
    option or an inbox path that holds no inbox; OSError for an address that
    cannot be bound (a port in use). The signal
    handlers are in place next, and the URL is printed (and flushed) only once
    the inbox is open and the socket listens: a parent that reads the first
    line can send at once, or stop it at once. On a signal, requests in
    progress are answered, the inbox is closed cleanly, and the coroutine
    returns.
    """
    check_host(host, secrets)
    tls = None if tls_cert is None and tls_key is None else server_tls_context(tls_cert, tls_key)
    app = make_app(inbox_path, faults=faults, max_group=max_group, limits=limits,
                   secrets=secrets, tolerance_s=tolerance_s, path=path)
    listener = Listener(app, host, port, tls=tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    notifier = Notifier.from_environment()  # systemd's Type=notify, when it runs us
    try:
        await listener.start()
        print(listener.url, flush=True)
        notifier.ready(f"receiving at {listener.url}")  # the inbox open, the socket listening
        await stop.wait()
        notifier.stopping("answering the requests in progress, then closing the inbox")
    finally:
        await listener.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        notifier.close()
    # The figures of this run, as the last line: the inbox's are durable, and a
    # supervisor that restarts the receiver can add up the process_* ones.
    print(json.dumps(stats(app)), flush=True)
    say("receiver stopped", "asyncworker.receiver")  # a JSON object with --log-format json


def check_host(host: object, secrets: Sequence[bytes] | None) -> str:
    """The host to bind: any address with secrets, else loopback only."""
    if type(host) is not str or not host:
        raise ValueError(f"host must be an address or a name, got {host!r:.80}")
    if secrets is None and not is_loopback(host):
        raise ValueError(f"host {host} is not loopback: serving on a network needs a secret "
                         f"(--secret-file), so that only signed requests are applied")
    return host


def server_tls_context(cert: str | os.PathLike | None,
                       key: str | os.PathLike | None) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or later) for a PEM certificate chain
    and its key; ValueError (one line, naming the file) if they do not load."""
    if cert is None or key is None:
        raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    for what, name in (("certificate", cert), ("key", key)):
        if os.path.exists(name) and not os.path.isfile(name):  # a FIFO would block open()
            raise ValueError(f"TLS {what} {os.fsdecode(name)}: not a regular file")
        try:
            with open(name, "rb") as file:
                file.read(1)
        except OSError as exc:
            raise ValueError(f"TLS {what} {os.fsdecode(name)}: {exc.strerror or exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise ValueError(f"TLS key {os.fsdecode(key)}: encrypted; "
                         f"give the key unencrypted, readable by this user only") from None
    except ssl.SSLError as exc:
        problem = ("the key does not match the certificate" if exc.reason == "KEY_VALUES_MISMATCH"
                   else "not a PEM certificate chain and its PEM private key")
        raise ValueError(f"TLS certificate {os.fsdecode(cert)} and key {os.fsdecode(key)}: "
                         f"{problem}" + (f" ({exc.reason})" if exc.reason else "")) from None
    return context


class _Encrypted(ValueError):
    pass


def _no_passphrase() -> str:
    # Without this, OpenSSL would ask for an encrypted key's passphrase on the terminal.
    raise _Encrypted


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
