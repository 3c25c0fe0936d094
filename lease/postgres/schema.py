"""The PostgreSQL driver's schema: versions, migrations, connections, errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool
from psycopg import errors

from lease.postgres.queues import CHANNEL, MIGRATION_LOCK, SCHEMA, Queue
from lease.postgres.statements import DUE_LINE, LINE
from lease.queues import split_url
from lease.rules import (
    TABLES_PG4,
    TABLES_PG5,
    TABLES_PG6,
    TABLES_PG7,
    TABLES_V1,
    TABLES_V2,
    TABLES_V3,
)
from lease.worker import (
    CONTRACT_COLUMNS,
    Busy,
    NotAQueue,
    StoreError,
)

SCHEMA_VERSION = 9
CONSOLE_SINCE = 5  # the version with the pause, its audit and the workers (lease.rules)
ROLLUP_SINCE = 6  # the version with the per-minute rollup of the finishes (lease.rules)
PRIORITY_SINCE = 7  # the version with each job's priority (lease.policy.check_priority)
DUE_SINCE = 8  # the version whose own pick reads its due jobs apart from its leases
FLIGHT_SINCE = 9  # the version whose deliveries' leases are read in the claim's order
SECRET_TABLES = ("endpoints",)  # rows a server's error message must not show

# CHANNEL is NOTIFY'd when work becomes available. MIGRATION_LOCK, the
# pg_advisory_xact_lock key of the migrations: two hosts opening a new database
# at once wait for each other and migrate it once. A named queue has its own
# of each (lease.postgres.queues).
__all__ = ["CHANNEL", "SCHEMA", "SCHEMA_VERSION", "connect", "migrate", "redact"]

# A statement is prepared on a connection after its 5th run: the claim and the
# finish run thousands of times, and every statement here has a constant text
# (arrays, never IN lists of varying length), so each connection prepares a few.
PREPARE_THRESHOLD = 5
CONNECT_TIMEOUT_S = 10
INTAKE_CHUNK = 500  # events per INSERT: bounded memory for a stream of millions

NOW = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"

# The tables each version has: the SQLite product file's of that version,
# column for column. SQLite's version 4 moved the bodies to a table of their
# own; PostgreSQL needs no such move: an UPDATE keeps a large body where TOAST
# put it, out of the row, and does not write it again.
# Version 4: endpoints as data (lease.endpoints); a job of the queue's own has
# NULL in the four new columns of jobs.
TABLES = {1: {**TABLES_V1, "redrives": CONTRACT_COLUMNS["redrives"]}, 2: TABLES_V2,
          3: TABLES_V3, 4: TABLES_PG4, CONSOLE_SINCE: TABLES_PG5,
          ROLLUP_SINCE: TABLES_PG6, PRIORITY_SINCE: TABLES_PG7,
          DUE_SINCE: TABLES_PG7, FLIGHT_SINCE: TABLES_PG7}  # 8 and 9 changed indexes only

MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        # The SQLite product file's tables, column for column and in its order.
        """CREATE TABLE lease.jobs (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id text NOT NULL UNIQUE, qty bigint NOT NULL,
  status text NOT NULL CHECK (status IN ('pending', 'leased', 'done', 'dead')),
  attempts bigint NOT NULL, max_attempts bigint NOT NULL, token bigint NOT NULL,
  available_at bigint NOT NULL, deadline bigint NOT NULL,
  owner text, lease_until bigint, reason text, body text, digest text,
  done_by text, done_started_ms bigint, done_latency_ms bigint, done_http_status bigint,
  done_after bigint)""",
        """CREATE TABLE lease.redrives (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id text NOT NULL, token bigint NOT NULL, at_ms bigint NOT NULL, note text NOT NULL)""",
        """CREATE TABLE lease.attempts (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id text NOT NULL, token bigint NOT NULL, attempt bigint NOT NULL, owner text NOT NULL,
  started_ms bigint NOT NULL, ended_ms bigint NOT NULL, outcome text NOT NULL,
  result text NOT NULL, reason text, http_status bigint, error text, latency_ms bigint)""",
        """CREATE TABLE lease.cancels (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id text NOT NULL, token bigint NOT NULL, at_ms bigint NOT NULL, note text NOT NULL,
  was text NOT NULL)""",
        "CREATE TABLE lease.tallies (name text PRIMARY KEY, n bigint NOT NULL)",
        # Partial indexes, so a claim reads only the rows it may change however
        # many finished rows pile up: live rows in seq order (the pick), live by
        # deadline and leased by lease end (the quarantine), pending with a spent
        # budget (empty through the API), done by finish time (prune).
        "CREATE INDEX jobs_live ON lease.jobs (seq) WHERE status IN ('pending', 'leased')",
        """CREATE INDEX jobs_live_deadline ON lease.jobs (deadline)
  WHERE status IN ('pending', 'leased')""",
        "CREATE INDEX jobs_leased_until ON lease.jobs (lease_until) WHERE status = 'leased'",
        """CREATE INDEX jobs_pending_spent ON lease.jobs (seq)
  WHERE status = 'pending' AND attempts >= max_attempts""",
        "CREATE INDEX jobs_done_at ON lease.jobs (available_at, seq) WHERE status = 'done'",
        # A job's audit rows, read by its history and deleted with it by prune.
        "CREATE INDEX attempts_by_job ON lease.attempts (id, seq)",
        "CREATE INDEX redrives_by_job ON lease.redrives (id)",
        "CREATE INDEX cancels_by_job ON lease.cancels (id)",
    ),
    2: (
        # Who made an operator's change (a name, a token's label); NULL when not said.
        "ALTER TABLE lease.redrives ADD COLUMN actor text",
        "ALTER TABLE lease.cancels ADD COLUMN actor text",
    ),
    3: (
        "ALTER TABLE lease.jobs ADD COLUMN ordering_key text",  # NULL: no order to keep
        # 1 while an earlier job of its key is in line (lease.sqlite, "Ordered keys")
        "ALTER TABLE lease.jobs ADD COLUMN held bigint NOT NULL DEFAULT 0",
        # What a claim may take, in seq order; a key's line, its first apart.
        """CREATE INDEX jobs_ready ON lease.jobs (seq)
  WHERE status IN ('pending', 'leased') AND held = 0""",
        "CREATE INDEX jobs_line ON lease.jobs (ordering_key, held, seq) WHERE "
        + LINE.format(a="jobs").replace("jobs.", ""),
    ),
    4: (
        # NULL for a job of the queue's own; a delivery's endpoint, its message's
        # id, the event's type (every job's, NULL when none). Columns without a
        # default: adding them rewrites no row.
        "ALTER TABLE lease.jobs ADD COLUMN endpoint text",
        "ALTER TABLE lease.jobs ADD COLUMN message text",
        "ALTER TABLE lease.jobs ADD COLUMN event_type text",
        # secrets and headers are secrets: no read selects them but
        # endpoint_configs, for the dispatcher that signs with them.
        """CREATE TABLE lease.endpoints (name text PRIMARY KEY, url text NOT NULL,
  ack text NOT NULL, ca_file text, secrets jsonb NOT NULL, headers jsonb NOT NULL,
  types jsonb NOT NULL, max_in_flight bigint, rate double precision, burst bigint,
  insecure_http boolean NOT NULL, enabled boolean NOT NULL,
  tokens double precision NOT NULL, refilled_ms bigint NOT NULL,
  has_work bigint NOT NULL DEFAULT 0, served_at bigint NOT NULL DEFAULT 0,
  created_ms bigint NOT NULL, updated_ms bigint NOT NULL,
  circuit text NOT NULL DEFAULT 'closed', circuit_since_ms bigint, circuit_why text,
  failures bigint NOT NULL DEFAULT 0, window_ms bigint,
  window_failed bigint NOT NULL DEFAULT 0, window_total bigint NOT NULL DEFAULT 0,
  open_until_ms bigint, cooldown_ms bigint NOT NULL DEFAULT 0, paused_until_ms bigint,
  failing_since_ms bigint, disable_after_ms bigint, disabled_why text,
  saved bigint NOT NULL DEFAULT 0)""",
        # action: an operator's (add, update, disable, enable, remove) or the
        # breaker's (opened, reopened, closed, paused, disable); fields: the
        # NAMES of the fields changed, never their values
        """CREATE TABLE lease.endpoint_audit (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  endpoint text NOT NULL, at_ms bigint NOT NULL,
  action text NOT NULL,
  fields jsonb NOT NULL, note text, actor text)""",
        # The queue's own pick reads no delivery (an own claim never takes one).
        "DROP INDEX lease.jobs_ready",
        """CREATE INDEX jobs_ready ON lease.jobs (seq)
  WHERE status IN ('pending', 'leased') AND held = 0 AND endpoint IS NULL""",
        # An endpoint's due deliveries, in the order they became due, and its
        # leases (live and run out): each one index range per endpoint.
        f"CREATE INDEX jobs_endpoint_due ON lease.jobs (endpoint, available_at, seq)"
        f" WHERE {DUE_LINE}",
        """CREATE INDEX jobs_in_flight ON lease.jobs (endpoint, lease_until)
  WHERE status = 'leased' AND endpoint IS NOT NULL""",
        # The rotation: the endpoints with work, the least recently served first.
        """CREATE INDEX endpoints_rotation ON lease.endpoints (served_at, name)
  WHERE has_work = 1 AND enabled""",
        "CREATE INDEX jobs_by_message ON lease.jobs (message) WHERE message IS NOT NULL",
        """CREATE INDEX jobs_by_endpoint ON lease.jobs (endpoint, status)
  WHERE endpoint IS NOT NULL""",
    ),
    CONSOLE_SINCE: (
        # The W3C trace context its intake ran in; NULL: none. Without a
        # default: adding it rewrites no row.
        "ALTER TABLE lease.jobs ADD COLUMN trace text",
        # One row while the queue is paused: every claim reads this tiny table.
        """CREATE TABLE lease.pause (id bigint PRIMARY KEY CHECK (id = 1),
  since_ms bigint NOT NULL, actor text, note text NOT NULL)""",
        """CREATE TABLE lease.queue_audit (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  at_ms bigint NOT NULL, action text NOT NULL, note text NOT NULL, actor text)""",
        # A dispatcher at work: host and pid from its registration, the last
        # claim from each claim that names it (one UPSERT a claim, in the
        # statement that leases).
        """CREATE TABLE lease.workers (owner text PRIMARY KEY, host text, pid bigint,
  started_ms bigint, last_claim_ms bigint, last_claimed bigint NOT NULL DEFAULT 0)""",
    ),
    ROLLUP_SINCE: (
        # The finishes per minute, endpoint ('' for the queue's own jobs) and
        # owner, and their send latencies in fixed buckets (lease.rules).
        """CREATE TABLE lease.minutes (minute_ms bigint NOT NULL, endpoint text NOT NULL,
  owner text NOT NULL, done bigint NOT NULL, retried bigint NOT NULL, dead bigint NOT NULL,
  b0 bigint NOT NULL,
  b1 bigint NOT NULL,
  b2 bigint NOT NULL,
  b3 bigint NOT NULL,
  b4 bigint NOT NULL,
  b5 bigint NOT NULL,
  b6 bigint NOT NULL,
  b7 bigint NOT NULL,
  b8 bigint NOT NULL,
  b9 bigint NOT NULL,
  b10 bigint NOT NULL,
  b11 bigint NOT NULL,
  b12 bigint NOT NULL,
  b13 bigint NOT NULL,
  b14 bigint NOT NULL,
  b15 bigint NOT NULL, PRIMARY KEY (minute_ms, endpoint, owner))""",
    ),
    PRIORITY_SINCE: (
        # Higher is claimed first; the jobs written before are all 0. A
        # constant default: adding the column rewrites no row.
        "ALTER TABLE lease.jobs ADD COLUMN priority smallint NOT NULL DEFAULT 0",
        # The claim's two indexes lead with it, so each claim still reads its
        # rows in the order it takes them (an index scan that stops at the batch).
        "DROP INDEX lease.jobs_ready",
        """CREATE INDEX jobs_ready ON lease.jobs (priority DESC, seq)
  WHERE status IN ('pending', 'leased') AND held = 0 AND endpoint IS NULL""",
        "DROP INDEX lease.jobs_endpoint_due",
        "CREATE INDEX jobs_endpoint_due ON lease.jobs (endpoint, priority DESC, available_at,"
        f" seq) WHERE {DUE_LINE}",
    ),
    DUE_SINCE: (
        # The queue's own pending jobs apart from its leases, as an endpoint's
        # due deliveries are: a pick read every live lease at the front of
        # jobs_ready (the oldest seqs) before it came to a due job, a heap
        # fetch each, and every lease wrote a new entry in it (a leased row
        # version met its terms). The leases run out are read by
        # jobs_leased_until.
        "DROP INDEX lease.jobs_ready",
        """CREATE INDEX jobs_own_due ON lease.jobs (priority DESC, seq)
  WHERE status = 'pending' AND held = 0 AND endpoint IS NULL""",
        # The jobs with an ordering key, by id: a finish locks the keys of its
        # jobs' lines (LOCK_KEYS_OF) before their rows, and found them by the
        # id of every job it finished, keyed or not, each id's every version
        # (a lease and a finish each leave one in jobs_id_key).
        "CREATE INDEX jobs_keyed ON lease.jobs (id) WHERE ordering_key IS NOT NULL",
    ),
    FLIGHT_SINCE: (
        # An endpoint's leases by lease end and then seq, the order in which
        # a claim takes the ones run out (TAKE_DUE): the claim locks them as
        # its scan reads them, and a scan that must sort first (lease end
        # alone) lost, on the planner's costs, to reading every endpoint's
        # leases run out through jobs_leased_until, once per endpoint.
        "DROP INDEX lease.jobs_in_flight",
        """CREATE INDEX jobs_in_flight ON lease.jobs (endpoint, lease_until, seq)
  WHERE status = 'leased' AND endpoint IS NOT NULL""",
    ),
}


# ------------------------------------------------------------------ errors


def redact(url: str) -> str:
    """The URL without its password (in the userinfo or as a query parameter);
    a queue it names shown after it (`` queue orders``)."""
    try:
        url, name = split_url(url)
    except ValueError:  # shown as it is: the open refuses it with the reason
        name = None
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.partition(':')[0]}{at}{hosts}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                       if k != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment)) \
        + Queue(name).suffix


def no_queue(name: str) -> NotAQueue:
    return NotAQueue(f"no queue in {name}: asyncworker init {name} creates it")


def _store_error(exc: psycopg.Error, name: str) -> StoreError:
    """psycopg's errors in the store's words (see ``PostgresStore._tx``)."""
    if isinstance(exc, psycopg_pool.PoolClosed):
        return StoreError(f"the store of {name} is closed")
    if isinstance(exc, (errors.SerializationFailure, errors.DeadlockDetected,
                        errors.LockNotAvailable)):
        return Busy(f"PostgreSQL queue {name}: {_one_line(exc)}")
    if isinstance(exc, (errors.UndefinedTable, errors.InvalidSchemaName)):
        return no_queue(name)
    # A lost connection (the server restarted or terminated it, the network
    # dropped, the pool found none in time) is an OperationalError; so are
    # AdminShutdown and a statement cancelled by a timeout.
    if isinstance(exc, psycopg.OperationalError):
        return Busy(f"PostgreSQL queue {name}: connection lost: {_one_line(exc)}")
    return StoreError(f"PostgreSQL queue {name}: {_without_secrets(exc)}")


def _without_secrets(exc: psycopg.Error) -> str:
    """The server's message; of an endpoint's row, without its DETAIL: a
    "Failing row contains (...)" there would show its secrets and headers."""
    if exc.diag.table_name in SECRET_TABLES:
        return _one_line(exc.diag.message_primary or type(exc).__name__)
    return _one_line(exc)


@contextmanager
def mapped(name: str) -> Iterator[None]:
    try:
        yield
    except psycopg.Error as exc:
        raise _store_error(exc, name) from exc


def _one_line(exc: BaseException | str) -> str:
    """A server's message on one line (libpq adds hints on lines of their own)."""
    return " ".join(str(exc).split())


