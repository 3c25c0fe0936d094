"""The product's PostgreSQL queue: many hosts, one database, the same rules.

``PostgresStore`` implements ``lease.store.Store`` on psycopg 3 with a
connection pool, for the same results as ``lease.sqlite.SQLiteStore`` row for
row. The rules are not here: every argument goes through the validators of
``lease.worker``/``lease.policy``/``lease.sqlite``, every verdict through
``finish_decision`` and ``_marker_matches``, every refusal through the same
decision functions. What is here is how PostgreSQL's rows are locked, read and
written so that, at READ COMMITTED with many writers at once, no interleaving
of transactions can let a stale ticket win:

- a claim picks with ``FOR UPDATE SKIP LOCKED`` inside a CTE: it never blocks
  on or deadlocks with another claimer, and the planner cannot update more
  rows than the limit;
- an extension or a finish locks its rows (``FOR UPDATE``, in seq order, so two
  of them never deadlock), judges them in Python by the rules, and then every
  UPDATE carries the whole marker in its WHERE and checks its row count;
- time is the database server's clock, read inside the transaction as its
  first statement, so hosts whose clocks are skewed cannot steal or keep a
  lease (``clock=`` injects another, for tests).

Ordered keys (``lease.sqlite``, "Ordered keys"): the same ``held`` mark on
the first job of each key's line, moved by the same transactions. Here many
writers run at once, so every transaction that moves a mark (an intake, a
finish, a redrive, a cancel) first takes a transaction-level advisory lock
on each of its keys, in one order, before it locks any row: two of them on
one key run one after the other and see each other's rows. A claim takes no
key lock: it only leases marked jobs, and the one move of a mark away from a
job a claim could take (a cancelled job redriven to its place) locks that job
first (FOR UPDATE), so a claim in flight either committed (and the redrive
sees it) or skips it.

A service enqueues inside its own transaction with ``enqueue_in`` (the
transactional outbox): on its own psycopg connection, the server's clock, the
NOTIFY delivered at the service's COMMIT.

The tables live in a schema of their own (``lease``), so a service's own
``jobs`` table cannot collide; they have the SQLite product file's columns in
its order. Versioned migrations (``lease.schema_migrations``) each run in one
transaction under an advisory lock: two hosts starting at once migrate once.
"""

from __future__ import annotations

import itertools
import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Union
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool
from psycopg import errors, pq
from psycopg.rows import dict_row, tuple_row

from lease.observe import (
    BLOCKED_HEADS,
    BLOCKED_JOBS,
    BLOCKED_KEYS,
    DAY_MS,
    IDLE,
    STATUSES,
    _job_filter,
)
from lease.policy import (
    DEFAULT_POLICY,
    PRODUCT,
    Intake,
    RetryPolicy,
    check_actor,
    check_not_before,
    check_note,
    check_ordering_key,
    check_product_event,
)
from lease.records import MAX_ERROR_CHARS, Claimed, Leased, check_on_conflict, judge_intake
from lease.sqlite import (
    _TABLES_V1,
    _TABLES_V2,
    _TABLES_V3,
    _cancel_decisions,
    _check_ids,
    _check_item,
    _conflict,
    _in_flight_refusals,
    _kept_audits,
)
from lease.worker import (
    _COLUMNS,
    _MARKED,
    MAX_BATCH,
    Busy,
    Conflict,
    Fault,
    NotAQueue,
    StoreError,
    _call,
    _check_fault,
    _check_int,
    _marker_matches,
    _redrive_decisions,
    check_identifier,
    check_job_id,
    check_now,
    check_ticket,
    finish_decision,
)

__all__ = ["CHANNEL", "SCHEMA", "SCHEMA_VERSION", "Listener", "PostgresStore", "enqueue_in",
           "redact"]

SCHEMA = "lease"
SCHEMA_VERSION = 3
CHANNEL = "lease_jobs"  # NOTIFY'd when work becomes available

# pg_advisory_xact_lock key of the migrations ("lease" in ASCII): two hosts
# opening a new database at once wait for each other and migrate it once.
_MIGRATION_LOCK = 0x6C65617365

# A statement is prepared on a connection after its 5th run: the claim and the
# finish run thousands of times, and every statement here has a constant text
# (arrays, never IN lists of varying length), so each connection prepares a few.
_PREPARE_THRESHOLD = 5
_CONNECT_TIMEOUT_S = 10
_INTAKE_CHUNK = 500  # events per INSERT: bounded memory for a stream of millions

_NOW = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"

# The tables each version has: the SQLite product file's of that version,
# column for column. SQLite's version 4 moved the bodies to a table of their
# own; PostgreSQL needs no such move: an UPDATE keeps a large body where TOAST
# put it, out of the row, and does not write it again.
_TABLES = {1: {**_TABLES_V1, "redrives": _COLUMNS["redrives"]}, 2: _TABLES_V2,
           3: _TABLES_V3}

# A job in its key's line (lease.sqlite._LINE), and the classid of the keys'
# advisory locks ("ke"; the two-int form, a key space apart from the one-int
# form of the migrations' lock).
_LINE = ("{a}.ordering_key IS NOT NULL AND ({a}.status IN ('pending', 'leased')"
         " OR ({a}.status = 'dead' AND {a}.reason <> 'cancelled'))")
_KEY_LOCK = 0x6B65

_MIGRATIONS: dict[int, tuple[str, ...]] = {
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
        + _LINE.format(a="jobs").replace("jobs.", ""),
    ),
}


# ------------------------------------------------------------------ errors


def redact(url: str) -> str:
    """The URL without its password (in the userinfo or as a query parameter)."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.partition(':')[0]}{at}{hosts}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                       if k != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _no_queue(name: str) -> NotAQueue:
    return NotAQueue(f"no queue in {name}: asyncworker init {name} creates it")


def _store_error(exc: psycopg.Error, name: str) -> StoreError:
    """psycopg's errors in the store's words (see ``PostgresStore._tx``)."""
    if isinstance(exc, psycopg_pool.PoolClosed):
        return StoreError(f"the store of {name} is closed")
    if isinstance(exc, (errors.SerializationFailure, errors.DeadlockDetected,
                        errors.LockNotAvailable)):
        return Busy(f"PostgreSQL queue {name}: {_one_line(exc)}")
    if isinstance(exc, (errors.UndefinedTable, errors.InvalidSchemaName)):
        return _no_queue(name)
    # A lost connection (the server restarted or terminated it, the network
    # dropped, the pool found none in time) is an OperationalError; so are
    # AdminShutdown and a statement cancelled by a timeout.
    if isinstance(exc, psycopg.OperationalError):
        return Busy(f"PostgreSQL queue {name}: connection lost: {_one_line(exc)}")
    return StoreError(f"PostgreSQL queue {name}: {_one_line(exc)}")


@contextmanager
def _mapped(name: str) -> Iterator[None]:
    try:
        yield
    except psycopg.Error as exc:
        raise _store_error(exc, name) from exc


def _one_line(exc: BaseException) -> str:
    """A server's message on one line (libpq adds hints on lines of their own)."""
    return " ".join(str(exc).split())


