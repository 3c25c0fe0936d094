"""The product's SQLite queue: payloads, wider budgets, the evidence of every
attempt, cancels, retention, and versioned migrations.

A product file is a contract file migrated forward: the contract's two tables
stay as they are, with columns added after the contract's and tables added
beside them, and ``PRAGMA user_version`` says which version it is. So the
contract's functions (``lease.worker``) still work on it, and every function
here runs the contract's own transactions (claim, extend, finish, redrive)
with the product's limits (``lease.policy.PRODUCT``). No rule is written
twice: what is new here is only what the contract has no column for.

Versions:

- 0: the contract's schema (``lease.worker.open_queue``);
- 1: ``jobs.body`` and ``jobs.digest``; the delivering attempt's evidence
  on a done job's row (``jobs.done_*``) and every other attempt's in
  ``attempts``; ``cancels``, their audit rows; ``tallies``, durable counters (the
  stale finishes refused); indexes for pruning done jobs and for a job's
  audit rows;
- 2: ``redrives.actor`` and ``cancels.actor``: who made an operator's change;
- 3: ``jobs.ordering_key`` and ``jobs.held``: ordered delivery per key (below);
- 4: ``bodies``, a job's payload in a table of its own, written once by the
  intake and deleted with the job (``jobs.body`` stays, always NULL).
  SQLite rewrites a whole record at each change of any column, so a body
  kept on the job's row was written again by the claim and by the finish,
  and its pages again by both COMMITs: with 3.7 KB payloads the store's
  claim and finish cost about twice as much CPU a job that way
  (``docs/benchmarks.md``).

Every migration runs in one transaction: a crash leaves the old version
whole. A file newer than this code is refused untouched.

Ordered keys. Jobs enqueued with the same ``key`` are delivered one at a time
in intake order. A key's *line* is its jobs still to be delivered: pending,
leased, or dead but not cancelled (a dead job blocks the jobs behind it until
it is redriven, when it is first in line again, or cancelled, when the next
goes). Exactly one job of a non-empty line has ``held = 0``: its first, the
only one a claim may take; every other has ``held = 1``. Each transaction
that changes a line (intake, a finish that makes its first done, a cancel, a
redrive) moves the mark in the same transaction, by index probes on the key
alone, so a claim reads only the jobs it may take (``jobs_claimable``) however
long the lines are. Jobs without a key are never held.

A queue can share a file with a service's own tables, as a declared choice
(``SQLiteStore(path, create=True, shared=True)``): the declaration is a row in
``lease_meta``, so every later open accepts the file without being told, the
file keeps the journal mode the service gave it (WAL or a rollback journal),
and the service enqueues inside its own transaction with ``enqueue_in``. A file
with foreign tables that was never declared shared is refused as before.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import time
from contextlib import contextmanager
from operator import itemgetter
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Tuple, Union

from lease import observe
from lease.observe import BODIES_SINCE, stale_finishes
from lease.policy import (
    DEFAULT_POLICY,
    PRODUCT,
    Intake,
    RetryPolicy,
    check_actor,
    check_not_before,
    check_note,
    check_product_event,
)
from lease.records import (
    MAX_ERROR_CHARS,
    Attempt,
    Claimed,
    Leased,
    check_on_conflict,
    judge_intake,
)
from lease.worker import (
    _PICK_NAMES,
    _ROW_AT_A_TIME,
    MAX_BATCH,
    MAX_NOW_MS,
    OUTCOMES,
    Busy,
    Conflict,
    Fault,
    NotAQueue,
    StoreError,
    _call,
    _check_connection,
    _check_fault,
    _check_int,
    _check_path,
    _check_schema,
    _claim_tx,
    _connect_file,
    _extend_tx,
    _finish_tx,
    _immediate,
    _open_file,
    _redrive_decisions,
    _RowAtATime,
    _select,
    _tuples,
    check_identifier,
    check_job_id,
    check_now,
    check_outcome,
    check_ticket,
    open_queue,
)
from lease.worker import _SCHEMA as _CONTRACT_SCHEMA

__all__ = [
    "SCHEMA_VERSION",
    "Attempt",
    "Leased",
    "open_store",
    "migrate",
    "schema_version",
    "enqueue_events",
    "enqueue_in",
    "claim_jobs",
    "extend_lease",
    "finish_jobs",
    "redrive_jobs",
    "cancel_jobs",
    "prune_done",
    "stale_finishes",
    "SQLiteStore",
]

SCHEMA_VERSION = 4

# A job in its key's line: still to be delivered, or dead and blocking the
# jobs behind it. The partial index below has this very predicate (SQLite uses
# a partial index only for a query that states its terms).
_LINE = ("ordering_key IS NOT NULL AND (status IN ('pending', 'leased')"
         " OR (status = 'dead' AND reason <> 'cancelled'))")


def _in_line(alias: str) -> str:
    return _LINE.replace("ordering_key", f"{alias}.ordering_key").replace(
        "status", f"{alias}.status").replace("reason", f"{alias}.reason")

_MIGRATIONS: dict[int, Tuple[str, ...]] = {
    1: (
        "ALTER TABLE jobs ADD COLUMN body TEXT",  # canonical JSON; NULL for {"id", "qty"}
        "ALTER TABLE jobs ADD COLUMN digest TEXT",  # sha256 of body; the intake's dedupe key
        # The evidence of the attempt that delivered a done job, on its own row:
        # the common path writes no attempts row (the finish updates this row
        # anyway), and done is final, so one set of columns is enough.
        "ALTER TABLE jobs ADD COLUMN done_by TEXT",
        "ALTER TABLE jobs ADD COLUMN done_started_ms INTEGER",
        "ALTER TABLE jobs ADD COLUMN done_latency_ms INTEGER",
        "ALTER TABLE jobs ADD COLUMN done_http_status INTEGER",
        # the attempts row written just before the delivery: the history's order
        # is the order of writing, whatever the callers' clocks said
        "ALTER TABLE jobs ADD COLUMN done_after INTEGER",
        # No AUTOINCREMENT: a new rowid is the largest + 1, so a job's attempts
        # read back in the order they were written; AUTOINCREMENT's bookkeeping
        # costs ~10 us a row on the finish path.
        """CREATE TABLE attempts (seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL, owner TEXT NOT NULL,
  started_ms INTEGER NOT NULL, ended_ms INTEGER NOT NULL, outcome TEXT NOT NULL,
  result TEXT NOT NULL, reason TEXT, http_status INTEGER, error TEXT, latency_ms INTEGER)""",
        "CREATE INDEX attempts_by_job ON attempts(id, seq)",
        """CREATE TABLE cancels (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL,
  was TEXT NOT NULL)""",
        "CREATE TABLE tallies (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
        # finish sets available_at = now for done: the time a done job finished.
        "CREATE INDEX jobs_done_at ON jobs(available_at) WHERE status = 'done'",
        # A job's audit rows, read by its history and deleted with it by prune.
        "CREATE INDEX redrives_by_job ON redrives(id)",
        "CREATE INDEX cancels_by_job ON cancels(id)",
    ),
    2: (
        # Who made an operator's change (a name, a token's label); NULL when not said.
        "ALTER TABLE redrives ADD COLUMN actor TEXT",
        "ALTER TABLE cancels ADD COLUMN actor TEXT",
    ),
    3: (
        "ALTER TABLE jobs ADD COLUMN ordering_key TEXT",  # NULL: no order to keep
        # 1 while an earlier job of its key is in line (see "Ordered keys" above)
        "ALTER TABLE jobs ADD COLUMN held INTEGER NOT NULL DEFAULT 0",
        # What a claim may take, in seq order: the contract's live rows less the held.
        "CREATE INDEX jobs_ready ON jobs(seq) WHERE status IN ('pending', 'leased') AND held = 0",
        # A key's line, its first (held = 0) apart from the rest (held = 1, in order).
        f"CREATE INDEX jobs_line ON jobs(ordering_key, held, seq) WHERE {_LINE}",
    ),
    BODIES_SINCE: (
        # A job's payload, keyed by its seq (AUTOINCREMENT: a seq is never
        # taken again, not even after prune_done). The column on the job's row
        # stays, NULL: a DROP COLUMN needs SQLite 3.35 and rewrites every row.
        "CREATE TABLE bodies (seq INTEGER PRIMARY KEY, body TEXT NOT NULL)",
        "INSERT INTO bodies (seq, body) SELECT seq, body FROM jobs WHERE body IS NOT NULL",
        "UPDATE jobs SET body = NULL WHERE body IS NOT NULL",
        # jobs_ready under another name: an older dispatcher still running reads
        # its payloads from jobs.body, now NULL, and would spend their budgets on
        # sends refused unsent. Its claim names jobs_ready (INDEXED BY), so each
        # of its claims now fails whole, as an error, and leaves the jobs alone.
        "DROP INDEX jobs_ready",
        "CREATE INDEX jobs_claimable ON jobs(seq)"
        " WHERE status IN ('pending', 'leased') AND held = 0",
    ),
}

_TABLES = {
    "jobs": ["seq", "id", "qty", "status", "attempts", "max_attempts", "token",
             "available_at", "deadline", "owner", "lease_until", "reason", "body", "digest",
             "done_by", "done_started_ms", "done_latency_ms", "done_http_status",
             "done_after", "ordering_key", "held"],
    "attempts": ["seq", "id", "token", "attempt", "owner", "started_ms", "ended_ms", "outcome",
                 "result", "reason", "http_status", "error", "latency_ms"],
    "redrives": ["seq", "id", "token", "at_ms", "note", "actor"],
    "cancels": ["seq", "id", "token", "at_ms", "note", "was", "actor"],
    "tallies": ["name", "n"],
    "bodies": ["seq", "body"],
}
# lease.postgres checks its own versions' tables by these (its jobs keep their bodies)
_TABLES_V3 = {name: columns for name, columns in _TABLES.items() if name != "bodies"}
_TABLES_V2 = {**_TABLES_V3, "jobs": _TABLES["jobs"][:-2]}
_TABLES_V1 = {  # version 1: lease.postgres reads a version-1 database by it
    "jobs": ["seq", "id", "qty", "status", "attempts", "max_attempts", "token",
             "available_at", "deadline", "owner", "lease_until", "reason", "body", "digest",
             "done_by", "done_started_ms", "done_latency_ms", "done_http_status",
             "done_after"],
    "attempts": ["seq", "id", "token", "attempt", "owner", "started_ms", "ended_ms", "outcome",
                 "result", "reason", "http_status", "error", "latency_ms"],
    "cancels": ["seq", "id", "token", "at_ms", "note", "was"],
    "tallies": ["name", "n"],
}


# ------------------------------------------------------------------ opening


def schema_version(con: sqlite3.Connection) -> int:
    return int(con.execute("PRAGMA user_version").fetchone()[0])


def open_store(path: Union[str, os.PathLike[str]], *, create: bool = True,
               journal: Optional[str] = None) -> sqlite3.Connection:
    """Open a queue for the product: the contract's ``open_queue`` (its
    settings, its refusal of foreign files), then the migrations up to
    SCHEMA_VERSION, in one transaction. A newer file is a ValueError.

    A file in WAL mode stays in it (``open_wal``: the contract's opener would
    insist on its rollback journal, and cannot switch a WAL file that another
    process has open). ``journal`` ("wal" or "delete") switches the file's
    mode, which needs the file to itself; None keeps what the file has."""
    text = _check_path(path, "queue")
    check_journal(journal)
    con = open_wal(text) if is_wal_file(text) else open_queue(text, create=create)
    try:
        migrate(con)
        if journal is not None:
            _switch_journal(con, journal, text)
    except BaseException:
        con.close()
        raise
    return con


# The journal modes a product file may choose: the contract's rollback
# journal, or the write-ahead log (one fsync a COMMIT instead of several, and
# readers that never block the writer). synchronous=FULL makes every COMMIT
# durable in both.
JOURNALS = ("delete", "wal")


def check_journal(journal: object) -> None:
    if journal is not None and (type(journal) is not str or journal not in JOURNALS):
        raise ValueError(f"journal must be None, 'delete' or 'wal', got {journal!r}")


def journal_mode(con: sqlite3.Connection) -> str:
    """The journal mode of an open queue's connection ("delete", "wal", ...)."""
    return str(con.execute("PRAGMA journal_mode").fetchone()[0])


