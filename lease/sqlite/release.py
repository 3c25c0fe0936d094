"""The SQLite driver's release: claimed deliveries given back unsent
(``lease.store.Store.release_jobs``), one short ``BEGIN IMMEDIATE``. The
rule is ``lease.breaker.release_decisions``; this module reads and writes rows."""

from __future__ import annotations

import sqlite3
from collections import Counter

from lease.breaker import check_release, release_decisions
from lease.sqlite import batch
from lease.worker import MARKED, MARKED_NAMES, check_connection, check_now, immediate

# What a release reads of a row: the contract's marker, and a delivery's endpoint.
_NAMES = (*MARKED_NAMES, "endpoint")
# Pending again, its lease cleared, its attempt count as before the claim; its
# token, its available_at and its place in its ordering line kept.
RELEASE_CLAIMED = ("UPDATE jobs SET status = 'pending', attempts = ?, owner = NULL,"
                   " lease_until = NULL WHERE seq = ? AND status = 'leased'")
# the attempts a release for the endpoint's circuit saved
COUNT_SAVED = "UPDATE endpoints SET saved = saved + ? WHERE name = ?"


def release_jobs(con: sqlite3.Connection, tickets: list, now_ms: int, reason: str) -> list:
    """Give claimed, unsent jobs back (``lease.breaker.release_decisions``):
    per ticket True (released) or False (stale, nothing changed). A delivery
    released for its endpoint's ``"circuit"`` counts in the endpoint's
    attempts saved, in the same transaction."""
    check_connection(con)
    check_release(tickets, reason)
    check_now(now_ms)
    if not tickets:
        return []
    ids = sorted({ticket["id"] for ticket in tickets})
    with immediate(con):
        found = batch.BATCH.read(
            con, _NAMES,
            f"SELECT {MARKED}, endpoint FROM jobs WHERE id IN ({', '.join('?' * len(ids))})",
            ids)
        rows = {row[1]: dict(zip(_NAMES, row, strict=True)) for row in found}  # [1]: id
        results, released = release_decisions(rows, tickets, now_ms)
        con.executemany(RELEASE_CLAIMED, [(row["attempts"], row["seq"]) for row in released])
        if reason == "circuit":
            saved = Counter(row["endpoint"] for row in released if row["endpoint"] is not None)
            con.executemany(COUNT_SAVED, sorted((n, name) for name, n in saved.items()))
    return results
