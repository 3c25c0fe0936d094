"""The operator's pages: an aiohttp application, rendered on the server.

Every page reads the queue through the store interface, off the event loop,
and answers as HTML or, with ``?format=json``, as the JSON the CLI prints
for the same question (``stats --json``, ``dead``, ``inspect --json``).
Templates are Jinja2 with autoescaping on: every value a job carries (its
id, body, error, note) is text in the page, never markup.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import shlex
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    TypeVar,
)

import aiohttp
import jinja2
from aiohttp import web
from markupsafe import Markup

from asyncworker.operations import (
    TooMany,
    chunks,
    dead_matching,
    neighbour_queues,
    one_line,
    shown,
    stats_url,
    when,
)
from asyncworker.operations import endpoint_figures as stats_endpoints
from asyncworker.queue_metrics import METRICS, QueueMetrics, queue_metrics_handler
from asyncworker.store import AsyncStore
from asyncworker.ui.bulk import (
    MAX_BULK,
    SAMPLE,
    BadRequest,
    BulkRequest,
    Filter,
    Member,
    fingerprint,
    job_actions,
    outcome,
    parse_bulk,
    parse_filter,
    parse_job_change,
    parse_note,
)
from asyncworker.ui.charts import SPANS, chart, periods
from asyncworker.ui.recovery import NoSuchEndpoint, parse_recovery
from asyncworker.ui.recovery import confirm as confirm_recovery
from asyncworker.ui.recovery import preview as preview_recovery
from asyncworker.ui.safety import (
    LOOPBACK_NAMES,
    SECURITY_HEADERS,
    SESSION_COOKIE,
    Access,
    Guard,
    Hosts,
    check_token,
    cross_site,
)
from lease.breaker import CLOSED, HALF_OPEN, OPEN
from lease.endpoints import check_endpoint_name
from lease.http import Destination
from lease.policy import DEFAULT_POLICY, PRODUCT, check_actor
from lease.records import StoreError
from lease.retrying import PATIENT
from lease.rules import DAY_MS, MAX_PAGE, MINUTE_MS, STATUSES, WORKER_BEAT_MS
from lease.store import Store
from lease.stores import is_postgres_url, open_store
from lease.worker import check_job_id

__all__ = ["ui_app"]

T = TypeVar("T")

HERE = Path(__file__).parent
PAGE_SIZE = 50  # jobs a list page shows
RECEIVER_TIMEOUT_S = 2.0  # the overview waits this long for the receiver's /stats
SHOW_RESULTS = 1000  # result lines a bulk change's page lists (its JSON lists every one)
PUBLIC_ROUTES = ("login", "login_form", "css")  # reachable without the token


class Refused(Exception):
    """An answer other than the page: its status and one line saying why."""

    def __init__(self, status: int, message: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


# ------------------------------------------------------------------ the queue


QUEUES_READ_S = 30.0


class Queue:
    """The queue the pages look at and change, every call off the event loop.

    Changes allowed: one AsyncStore, the queue opened writable (a SQLite file
    migrated to this version, as any command that writes does). Read-only on
    PostgreSQL: one AsyncStore opened read-only. Read-only on a SQLite file: a
    read-only connection per look, on a thread. A long-lived one would not do:
    a file with no writer at the time is opened as immutable (so a look leaves
    no -wal file behind), and such a connection never sees what a dispatcher
    started later writes.
    """

    def __init__(self, target: str, *, allow_changes: bool, queues_of: str | None = None) -> None:
        self.target = target
        self.allow_changes = allow_changes
        self._per_look = not allow_changes and not is_postgres_url(target)
        self._store: AsyncStore | None = None
        self._queues_of = target if queues_of is None else queues_of
        self._queues: tuple[float, list[str] | None] | None = None

    async def neighbours(self) -> list[str] | None:
        """The queues of its database or beside its file (``neighbour_queues``),
        read again at most every ``QUEUES_READ_S``: a new queue is rare, and
        the overview refreshes often."""
        now = time.monotonic()
        if self._queues is None or now - self._queues[0] > QUEUES_READ_S:
            names = await asyncio.to_thread(
                lambda: PATIENT.call(lambda: neighbour_queues(self._queues_of)))
            self._queues = (now, names)
        return self._queues[1]

    async def open(self) -> None:
        if self._per_look:
            await self.look(lambda store: store.schema_version())  # a queue, now
            return
        target = self.target
        self._store = (AsyncStore(target) if self.allow_changes
                       else AsyncStore(lambda: open_store(target, read_only=True)))
        await self._store.open()

    async def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            await store.close()

    async def look(self, fn: Callable[[Store], T]) -> T:
        if self._per_look:
            return await asyncio.to_thread(_look_once, self.target, fn)
        return await self._open().call(fn)

    async def change(self, fn: Callable[[Store], T]) -> T:
        if not self.allow_changes:
            raise Refused(403, "read-only: this page was started without --allow-changes")
        return await self._open().call(fn)

    def _open(self) -> AsyncStore:
        if self._store is None:
            raise StoreError("the queue is not open")
        return self._store


def _look_once(target: str, fn: Callable[[Store], T]) -> T:
    with open_store(target, read_only=True) as store:
        return PATIENT.call(lambda: fn(store))


def list_jobs(store: Store, *, endpoint: str | None, **query: Any) -> list[dict]:
    """``store.list_jobs``, its endpoint filter passed only when one is named: a
    store that keeps no endpoints (nor takes the filter) has no deliveries."""
    if endpoint is None:
        return store.list_jobs(**query)
    if getattr(store, "endpoint_stats", None) is None:
        return []
    return store.list_jobs(endpoint=endpoint, **query)


def matched(store: Store, bulk: BulkRequest) -> list[Member]:
    """Every dead letter of the bulk's filter (of one endpoint: its dead
    deliveries, the store's filter), in seq order (operations.dead_matching)."""
    if bulk.endpoint is not None and getattr(store, "endpoint_stats", None) is None:
        return []  # a store that keeps no endpoints has no deliveries
    try:
        found = dead_matching(store, cap=MAX_BULK, **bulk.store_filters())
    except TooMany:
        raise BadRequest(f"the filter matches more than {MAX_BULK} jobs: narrow it "
                         f"(a reason, an id prefix, an ordering key, an error, a time "
                         f"range)") from None
    return [Member(row["id"], row["token"], row["reason"]) for row in found]


