"""The SQLite driver's console state: the queue's pause and its audit."""

from __future__ import annotations

import sqlite3
from typing import Any

from lease.rules import pause_decision, paused_state
from lease.sqlite.schema import CONSOLE_SINCE
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
