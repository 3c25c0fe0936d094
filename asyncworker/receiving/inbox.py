"""The receiver's inbox: one SQLite file that deduplicates what it applies.

Two kinds of event arrive. A lab event ``{"id", "qty"}`` is deduplicated by
its id and quantity, and its effect is the stock. A payload event (any other
JSON object, named by its ``webhook-id``) is deduplicated by its id and the
sha256 of its canonical body (``lease.policy.canonical_body``: the same body
with its keys in another order is the same body), and its effect is its row.
An id is one event: another quantity or another body for it is a conflict.
The same event again is a duplicate, answered as one and applied zero times,
whatever its ``X-Lease-Token``: one lower than the highest seen for the id
(a superseded sender, or the event enqueued again after the queue pruned
its job, or by a second queue) is counted as a stale sender, and keeps the
highest token as it is.

One writer task owns the aiosqlite connection. Requests queue up for it; it
takes every request that is waiting (up to ``max_group``), applies them one by
one inside a single transaction, commits, and only then answers each of them:
a group commit, never an answer before durability. Because one task applies
everything in order, 50 concurrent requests for one ID apply exactly once.

A file is an inbox when its tables are exactly those of an inbox version; a
missing or empty file becomes one. Anything else (a queue, another database,
a directory, bytes that are not SQLite) is refused by ``probe_inbox`` before
it is touched. Versions, told apart by their tables (``PRAGMA user_version``
is written from version 3 on, and a file newer than this code is refused):

- 1: ``inbox`` and ``effect``;
- 2: ``refusals``, the conflicts and stale senders counted durably;
- 3: ``inbox.digest`` (payload events), ``pruned`` (what retention removed,
  so the all-time figures stay true) and an index on ``first_seen_ms``.

An older file is migrated forward in one transaction when it is opened for
writing, its rows kept; a crash leaves the old version whole.

Retention: ``prune_inbox`` deletes the rows first seen before a window. A
pruned row is a duplicate no longer absorbed: a resend of that id after the
window is applied again, as a new event. So choose the window longer than the
sender's whole retry budget (``lease.policy.RetryPolicy.ttl_ms``, three days
by default; the lab's jobs live 60 s), with a margin for a redrive of the
dead, which grants a fresh budget. The all-time figures (applied,
duplicates) count the pruned rows too; ``inbox_rows`` is what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import aiosqlite

from lease.clock import wall_clock_ms
from lease.worker import MAX_NOW_MS, check_now, check_path
from lease.worker import check_int as _check_int
from lease.worker import immediate as _immediate

INBOX_VERSION = 3  # PRAGMA user_version of the inbox this code writes
NEW = 0  # a missing or empty file: no version yet

_INBOX_V1 = ["id", "qty", "first_seen_ms", "seen", "max_token"]
# The tables of each inbox version, column by column: a file that holds
# exactly those of one version is an inbox; anything else is refused untouched.
_VERSIONS = {
    1: {"inbox": _INBOX_V1, "effect": ["one", "stock"]},
    2: {"inbox": _INBOX_V1, "effect": ["one", "stock"],
        "refusals": ["one", "conflicts", "stale"]},
    3: {"inbox": [*_INBOX_V1, "digest"], "effect": ["one", "stock"],
        "refusals": ["one", "conflicts", "stale"], "pruned": ["one", "rows", "seen"]},
}
_COLUMNS = _VERSIONS[INBOX_VERSION]

# Idempotent: on a current inbox they change nothing. The counters of an older
# version start at 0 (its past conflicts, stale senders and prunes left no row).
_SETUP = (
    """CREATE TABLE IF NOT EXISTS inbox (
  id TEXT PRIMARY KEY, qty INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL,
  seen INTEGER NOT NULL, max_token INTEGER, digest TEXT)""",
    """CREATE TABLE IF NOT EXISTS effect (
  one INTEGER PRIMARY KEY CHECK (one = 1), stock INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS refusals (
  one INTEGER PRIMARY KEY CHECK (one = 1), conflicts INTEGER NOT NULL, stale INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS pruned (
  one INTEGER PRIMARY KEY CHECK (one = 1), rows INTEGER NOT NULL, seen INTEGER NOT NULL)""",
    "INSERT OR IGNORE INTO effect (one, stock) VALUES (1, 0)",
    "INSERT OR IGNORE INTO refusals (one, conflicts, stale) VALUES (1, 0, 0)",
    "INSERT OR IGNORE INTO pruned (one, rows, seen) VALUES (1, 0, 0)",
    # retention deletes by age, oldest first, a batch at a time
    "CREATE INDEX IF NOT EXISTS inbox_first_seen ON inbox (first_seen_ms)",
)

# Every table and its columns, in one query, for inbox_kind().
_TABLES_QUERY = (
    "SELECT m.name, p.name FROM sqlite_master AS m, pragma_table_info(m.name) AS p"
    " WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY m.name, p.cid")

_SQLITE_MAGIC = b"SQLite format 3\x00"

APPLIED, DUPLICATE, CONFLICT, STALE = "applied", "duplicate", "conflict", "stale"
MAX_PRUNE_BATCH = 100_000


def inbox_kind(columns: list[tuple[str, str]], user_version: int = 0) -> int:
    """The inbox version (1..INBOX_VERSION) of a SQLite file from its (table,
    column) pairs, NEW if it has no tables; ValueError naming what it holds else."""
    tables: dict[str, list[str]] = {}
    for table, column in columns:
        tables.setdefault(table, []).append(column)
    if not tables:
        return NEW
    if user_version > INBOX_VERSION and "inbox" in tables:
        raise ValueError(f"it is an inbox of version {user_version}, newer than this "
                         f"code's {INBOX_VERSION}: open it with a newer receiver")
    for version, schema in _VERSIONS.items():
        if tables == schema:
            return version
    for name in sorted(tables):
        known = [schema[name] for schema in _VERSIONS.values() if name in schema]
        if known and tables[name] not in known:
            raise ValueError(f"table {name!r} has columns {tables[name]}, "
                             f"not an inbox's {_COLUMNS[name]}")
    raise ValueError(f"it holds the tables {sorted(tables)[:8]}, not an inbox's "
                     f"{sorted(_COLUMNS)}")


def check_max_group(max_group: object) -> int:
    if type(max_group) is not int or max_group < 1:
        raise ValueError(f"max_group must be an int >= 1, got {max_group!r}")
    return max_group


def probe_inbox(path: object) -> int:
    """What the file at ``path`` is for an inbox: NEW (missing or 0 bytes) or
    its version; ValueError naming the file and the problem otherwise (a
    directory, a missing folder, not a regular file, not SQLite, a foreign or
    newer database). Reads only: creates nothing, changes nothing, leaves no
    -wal/-shm/-journal file behind."""
    text = _check_path(path)
    where = Path(text)
    if where.is_dir():
        raise ValueError(f"inbox path is a directory: {text}")
    if not where.parent.is_dir():
        raise ValueError(f"inbox folder does not exist: {where.parent}")
    try:
        info = where.stat()
    except FileNotFoundError:
        return NEW
    except OSError as exc:
        raise ValueError(f"cannot read inbox file {text}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"inbox path is not a regular file: {text}")
    if info.st_size == 0:
        return NEW
    _check_magic(where, text)
    try:
        with contextlib.closing(_connect_readonly(where)) as con:
            kind = _kind_of(con, text)
    except sqlite3.Error as exc:
        raise ValueError(f"not an inbox file: {text} cannot be read as SQLite ({exc})") from None
    if kind == NEW:  # only a missing or empty file becomes an inbox
        raise ValueError(f"not an inbox file: {text} is a SQLite database with no tables")
    return kind


def _kind_of(con: sqlite3.Connection, text: str) -> int:
    columns = con.execute(_TABLES_QUERY).fetchall()
    user_version = con.execute("PRAGMA user_version").fetchone()[0]
    try:
        return inbox_kind(columns, user_version)
    except ValueError as exc:
        raise ValueError(f"not an inbox file: {text}: {exc}") from None


def _check_magic(where: Path, text: str) -> None:
    try:
        with where.open("rb") as file:
            magic = file.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise ValueError(f"cannot read inbox file {text}: {exc.strerror}") from None
    if magic != _SQLITE_MAGIC:
        raise ValueError(f"not an inbox file: {text} is not a SQLite database")


def _check_path(path: object) -> str:
    return check_path(path, "inbox path")  # the queue's rule, in the inbox's words


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection that cannot write, nor leave a -wal or -shm file behind.

    A read-only connection to a WAL file creates -wal and -shm and cannot
    remove them. With no -wal or -journal beside it, the main file is the
    whole database, so it is opened immutable (no locks, no side files); with
    one, those files exist already and a plain read-only open reads them.
    """
    side_files = any(path.with_name(path.name + end).exists() for end in ("-wal", "-journal"))
    uri = path.resolve().as_uri() + ("?mode=ro" if side_files else "?mode=ro&immutable=1")
    return sqlite3.connect(uri, uri=True, isolation_level=None)


def _connect_writer(path: str) -> sqlite3.Connection:
    """A writing connection, its settings each for a reason."""
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("PRAGMA synchronous=FULL")  # every COMMIT is on disk before we answer
        con.execute("PRAGMA busy_timeout=5000")  # another writer: wait a little, then fail
    except BaseException:
        con.close()
        raise
    return con


def set_up(con: sqlite3.Connection, path: str) -> None:
    """Create the tables, or migrate an older inbox forward, in one transaction;
    the file's contents are checked again under the write lock. Then WAL, so
    readers never block the group commit."""
    with _immediate(con):
        version = _kind_of(con, path)
        if version in (1, 2):
            con.execute("ALTER TABLE inbox ADD COLUMN digest TEXT")
        for statement in _SETUP:  # on a current inbox: no change at all
            con.execute(statement)
        if version != INBOX_VERSION:
            con.execute(f"PRAGMA user_version = {INBOX_VERSION}")
    mode = con.execute("PRAGMA journal_mode=WAL").fetchall()
    if mode != [("wal",)]:
        raise sqlite3.OperationalError(f"could not set journal_mode=WAL (got {mode})")


class Arrival(NamedTuple):
    """One validated request, as the inbox decides it."""

    id: str
    qty: int  # 1..1000 for a lab event; 0 for a payload event
    token: int | None = None
    digest: str | None = None  # sha256 of a payload's canonical body; None for a lab event


class Kept(NamedTuple):
    """What the inbox keeps of an id to decide the next arrival for it."""

    qty: int
    digest: str | None
    max_token: int | None


@dataclass(frozen=True)
class Delivery:
    """What the inbox made of one request."""

    outcome: str  # applied | duplicate | conflict | stale
    id: str
    qty: int
    digest: str | None = None
    known_qty: int | None = None  # of the row kept for this id
    known_digest: str | None = None
    max_token: int | None = None


def decide_group(known: dict[str, Kept], arrivals: list[Arrival]) -> list[Delivery]:
    """What each arrival of a group means, in order, as if applied one by one.

    ``known`` maps an id already in the inbox to what is kept of it; it is not
    changed. A pure function: the rules of the inbox live here alone. An id's
    event is its (qty, digest): equal is a duplicate, anything else a conflict,
    whatever the token. The token only tells a duplicate from a stale sender
    apart (one lower than the highest seen for the id: a superseded claim, or
    the same event enqueued again after a prune, or by another queue): STALE
    is a duplicate too, acknowledged, never applied, counted apart.
    """
    state = dict(known)
    deliveries = []
    for event_id, qty, token, digest in arrivals:
        kept = state.get(event_id)
        if kept is None:
            state[event_id] = Kept(qty, digest, token)
            deliveries.append(Delivery(APPLIED, event_id, qty, digest, qty, digest, token))
            continue
        max_token: int | None
        if (kept.qty, kept.digest) != (qty, digest):
            outcome, max_token = CONFLICT, kept.max_token
        elif token is not None and kept.max_token is not None and token < kept.max_token:
            outcome, max_token = STALE, kept.max_token
        else:
            outcome = DUPLICATE
            max_token = kept.max_token if token is None else max(token, kept.max_token or 0)
            state[event_id] = kept._replace(max_token=max_token)
        deliveries.append(Delivery(outcome, event_id, qty, digest, kept.qty, kept.digest,
                                   max_token))
    return deliveries


@dataclass
class InboxTotals:
    """The inbox file's durable figures, read at open (and again when another
    connection changed the file) and mirrored in memory after each COMMIT: the
    same before and after a restart.

    Applied and duplicates are derived from the rows (each row was applied
    once and seen ``seen`` times) and from what retention pruned, so they
    need no counter of their own; conflicts and stale senders leave no row,
    and are counted in the file.
    """

    rows: int = 0  # in the file now
    stock: int = 0
    seen: int = 0  # requests that reached a committed row: applied + duplicates, all time
    conflicts: int = 0
    stale: int = 0
    pruned: int = 0  # rows deleted by retention, all time

    @property
    def applied(self) -> int:
        return self.rows + self.pruned

    @property
    def duplicates(self) -> int:
        return self.seen - self.applied


def _totals_query(version: int) -> str:
    """One statement (one snapshot) for InboxTotals, on a file of any version."""
    refusals = ("COALESCE((SELECT conflicts FROM refusals), 0),"
                " COALESCE((SELECT stale FROM refusals), 0)") if version >= 2 else "0, 0"
    pruned = ("COALESCE((SELECT rows FROM pruned), 0),"
              " COALESCE((SELECT seen FROM pruned), 0)") if version >= 3 else "0, 0"
    return ("SELECT (SELECT COUNT(*) FROM inbox), (SELECT COALESCE(SUM(seen), 0) FROM inbox),"
            f" COALESCE((SELECT stock FROM effect), 0), {refusals}, {pruned}")


def _totals(row: tuple) -> InboxTotals:
    rows, seen, stock, conflicts, stale, pruned_rows, pruned_seen = row
    return InboxTotals(rows, stock, seen + pruned_seen, conflicts, stale, pruned_rows)


@dataclass(frozen=True)
class InboxContents:
    """What an inbox file holds, read in one transaction."""

    applied: dict  # id -> qty (a lab event) or the body's sha256 (a payload event)
    seen: int  # arrivals that reached a row: applied + duplicates, all time
    stock: int
    conflicts: int
    stale: int
    pruned: int = 0  # rows deleted by retention, all time (not in ``applied``)


def read_inbox(path: str | Path) -> InboxContents:
    """Read an inbox file (synchronously, writing nothing): for evidence and checks.

    ValueError if there is no inbox at ``path``; an empty file reads as empty.
    """
    kind = probe_inbox(path)
    if kind == NEW:
        if not Path(path).exists():
            raise ValueError(f"inbox file not found: {os.fsdecode(path)}")
        return InboxContents({}, 0, 0, 0, 0)
    content = "COALESCE(digest, qty)" if kind >= 3 else "qty"
    with contextlib.closing(_connect_readonly(Path(path))) as con:
        con.execute("BEGIN")
        applied = dict(con.execute(f"SELECT id, {content} FROM inbox").fetchall())
        totals = _totals(con.execute(_totals_query(kind)).fetchone())
        con.execute("COMMIT")
    return InboxContents(applied, totals.seen, totals.stock, totals.conflicts, totals.stale,
                         totals.pruned)


def prune_inbox(path: str | os.PathLike, older_than_ms: int, *, now_ms: int,
                batch: int = 10_000) -> int:
    """Delete the rows first seen before ``now_ms - older_than_ms``, oldest
    first, ``batch`` rows per transaction; return how many.

    A pruned row is a duplicate no longer absorbed (see the module's
    docstring): choose ``older_than_ms`` longer than the sender's whole retry
    budget. Safe while ``serve`` runs on the same file: each batch is a short
    transaction, and a busy file is waited for (5 s) before failing.

    ValueError, with nothing changed, for bad arguments, a missing file or one
    that holds no inbox; an empty file holds no rows (0, left as it is). An
    older inbox is migrated forward first. sqlite3.OperationalError naming
    the file if it cannot be written (read-only, locked for too long).
    """
    check_now(now_ms)
    _check_int("older_than_ms", older_than_ms, 0, MAX_NOW_MS)  # longer than the clock: none
    _check_int("batch", batch, 1, MAX_PRUNE_BATCH)
    text = _check_path(path)
    if probe_inbox(text) == NEW:
        if not Path(text).exists():
            raise ValueError(f"inbox file not found: {text}")
        return 0
    try:
        with contextlib.closing(_connect_writer(text)) as con:
            set_up(con, text)
            return _prune(con, now_ms - older_than_ms, batch)
    except sqlite3.OperationalError as exc:
        raise sqlite3.OperationalError(f"cannot prune inbox file {text}: {exc}") from None


def _prune(con: sqlite3.Connection, before_ms: int, batch: int) -> int:
    total = 0
    while True:
        with _immediate(con):
            doomed = con.execute(
                "SELECT rowid, seen FROM inbox WHERE first_seen_ms < ?"
                " ORDER BY first_seen_ms LIMIT ?", (before_ms, batch)).fetchall()
            if doomed:  # nothing to delete writes nothing
                con.executemany("DELETE FROM inbox WHERE rowid = ?",
                                [(rowid,) for rowid, _ in doomed])
                # in the same transaction: applied and duplicates stay true
                con.execute("UPDATE pruned SET rows = rows + ?, seen = seen + ? WHERE one = 1",
                            (len(doomed), sum(seen for _, seen in doomed)))
        total += len(doomed)
        if len(doomed) < batch:
            return total


class InboxClosed(RuntimeError):
    """The inbox is shutting down and takes no more requests."""


class Inbox:
    """Open with ``await Inbox.open(path)``; ``await inbox.deliver(id, qty, token)``
    for a lab event, ``await inbox.deliver(id, 0, token, digest)`` for a payload."""

    def __init__(self, db: aiosqlite.Connection, max_group: int) -> None:
        self._db = db
        self._max_group = max_group
        self._waiting: asyncio.Queue[tuple | None] = asyncio.Queue()
        self._writer: asyncio.Task | None = None
        # One user of the connection at a time: a group's transaction, or a
        # refresh of the figures, never a read in the middle of a transaction.
        self._using = asyncio.Lock()
        self._data_version: int | None = None
        self.totals = InboxTotals()
        self.commits = 0  # commits by this process
        self.grouped = 0  # requests those commits answered

    @classmethod
    async def open(cls, path: str | Path, *, max_group: int = 64) -> Inbox:
        """Open the inbox at ``path``, creating it if the file is missing or empty.

        ValueError, with nothing created or changed, for a path that holds no
        inbox (see probe_inbox); ValueError too if SQLite cannot open it for
        writing. An older inbox is migrated forward in one transaction.
        """
        check_max_group(max_group)
        text = _check_path(path)
        probe_inbox(text)
        try:
            await asyncio.to_thread(_prepare, text)
            db = await aiosqlite.connect(text, isolation_level=None)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open inbox file {text}: {exc}") from None
        try:
            await db.execute("PRAGMA synchronous=FULL")  # every COMMIT on disk before we answer
            await db.execute("PRAGMA busy_timeout=5000")  # a prune's batch: wait, then fail
            inbox = cls(db, max_group)
            await inbox._reload_if_changed()
        except sqlite3.Error as exc:
            await db.close()
            raise ValueError(f"cannot open inbox file {text}: {exc}") from None
        except BaseException:
            await db.close()
            raise
        inbox._writer = asyncio.create_task(inbox._write_loop(), name="inbox writer")
        return inbox

    async def _reload_if_changed(self) -> None:
        """Read the figures again if another connection (a prune) changed the
        file since they were read; a cheap check, so done before each use."""
        (version,), = await self._db.execute_fetchall("PRAGMA data_version")
        if version == self._data_version:
            return
        async with self._db.execute(_totals_query(INBOX_VERSION)) as cur:
            row = await cur.fetchone()
        assert row is not None  # an aggregate query has one row
        self.totals = _totals(tuple(row))
        self._data_version = version

    async def refresh(self) -> None:
        """Bring the figures up to date with the file (after a prune)."""
        if self._writer is None or self._writer.done():
            return  # closing: the figures were refreshed on the way out
        async with self._using:
            await self._reload_if_changed()

    async def deliver(self, event_id: str, qty: int, token: int | None,
                      digest: str | None = None) -> Delivery:
        """Queue one validated request and wait until its group has committed.

        A lab event has qty 1..1000 and no digest; a payload event qty 0 and
        its body's digest."""
        if self._writer is None or self._writer.done():
            raise InboxClosed("inbox is closed")
        answer: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        await self._waiting.put((Arrival(event_id, qty, token, digest), answer))
        return await answer

    async def close(self) -> None:
        """Apply what is already queued, then stop the writer and close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await self._waiting.put(None)
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        try:
            async with self._using:
                await self._reload_if_changed()  # the final figures are the file's
        except sqlite3.Error:
            pass  # the figures of the last commit stand; closing must not fail
        finally:
            await self._db.close()

    async def _write_loop(self) -> None:
        while True:
            first = await self._waiting.get()
            if first is None:
                return
            group = [first]
            while len(group) < self._max_group and not self._waiting.empty():
                item = self._waiting.get_nowait()
                if item is None:
                    await self._commit_group(group)
                    return
                group.append(item)
            await self._commit_group(group)

    async def _commit_group(self, group: list) -> None:
        answers = [answer for _, answer in group]
        try:
            # Shielded: a shutdown must not cut a transaction in half.
            deliveries = await asyncio.shield(self._apply([arrival for arrival, _ in group]))
        except Exception as exc:
            for answer in answers:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for answer, delivery in zip(answers, deliveries, strict=False):
            if not answer.done():
                answer.set_result(delivery)

    async def _apply(self, arrivals: list[Arrival]) -> list[Delivery]:
        """One transaction for the whole group, in a fixed number of statements
        (one read, then batched writes), so its cost barely grows with its size."""
        async with self._using:
            now_ms = wall_clock_ms()
            await self._db.execute("BEGIN IMMEDIATE")
            try:
                await self._reload_if_changed()  # a prune since: mirror the file, not the past
                known = await self._known(sorted({arrival.id for arrival in arrivals}))
                deliveries = decide_group(known, arrivals)
                await self._write(deliveries, now_ms)
                await self._db.execute("COMMIT")
            except BaseException:
                await self._db.execute("ROLLBACK")
                raise
            self._count(deliveries)
            return deliveries

    async def _known(self, ids: list[str]) -> dict[str, Kept]:
        """What is kept of the ids already in the inbox."""
        known: dict[str, Kept] = {}
        for start in range(0, len(ids), 500):  # well under SQLite's variable limit
            chunk = ids[start:start + 500]
            rows = await self._db.execute_fetchall(
                f"SELECT id, qty, digest, max_token FROM inbox WHERE id IN "
                f"({', '.join('?' * len(chunk))})", chunk)
            known.update({row[0]: Kept(*row[1:]) for row in rows})
        return known

    async def _write(self, deliveries: list[Delivery], now_ms: int) -> None:
        fresh = {d.id: d for d in deliveries if d.outcome == APPLIED}
        seen: dict[str, int] = {}
        for d in deliveries:
            if d.outcome in (APPLIED, DUPLICATE):
                seen[d.id] = seen.get(d.id, 0) + 1
        final_token = {d.id: d.max_token for d in deliveries if d.outcome in (APPLIED, DUPLICATE)}
        if fresh:
            await self._db.executemany(
                "INSERT INTO inbox (id, qty, first_seen_ms, seen, max_token, digest)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(i, d.qty, now_ms, seen[i], final_token[i], d.digest) for i, d in fresh.items()])
            await self._db.execute("UPDATE effect SET stock = stock + ? WHERE one = 1",
                                   (sum(d.qty for d in fresh.values()),))
        again = [(seen[i], final_token[i], i) for i in seen if i not in fresh]
        if again:
            await self._db.executemany(
                "UPDATE inbox SET seen = seen + ?, max_token = ? WHERE id = ?", again)
        refused = [sum(d.outcome == outcome for d in deliveries) for outcome in (CONFLICT, STALE)]
        if any(refused):  # in the same transaction: the figures survive a restart
            await self._db.execute("UPDATE refusals SET conflicts = conflicts + ?,"
                                   " stale = stale + ? WHERE one = 1", refused)

    def _count(self, deliveries: list[Delivery]) -> None:
        """Mirror what was just committed, so the figures are read without a query."""
        totals = self.totals
        self.commits += 1
        self.grouped += len(deliveries)
        for delivery in deliveries:
            if delivery.outcome == APPLIED:
                totals.rows += 1
                totals.stock += delivery.qty
            if delivery.outcome in (APPLIED, DUPLICATE):
                totals.seen += 1
            totals.conflicts += delivery.outcome == CONFLICT
            totals.stale += delivery.outcome == STALE


def _prepare(path: str) -> None:
    """The tables, created or migrated, on a connection of its own: the same
    transaction as prune's, run once before the writer's connection opens."""
    with contextlib.closing(_connect_writer(path)) as con:
        set_up(con, path)


def read_arrivals(path: str | Path) -> dict[str, tuple[int, int | None]]:
    """Each id's arrivals at the inbox file: (times seen, the highest claim
    token seen, None for requests that carried none). Writes nothing; the ids
    retention pruned are not there. ValueError if there is no inbox at ``path``."""
    if probe_inbox(path) == NEW:
        if not Path(path).exists():
            raise ValueError(f"inbox file not found: {os.fsdecode(path)}")
        return {}
    with contextlib.closing(_connect_readonly(Path(path))) as con:
        return {job_id: (seen, token) for job_id, seen, token in
                con.execute("SELECT id, seen, max_token FROM inbox").fetchall()}
