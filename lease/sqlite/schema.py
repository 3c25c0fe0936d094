"""The SQLite driver's schema: versions, migrations, opening, journals, sharing."""

from __future__ import annotations

import os
import sqlite3

from lease.rules import TABLES
from lease.sqlite.reads import BODIES_SINCE
from lease.sqlite.statements import DUE_LINE, LINE, OWN_READY, REST_LINE
from lease.worker import (
    CONTRACT_SCHEMA,
    NotAQueue,
    StoreError,
    check_connection,
    check_path,
    check_schema,
    connect_file,
    immediate,
    open_file,
    open_queue,
)

SCHEMA_VERSION = 9
ENDPOINTS_SINCE = 5  # the version that knows endpoints (lease.endpoints)
CONSOLE_SINCE = 6  # the version with the pause, its audit and the workers (lease.rules)
ROLLUP_SINCE = 7  # the version with the per-minute rollup of the finishes (lease.rules)
PRIORITY_SINCE = 8  # the version with each job's priority (lease.policy.check_priority)
REST_SINCE = 9  # the version whose lease of a delivery leaves its per-endpoint index alone

MIGRATIONS: dict[int, tuple[str, ...]] = {
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
        f"CREATE INDEX jobs_line ON jobs(ordering_key, held, seq) WHERE {LINE}",
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
    ENDPOINTS_SINCE: (
        # Endpoints as data (lease.endpoints). A job of the queue's own has
        # NULL in all three; a delivery names its endpoint and its message.
        "ALTER TABLE jobs ADD COLUMN endpoint TEXT",
        "ALTER TABLE jobs ADD COLUMN message TEXT",
        "ALTER TABLE jobs ADD COLUMN event_type TEXT",
        """CREATE TABLE endpoints (name TEXT PRIMARY KEY, url TEXT NOT NULL, ack TEXT NOT NULL,
  ca_file TEXT, secrets TEXT NOT NULL, headers TEXT NOT NULL, types TEXT NOT NULL,
  max_in_flight INTEGER, rate REAL, burst INTEGER, insecure_http INTEGER NOT NULL,
  enabled INTEGER NOT NULL, tokens REAL NOT NULL, refilled_ms INTEGER NOT NULL,
  has_work INTEGER NOT NULL, served_at INTEGER NOT NULL,
  created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL,
  circuit TEXT NOT NULL DEFAULT 'closed', circuit_since_ms INTEGER, circuit_why TEXT,
  failures INTEGER NOT NULL DEFAULT 0, window_ms INTEGER,
  window_failed INTEGER NOT NULL DEFAULT 0, window_total INTEGER NOT NULL DEFAULT 0,
  open_until_ms INTEGER, cooldown_ms INTEGER NOT NULL DEFAULT 0, paused_until_ms INTEGER,
  failing_since_ms INTEGER, disable_after_ms INTEGER, disabled_why TEXT,
  saved INTEGER NOT NULL DEFAULT 0)""",
        """CREATE TABLE endpoint_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  endpoint TEXT NOT NULL, at_ms INTEGER NOT NULL, action TEXT NOT NULL, fields TEXT NOT NULL,
  note TEXT, actor TEXT)""",
        # jobs_claimable under another name again, now for the queue's own
        # jobs only: an older dispatcher (INDEXED BY jobs_claimable) would
        # send deliveries to its own --url; its claims now fail whole instead.
        "DROP INDEX jobs_claimable",
        f"CREATE INDEX jobs_own ON jobs(seq) WHERE {OWN_READY}",
        # An endpoint's due deliveries, in the order they became due, and
        # its leases (live and run out), each one index range per endpoint.
        f"CREATE INDEX jobs_endpoint_due ON jobs(endpoint, available_at, seq) WHERE {DUE_LINE}",
        "CREATE INDEX jobs_in_flight ON jobs(endpoint, lease_until)"
        " WHERE status = 'leased' AND endpoint IS NOT NULL",
        # The rotation: the endpoints with work, the least recently served first.
        "CREATE INDEX endpoints_rotation ON endpoints(served_at, name)"
        " WHERE has_work = 1 AND enabled = 1",
        "CREATE INDEX jobs_by_message ON jobs(message) WHERE message IS NOT NULL",
        "CREATE INDEX jobs_by_endpoint ON jobs(endpoint, status) WHERE endpoint IS NOT NULL",
    ),
    CONSOLE_SINCE: (
        # The W3C trace context its intake ran in; NULL: none.
        "ALTER TABLE jobs ADD COLUMN trace TEXT",
        # One row while the queue is paused: every claim reads this tiny table.
        """CREATE TABLE pause (id INTEGER PRIMARY KEY CHECK (id = 1),
  since_ms INTEGER NOT NULL, actor TEXT, note TEXT NOT NULL)""",
        """CREATE TABLE queue_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  at_ms INTEGER NOT NULL, action TEXT NOT NULL, note TEXT NOT NULL, actor TEXT)""",
        # A dispatcher at work: host and pid from its registration, the last
        # claim from each claim that names it (one UPSERT a claim).
        """CREATE TABLE workers (owner TEXT PRIMARY KEY, host TEXT, pid INTEGER,
  started_ms INTEGER, last_claim_ms INTEGER, last_claimed INTEGER NOT NULL DEFAULT 0)
  WITHOUT ROWID""",
    ),
    ROLLUP_SINCE: (
        # The finishes per minute, endpoint ('' for the queue's own jobs) and
        # owner, and their send latencies in fixed buckets (lease.rules).
        """CREATE TABLE minutes (minute_ms INTEGER NOT NULL, endpoint TEXT NOT NULL,
  owner TEXT NOT NULL, done INTEGER NOT NULL, retried INTEGER NOT NULL, dead INTEGER NOT NULL,
  b0 INTEGER NOT NULL,
  b1 INTEGER NOT NULL,
  b2 INTEGER NOT NULL,
  b3 INTEGER NOT NULL,
  b4 INTEGER NOT NULL,
  b5 INTEGER NOT NULL,
  b6 INTEGER NOT NULL,
  b7 INTEGER NOT NULL,
  b8 INTEGER NOT NULL,
  b9 INTEGER NOT NULL,
  b10 INTEGER NOT NULL,
  b11 INTEGER NOT NULL,
  b12 INTEGER NOT NULL,
  b13 INTEGER NOT NULL,
  b14 INTEGER NOT NULL,
  b15 INTEGER NOT NULL, PRIMARY KEY (minute_ms, endpoint, owner)) WITHOUT ROWID""",
    ),
    PRIORITY_SINCE: (
        # Higher is claimed first; the jobs written before are all 0. A
        # column with a constant default: adding it rewrites no row.
        "ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
        # The claim's two indexes lead with it, so each claim still reads its
        # rows in the order it takes them. Same names: an older dispatcher
        # still running (INDEXED BY) keeps claiming, in its old order.
        "DROP INDEX jobs_own",
        f"CREATE INDEX jobs_own ON jobs(priority DESC, seq) WHERE {OWN_READY}",
        "DROP INDEX jobs_endpoint_due",
        "CREATE INDEX jobs_endpoint_due ON jobs(endpoint, priority DESC, available_at, seq)"
        f" WHERE {DUE_LINE}",
    ),
    REST_SINCE: (
        # jobs_by_endpoint (endpoint, status) held every delivery, so each
        # lease and each finish moved its entry from one status to another:
        # two B-tree writes a row, and pages to journal and sync at each
        # commit. jobs_endpoint_rest holds only what neither claim index holds
        # (the held behind their line's first, the done, the dead): a lease
        # leaves it alone, a finish adds the entry once. The stats count the
        # three indexes. A new name: an older dispatcher's reads of the old
        # one (INDEXED BY) fail whole, as errors, and change nothing.
        "DROP INDEX jobs_by_endpoint",
        f"CREATE INDEX jobs_endpoint_rest ON jobs(endpoint, status) WHERE {REST_LINE}",
        # An endpoint's deliveries in seq order, whatever their status: the
        # operator's pages of one endpoint. Its terms name no column a lease
        # or a finish changes, so neither writes it; an intake writes it
        # where it wrote jobs_by_endpoint.
        "CREATE INDEX jobs_of_endpoint ON jobs(endpoint) WHERE endpoint IS NOT NULL",
        # seq is the rowid, which every index entry ends with already: the
        # claim's two indexes keep their order without it, in smaller entries
        # (fewer pages to rebalance as a claim empties the front of each).
        # Same names: an older dispatcher's pick (INDEXED BY) still runs.
        "DROP INDEX jobs_own",
        f"CREATE INDEX jobs_own ON jobs(priority DESC) WHERE {OWN_READY}",
        "DROP INDEX jobs_endpoint_due",
        f"CREATE INDEX jobs_endpoint_due ON jobs(endpoint, priority DESC, available_at)"
        f" WHERE {DUE_LINE}",
    ),
}