def job_page(store: Store, status: str | None, found: Filter, after: int | None,
             limit: int) -> tuple[list[dict], int | None]:
    """One page of the jobs ``found`` matches after the seq ``after``: at most
    ``limit`` rows in seq order, and the seq the next page starts after (None:
    there is no more). Keyset pagination: never a row repeated or skipped."""
    narrowed = {name: value for name, value in (
        ("error", found.error), ("http_status", found.http_status),
        ("from_ms", found.from_ms), ("to_ms", found.to_ms)) if value is not None}
    rows = list_jobs(store, status=status, reason=found.reason, id_prefix=found.id_prefix,
                     key=found.key, endpoint=found.endpoint, after_seq=after, limit=limit + 1,
                     **narrowed)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1]["seq"] if more else None)


def dead_by_reason(store: Store, found: Filter) -> dict[str, int]:
    """The dead letters by reason: the snapshot's, or of one endpoint its
    dead deliveries' (``endpoint_stats``'s ``dead_by_reason``; none for an
    endpoint removed since)."""
    if found.endpoint is None:
        return store.snapshot()["dead_by_reason"]
    for row in endpoint_figures(store):
        if row["name"] == found.endpoint:
            return dict(sorted(row["dead_by_reason"].items()))
    counts: Counter[str] = Counter()  # an endpoint removed since: its dead deliveries
    after: int | None = None
    while True:
        page = list_jobs(store, status="dead", endpoint=found.endpoint, after_seq=after,
                         limit=MAX_PAGE)
        counts.update(row["reason"] for row in page)
        if len(page) < MAX_PAGE:
            return dict(sorted(counts.items()))
        after = page[-1]["seq"]


# What the pages show of an endpoint: Store.endpoint_stats's public fields and
# figures, its circuit breaker's, and nothing else a store might add to a row.
ENDPOINT_FIELDS = ("name", "url", "ack", "ca_file", "secrets", "headers", "types",
                   "max_in_flight", "rate", "burst", "insecure_http", "enabled", "created_ms",
                   "updated_ms", "ready", "in_flight", "done", "retried", "dead",
                   "dead_by_reason", "last_error", "last_success_ms", "circuit",
                   "disable_after_ms", "disabled_why")
CIRCUIT_FIELDS = ("state", "since_ms", "why", "failures", "open_until_ms", "paused_until_ms",
                  "failing_since_ms", "attempts_saved")
CIRCUIT_STATES = (CLOSED, OPEN, HALF_OPEN)


def endpoint_figures(store: Store) -> list[dict[str, Any]]:
    """Every endpoint with its figures (``Store.endpoint_stats``), by name;
    none from a store that keeps no endpoints. Only ENDPOINT_FIELDS are kept
    (of ``circuit`` its CIRCUIT_FIELDS), ``secrets`` as a count and
    ``headers`` as names: the page never shows a secret or a header's value,
    whatever a store's row held."""
    stats = getattr(store, "endpoint_stats", None)
    return [] if stats is None else [_public(row) for row in stats()]


def _public(row: Mapping[str, Any]) -> dict[str, Any]:
    kept = {name: row.get(name) for name in ENDPOINT_FIELDS}
    secrets = kept["secrets"]
    kept["secrets"] = secrets if isinstance(secrets, int) else len(secrets or ())
    kept["headers"] = [header[0] if isinstance(header, (list, tuple)) else header
                       for header in kept["headers"] or ()]
    given = kept["circuit"] if isinstance(kept["circuit"], Mapping) else {}
    circuit = {name: given.get(name) for name in CIRCUIT_FIELDS}
    if circuit["state"] is None:
        circuit["state"] = CLOSED
    kept["circuit"] = circuit
    kept["dead_by_reason"] = dict(kept["dead_by_reason"] or {})
    return kept


def circuit_summary(endpoints: list[dict[str, Any]], now_ms: int) -> dict[str, int]:
    """How many endpoints are in each state: closed, open, half-open (by
    their circuit), paused (a Retry-After not over yet), disabled (of which
    automatically: by the breaker, failing longer than disable_after_ms)."""
    counts = {"endpoints": len(endpoints), **{state: 0 for state in CIRCUIT_STATES},
              "paused": 0, "disabled": 0, "disabled_automatically": 0}
    for ep in endpoints:
        circuit = ep["circuit"]
        if circuit["state"] in CIRCUIT_STATES:
            counts[circuit["state"]] += 1
        paused = circuit.get("paused_until_ms")
        if paused is not None and paused > now_ms:
            counts["paused"] += 1
        if not ep["enabled"]:
            counts["disabled"] += 1
            if ep.get("disabled_why"):
                counts["disabled_automatically"] += 1
    return counts


