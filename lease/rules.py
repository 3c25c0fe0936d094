"""The product's rules that every store follows, beyond the contract's.

Pure functions (rows in, decisions out) and the product's tables as both
drivers lay them out: the SQLite driver (``lease.sqlite``) and the PostgreSQL
driver (``lease.postgres``) each read and write their own rows, and judge
them here, so a rule is written once and neither driver imports the other.
The contract's own rules (validation, the retry delay, the verdicts, the
finish decision, the marker check) are in ``lease.worker``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lease.policy import PRODUCT, Intake, check_actor, check_note, check_ordering_key
from lease.records import Attempt
from lease.worker import (
    MAX_BATCH,
    MAX_NOW_MS,
    OUTCOMES,
    Conflict,
    check_identifier,
    check_int,
    check_job_id,
    check_now,
    check_outcome,
    check_ticket,
)

__all__ = [
    "DAY_MS",
    "MAX_PAGE",
    "STATUSES",
    "TABLES",
    "TABLES_V1",
    "TABLES_V2",
    "TABLES_V3",
    "TABLES_V4",
    "TABLES_PG4",
    "TABLES_PG5",
    "TABLES_V5",
    "TRACE_COLUMNS",
    "CONSOLE_TABLES",
    "PAUSE_ACTIONS",
    "pause_decision",
    "paused_state",
    "MINUTE_MS",
    "LATENCY_BOUNDS_MS",
    "MINUTE_COLUMNS",
    "BUCKET_COLUMNS",
    "TABLES_PG6",
    "TABLES_PG7",
    "TABLES_V6",
    "TABLES_V7",
    "PRIORITY_COLUMNS",
    "ROLLUP_TABLES",
    "minute_rollup",
    "minute_rows",
    "check_minutes_query",
    "percentiles",
    "WORKER_BEAT_MS",
    "WORKERS_KEPT_MS",
    "check_worker",
    "workers_at_work",
    "ENDPOINT_TABLES",
    "DELIVERY_COLUMNS",
    "CIRCUIT_COLUMNS",
    "cancel_decisions",
    "check_finish_item",
    "check_ids",
    "conflict",
    "in_flight_refusals",
    "kept_audits",
    "list_filters",
    "check_error_filter",
    "status_range",
    "queue_depth",
    "claim_rank",
]

STATUSES = ("pending", "leased", "done", "dead")
DAY_MS = 86_400_000  # "the last day" of the figures that count recent changes
MAX_PAGE = 1000  # the most jobs one list_jobs page holds

# The product's tables and their columns, in order (SQLite's version 4).
TABLES_V4 = {
    "jobs": ["seq", "id", "qty", "status", "attempts", "max_attempts", "token",
             "available_at", "deadline", "owner", "lease_until", "reason", "body", "digest",
             "done_by", "done_started_ms", "done_latency_ms", "done_http_status",
             "done_after", "ordering_key", "held"],
    "attempts": ["seq", "id", "token", "attempt", "owner", "started_ms", "ended_ms", "outcome",
                 "result", "reason", "http_status", "error", "latency_ms"],
    "redrives": ["seq", "id", "token", "at_ms", "note", "actor"],
    "cancels": ["seq", "id", "token", "at_ms", "note", "was", "actor"],
    "tallies": ["name", "n"],
    "bodies": ["seq", "body"],
}
# An endpoint's breaker (lease.breaker.Circuit's fields, in order).
CIRCUIT_COLUMNS = ("circuit", "circuit_since_ms", "circuit_why", "failures", "window_ms",
                   "window_failed", "window_total", "open_until_ms", "cooldown_ms",
                   "paused_until_ms", "failing_since_ms")
# Endpoints (lease.endpoints): SQLite's version 5, PostgreSQL's version 4.
ENDPOINT_TABLES = {
    "endpoints": ["name", "url", "ack", "ca_file", "secrets", "headers", "types",
                  "max_in_flight", "rate", "burst", "insecure_http", "enabled", "tokens",
                  "refilled_ms", "has_work", "served_at", "created_ms", "updated_ms",
                  *CIRCUIT_COLUMNS, "disable_after_ms", "disabled_why", "saved"],
    "endpoint_audit": ["seq", "endpoint", "at_ms", "action", "fields", "note", "actor"],
}
DELIVERY_COLUMNS = ["endpoint", "message", "event_type"]
TABLES_V5 = {**TABLES_V4, "jobs": TABLES_V4["jobs"] + DELIVERY_COLUMNS, **ENDPOINT_TABLES}
# The W3C trace context its intake ran in; NULL: none.
TRACE_COLUMNS = ["trace"]
# The operator's console: SQLite's version 6, PostgreSQL's version 5.
# pause: one row (id 1) while the queue is paused, none otherwise; every
# claim reads it. queue_audit: each pause and resume. workers: each
# dispatcher that claimed (its host and pid as it registered them).
CONSOLE_TABLES = {
    "pause": ["id", "since_ms", "actor", "note"],
    "queue_audit": ["seq", "at_ms", "action", "note", "actor"],
    "workers": ["owner", "host", "pid", "started_ms", "last_claim_ms", "last_claimed"],
}
TABLES_V6 = {**TABLES_V5, "jobs": TABLES_V5["jobs"] + TRACE_COLUMNS, **CONSOLE_TABLES}
# The per-minute rollup of the finishes (the console's charts): SQLite's
# version 7, PostgreSQL's version 6. A send's latency is counted in fixed
# buckets, one column each (b0: <= 1 ms, ..., the last: above 60 s): the
# finish's UPSERT adds to them in place, where a histogram in one JSON text
# would need a read of the row first. One row a minute, endpoint ('' for the
# queue's own jobs) and owner: a dispatcher adds to its own rows, so the
# finishes of many dispatchers never wait for one another's row lock.
MINUTE_MS = 60_000
LATENCY_BOUNDS_MS = (1, 3, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000,
                     60000)
BUCKET_COLUMNS = [f"b{i}" for i in range(len(LATENCY_BOUNDS_MS) + 1)]
MINUTE_COLUMNS = ["minute_ms", "endpoint", "owner", "done", "retried", "dead", *BUCKET_COLUMNS]
ROLLUP_TABLES = {"minutes": MINUTE_COLUMNS}
TABLES_V7 = {**TABLES_V6, **ROLLUP_TABLES}
# An event's priority (lease.policy.check_priority): SQLite's version 8,
# PostgreSQL's version 7; 0 for every job written before.
PRIORITY_COLUMNS = ["priority"]
TABLES = {**TABLES_V7, "jobs": TABLES_V7["jobs"] + PRIORITY_COLUMNS}
# PostgreSQL's versions have these tables (its jobs keep their bodies)
TABLES_PG4 = {name: columns for name, columns in TABLES_V5.items() if name != "bodies"}
TABLES_PG5 = {name: columns for name, columns in TABLES_V6.items() if name != "bodies"}
TABLES_PG6 = {name: columns for name, columns in TABLES_V7.items() if name != "bodies"}
TABLES_PG7 = {name: columns for name, columns in TABLES.items() if name != "bodies"}
TABLES_V3 = {name: columns for name, columns in TABLES_V4.items() if name != "bodies"}
TABLES_V2 = {**TABLES_V3, "jobs": TABLES_V4["jobs"][:-2]}
TABLES_V1 = {  # version 1: a version-1 PostgreSQL database has these
    "jobs": ["seq", "id", "qty", "status", "attempts", "max_attempts", "token",
             "available_at", "deadline", "owner", "lease_until", "reason", "body", "digest",
             "done_by", "done_started_ms", "done_latency_ms", "done_http_status",
             "done_after"],
    "attempts": ["seq", "id", "token", "attempt", "owner", "started_ms", "ended_ms", "outcome",
                 "result", "reason", "http_status", "error", "latency_ms"],
    "cancels": ["seq", "id", "token", "at_ms", "note", "was"],
    "tallies": ["name", "n"],
}



# ------------------------------------------------------------------ pause and resume
#
# A paused queue leases nothing: every claim (the queue's own jobs and the
# deliveries) reads the pause row first and, when there is one, returns no
# lease and changes nothing (not even its quarantine: a paused queue is one
# the operator wants left as it is; the quarantine runs at the first claim
# after the resume). Leases taken before the pause run to their end, and
# their finishes are written: a pause stops new sends, never one on the wire.

PAUSE_ACTIONS = ("pause", "resume")


def pause_decision(action: str, paused: bool, note: object, actor: object) -> bool:
    """Pure: whether a pause or a resume changes the queue (False: it is
    already so, and nothing is written, no audit row either); the note and
    the actor checked first, so a bad one is refused whatever the state."""
    if action not in PAUSE_ACTIONS:
        raise ValueError(f"action must be one of {PAUSE_ACTIONS}, got {action!r:.40}")
    check_note(note)
    check_actor(actor)
    return paused != (action == "pause")


def paused_state(row: tuple[int, str | None, str] | None) -> dict[str, Any] | None:
    """The pause row (since_ms, actor, note) as Store.paused gives it; None: not paused."""
    if row is None:
        return None
    since_ms, actor, note = row
    return {"since_ms": int(since_ms), "actor": actor, "note": note}


# ------------------------------------------------------------------ the per-minute rollup

_COUNTED = {"done": 0, "pending": 1, "dead": 2}  # a finish's status -> done, retried, dead


def minute_rollup(items: list, results: list, endpoints_of: Mapping[str, str],
                  now_ms: int) -> list[tuple]:
    """Pure: a finish's additions to the rollup, one row per (minute,
    endpoint, owner), sorted (the order both stores lock them in): the
    minute of ``now_ms``, the endpoint ('' for the queue's own), the
    ticket's owner, then done, retried, dead and the latency buckets.
    A stale finish (False) and an evidence-only item (no outcome) add
    nothing: no outcome was written. ``endpoints_of``: id -> endpoint."""
    minute = now_ms - now_ms % MINUTE_MS
    groups: dict[tuple[str, str], list[int]] = {}
    for (ticket, outcome, _, seen), result in zip(items, results, strict=True):
        if outcome is None or not result or result[0] not in _COUNTED:
            continue
        key = (endpoints_of.get(ticket["id"], ""), ticket["owner"])
        row = groups.setdefault(key, [0] * (3 + len(BUCKET_COLUMNS)))
        row[_COUNTED[result[0]]] += 1
        if seen.latency_ms is not None:
            row[3 + _bucket(seen.latency_ms)] += 1
    return [(minute, endpoint, owner, *row) for (endpoint, owner), row in sorted(groups.items())]


def _bucket(latency_ms: int) -> int:
    for index, bound in enumerate(LATENCY_BOUNDS_MS):
        if latency_ms <= bound:
            return index
    return len(LATENCY_BOUNDS_MS)


def check_minutes_query(since_ms: object, endpoint: object) -> None:
    """Store.minutes's arguments: a clock value, and None, '' (the queue's
    own jobs) or an endpoint's name."""
    check_now(since_ms, "since_ms")
    if endpoint is not None and endpoint != "":
        check_identifier("endpoint", endpoint)


