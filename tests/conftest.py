"""Shared fixtures: real queue files in tmp_path, an injected clock, row snapshots.

The tests are in tiers, a folder each: unit/ (in-process, no server: seconds),
properties/ (random programs against a model, hypothesis),
conformance/ (one suite, every store), runtime/ (the dispatcher and the senders
against real servers on loopback, in-process), processes/ (real child processes,
killed for real), postgres/ (a real PostgreSQL server), soak/ (long chaos runs,
short by default) and browser/ (headless Chromium). Helpers two modules share
live in tests/support/, never imported from another test module."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from lease import worker
from lease.sqlite import open_store

# A real PostgreSQL server, started lazily by the suite (or TEST_DATABASE_URL):
# the fixtures postgres_server, postgres_url and make_postgres_server.
pytest_plugins = ["tests.support.postgres_server"]


@pytest.fixture
def queue_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
def con(queue_path: Path):
    connection = worker.open_queue(queue_path)
    yield connection
    connection.close()


@pytest.fixture
def queue(tmp_path: Path) -> Path:
    """A product queue file, made and closed: for tests that drive the CLI."""
    path = tmp_path / "queue.db"
    open_store(path).close()
    return path


@pytest.fixture(params=["sync", "async", "aiohttp"])
def send(request: pytest.FixtureRequest) -> Callable[..., Awaitable[object]]:
    """Each sender (sync; async on its own client; async on a caller's aiohttp
    session), as an awaitable taking a destination (a lab URL or a
    Destination) first: ``await send(destination, event, timeout=...)``. The
    lab sender's own tests (test_sender*.py) keep fixtures of their own shape."""
    from asyncworker import new_session
    from asyncworker import send_http as async_send
    from lease import http as sync_http

    if request.param == "async":
        return async_send
    if request.param == "aiohttp":  # the async sender on a caller's aiohttp session
        async def via_aiohttp(destination: object, event: dict, **kwargs: object) -> object:
            async with new_session() as session:
                return await async_send(destination, event, session=session, **kwargs)

        return via_aiohttp

    async def via_thread(destination: object, event: dict, **kwargs: object) -> object:
        return await asyncio.to_thread(sync_http.send_http, destination, event, **kwargs)

    return via_thread


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "the chaos soak (tests/soak/test_soak.py)")
    group.addoption("--soak-jobs", type=int, default=1000,
                    help="jobs in the chaos soak (default 1000: the short CI run)")
    group.addoption("--soak-seconds", type=float, default=None,
                    help="seconds of chaos in the PostgreSQL soak (default 25: the short run)")
    group.addoption("--soak-seed", type=int, default=20261129, help="seed of the chaos")


_SERVER_FIXTURES = {"postgres_server", "postgres_url", "make_postgres_server"}


def _needs_postgres(item: pytest.Item) -> bool:
    """A test that starts or uses a PostgreSQL server: by its fixtures, or by a
    store parameter that names PostgreSQL (fixtures that ask for the server only
    when their parameter says so)."""
    if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(v, str) and v.startswith("postgres") for v in params.values())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The markers follow what a test needs: ``-m 'not postgres'`` leaves out
    every test that needs a PostgreSQL server, ``-m browser`` keeps only
    Chromium's, ``-m soak`` only the chaos runs (by their folder)."""
    for item in items:
        parts = Path(str(item.path)).parts
        if _needs_postgres(item) or "postgres" in parts:
            item.add_marker(pytest.mark.postgres)
        if "soak" in parts:
            item.add_marker(pytest.mark.soak)
        if "browser" in parts:
            item.add_marker(pytest.mark.browser)