def endpoint_record(store: Store, name: str) -> tuple[dict[str, Any] | None, list[dict]]:
    """One endpoint's figures (None: no such endpoint) and its audit rows."""
    found = [row for row in endpoint_figures(store) if row["name"] == name]
    if not found:
        return None, []
    return found[0], store.endpoint_audit(name)


def delivery_columns(rows: list[dict]) -> dict[str, bool]:
    """Which of a delivery's columns a table of jobs shows: the endpoint and
    the message when a row is a delivery, the event type when a row has one
    (a queue without endpoints or types shows its table as before)."""
    return {"endpoint": any(row.get("endpoint") is not None for row in rows),
            "type": any(row.get("event_type") is not None for row in rows)}


# ------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Settings:
    queue: str  # as shown: a URL without its password
    allow_changes: bool
    guard: Guard
    operator: str | None  # who the audit rows name
    stats_url: str | None  # the receiver's /stats
    hosts: Hosts  # the names it answers to
    receiver_tls: ssl.SSLContext | None  # how the receiver's certificate is verified


SETTINGS = web.AppKey("settings", Settings)
QUEUE = web.AppKey("queue", Queue)
TEMPLATES = web.AppKey("templates", jinja2.Environment)
HTTP = web.AppKey("http", aiohttp.ClientSession)


def ui_app(queue: str, *, allow_changes: bool = False, token: str | None = None,
           receiver_url: str | Destination | None = None, operator: str | None = None,
           allowed_hosts: Iterable[str] = LOOPBACK_NAMES,
           queues_of: str | None = None) -> web.Application:
    """The page for ``queue`` (a file's path or a ``postgresql://`` URL), to serve
    or to mount: ``app.add_subapp("/ops", ui_app(...))``. ``token``: every request
    must show it (Bearer, or the login form's cookie). ``operator``: the name
    the audit rows of its changes carry. ``receiver_url``: the receiver's URL,
    or a ``lease.http.Destination`` (its ``ca_file``, its ``insecure_http``).
    ``allowed_hosts``: the names a request's ``Host`` may carry, each ``NAME``
    (any port) or ``NAME:PORT`` (by default loopback's names: mounted in a
    service reached by another name, list that one); any other is refused
    (421) before anything is read. ``queues_of``: where the overview's list of
    the queues beside this one is read from (the default queue's file or URL;
    by default ``queue``). The queue opens when the app starts."""
    if token is not None:
        check_token(token)
    check_actor(operator)
    hosts = Hosts(allowed_hosts)
    receiver = None if receiver_url is None else (
        receiver_url if isinstance(receiver_url, Destination) else Destination(receiver_url))
    stats = None if receiver is None else stats_url(
        receiver.url, insecure_http=receiver.insecure_http)
    access = None if token is None else Access(token, operator)
    app = web.Application(middlewares=[_refusals, _guarded])
    app[SETTINGS] = Settings(shown(str(queue)), allow_changes, Guard(access), operator,
                             stats, hosts, None if receiver is None else receiver.ssl_context)
    app[QUEUE] = Queue(str(queue), allow_changes=allow_changes, queues_of=queues_of)
    app[TEMPLATES] = _templates()
    app[METRICS] = QueueMetrics(lambda: app[QUEUE].look(lambda store: store.queue_depth()))
    app.cleanup_ctx.append(_open_queue)
    if stats is not None:
        app.cleanup_ctx.append(_http_session)
    app.on_response_prepare.append(_security_headers)
    _routes(app)
    return app


def _routes(app: web.Application) -> None:
    add = app.router.add_route
    add("GET", "/", overview, name="overview")
    add("GET", "/jobs", jobs, name="jobs")
    add("GET", "/job", job, name="job")
    add("GET", "/dead", dead, name="dead")
    add("GET", "/endpoints", endpoints, name="endpoints")
    add("GET", "/endpoint", endpoint, name="endpoint")
    add("GET", "/blocked", blocked, name="blocked")
    add("GET", "/workers", workers, name="workers")
    add("GET", "/pause", pause_page, name="pause_page")
    add("POST", "/pause", pause_change, name="pause")
    add("POST", "/resume", pause_change, name="resume")
    add("POST", "/refresh", refresh, name="refresh")
    add("POST", "/job/redrive", job_change, name="job_redrive")
    add("POST", "/job/cancel", job_change, name="job_cancel")
    add("POST", "/dead/preview", preview, name="preview")
    add("POST", "/dead/apply", apply, name="apply")
    add("POST", "/endpoint/recover/preview", recover_preview, name="recover_preview")
    add("POST", "/endpoint/recover/apply", recover_apply, name="recover_apply")
    add("GET", "/login", login_form, name="login_form")
    add("POST", "/login", login, name="login")
    add("POST", "/logout", logout, name="logout")
    add("GET", "/ui.css", css, name="css")
    add("GET", "/metrics", queue_metrics_handler, name="metrics")


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["when"] = when
    env.filters["age"] = age
    env.filters["cell"] = lambda value: "-" if value is None else value
    return env


