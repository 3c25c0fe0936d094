"""The PostgreSQL driver's reads: the observations, with its own SQL."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from lease.endpoints import key_of_line
from lease.postgres.statements import (
    BLOCKED_JOBS,
    BLOCKED_KEYS,
    BY_KEY_FROM,
    FILTERS,
    KEY_OR_LINES,
)
from lease.rules import (
    DAY_MS,
    STATUSES,
    list_filters,
    queue_depth,
)


def by_key(conn: Any, sql: str, ids: list[str]) -> Any:
    """A lookup of these ids by key (``conn`` a connection or a cursor): one
    of more than BY_KEY_FROM planned for its own array, not prepared
    (statements.BY_KEY_FROM says why)."""
    return conn.execute(sql, (ids,), prepare=False if len(ids) > BY_KEY_FROM else None)


def dicts(conn: psycopg.Connection, sql: str, args: Any = ()) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(sql, args).fetchall()


def read_counts(conn: psycopg.Connection) -> dict[str, int]:
    found: dict[str, int] = dict(conn.execute(
        "SELECT status, count(*) FROM lease.jobs GROUP BY status").fetchall())
    return {status: found.get(status, 0) for status in STATUSES}


def read_stale_finishes(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT n FROM lease.tallies WHERE name = 'stale_finishes'").fetchone()
    return 0 if row is None else int(row[0])


def read_snapshot(conn: psycopg.Connection, now: int, *, keys: bool = True) -> dict[str, Any]:
    """reads.snapshot of SQLite's figures, inside one consistent read."""
    def one(sql: str, args: Any = ()) -> Any:
        row = conn.execute(sql, args).fetchone()
        return None if row is None else row[0]

    by_status = read_counts(conn)
    oldest = one("SELECT min(available_at) FROM lease.jobs WHERE status IN ('pending', 'leased')")
    attempts = conn.execute("SELECT attempts, count(*) FROM lease.jobs GROUP BY attempts"
                            " ORDER BY attempts").fetchall()
    dead = conn.execute("SELECT reason, count(*) FROM lease.jobs WHERE status = 'dead'"
                        ' GROUP BY reason ORDER BY reason COLLATE "C"').fetchall()
    redrives = conn.execute("SELECT count(*), count(DISTINCT id), count(*) FILTER"
                            " (WHERE at_ms > %s) FROM lease.redrives", (now - DAY_MS,)).fetchone()
    leases = conn.execute("SELECT count(*) FILTER (WHERE lease_until <= %s), count(*) FILTER"
                          " (WHERE lease_until > %s) FROM lease.jobs WHERE status = 'leased'",
                          (now, now)).fetchone()
    cancels = conn.execute("SELECT count(*), count(*) FILTER (WHERE at_ms > %s)"
                           " FROM lease.cancels", (now - DAY_MS,)).fetchone()
    ready = one("SELECT min(available_at) FROM lease.jobs WHERE status = 'pending'"
                " AND available_at <= %s", (now,))
    assert redrives and leases and cancels  # an aggregate returns one row
    return {
        "jobs": sum(by_status.values()),
        "by_status": by_status,
        "oldest_unfinished_age_ms": None if oldest is None else max(0, now - oldest),
        "oldest_ready_age_ms": None if ready is None else now - ready,
        "expired_leases": leases[0],
        "live_leases": leases[1],
        "attempts": {str(k): v for k, v in attempts},
        "dead_by_reason": dict(dead),
        "redrives": redrives[0],
        "redriven_jobs": redrives[1],
        "redrives_last_day": redrives[2],
        "cancels": cancels[0],
        "cancels_last_day": cancels[1],
        "attempts_recorded": one(
            "SELECT (SELECT count(*) FROM lease.attempts)"
            " + (SELECT count(*) FROM lease.jobs WHERE status = 'done' AND done_by IS NOT NULL)"),
        "stale_finishes": read_stale_finishes(conn),
        **({"blocked_keys": one(BLOCKED_KEYS),
            "blocked_jobs": one(BLOCKED_JOBS)} if keys else {}),
    }


# The queue's depth (Store.queue_depth): SQLite's one grouped scan, here.
DEPTH = """SELECT {endpoint}, status, count(*)::bigint,
  count(*) FILTER (WHERE status = 'pending' AND available_at <= %(now)s {first}),
  min(available_at) FILTER (WHERE status = 'pending' AND available_at <= %(now)s {first})
FROM lease.jobs GROUP BY 1, 2"""


def read_depth(conn: psycopg.Connection, now: int, *, keys: bool,
               endpoints: bool) -> dict[str, Any]:
    """Store.queue_depth, inside one consistent read."""
    rows = conn.execute(DEPTH.format(endpoint="endpoint" if endpoints else "NULL::text",
                                     first="AND held = 0" if keys else ""),
                        {"now": now}).fetchall()
    blocked = conn.execute(BLOCKED_KEYS).fetchone() if keys else None
    found = (conn.execute("SELECT name, enabled, circuit FROM lease.endpoints").fetchall()
             if endpoints else [])
    return queue_depth(rows, now, 0 if blocked is None else int(blocked[0]), found)


def job_filter(status: str | None, reason: str | None, id_prefix: str | None,
               after_seq: int | None, limit: int,
               key: str | None = None, endpoint: str | None = None, *,
               endpoints: bool = True, **more: Any) -> tuple[str, list[Any]]:
    """The WHERE of list_jobs and its arguments, checked; with endpoints, a
    key matches a job's own key and every delivery's line of that key."""
    filters = list_filters(status, reason, id_prefix, after_seq, limit, key, endpoint, **more)
    clauses = ["1 = 1"]
    args: list[Any] = []
    for name, values in filters:
        if name == "endpoint" and not endpoints:
            continue  # refused by the caller: no job has one
        if name == "key" and endpoints:
            clauses.append(KEY_OR_LINES.replace("%(key)s", "%s"))
            args += values * 2
        else:
            clauses.append(FILTERS[name])
            args += values
    return " AND ".join(clauses), args


def job_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a read shows them: a delivery's line as its event's own key
    (the line is the key per endpoint). A row of a queue before endpoints
    is as it is."""
    for row in rows:
        if "endpoint" in row:
            for name in ("ordering_key", "key"):
                if row.get(name) is not None:
                    row[name] = key_of_line(row[name], row["endpoint"])
    return rows