def minute_rows(rows: Iterable[tuple]) -> list[dict[str, Any]]:
    """Pure: the rollup's rows (MINUTE_COLUMNS, summed over the owners) as
    Store.minutes gives them: by minute, then endpoint; ``buckets`` a list."""
    summed: dict[tuple[int, str], list[int]] = {}
    for minute_ms, endpoint, _owner, *figures in rows:
        into = summed.setdefault((int(minute_ms), endpoint), [0] * len(figures))
        for index, value in enumerate(figures):
            into[index] += int(value)
    return [{"minute_ms": minute_ms, "endpoint": endpoint, "done": figures[0],
             "retried": figures[1], "dead": figures[2], "buckets": figures[3:]}
            for (minute_ms, endpoint), figures in sorted(summed.items())]


def percentiles(buckets: list[int], quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)
                ) -> list[int | None]:
    """Pure: each quantile of a latency histogram as the upper bound (ms) of
    the bucket it falls in (an estimate no lower than the truth); None when
    the histogram is empty, or for a quantile above the last bound."""
    total = sum(buckets)
    out: list[int | None] = []
    for quantile in quantiles:
        if total == 0:
            out.append(None)
            continue
        rank, seen = quantile * total, 0
        found: int | None = None
        for index, count in enumerate(buckets):
            seen += count
            if seen >= rank:
                found = LATENCY_BOUNDS_MS[index] if index < len(LATENCY_BOUNDS_MS) else None
                break
        out.append(found)
    return out


