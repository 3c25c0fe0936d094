"""A named queue's schema, channel and locks in one PostgreSQL database.

Every statement of this driver is written for the default queue, schema
``lease``. A named queue's connections get a cursor class whose every
statement goes through ``in_schema`` first (cached: each text is rewritten
once), so the statements stay written once; the default queue's connections
get no such class, and pay nothing.
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Iterable
from typing import Any, ClassVar

import psycopg
from psycopg.abc import Params

from lease.postgres.statements import KEY_LOCK
from lease.queues import DEFAULT, check_queue_name

__all__ = ["Queue", "in_schema", "queue_names"]

SCHEMA = "lease"
CHANNEL = "lease_jobs"
MIGRATION_LOCK = 0x6C65617365  # "lease" in ASCII: the default queue's migrations

_QUALIFIED = re.compile(r"\blease\.")  # a table, an index: lease.jobs, 'lease.x' in to_regclass
_LITERAL = re.compile(r"'lease'")  # information_schema's table_schema = 'lease'
_CREATE = re.compile(r"\bSCHEMA IF NOT EXISTS lease\b")
_KEY_LOCK = re.compile(rf"\bpg_advisory_xact_lock\({KEY_LOCK},")


def _crc(schema: str) -> int:
    return zlib.crc32(schema.encode())


def key_lock(schema: str) -> int:
    """The first int of a queue's key locks (two-int form): the default's
    for ``lease``, another for each named queue's schema, so one queue's
    ordered keys never wait for another's with the same key."""
    if schema == SCHEMA:
        return KEY_LOCK
    derived = _crc(schema) & 0x7FFFFFFF
    return derived if derived != KEY_LOCK else derived ^ 1


def migration_lock(schema: str) -> int:
    """A queue's migration lock (one-bigint form): the default's for
    ``lease``; with bit 62 set for a named queue, so never the default's."""
    if schema == SCHEMA:
        return MIGRATION_LOCK
    return (1 << 62) | ((_crc(schema) & 0x3FFFFF) << 40) | MIGRATION_LOCK


@functools.lru_cache(maxsize=4096)
def in_schema(query: str, schema: str) -> str:
    """``query`` (written for schema ``lease``) for the queue in ``schema``:
    every ``lease.`` qualifier, the schema's name as a literal, its creation
    and the key locks' first int. Column names (``lease_until``) and words
    (``'leased'``) are left alone."""
    if schema == SCHEMA:
        return query
    query = _QUALIFIED.sub(f"{schema}.", query)
    query = _LITERAL.sub(f"'{schema}'", query)
    query = _CREATE.sub(f"SCHEMA IF NOT EXISTS {schema}", query)
    return _KEY_LOCK.sub(f"pg_advisory_xact_lock({key_lock(schema)},", query)


class _SchemaCursor(psycopg.Cursor[Any]):
    """A cursor whose statements are rewritten for ``schema``."""

    schema: ClassVar[str] = SCHEMA

    def execute(self, query: Any, params: Params | None = None, *,
                prepare: bool | None = None, binary: bool | None = None) -> Any:
        if isinstance(query, str):
            query = in_schema(query, self.schema)
        return super().execute(query, params, prepare=prepare, binary=binary)

    def executemany(self, query: Any, params_seq: Iterable[Params], *,
                    returning: bool = False) -> None:
        if isinstance(query, str):
            query = in_schema(query, self.schema)
        super().executemany(query, params_seq, returning=returning)


@functools.lru_cache(maxsize=64)
def _cursor_class(schema: str) -> type[psycopg.Cursor[Any]]:
    return type(f"SchemaCursor_{schema}", (_SchemaCursor,), {"schema": schema})


class Queue:
    """Where one queue lives in a database: its schema, its NOTIFY channel,
    its locks, and what its connections need (nothing for the default)."""

    def __init__(self, name: str | None) -> None:
        self.name = check_queue_name(name)
        self.schema = SCHEMA if self.name is None else f"{SCHEMA}_{self.name}"
        # NOTIFY is per database: a channel per queue wakes only its dispatchers
        self.channel = CHANNEL if self.name is None else f"{CHANNEL}_{self.name}"
        self.migration_lock = migration_lock(self.schema)

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """psycopg.connect's (and the pool's) arguments for this queue."""
        if self.name is None:
            return {}
        return {"cursor_factory": _cursor_class(self.schema)}

    def cursor(self, conn: psycopg.Connection, **kwargs: Any) -> psycopg.Cursor[Any]:
        """A cursor of this queue on a connection that is not the store's own
        (a service's, for ``enqueue_in``)."""
        if self.name is None:
            return conn.cursor(**kwargs)
        return _cursor_class(self.schema)(conn, **kwargs)

    @property
    def suffix(self) -> str:
        """What a shown URL adds for this queue."""
        return "" if self.name is None else f" queue {self.name}"


# From the catalogs, which every role may read: to_regclass would fail on a
# schema the role has no USAGE of (another queue's, say).
LIST_SCHEMAS = """SELECT n.nspname FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid
  WHERE (n.nspname = 'lease' OR n.nspname LIKE 'lease\\_%')
  AND c.relname = 'schema_migrations' AND c.relkind IN ('r', 'p')"""


def queue_names(conn: psycopg.Connection) -> list[str]:
    """The queues in a database (schemas ``lease`` and ``lease_NAME`` with a
    ``schema_migrations`` table), the default one named ``default``, first."""
    names: list[str] = []
    for (schema,) in conn.execute(LIST_SCHEMAS):
        if schema == SCHEMA:
            names.append(DEFAULT)
            continue
        name = schema[len(SCHEMA) + 1:]
        try:
            if check_queue_name(name) is not None:
                names.append(name)
        except ValueError:  # a schema of that shape that no queue name makes
            continue
    return sorted(names, key=lambda name: (name != DEFAULT, name))