def _connect(url: str, name: str, **kwargs: Any) -> psycopg.Connection:
    """One autocommit connection, or a clear StoreError naming the URL without
    its password."""
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=_CONNECT_TIMEOUT_S,
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


def _version(conn: psycopg.Connection) -> Optional[int]:
    """The queue's schema version; None for a database without one."""
    found = conn.execute("SELECT to_regclass('lease.schema_migrations')").fetchone()
    if found is None or found[0] is None:
        return None
    row = conn.execute("SELECT max(version) FROM lease.schema_migrations").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _check_version(version: Optional[int], name: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise NotAQueue(f"the queue in {name} has schema version {version}, newer than this "
                        f"code's {SCHEMA_VERSION}: open it with a newer lease-dispatcher")


def _migrate(conn: psycopg.Connection, name: str) -> None:
    """The migrations still missing, each in one transaction under the
    advisory lock; another host may have applied them meanwhile."""
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE SCHEMA IF NOT EXISTS lease")
            conn.execute("""CREATE TABLE IF NOT EXISTS lease.schema_migrations
  (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())""")
            version = _version(conn) or 0
            _check_version(version, name)
            if version == SCHEMA_VERSION:
                return
            try:
                for statement in _MIGRATIONS[version + 1]:
                    conn.execute(statement)
            except errors.DuplicateTable as exc:
                raise NotAQueue(f"not a queue: {name} holds other tables in schema lease "
                                f"({_one_line(exc)})") from None
            conn.execute("INSERT INTO lease.schema_migrations (version) VALUES (%s)",
                         (version + 1,))


def _check_tables(conn: psycopg.Connection, name: str, version: int) -> None:
    found: dict[str, list[str]] = {}
    for table, column in conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = 'lease' ORDER BY table_name, ordinal_position"):
        found.setdefault(table, []).append(column)
    for table, columns in _TABLES[version].items():
        if found.get(table) != columns:
            raise NotAQueue(f"not a version {version} queue: {name} has table "
                            f"lease.{table} with columns {found.get(table, [])}")


# ------------------------------------------------------------------ statements

# The quarantine of lease.worker._QUARANTINE: the same three moves in the same
# order (a missed deadline is the reason even when the budget is spent too),
# each on rows picked with SKIP LOCKED: a claimer never waits for another.
_QUARANTINE = (
    ("deadline", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status IN ('pending', 'leased') AND deadline <= %(now)s
    AND (status = 'pending' OR lease_until <= %(now)s)
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'deadline', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
    ("exhausted", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status = 'leased' AND lease_until <= %(now)s AND attempts >= max_attempts
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'exhausted', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
    ("exhausted", """WITH doomed AS (SELECT seq FROM lease.jobs
  WHERE status = 'pending' AND attempts >= max_attempts
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'dead', reason = 'exhausted', owner = NULL, lease_until = NULL
FROM doomed WHERE j.seq = doomed.seq"""),
)

# lease.worker._PICK, locked in a CTE: the planner cannot update more rows
# than the limit; a new lease as lease.worker._lease_rows makes it. On SQLite
# the quarantine and the pick run under one write lock, so no row at its
# budget or past its deadline is left for the pick. Here the quarantine skips
# a row another transaction holds (a stale finish, an extension), and that
# one may commit before the pick, a statement with a snapshot of its own: the
# pick says the rule itself, and such a row waits for the next claim's
# quarantine instead of a lease as attempt max + 1 or one ending at once.
_PICK_AND_LEASE = """WITH picked AS (SELECT seq FROM lease.jobs
  WHERE status IN ('pending', 'leased') AND held = 0
    AND ((status = 'pending' AND available_at <= %(now)s)
      OR (status = 'leased' AND lease_until <= %(now)s))
    AND attempts < max_attempts AND deadline > %(now)s
  ORDER BY seq LIMIT %(limit)s
  FOR UPDATE SKIP LOCKED)
UPDATE lease.jobs j SET status = 'leased', attempts = j.attempts + 1, token = j.token + 1,
  owner = %(owner)s, lease_until = LEAST(%(now)s + %(lease_ms)s, j.deadline), reason = NULL
FROM picked WHERE j.seq = picked.seq
RETURNING j.seq, j.id, j.qty, j.token, j.attempts, j.lease_until, j.body, j.digest"""

# The keys' locks, in one order (by their hash, so two writers of the same
# keys never deadlock), before any row is locked: of an intake's keys, and of
# the keys of the jobs an operator's change or a finish names.
_LOCK_KEYS = f"""SELECT count(pg_advisory_xact_lock({_KEY_LOCK}, h)) FROM
  (SELECT DISTINCT hashtext(k) AS h FROM unnest(%s::text[]) AS k ORDER BY h) s"""
_LOCK_KEYS_OF = f"""SELECT count(pg_advisory_xact_lock({_KEY_LOCK}, h)) FROM
  (SELECT DISTINCT hashtext(ordering_key) AS h FROM lease.jobs
   WHERE id = ANY(%s::text[]) AND ordering_key IS NOT NULL ORDER BY h) s"""

# lease.sqlite._PROMOTE for many keys: each line with no marked job gets its first.
_PROMOTE = f"""UPDATE lease.jobs j SET held = 0
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (SELECT f.seq FROM lease.jobs f WHERE f.ordering_key = k.key
  AND f.held = 1 AND {_LINE.format(a='f')} ORDER BY f.seq LIMIT 1) f
WHERE j.seq = f.seq AND NOT EXISTS (SELECT 1 FROM lease.jobs c
  WHERE c.ordering_key = k.key AND c.held = 0 AND {_LINE.format(a='c')})"""

# lease.sqlite._DEMOTE for many keys (the marked jobs are locked by then).
_DEMOTE = f"""UPDATE lease.jobs j SET held = 1
FROM unnest(%(keys)s::text[]) AS k(key)
WHERE j.ordering_key = k.key AND j.held = 0 AND {_LINE.format(a='j')} AND j.status <> 'leased'
  AND EXISTS (SELECT 1 FROM lease.jobs f WHERE f.ordering_key = k.key AND f.held = 1
    AND {_LINE.format(a='f')} AND f.seq < j.seq)"""

# The marked job of each key's line, locked: a claim leasing it commits first.
_FIRSTS = f"""SELECT ordering_key, seq, id, status FROM lease.jobs j
WHERE j.ordering_key = ANY(%s::text[]) AND j.held = 0 AND {_LINE.format(a='j')}
ORDER BY seq FOR UPDATE"""

# The fence: each UPDATE below changes a row only if it is still leased by this
# very ticket, now; its row count says whether it did.
_STILL_LEASED = """j.status = 'leased' AND j.qty = u.qty AND j.owner = u.owner
  AND j.token = u.token AND j.attempts = u.attempt AND j.lease_until = u.lease_until
  AND j.lease_until > %(now)s AND j.deadline > %(now)s"""

_EXTEND_IF_STILL_LEASED = f"""UPDATE lease.jobs j SET lease_until = %(new_until)s
FROM (VALUES (%(seq)s::bigint, %(qty)s::bigint, %(owner)s::text, %(token)s::bigint,
  %(attempt)s::bigint, %(lease_until)s::bigint))
  AS u(seq, qty, owner, token, attempt, lease_until)
WHERE j.seq = u.seq AND {_STILL_LEASED}"""

_FINISH_IF_STILL_LEASED = f"""UPDATE lease.jobs j SET status = u.status, reason = u.reason,
  available_at = u.available_at, owner = NULL, lease_until = NULL
FROM unnest(%(seq)s::bigint[], %(status)s::text[], %(reason)s::text[],
  %(available_at)s::bigint[], %(qty)s::bigint[], %(owner)s::text[], %(token)s::bigint[],
  %(attempt)s::bigint[], %(lease_until)s::bigint[])
  AS u(seq, status, reason, available_at, qty, owner, token, attempt, lease_until)
WHERE j.seq = u.seq AND {_STILL_LEASED}
RETURNING j.seq"""

_RECORD_DONE = """UPDATE lease.jobs j SET done_by = u.owner, done_started_ms = u.started_ms,
  done_latency_ms = u.latency_ms, done_http_status = u.http_status, done_after = u.after
FROM unnest(%s::bigint[], %s::text[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[])
  AS u(seq, owner, started_ms, latency_ms, http_status, after)
WHERE j.seq = u.seq"""

_RECORD_ATTEMPTS = """INSERT INTO lease.attempts (id, token, attempt, owner, started_ms,
  ended_ms, outcome, result, reason, http_status, error, latency_ms)
SELECT id, token, attempt, owner, started_ms, ended_ms, outcome, result, reason, http_status,
  error, latency_ms
FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::bigint[], %s::bigint[],
  %s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::bigint[])
  WITH ORDINALITY AS u(id, token, attempt, owner, started_ms, ended_ms, outcome, result,
  reason, http_status, error, latency_ms, ord)
ORDER BY ord
RETURNING seq"""

_TALLY = """INSERT INTO lease.tallies (name, n) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET n = lease.tallies.n + excluded.n"""

# Identity values follow the SELECT's order: seq is the order of intake.
_INSERT_NEW = """INSERT INTO lease.jobs (id, qty, status, attempts, max_attempts, token,
  available_at, deadline, owner, lease_until, reason, body, digest, ordering_key, held)
SELECT id, qty, 'pending', 0, %s, 0, %s, %s, NULL, NULL, NULL, body, digest, key,
  CASE WHEN key IS NULL THEN 0 ELSE 1 END
FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::text[]) WITH ORDINALITY
  AS u(id, qty, body, digest, key, ord)
ORDER BY ord
ON CONFLICT (id) DO NOTHING
RETURNING id"""

_AUDIT_REDRIVES = """INSERT INTO lease.redrives (id, token, at_ms, note, actor)
SELECT id, token, %s, %s, %s::text FROM unnest(%s::text[], %s::bigint[])
  WITH ORDINALITY AS u(id, token, ord)
ORDER BY ord"""

_RELEASE = """UPDATE lease.jobs SET status = 'pending', attempts = 0, available_at = %s,
  deadline = %s, owner = NULL, lease_until = NULL, reason = NULL,
  held = CASE WHEN ordering_key IS NOT NULL AND reason = 'cancelled' THEN 1 ELSE held END
WHERE seq = ANY(%s::bigint[]) AND status = 'dead'"""

_AUDIT_CANCELS = """INSERT INTO lease.cancels (id, token, at_ms, note, was, actor)
SELECT id, token, %s, %s, was, %s::text FROM unnest(%s::text[], %s::bigint[], %s::text[])
  WITH ORDINALITY AS u(id, token, was, ord)
ORDER BY ord"""

_CANCEL = """UPDATE lease.jobs SET status = 'dead', reason = 'cancelled', available_at = %s,
  owner = NULL, lease_until = NULL WHERE seq = ANY(%s::bigint[])"""

# Done jobs by finish time (seq breaks ties, as SQLite's index does by rowid);
# a row another writer holds is left for the next call.
_PRUNABLE = """SELECT seq, id FROM lease.jobs WHERE status = 'done' AND available_at < %s
ORDER BY available_at, seq LIMIT %s FOR UPDATE SKIP LOCKED"""

_DEAD = """SELECT d.*, (SELECT COALESCE(a.error, 'HTTP ' || a.http_status)
  FROM lease.attempts a WHERE a.id = d.id ORDER BY a.seq DESC LIMIT 1) AS last_error
FROM (SELECT * FROM lease.jobs WHERE status = 'dead'
  AND (%(reason)s::text IS NULL OR reason = %(reason)s::text)
  AND (%(key)s::text IS NULL OR ordering_key = %(key)s::text)
  ORDER BY seq LIMIT %(limit)s::bigint) d
ORDER BY d.seq"""

_LIST_JOBS = """SELECT d.*, CASE WHEN d.status = 'dead' THEN
  (SELECT COALESCE(a.error, 'HTTP ' || a.http_status) FROM lease.attempts a WHERE a.id = d.id
   ORDER BY a.seq DESC LIMIT 1) END AS last_error
FROM (SELECT * FROM lease.jobs WHERE {where} ORDER BY seq LIMIT %s) d ORDER BY d.seq"""

_HISTORY_ATTEMPTS = """SELECT token, attempt, owner, started_ms, ended_ms, outcome, result,
  reason, http_status, error, latency_ms FROM (
  SELECT seq AS at, 0 AS tie, token, attempt, owner, started_ms, ended_ms, outcome, result,
    reason, http_status, error, latency_ms FROM lease.attempts WHERE id = %(id)s
  UNION ALL
  SELECT done_after, 1, token, attempts, done_by, done_started_ms, available_at, 'ok',
    'done', NULL, done_http_status, NULL, done_latency_ms FROM lease.jobs
  WHERE id = %(id)s AND status = 'done' AND done_by IS NOT NULL) merged
ORDER BY at, tie"""
# (the delivering attempt, kept on a done job's row, after the attempts row it
# followed: the order of writing, as lease.observe._attempts reads a file)


def _text(error: Optional[str]) -> Optional[str]:
    """An attempt's error as PostgreSQL's text can hold it: capped as kept,
    a NUL (which text cannot hold) and a lone surrogate replaced."""
    if error is None:
        return None
    capped = error[:MAX_ERROR_CHARS].replace("\x00", "\ufffd")
    return capped.encode("utf-8", "replace").decode("utf-8")


def _columns(rows: list[tuple]) -> list[list]:
    """Rows as columns, for a statement over unnest(...)."""
    return [list(column) for column in zip(*rows, strict=True)]


# ------------------------------------------------------------------ the store


class PostgresStore:
    """The ``lease.store.Store`` of one PostgreSQL database, on a pool of
    ``threads`` connections: ``threads`` threads may call it at once."""

    kind = "postgresql"

    def __init__(self, url: str, *, create: bool = False, read_only: bool = False,
                 clock: Optional[Callable[[], int]] = None, threads: int = 1) -> None:
        if not isinstance(url, str):
            raise ValueError(f"url must be a str, got {type(url).__name__}")
        _check_int("threads", threads, 1, 1000)
        if clock is not None and not callable(clock):
            raise ValueError("clock must be None or callable")
        self.name = redact(url)
        self.threads = threads
        self.read_only = read_only
        self._url = url
        self._clock = clock
        self._open_queue(create)
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=threads, open=False, name=f"lease {self.name}",
            kwargs={"autocommit": True, "prepare_threshold": _PREPARE_THRESHOLD,
                    "connect_timeout": _CONNECT_TIMEOUT_S},
            configure=self._configure)
        try:
            self._pool.open(wait=True, timeout=_CONNECT_TIMEOUT_S)
        except psycopg_pool.PoolTimeout:
            self._pool.close()
            raise StoreError(f"cannot connect to {self.name}: no connection within "
                             f"{_CONNECT_TIMEOUT_S} s") from None

    def _open_queue(self, create: bool) -> None:
        """Check (and unless read only, create or migrate) the queue on a
        connection of its own, before the pool opens."""
        conn = _connect(self._url, self.name)
        try:
            with _mapped(self.name):
                version = _version(conn)
                _check_version(version, self.name)
                if version is None and (self.read_only or not create):
                    raise _no_queue(self.name)
                if version != SCHEMA_VERSION and not self.read_only:
                    _migrate(conn, self.name)
                    version = SCHEMA_VERSION
                assert version is not None  # refused or migrated above
                # A reader looks at an older queue as it is (without the columns
                # it has not got yet): a writer migrates it.
                _check_tables(conn, self.name, version)
                self._actors = "actor" in _TABLES[version]["redrives"]
                self._keys = "ordering_key" in _TABLES[version]["jobs"]
        finally:
            conn.close()

    def _configure(self, conn: psycopg.Connection) -> None:
        # A read-only store's every transaction is READ ONLY (BEGIN READ ONLY).
        conn.read_only = self.read_only

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listener(self) -> Listener:
        """Wake-ups when work becomes available, on a connection of its own."""
        return Listener(self._url, self.name)

    # -- the one transaction helper

    @contextmanager
    def _tx(self, *, read_only: bool = False,
            snapshot: bool = False) -> Iterator[psycopg.Connection]:
        """One transaction on a pooled connection: COMMIT at the end, ROLLBACK on
        any exception (BaseException: a cancelled caller leaves nothing open).

        psycopg's errors in the store's words: a serialization failure, a
        deadlock, a lock not available and a lost connection are Busy (the same
        call may succeed after a short pause); a missing table is NotAQueue;
        anything else a StoreError with the server's message. Whatever a fault
        hook raises passes through as it is, after the rollback.

        A connection lost during COMMIT leaves the outcome unknown: it is raised
        as Busy all the same, because every operation is safe to retry under
        the fence: a retried claim leases other rows (the first lease expires
        and its job is claimed again); a retried finish or extension finds the
        marker changed and reports the ticket stale; a retried enqueue sees its
        events as duplicates; a retried redrive or cancel sees the job no
        longer dead or already cancelled.
        """
        with _mapped(self.name), self._pool.connection() as conn, conn.transaction():
            if snapshot:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            elif read_only and not self.read_only:
                conn.execute("SET TRANSACTION READ ONLY")
            yield conn

    def _now_in(self, conn: psycopg.Connection, now_ms: Optional[int]) -> int:
        """The time the transaction judges by: the caller's, the injected clock's,
        or the server's, read as the transaction's first statement."""
        if now_ms is not None:
            return now_ms
        if self._clock is not None:
            return check_now(self._clock(), "clock value")
        row = conn.execute(_NOW).fetchone()
        assert row is not None  # a SELECT of one value returns one row
        return int(row[0])

    def now_ms(self) -> int:
        with self._tx(read_only=True) as conn:
            return self._now_in(conn, None)

    def schema_version(self) -> int:
        with self._tx(read_only=True) as conn:
            version = _version(conn)
        if version is None:
            raise _no_queue(self.name)
        return version

    # -- intake

    def enqueue_events(self, events: Iterable[object], policy: RetryPolicy = DEFAULT_POLICY, *,
                       now_ms: Optional[int] = None, not_before_ms: Optional[int] = None,
                       on_progress: Optional[Callable[[int], None]] = None,
                       on_conflict: str = "return") -> list:
        """All or none in one transaction, as ``lease.sqlite.enqueue_events``
        (``on_conflict`` too); ``events`` is read and inserted in chunks, never
        held whole."""
        if now_ms is not None:
            check_now(now_ms)
        if not isinstance(policy, RetryPolicy):
            raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        check_on_conflict(on_conflict)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            available_at = now if not_before_ms is None else check_not_before(not_before_ms, now)
            return judge_intake(_intake(conn, events, available_at, policy, on_progress),
                                on_conflict)

    # -- one attempt

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: Optional[int] = None, fault: Fault = None) -> Claimed:
        check_identifier("owner", owner)
        if now_ms is not None:
            check_now(now_ms)
        _check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
        _check_int("limit", limit, 1, MAX_BATCH)
        _check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            moved = {"deadline": 0, "exhausted": 0}
            args = {"now": now, "limit": limit, "owner": owner, "lease_ms": lease_ms}
            with conn.pipeline() as pipeline:
                moves = [(reason, conn.execute(statement, args))
                         for reason, statement in _QUARANTINE]
                self._before_pick(pipeline)
                picked = conn.execute(_PICK_AND_LEASE, args)
            for reason, cursor in moves:
                moved[reason] += cursor.rowcount
            leased = [Leased({"id": job_id, "qty": qty, "owner": owner, "token": token,
                              "attempt": attempt, "lease_until": until}, body, digest)
                      for _, job_id, qty, token, attempt, until, body, digest in sorted(picked)]
            if leased:
                _call(fault, "after-claim")
        if leased:
            _call(fault, "after-commit")
        return Claimed(leased, moved, now)

    def _before_pick(self, pipeline: psycopg.Pipeline) -> None:
        """Inside a claim, between its quarantine and its pick: nothing (the
        statements go in one pipeline, none waited for). The moment another
        transaction's lock, which made the quarantine skip a row, can end
        before the pick reads; a test's subclass syncs the pipeline here and
        ends one, to prove the pick's own rule."""

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: Optional[int] = None,
                     fault: Fault = None) -> Union[dict, bool]:
        check_ticket(ticket, PRODUCT)
        if now_ms is not None:
            check_now(now_ms)
        _check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
        _check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            row = _lock(conn, _MARKED, [ticket["id"]]).get(ticket["id"])
            if row is None or not _marker_matches(row, ticket, now):
                return False
            # lease.worker._extend_tx's rule: never backwards, never past the deadline
            new_until = max(row["lease_until"], min(now + lease_ms, row["deadline"]))
            if conn.execute(_EXTEND_IF_STILL_LEASED, {
                    "new_until": new_until, "now": now, "seq": row["seq"], **_marker(ticket)},
                    ).rowcount != 1:
                return False
            _call(fault, "after-extend")
        _call(fault, "after-commit")
        return {**ticket, "lease_until": new_until}

    def finish_jobs(self, items: list, *, now_ms: Optional[int] = None,
                    fault: Fault = None) -> list:
        """``lease.sqlite.finish_jobs`` on PostgreSQL: the items in order, as
        single finishes in sequence, with each attempt's evidence."""
        if type(items) is not list or len(items) > MAX_BATCH:
            raise ValueError(f"items must be a list of at most {MAX_BATCH}")
        for item in items:
            _check_item(item)
        if now_ms is not None:
            check_now(now_ms)
        _check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            judged = iter(_finish_marked(conn, items, now))
            verdicts = [next(judged) if outcome is not None else None
                        for _, outcome, _, _ in items]
            results = [("leased", None) if v is None else v and v[:2] for v in verdicts]
            _record_attempts(conn, items, results,
                             [v[2] if v else None for v in verdicts], now)
            changed = any(verdicts)
            if changed:
                _call(fault, "after-finish")
        if changed:
            _call(fault, "after-commit")
        return results

    # -- the operator

    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: Optional[int] = None, fault: Fault = None,
                     actor: Optional[str] = None) -> list:
        """``lease.sqlite.redrive_jobs``: per id True or its ValueError; each
        redriven job's audit row (the note, who did it) and release together."""
        _check_ids(job_ids)
        if now_ms is not None:
            check_now(now_ms)
        _check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
        check_note(note)
        check_actor(actor)
        _check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            conn.execute(_LOCK_KEYS_OF, (sorted(set(job_ids)),))
            rows = _lock(conn, "seq, id, status, reason, token, ordering_key", job_ids)
            results, audits, releases = _redrive_decisions(rows, job_ids)
            keys = sorted({row["ordering_key"] for row in rows.values()
                           if row["ordering_key"] is not None})
            firsts = {row["ordering_key"]: row for row in _dicts(conn, _FIRSTS, (keys,))} \
                if keys else {}
            results = _in_flight_refusals(rows, firsts, results, job_ids)
            audits = _kept_audits(audits, results, job_ids)
            releases = [rows[job_id]["seq"] for job_id, _ in audits]
            if audits:
                conn.execute(_AUDIT_REDRIVES, (now, note, actor, *_columns(audits)))
                _call(fault, "after-audit")
                conn.execute(_RELEASE, (now, now + ttl_ms, releases))
                if keys:  # a cancelled job back in its place; each line's first
                    conn.execute(_DEMOTE, {"keys": keys})
                    conn.execute(_PROMOTE, {"keys": keys})
                _call(fault, "after-redrive")
                conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
        if audits:
            _call(fault, "after-commit")
        return results

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: Optional[int] = None,
                    fault: Fault = None, actor: Optional[str] = None) -> list:
        """``lease.sqlite.cancel_jobs``: per id True or its ValueError; each
        cancelled job's audit row (the note, who did it) and its move to
        dead/cancelled together."""
        _check_ids(job_ids)
        if now_ms is not None:
            check_now(now_ms)
        check_note(note)
        check_actor(actor)
        _check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            conn.execute(_LOCK_KEYS_OF, (sorted(set(job_ids)),))
            rows = _lock(conn, "seq, id, status, reason, token, ordering_key", job_ids)
            results, audits = _cancel_decisions(rows, job_ids)
            if audits:
                conn.execute(_AUDIT_CANCELS, (now, note, actor, *_columns(
                    [(job_id, token, was) for _, job_id, token, was in audits])))
                _call(fault, "after-audit")
                conn.execute(_CANCEL, (now, [seq for seq, _, _, _ in audits]))
                # a line whose first was cancelled: the next one goes
                lines = sorted({rows[job_id]["ordering_key"] for _, job_id, _, _ in audits
                                if rows[job_id]["ordering_key"] is not None})
                if lines:
                    conn.execute(_PROMOTE, {"keys": lines})
                _call(fault, "after-cancel")
        if audits:
            _call(fault, "after-commit")
        return results

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int:
        """``lease.sqlite.prune_done``: up to ``limit`` done jobs finished before
        the cutoff, with their attempts and audit rows, in one transaction."""
        check_now(finished_before_ms, "finished_before_ms")
        _check_int("limit", limit, 1, MAX_BATCH)
        with self._tx() as conn:
            done = conn.execute(_PRUNABLE, (finished_before_ms, limit)).fetchall()
            ids = [job_id for _, job_id in done]
            if done:
                for table in ("attempts", "redrives", "cancels"):
                    conn.execute(f"DELETE FROM lease.{table} WHERE id = ANY(%s::text[])",
                                 (ids,))
                conn.execute("DELETE FROM lease.jobs WHERE seq = ANY(%s::bigint[])",
                             ([seq for seq, _ in done],))
        return len(done)

    # -- observations (read only)

    def counts(self) -> dict[str, int]:
        with self._tx(read_only=True) as conn:
            return _counts(conn)

    def is_drained(self) -> bool:
        with self._tx(read_only=True) as conn:
            row = conn.execute("SELECT EXISTS (SELECT 1 FROM lease.jobs"
                               " WHERE status IN ('pending', 'leased'))").fetchone()
        return not (row and row[0])

    def is_idle(self) -> bool:
        """lease.observe.is_idle: nothing claimable now or later without an operator."""
        if not self._keys:
            return self.is_drained()
        with self._tx(read_only=True) as conn:
            row = conn.execute(IDLE.format(jobs="lease.jobs")).fetchone()
        return bool(row and row[0])

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]:
        """lease.observe.blocked_heads: each blocked key's dead first job."""
        _check_int("limit", limit, 1, MAX_BATCH)
        if not self._keys:
            return []
        with self._tx(read_only=True) as conn:
            return _dicts(conn, BLOCKED_HEADS.format(jobs="lease.jobs", limit=limit))

    def snapshot(self, now_ms: Optional[int] = None) -> dict[str, Any]:
        """What lease.observe.snapshot gives for a product queue, read in one
        REPEATABLE READ transaction so the figures agree."""
        if now_ms is not None:
            check_now(now_ms)
        with self._tx(snapshot=True) as conn:
            now = self._now_in(conn, now_ms)
            return _snapshot(conn, now, keys=self._keys)

    def job_history(self, job_id: str) -> Optional[dict[str, Any]]:
        """A job's whole row, its redrives, every attempt in the order written,
        its cancels (lease.observe.job_history); None if there is no such job."""
        check_job_id("job_id", job_id, PRODUCT)
        actor = ", actor" if self._actors else ""
        with self._tx(snapshot=True) as conn:
            found = _dicts(conn, "SELECT * FROM lease.jobs WHERE id = %s", (job_id,))
            history = {
                "redrives": _dicts(conn, f"SELECT seq, token, at_ms, note{actor}"
                                   " FROM lease.redrives WHERE id = %s ORDER BY seq", (job_id,)),
                "attempts": _dicts(conn, _HISTORY_ATTEMPTS, {"id": job_id}),
                "cancels": _dicts(conn, f"SELECT seq, token, at_ms, note, was{actor}"
                                  " FROM lease.cancels WHERE id = %s ORDER BY seq", (job_id,)),
            }
        if not found:
            return None
        return {"job": found[0], **history}

    def dead_jobs(self, reason: Optional[str] = None, limit: Optional[int] = None, *,
                  key: Optional[str] = None) -> list[dict[str, Any]]:
        """Dead jobs in seq order, of one reason and one ordering key if given,
        each with its last recorded error (lease.observe.dead_jobs)."""
        if reason is not None:
            check_identifier("reason", reason)
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        if key is not None:
            check_ordering_key(key, "key")
        with self._tx(read_only=True) as conn:
            return _dicts(conn, _DEAD, {"reason": reason, "key": key, "limit": limit})

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r:.40}")
        with self._tx(read_only=True) as conn:
            return _dicts(conn, "SELECT * FROM lease.jobs WHERE status = %s ORDER BY seq",
                          (status,))

    def list_jobs(self, *, status: Optional[str] = None, reason: Optional[str] = None,
                  id_prefix: Optional[str] = None, after_seq: Optional[int] = None,
                  limit: int = 50, key: Optional[str] = None) -> list[dict[str, Any]]:
        """lease.observe.list_jobs: one page of whole rows in seq order after
        ``after_seq``, filtered, a dead row with its last error."""
        where, args = _job_filter(status, reason, id_prefix, after_seq, limit, key)
        # the filter's own checks and clauses, in this driver's placeholders
        sql = _LIST_JOBS.format(where=where.replace("?", "%s"))
        with self._tx(read_only=True) as conn:
            return _dicts(conn, sql, [*args, limit])

    def stale_finishes(self) -> int:
        with self._tx(read_only=True) as conn:
            return _stale_finishes(conn)