def is_wal_file(text: str) -> bool:
    """True when the file's header says WAL (its read and write versions are 2),
    read without opening it as a database: nothing is created or changed."""
    try:
        with open(text, "rb") as file:
            header = file.read(20)
    except OSError:  # missing, a folder, unreadable: the usual opener says which
        return False
    return header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"


def open_wal(text: str) -> sqlite3.Connection:
    """A queue file in WAL mode, opened as the contract opens one (autocommit,
    a 1 s wait for a competing writer, synchronous=FULL, foreign files refused,
    missing tables created) but with its journal mode kept."""
    return _open_file(text, False, None)


def _switch_journal(con: sqlite3.Connection, journal: str, text: str) -> None:
    """The file's journal mode made ``journal``; SQLite answers with the mode it
    has, which stays the old one while another connection has the file open."""
    if journal_mode(con) == journal:
        return
    try:
        found = con.execute(f"PRAGMA journal_mode={journal.upper()}").fetchone()[0]
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
        found = journal_mode(con)
    if found != journal:
        raise StoreError(f"{text}: could not switch to journal_mode={journal} (still {found}):"
                         f" another connection has the file open; switch it while nothing else"
                         f" uses it")


def migrate(con: sqlite3.Connection) -> int:
    """Bring an open queue to SCHEMA_VERSION; the version it had before."""
    _check_connection(con)
    before = _check_version(con)
    if before < SCHEMA_VERSION:
        with _immediate(con):
            before = _migrate_here(con)
    _check_tables(con)
    return before


def _migrate_here(con: sqlite3.Connection) -> int:
    """Inside a write transaction: the migrations still missing; the version
    the file had (another process may have migrated it meanwhile)."""
    before = _check_version(con)
    for version in range(before + 1, SCHEMA_VERSION + 1):
        for statement in _MIGRATIONS[version]:
            con.execute(statement)
    if before < SCHEMA_VERSION:
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return before


