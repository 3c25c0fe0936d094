"""The PostgreSQL driver's console state: the queue's pause and its audit.

A pause takes the pause table's ACCESS EXCLUSIVE lock, which waits for every
claim in flight (each read the table, so holds its ACCESS SHARE lock to its
end), and every later claim reads the row it wrote: once ``pause`` returns,
no claim on any host leases anything, as on SQLite where writers take turns.
"""

from __future__ import annotations

from typing import Any

import psycopg

from lease.rules import pause_decision, paused_state

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
