"""The receiver's inbox: one SQLite file that deduplicates by ID and quantity.

One writer task owns the aiosqlite connection. Requests queue up for it; it
takes every request that is waiting (up to ``max_group``), applies them one by
one inside a single transaction, commits, and only then answers each of them:
a group commit, never an answer before durability. Because one task applies
everything in order, 50 concurrent requests for one ID apply exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import aiosqlite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (
  id TEXT PRIMARY KEY, qty INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL,
  seen INTEGER NOT NULL, max_token INTEGER);
CREATE TABLE IF NOT EXISTS effect (
  one INTEGER PRIMARY KEY CHECK (one = 1), stock INTEGER NOT NULL);
INSERT OR IGNORE INTO effect (one, stock) VALUES (1, 0);
"""

APPLIED, DUPLICATE, CONFLICT, STALE = "applied", "duplicate", "conflict", "stale"


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
    """Durable state, mirrored in memory after each COMMIT (read without a query)."""

    rows: int = 0
    stock: int = 0
    seen: int = 0  # requests that reached a committed row: applied + duplicates, all time
    commits: int = 0
    grouped: int = 0  # requests committed in those commits (this process)
    outcomes: dict = field(default_factory=lambda: dict.fromkeys(
        (APPLIED, DUPLICATE, CONFLICT, STALE), 0))


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


def read_inbox(path: Union[str, Path]) -> InboxContents:
    """Read an inbox file (synchronously, changing nothing): for evidence and checks."""
    con = sqlite3.connect(path)
    try:
        con.execute("BEGIN")
        applied = dict(con.execute("SELECT id, qty FROM inbox").fetchall())
        seen = con.execute("SELECT COALESCE(SUM(seen), 0) FROM inbox").fetchone()[0]
        stock = con.execute("SELECT stock FROM effect").fetchone()[0]
        con.execute("COMMIT")
    finally:
        con.close()
    return InboxContents(applied, seen, stock)


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

    @classmethod
    async def open(cls, path: Union[str, Path], *, max_group: int = 64) -> Inbox:
        if type(max_group) is not int or max_group < 1:
            raise ValueError(f"max_group must be an int >= 1, got {max_group!r}")
        db = await aiosqlite.connect(path, isolation_level=None)
        try:
            # WAL + synchronous=FULL: every COMMIT is on disk before we answer.
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=FULL")
            await db.execute("PRAGMA busy_timeout=5000")
            await db.executescript(_SCHEMA)
            inbox = cls(db, max_group)
            await inbox._load_totals()
        except BaseException:
            await db.close()
            raise
        inbox._writer = asyncio.create_task(inbox._write_loop(), name="inbox writer")
        return inbox

    async def _load_totals(self) -> None:
        async with self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(seen), 0), (SELECT stock FROM effect) FROM inbox"
        ) as cur:
            rows, seen, stock = await cur.fetchone()  # type: ignore[misc]
        self.totals.rows, self.totals.seen, self.totals.stock = rows, seen, stock

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

    def _count(self, deliveries: list[Delivery]) -> None:
        totals = self.totals
        totals.commits += 1
        totals.grouped += len(deliveries)
        for delivery in deliveries:
            totals.outcomes[delivery.outcome] += 1
            if delivery.outcome == APPLIED:
                totals.rows += 1
                totals.stock += delivery.qty
            if delivery.outcome in (APPLIED, DUPLICATE):
                totals.seen += 1
