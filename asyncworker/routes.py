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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from asyncworker.metrics import EndpointFigures
from asyncworker.store import AsyncStore
from asyncworker.wire import WireClient
from lease.endpoints import ALL, Endpoint, EndpointError
from lease.http import Destination
from lease.store import Store
from lease.worker import Busy

__all__ = ["EndpointRoutes", "Route"]

log = logging.getLogger("asyncworker.dispatcher")

REFRESH_S = 2.0  # how often a dispatcher reads its endpoints again


class Route:
    """One endpoint as the dispatcher sends to it. ``endpoint`` is replaced in
    place when a refresh finds it changed, so a delivery claimed before the
    change is sent with the newest configuration."""

    __slots__ = ("name", "endpoint", "client", "figures", "sending", "gone")

    def __init__(self, endpoint: Endpoint, client: WireClient,
                 figures: EndpointFigures) -> None:
        self.name = endpoint.name
        self.endpoint = endpoint
        self.client = client
        self.figures = figures
        self.sending = 0  # sends in flight on its pool
        self.gone = False  # no longer in the table: the pool closes after its last send

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
                 refresh_s: float = REFRESH_S) -> None:
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
        """Refresh every ``refresh_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

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