# ------------------------------------------------------------------ opening


def schema_version(con: sqlite3.Connection) -> int:
    return int(con.execute("PRAGMA user_version").fetchone()[0])


def open_store(path: str | os.PathLike[str], *, create: bool = True,
               journal: str | None = None) -> sqlite3.Connection:
    """Open a queue for the product: the contract's ``open_queue`` (its
    settings, its refusal of foreign files), then the migrations up to
    SCHEMA_VERSION, in one transaction. A newer file is a ValueError.

    A file in WAL mode stays in it (``open_wal``: the contract's opener would
    insist on its rollback journal, and cannot switch a WAL file that another
    process has open). ``journal`` ("wal" or "delete") switches the file's
    mode, which needs the file to itself; None keeps what the file has."""
    text = check_path(path, "queue")
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
    return open_file(text, False, None)


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
    check_connection(con)
    before = check_version(con)
    if before < SCHEMA_VERSION:
        with immediate(con):
            before = migrate_here(con)
    _check_tables(con)
    return before


def migrate_here(con: sqlite3.Connection) -> int:
    """Inside a write transaction: the migrations still missing; the version
    the file had (another process may have migrated it meanwhile)."""
    before = check_version(con)
    for version in range(before + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[version]:
            con.execute(statement)
    if before < SCHEMA_VERSION:
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return before


def check_version(con: sqlite3.Connection) -> int:
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


def open_shared(path: str | os.PathLike[str], *, create: bool = False,
                declare: bool = False) -> sqlite3.Connection | None:
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
    text = check_path(path, "queue")
    con = connect_file(text, create)
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
            with immediate(con):
                _make_shared(con, declared)
        check_version(con)
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
        check_schema(con)  # the contract's columns, or NotAQueue
    elif schema_version(con) != 0:  # the service numbers its own schema there
        raise NotAQueue("PRAGMA user_version of the file is "
                        f"{schema_version(con)}: a shared queue keeps its version there")
    for statement in CONTRACT_SCHEMA:
        con.execute(statement)
    migrate_here(con)
    if not declared:
        con.execute(_META)
        con.execute("INSERT OR REPLACE INTO lease_meta (name, value) VALUES ('shared', '1')")


def _check_tables(con: sqlite3.Connection) -> None:
    for name, columns in TABLES.items():
        found = [row[1] for row in con.execute(f"PRAGMA table_info({name})")]
        if found != columns:
            raise NotAQueue(f"not a version {SCHEMA_VERSION} queue: table {name!r} has "
                             f"columns {found}")