# ------------------------------------------------------------------ the dispatchers at work
#
# Each claim names its owner, and records itself in the workers table in its
# own transaction: when it claimed and how many it leased (one UPSERT). A
# claim that leased nothing (an idle poll, a paused queue's) writes only when
# the row's last claim is WORKER_BEAT_MS old: an idle dispatcher would
# otherwise turn each poll into a written transaction (an fsync on SQLite).
# Host and pid come from the dispatcher's registration when it opens
# (Store.register_worker): the claim's signature stays as it is. A row whose
# last sign of life (claim or registration) is older than WORKERS_KEPT_MS is
# not shown, and prune_done deletes it.

WORKER_BEAT_MS = 10_000
WORKERS_KEPT_MS = DAY_MS
MAX_HOST_CHARS = 255


def check_worker(owner: object, host: object, pid: object) -> None:
    """A registration's owner (an identifier, as a claim's), host (1-255
    characters without control characters) and pid (an int >= 0)."""
    check_identifier("owner", owner)
    if (type(host) is not str or not 1 <= len(host) <= MAX_HOST_CHARS
            or any(ord(c) < 32 or ord(c) == 127 for c in host)):
        raise ValueError(f"host must be 1-{MAX_HOST_CHARS} characters without control "
                         f"characters, got {host!r:.40}")
    check_int("pid", pid, 0, 2**31 - 1)