def connect(url: str, name: str, **kwargs: Any) -> psycopg.Connection:
    """One autocommit connection, or a clear StoreError naming the URL without
    its password."""
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                               **kwargs)
    except psycopg.Error as exc:
        if _server_down(exc):  # a pause may cure it: a dispatcher waits (AsyncStore)
            raise Busy(f"cannot connect to {name}: {_one_line(exc)}") from None
        raise StoreError(f"cannot connect to {name}: {_one_line(exc)}") from None


def _server_down(exc: psycopg.Error) -> bool:
    """The server refuses connections for now (not listening, starting up,
    shutting down, in recovery): not a wrong password, host or database name."""
    text = str(exc)
    return (getattr(exc, "sqlstate", None) == "57P03"  # cannot_connect_now
            or "Connection refused" in text or "the database system is" in text)


# ------------------------------------------------------------------ migrations


def queue_version(conn: psycopg.Connection) -> int | None:
    """The queue's schema version; None for a database without one."""
    found = conn.execute("SELECT to_regclass('lease.schema_migrations')").fetchone()
    if found is None or found[0] is None:
        return None
    row = conn.execute("SELECT max(version) FROM lease.schema_migrations").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def check_version(version: int | None, name: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise NotAQueue(f"the queue in {name} has schema version {version}, newer than this "
                        f"code's {SCHEMA_VERSION}: open it with a newer lease-dispatcher")


def migrate(conn: psycopg.Connection, name: str, lock: int = MIGRATION_LOCK) -> None:
    """The migrations still missing, each in one transaction under the
    advisory lock (the queue's: ``Queue.migration_lock``); another host may
    have applied them meanwhile."""
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))
            conn.execute("CREATE SCHEMA IF NOT EXISTS lease")
            conn.execute("""CREATE TABLE IF NOT EXISTS lease.schema_migrations
  (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())""")
            version = queue_version(conn) or 0
            check_version(version, name)
            if version == SCHEMA_VERSION:
                return
            try:
                for statement in MIGRATIONS[version + 1]:
                    conn.execute(statement)
            except errors.DuplicateTable as exc:
                raise NotAQueue(f"not a queue: {name} holds other tables in schema lease "
                                f"({_one_line(exc)})") from None
            conn.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)",
                         (version + 1,))


def check_tables(conn: psycopg.Connection, name: str, version: int) -> None:
    found: dict[str, list[str]] = {}
    for table, column in conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = 'lease' ORDER BY table_name, ordinal_position"):
        found.setdefault(table, []).append(column)
    for table, columns in TABLES[version].items():
        if found.get(table) != columns:
            raise NotAQueue(f"not a version {version} queue: {name} has table "
                            f"lease.{table} with columns {found.get(table, [])}")


