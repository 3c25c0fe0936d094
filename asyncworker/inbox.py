"""The receiver's inbox: one SQLite file that deduplicates by ID and quantity.

One writer task owns the aiosqlite connection. Requests queue up for it; it
takes every request that is waiting (up to ``max_group``), applies them one by
one inside a single transaction, commits, and only then answers each of them:
a group commit, never an answer before durability. Because one task applies
everything in order, 50 concurrent requests for one ID apply exactly once.

A file is an inbox when its tables are exactly the inbox's; a missing or empty
file becomes one. Anything else (a queue, another database, a directory, bytes
that are not SQLite) is refused by ``probe_inbox`` before it is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import aiosqlite

# The tables of an inbox, column by column: a file that holds exactly these is
# an inbox; one that holds anything else is refused untouched.
_COLUMNS = {
    "inbox": ["id", "qty", "first_seen_ms", "seen", "max_token"],
    "effect": ["one", "stock"],
    "refusals": ["one", "conflicts", "stale"],
}
# An inbox made before refusals were counted durably: it opens, migrated forward.
_FIRST_TABLES = ("inbox", "effect")
NEW, FIRST, CURRENT = "new", "first", "current"

# Idempotent: on a current inbox it changes nothing; on a first-version inbox it
# adds the refusals row (the conflicts and stale senders of the past left no
# row behind, so they start at 0; duplicates need no migration, see InboxTotals).
_SETUP = (
    """CREATE TABLE IF NOT EXISTS inbox (
  id TEXT PRIMARY KEY, qty INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL,
  seen INTEGER NOT NULL, max_token INTEGER)""",
    """CREATE TABLE IF NOT EXISTS effect (
  one INTEGER PRIMARY KEY CHECK (one = 1), stock INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS refusals (
  one INTEGER PRIMARY KEY CHECK (one = 1), conflicts INTEGER NOT NULL, stale INTEGER NOT NULL)""",
    "INSERT OR IGNORE INTO effect (one, stock) VALUES (1, 0)",
    "INSERT OR IGNORE INTO refusals (one, conflicts, stale) VALUES (1, 0, 0)",
)

# Every table and its columns, in one query, for inbox_kind().
_TABLES_QUERY = (
    "SELECT m.name, p.name FROM sqlite_master AS m, pragma_table_info(m.name) AS p"
    " WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY m.name, p.cid")

_SQLITE_MAGIC = b"SQLite format 3\x00"

APPLIED, DUPLICATE, CONFLICT, STALE = "applied", "duplicate", "conflict", "stale"


def inbox_kind(columns: list[tuple[str, str]]) -> str:
    """NEW (no tables), FIRST (an inbox of the first version) or CURRENT, from the
    (table, column) pairs of a SQLite file; ValueError naming what it holds else."""
    tables: dict[str, list[str]] = {}
    for table, column in columns:
        tables.setdefault(table, []).append(column)
    if not tables:
        return NEW
    for name in sorted(tables):
        if name in _COLUMNS and tables[name] != _COLUMNS[name]:
            raise ValueError(f"table {name!r} has columns {tables[name]}, "
                             f"not an inbox's {_COLUMNS[name]}")
    if sorted(tables) == sorted(_COLUMNS):
        return CURRENT
    if sorted(tables) == sorted(_FIRST_TABLES):
        return FIRST
    raise ValueError(f"it holds the tables {sorted(tables)[:8]}, not an inbox's "
                     f"{sorted(_COLUMNS)}")


def check_max_group(max_group: object) -> int:
    if type(max_group) is not int or max_group < 1:
        raise ValueError(f"max_group must be an int >= 1, got {max_group!r}")
    return max_group


def probe_inbox(path: object) -> str:
    """What the file at ``path`` is for an inbox: NEW (missing or 0 bytes),
    FIRST or CURRENT; ValueError naming the file and the problem otherwise
    (a directory, a missing folder, not a regular file, not SQLite, a foreign
    database). Reads only: creates nothing, changes nothing, leaves no
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
            columns = con.execute(_TABLES_QUERY).fetchall()
    except sqlite3.Error as exc:
        raise ValueError(f"not an inbox file: {text} cannot be read as SQLite ({exc})") from None
    try:
        kind = inbox_kind(columns)
    except ValueError as exc:
        raise ValueError(f"not an inbox file: {text}: {exc}") from None
    if kind == NEW:  # only a missing or empty file becomes an inbox
        raise ValueError(f"not an inbox file: {text} is a SQLite database with no tables")
    return kind


def _check_magic(where: Path, text: str) -> None:
    try:
        with where.open("rb") as file:
            magic = file.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise ValueError(f"cannot read inbox file {text}: {exc.strerror}") from None
    if magic != _SQLITE_MAGIC:
        raise ValueError(f"not an inbox file: {text} is not a SQLite database")


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"inbox path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fsdecode(path)
    if text in ("", ":memory:") or text.startswith("file:"):
        raise ValueError(f"inbox path must name a local file, got {text!r}")
    return text


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


@dataclass(frozen=True)
class Delivery:
    """What the inbox made of one request."""

    outcome: str  # applied | duplicate | conflict | stale
    id: str
    qty: int
    known_qty: Optional[int] = None
    max_token: Optional[int] = None


@dataclass
class InboxTotals:
    """The inbox file's durable figures, read at open and mirrored in memory
    after each COMMIT: the same before and after a restart.

    Applied and duplicates are derived from the rows (each row was applied
    once and seen ``seen`` times), so they need no counter of their own;
    conflicts and stale senders leave no row, and are counted in the file.
    """

    rows: int = 0
    stock: int = 0
    seen: int = 0  # requests that reached a committed row: applied + duplicates, all time
    conflicts: int = 0
    stale: int = 0

    @property
    def applied(self) -> int:
        return self.rows

    @property
    def duplicates(self) -> int:
        return self.seen - self.rows


def decide_group(known: dict[str, tuple], requests: list[tuple]) -> list[Delivery]:
    """What each request of a group means, in order, as if applied one by one.

    ``known`` maps an id already in the inbox to (qty, seen, max_token); it is
    not changed. A pure function: the rules of the inbox live here alone.
    """
    state = {event_id: (qty, max_token) for event_id, (qty, _, max_token) in known.items()}
    deliveries = []
    for event_id, qty, token in requests:
        if event_id not in state:
            state[event_id] = (qty, token)
            deliveries.append(Delivery(APPLIED, event_id, qty, qty, token))
            continue
        known_qty, max_token = state[event_id]
        if token is not None and max_token is not None and token < max_token:
            deliveries.append(Delivery(STALE, event_id, qty, known_qty, max_token))
        elif known_qty != qty:
            deliveries.append(Delivery(CONFLICT, event_id, qty, known_qty, max_token))
        else:
            new_max = max_token if token is None else max(token, max_token or 0)
            state[event_id] = (known_qty, new_max)
            deliveries.append(Delivery(DUPLICATE, event_id, qty, known_qty, new_max))
    return deliveries


@dataclass(frozen=True)
class InboxContents:
    """What an inbox file holds, read in one transaction."""

    applied: dict  # id -> qty
    seen: int  # arrivals that reached a row: applied + duplicates, all time
    stock: int
    conflicts: int
    stale: int


def read_inbox(path: Union[str, Path]) -> InboxContents:
    """Read an inbox file (synchronously, writing nothing): for evidence and checks.

    ValueError if there is no inbox at ``path``; an empty file reads as empty.
    """
    kind = probe_inbox(path)
    if kind == NEW:
        if not Path(path).exists():
            raise ValueError(f"inbox file not found: {os.fsdecode(path)}")
        return InboxContents({}, 0, 0, 0, 0)
    with contextlib.closing(_connect_readonly(Path(path))) as con:
        con.execute("BEGIN")
        applied = dict(con.execute("SELECT id, qty FROM inbox").fetchall())
        seen = con.execute("SELECT COALESCE(SUM(seen), 0) FROM inbox").fetchone()[0]
        stock = con.execute("SELECT COALESCE(MAX(stock), 0) FROM effect").fetchone()[0]
        conflicts, stale = (0, 0) if kind == FIRST else con.execute(
            "SELECT COALESCE(MAX(conflicts), 0), COALESCE(MAX(stale), 0) FROM refusals"
        ).fetchone()
        con.execute("COMMIT")
    return InboxContents(applied, seen, stock, conflicts, stale)


class InboxClosed(RuntimeError):
    """The inbox is shutting down and takes no more requests."""


class Inbox:
    """Open with ``await Inbox.open(path)``; ``await inbox.deliver(id, qty, token)``."""

    def __init__(self, db: aiosqlite.Connection, max_group: int) -> None:
        self._db = db
        self._max_group = max_group
        self._waiting: asyncio.Queue[Optional[tuple]] = asyncio.Queue()
        self._writer: Optional[asyncio.Task] = None
        self.totals = InboxTotals()
        self.commits = 0  # commits by this process
        self.grouped = 0  # requests those commits answered

    @classmethod
    async def open(cls, path: Union[str, Path], *, max_group: int = 64) -> Inbox:
        """Open the inbox at ``path``, creating it if the file is missing or empty.

        ValueError, with nothing created or changed, for a path that holds no
        inbox (see probe_inbox); ValueError too if SQLite cannot open it for
        writing. A first-version inbox is migrated forward in one transaction.
        """
        check_max_group(max_group)
        probe_inbox(path)
        try:
            db = await aiosqlite.connect(path, isolation_level=None)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open inbox file {os.fsdecode(path)}: {exc}") from None
        try:
            await _set_up(db, os.fsdecode(path))
            inbox = cls(db, max_group)
            await inbox._load_totals()
        except sqlite3.Error as exc:
            await db.close()
            raise ValueError(f"cannot open inbox file {os.fsdecode(path)}: {exc}") from None
        except BaseException:
            await db.close()
            raise
        inbox._writer = asyncio.create_task(inbox._write_loop(), name="inbox writer")
        return inbox

    async def _load_totals(self) -> None:
        async with self._db.execute(
            "SELECT (SELECT COUNT(*) FROM inbox), (SELECT COALESCE(SUM(seen), 0) FROM inbox),"
            " (SELECT stock FROM effect), (SELECT conflicts FROM refusals),"
            " (SELECT stale FROM refusals)"
        ) as cur:
            rows, seen, stock, conflicts, stale = await cur.fetchone()  # type: ignore[misc]
        self.totals = InboxTotals(rows, stock, seen, conflicts, stale)

    async def deliver(self, event_id: str, qty: int, token: Optional[int]) -> Delivery:
        """Queue one validated request and wait until its group has committed."""
        if self._writer is None or self._writer.done():
            raise InboxClosed("inbox is closed")
        answer: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        await self._waiting.put((event_id, qty, token, answer))
        return await answer

    async def close(self) -> None:
        """Apply what is already queued, then stop the writer and close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await self._waiting.put(None)
            with contextlib.suppress(asyncio.CancelledError):
                await writer
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
        answers = [item[3] for item in group]
        try:
            # Shielded: a shutdown must not cut a transaction in half.
            deliveries = await asyncio.shield(self._apply(group))
        except Exception as exc:
            for answer in answers:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for answer, delivery in zip(answers, deliveries, strict=False):
            if not answer.done():
                answer.set_result(delivery)

    async def _apply(self, group: list) -> list[Delivery]:
        """One transaction for the whole group, in a fixed number of statements
        (one read, then batched writes), so its cost barely grows with its size."""
        now_ms = int(time.time() * 1000)
        requests = [(event_id, qty, token) for event_id, qty, token, _ in group]
        await self._db.execute("BEGIN IMMEDIATE")
        try:
            known = await self._known(sorted({event_id for event_id, _, _ in requests}))
            deliveries = decide_group(known, requests)
            await self._write(deliveries, known, now_ms)
            await self._db.execute("COMMIT")
        except BaseException:
            await self._db.execute("ROLLBACK")
            raise
        self._count(deliveries)
        return deliveries

    async def _known(self, ids: list[str]) -> dict[str, tuple]:
        """{id: (qty, seen, max_token)} of the rows already in the inbox."""
        known: dict[str, tuple] = {}
        for start in range(0, len(ids), 500):  # well under SQLite's variable limit
            chunk = ids[start:start + 500]
            rows = await self._db.execute_fetchall(
                f"SELECT id, qty, seen, max_token FROM inbox WHERE id IN "
                f"({', '.join('?' * len(chunk))})", chunk)
            known.update({row[0]: tuple(row[1:]) for row in rows})
        return known

    async def _write(self, deliveries: list[Delivery], known: dict[str, tuple],
                     now_ms: int) -> None:
        fresh = {d.id: d for d in deliveries if d.outcome == APPLIED}
        seen: dict[str, int] = {}
        for d in deliveries:
            if d.outcome in (APPLIED, DUPLICATE):
                seen[d.id] = seen.get(d.id, 0) + 1
        final_token = {d.id: d.max_token for d in deliveries if d.outcome in (APPLIED, DUPLICATE)}
        if fresh:
            await self._db.executemany(
                "INSERT INTO inbox (id, qty, first_seen_ms, seen, max_token)"
                " VALUES (?, ?, ?, ?, ?)",
                [(i, d.qty, now_ms, seen[i], final_token[i]) for i, d in fresh.items()])
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


async def _set_up(db: aiosqlite.Connection, path: str) -> None:
    """Settings, each for a reason, and the tables, created or migrated in one
    transaction; the file's contents are checked again under the write lock."""
    await db.execute("PRAGMA synchronous=FULL")  # every COMMIT is on disk before we answer
    await db.execute("PRAGMA busy_timeout=5000")  # another writer: wait a little, then fail
    await db.execute("BEGIN IMMEDIATE")
    try:
        try:
            inbox_kind([(row[0], row[1]) for row in
                        await db.execute_fetchall(_TABLES_QUERY)])
        except ValueError as exc:
            raise ValueError(f"not an inbox file: {path}: {exc}") from None
        for statement in _SETUP:  # on a current inbox: no change at all
            await db.execute(statement)
        await db.execute("COMMIT")
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    # WAL once the tables are there: readers never block the group commit.
    mode = (await db.execute_fetchall("PRAGMA journal_mode=WAL"))
    if list(mode) != [("wal",)]:
        raise sqlite3.OperationalError(f"could not set journal_mode=WAL (got {list(mode)})")
