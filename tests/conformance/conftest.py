"""The conformance suite's fixtures: every test runs once per store.

``store`` is an empty queue of one kind (``kind``: "sqlite", "sqlite-wal" (a
file in WAL mode), "postgresql", "postgresql-named" (the named queue
``orders`` of a database whose default queue holds live jobs of the ids the
tests use: each test then also proves that a named queue never reads or
changes its neighbour, checked after it), "sqlite-named" (the same beside a
file)),
``make_store`` opens more stores on that same queue (other connections,
other "hosts"), ``queues`` makes fresh empty queues of that kind (for
Hypothesis, one per example). Every store is opened with an injected clock,
``clock``, and every test passes ``now_ms=`` to every call anyway: both stores
judge by the same values, and a call that forgot its now_ms would read the
injected clock, not the machine's.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from asyncworker.devtools.postgres_server import drop_database, fresh_database
from lease.postgres import PostgresStore
from lease.rules import MAX_PAGE
from lease.sqlite import SQLiteStore
from lease.store import Store
from lease.stores import open_store
from tests.support.queues import T0

KINDS = ("sqlite", "sqlite-wal", "postgresql", "postgresql-named", "sqlite-named")
NAMED = "orders"  # the named kinds' queue
# The ids the tests give their jobs, live in the named kinds' default queue.
NEIGHBOUR_IDS = ("a", "b", "n", "x", "j", "k", "m", "old", "order:1", "order:2", "order:7",
                 "k-1", "k-2", "d-1", "p-1", "snack-1", *(f"j{n}" for n in range(20)),
                 *(f"m{n}" for n in range(20)))
NEIGHBOUR_LEASED = 10  # of them leased, the others pending


class ManualClock:
    """The store's clock in a test: the value the test last set."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def open_kind(kind: str, location: str, clock: Callable[[], int], *,
              create: bool = True) -> Store:
    """A store of ``kind`` on the queue at ``location`` (a path or a URL)."""
    if kind == "sqlite":
        return SQLiteStore(location, create=create, clock=clock)
    if kind == "sqlite-wal":
        return SQLiteStore(location, create=create, clock=clock, journal="wal")
    if kind == "sqlite-named":
        return open_store(location, create=create, clock=clock, queue=NAMED)
    if kind == "postgresql-named":
        return PostgresStore(location, create=create, clock=clock, queue=NAMED)
    return PostgresStore(location, create=create, clock=clock)


def _default_kind(kind: str) -> str:
    return kind.removesuffix("-named")


def _seed_neighbour(kind: str, location: str) -> None:
    """The default queue at ``location``, with live jobs of the tests' ids."""
    with contextlib.closing(open_kind(_default_kind(kind), location, ManualClock(T0))) as home:
        home.enqueue_events([{"id": job_id, "body": {"queue": "default"}}
                             for job_id in NEIGHBOUR_IDS], now_ms=T0)
        home.claim_jobs("neighbour", 3_600_000, NEIGHBOUR_LEASED, now_ms=T0)


def _neighbour(kind: str, location: str) -> tuple:
    """What the default queue holds: its jobs, its figures (attempts, audits,
    tallies) and its endpoints, read at one clock."""
    with contextlib.closing(open_kind(_default_kind(kind), location, ManualClock(T0),
                                      create=False)) as home:
        return home.list_jobs(limit=MAX_PAGE), home.snapshot(), home.endpoints()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def location(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where this test's queue lives: a file in tmp_path, or a fresh database."""
    if kind.startswith("sqlite"):
        return str(tmp_path / "q.db")
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def make_store(kind: str, location: str, clock: ManualClock) -> Iterator[Callable[..., Store]]:
    """Open another store on this test's queue (the first one creates it);
    every store is closed after the test. A named kind's neighbour, the
    default queue, is made first and checked unchanged after the test."""
    opened: list[Store] = []
    neighbour = None
    if kind.endswith("-named"):
        _seed_neighbour(kind, location)
        neighbour = _neighbour(kind, location)

    def make(*, clock: Callable[[], int] = clock) -> Store:
        store = open_kind(kind, location, clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
    if neighbour is not None:
        assert _neighbour(kind, location) == neighbour, "the default queue changed"


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    return make_store()


class Queues:
    """Fresh empty queues of one kind, each removed when its ``with`` ends."""

    def __init__(self, kind: str, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        self._request = request

    @contextlib.contextmanager
    def fresh(self, clock: Callable[[], int] | None = None) -> Iterator[Store]:
        clock = clock or ManualClock(T0)
        if self.kind.startswith("sqlite"):
            folder = tempfile.mkdtemp(prefix="conformance-")
            try:
                if self.kind.endswith("-named"):
                    _seed_neighbour(self.kind, f"{folder}/q.db")
                with contextlib.closing(open_kind(self.kind, f"{folder}/q.db", clock)) as store:
                    yield store
            finally:
                shutil.rmtree(folder)
            return
        yield from self._fresh_database(clock)

    def _fresh_database(self, clock: Callable[[], int]) -> Iterator[Store]:
        server = self._request.getfixturevalue("postgres_server")
        url = fresh_database(server.url)
        try:
            if self.kind.endswith("-named"):
                _seed_neighbour(self.kind, url)
            with contextlib.closing(open_kind(self.kind, url, clock)) as store:
                yield store
        finally:
            drop_database(url, admin_url=server.url)

    def settings(self, sqlite_examples: int, postgresql_examples: int, **more: object) -> settings:
        """Hypothesis settings for this kind: a PostgreSQL example costs a
        fresh database, so fewer of them keep the suite quick."""
        # a WAL file runs the same SQL as a rollback-journal file: fewer examples
        # prove its commits and reads keep the rules
        examples = {"sqlite": sqlite_examples, "sqlite-wal": max(5, sqlite_examples // 3),
                    "sqlite-named": max(5, sqlite_examples // 3),
                    "postgresql-named": max(3, postgresql_examples // 3),
                    }.get(self.kind, postgresql_examples)
        return settings(max_examples=examples, deadline=None, **more)  # type: ignore[arg-type]


@pytest.fixture
def queues(kind: str, request: pytest.FixtureRequest) -> Queues:
    return Queues(kind, request)