def _check_version(con: sqlite3.Connection) -> int:
    version = schema_version(con)
    if version > SCHEMA_VERSION:
        raise NotAQueue(f"queue file has schema version {version}, newer than this code's "
                         f"{SCHEMA_VERSION}: open it with a newer lease-dispatcher")
    return version


# A shared file's journal modes: the ones that keep a COMMIT across a crash.
# (MEMORY and OFF can lose or corrupt the file: a queue cannot live there.)
SHARED_JOURNAL_MODES = ("delete", "truncate", "persist", "wal")
_META = "CREATE TABLE IF NOT EXISTS lease_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"


def is_declared_shared(con: sqlite3.Connection) -> bool:
    """True when the file records that its queue shares it with other tables."""
    if not con.execute("SELECT EXISTS (SELECT 1 FROM sqlite_master"
                       " WHERE type = 'table' AND name = 'lease_meta')").fetchone()[0]:
        return False
    row = con.execute("SELECT value FROM lease_meta WHERE name = 'shared'").fetchone()
    return row is not None and row[0] == "1"


def open_shared(path: Union[str, os.PathLike[str]], *, create: bool = False,
                declare: bool = False) -> Optional[sqlite3.Connection]:
    """Open a queue that shares its file with a service's own tables; None
    when the file was never declared shared and ``declare`` is False (the
    caller opens it as a queue file of its own, with its refusals).

    ``declare`` makes the choice: the queue's tables are created beside the
    service's if missing (``create``), the file migrated, and the declaration
    recorded in ``lease_meta``, all in one transaction. The file keeps its
    journal mode (WAL, or a rollback journal): the service chose it, and
    switching a WAL file another process has open would fail or surprise it.
    synchronous=FULL on our connection makes each COMMIT durable in either.
    """
    text = _check_path(path, "queue")
    con = _connect_file(text, create)
    try:
        declared = is_declared_shared(con)
        if not declared and not declare:
            con.close()
            return None
        mode = con.execute("PRAGMA journal_mode").fetchone()[0]
        if mode not in SHARED_JOURNAL_MODES:
            raise NotAQueue(f"{text}: journal_mode={mode} cannot keep a COMMIT across a crash;"
                            f" a shared queue needs one of {', '.join(SHARED_JOURNAL_MODES)}")
        con.execute("PRAGMA synchronous=FULL")
        if not declared or schema_version(con) < SCHEMA_VERSION:
            with _immediate(con):
                _make_shared(con, declared)
        _check_version(con)
        _check_tables(con)
    except BaseException:
        con.close()
        raise
    return con


def _make_shared(con: sqlite3.Connection, declared: bool) -> None:
    """Inside a write transaction: the queue's tables beside the others (the
    ones it already has checked first), migrated, the declaration recorded."""
    has_queue = con.execute("SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table'"
                            " AND name IN ('jobs', 'redrives'))").fetchone()[0]
    if has_queue:
        _check_schema(con)  # the contract's columns, or NotAQueue
    elif schema_version(con) != 0:  # the service numbers its own schema there
        raise NotAQueue("PRAGMA user_version of the file is "
                        f"{schema_version(con)}: a shared queue keeps its version there")
    for statement in _CONTRACT_SCHEMA:
        con.execute(statement)
    _migrate_here(con)
    if not declared:
        con.execute(_META)
        con.execute("INSERT OR REPLACE INTO lease_meta (name, value) VALUES ('shared', '1')")


def _check_tables(con: sqlite3.Connection) -> None:
    for name, columns in _TABLES.items():
        found = [row[1] for row in con.execute(f"PRAGMA table_info({name})")]
        if found != columns:
            raise NotAQueue(f"not a version {SCHEMA_VERSION} queue: table {name!r} has "
                             f"columns {found}")


# ------------------------------------------------------------------ intake


def enqueue_events(
    con: sqlite3.Connection,
    events: Iterable[object],
    now_ms: int,
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    not_before_ms: Optional[int] = None,
    on_progress: Optional[Callable[[int], None]] = None,
    on_conflict: str = "return",
) -> list:
    """Enqueue events in one transaction: all of them or, on a bad event or any
    error while ``events`` is read, none. ``events`` may be a generator (a
    large file read line by line): each is checked as it comes, and memory
    stays bounded by the results list.

    Per event: True (new), False (the same id with the same content: a
    duplicate, its row and its budget untouched) or a Conflict (the same id
    with other content; the others go on). With ``on_conflict="raise"`` a
    conflict refuses the whole call instead: every event is still judged,
    then Conflicts (naming each conflicting event) rolls the transaction
    back. The content is the qty of an {"id", "qty"} event and the body's
    canonical digest of an {"id", "body"} event. ``not_before_ms`` delays the
    first attempt (delayed delivery).
    A connection from the contract's ``open_queue`` will do: a contract file
    is migrated forward inside the same transaction.
    """
    _check_connection(con)
    check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    available_at = now_ms if not_before_ms is None else check_not_before(not_before_ms, now_ms)
    with _immediate(con):
        # A contract file is migrated in the intake's own transaction: an intake
        # refused halfway leaves it exactly as it was, at its old version too.
        _migrate_here(con)
        return judge_intake(_intake(con, events, now_ms, available_at, policy, on_progress),
                            on_conflict)


def _intake(con: Union[sqlite3.Connection, sqlite3.Cursor], events: Iterable[object],
            now_ms: int, available_at: int, policy: RetryPolicy,
            on_progress: Optional[Callable[[int], None]] = None) -> list:
    """Inside a transaction: each event checked and inserted, then each key
    that got a job given its first in line; per event True, False or Conflict."""
    results: list = []
    keys: set[str] = set()
    for event in events:
        intake = check_product_event(event)
        try:
            new = _insert(con, intake, now_ms, available_at, policy)
        except Conflict as conflict:
            results.append(conflict)
        else:
            results.append(new)
            if new and intake.key is not None:
                keys.add(intake.key)
        if on_progress is not None and len(results) % 1000 == 0:
            on_progress(len(results))
    _promote(con, keys)
    return results


def enqueue_in(
    con: sqlite3.Connection,
    events: Iterable[object],
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    now_ms: Optional[int] = None,
    not_before_ms: Optional[int] = None,
    on_conflict: str = "raise",
) -> list:
    """The transactional outbox: enqueue on the service's own connection,
    inside the transaction it has open, so the jobs commit or roll back with
    the service's rows. Per event True (new) or False (a duplicate).

    An event whose id is kept with other content raises Conflicts (a
    Conflict), after this call's rows are rolled back: an event the service
    meant to send is never dropped without an error, and the service's
    transaction is the service's to roll back (``with con:`` does). Only
    ``on_conflict="return"`` gives each Conflict in the results instead, and
    writes the rest, as enqueue_events does by default.

    ``con`` is the service's sqlite3 connection to a file that holds the queue
    (declared shared, beside the service's tables: ``SQLiteStore(path,
    create=True, shared=True)`` once makes it). A connection with no
    transaction open is refused: the jobs would be committed on their own,
    which is what this function exists to prevent. All or none: a bad event
    rolls back what this call wrote (a savepoint), never the service's work.
    ``now_ms`` None: this host's clock.
    """
    if not isinstance(con, sqlite3.Connection):
        raise ValueError(f"con must be a sqlite3.Connection, got {type(con).__name__}")
    if not con.in_transaction:
        raise ValueError("enqueue_in needs the service's open transaction (BEGIN, then the "
                         "service's writes, then enqueue_in, then COMMIT): con has none")
    now = wall_clock_ms() if now_ms is None else check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    available_at = now if not_before_ms is None else check_not_before(not_before_ms, now)
    cursor = con.cursor()
    cursor.row_factory = None  # the service's factory, whatever it is, is not ours
    with _store_errors():
        version = int(cursor.execute("PRAGMA user_version").fetchone()[0])
        if version != SCHEMA_VERSION:
            raise NotAQueue(f"the file holds no version {SCHEMA_VERSION} queue (version "
                            f"{version}): open it once with SQLiteStore(path, create=True, "
                            f"shared=True)")
        cursor.execute("SAVEPOINT lease_enqueue_in")
        try:
            results = judge_intake(_intake(cursor, events, now, available_at, policy),
                                   on_conflict)
        except BaseException:
            cursor.execute("ROLLBACK TO lease_enqueue_in")
            cursor.execute("RELEASE lease_enqueue_in")
            raise
        cursor.execute("RELEASE lease_enqueue_in")
    return results


