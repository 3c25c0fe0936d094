"""The SQLite driver's console state: the queue's pause and its audit, and
the dispatchers at work, the per-minute rollup of the finishes."""

from __future__ import annotations

import sqlite3
from typing import Any

from lease.rules import (
    BUCKET_COLUMNS,
    MINUTE_COLUMNS,
    WORKER_BEAT_MS,
    check_worker,
    minute_rows,
    pause_decision,
    paused_state,
    workers_at_work,
)
from lease.sqlite.schema import CONSOLE_SINCE, ROLLUP_SINCE
from lease.worker import check_connection, check_now, immediate

PAUSED = "SELECT since_ms, actor, note FROM pause WHERE id = 1"
IS_PAUSED = "SELECT EXISTS (SELECT 1 FROM pause)"
PAUSE = "INSERT INTO pause (id, since_ms, actor, note) VALUES (1, ?, ?, ?)"
RESUME = "DELETE FROM pause"
AUDIT = "INSERT INTO queue_audit (at_ms, action, note, actor) VALUES (?, ?, ?, ?)"
AUDIT_ROWS = "SELECT at_ms, action, note, actor FROM queue_audit ORDER BY seq"


def _older(con: sqlite3.Connection) -> bool:
    """A file older than the console, opened read-only and read as it is."""
    return int(con.execute("PRAGMA user_version").fetchone()[0]) < CONSOLE_SINCE


def is_paused(con: sqlite3.Connection) -> bool:
    """Inside a claim's transaction: whether the queue is paused."""
    return bool(con.execute(IS_PAUSED).fetchone()[0])


def set_paused(con: sqlite3.Connection, action: str, now_ms: int, note: str,
               actor: str | None) -> bool:
    """Pause or resume, with its audit row, in one transaction; False (and
    nothing written) when the queue already was so."""
    check_connection(con)
    check_now(now_ms)
    with immediate(con):
        if not pause_decision(action, is_paused(con), note, actor):
            return False
        if action == "pause":
            con.execute(PAUSE, (now_ms, actor, note))
        else:
            con.execute(RESUME)
        con.execute(AUDIT, (now_ms, action, note, actor))
    return True


def paused(con: sqlite3.Connection) -> dict[str, Any] | None:
    """The pause; None too for an older file read as it is (it has no pause)."""
    check_connection(con)
    if _older(con):
        return None
    return paused_state(con.execute(PAUSED).fetchone())


def queue_audit(con: sqlite3.Connection) -> list[dict[str, Any]]:
    check_connection(con)
    if _older(con):
        return []
    return [{"at_ms": at_ms, "action": action, "note": note, "actor": actor}
            for at_ms, action, note, actor in con.execute(AUDIT_ROWS)]


# ------------------------------------------------------------------ the dispatchers at work

# The claim's record of itself (lease.rules, "the dispatchers at work"): a
# claim that leased nothing writes only when the row's last claim is a beat old.
WORKER_CLAIMED = """INSERT INTO workers (owner, last_claim_ms, last_claimed)
VALUES (:owner, :now, :n)
ON CONFLICT (owner) DO UPDATE SET last_claim_ms = excluded.last_claim_ms,
  last_claimed = excluded.last_claimed
WHERE excluded.last_claimed > 0 OR workers.last_claim_ms IS NULL
  OR workers.last_claim_ms <= excluded.last_claim_ms - :beat"""
REGISTER = """INSERT INTO workers (owner, host, pid, started_ms) VALUES (?, ?, ?, ?)
ON CONFLICT (owner) DO UPDATE SET host = excluded.host, pid = excluded.pid,
  started_ms = excluded.started_ms"""
WORKER_ROWS = ("SELECT owner, host, pid, started_ms, last_claim_ms, last_claimed"
               " FROM workers")
LIVE_LEASES = ("SELECT owner, COUNT(*) FROM jobs WHERE status = 'leased' AND lease_until > ?"
               " GROUP BY owner")
PRUNE_WORKERS = "DELETE FROM workers WHERE max(coalesce(started_ms, 0),"\
    " coalesce(last_claim_ms, 0)) < ?"


def worker_claimed(con: sqlite3.Connection, owner: str, now_ms: int, leased: int) -> None:
    """Inside a claim's transaction: the claim recorded on its owner's row."""
    con.execute(WORKER_CLAIMED, {"owner": owner, "now": now_ms, "n": leased,
                                 "beat": WORKER_BEAT_MS})


def register_worker(con: sqlite3.Connection, owner: str, host: str, pid: int,
                    now_ms: int) -> None:
    check_connection(con)
    check_worker(owner, host, pid)
    check_now(now_ms)
    with immediate(con):
        con.execute(REGISTER, (owner, host, pid, now_ms))


def workers(con: sqlite3.Connection, now_ms: int) -> list[dict[str, Any]]:
    """The dispatchers seen in the last day, each with its live leases; none
    for an older file read as it is."""
    check_connection(con)
    check_now(now_ms)
    if _older(con):
        return []
    leases = dict(con.execute(LIVE_LEASES, (now_ms,)).fetchall())
    return workers_at_work(con.execute(WORKER_ROWS).fetchall(), leases, now_ms)


def prune_workers(con: sqlite3.Connection, cutoff_ms: int) -> None:
    """Inside prune's transaction: the dispatchers not seen since its cutoff
    (the reads already hide those not seen for WORKERS_KEPT_MS)."""
    con.execute(PRUNE_WORKERS, (cutoff_ms,))


# ------------------------------------------------------------------ the per-minute rollup

_ADDED = ["done", "retried", "dead", *BUCKET_COLUMNS]
ADD_MINUTE = (f"INSERT INTO minutes ({', '.join(MINUTE_COLUMNS)})"
              f" VALUES ({', '.join('?' * len(MINUTE_COLUMNS))})"
              " ON CONFLICT (minute_ms, endpoint, owner) DO UPDATE SET "
              + ", ".join(f"{name} = {name} + excluded.{name}" for name in _ADDED))
MINUTES_SINCE = f"SELECT {', '.join(MINUTE_COLUMNS)} FROM minutes WHERE minute_ms >= ?"
PRUNE_MINUTES = "DELETE FROM minutes WHERE minute_ms < ?"


def add_minutes(con: sqlite3.Connection, rows: list[tuple]) -> None:
    """Inside a finish's transaction: its additions (lease.rules.minute_rollup)."""
    if rows:
        con.executemany(ADD_MINUTE, rows)


def minutes(con: sqlite3.Connection, since_ms: int,
            endpoint: str | None) -> list[dict[str, Any]]:
    check_connection(con)
    check_now(since_ms, "since_ms")
    if int(con.execute("PRAGMA user_version").fetchone()[0]) < ROLLUP_SINCE:
        return []  # an older file read as it is: no rollup there
    if endpoint is None:
        return minute_rows(con.execute(MINUTES_SINCE, (since_ms,)))
    return minute_rows(con.execute(MINUTES_SINCE + " AND endpoint = ?", (since_ms, endpoint)))


def prune_minutes(con: sqlite3.Connection, cutoff_ms: int) -> None:
    """Inside prune's transaction: the minutes before its cutoff."""
    con.execute(PRUNE_MINUTES, (cutoff_ms,))