def workers_at_work(rows: Iterable[tuple], leases: Mapping[str, int],
                    now_ms: int) -> list[dict[str, Any]]:
    """Pure: the workers rows (owner, host, pid, started_ms, last_claim_ms,
    last_claimed) seen within WORKERS_KEPT_MS, each with its live leases
    (``leases``: owner -> leases live at ``now_ms``), by owner."""
    kept_since = now_ms - WORKERS_KEPT_MS
    out = []
    for owner, host, pid, started_ms, last_claim_ms, last_claimed in sorted(rows):
        seen = max(started_ms or 0, last_claim_ms or 0)
        if seen < kept_since:
            continue
        out.append({"owner": owner, "host": host, "pid": pid, "started_ms": started_ms,
                    "last_claim_ms": last_claim_ms, "last_claimed": last_claimed,
                    "live_leases": leases.get(owner, 0)})
    return out


def conflict(intake: Intake, qty: int, digest: str | None,
              key: str | None = None, event_type: str | None = None) -> Conflict:
    """The intake's refusal of an id kept with other content, in every store's words."""
    return Conflict(f"job {intake.id!r} exists with other content "
                    f"({_content(qty, digest, key, event_type)}, not "
                    f"{_content(intake.qty, intake.digest, intake.key, intake.type)})")


def _content(qty: int, digest: str | None, key: str | None, event_type: str | None) -> str:
    text = f"qty {qty}" if digest is None else f"body sha256 {digest[:12]}..."
    if key is not None:
        text = f"{text}, key {key!r:.40}"
    return text if event_type is None else f"{text}, type {event_type!r:.40}"


def in_flight_refusals(rows: Mapping[str, Mapping], firsts: Mapping[str, Mapping],
                        results: list, job_ids: list) -> list:
    """Pure: a cancelled keyed job cannot go back in its line while a later job
    of its key is on the wire (two of a key would be delivered at once): its
    True becomes a ValueError. ``firsts``: key -> its marked job (seq, id,
    status). Every store calls this."""
    out = []
    for job_id, result in zip(job_ids, results, strict=True):
        row = rows.get(job_id)
        first = None if row is None or row["ordering_key"] is None \
            else firsts.get(row["ordering_key"])
        if (result is True and row is not None and row["reason"] == "cancelled"
                and first is not None and first["status"] == "leased"
                and first["seq"] > row["seq"]):
            out.append(ValueError(
                f"job {job_id!r} was cancelled and the later job {first['id']!r} of its key "
                f"{row['ordering_key']!r:.40} is being delivered: redrive it when that "
                f"one has finished"))
        else:
            out.append(result)
    return out


def kept_audits(audits: list, results: list, job_ids: list) -> list:
    """Pure: of a redrive's audit rows (id, token), the ones whose id is still
    True at its first place in ``job_ids`` (where redrive_decisions
    released it) once in_flight_refusals has judged. Every store calls this.

    Each id's first result is found in a dict made in one pass: a scan of
    the list per id (list.index) made a redrive of 10,000 ids quadratic,
    0.8 s inside its write transaction."""
    first: dict = {}
    for job_id, result in zip(job_ids, results, strict=True):
        first.setdefault(job_id, result)
    return [(job_id, token) for job_id, token in audits if first[job_id] is True]