async def _open_queue(app: web.Application) -> AsyncIterator[None]:
    await app[QUEUE].open()
    yield
    await app[QUEUE].close()


async def _http_session(app: web.Application) -> AsyncIterator[None]:
    # no proxy from the environment, no cookies kept: a GET of the receiver's figures,
    # its certificate verified as the senders verify it (against --ca-file alone if given)
    context = app[SETTINGS].receiver_tls
    connector = aiohttp.TCPConnector(ssl=True if context is None else context)
    async with aiohttp.ClientSession(trust_env=False, connector=connector,
                                     cookie_jar=aiohttp.DummyCookieJar()) as session:
        app[HTTP] = session
        yield


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(SECURITY_HEADERS)


def age(ms: int | None) -> str:
    """A duration for people: 950 ms, 12.5 s, 42 min, 5.1 h, 3.2 d."""
    if ms is None:
        return "-"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.1f} {unit}".replace(".0 ", " ")
    return f"{ms} ms"


# ------------------------------------------------------------------ middlewares


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A refusal as a page (or JSON) of one line, with its status."""
    try:
        return await handler(request)
    except Refused as exc:
        return _refusal(request, exc.status, exc.message, exc.headers)
    except BadRequest as exc:
        return _refusal(request, 400, str(exc))
    except (StoreError, OSError) as exc:  # locked, unreachable, the file gone
        return _refusal(request, 503, f"the queue did not answer: {one_line(str(exc))}")


def _refusal(request: web.Request, status: int, message: str,
             headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    if request.query.get("format") == "json" or not _accepts_html(request):
        return web.json_response({"error": message}, status=status, headers=headers)
    return _render(request, "refused.html", status=status, headers=headers,
                   status_code=status, message=message)


def _accepts_html(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "text/html" in accept or "*/*" in accept or not accept


@web.middleware
async def _guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A host it does not answer to refused first, then cross-site posts, then
    the token asked for."""
    settings = request.app[SETTINGS]
    host = request.headers.get("Host")
    if not settings.hosts.admits(host, 443 if request.secure else 80):
        # plain text, no page: a page carries the CSRF token, which such a request
        # (another site's, by a name rebound to this address) must never read
        status = 400 if host is None else 421
        why = ("names no Host" if host is None else
               f"names the host {host!r:.80}, not one this page answers to (asyncworker ui "
               f"--allowed-host names the others)")
        return web.Response(status=status, text=f"refused: the request {why}\n")
    if request.method == "POST" and cross_site(request.headers, settings.hosts):
        raise Refused(403, "refused: a change must be posted by this page itself "
                           "(a cross-site request)")
    route = request.match_info.route.name
    if route in PUBLIC_ROUTES or settings.guard.admits(
            request.headers.get("Authorization"), request.cookies.get(SESSION_COOKIE)):
        return await handler(request)
    if request.method == "GET" and request.query.get("format") != "json" and "Authorization" \
            not in request.headers and _accepts_html(request):
        login_url = _url(request, "login_form", next=request.path_qs)
        raise web.HTTPSeeOther(login_url)
    raise Refused(401, "the access token is missing or wrong",
                  {"WWW-Authenticate": 'Bearer realm="asyncworker ui"'})


def _url(request: web.Request, name: str, /, **query: Any) -> str:
    """A route of this app (with its prefix when mounted), its query kept in order
    (a query may have a ``name`` of its own: one endpoint's page)."""
    url = request.app.router[name].url_for()
    given = {key: str(value) for key, value in query.items() if value not in (None, "")}
    return str(url.with_query(given) if given else url)


# ------------------------------------------------------------------ answers


def _wants_json(request: web.Request) -> bool:
    form = request.query.get("format", "html")
    if form not in ("html", "json"):
        raise BadRequest(f"format must be html or json, got {form!r:.20}")
    return form == "json"


def _render(request: web.Request, template: str, *, status: int = 200,
            headers: Mapping[str, str] | None = None, **context: Any) -> web.Response:
    settings = request.app[SETTINGS]
    refreshable = status == 200 and _refreshable(request)
    refresh_on = refreshable and request.cookies.get(REFRESH_COOKIE) != "off"
    page = request.app[TEMPLATES].get_template(template).render(
        settings=settings, csrf=settings.guard.csrf(), token_required=settings.guard.required,
        url=lambda route, /, **query: _url(request, route, **query),
        json_url=str(request.rel_url.update_query(format="json"))
        if request.method == "GET" and status == 200 else None,
        refreshable=refreshable, refresh_s=REFRESH_S if refresh_on else None,
        here=request.path_qs, **context)
    answer = web.Response(text=page, status=status, headers=headers, content_type="text/html",
                          charset="utf-8")
    if refresh_on:  # the browser reloads the page itself: no script, the CSP stays
        answer.headers["Refresh"] = str(REFRESH_S)
    return answer


# Auto-refresh: the pages that only show reload every REFRESH_S seconds, unless
# the operator turned it off (a cookie). A page with a change form reloads only
# when the page is read-only: a reload would lose a note being typed.
REFRESH_S = 10
REFRESH_COOKIE = "asyncworker_refresh"
REFRESHED = frozenset({"overview", "jobs", "endpoints", "blocked", "workers"})
REFRESHED_READ_ONLY = frozenset({"dead", "endpoint", "job", "pause_page"})


