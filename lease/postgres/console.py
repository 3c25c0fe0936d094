"""The PostgreSQL driver's console state: the queue's pause and its audit,
and the dispatchers at work.

A pause takes the pause table's ACCESS EXCLUSIVE lock, which waits for every
claim in flight (each read the table, so holds its ACCESS SHARE lock to its
end), and every later claim reads the row it wrote: once ``pause`` returns,
no claim on any host leases anything, as on SQLite where writers take turns.
"""

from __future__ import annotations

from typing import Any

import psycopg

from lease.postgres.statements import WORKER_ROW
from lease.rules import (
    BUCKET_COLUMNS,
    MINUTE_COLUMNS,
    WORKER_BEAT_MS,
    minute_rows,
    pause_decision,
    paused_state,
    workers_at_work,
)

IS_PAUSED = "SELECT EXISTS (SELECT 1 FROM lease.pause)"
NOW_AND_PAUSED = ("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint,"
                  " EXISTS (SELECT 1 FROM lease.pause)")
PAUSED = "SELECT since_ms, actor, note FROM lease.pause WHERE id = 1"
LOCK_PAUSE = "LOCK TABLE lease.pause IN ACCESS EXCLUSIVE MODE"
PAUSE = "INSERT INTO lease.pause (id, since_ms, actor, note) VALUES (1, %s, %s, %s)"
RESUME = "DELETE FROM lease.pause"
AUDIT = "INSERT INTO lease.queue_audit (at_ms, action, note, actor) VALUES (%s, %s, %s, %s)"
AUDIT_ROWS = "SELECT at_ms, action, note, actor FROM lease.queue_audit ORDER BY seq"


def set_paused(conn: psycopg.Connection, action: str, now_ms: int, note: str,
               actor: str | None) -> bool:
    """Inside a transaction: pause or resume, with its audit row; False (and
    nothing written) when the queue already was so."""
    conn.execute(LOCK_PAUSE)
    row = conn.execute(IS_PAUSED).fetchone()
    if not pause_decision(action, bool(row and row[0]), note, actor):
        return False
    if action == "pause":
        conn.execute(PAUSE, (now_ms, actor, note))
    else:
        conn.execute(RESUME)
    conn.execute(AUDIT, (now_ms, action, note, actor))
    return True


def _older(conn: psycopg.Connection) -> bool:
    """A queue older than the console, read as it is (it has no pause)."""
    row = conn.execute("SELECT to_regclass('lease.pause')").fetchone()
    return row is None or row[0] is None


def paused(conn: psycopg.Connection) -> dict[str, Any] | None:
    if _older(conn):
        return None
    return paused_state(conn.execute(PAUSED).fetchone())


def queue_audit(conn: psycopg.Connection) -> list[dict[str, Any]]:
    if _older(conn):
        return []
    return [{"at_ms": int(at_ms), "action": action, "note": note, "actor": actor}
            for at_ms, action, note, actor in conn.execute(AUDIT_ROWS)]


# ------------------------------------------------------------------ the dispatchers at work

# The claim's record of itself, when no statement of the claim leased
# (statements.WORKER_ROW: the pick and each round of a claim of deliveries
# write it as they lease).
WORKER_CLAIMED = WORKER_ROW.format(claimed="%(n)s")
REGISTER = """INSERT INTO lease.workers (owner, host, pid, started_ms) VALUES (%s, %s, %s, %s)
ON CONFLICT (owner) DO UPDATE SET host = excluded.host, pid = excluded.pid,
  started_ms = excluded.started_ms"""
WORKER_ROWS = ("SELECT owner, host, pid, started_ms, last_claim_ms, last_claimed"
               " FROM lease.workers")
LIVE_LEASES = ("SELECT owner, count(*) FROM lease.jobs WHERE status = 'leased'"
               " AND lease_until > %s GROUP BY owner")
PRUNE_WORKERS = ("DELETE FROM lease.workers WHERE greatest(coalesce(started_ms, 0),"
                 " coalesce(last_claim_ms, 0)) < %s")


def worker_claimed(conn: psycopg.Connection, owner: str, now_ms: int, leased: int) -> None:
    """Inside a claim's transaction: the claim recorded on its owner's row."""
    conn.execute(WORKER_CLAIMED, {"owner": owner, "now": now_ms, "n": leased,
                                  "beat": WORKER_BEAT_MS})


def register_worker(conn: psycopg.Connection, owner: str, host: str, pid: int,
                    now_ms: int) -> None:
    conn.execute(REGISTER, (owner, host, pid, now_ms))


def workers(conn: psycopg.Connection, now_ms: int) -> list[dict[str, Any]]:
    if _older(conn):
        return []
    leases = {owner: int(n) for owner, n in conn.execute(LIVE_LEASES, (now_ms,))}
    rows = [(owner, host, None if pid is None else int(pid),
             None if started is None else int(started),
             None if last is None else int(last), int(n))
            for owner, host, pid, started, last, n in conn.execute(WORKER_ROWS)]
    return workers_at_work(rows, leases, now_ms)


def prune_workers(conn: psycopg.Connection, cutoff_ms: int) -> None:
    """Inside prune's transaction: the dispatchers not seen since its cutoff
    (the reads already hide those not seen for WORKERS_KEPT_MS)."""
    conn.execute(PRUNE_WORKERS, (cutoff_ms,))


# ------------------------------------------------------------------ the per-minute rollup

_ADDED = ["done", "retried", "dead", *BUCKET_COLUMNS]
ADD_MINUTE = (f"INSERT INTO lease.minutes ({', '.join(MINUTE_COLUMNS)})"
              f" VALUES ({', '.join(['%s'] * len(MINUTE_COLUMNS))})"
              " ON CONFLICT (minute_ms, endpoint, owner) DO UPDATE SET "
              + ", ".join(f"{name} = lease.minutes.{name} + excluded.{name}"
                          for name in _ADDED))
MINUTES_SINCE = (f"SELECT {', '.join(MINUTE_COLUMNS)} FROM lease.minutes"
                 " WHERE minute_ms >= %s AND (%s::text IS NULL OR endpoint = %s)")
PRUNE_MINUTES = "DELETE FROM lease.minutes WHERE minute_ms < %s"


def add_minutes(conn: psycopg.Connection, rows: list[tuple]) -> None:
    """Inside a finish's transaction: its additions (lease.rules.minute_rollup),
    in their sorted order, so two finishes lock their rows in one order."""
    if rows:
        with conn.cursor() as cursor:
            cursor.executemany(ADD_MINUTE, rows)


def minutes(conn: psycopg.Connection, since_ms: int,
            endpoint: str | None) -> list[dict[str, Any]]:
    row = conn.execute("SELECT to_regclass('lease.minutes')").fetchone()
    if row is None or row[0] is None:
        return []  # an older queue read as it is: no rollup there
    return minute_rows(conn.execute(MINUTES_SINCE, (since_ms, endpoint, endpoint)))


def prune_minutes(conn: psycopg.Connection, cutoff_ms: int) -> None:
    conn.execute(PRUNE_MINUTES, (cutoff_ms,))
