"""Where a dispatcher serving endpoints sends each delivery: the queue's
endpoints (``lease.endpoints.Endpoint``, secrets and static headers
included), each with a connection pool of its own.

The table is read from the store (``Store.endpoint_configs``) when the
dispatcher starts, again every ``refresh_s`` seconds (a changed URL, secret
or header is used from the next send on), and at once when a claim hands back
a delivery of an endpoint it does not know (one added since). A ``Route`` is
one endpoint's entry: its latest configuration, its ``WireClient`` (one pool
per endpoint: a slow endpoint's connections never crowd out another's) and
its figures (``asyncworker.metrics.EndpointFigures``). An endpoint that is
gone from the table (removed) keeps its pool until its last send in flight
ends, then the pool is closed; its figures stay with the metrics. An
endpoint that cannot be built from its row (its CA file gone) is logged once
and keeps the configuration it had; it stops none of the others.

The claim decides how the dispatcher's slots are shared between endpoints
(each endpoint's cap, rate and fair share are store state, judged inside the
claim's transaction); this module only routes what was claimed.

Circuits (``lease.breaker``: every endpoint's breaker is store state, stepped
by the finishes and honoured by the claims of every dispatcher). With each
refresh the dispatcher reads the endpoints' rows (``Store.endpoints``: each
one's circuit) and, for an endpoint whose circuit changed since the last
read, its audit rows; each new row the breaker wrote (actor "breaker":
opened, reopened, closed, paused, disable) is one log line with its
evidence, and a circuit seen half-open is one "probing" line. Every
dispatcher logs the changes of the endpoints it serves, whichever
dispatcher's finish caused them: a finish does not say which changes it
made, and a process whose sends stopped must say why in its own log. So N
dispatchers print each change at most N times, each line with the change's
``at_ms`` (the same in all of them: dedupe an aggregated log on endpoint,
action and at_ms). A dispatcher that starts during an outage says so once.

What is claimed and not yet sent waits on the circuit too. Each route
keeps its endpoint's circuit as this dispatcher knows it: the store's, as
last read, stepped by this dispatcher's own attempts as each is judged,
before its finish is written (``EndpointRoutes.judged``: the store's own
rule, ``lease.breaker.step``). When that circuit may not send
(``lease.breaker.may_send``: open within its cool-down, or paused), or
while a failure of its own waits for the store's word, the dispatcher
gives that endpoint's claimed deliveries that are not on the wire yet back
to the store (``Store.release_jobs``) instead of sending them. A failure is
enough to hold the endpoint back: the other dispatchers' failures may have
opened the circuit already, and a send begun before the next read would
reach an endpoint whose circuit is open. The local view is kept over a read
until the finish of that failure is recorded, then the circuits are read at
once: the store's word (open, or still closed) is the route's again. The
cost, for an endpoint that fails now and then while up: each failure gives
its claimed deliveries back for one finish and one read (no attempt spent,
due again at once).

Failed attempts in an outage are counted, not logged one by one: an
attempt that failed (``lease.breaker.signal_of``: no answer, a timeout, a
5xx, a 429) while its endpoint's circuit is not closed (as last read), or
after ``BREAKER.open_after`` failures in a row at this dispatcher, goes into
its endpoint's summary, one line per endpoint per ``summary_s`` at most
("endpoint X: 37 attempts failed in the last 10 s, last: ..."). A
delivery, a refusal (4xx: the endpoint answered), or a failure of a closed
circuit below the threshold logs as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncworker.metrics import CONDITIONS, EndpointFigures
from asyncworker.store import AsyncStore
from asyncworker.wire import WireClient
from lease.breaker import (
    BREAKER,
    BREAKER_ACTOR,
    CLOSED,
    HALF_OPEN,
    OPEN,
    Circuit,
    may_send,
    step,
)
from lease.endpoints import ALL, Endpoint, EndpointError
from lease.http import Destination
from lease.records import Attempt
from lease.store import Store
from lease.worker import Busy

__all__ = ["CONDITIONS", "EndpointRoutes", "FailureSummary", "Route", "condition_of"]

log = logging.getLogger("asyncworker.dispatcher")

REFRESH_S = 2.0  # how often a dispatcher reads its endpoints again
SUMMARY_S = 10.0  # at most one summary of failed attempts per endpoint this often
PAUSED, DISABLED = "paused", "disabled"
assert CONDITIONS == (CLOSED, PAUSED, OPEN, HALF_OPEN, DISABLED)


def condition_of(row: dict[str, Any], now_ms: int | None) -> str:
    """One of CONDITIONS for an endpoint's row (``Store.endpoints``): disabled
    first, then its circuit; a closed one is paused while a Retry-After runs."""
    if not row.get("enabled", True):
        return DISABLED
    circuit = row.get("circuit") or {}
    state = circuit.get("state") or CLOSED
    paused = circuit.get("paused_until_ms")
    if state == CLOSED and paused is not None and now_ms is not None and now_ms < paused:
        return PAUSED
    return str(state)


def _signature(row: dict[str, Any]) -> tuple:
    """What changes when the breaker (or an operator's enable or disable) acts."""
    circuit = row.get("circuit") or {}
    return (circuit.get("state"), circuit.get("since_ms"), circuit.get("paused_until_ms"),
            row.get("enabled"), row.get("disabled_why"))


class FailureSummary:
    """One endpoint's failed attempts counted instead of logged: how many
    since ``first`` (the summary clock's seconds), and the last one's evidence."""

    __slots__ = ("count", "first", "error", "http_status", "job")

    def __init__(self) -> None:
        self.count = 0
        self.first = 0.0
        self.error: str | None = None
        self.http_status: int | None = None
        self.job: str | None = None

    def add(self, now: float, seen: Attempt, job: str) -> None:
        if not self.count:
            self.first = now
        self.count += 1
        self.error, self.http_status, self.job = seen.error, seen.http_status, job

    def due(self, now: float, interval: float) -> bool:
        return self.count > 0 and now - self.first >= interval


class Route:
    """One endpoint as the dispatcher sends to it. ``endpoint`` is replaced in
    place when a refresh finds it changed, so a delivery claimed before the
    change is sent with the newest configuration."""

    __slots__ = ("name", "endpoint", "client", "figures", "sending", "gone", "failing",
                 "condition", "summary", "circuit", "unconfirmed")

    def __init__(self, endpoint: Endpoint, client: WireClient,
                 figures: EndpointFigures) -> None:
        self.name = endpoint.name
        self.endpoint = endpoint
        self.client = client
        self.figures = figures
        self.sending = 0  # sends in flight on its pool
        self.gone = False  # no longer in the table: the pool closes after its last send
        self.failing = 0  # failed attempts in a row, as this dispatcher's finishes saw them
        self.condition = CLOSED  # its circuit as last read (CONDITIONS)
        self.summary = FailureSummary()  # the failed attempts counted, not logged
        # its circuit as this dispatcher knows it: read from the store, then
        # stepped by this dispatcher's own attempts as each is judged
        self.circuit = Circuit()
        # a failure of this dispatcher's own that the store has not shown yet:
        # the job in flight that saw it, until its finish is recorded and the
        # circuits are read again (meanwhile nothing more is sent to it)
        self.unconfirmed: object | None = None

    def may_send(self, now_ms: int) -> bool:
        """Whether a delivery claimed for it may still be sent: no failure of
        its own is waiting for the store's word, and the circuit lets it
        (``lease.breaker.may_send``)."""
        return self.unconfirmed is None and may_send(self.circuit, now_ms)

    @property
    def quiet(self) -> bool:
        """A failed attempt is counted in the summary, not logged on its own:
        the circuit is not closed, or failures repeat past the breaker's threshold."""
        return self.condition != CLOSED or self.failing >= BREAKER.open_after

    @property
    def destination(self) -> Destination:
        return self.endpoint.destination


class EndpointRoutes:
    """The endpoints a dispatcher serves (``served``: ``"*"`` or names), read
    from ``queue``. ``pool_limit`` bounds each endpoint's connections;
    ``figures_of`` gives an endpoint's figures (kept by the metrics);
    ``keep_trying`` says how long a busy store is worth waiting for."""

    def __init__(self, queue: AsyncStore, served: str | tuple[str, ...], *, pool_limit: int,
                 figures_of: Callable[[str], EndpointFigures],
                 keep_trying: Callable[[], bool] = lambda: True,
                 on_busy: Callable[[], None] = lambda: None,
                 refresh_s: float = REFRESH_S, owner: str | None = None,
                 summary_s: float = SUMMARY_S,
                 summary_clock: Callable[[], float] = time.monotonic,
                 on_held_back: Callable[[Route], None] = lambda _: None) -> None:
        self._queue = queue
        self._names = None if served == ALL else tuple(served)
        self._pool_limit = pool_limit
        self._figures_of = figures_of
        self._keep_trying = keep_trying
        self._on_busy = on_busy
        self.refresh_s = refresh_s
        self._routes: dict[str, Route] = {}
        self._lock = asyncio.Lock()
        self._unknown_told: set[str] = set()  # endpoints whose unknown delivery was logged
        self._broken_told: set[str] = set()  # endpoints that could not be built, logged
        self.loads = 0  # reads of the table that succeeded
        self.owner = owner
        self.summary_s = summary_s
        self._clock = summary_clock
        self._on_held_back = on_held_back  # a route whose deliveries may not be sent now
        # the circuits: each endpoint's row as last read (Store.endpoints), when
        # (the store's time), and per endpoint its signature and audit rows seen
        self.circuits: dict[str, dict[str, Any]] = {}
        self.circuits_ms: int | None = None
        self._signatures: dict[str, tuple] = {}
        self._audited: dict[str, int] = {}
        self.watches = 0  # reads of the circuits that succeeded
        self._watching = asyncio.Lock()

    def get(self, name: str | None) -> Route | None:
        return None if name is None else self._routes.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._routes)

    async def load(self) -> None:
        """Read the table and apply it: one store call (a busy store waited
        out while ``keep_trying``), then no await until every route is set.
        Loads run one at a time, each reading after the one before it."""
        async with self._lock:
            broken: dict[str, str] = {}
            try:
                configs = await self._queue.endpoint_configs(
                    self._names, keep_trying=self._keep_trying,
                    on_busy=lambda _: self._on_busy())
            except EndpointError:  # a name served is no endpoint (yet), or one
                configs, broken = await self._one_by_one()  # cannot be built (CA file gone)
            self._apply(configs, broken)
            self.loads += 1

    async def _one_by_one(self) -> tuple[list[Endpoint], dict[str, str]]:
        """The endpoints read one at a time (on one store thread hop), so one
        that cannot be built keeps none of the others from being served:
        (those built, {name: why} of the others)."""
        names = self._names

        def each(store: Store) -> tuple[list[Endpoint], dict[str, str]]:
            found: list[Endpoint] = []
            broken: dict[str, str] = {}
            existing = [row["name"] for row in store.endpoints()]
            for name in existing if names is None else sorted(set(names) & set(existing)):
                try:
                    found += store.endpoint_configs((name,))
                except EndpointError as exc:
                    broken[name] = str(exc)
            return found, broken

        return await self._queue.call(each, keep_trying=self._keep_trying,
                                      on_busy=lambda _: self._on_busy())

    async def refresh(self) -> bool:
        """``load``, for a running dispatcher: False (logged) when the store
        could not be read; the routes it had stay as they were."""
        try:
            await self.load()
        except Busy:  # stopping, or the store stayed busy: the next refresh tries again
            return False
        except Exception as exc:
            log.warning("endpoints not refreshed: %s", " ".join(f"{type(exc).__name__}: "
                                                                f"{exc}".split()),
                        extra={"endpoints": len(self._routes)})
            return False
        return True

    async def run(self) -> None:
        """Refresh every ``refresh_s`` seconds, until cancelled: the routes,
        the circuits, and the summaries that are due."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
            await self.watch()
            self.summarize()

    # ------------------------------------------------------------ circuits

    async def watch(self) -> bool:
        """Read the circuits of the endpoints served, and log each change the
        breaker made since the last read (the first read logs only the
        circuits that are not closed, once). False (logged) when the store
        could not be read."""
        async with self._watching:  # one read at a time, each after the one before
            return await self._watch()

    async def _watch(self) -> bool:
        known = dict(self._signatures)
        names = self._names

        def read(store: Store) -> tuple[list[dict[str, Any]], dict[str, list], int]:
            rows = [row for row in store.endpoints() if names is None or row["name"] in names]
            audits = {row["name"]: store.endpoint_audit(row["name"]) for row in rows
                      if _signature(row) != known.get(row["name"])}
            return rows, audits, store.now_ms()

        try:
            rows, audits, now_ms = await self._queue.call(
                read, keep_trying=self._keep_trying, on_busy=lambda _: self._on_busy())
        except Busy:
            return False
        except Exception as exc:
            log.warning("circuits not read: %s", " ".join(f"{type(exc).__name__}: "
                                                         f"{exc}".split()),
                        extra={"owner": self.owner})
            return False
        self._apply_circuits(rows, audits, now_ms, first=not self.watches)
        self.watches += 1
        return True

    def _apply_circuits(self, rows: list[dict[str, Any]], audits: dict[str, list],
                        now_ms: int, *, first: bool) -> None:
        circuits: dict[str, dict[str, Any]] = {}
        for row in rows:
            name = row["name"]
            condition = condition_of(row, now_ms)
            circuits[name] = {**row["circuit"], "condition": condition,
                              "enabled": row["enabled"], "disabled_why": row["disabled_why"]}
            route = self._routes.get(name)
            if route is not None:
                self._know_circuit(route, row["circuit"], now_ms)
                before, route.condition = route.condition, condition
                if condition == CLOSED and before != CLOSED:
                    route.failing = 0
                    if route.summary.count:  # the outage's failures said before it ends
                        self._summarize(route, self._clock())
            if name in audits:
                self._signatures[name] = _signature(row)
                rows_seen = audits[name]
                told = self._audited.get(name)
                self._audited[name] = len(rows_seen)
                if first:
                    if condition != CLOSED:
                        self._tell_found(name, circuits[name])
                    continue
                new = rows_seen[told or 0:] if told is None or told <= len(rows_seen) else []
                changes = [one for one in new if one.get("actor") == BREAKER_ACTOR]
                for change in changes:
                    self._tell_change(name, change, circuits[name])
                if condition == HALF_OPEN and not changes:
                    self._tell(logging.INFO, name, "probing", "one delivery is sent as a "
                               "probe; its answer closes the circuit or opens it again",
                               circuits[name], circuits[name].get("since_ms"))
        for name in set(self._signatures) - set(circuits):
            del self._signatures[name]
            self._audited.pop(name, None)
        self.circuits, self.circuits_ms = circuits, now_ms

    def _know_circuit(self, route: Route, read: dict[str, Any], now_ms: int) -> None:
        """The circuit read from the store becomes the route's, unless a change
        of this dispatcher's own is not confirmed yet (the read may predate its
        finish); a route that may not send now is handed to ``on_held_back``."""
        if route.unconfirmed is None:
            route.circuit = Circuit(
                state=read.get("state") or CLOSED, since_ms=read.get("since_ms"),
                why=read.get("why"), failures=read.get("failures") or 0,
                open_until_ms=read.get("open_until_ms"),
                paused_until_ms=read.get("paused_until_ms"),
                failing_since_ms=read.get("failing_since_ms"))
        if not route.may_send(now_ms):
            self._on_held_back(route)

    def judged(self, route: Route, signal: str, seen: Attempt, now_ms: int,
               cause: object) -> bool:
        """One of this dispatcher's attempts judged (its ``signal_of``), before
        its finish is written: the route's circuit stepped by the store's own
        rule (``lease.breaker.step``). A failure, while the route could send,
        holds it back until the store has its word (``confirmed``, then a
        read): the failures of the other dispatchers may have opened the
        circuit already, or this one may, and a send begun before the read
        would reach an endpoint whose circuit is open. True then; ``cause``
        is what the read waits for."""
        circuit = route.circuit
        if signal == "success" and circuit.state == CLOSED and not circuit.failures \
                and circuit.window_ms is None:
            return False  # a healthy endpoint's delivery changes nothing: no step per job
        could = route.may_send(now_ms)
        route.circuit, _ = step(circuit, signal, seen, now_ms)
        if could and signal == "failure":
            route.unconfirmed = cause
            return True
        return False

    def confirmed(self, route: Route, cause: object) -> bool:
        """``cause``'s finish is recorded (or failed): the store now holds what
        it told the breaker, and the next read of the circuits is the
        route's again. True when a read should come at once."""
        if route.unconfirmed is not cause:
            return False
        route.unconfirmed = None
        return True

    def _tell_found(self, name: str, circuit: dict[str, Any]) -> None:
        why = circuit.get("disabled_why") if circuit["condition"] == DISABLED else None
        self._tell(logging.WARNING, name, f"found {circuit['condition']}",
                   why or circuit.get("why") or "", circuit, circuit.get("since_ms"))

    def _tell_change(self, name: str, change: dict[str, Any], circuit: dict[str, Any]) -> None:
        action = change["action"]
        level = logging.INFO if action == "closed" else (
            logging.ERROR if action == "disable" else logging.WARNING)
        said = {"opened": "circuit opened", "reopened": "circuit opened again",
                "closed": "circuit closed", "paused": "paused by a Retry-After",
                "disable": "disabled by the breaker"}.get(action, action)
        why = change.get("note") or ""
        paused, at_ms = circuit.get("paused_until_ms"), change.get("at_ms")
        if action == "paused" and paused is not None and at_ms is not None:
            why = f"no delivery sent for {max(0, paused - at_ms) // 1000} s" + (
                f", {why}" if why else "")
        self._tell(level, name, said, why, circuit, at_ms, action=action)

    def _tell(self, level: int, name: str, said: str, why: str, circuit: dict[str, Any],
              at_ms: int | None, action: str | None = None) -> None:
        """One line of a circuit's change: what, why (the evidence), and until when."""
        until = circuit.get("open_until_ms") if circuit["condition"] == OPEN else None
        if action == "paused":
            until = circuit.get("paused_until_ms")
        facts: dict[str, Any] = {"endpoint": name, "owner": self.owner,
                                 "action": action or said, "at_ms": at_ms,
                                 "circuit": circuit["condition"],
                                 "attempts_saved": circuit.get("attempts_saved")}
        if until is not None:
            facts["until_ms"] = until
        log.log(level, "endpoint %s: %s%s", name, said, f": {why}" if why else "", extra=facts)

    # ------------------------------------------------------------ failed attempts

    def failed(self, route: Route, seen: Attempt, job: str) -> bool:
        """A failed attempt of ``route``'s endpoint (the breaker's signal
        "failure"): True when it is counted in the endpoint's summary instead
        of logged on its own (``Route.quiet``); a summary that is due is logged."""
        route.failing += 1
        if not route.quiet:
            return False
        now = self._clock()
        route.summary.add(now, seen, job)
        if route.summary.due(now, self.summary_s):
            self._summarize(route, now)
        return True

    @staticmethod
    def answered(route: Route) -> None:
        """A delivery, or a refusal: the endpoint answered."""
        route.failing = 0

    def summarize(self, *, every: bool = False) -> None:
        """Log the summaries that are due (``every``: all that hold a count, at the end)."""
        now = self._clock()
        for route in list(self._routes.values()):
            if route.summary.count and (every or route.summary.due(now, self.summary_s)):
                self._summarize(route, now)

    def _summarize(self, route: Route, now: float) -> None:
        summary, route.summary = route.summary, FailureSummary()
        seconds = max(1, round(now - summary.first))
        last = summary.error or (f"HTTP {summary.http_status}" if summary.http_status
                                 else "no answer")
        facts: dict[str, Any] = {"endpoint": route.name, "owner": self.owner,
                                 "failed": summary.count, "seconds": seconds,
                                 "circuit": route.condition, "last_id": summary.job,
                                 "error": summary.error}
        if summary.http_status is not None:
            facts["http_status"] = summary.http_status
        log.warning("endpoint %s: %d attempt%s failed in the last %d s, last: %s", route.name,
                    summary.count, "" if summary.count == 1 else "s", seconds, last, extra=facts)

    def _apply(self, configs: list[Endpoint], broken: dict[str, str]) -> None:
        """The table read: new endpoints get a route, changed ones their new
        configuration, gone ones lose theirs. One that cannot be built keeps
        the configuration it had (if any), and is logged once until it can."""
        fresh = {endpoint.name: endpoint for endpoint in configs}
        for name, why in broken.items():
            if name not in self._broken_told:
                self._broken_told.add(name)
                log.warning("endpoint cannot be sent to: %s", why, extra={
                    "endpoint": name, "kept": name in self._routes})
        self._broken_told &= set(broken)
        for name, route in list(self._routes.items()):
            if name not in fresh and name not in broken:
                del self._routes[name]
                route.gone = True
                self._close_if_idle(route)
                log.info("endpoint gone", extra={"endpoint": name})
        for name, endpoint in fresh.items():
            known = self._routes.get(name)
            if known is None:
                self._routes[name] = Route(endpoint, WireClient(limit=self._pool_limit),
                                           self._figures_of(name))
                self._unknown_told.discard(name)
            elif known.endpoint != endpoint:
                known.endpoint = endpoint

    def tell_unknown(self, name: str | None) -> bool:
        """True the first time a delivery of ``name`` finds no route (log it then)."""
        key = name or ""
        if key in self._unknown_told:
            return False
        self._unknown_told.add(key)
        return True

    @property
    def missing(self) -> list[str]:
        """The names it serves that the queue has no endpoint of (yet)."""
        return [] if self._names is None else sorted(set(self._names) - set(self._routes))

    def sending(self, route: Route) -> None:
        if route.client.closed:  # a gone endpoint's pool, closed: a send claimed before
            route.client = WireClient(limit=self._pool_limit)
        route.sending += 1

    def sent(self, route: Route) -> None:
        route.sending -= 1
        if route.gone:
            self._close_if_idle(route)

    @staticmethod
    def _close_if_idle(route: Route) -> None:
        if not route.sending:
            route.client.close_now()  # nothing in flight on it: only idle connections go

    async def close(self) -> None:
        routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.gone = True
            route.client.close_now()