def enqueue_in(conn: psycopg.Connection, events: Iterable[object],
               policy: RetryPolicy = DEFAULT_POLICY, *, now_ms: Optional[int] = None,
               not_before_ms: Optional[int] = None, on_conflict: str = "raise") -> list:
    """The transactional outbox: enqueue on the service's own psycopg
    connection, inside its transaction, so the jobs commit or roll back with
    the service's rows. Per event True (new) or False (a duplicate); an event
    whose id is kept with other content raises Conflicts after this call's
    rows are rolled back, unless ``on_conflict="return"``: as
    ``lease.sqlite.enqueue_in``.

    ``conn`` has a transaction open: inside ``with conn.transaction():``, or a
    connection that is not autocommit after the service's own first statement.
    A connection with none open is refused: the jobs would commit on their
    own, or begin a transaction the service does not know it has. All or
    none: a bad event rolls back this call's rows (a savepoint), never the
    service's. The time is the server's clock (``now_ms`` overrides it); the
    dispatchers' wake-up is NOTIFY'd, delivered at the service's COMMIT.
    The database must hold the queue at this version (``PostgresStore(url,
    create=True)`` makes or migrates it).
    """
    if not isinstance(conn, psycopg.Connection):
        raise ValueError(f"conn must be a psycopg.Connection, got {type(conn).__name__}")
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.INERROR:
        raise ValueError("the service's transaction has already failed: roll it back first")
    if status != pq.TransactionStatus.INTRANS:
        raise ValueError("enqueue_in needs the service's open transaction (with "
                         "conn.transaction(): the service's writes, then enqueue_in): "
                         f"conn has none ({status.name})")
    if now_ms is not None:
        check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    name = redact(conn.info.dsn)
    with _mapped(name), conn.transaction():  # a savepoint inside the service's transaction
        cursor = conn.cursor(row_factory=tuple_row)  # the service's factory is not ours
        version = _version(cursor)  # type: ignore[arg-type]
        if version != SCHEMA_VERSION:
            raise NotAQueue(f"{name} holds no version {SCHEMA_VERSION} queue (version "
                            f"{version}): PostgresStore(url, create=True) makes it")
        if now_ms is None:
            row = cursor.execute(_NOW).fetchone()
            assert row is not None  # a SELECT of one value returns one row
            now_ms = int(row[0])
        available_at = now_ms if not_before_ms is None \
            else check_not_before(not_before_ms, now_ms)
        return judge_intake(_intake(cursor, events, available_at, policy, None), on_conflict)