def _insert(con: Union[sqlite3.Connection, sqlite3.Cursor], intake: Intake, now_ms: int,
            available_at: int, policy: RetryPolicy) -> bool:
    """Inside a transaction: a new pending job (True), or the duplicate kept
    (False). A keyed job is held until ``_promote`` finds it first in line."""
    row = con.execute("SELECT qty, digest, ordering_key FROM jobs WHERE id = ?",
                      (intake.id,)).fetchone()
    if row is not None:
        if (row[0], row[1], row[2]) != (intake.qty, intake.digest, intake.key):
            raise _conflict(intake, row[0], row[1], row[2])
        return False
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline, owner, lease_until, reason, digest, ordering_key, held)"
        " VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL, ?, ?, ?)",
        (intake.id, intake.qty, policy.max_attempts, available_at,
         available_at + policy.ttl_ms, intake.digest, intake.key,
         0 if intake.key is None else 1),
    )
    if intake.body is not None:
        con.execute("INSERT INTO bodies (seq, body) VALUES (last_insert_rowid(), ?)",
                    (intake.body,))
    return True


def _conflict(intake: Intake, qty: int, digest: Optional[str],
              key: Optional[str] = None) -> Conflict:
    """The intake's refusal of an id kept with other content, in every store's words."""
    return Conflict(f"job {intake.id!r} exists with other content "
                    f"({_content(qty, digest, key)}, not "
                    f"{_content(intake.qty, intake.digest, intake.key)})")


def _content(qty: int, digest: Optional[str], key: Optional[str]) -> str:
    text = f"qty {qty}" if digest is None else f"body sha256 {digest[:12]}..."
    return text if key is None else f"{text}, key {key!r:.40}"


# ------------------------------------------------------------------ ordered keys

# The first of a key's line, if the line has none marked (its first was
# delivered or cancelled, or the line is new): two index probes on the key.
_PROMOTE = f"""UPDATE jobs SET held = 0
WHERE seq = (SELECT f.seq FROM jobs f WHERE f.ordering_key = :key AND f.held = 1
    AND {_in_line("f")} ORDER BY f.seq LIMIT 1)
  AND NOT EXISTS (SELECT 1 FROM jobs c WHERE c.ordering_key = :key AND c.held = 0
    AND {_in_line("c")})"""

# A redriven job that was cancelled goes back to its place: the line's marked
# job, when it is later and not on the wire, waits again behind it.
_DEMOTE = f"""UPDATE jobs SET held = 1
WHERE ordering_key = :key AND held = 0 AND {_LINE} AND status <> 'leased'
  AND EXISTS (SELECT 1 FROM jobs f WHERE f.ordering_key = :key AND f.held = 1
    AND {_in_line("f")} AND f.seq < jobs.seq)"""

# The marked job of each key's line (the only one a claim may take).
_FIRSTS = f"""SELECT ordering_key, seq, id, status FROM jobs
WHERE ordering_key = ? AND held = 0 AND {_LINE}"""

# lease.worker._PICK less the held jobs, through the index of what may be taken;
# only what a lease (lease.worker._lease_rows) and its Leased need: every column
# read costs, and a done job's evidence is no claim's business. A picked
# job's body is one probe of its table, made for the rows returned only (the
# index gives the order: no join to sort again).
_PICK_READY_NAMES = (*_PICK_NAMES, "digest", "body")
_PICK_READY = f"""
SELECT {', '.join(_PICK_NAMES)}, digest,
  (SELECT b.body FROM bodies b WHERE b.seq = jobs.seq) AS body
FROM jobs INDEXED BY jobs_claimable
WHERE status IN ('pending', 'leased') AND held = 0
  AND ((status = 'pending' AND available_at <= :now)
    OR (status = 'leased' AND lease_until <= :now))
ORDER BY seq LIMIT :limit
"""


def _promote(con: Union[sqlite3.Connection, sqlite3.Cursor], keys: Iterable[str]) -> None:
    """Inside a transaction: each key's line given its first, if it has none."""
    for key in sorted(set(keys)):
        con.execute(_PROMOTE, {"key": key})


# Whether any key has a line at all: one probe of jobs_line. With none, no
# finish has a next job to promote, and the finished rows need no second read.
_ANY_LINE = f"SELECT EXISTS (SELECT 1 FROM jobs WHERE {_LINE})"


def _keys_of(con: sqlite3.Connection, seqs: list) -> list[str]:
    """The ordering keys of the rows ``seqs``."""
    if not seqs or not con.execute(_ANY_LINE).fetchone()[0]:
        return []
    marks = ", ".join("?" * len(seqs))
    return [key for (key,) in con.execute(
        f"SELECT DISTINCT ordering_key FROM jobs WHERE seq IN ({marks})"
        " AND ordering_key IS NOT NULL", seqs)]


def _rows_by_id(con: sqlite3.Connection, job_ids: list) -> dict[str, Any]:
    """Inside a transaction: what an operator's redrive or cancel judges of each
    named job (its marker, its reason and its key), by id."""
    unique = sorted(set(job_ids))
    if not unique:
        return {}
    marks = ", ".join("?" * len(unique))
    sql = (f"SELECT seq, id, status, reason, token, ordering_key FROM jobs"
           f" WHERE id IN ({marks})")
    return {row["id"]: row for row in _select(con, sql, unique)}


def _in_flight_refusals(rows: Mapping[str, Mapping], firsts: Mapping[str, Mapping],
                        results: list, job_ids: list) -> list:
    """Pure: a cancelled keyed job cannot go back in its line while a later job
    of its key is on the wire (two of a key would be delivered at once): its
    True becomes a ValueError. ``firsts``: key -> its marked job (seq, id,
    status). Every store calls this."""
    out = []
    for job_id, result in zip(job_ids, results, strict=True):
        row = rows.get(job_id)
        first = None if row is None or row["ordering_key"] is None \
            else firsts.get(row["ordering_key"])
        if (result is True and row is not None and row["reason"] == "cancelled"
                and first is not None and first["status"] == "leased"
                and first["seq"] > row["seq"]):
            out.append(ValueError(
                f"job {job_id!r} was cancelled and the later job {first['id']!r} of its key "
                f"{row['ordering_key']!r:.40} is being delivered: redrive it when that "
                f"one has finished"))
        else:
            out.append(result)
    return out


