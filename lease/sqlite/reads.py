"""Read-only observations of a queue: what an operator asks before acting.

Each function reads in one statement or one read transaction and changes
nothing. They answer "up to which state is there evidence?": counts by
status, the oldest unfinished job's age, attempts, dead jobs by reason,
redrives.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from lease.endpoints import Endpoint, check_endpoint_name, key_of_line
from lease.policy import PRODUCT, check_ordering_key
from lease.rules import DAY_MS, STATUSES, list_filters, queue_depth
from lease.sqlite import endpoints
from lease.sqlite.statements import DUE_LINE, IN_FLIGHT, REST_LINE
from lease.worker import (
    NotAQueue,
    check_identifier,
    check_job_id,
    check_now,
    check_path,
    check_schema,
)

__all__ = ["open_readonly", "snapshot", "counts", "is_drained", "is_idle", "blocked_heads",
           "job_history", "dead_jobs",
           "jobs_with_status", "list_jobs", "stale_finishes"]


READ_PATIENCE_S = 5.0
BODIES_SINCE = 4  # the schema version (lease.sqlite.schema) that keeps the bodies in a table

# Byte 18 of a SQLite file's header is its read format version: 2 in WAL mode.
_HEADER = b"SQLite format 3\x00"
_WAL_READ_VERSION = 2


def open_readonly(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open an existing queue file for reading only: for the commands that look.

    Never creates, writes or repairs anything: no journal mode switched, no
    missing index made (``open_queue`` does both). A missing file is
    FileNotFoundError; a directory, a file that is not SQLite, or one that
    holds something other than a queue is ValueError, the file untouched.
    """
    text = check_path(path)
    if not os.path.exists(text):
        raise FileNotFoundError(f"queue file not found: {text}")
    if not os.path.isfile(text):
        raise ValueError(f"not a file: {text}")
    with open(text, "rb") as file:
        header = file.read(100)
    if len(header) < 100 or not header.startswith(_HEADER):
        raise NotAQueue("not a queue file: not a SQLite database" if header
                         else "not a queue file: it is empty")
    uri = Path(text).resolve().as_uri() + "?mode=ro"
    if header[18] == _WAL_READ_VERSION and not os.path.exists(text + "-wal"):
        # A read-only connection to a WAL file would leave -wal and -shm files
        # behind. With no -wal file there is no writer and nothing unmerged:
        # read the file as it is.
        uri += "&immutable=1"
    # A reader waits for a commit in progress to end. Busy dispatchers commit
    # back to back and SQLite's busy handler sleeps in growing steps, so 1 s
    # (the writers' setting) can run out: a reader holds no lock worth hurrying for.
    con = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=READ_PATIENCE_S)
    try:
        _first_read(con, text)
        if not con.execute(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE name = 'jobs')"
        ).fetchone()[0]:
            raise NotAQueue("not a queue file yet: it has no tables (asyncworker init makes them)")
    except sqlite3.OperationalError:  # locked, or an I/O error: no verdict on the file
        con.close()
        raise
    except sqlite3.DatabaseError as exc:
        con.close()
        raise NotAQueue(f"not a queue file: {exc}") from None
    except BaseException:
        con.close()
        raise
    return con


def _first_read(con: sqlite3.Connection, text: str) -> None:
    """The schema check; a foreign file is ValueError.

    A writer that ended inside a transaction (killed, or failed on an I/O error
    such as a full disk) leaves a hot journal, which only a writer can roll
    back; a reader is refused ("attempt to write a readonly database") until
    one does. A live dispatcher does it at its next transaction, so wait for
    that a while; with no writer left, say what is known and what recovers the
    file rather than recovering it here."""
    give_up = time.monotonic() + READ_PATIENCE_S
    while True:
        try:
            check_schema(con)
            return
        except sqlite3.OperationalError as exc:
            if "readonly" not in str(exc):
                raise
            if time.monotonic() >= give_up:
                raise sqlite3.OperationalError(_unfinished(text)) from None
        time.sleep(0.02)