def _intake(conn: Any, events: Iterable[object], available_at: int, policy: RetryPolicy,
            on_progress: Optional[Callable[[int], None]]) -> list:
    """Inside a transaction (``conn`` a connection or a cursor): the events
    read, checked and inserted in chunks, never held whole; the wake-up."""
    stream = iter(events)
    results: list = []
    while True:
        chunk = [check_product_event(event) for event in itertools.islice(stream, _INTAKE_CHUNK)]
        if not chunk:
            break
        for result in _insert(conn, chunk, available_at, policy):
            results.append(result)
            if on_progress is not None and len(results) % 1000 == 0:
                on_progress(len(results))
    if any(result is True for result in results):
        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
    return results


def _insert(conn: Any, chunk: list[Intake], available_at: int, policy: RetryPolicy) -> list:
    """Inside the intake: per event True (new), False (a duplicate) or its
    Conflict, in order, as single intakes in sequence would give them. Only
    new ids reach the INSERT: a duplicate never draws a seq. The chunk's keys
    are locked first, so the jobs of a key take their seqs in the order their
    intakes commit; each key's line then gets its first if it has none."""
    keys = sorted({intake.key for intake in chunk if intake.key is not None})
    if keys:
        conn.execute(_LOCK_KEYS, (keys,))
    kept = _contents(conn, sorted({intake.id for intake in chunk}))
    new: dict[str, Intake] = {}
    for intake in chunk:
        if intake.id not in kept:
            new.setdefault(intake.id, intake)
    inserted: set[str] = set()
    if new:
        inserted = {job_id for (job_id,) in conn.execute(_INSERT_NEW, (
            policy.max_attempts, available_at, available_at + policy.ttl_ms,
            *_columns([(i.id, i.qty, i.body, i.digest, i.key) for i in new.values()])))}
        # another intake committed one of these ids meanwhile: judge by its row
        kept.update(_contents(conn, [job_id for job_id in new if job_id not in inserted]))
    results: list = []
    for intake in chunk:
        first = new.get(intake.id)
        if first is intake and intake.id in inserted:
            results.append(True)
        else:
            qty, digest, key = kept.get(intake.id) or (
                first.qty, first.digest, first.key)  # type: ignore[union-attr]
            results.append(_judge(intake, qty, digest, key))
    lines = sorted({key for key in (new[job_id].key for job_id in inserted) if key is not None})
    if lines:
        conn.execute(_PROMOTE, {"keys": lines})
    return results