def _kept_audits(audits: list, results: list, job_ids: list) -> list:
    """Pure: of a redrive's audit rows (id, token), the ones whose id is still
    True at its first place in ``job_ids`` (where _redrive_decisions
    released it) once _in_flight_refusals has judged. Every store calls this.

    Each id's first result is found in a dict made in one pass: a scan of
    the list per id (list.index) made a redrive of 10,000 ids quadratic,
    0.8 s inside its write transaction."""
    first: dict = {}
    for job_id, result in zip(job_ids, results, strict=True):
        first.setdefault(job_id, result)
    return [(job_id, token) for job_id, token in audits if first[job_id] is True]


# ------------------------------------------------------------------ one attempt


class _NotExact(Exception):
    """A REAL in a batch read: JSON's text of it may round, so it is read again
    the contract's way."""


def _no_float(text: str) -> float:
    raise _NotExact(text)


_CHUNK = 64  # rows one UPDATE statement writes: 64 x 9 values stay under any SQLite's limit


class _OneStatement(_RowAtATime):
    """A claim's and a finish's batch in one SQLite step a statement, not one a row.

    Why: the store's thread hands the GIL back to the event loop at every step
    and must take it again after, and while the loop is busy every take waits
    (CPython's GIL is not fair to the thread that asked). A claim or a finish
    of 25 jobs took about 55 steps; with a thread as busy as a saturated
    event loop beside it a transaction of 25 rows measured 59 ms that way and
    0.5 ms this way, and the store alone costs 6-15% less CPU a job
    (``docs/benchmarks.md``). A read is one row, the batch as JSON (its
    payloads beside it, unescaped); a write is one ``UPDATE ... FROM (VALUES
    ...)``, or, when most rows set the same values, one ``UPDATE ... WHERE seq
    IN (...)`` for each set of values. Same rows, same values: any row JSON
    cannot carry exactly (a BLOB, a REAL) is read the contract's way.
    """

    def read(self, con: sqlite3.Connection, names: Tuple[str, ...], select: str,
             params: object) -> list:
        if names[-1] == "body":
            return self._read_with_bodies(con, names, select, params)
        columns = ", ".join(names)
        try:
            (text,) = _tuples(con, f"SELECT json_group_array(json_array({columns}))"
                                   f" FROM ({select})", params).fetchone()
            rows: list = json.loads(text, parse_float=_no_float)
        except (sqlite3.OperationalError, _NotExact):
            return super().read(con, names, select, params)
        return _in_seq_order(names, rows)

    def _read_with_bodies(self, con: sqlite3.Connection, names: Tuple[str, ...], select: str,
                          params: object) -> list:
        """A read whose last column is a payload: the other columns as JSON, the
        bodies beside them as they are, joined by a separator no JSON text holds
        unescaped (U+001E). Inside a JSON array each body would be escaped and
        unescaped again: 48 rows of 4 KB bodies full of quotes cost 101 us a row
        that way and 10 this way, and the store alone with 3.7 KB orders 180-195
        against 146-149 us a job. Both aggregates step through the same rows
        together. A body that is not text, or that holds the separator (written
        by other means), is read the contract's way."""
        columns = ", ".join(names[:-1])
        try:
            text, bodies, odd = _tuples(
                con, f"SELECT json_group_array(json_array({columns})),"
                     f" group_concat(CASE WHEN body IS NULL THEN 'n' ELSE 'b' || body END,"
                     f" char(30)), total(typeof(body) NOT IN ('text', 'null')) FROM ({select})",
                params).fetchone()
            rows: list = json.loads(text, parse_float=_no_float)
        except (sqlite3.OperationalError, _NotExact):
            return super().read(con, names, select, params)
        parts = [] if bodies is None else bodies.split("\x1e")
        if odd or len(parts) != len(rows):
            return super().read(con, names, select, params)
        for row, part in zip(rows, parts, strict=True):  # "n": NULL, "b" and the body's text
            row.append(None if part == "n" else part[1:])
        return _in_seq_order(names, rows)

    def update(self, con: sqlite3.Connection, fixed: str, names: Tuple[str, ...],
               rows: list) -> None:
        alike: dict[tuple, list] = {}
        for row in rows:
            sets = tuple(row[:-1])
            # with the types: 1, 1.0 and True are equal keys, but not the same value
            alike.setdefault((*sets, *map(type, sets)), []).append(row[-1])
        # A statement a group costs more than a VALUES row saves: only when
        # most rows share their values (a claim's fresh jobs, finishes of a burst).
        if len(alike) * 4 <= len(rows):
            for key, seqs in alike.items():
                self._update_alike(con, fixed, names, key[:len(names)], seqs)
            return
        width = len(names) + 1
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start:start + _CHUNK]
            size = _padded(len(chunk))
            values = [value for row in chunk for value in row]
            values += [None] * (width * (size - len(chunk)))  # seq NULL: a row matching none
            con.execute(_values_update(fixed, names, size), values)

    @staticmethod
    def _update_alike(con: sqlite3.Connection, fixed: str, names: Tuple[str, ...],
                      values: tuple, seqs: list) -> None:
        """Rows that set the same values (a claim's fresh jobs, the outcomes of
        a finish that share their latency): one ``UPDATE ... WHERE seq IN
        (...)``, which SQLite runs with a quarter less work a row than a join
        with VALUES."""
        for start in range(0, len(seqs), _CHUNK):
            chunk = seqs[start:start + _CHUNK]
            size = _padded(len(chunk))
            con.execute(_alike_update(fixed, names, size),
                        [*values, *chunk, *[None] * (size - len(chunk))])  # NULL: no row


def _in_seq_order(names: Tuple[str, ...], rows: list) -> list:
    """An aggregate keeps its select's order in fact, not by promise: rows
    led by their seq are put in its order."""
    if names[0] == "seq":
        rows.sort(key=itemgetter(0))
    return rows


def _padded(n: int) -> int:
    """1, 2, 4 ... 64: seven statements' shapes to cache, whatever the batch."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=64)
def _alike_update(fixed: str, names: Tuple[str, ...], size: int) -> str:
    sets = ", ".join([fixed, *(f"{name} = ?" for name in names)])
    return f"UPDATE jobs SET {sets} WHERE seq IN ({', '.join('?' * size)})"


@functools.lru_cache(maxsize=64)
def _values_update(fixed: str, names: Tuple[str, ...], size: int) -> str:
    width = len(names) + 1
    sets = ", ".join([fixed, *(f"{name} = v.column{i}" for i, name in enumerate(names, 1))])
    row = "(" + ", ".join("?" * width) + ")"
    return (f"UPDATE jobs SET {sets} FROM (VALUES {', '.join([row] * size)}) AS v"
            f" WHERE jobs.seq = v.column{width}")


def _one_statement_works() -> bool:
    """UPDATE ... FROM is SQLite 3.33's; the JSON functions may be left out of a build."""
    if sqlite3.sqlite_version_info < (3, 33, 0):
        return False
    probe = sqlite3.connect(":memory:")
    try:
        return probe.execute("SELECT json_group_array(json_array(1, 'a'))").fetchone() == (
            '[[1,"a"]]',)
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