def check_finish_item(item: object) -> None:
    if type(item) is not tuple or len(item) != 4:
        raise ValueError("each item must be a tuple (ticket, outcome, delay_ms, Attempt)")
    ticket, outcome, delay_ms, attempt = item
    check_ticket(ticket, PRODUCT)
    if type(attempt) is Attempt:
        # The checks below in one expression, for the common case of a good
        # item; any miss goes through them one by one for the error's words.
        started, latency, status, error, wait = attempt
        if ((outcome is None or (type(outcome) is str and outcome in OUTCOMES))
                and (wait is None or (type(wait) is int and 0 <= wait <= 10**12))
                and type(delay_ms) is int and 0 <= delay_ms <= PRODUCT.max_delay_ms
                and type(started) is int and 0 <= started <= MAX_NOW_MS
                and (latency is None or (type(latency) is int and 0 <= latency <= 10**12))
                and (status is None or (type(status) is int and 0 <= status <= 10**12))
                and (error is None or type(error) is str)):
            return
    if outcome is not None:
        check_outcome(outcome)
    check_int("delay_ms", delay_ms, 0, PRODUCT.max_delay_ms)
    if not isinstance(attempt, Attempt):
        raise ValueError(f"evidence must be an Attempt, got {type(attempt).__name__}")
    check_now(attempt.started_ms, "attempt started_ms")
    for name in ("latency_ms", "http_status", "retry_after_ms"):
        value = getattr(attempt, name)
        if value is not None:
            check_int(f"attempt {name}", value, 0, 10**12)
    if attempt.error is not None and type(attempt.error) is not str:
        raise ValueError(f"attempt error must be None or a str, got "
                         f"{type(attempt.error).__name__}")


def check_ids(job_ids: object) -> list:
    if type(job_ids) is not list or len(job_ids) > MAX_BATCH:
        raise ValueError(f"job_ids must be a list of at most {MAX_BATCH}")
    for job_id in job_ids:
        check_job_id("job_id", job_id, PRODUCT)
    return job_ids


def cancel_decisions(rows: Mapping[str, Mapping], job_ids: list) -> tuple[list, list]:
    """Pure: given the rows of the ids (id -> row with seq, id, status, reason,
    token), per id True or its ValueError, in order; the audit rows
    (seq, id, token, was). Every store calls this."""
    cancelled: set = set()
    results: list = []
    audits: list = []
    for job_id in job_ids:
        row = rows.get(job_id)
        if row is None:
            results.append(ValueError(f"job {job_id!r} does not exist"))
        elif job_id in cancelled or row["reason"] == "cancelled":
            results.append(ValueError(f"job {job_id!r} is already cancelled"))
        elif row["status"] not in ("pending", "dead"):
            results.append(ValueError(f"job {job_id!r} is {row['status']}: only a pending "
                                      f"or dead job can be cancelled"))
        else:
            cancelled.add(job_id)
            was = row["status"] if row["reason"] is None else f"{row['status']}/{row['reason']}"
            audits.append((row["seq"], job_id, row["token"], was))
            results.append(True)
    return results, audits


MAX_ERROR_FILTER_CHARS = 200
_STATUS_CLASS = re.compile(r"([1-5])xx")


def check_error_filter(text: object) -> str:
    """An error-text filter: 1-200 characters without control characters,
    matched as a substring (case-sensitive) of the last attempt's error."""
    if (type(text) is not str or not 1 <= len(text) <= MAX_ERROR_FILTER_CHARS
            or any(ord(c) < 32 or ord(c) == 127 for c in text)):
        raise ValueError(f"error must be 1-{MAX_ERROR_FILTER_CHARS} characters without "
                         f"control characters, got {text!r:.40}")
    return text


def status_range(value: object) -> tuple[int, int]:
    """An HTTP status filter as the range it matches: an exact status (an int
    100-599, or its digits) or a class ("4xx": 400-499)."""
    if type(value) is str:
        found = _STATUS_CLASS.fullmatch(value)
        if found is not None:
            low = int(found.group(1)) * 100
            return low, low + 99
        if value.isdigit() and len(value) == 3:
            value = int(value)
    if type(value) is not int or not 100 <= value <= 599:
        raise ValueError(f"http_status must be a status 100-599 or a class 1xx-5xx, "
                         f"got {value!r:.40}")
    return value, value