def _contents(conn: Any, ids: list[str]) -> dict[str, tuple]:
    if not ids:
        return {}
    return {job_id: (qty, digest, key) for job_id, qty, digest, key in conn.execute(
        "SELECT id, qty, digest, ordering_key FROM lease.jobs WHERE id = ANY(%s::text[])",
        (ids,))}


def _judge(intake: Intake, qty: int, digest: Optional[str],
           key: Optional[str]) -> Union[bool, Conflict]:
    """A known id: False for the content it has, else lease.sqlite's Conflict."""
    if (qty, digest, key) == (intake.qty, intake.digest, intake.key):
        return False
    return _conflict(intake, qty, digest, key)


def _marker(ticket: dict) -> dict[str, Any]:
    """The ticket's marker as the fence's parameters."""
    return {"qty": ticket["qty"], "owner": ticket["owner"], "token": ticket["token"],
            "attempt": ticket["attempt"], "lease_until": ticket["lease_until"]}


def _lock(conn: psycopg.Connection, columns: str, job_ids: list) -> dict[str, dict[str, Any]]:
    """The rows of these ids by id, locked in seq order (two writers never
    deadlock)."""
    unique = sorted(set(job_ids))
    if not unique:
        return {}
    locked = _dicts(conn, f"SELECT {columns} FROM lease.jobs WHERE id = ANY(%s::text[])"
                    " ORDER BY seq FOR UPDATE", (unique,))
    return {row["id"]: row for row in locked}