def _unfinished(text: str) -> str:
    """What a hot journal tells: a writer did not finish its transaction, and
    none holds it now. Whether it was killed or failed is not known; the room
    left on the file's disk is, and a full disk is one cause worth naming."""
    try:
        free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(text))).free:,} bytes"
    except OSError:
        free = "unknown"
    return (f"{text} holds a transaction its writer did not finish: the writer ended "
            f"inside it (killed, or failed, for example on a full disk; free space on its "
            f"disk: {free}). Any command that writes (asyncworker init, a dispatcher) "
            f"rolls it back, once the disk has room")


def counts(con: sqlite3.Connection) -> dict[str, int]:
    """Jobs by status, every status present (0 where none)."""
    found = dict(con.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())
    return {status: found.get(status, 0) for status in STATUSES}


def is_drained(con: sqlite3.Connection) -> bool:
    """True when every job is done or dead: nothing pending, nothing leased."""
    row = con.execute(
        "SELECT EXISTS (SELECT 1 FROM jobs WHERE status IN ('pending', 'leased'))"
    ).fetchone()
    return not row[0]


# Idle: no job a claim may take now or later without an operator. A key's first
# (held = 0) is the only job of its line a claim takes; with none pending or
# leased, every job left waits behind a dead first job of its key.
IDLE = ("SELECT NOT EXISTS (SELECT 1 FROM jobs WHERE status IN ('pending', 'leased')"
        " AND held = 0)")


def is_idle(con: sqlite3.Connection) -> bool:
    """True when nothing is claimable now or later without an operator: every
    job done or dead, or waiting behind a dead first job of its key (a retry
    delay or a lease still to run out is work to come, not idle)."""
    if "held" not in _columns(con, "jobs"):  # no ordering keys: idle is drained
        return is_drained(con)
    return bool(con.execute(IDLE).fetchone()[0])


# What one dispatcher serves is idle when nothing it may claim is left, now or
# later without an operator: its own jobs, or the deliveries of the enabled
# endpoints it serves (a disabled endpoint's wait for an operator).
IDLE_OWN = ("SELECT NOT EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_own"
            " WHERE endpoint IS NULL AND status IN ('pending', 'leased') AND held = 0)")
IDLE_SERVED = f"""SELECT NOT EXISTS (SELECT 1 FROM endpoints e
  WHERE e.enabled = 1 {{only}} AND (EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_endpoint_due
    WHERE endpoint = e.name AND {DUE_LINE})
  OR EXISTS (SELECT 1 FROM jobs INDEXED BY jobs_in_flight
    WHERE endpoint = e.name AND {IN_FLIGHT} AND held = 0)))"""


def is_idle_for(con: sqlite3.Connection, served: str | tuple[str, ...] | None) -> bool:
    """``is_idle`` of what a claim with ``endpoints=served`` may take."""
    if served is None:
        return bool(con.execute(IDLE_OWN).fetchone()[0])
    if served == "*":
        return bool(con.execute(IDLE_SERVED.format(only="")).fetchone()[0])
    marks = ", ".join("?" * len(served))
    return bool(con.execute(IDLE_SERVED.format(only=f"AND e.name IN ({marks})"),
                            served).fetchone()[0])


def blocked_heads(con: sqlite3.Connection, limit: int) -> list[dict[str, Any]]:
    """The keys blocked by a dead first job, in key order (at most ``limit``):
    each as {"key", "id", "reason", "waiting"}, the dead head's id and reason
    and how many pending jobs wait behind it."""
    if "held" not in _columns(con, "jobs"):
        return []
    columns = _columns(con, "jobs")
    rows = _dicts(con, BLOCKED_HEADS.format(
        limit=int(limit), endpoint=", h.endpoint" if "endpoint" in columns else ""))
    for row in rows:
        row.setdefault("endpoint", None)
    return rows


