"""The suite's PostgreSQL fixtures, on the launcher
``asyncworker.devtools.postgres_server`` (a real server started from the
machine's binaries). ``TEST_DATABASE_URL`` points the suite at an existing
server instead.

- ``postgres_server``: one per run, started only when a test asks.
- ``postgres_url``: a fresh database per test, dropped after it.
- ``make_postgres_server``: servers a test owns (restarts, crashes, durable
  settings).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest

from asyncworker.devtools.postgres_server import (
    ExternalServer,
    PostgresServer,
    Server,
    drop_database,
    fresh_database,
)

# --- fixtures -------------------------------------------------------------------------

@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Server]:
    """One server for the whole run, started when the first test asks for it;
    with TEST_DATABASE_URL set, that server, and nothing is started."""
    external = os.environ.get("TEST_DATABASE_URL")
    if external:
        yield ExternalServer(external)
        return
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: Server) -> Iterator[str]:
    """A fresh empty database of this test's own; dropped after it."""
    url = fresh_database(postgres_server.url)
    yield url
    drop_database(url, admin_url=postgres_server.url)


@pytest.fixture
def make_postgres_server() -> Iterator[Callable[..., PostgresServer]]:
    """Start servers this test owns (PostgresServer's options), closed after it:
    for restarts, crashes and durable settings, which a shared server cannot take."""
    with contextlib.ExitStack() as servers:
        yield lambda **options: servers.enter_context(PostgresServer(**options))