def _refreshable(request: web.Request) -> bool:
    if request.method != "GET":
        return False
    route = request.match_info.route.name
    return route in REFRESHED or (route in REFRESHED_READ_ONLY
                                  and not request.app[SETTINGS].allow_changes)


async def refresh(request: web.Request) -> web.StreamResponse:
    """The operator's auto-refresh, on or off (``to``), then back to ``next``: a
    preference kept in a cookie, not a change of the queue (so it needs the
    CSRF token, not --allow-changes)."""
    posted = await request.post()
    if not request.app[SETTINGS].guard.csrf_matches(posted.get("csrf")):
        raise Refused(403, "the form's CSRF token is missing or stale: reload the page")
    to = posted.get("to")
    if to not in ("on", "off"):
        raise BadRequest("to must be on or off")
    answer = web.HTTPSeeOther(_next(request, posted.get("next")))
    if to == "off":
        answer.set_cookie(REFRESH_COOKIE, "off", httponly=True, samesite="Strict",
                          secure=request.secure, path=_url(request, "overview"))
    else:
        answer.del_cookie(REFRESH_COOKIE, path=_url(request, "overview"))
    raise answer


def _answer(request: web.Request, template: str, data: Any, *, status: int = 200,
            **context: Any) -> web.Response:
    if _wants_json(request):
        return web.json_response(data, status=status,
                                 dumps=lambda value: json.dumps(value, ensure_ascii=False))
    return _render(request, template, status=status, **context)


def _shows_body(request: web.Request) -> bool:
    return request.query.get("show") == "body"


def hide_body(row: dict) -> dict:
    """A job's row with its payload left out (its size said instead)."""
    body = row.get("body")
    if body is None:
        return row
    return {**row, "body": None, "body_bytes": len(body.encode())}


# ------------------------------------------------------------------ the pages


async def overview(request: web.Request) -> web.Response:
    _wants_json(request)
    def read(store: Store) -> tuple[dict, list[dict], list[dict], dict | None, list[dict],
                                    list[dict]]:
        found = endpoint_figures(store)
        return (store.snapshot(), found, stats_endpoints(store) if found else [],
                store.paused(), store.workers(), store.minutes(_chart_since()))

    snap, found, listed, paused, at_work, minutes = await request.app[QUEUE].look(read)
    queues = await request.app[QUEUE].neighbours()
    receiver, receiver_error = await _receiver_figures(request)
    data = dict(snap)
    if queues is not None:  # a queue alone in its database answers as before queues had names
        data["queues"] = queues
    if paused is not None:  # a queue that runs answers as before the pause existed
        data["paused"] = paused
    if at_work:  # as ``stats --json`` has them
        data["workers"] = at_work
    circuits = circuit_summary(found, _now_ms()) if found else None
    if circuits is not None:  # a queue without endpoints answers as before them
        data["endpoints"] = listed  # as ``stats --json`` has them
        data["circuits"] = circuits
    if receiver is not None:
        data["receiver"] = receiver
    if receiver_error is not None:
        data["receiver_error"] = receiver_error
    refused = None if receiver is None else sum(
        value for key, value in receiver.items()
        if key.startswith("process_refused_signature_") and isinstance(value, int))
    return _answer(request, "overview.html", data, snap=snap, receiver=receiver,
                   receiver_error=receiver_error, refused_by_signature=refused,
                   circuits=circuits, paused=paused, at_work=at_work, queues=queues,
                   charts=charts(minutes, "the queue"))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _chart_since() -> int:
    """The first minute the day's chart shows (this host's clock: a page's)."""
    return max(0, _now_ms() - DAY_MS - MINUTE_MS)


def charts(minutes: list[dict], label: str) -> list[tuple[str, Markup]]:
    """The charts of the last hour and the last day of ``minutes``, each with
    its heading (asyncworker.ui.charts)."""
    now = _now_ms()
    return [(title, chart(span, title, periods(minutes, now, bars, each), label))
            for span, title, bars, each in SPANS]


async def _receiver_figures(request: web.Request) -> tuple[dict | None, str | None]:
    """The receiver's /stats, or why they are unavailable: the page shows either."""
    url = request.app[SETTINGS].stats_url
    if url is None:
        return None, None
    try:
        async with request.app[HTTP].get(
                url, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=RECEIVER_TIMEOUT_S)) as answer:
            if answer.status != 200:
                raise ValueError(f"HTTP {answer.status}")
            found = await answer.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return None, f"unavailable: {one_line(str(exc)) or type(exc).__name__}"
    if not isinstance(found, dict):
        return None, "unavailable: its /stats is not a JSON object"
    return found, None


def _page_query(request: web.Request) -> tuple[int | None, int]:
    """after (a seq) and limit from the query: keyset pagination."""
    after_text = request.query.get("after") or None
    limit_text = request.query.get("limit") or str(PAGE_SIZE)
    if after_text is not None and not (after_text.isascii() and after_text.isdigit()
                                       and len(after_text) <= 19):
        raise BadRequest("after must be a job's seq (a whole number)")
    if not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 4
            and 1 <= int(limit_text) <= MAX_PAGE - 1):
        raise BadRequest(f"limit must be a whole number in 1..{MAX_PAGE - 1}")
    return (None if after_text is None else int(after_text)), int(limit_text)