# How this product's claims and finishes read and write their rows.
_BATCH: _RowAtATime = _OneStatement() if _one_statement_works() else _ROW_AT_A_TIME


def claim_jobs(
    con: sqlite3.Connection,
    owner: str,
    now_ms: int,
    lease_ms: int,
    limit: int = 1,
    fault: Fault = None,
) -> Tuple[list, dict]:
    """The contract's claim transaction with the product's lease range: up to
    ``limit`` Leased jobs (ticket and body), and the quarantine's moves by
    reason ({"deadline": n, "exhausted": m})."""
    _check_connection(con)
    check_identifier("owner", owner)
    check_now(now_ms)
    _check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    _check_int("limit", limit, 1, MAX_BATCH)
    _check_fault(fault)
    rows, tickets, moved = _claim_tx(con, owner, now_ms, lease_ms, limit, fault, _PICK_READY,
                                     _PICK_READY_NAMES, _BATCH)
    return [Leased(ticket, row["body"], row["digest"])
            for row, ticket in zip(rows, tickets, strict=True)], moved


def extend_lease(
    con: sqlite3.Connection,
    ticket: dict,
    now_ms: int,
    lease_ms: int,
    fault: Fault = None,
) -> Union[dict, bool]:
    """The contract's extension (whole-marker check) with the product's ranges."""
    _check_connection(con)
    check_ticket(ticket, PRODUCT)
    check_now(now_ms)
    _check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    _check_fault(fault)
    return _extend_tx(con, ticket, now_ms, lease_ms, fault)


def finish_jobs(
    con: sqlite3.Connection,
    items: list,
    now_ms: int,
    fault: Fault = None,
) -> list:
    """Record outcomes and their evidence in one transaction.

    ``items``: (ticket, outcome, delay_ms, Attempt). ``outcome`` is "ok",
    "retry", "permanent" — the contract's fenced finish — or None: an attempt
    that proved nothing (a bad ACK, an unclassified error), recorded as
    evidence while the job stays leased for its lease expiry to recover.
    Per item: (status, reason) as finish_batch gives it, False for a stale
    ticket (its attempt recorded, and counted in ``stale_finishes``), or
    ("leased", None) for an evidence-only item.
    """
    _check_connection(con)
    if type(items) is not list or len(items) > MAX_BATCH:
        raise ValueError(f"items must be a list of at most {MAX_BATCH}")
    for item in items:
        _check_item(item)
    check_now(now_ms)
    _check_fault(fault)
    finishing = [(t, o, d) for t, o, d, _ in items if o is not None]
    merged: list = []
    planned: list = []  # the evidence, planned once inside the transaction

    def plan(results: list) -> Tuple[list, list]:
        if not planned:
            outcomes = iter(results)
            merged.extend(next(outcomes) if outcome is not None else ("leased", None)
                          for _, outcome, _, _ in items)
            planned.extend(_plan_evidence(items, merged, _attempts_high(con), now_ms))
        return planned[0], planned[1]

    def evidence(results: list) -> Tuple[Tuple[str, ...], list]:
        # a delivery's evidence goes on its row in the finish's own UPDATE
        done, _ = plan(results)
        return _DONE_COLUMNS, [value for value, (_, outcome, _, _) in zip(done, items, strict=True)
                               if outcome is not None]

    def record(con: sqlite3.Connection, results: list, seqs: list) -> None:
        _, rows = plan(results)
        _record_attempts(con, rows, merged)
        found = iter(seqs)
        done = [next(found) if outcome is not None else None for _, outcome, _, _ in items]
        # a line whose first was delivered: the next one goes
        _promote(con, _keys_of(con, [seq for seq, result in zip(done, merged, strict=True)
                                     if result and result[0] == "done"]))

    _finish_tx(con, finishing, now_ms, fault, record, evidence, _BATCH)
    return merged


def _check_item(item: object) -> None:
    if type(item) is not tuple or len(item) != 4:
        raise ValueError("each item must be a tuple (ticket, outcome, delay_ms, Attempt)")
    ticket, outcome, delay_ms, attempt = item
    check_ticket(ticket, PRODUCT)
    if type(attempt) is Attempt:
        # The checks below in one expression, for the common case of a good
        # item; any miss goes through them one by one for the error's words.
        started, latency, status, error = attempt
        if ((outcome is None or (type(outcome) is str and outcome in OUTCOMES))
                and type(delay_ms) is int and 0 <= delay_ms <= PRODUCT.max_delay_ms
                and type(started) is int and 0 <= started <= MAX_NOW_MS
                and (latency is None or (type(latency) is int and 0 <= latency <= 10**12))
                and (status is None or (type(status) is int and 0 <= status <= 10**12))
                and (error is None or type(error) is str)):
            return
    if outcome is not None:
        check_outcome(outcome)
    _check_int("delay_ms", delay_ms, 0, PRODUCT.max_delay_ms)
    if not isinstance(attempt, Attempt):
        raise ValueError(f"evidence must be an Attempt, got {type(attempt).__name__}")
    check_now(attempt.started_ms, "attempt started_ms")
    for name in ("latency_ms", "http_status"):
        value = getattr(attempt, name)
        if value is not None:
            _check_int(f"attempt {name}", value, 0, 10**12)
    if attempt.error is not None and type(attempt.error) is not str:
        raise ValueError(f"attempt error must be None or a str, got "
                         f"{type(attempt.error).__name__}")


# The evidence of the attempt that made a job done, on its row (see version 1).
_DONE_COLUMNS = ("done_by", "done_started_ms", "done_latency_ms", "done_http_status",
                 "done_after")


def _plan_evidence(items: list, results: list, last: int, now_ms: int) -> Tuple[list, list]:
    """Pure: each attempt's evidence, ``last`` being the largest attempts seq
    yet. The attempt that made a job done goes on the job's row (per item its
    done_* values, None for every other item: its end is available_at); every
    other attempt (a retry, a refusal, a stale finish, evidence only) is an
    attempts row, numbered on from ``last``."""
    rows: list[tuple] = []
    done: list[Optional[tuple]] = []
    for (ticket, outcome, _, seen), result in zip(items, results, strict=True):
        if result is not False and result[0] == "done":
            done.append((ticket["owner"], seen.started_ms, seen.latency_ms, seen.http_status,
                         last + len(rows)))
            continue
        done.append(None)
        status, reason = ("stale", None) if result is False else result
        error = None if seen.error is None else seen.error[:MAX_ERROR_CHARS]
        rows.append((last + len(rows) + 1, ticket["id"], ticket["token"], ticket["attempt"],
                     ticket["owner"], seen.started_ms, now_ms, outcome or "none", status, reason,
                     seen.http_status, error, seen.latency_ms))
    return done, rows