def snapshot(con: sqlite3.Connection, now_ms: int) -> dict[str, Any]:
    """Everything `stats` shows, read in one transaction so the figures agree."""
    check_now(now_ms)
    con.execute("BEGIN")
    try:
        by_status = counts(con)
        oldest = con.execute(
            "SELECT MIN(available_at) FROM jobs WHERE status IN ('pending', 'leased')"
        ).fetchone()[0]
        attempts = dict(con.execute(
            "SELECT attempts, COUNT(*) FROM jobs GROUP BY attempts ORDER BY attempts"
        ).fetchall())
        dead = dict(con.execute(
            "SELECT reason, COUNT(*) FROM jobs WHERE status = 'dead' GROUP BY reason"
            " ORDER BY reason"
        ).fetchall())
        redrives, redriven_jobs = con.execute(
            "SELECT COUNT(*), COUNT(DISTINCT id) FROM redrives"
        ).fetchone()
        expired, live = con.execute(
            "SELECT COALESCE(SUM(lease_until <= ?), 0), COALESCE(SUM(lease_until > ?), 0)"
            " FROM jobs WHERE status = 'leased'", (now_ms, now_ms)).fetchone()
        ready = con.execute(
            "SELECT MIN(available_at) FROM jobs WHERE status = 'pending' AND available_at <= ?",
            (now_ms,)).fetchone()[0]
        redrives_day = con.execute(
            "SELECT COUNT(*) FROM redrives WHERE at_ms > ?", (now_ms - DAY_MS,)).fetchone()[0]
        product = _product_figures(con, now_ms) if _has_table(con, "tallies") else {}
        if _has_keys(con):
            product.update(_blocked(con))
    finally:
        con.execute("COMMIT")
    return {
        "jobs": sum(by_status.values()),
        "by_status": by_status,
        "oldest_unfinished_age_ms": None if oldest is None else max(0, now_ms - oldest),
        "oldest_ready_age_ms": None if ready is None else now_ms - ready,
        "expired_leases": expired,
        "live_leases": live,
        "attempts": {str(k): v for k, v in attempts.items()},
        "dead_by_reason": dead,
        "redrives": redrives,
        "redriven_jobs": redriven_jobs,
        "redrives_last_day": redrives_day,
        **product,
    }


# The queue's depth (Store.queue_depth): one grouped scan of the jobs (per
# endpoint and status: how many, how many a claim may take now, the oldest of
# those), the blocked keys and the endpoints' states, in one transaction. A
# scrape's cost is that scan: about half a second at a million jobs.
_DEPTH = """SELECT {endpoint}, status, COUNT(*),
  SUM(status = 'pending' AND available_at <= :now {first}),
  MIN(CASE WHEN status = 'pending' AND available_at <= :now {first} THEN available_at END)
FROM jobs GROUP BY 1, 2"""


def depth(con: sqlite3.Connection, now_ms: int) -> dict[str, Any]:
    """Store.queue_depth, read in one transaction."""
    check_now(now_ms)
    columns = _columns(con, "jobs")
    con.execute("BEGIN")
    try:
        rows = con.execute(_DEPTH.format(
            endpoint="endpoint" if "endpoint" in columns else "NULL",
            first="AND held = 0" if "held" in columns else ""), {"now": now_ms}).fetchall()
        blocked = con.execute(BLOCKED_KEYS).fetchone()[0] if "held" in columns else 0
        found = (con.execute("SELECT name, enabled, circuit FROM endpoints").fetchall()
                 if _has_table(con, "endpoints") else [])
    finally:
        con.execute("COMMIT")
    return queue_depth(rows, now_ms, blocked, found)


def _product_figures(con: sqlite3.Connection, now_ms: int) -> dict[str, Any]:
    """What only a product queue records: cancels, attempts, stale finishes."""
    return {
        "cancels": con.execute("SELECT COUNT(*) FROM cancels").fetchone()[0],
        "cancels_last_day": con.execute(
            "SELECT COUNT(*) FROM cancels WHERE at_ms > ?", (now_ms - DAY_MS,)).fetchone()[0],
        "attempts_recorded": con.execute(
            "SELECT (SELECT COUNT(*) FROM attempts)"
            " + (SELECT COUNT(*) FROM jobs WHERE status = 'done' AND done_by IS NOT NULL)"
        ).fetchone()[0],
        "stale_finishes": stale_finishes(con),
    }


# A key is blocked when the first of its line is dead (not cancelled): the jobs
# behind it wait until it is redriven or cancelled. (lease.sqlite, "Ordered keys".)
_DEAD_FIRST = ("h.ordering_key IS NOT NULL AND h.held = 0 AND h.status = 'dead'"
               " AND h.reason <> 'cancelled'")