async def _job_page(request: web.Request, status: str | None, found: Filter
                    ) -> tuple[list[dict], int | None]:
    """One page of jobs and the seq the next page starts after (None: the last)."""
    after, limit = _page_query(request)
    rows, next_after = await request.app[QUEUE].look(
        lambda store: job_page(store, status, found, after, limit))
    if not _shows_body(request):
        rows = [hide_body(row) for row in rows]
    return rows, next_after


async def jobs(request: web.Request) -> web.Response:
    _wants_json(request)
    status = request.query.get("status") or None
    if status is not None and status not in STATUSES:
        raise BadRequest(f"status must be one of {', '.join(STATUSES)}, got {status!r:.40}")
    found = parse_filter(request.query)
    rows, next_after = await _job_page(request, status, found)
    filters = {"status": status, **found._asdict()}
    return _answer(request, "jobs.html", {"jobs": rows, "next_after_seq": next_after},
                   rows=rows, filters=filters, next_after=next_after, statuses=STATUSES,
                   columns=delivery_columns(rows))


async def job(request: web.Request) -> web.Response:
    _wants_json(request)
    job_id = request.query.get("id", "")
    try:
        check_job_id("id", job_id, PRODUCT)
    except ValueError:
        raise BadRequest(f"id must be {PRODUCT.job_id_rule}") from None
    history = await request.app[QUEUE].look(lambda store: store.job_history(job_id))
    if history is None:
        raise Refused(404, f"no job {job_id!r} in this queue")
    show_body = _shows_body(request)
    if not show_body:
        history = {**history, "job": hide_body(history["job"])}
    return _job_answer(request, history, show_body=show_body)


def _job_answer(request: web.Request, history: dict[str, Any], *, show_body: bool = False,
                status: int = 200, change: dict[str, str] | None = None) -> web.Response:
    """A job's page: its row, its history, the actions its status allows (when
    the page may change) and, after one, what it did (``change``)."""
    settings = request.app[SETTINGS]
    job_id = history["job"]["id"]
    command = f"asyncworker inspect {shlex.quote(settings.queue)} {shlex.quote(job_id)}"
    data = history if change is None else {**history, "change": change}
    return _answer(request, "job.html", data, status=status, history=history,
                   row=history["job"], command=command, show_body=show_body, change=change,
                   actions=job_actions(history["job"]["status"]),
                   ttl_ms=DEFAULT_POLICY.ttl_ms)


async def job_change(request: web.Request) -> web.Response:
    """One job redriven or cancelled from its page: no dry run (the set is the
    one job the operator is looking at), a note required, an audit row with
    the actor; refused (409, its page again with the store's words) when its
    status no longer allows it."""
    action = request.match_info.route.name.removeprefix("job_")  # type: ignore[union-attr]
    one = parse_job_change(action, await _change_form(request))
    actor = request.app[SETTINGS].operator

    def change(store: Store) -> tuple[object, dict[str, Any] | None]:
        if one.action == "redrive":
            answer = store.redrive_jobs([one.job_id], one.ttl_ms, one.note, actor=actor)[0]
        else:
            answer = store.cancel_jobs([one.job_id], one.note, actor=actor)[0]
        return answer, store.job_history(one.job_id)

    answer, history = await request.app[QUEUE].change(change)
    if history is None:
        raise Refused(404, f"no job {one.job_id!r} in this queue")
    result, detail = outcome(one.action, answer)
    return _job_answer(request, history, status=200 if answer is True else 409,
                       change={"action": one.action, "result": result, "detail": detail,
                               "note": one.note})