def _finish_marked(conn: psycopg.Connection, items: list, now: int) -> list:
    """Inside the finish: each finishing item judged by the rules on its locked
    row, in order (a job finished earlier in the list is no longer leased for a
    later item), then written only if still leased by its ticket. Per finishing
    item (status, reason, seq) or False.

    Every item's row is locked, an evidence-only item's too: a job's attempts
    are then written one transaction after another, in the order of their seqs.
    """
    ids = [ticket["id"] for ticket, _, _, _ in items]
    conn.execute(_LOCK_KEYS_OF, (sorted(set(ids)),))
    rows = _lock(conn, f"{_MARKED}, ordering_key", ids)
    verdicts: list = []
    writes: list[tuple] = []
    for ticket, outcome, delay_ms, _ in items:
        if outcome is None:
            continue
        row = rows.get(ticket["id"])
        if row is None or not _marker_matches(row, ticket, now):
            verdicts.append(False)
            continue
        status, reason, available_at = finish_decision(
            outcome, row["attempts"], row["max_attempts"], row["deadline"], now, delay_ms)
        row.update(status=status, reason=reason, available_at=available_at, owner=None,
                   lease_until=None)
        writes.append((row["seq"], status, reason, available_at, *_marker(ticket).values()))
        verdicts.append((status, reason, row["seq"]))
    if not writes:
        return verdicts
    names = ("seq", "status", "reason", "available_at", *_marker(items[0][0]))
    written = {seq for (seq,) in conn.execute(
        _FINISH_IF_STILL_LEASED, {"now": now, **dict(zip(names, _columns(writes), strict=True))})}
    # a line whose first was delivered: the next one goes
    lines = sorted({row["ordering_key"] for row in rows.values() if row["status"] == "done"
                    and row["seq"] in written and row["ordering_key"] is not None})
    if lines:
        conn.execute(_PROMOTE, {"keys": lines})
    return [v if v and v[2] in written else False for v in verdicts]