def _record_attempts(con: sqlite3.Connection, rows: list, results: list) -> None:
    """Inside the finish transaction: the attempts rows, and the stale finishes counted."""
    if rows:
        con.executemany(
            "INSERT INTO attempts (seq, id, token, attempt, owner, started_ms, ended_ms,"
            " outcome, result, reason, http_status, error, latency_ms)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    stale = sum(1 for result in results if result is False)
    if stale:
        _tally(con, "stale_finishes", stale)


def _attempts_high(con: sqlite3.Connection) -> int:
    """The largest attempts seq ever written: a prune may have deleted the
    newest row, and a seq taken again would sort a later attempt before the
    delivery it followed (done_after)."""
    return int(con.execute(
        "SELECT MAX(COALESCE((SELECT MAX(seq) FROM attempts), 0),"
        " COALESCE((SELECT n FROM tallies WHERE name = 'attempts_seq'), 0))").fetchone()[0])


def _tally(con: sqlite3.Connection, name: str, n: int) -> None:
    con.execute("INSERT INTO tallies (name, n) VALUES (?, ?)"
                " ON CONFLICT (name) DO UPDATE SET n = n + excluded.n", (name, n))


# ------------------------------------------------------------------ the operator


def _check_ids(job_ids: object) -> list:
    if type(job_ids) is not list or len(job_ids) > MAX_BATCH:
        raise ValueError(f"job_ids must be a list of at most {MAX_BATCH}")
    for job_id in job_ids:
        check_job_id("job_id", job_id, PRODUCT)
    return job_ids


def redrive_jobs(
    con: sqlite3.Connection,
    job_ids: list,
    now_ms: int,
    ttl_ms: int,
    note: str,
    fault: Fault = None,
    actor: Optional[str] = None,
) -> list:
    """The contract's redrive (audit row and release together, token kept) with
    the product's ids, time to live and notes, and who did it (``actor``, in
    the audit row). Per id True or its ValueError."""
    _check_connection(con)
    _check_ids(job_ids)
    check_now(now_ms)
    _check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
    check_note(note)
    check_actor(actor)
    _check_fault(fault)
    with _immediate(con):
        rows = _rows_by_id(con, job_ids)
        results, audits, releases = _redrive_decisions(rows, job_ids)
        keys = sorted({row["ordering_key"] for row in rows.values()
                       if row["ordering_key"] is not None})
        firsts = {row["ordering_key"]: row for key in keys
                  for row in _select(con, _FIRSTS, (key,))}
        results = _in_flight_refusals(rows, firsts, results, job_ids)
        audits = _kept_audits(audits, results, job_ids)
        releases = [rows[job_id]["seq"] for job_id, _ in audits]
        if audits:
            con.executemany(
                "INSERT INTO redrives (id, token, at_ms, note, actor) VALUES (?, ?, ?, ?, ?)",
                [(job_id, token, now_ms, note, actor) for job_id, token in audits])
            _call(fault, "after-audit")
            # A cancelled job left its line: it comes back held, and the
            # demotion below gives it its place again.
            con.executemany(
                "UPDATE jobs SET status = 'pending', attempts = 0, available_at = ?,"
                " deadline = ?, owner = NULL, lease_until = NULL, reason = NULL,"
                " held = CASE WHEN ordering_key IS NOT NULL AND reason = 'cancelled'"
                " THEN 1 ELSE held END WHERE seq = ?",
                [(now_ms, now_ms + ttl_ms, seq) for seq in releases])
            for key in keys:
                con.execute(_DEMOTE, {"key": key})
            _promote(con, keys)
            _call(fault, "after-redrive")
    if audits:
        _call(fault, "after-commit")
    return results


def cancel_jobs(
    con: sqlite3.Connection,
    job_ids: list,
    now_ms: int,
    note: str,
    fault: Fault = None,
    actor: Optional[str] = None,
) -> list:
    """Cancel pending or dead jobs: each becomes dead/cancelled with an audit
    row in ``cancels`` (what it was, its token, the note), together.

    A leased job is refused (its send may be on the wire: let it finish or
    its lease run out, then cancel), and so is a done one. Per id True or
    the ValueError; a refusal does not stop the others. A cancelled job
    leaves the dead letters only by a redrive, like any dead job.
    Hooks: fault("after-audit"), fault("after-cancel"), fault("after-commit").
    """
    _check_connection(con)
    _check_ids(job_ids)
    check_now(now_ms)
    check_note(note)
    check_actor(actor)
    _check_fault(fault)
    with _immediate(con):
        rows = _rows_by_id(con, job_ids)
        results, audits = _cancel_decisions(rows, job_ids)
        if audits:
            con.executemany(
                "INSERT INTO cancels (id, token, at_ms, note, was, actor)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(job_id, token, now_ms, note, was, actor) for _, job_id, token, was in audits])
            _call(fault, "after-audit")
            con.executemany(
                "UPDATE jobs SET status = 'dead', reason = 'cancelled', available_at = ?,"
                " owner = NULL, lease_until = NULL WHERE seq = ?",
                [(now_ms, seq) for seq, _, _, _ in audits])
            # a line whose first was cancelled: the next one goes
            _promote(con, {rows[job_id]["ordering_key"] for _, job_id, _, _ in audits
                           if rows[job_id]["ordering_key"] is not None})
            _call(fault, "after-cancel")
    if audits:
        _call(fault, "after-commit")
    return results


def _cancel_decisions(rows: Mapping[str, Mapping], job_ids: list) -> Tuple[list, list]:
    """Pure: given the rows of the ids (id -> row with seq, id, status, reason,
    token), per id True or its ValueError, in order; the audit rows
    (seq, id, token, was). Every store calls this."""
    cancelled: set = set()
    results: list = []
    audits: list = []
    for job_id in job_ids:
        row = rows.get(job_id)
        if row is None:
            results.append(ValueError(f"job {job_id!r} does not exist"))
        elif job_id in cancelled or row["reason"] == "cancelled":
            results.append(ValueError(f"job {job_id!r} is already cancelled"))
        elif row["status"] not in ("pending", "dead"):
            results.append(ValueError(f"job {job_id!r} is {row['status']}: only a pending "
                                      f"or dead job can be cancelled"))
        else:
            cancelled.add(job_id)
            was = row["status"] if row["reason"] is None else f"{row['status']}/{row['reason']}"
            audits.append((row["seq"], job_id, row["token"], was))
            results.append(True)
    return results, audits


def prune_done(
    con: sqlite3.Connection,
    finished_before_ms: int,
    limit: int = MAX_BATCH,
) -> int:
    """Delete up to ``limit`` done jobs that finished before the cutoff, with
    their attempts and audit rows, in one transaction; how many. Live,
    dead and cancelled jobs are never touched. Call again until it returns
    0 for a large backlog: each transaction stays short. An id whose job was
    pruned is new again: enqueued again, it is a new job.
    """
    _check_connection(con)
    check_now(finished_before_ms, "finished_before_ms")
    _check_int("limit", limit, 1, MAX_BATCH)
    with _immediate(con):
        done = con.execute(
            "SELECT seq, id FROM jobs WHERE status = 'done' AND available_at < ?"
            " ORDER BY available_at LIMIT ?", (finished_before_ms, limit)).fetchall()
        ids = [(job_id,) for _, job_id in done]
        if done:  # the high-water mark outlives the rows: seqs are never taken again
            con.execute("INSERT INTO tallies (name, n) VALUES ('attempts_seq', ?)"
                        " ON CONFLICT (name) DO UPDATE SET n = MAX(n, excluded.n)",
                        (_attempts_high(con),))
        con.executemany("DELETE FROM attempts WHERE id = ?", ids)
        con.executemany("DELETE FROM redrives WHERE id = ?", ids)
        con.executemany("DELETE FROM cancels WHERE id = ?", ids)
        seqs = [(seq,) for seq, _ in done]
        con.executemany("DELETE FROM bodies WHERE seq = ?", seqs)
        con.executemany("DELETE FROM jobs WHERE seq = ?", seqs)
    return len(done)


# ------------------------------------------------------------------ the store


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def _store_errors() -> Iterator[None]:
    """sqlite3's errors in the store's words: a held write lock is Busy (a
    short pause cures it); a file that is not a database is NotAQueue; any
    other failure of the file is a StoreError. The transaction was rolled
    back in every case (``_immediate``)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise Busy(f"the queue file is locked by another writer: {exc}") from exc
        raise StoreError(f"queue file: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise NotAQueue(f"not a queue file: {exc}") from exc


class SQLiteStore:
    """The ``lease.store.Store`` of one SQLite file (the functions above, and
    ``lease.observe`` for the reads) on one connection: one thread at a time.

    The store's clock is this host's wall clock: every writer of a local file
    runs on the same host. ``connection`` is the file's sqlite3 connection,
    for the contract's own functions.
    """

    kind = "sqlite"
    threads = 1

    def __init__(self, path: Union[str, os.PathLike[str]], *, create: bool = False,
                 read_only: bool = False, clock: Optional[Callable[[], int]] = None,
                 migrate: bool = True, shared: bool = False,
                 journal: Optional[str] = None) -> None:
        """``migrate=False`` leaves a contract file at its version until the
        first intake migrates it in its own transaction (``enqueue_events``):
        an intake refused halfway then leaves the file exactly as it was.

        ``shared=True`` declares that the queue shares its file with a
        service's own tables (``open_shared``); a file declared so once is
        opened as shared ever after, by every store, without being told.

        ``journal`` switches the file's journal mode ("wal" or "delete", see
        ``open_store``); None keeps the one it has. A shared file keeps the
        service's."""
        self.name = _check_path(path, "queue")
        check_journal(journal)
        if journal is not None and (shared or read_only):
            raise ValueError("journal is not for a shared file (a shared file keeps the "
                             "service's journal mode) nor for a read-only store")
        self.read_only = read_only
        self.shared = False
        self._clock = clock or wall_clock_ms
        with _store_errors():
            if read_only:
                self.connection = observe.open_readonly(self.name)
                return
            if not create and not os.path.isfile(self.name):
                raise FileNotFoundError(f"queue file not found: {self.name}")
            found = None
            if shared or os.path.isfile(self.name):
                found = open_shared(self.name, create=create, declare=shared)
            if found is not None:
                self.connection, self.shared = found, True
                return
            if migrate or journal is not None:
                self.connection = open_store(self.name, create=create, journal=journal)
                return
            # a WAL file stays one: the contract's opener would insist on its journal
            self.connection = open_wal(self.name) if is_wal_file(self.name) \
                else open_queue(self.name, create=create)
            try:
                _check_version(self.connection)
            except BaseException:
                self.connection.close()
                raise

    def close(self) -> None:
        self.connection.close()

    @property
    def journal(self) -> str:
        """The file's journal mode: "delete" (the default), "wal", or a shared
        file's own."""
        with _store_errors():
            return journal_mode(self.connection)

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def now_ms(self) -> int:
        return check_now(self._clock(), "clock value")

    def _now(self, now_ms: Optional[int]) -> int:
        return self.now_ms() if now_ms is None else now_ms

    def schema_version(self) -> int:
        with _store_errors():
            return schema_version(self.connection)

    def enqueue_events(self, events: Iterable[object], policy: RetryPolicy = DEFAULT_POLICY, *,
                       now_ms: Optional[int] = None, not_before_ms: Optional[int] = None,
                       on_progress: Optional[Callable[[int], None]] = None,
                       on_conflict: str = "return") -> list:
        with _store_errors():
            return enqueue_events(self.connection, events, self._now(now_ms), policy,
                                  not_before_ms=not_before_ms, on_progress=on_progress,
                                  on_conflict=on_conflict)

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: Optional[int] = None, fault: Fault = None) -> Claimed:
        now = self._now(now_ms)
        with _store_errors():
            leased, moved = claim_jobs(self.connection, owner, now, lease_ms, limit, fault)
        return Claimed(leased, moved, now)

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: Optional[int] = None,
                     fault: Fault = None) -> Union[dict, bool]:
        with _store_errors():
            return extend_lease(self.connection, ticket, self._now(now_ms), lease_ms, fault)

    def finish_jobs(self, items: list, *, now_ms: Optional[int] = None,
                    fault: Fault = None) -> list:
        with _store_errors():
            return finish_jobs(self.connection, items, self._now(now_ms), fault)

    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: Optional[int] = None, fault: Fault = None,
                     actor: Optional[str] = None) -> list:
        with _store_errors():
            return redrive_jobs(self.connection, job_ids, self._now(now_ms), ttl_ms, note, fault,
                                actor)

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: Optional[int] = None,
                    fault: Fault = None, actor: Optional[str] = None) -> list:
        with _store_errors():
            return cancel_jobs(self.connection, job_ids, self._now(now_ms), note, fault, actor)

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int:
        with _store_errors():
            return prune_done(self.connection, finished_before_ms, limit)

    def counts(self) -> dict[str, int]:
        with _store_errors():
            return observe.counts(self.connection)

    def is_drained(self) -> bool:
        with _store_errors():
            return observe.is_drained(self.connection)

    def is_idle(self) -> bool:
        with _store_errors():
            return observe.is_idle(self.connection)

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]:
        _check_int("limit", limit, 1, MAX_BATCH)
        with _store_errors():
            return observe.blocked_heads(self.connection, limit)

    def snapshot(self, now_ms: Optional[int] = None) -> dict[str, Any]:
        with _store_errors():
            return observe.snapshot(self.connection, self._now(now_ms))

    def job_history(self, job_id: str) -> Optional[dict[str, Any]]:
        with _store_errors():
            return observe.job_history(self.connection, job_id)

    def dead_jobs(self, reason: Optional[str] = None, limit: Optional[int] = None, *,
                  key: Optional[str] = None) -> list[dict[str, Any]]:
        with _store_errors():
            return observe.dead_jobs(self.connection, reason, limit, key=key)

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]:
        with _store_errors():
            return observe.jobs_with_status(self.connection, status)

    def list_jobs(self, *, status: Optional[str] = None, reason: Optional[str] = None,
                  id_prefix: Optional[str] = None, after_seq: Optional[int] = None,
                  limit: int = 50, key: Optional[str] = None) -> list[dict[str, Any]]:
        with _store_errors():
            return observe.list_jobs(self.connection, status=status, reason=reason,
                                     id_prefix=id_prefix, after_seq=after_seq, limit=limit,
                                     key=key)

    def stale_finishes(self) -> int:
        with _store_errors():
            return stale_finishes(self.connection)