async def workers(request: web.Request) -> web.Response:
    """The dispatchers at work (Store.workers), by owner."""
    _wants_json(request)
    rows, paused = await request.app[QUEUE].look(
        lambda store: (store.workers(), store.paused()))
    return _answer(request, "workers.html", rows, rows=rows, paused=paused,
                   beat_s=WORKER_BEAT_MS // 1000)


async def pause_page(request: web.Request) -> web.Response:
    """The queue's pause: its state, the form that changes it, its audit rows."""
    _wants_json(request)
    paused, audit = await request.app[QUEUE].look(
        lambda store: (store.paused(), store.queue_audit()))
    return _answer(request, "pause.html", {"paused": paused, "audit": audit},
                   paused=paused, audit=audit, change=None)


async def pause_change(request: web.Request) -> web.Response:
    """Pause or resume from the page: a note required, an audit row with the
    actor; the page again with what it did (nothing, when it already was so)."""
    action = request.match_info.route.name
    note = parse_note(await _change_form(request), "say why, for the audit row")
    actor = request.app[SETTINGS].operator

    def change(store: Store) -> tuple[bool, dict | None, list[dict]]:
        changed = store.pause(note, actor=actor) if action == "pause" \
            else store.resume(note, actor=actor)
        return changed, store.paused(), store.queue_audit()

    changed, paused, audit = await request.app[QUEUE].change(change)
    done = {"pause": "paused", "resume": "resumed"}[str(action)]
    said = done if changed else f"not {done}: it already was {'paused' if paused else 'running'}"
    return _answer(request, "pause.html", {"paused": paused, "audit": audit, "change": said},
                   paused=paused, audit=audit, change=said)


async def dead(request: web.Request) -> web.Response:
    _wants_json(request)
    found = parse_filter(request.query)
    by_reason = await request.app[QUEUE].look(
        lambda store: dead_by_reason(store, found))
    rows, next_after = await _job_page(request, "dead", found)
    data: dict[str, Any] = {"dead_by_reason": by_reason, "jobs": rows,
                            "next_after_seq": next_after}
    if found.endpoint is not None:
        data["endpoint"] = found.endpoint
    return _answer(request, "dead.html", data, by_reason=by_reason, rows=rows,
                   next_after=next_after, filters=found._asdict(),
                   columns=delivery_columns(rows))


async def blocked(request: web.Request) -> web.Response:
    """The ordering keys blocked by a dead first job: each key (and endpoint),
    its dead head (a link to its page: redrive or cancel it there) and how
    many wait behind it."""
    _wants_json(request)
    rows = await request.app[QUEUE].look(lambda store: store.blocked_heads(MAX_PAGE))
    return _answer(request, "blocked.html", {"blocked": rows}, rows=rows, limit=MAX_PAGE)


async def endpoints(request: web.Request) -> web.Response:
    """Every endpoint with its figures and its circuit, and how many are open,
    half-open, paused, disabled; none: how to add one."""
    _wants_json(request)
    found = await request.app[QUEUE].look(endpoint_figures)
    now = _now_ms()
    circuits = circuit_summary(found, now)
    queue = shlex.quote(request.app[SETTINGS].queue)
    data: dict[str, Any] = {"endpoints": found}
    if found:  # a queue without endpoints answers as before them
        data["circuits"] = circuits
    return _answer(request, "endpoints.html", data,
                   endpoints=found, circuits=circuits, now_ms=now,
                   add_command=f"asyncworker endpoint add {queue} NAME URL")


def _endpoint_name(text: str) -> str:
    try:
        return check_endpoint_name(text)
    except ValueError:
        raise BadRequest("name must be an endpoint's name: 1-64 ASCII letters, digits, "
                         "'_' or '-'") from None


async def endpoint(request: web.Request) -> web.Response:
    """One endpoint: its figures, its circuit, where its deliveries and dead
    letters are, the recovery's form, and its audit rows (the breaker's too)."""
    _wants_json(request)
    name = _endpoint_name(request.query.get("name", ""))
    record, audit, minutes = await request.app[QUEUE].look(
        lambda store: (*endpoint_record(store, name), store.minutes(_chart_since(), name)))
    if record is None:
        raise Refused(404, f"no endpoint {name!r} in this queue (a removed endpoint's "
                           f"finished deliveries are on the jobs page, by endpoint)")
    now = _now_ms()
    circuit = record["circuit"]
    since = circuit.get("failing_since_ms") or (
        circuit.get("since_ms") if circuit.get("state") != CLOSED else None)
    return _answer(request, "endpoint.html", {"endpoint": record, "audit": audit},
                   ep=record, audit=audit, now_ms=now,
                   since_default=None if since is None else _datetime_local(since),
                   ttl_ms=DEFAULT_POLICY.ttl_ms, charts=charts(minutes, name))


def _datetime_local(ms: int) -> str:
    """A moment as a date-time input's value (UTC, to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000))


# ------------------------------------------------------------------ an endpoint's recovery


async def recover_preview(request: web.Request) -> web.Response:
    """The recovery's dry run: the endpoint's deliveries finished since then,
    how many, and that set's fingerprint; nothing changed."""
    recovery = parse_recovery(await _change_form(request))
    try:
        dry = await request.app[QUEUE].change(lambda store: preview_recovery(store, recovery))
    except NoSuchEndpoint:
        raise Refused(404, f"no endpoint {recovery.endpoint!r} in this queue") from None
    data = {key: value for key, value in dry.items() if key != "ids"}
    data["csrf"] = request.app[SETTINGS].guard.csrf()
    return _answer(request, "recover_preview.html", data, dry=data, stale=None)


async def recover_apply(request: web.Request) -> web.Response:
    """The recovery's confirmation: refused (409, nothing sent) unless the
    endpoint's deliveries finished since then are the very set the dry run
    showed; then exactly those sent again, each with an audit row (the note,
    the actor)."""
    form = await _change_form(request)
    recovery = parse_recovery(form)
    actor = request.app[SETTINGS].operator
    try:
        result, same = await request.app[QUEUE].change(
            lambda store: confirm_recovery(store, recovery, form.get("fingerprint", ""), actor))
    except NoSuchEndpoint:
        raise Refused(404, f"no endpoint {recovery.endpoint!r} in this queue") from None
    if not same:
        data = {key: value for key, value in result.items() if key != "ids"}
        data["csrf"] = request.app[SETTINGS].guard.csrf()
        data["error"] = (f"the deliveries of {recovery.endpoint} finished since then changed "
                         f"since the dry run ({result['count']} now): nothing was sent; run "
                         f"the dry run again")
        return _answer(request, "recover_preview.html", data, status=409, dry=data,
                       stale=data["error"])
    data = {key: value for key, value in result.items() if key != "ids"}
    data["actor"] = actor
    return _answer(request, "recover_result.html", data, result=data,
                   shown=result["recovered"][:SHOW_RESULTS],
                   hidden=max(0, len(result["recovered"]) - SHOW_RESULTS))


# ------------------------------------------------------------------ bulk changes


async def _change_form(request: web.Request) -> dict[str, str]:
    """The posted form of a change, once the page may change and its CSRF token holds."""
    if not request.app[SETTINGS].allow_changes:
        raise Refused(403, "read-only: this page was started without --allow-changes")
    posted = await request.post()
    form = {key: value for key, value in posted.items() if isinstance(value, str)}
    if not request.app[SETTINGS].guard.csrf_matches(form.get("csrf")):
        raise Refused(403, "the form's CSRF token is missing or stale: reload the page")
    return form


async def preview(request: web.Request) -> web.Response:
    """The dry run: what the filter matches now, and that set's fingerprint."""
    bulk = parse_bulk(await _change_form(request))
    members = await request.app[QUEUE].look(lambda store: matched(store, bulk))
    data = _bulk_data(bulk, members)
    data["csrf"] = request.app[SETTINGS].guard.csrf()
    return _answer(request, "preview.html", data, bulk=bulk, dry=data, stale=None)


def _bulk_data(bulk: BulkRequest, members: list[Member]) -> dict[str, Any]:
    return {"action": bulk.action, "reason": bulk.reason, "id_prefix": bulk.id_prefix,
            "key": bulk.key, "endpoint": bulk.endpoint, "error": bulk.error,
            "http_status": bulk.http_status, "from": bulk.from_text, "to": bulk.to_text,
            "note": bulk.note,
            "ttl_ms": bulk.ttl_ms, "count": len(members),
            "sample": [member.id for member in members[:SAMPLE]],
            "fingerprint": fingerprint(bulk, members)}


async def apply(request: web.Request) -> web.Response:
    """The confirmation: refused (409) unless the filter still matches the very
    set the dry run showed; then each job changed, or told why not."""
    form = await _change_form(request)
    bulk = parse_bulk(form)
    queue = request.app[QUEUE]
    members = await queue.look(lambda store: matched(store, bulk))
    now = _bulk_data(bulk, members)
    if not hmac.compare_digest(form.get("fingerprint", "").encode(), now["fingerprint"].encode()):
        now["csrf"] = request.app[SETTINGS].guard.csrf()
        now["error"] = (f"the dead letters this filter matches changed since the dry run "
                        f"({len(members)} match now): nothing was changed; run the dry run "
                        f"again")
        return _answer(request, "preview.html", now, status=409, bulk=bulk, dry=now,
                       stale=now["error"])
    results, error = await _apply_in_chunks(request, bulk, [m.id for m in members])
    counts = Counter(line["result"] for line in results)
    data = {"action": bulk.action, "note": bulk.note, "counts": dict(counts),
            "results": results, "error": error}
    return _answer(request, "result.html", data, status=503 if error else 200, bulk=bulk,
                   results=results[:SHOW_RESULTS], hidden=max(0, len(results) - SHOW_RESULTS),
                   counts=counts, error=error)


async def _apply_in_chunks(request: web.Request, bulk: BulkRequest, ids: list[str]
                           ) -> tuple[list[dict[str, str]], str | None]:
    """Each chunk one transaction (MAX_BATCH jobs): a store that fails part-way
    leaves the chunks before it whole and the rest untouched, and says so."""
    queue = request.app[QUEUE]
    actor = request.app[SETTINGS].operator
    results: list[dict[str, str]] = []
    for chunk in chunks(ids):

        def change(store: Store, chunk: list[str] = chunk) -> list:
            if bulk.action == "redrive":
                return store.redrive_jobs(chunk, bulk.ttl_ms, bulk.note, actor=actor)
            return store.cancel_jobs(chunk, bulk.note, actor=actor)

        try:
            answers = await queue.change(change)
        except StoreError as exc:
            done = sum(line["result"] == bulk.past for line in results)
            return results, (f"{one_line(str(exc))}: {done} {bulk.past} before it, the "
                             f"other {len(ids) - len(results)} untouched")
        for job_id, answer in zip(chunk, answers, strict=True):
            result, detail = outcome(bulk.action, answer)
            results.append({"id": job_id, "result": result, "detail": detail})
    return results, None


# ------------------------------------------------------------------ signing in


async def login_form(request: web.Request) -> web.Response:
    return _render(request, "login.html", next=_next(request, request.query.get("next")),
                   wrong=False)


async def login(request: web.Request) -> web.StreamResponse:
    guard = request.app[SETTINGS].guard
    posted = await request.post()
    offered = posted.get("token")
    target = _next(request, posted.get("next"))
    if not guard.required:
        raise web.HTTPSeeOther(target)
    if not isinstance(offered, str) or not guard.token_matches(offered.strip()):
        return _render(request, "login.html", status=401, next=target, wrong=True)
    answer = web.HTTPSeeOther(target)
    answer.set_cookie(SESSION_COOKIE, guard.session(), httponly=True, samesite="Strict",
                      secure=request.secure, path=_url(request, "overview"))
    raise answer


async def logout(request: web.Request) -> web.StreamResponse:
    posted = await request.post()
    if not request.app[SETTINGS].guard.csrf_matches(posted.get("csrf")):
        raise Refused(403, "the form's CSRF token is missing or stale: reload the page")
    answer = web.HTTPSeeOther(_url(request, "login_form"))
    answer.del_cookie(SESSION_COOKIE, path=_url(request, "overview"))
    raise answer


def _next(request: web.Request, target: object) -> str:
    """Where to go after signing in: a page of this app only, never another site."""
    home = _url(request, "overview")
    if isinstance(target, str) and target.startswith(home) and not target.startswith("//") \
            and "\\" not in target:
        return target
    return home


async def css(request: web.Request) -> web.Response:
    return web.Response(body=(HERE / "static" / "ui.css").read_bytes(), content_type="text/css")