def _record_attempts(conn: psycopg.Connection, items: list, results: list, seqs: list,
                     now: int) -> None:
    """Inside the finish: each attempt's evidence, as lease.sqlite records it.
    The attempt that made a job done goes on the job's row, ``done_after``
    naming the attempts row written just before it; every other attempt (a
    retry, a refusal, a stale finish, evidence only) is an attempts row."""
    rows: list[tuple] = []
    done: list[tuple] = []
    for (ticket, outcome, _, seen), result, seq in zip(items, results, seqs, strict=True):
        if result is not False and result[0] == "done":
            done.append((len(rows), seq, ticket["owner"], seen.started_ms, seen.latency_ms,
                         seen.http_status))
            continue
        status, reason = ("stale", None) if result is False else result
        rows.append((ticket["id"], ticket["token"], ticket["attempt"], ticket["owner"],
                     seen.started_ms, now, outcome or "none", status, reason,
                     seen.http_status, _text(seen.error), seen.latency_ms))
    before = 0
    if done:
        row = conn.execute("SELECT COALESCE(max(seq), 0) FROM lease.attempts").fetchone()
        before = row[0] if row else 0
    written = sorted(seq for (seq,) in conn.execute(_RECORD_ATTEMPTS, _columns(rows))) \
        if rows else []
    if done:
        conn.execute(_RECORD_DONE, _columns([
            (seq, owner, started, latency, status, written[k - 1] if k else before)
            for k, seq, owner, started, latency, status in done]))
    stale = sum(1 for result in results if result is False)
    if stale:
        conn.execute(_TALLY, ("stale_finishes", stale))


