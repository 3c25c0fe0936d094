"""The PostgreSQL driver's release: claimed deliveries given back unsent
(``lease.store.Store.release_jobs``). The rule is
``lease.breaker.release_decisions``; this module locks, reads and writes rows.

Locks in the order every writer takes them (a finish's): the endpoints' rows
first, in name order (only when their attempts saved are counted), then the
jobs' rows in seq order."""

from __future__ import annotations

from collections import Counter

import psycopg

from lease.breaker import release_decisions
from lease.postgres.reads import dicts
from lease.worker import MARKED

# The endpoints of these jobs, read before any lock.
ENDPOINTS_OF_IDS = """SELECT DISTINCT endpoint FROM lease.jobs
WHERE id = ANY(%s::text[]) AND endpoint IS NOT NULL ORDER BY endpoint"""
LOCK_ENDPOINTS = """SELECT name FROM lease.endpoints WHERE name = ANY(%s::text[])
ORDER BY name FOR NO KEY UPDATE"""
LOCK_JOBS = """SELECT {columns} FROM lease.jobs WHERE id = ANY(%s::text[])
ORDER BY seq FOR UPDATE"""
# Pending again, its lease cleared, its attempt count as before the claim; its
# token, its available_at and its place in its ordering line kept.
RELEASE_CLAIMED = """UPDATE lease.jobs j SET status = 'pending', attempts = u.attempts,
  owner = NULL, lease_until = NULL
FROM unnest(%s::bigint[], %s::bigint[]) AS u(seq, attempts)
WHERE j.seq = u.seq AND j.status = 'leased'"""
COUNT_SAVED = """UPDATE lease.endpoints e SET saved = saved + u.n
FROM unnest(%s::text[], %s::bigint[]) AS u(name, n) WHERE e.name = u.name"""


def release_jobs(conn: psycopg.Connection, tickets: list, now: int, reason: str, *,
                 endpoints: bool = True) -> list:
    """Inside a transaction: per ticket True (released) or False (stale,
    nothing changed); a delivery released for its endpoint's "circuit"
    counts in the endpoint's attempts saved. ``endpoints`` False: a schema of
    before endpoints (no delivery to count)."""
    ids = sorted({ticket["id"] for ticket in tickets})
    counting = endpoints and reason == "circuit"
    if counting:
        names = [name for (name,) in conn.execute(ENDPOINTS_OF_IDS, (ids,))]
        if names:
            conn.execute(LOCK_ENDPOINTS, (names,))
    columns = f"{MARKED}, endpoint" if endpoints else MARKED
    rows = {row["id"]: row for row in dicts(conn, LOCK_JOBS.format(columns=columns), (ids,))}
    results, released = release_decisions(rows, tickets, now)
    if released:
        conn.execute(RELEASE_CLAIMED, ([row["seq"] for row in released],
                                       [row["attempts"] for row in released]))
    if counting:
        saved = Counter(row["endpoint"] for row in released if row["endpoint"] is not None)
        if saved:
            names = sorted(saved)
            conn.execute(COUNT_SAVED, (names, [saved[name] for name in names]))
    return results