BLOCKED_KEYS = f"SELECT COUNT(*) FROM jobs h WHERE {_DEAD_FIRST}"
BLOCKED_JOBS = f"""SELECT COUNT(*) FROM jobs h
JOIN jobs w ON w.ordering_key = h.ordering_key AND w.held = 1 AND w.status = 'pending'
  AND w.ordering_key IS NOT NULL AND (w.status IN ('pending', 'leased')
    OR (w.status = 'dead' AND w.reason <> 'cancelled'))
WHERE {_DEAD_FIRST}"""


BLOCKED_HEADS = f"""SELECT h.ordering_key AS key{{endpoint}}, h.id, h.reason,
  (SELECT COUNT(*) FROM jobs w
  WHERE w.ordering_key = h.ordering_key AND w.held = 1 AND w.status = 'pending') AS waiting
FROM jobs h WHERE {_DEAD_FIRST} ORDER BY h.ordering_key LIMIT {{limit}}"""


def _blocked(con: sqlite3.Connection) -> dict[str, int]:
    """Keys whose line is stopped by a dead first job, and the pending jobs
    waiting behind them."""
    return {"blocked_keys": con.execute(BLOCKED_KEYS).fetchone()[0],
            "blocked_jobs": con.execute(BLOCKED_JOBS).fetchone()[0]}


def stale_finishes(con: sqlite3.Connection) -> int:
    """Finishes refused because their lease was gone, all time (pruning keeps it)."""
    row = con.execute("SELECT n FROM tallies WHERE name = 'stale_finishes'").fetchone()
    return 0 if row is None else int(row[0])