def _dicts(conn: psycopg.Connection, sql: str, args: Any = ()) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(sql, args).fetchall()


def _counts(conn: psycopg.Connection) -> dict[str, int]:
    found: dict[str, int] = dict(conn.execute(
        "SELECT status, count(*) FROM lease.jobs GROUP BY status").fetchall())
    return {status: found.get(status, 0) for status in STATUSES}


def _stale_finishes(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT n FROM lease.tallies WHERE name = 'stale_finishes'").fetchone()
    return 0 if row is None else int(row[0])


def _snapshot(conn: psycopg.Connection, now: int, *, keys: bool = True) -> dict[str, Any]:
    """lease.observe.snapshot's figures, inside one consistent read."""
    def one(sql: str, args: Any = ()) -> Any:
        row = conn.execute(sql, args).fetchone()
        return None if row is None else row[0]

    by_status = _counts(conn)
    oldest = one("SELECT min(available_at) FROM lease.jobs WHERE status IN ('pending', 'leased')")
    attempts = conn.execute("SELECT attempts, count(*) FROM lease.jobs GROUP BY attempts"
                            " ORDER BY attempts").fetchall()
    dead = conn.execute("SELECT reason, count(*) FROM lease.jobs WHERE status = 'dead'"
                        ' GROUP BY reason ORDER BY reason COLLATE "C"').fetchall()
    redrives = conn.execute("SELECT count(*), count(DISTINCT id), count(*) FILTER"
                            " (WHERE at_ms > %s) FROM lease.redrives", (now - DAY_MS,)).fetchone()
    leases = conn.execute("SELECT count(*) FILTER (WHERE lease_until <= %s), count(*) FILTER"
                          " (WHERE lease_until > %s) FROM lease.jobs WHERE status = 'leased'",
                          (now, now)).fetchone()
    cancels = conn.execute("SELECT count(*), count(*) FILTER (WHERE at_ms > %s)"
                           " FROM lease.cancels", (now - DAY_MS,)).fetchone()
    ready = one("SELECT min(available_at) FROM lease.jobs WHERE status = 'pending'"
                " AND available_at <= %s", (now,))
    assert redrives and leases and cancels  # an aggregate returns one row
    return {
        "jobs": sum(by_status.values()),
        "by_status": by_status,
        "oldest_unfinished_age_ms": None if oldest is None else max(0, now - oldest),
        "oldest_ready_age_ms": None if ready is None else now - ready,
        "expired_leases": leases[0],
        "live_leases": leases[1],
        "attempts": {str(k): v for k, v in attempts},
        "dead_by_reason": dict(dead),
        "redrives": redrives[0],
        "redriven_jobs": redrives[1],
        "redrives_last_day": redrives[2],
        "cancels": cancels[0],
        "cancels_last_day": cancels[1],
        "attempts_recorded": one(
            "SELECT (SELECT count(*) FROM lease.attempts)"
            " + (SELECT count(*) FROM lease.jobs WHERE status = 'done' AND done_by IS NOT NULL)"),
        "stale_finishes": _stale_finishes(conn),
        **({"blocked_keys": one(BLOCKED_KEYS.format(jobs="lease.jobs")),
            "blocked_jobs": one(BLOCKED_JOBS.format(jobs="lease.jobs"))} if keys else {}),
    }


# ------------------------------------------------------------------ wake-ups


class Listener:
    """Wake-ups on CHANNEL (an intake, a redrive), on a connection of its own.

    ``wait(timeout_s)`` is True when a notification arrived (those already
    arrived are taken as one), False when the time ran out. When the connection drops,
    it reconnects with a growing pause and returns True once it has: what
    was NOTIFY'd meanwhile is lost, so the caller polls once and no work is
    stranded. Polling at the caller's own pace remains the fallback.
    """

    def __init__(self, url: str, name: str) -> None:
        self._url = url
        self.name = name
        self._pause_s = _MIN_PAUSE_S
        self._conn: Optional[psycopg.Connection] = self._listen()
        self._closed = False

    def _listen(self) -> psycopg.Connection:
        conn = _connect(self._url, self.name)
        try:
            with _mapped(self.name):
                conn.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    def wait(self, timeout_s: float) -> bool:
        if type(timeout_s) not in (int, float) or not 0 <= timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        if self._closed:
            raise StoreError(f"the listener of {self.name} is closed")
        give_up = time.monotonic() + timeout_s
        if self._conn is not None:
            try:
                woke = any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))
                if woke:
                    for _ in self._conn.notifies(timeout=0):  # the others: one wake-up
                        pass
                return woke
            except psycopg.Error:  # the connection dropped: reconnect, then poll once
                self._conn.close()
                self._conn = None
        return self._reconnect(give_up)

    def _reconnect(self, give_up: float) -> bool:
        """Connect again before ``give_up``, pausing longer after each failure."""
        while True:
            try:
                self._conn = self._listen()
                self._pause_s = _MIN_PAUSE_S
                return True
            except StoreError:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(self._pause_s, left))
                self._pause_s = min(_MAX_PAUSE_S, self._pause_s * 2)

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MIN_PAUSE_S = 0.05
_MAX_PAUSE_S = 5.0