def list_filters(status: str | None, reason: str | None, id_prefix: str | None,
                 after_seq: int | None, limit: int,
                 key: str | None = None, endpoint: str | None = None, *,
                 error: str | None = None, http_status: int | str | None = None,
                 from_ms: int | None = None, to_ms: int | None = None
                 ) -> list[tuple[str, list]]:
    """Pure: list_jobs's filters, checked, as (name, arguments) in order:
    "status", "reason", "id_prefix" (its length and itself), "after_seq",
    "key", "endpoint" (a delivery's, exactly), "error" (a substring of the
    last attempt's error), "http_status" (the last attempt's, or a done
    job's delivering one: the range low..high), "from" and "to" (its
    available_at, which is when a done or dead job finished: from <= it <
    to). Each driver writes its own condition for each name."""
    filters: list[tuple[str, list]] = []
    if status is not None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r:.40}")
        filters.append(("status", [status]))
    if reason is not None:
        check_identifier("reason", reason)
        filters.append(("reason", [reason]))
    if id_prefix is not None:
        if type(id_prefix) is not str or not 1 <= len(id_prefix) <= 255:
            raise ValueError(f"id_prefix must be 1-255 characters, got {id_prefix!r:.40}")
        filters.append(("id_prefix", [len(id_prefix), id_prefix]))
    if after_seq is not None:
        if type(after_seq) is not int or after_seq < 0:
            raise ValueError(f"after_seq must be an int >= 0, got {after_seq!r:.40}")
        filters.append(("after_seq", [after_seq]))
    if key is not None:
        check_ordering_key(key, "key")
        filters.append(("key", [key]))
    if endpoint is not None:
        check_identifier("endpoint", endpoint)
        filters.append(("endpoint", [endpoint]))
    if error is not None:
        filters.append(("error", [check_error_filter(error)]))
    if http_status is not None:
        filters.append(("http_status", list(status_range(http_status))))
    for name, moment in (("from", from_ms), ("to", to_ms)):
        if moment is not None:
            filters.append((name, [check_now(moment, f"{name}_ms")]))
    if from_ms is not None and to_ms is not None and to_ms <= from_ms:
        raise ValueError(f"to_ms must be after from_ms, got {from_ms}..{to_ms}")
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be an int in 1..{MAX_PAGE}, got {limit!r:.40}")
    return filters


# ------------------------------------------------------------------ the queue's depth
#
# What a metrics scrape reads of a queue (Store.queue_depth), assembled from the
# one grouped scan each driver runs: rows of (endpoint or None, status, count,
# ready now, oldest ready available_at). Ready is what a claim may take now,
# so a job waiting behind its key's dead first is not ready (it is blocked:
# blocked_keys counts those keys), and an old age means dispatchers behind.
# Both drivers call this, so the figures mean the same on both.

def queue_depth(rows: Iterable[tuple[str | None, str, int, int, int | None]], now_ms: int,
                blocked_keys: int, endpoints: Iterable[tuple[str, bool, str]]
                ) -> dict[str, Any]:
    """The queue's figures: jobs ``by_status`` (every status, 0 where none),
    ``ready`` (what a claim may take now: pending, due, and first of its key's
    line), ``oldest_ready_age_ms`` (None when none is ready), ``blocked_keys``;
    and per endpoint (name, enabled, circuit state), the same figures of its
    deliveries, every endpoint listed (zeros where it has none). A queue's own
    jobs count in the totals only."""
    def figures() -> dict[str, Any]:
        return {"by_status": dict.fromkeys(STATUSES, 0), "ready": 0, "oldest": None}

    total = figures()
    per: dict[str, dict[str, Any]] = {}
    for endpoint, status, count, ready, oldest in rows:
        parts = [total] if endpoint is None else [total, per.setdefault(endpoint, figures())]
        for part in parts:
            part["by_status"][status] = part["by_status"].get(status, 0) + count
            part["ready"] += ready or 0
            if oldest is not None and (part["oldest"] is None or oldest < part["oldest"]):
                part["oldest"] = oldest

    def shown(part: dict[str, Any]) -> dict[str, Any]:
        oldest = part["oldest"]
        return {"by_status": part["by_status"], "ready": part["ready"],
                "oldest_ready_age_ms": None if oldest is None else max(0, now_ms - oldest)}

    return {**shown(total), "blocked_keys": blocked_keys,
            "endpoints": [{"name": name, "enabled": bool(enabled), "circuit": circuit,
                           **shown(per.get(name) or figures())}
                          for name, enabled, circuit in sorted(endpoints)]}


# ------------------------------------------------------------------ priorities
#
# A claim takes, of the jobs it may lease (due, not held behind an earlier
# job of their key, within their endpoint's room), the higher priority
# first; within a priority its old order (seq, and for an endpoint's
# deliveries the time they became due first). Both stores' claim statements
# say so in their ORDER BY; this is the order of what a claim returns.


def claim_rank(row: Sequence[Any]) -> tuple[int, int]:
    """Pure: the sort key of a leased row led by its seq and ended by its
    priority: the higher priority first, then seq."""
    return -row[-1], row[0]