def job_history(con: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    """A job's whole row, its redrive audit rows and, on a product queue, every
    attempt's evidence and its cancels; None if there is no such job."""
    check_job_id("job_id", job_id, PRODUCT)
    con.execute("BEGIN")
    try:
        found = _dicts(con, f"SELECT * FROM {_jobs(con)} WHERE id = ?", (job_id,))
        actor = ", actor" if "actor" in _columns(con, "redrives") else ""
        history: dict[str, Any] = {"redrives": _dicts(
            con, f"SELECT seq, token, at_ms, note{actor} FROM redrives WHERE id = ? ORDER BY seq",
            (job_id,))}
        if _has_table(con, "attempts"):
            history["attempts"] = _attempts(con, job_id)
            history["cancels"] = _dicts(
                con, f"SELECT seq, token, at_ms, note, was{actor} FROM cancels WHERE id = ?"
                " ORDER BY seq", (job_id,))
    finally:
        con.execute("COMMIT")
    if not found:
        return None
    return {"job": found[0], **history}


_ATTEMPT = ("token, attempt, owner, started_ms, ended_ms, outcome, result, reason,"
            " http_status, error, latency_ms")


def _attempts(con: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """Every attempt of a job in the order it was written: the attempts rows,
    with the delivering attempt (kept on a done job's row) after the row it
    followed."""
    rows = _dicts(con, f"SELECT seq, {_ATTEMPT} FROM attempts WHERE id = ? ORDER BY seq",
                  (job_id,))
    done = _dicts(
        con, "SELECT done_after, token, attempts AS attempt, done_by AS owner,"
        " done_started_ms AS started_ms, available_at AS ended_ms, 'ok' AS outcome,"
        " 'done' AS result, NULL AS reason, done_http_status AS http_status,"
        " NULL AS error, done_latency_ms AS latency_ms FROM jobs"
        " WHERE id = ? AND status = 'done' AND done_by IS NOT NULL", (job_id,))
    if done:
        after = done[0].pop("done_after")
        at = sum(1 for row in rows if row["seq"] <= after)
        rows.insert(at, done[0])
    for row in rows:
        row.pop("seq", None)
    return rows


def dead_jobs(con: sqlite3.Connection, reason: str | None = None,
              limit: int | None = None, *, key: str | None = None,
              endpoint: str | None = None) -> list[dict[str, Any]]:
    """Dead jobs in seq order, optionally of one reason and of one ordering
    ``key`` (exactly that key: a file from before keys has no job with one), at
    most `limit` of them; on a product queue each with ``last_error``: the
    error or HTTP status its last recorded attempt saw (None when no attempt
    recorded one)."""
    if reason is not None:
        check_identifier("reason", reason)
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    if key is not None:
        check_ordering_key(key, "key")
        if not _has_keys(con):
            return []
    sql = f"SELECT * FROM {_jobs(con)} WHERE status = 'dead'"
    args: list[Any] = []
    if reason is not None:
        sql += " AND reason = ?"
        args.append(reason)
    if key is not None:
        sql += f" AND {KEY_MATCH}"
        args += key_args(key)
    if endpoint is not None:
        check_identifier("endpoint", endpoint)
        if "endpoint" not in _columns(con, "jobs"):
            return []
        sql += f" AND endpoint = ? AND {REST_LINE}"  # the terms of its index (_index_terms)
        args.append(endpoint)
    sql += " ORDER BY seq"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    if _has_table(con, "attempts"):
        sql = f"""SELECT d.*, (SELECT COALESCE(a.error, 'HTTP ' || a.http_status)
  FROM attempts a WHERE a.id = d.id ORDER BY a.seq DESC LIMIT 1) AS last_error
FROM ({sql}) d"""
    return _dicts(con, sql, args)


def list_jobs(con: sqlite3.Connection, *, status: str | None = None,
              reason: str | None = None, id_prefix: str | None = None,
              after_seq: int | None = None, limit: int = 50,
              key: str | None = None, endpoint: str | None = None,
              **more: Any) -> list[dict[str, Any]]:
    """One page of jobs in seq order (keyset pagination: those after
    ``after_seq``), filtered by status, reason, id prefix and ordering key,
    and ``more`` of lease.rules.list_filters (error, http_status, from_ms,
    to_ms); whole rows, a product queue's dead rows each with ``last_error``."""
    where, args = _job_filter(status, reason, id_prefix, after_seq, limit, key, endpoint,
                              **more)
    if key is not None and not _has_keys(con):
        return []  # a file from before keys: no job has one
    if endpoint is not None and "endpoint" not in _columns(con, "jobs"):
        return []  # a file from before endpoints: no job has one
    if endpoint is not None:
        terms, more_args = _index_terms(status, endpoint)
        where += terms
        args += more_args
    sql = f"SELECT * FROM {_jobs(con)} WHERE {where} ORDER BY seq LIMIT ?"
    if _has_table(con, "attempts"):
        sql = f"""SELECT d.*, CASE WHEN d.status = 'dead' THEN
  (SELECT COALESCE(a.error, 'HTTP ' || a.http_status) FROM attempts a WHERE a.id = d.id
   ORDER BY a.seq DESC LIMIT 1) END AS last_error
FROM ({sql}) d ORDER BY d.seq"""
    return _dicts(con, sql, [*args, limit])


# list_jobs's conditions, by the name lease.rules.list_filters gives each
# A key matches a job's own and every delivery's line of it ("key endpoint").
KEY_MATCH = "(ordering_key = ? OR (ordering_key > ? AND ordering_key < ?))"
# The last attempt's: its error, and its HTTP status (a done job's delivering
# attempt is on its own row: done_http_status, kept first).
_LAST_ATTEMPT = ("(SELECT a.{column} FROM attempts a WHERE a.id = jobs.id"
                 " ORDER BY a.seq DESC LIMIT 1)")
_LAST_STATUS = f"COALESCE(done_http_status, {_LAST_ATTEMPT.format(column='http_status')})"
_FILTERS = {"status": "status = ?", "reason": "reason = ?", "id_prefix": "substr(id, 1, ?) = ?",
            "after_seq": "seq > ?", "key": KEY_MATCH, "endpoint": "endpoint = ?",
            "error": f"instr({_LAST_ATTEMPT.format(column='error')}, ?) > 0",
            "http_status": f"{_LAST_STATUS} BETWEEN ? AND ?",
            "from": "available_at >= ?", "to": "available_at < ?"}


def key_args(key: str) -> list[str]:
    """KEY_MATCH's arguments: the key, and the bounds of its lines
    (' ' is below every visible character, '!' the first above it)."""
    return [key, key + " ", key + "!"]


def _index_terms(status: str | None, endpoint: str) -> tuple[str, list[Any]]:
    """Terms, and their arguments, that change nothing in a read of one
    endpoint's deliveries in a status but lead SQLite to the partial index
    that holds them. It reads a partial index only for a WHERE that contains
    its terms; without them a page of one endpoint's dead letters or leases
    scans every delivery of the endpoint (jobs_of_endpoint, in seq order)."""
    if status in ("done", "dead"):
        return f" AND {REST_LINE}", []
    if status == "leased":  # the leases first, by their index: few, whatever the queue
        return (" AND seq IN (SELECT seq FROM jobs INDEXED BY jobs_in_flight"
                f" WHERE endpoint = ? AND {IN_FLIGHT})"), [endpoint]
    return "", []


def _job_filter(status: str | None, reason: str | None, id_prefix: str | None,
                after_seq: int | None, limit: int,
                key: str | None = None, endpoint: str | None = None,
                **more: Any) -> tuple[str, list[Any]]:
    """The WHERE of list_jobs and its arguments, checked."""
    filters = list_filters(status, reason, id_prefix, after_seq, limit, key, endpoint, **more)
    clauses = ["1 = 1", *(_FILTERS[name] for name, _ in filters)]
    return " AND ".join(clauses), [arg for name, args in filters
                                   for arg in (key_args(*args) if name == "key" else args)]


def jobs_with_status(con: sqlite3.Connection, status: str) -> list[dict[str, Any]]:
    """Every job in one status, in seq order, as whole rows."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r:.40}")
    return _dicts(con, f"SELECT * FROM {_jobs(con)} WHERE status = ? ORDER BY seq",
                  (status,))


def _jobs(con: sqlite3.Connection) -> str:
    """What the readers of whole job rows read from: ``jobs``, or, from
    version 4 on (its bodies in a table of their own), the rows with their
    bodies put back in the place of ``jobs.body``."""
    if int(con.execute("PRAGMA user_version").fetchone()[0]) < BODIES_SINCE:
        return "jobs"
    columns = ", ".join("b.body AS body" if name == "body" else f"j.{name}"
                        for name in _columns(con, "jobs"))
    return f"(SELECT {columns} FROM jobs j LEFT JOIN bodies b ON b.seq = j.seq) AS jobs"


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in con.execute(f"PRAGMA table_info({table})")]


def _has_keys(con: sqlite3.Connection) -> bool:
    """Whether the file's jobs carry ordering keys (schema version 3 on)."""
    return "ordering_key" in _columns(con, "jobs")


def _has_table(con: sqlite3.Connection, name: str, kind: str = "table") -> bool:
    return bool(con.execute(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?)",
        (kind, name)).fetchone()[0])


def _dicts(con: sqlite3.Connection, sql: str, args: Any = ()) -> list[dict[str, Any]]:
    cursor = con.execute(sql, args)
    names = [column[0] for column in cursor.description]
    rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    if "endpoint" in names:
        for row in rows:  # a delivery's line shown as its event's own key
            for name in ("ordering_key", "key"):
                if row.get(name) is not None:
                    row[name] = key_of_line(row[name], row["endpoint"])
    return rows


# ------------------------------------------------------------------ endpoints


def endpoint_configs(con: sqlite3.Connection, names: tuple[str, ...] | None
                     ) -> list[Endpoint]:
    if not _has_table(con, "endpoints"):
        return []
    return endpoints.endpoint_configs(con, names)


def endpoints_of(con: sqlite3.Connection) -> list[dict[str, Any]]:
    if not _has_table(con, "endpoints"):
        return []
    return endpoints.public_endpoints(con)


def endpoint_audit(con: sqlite3.Connection, name: str | None) -> list[dict[str, Any]]:
    if name is not None:
        check_endpoint_name(name)
    if not _has_table(con, "endpoint_audit"):
        return []
    sql = "SELECT at_ms, endpoint, action, fields, note, actor FROM endpoint_audit"
    rows = _dicts(con, sql + (" WHERE endpoint = ? ORDER BY seq" if name else " ORDER BY seq"),
                  (name,) if name else ())
    for row in rows:
        row["fields"] = json.loads(row["fields"])
    return rows


# Per endpoint: its deliveries by status, its retries, its last failed attempt
# and its last delivery (a done job's available_at is when it finished).
# Each status from the index that holds it (pending from two: the due, and
# the held behind a line): every count is an index range, no row is read.
_BY_ENDPOINT = f"""SELECT endpoint, 'pending', COUNT(*) FROM jobs INDEXED BY jobs_endpoint_due
  WHERE {DUE_LINE} GROUP BY endpoint
UNION ALL SELECT endpoint, 'leased', COUNT(*) FROM jobs INDEXED BY jobs_in_flight
  WHERE {IN_FLIGHT} GROUP BY endpoint
UNION ALL SELECT endpoint, status, COUNT(*) FROM jobs INDEXED BY {{rest}}
  WHERE {REST_LINE} GROUP BY endpoint, status"""
_RETRIED = ("SELECT j.endpoint, COUNT(*) FROM attempts a JOIN jobs j ON j.id = a.id"
            " WHERE j.endpoint IS NOT NULL AND a.outcome = 'retry' GROUP BY j.endpoint")
_LAST_ERROR = ("SELECT j.endpoint, MAX(a.seq), a.error, a.http_status, a.ended_ms"
               " FROM attempts a JOIN jobs j ON j.id = a.id WHERE j.endpoint IS NOT NULL"
               " AND (a.error IS NOT NULL OR a.http_status NOT BETWEEN 200 AND 299)"
               " GROUP BY j.endpoint")
_DEAD_BY_REASON = ("SELECT endpoint, reason, COUNT(*) FROM jobs INDEXED BY {rest}"
                   f" WHERE {REST_LINE} AND status = 'dead' GROUP BY endpoint, reason")
_LAST_SUCCESS = ("SELECT endpoint, MAX(available_at) FROM jobs INDEXED BY {rest}"
                 f" WHERE {REST_LINE} AND status = 'done' GROUP BY endpoint")


def _rest_index(con: sqlite3.Connection) -> str:
    """The index of an endpoint's held and finished deliveries: a file not
    migrated yet (opened to read only) has version 8's index of them all,
    which the same terms read."""
    if _has_table(con, "jobs_endpoint_rest", kind="index"):
        return "jobs_endpoint_rest"
    return "jobs_by_endpoint"


def endpoint_stats(con: sqlite3.Connection) -> list[dict[str, Any]]:
    """Per endpoint (lease.store.Store.endpoint_stats), read in one transaction."""
    if not _has_table(con, "endpoints"):
        return []
    con.execute("BEGIN")
    try:
        found = endpoints.public_endpoints(con)
        rest = _rest_index(con)
        by_status: dict[str, dict[str, int]] = {}
        for name, status, n in con.execute(_BY_ENDPOINT.format(rest=rest)):
            counts = by_status.setdefault(name, {})
            counts[status] = counts.get(status, 0) + n
        retried = dict(con.execute(_RETRIED).fetchall())
        errors = {name: {"error": error, "http_status": status, "at_ms": at}
                  for name, _, error, status, at in con.execute(_LAST_ERROR)}
        success = dict(con.execute(_LAST_SUCCESS.format(rest=rest)).fetchall())
        dead: dict[str, dict[str, int]] = {}
        for name, reason, n in con.execute(_DEAD_BY_REASON.format(rest=rest)):
            dead.setdefault(name, {})[reason] = n
    finally:
        con.execute("COMMIT")
    return [{**row, **endpoint_figures(by_status.get(row["name"], {}),
                                      retried.get(row["name"], 0), errors.get(row["name"]),
                                      success.get(row["name"])),
             "dead_by_reason": dead.get(row["name"], {})} for row in found]


def endpoint_figures(by_status: dict[str, int], retried: int,
                     last_error: dict[str, Any] | None,
                     last_success_ms: int | None) -> dict[str, Any]:
    return {"ready": by_status.get("pending", 0), "in_flight": by_status.get("leased", 0),
            "done": by_status.get("done", 0), "dead": by_status.get("dead", 0),
            "retried": retried, "last_error": last_error, "last_success_ms": last_success_ms}
