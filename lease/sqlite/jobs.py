"""The SQLite driver's transactions: intake, claim, extension, finish, redrive,
cancel and prune, each one short ``BEGIN IMMEDIATE`` on the product file."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from typing import Any

from lease.breaker import signal_of
from lease.clock import wall_clock_ms
from lease.endpoints import (
    MAX_RECOVER,
    Endpoint,
    check_endpoint_name,
    check_recover_ids,
    check_served,
    key_of_line,
)
from lease.policy import (
    DEFAULT_POLICY,
    PRODUCT,
    Intake,
    RetryPolicy,
    check_actor,
    check_not_before,
    check_note,
    check_product_event,
)
from lease.records import (
    MAX_ERROR_CHARS,
    Attempt,
    Leased,
    check_on_conflict,
    judge_intake,
)
from lease.rules import (
    cancel_decisions,
    check_finish_item,
    check_ids,
    conflict,
    in_flight_refusals,
    kept_audits,
    minute_rollup,
)
from lease.sqlite import batch, endpoints
from lease.sqlite.console import (
    add_minutes,
    is_paused,
    prune_minutes,
    prune_workers,
    worker_claimed,
)
from lease.sqlite.endpoints import Fanout, pick_deliveries
from lease.sqlite.errors import store_errors
from lease.sqlite.schema import SCHEMA_VERSION, migrate_here
from lease.sqlite.statements import (
    ANY_LINE,
    ATTEMPTS_HIGH,
    AUDIT_CANCELS,
    AUDIT_REDRIVES,
    CANCEL,
    CONTENT_OF,
    DEMOTE,
    EXTEND,
    FINISH_FIXED,
    FINISH_NAMES,
    FIRSTS,
    INSERT_BODY,
    INSERT_JOB,
    KEEP_ATTEMPTS_HIGH,
    LEASE_FIXED,
    LEASE_NAMES,
    MARKED_BY_ID,
    PICK_READY,
    PICK_READY_NAMES,
    PROMOTE,
    PRUNABLE,
    PRUNE_ATTEMPTS,
    PRUNE_BODIES,
    PRUNE_CANCELS,
    PRUNE_JOBS,
    PRUNE_REDRIVES,
    RECORD_ATTEMPTS,
    RECOVER,
    RECOVERABLE,
    RELEASE,
    TALLY,
)
from lease.tracing import capture
from lease.worker import (
    MARKED,
    MARKED_NAMES,
    MAX_BATCH,
    Conflict,
    Fault,
    NotAQueue,
    call_fault,
    check_connection,
    check_fault,
    check_identifier,
    check_int,
    check_now,
    check_ticket,
    extended_until,
    immediate,
    judge_rows,
    lease_ticket,
    marker_matches,
    quarantine,
    redrive_decisions,
    select_rows,
)

# ------------------------------------------------------------------ intake


def enqueue_events(
    con: sqlite3.Connection,
    events: Iterable[object],
    now_ms: int,
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    not_before_ms: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    on_conflict: str = "return",
) -> list:
    """Enqueue events in one transaction: all of them or, on a bad event or any
    error while ``events`` is read, none. ``events`` may be a generator (a
    large file read line by line): each is checked as it comes, and memory
    stays bounded by the results list.

    Per event: True (new), False (the same id with the same content: a
    duplicate, its row and its budget untouched) or a Conflict (the same id
    with other content; the others go on). With ``on_conflict="raise"`` a
    conflict refuses the whole call instead: every event is still judged,
    then Conflicts (naming each conflicting event) rolls the transaction
    back. The content is the qty of an {"id", "qty"} event and the body's
    canonical digest of an {"id", "body"} event. ``not_before_ms`` delays the
    first attempt (delayed delivery).
    A connection from the contract's ``open_queue`` will do: a contract file
    is migrated forward inside the same transaction.
    """
    check_connection(con)
    check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    available_at = now_ms if not_before_ms is None else check_not_before(not_before_ms, now_ms)
    with immediate(con):
        # A contract file is migrated in the intake's own transaction: an intake
        # refused halfway leaves it exactly as it was, at its old version too.
        migrate_here(con)
        return judge_intake(_intake(con, events, now_ms, available_at, policy, on_progress,
                                    capture()), on_conflict)


def _intake(con: sqlite3.Connection | sqlite3.Cursor, events: Iterable[object],
            now_ms: int, available_at: int, policy: RetryPolicy,
            on_progress: Callable[[int], None] | None = None, trace: str | None = None) -> list:
    """Inside a transaction: each event checked and inserted, then each key
    that got a job given its first in line; per event True, False or Conflict.
    Each new job keeps ``trace``, the context the intake ran in (lease.tracing)."""
    results: list = []
    lines: set[str] = set()
    fanout = Fanout.of(con)
    for event in events:
        intake = check_product_event(event)
        try:
            new = _insert(con, intake, now_ms, available_at, policy, trace) if fanout is None \
                else fanout.insert(con, intake, available_at, policy, trace)
        except Conflict as conflict:
            results.append(conflict)
        else:
            results.append(new is not None)
            lines.update(new or ())
        if on_progress is not None and len(results) % 1000 == 0:
            on_progress(len(results))
    if fanout is not None:
        fanout.write_work(con)
    _promote(con, lines)
    return results


def enqueue_in(
    con: sqlite3.Connection,
    events: Iterable[object],
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    now_ms: int | None = None,
    not_before_ms: int | None = None,
    on_conflict: str = "raise",
) -> list:
    """The transactional outbox: enqueue on the service's own connection,
    inside the transaction it has open, so the jobs commit or roll back with
    the service's rows. Per event True (new) or False (a duplicate).

    An event whose id is kept with other content raises Conflicts (a
    Conflict), after this call's rows are rolled back: an event the service
    meant to send is never dropped without an error, and the service's
    transaction is the service's to roll back (``with con:`` does). Only
    ``on_conflict="return"`` gives each Conflict in the results instead, and
    writes the rest, as enqueue_events does by default.

    ``con`` is the service's sqlite3 connection to a file that holds the queue
    (declared shared, beside the service's tables: ``SQLiteStore(path,
    create=True, shared=True)`` once makes it). A connection with no
    transaction open is refused: the jobs would be committed on their own,
    which is what this function exists to prevent. All or none: a bad event
    rolls back what this call wrote (a savepoint), never the service's work.
    ``now_ms`` None: this host's clock.
    """
    if not isinstance(con, sqlite3.Connection):
        raise ValueError(f"con must be a sqlite3.Connection, got {type(con).__name__}")
    if not con.in_transaction:
        raise ValueError("enqueue_in needs the service's open transaction (BEGIN, then the "
                         "service's writes, then enqueue_in, then COMMIT): con has none")
    now = wall_clock_ms() if now_ms is None else check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    available_at = now if not_before_ms is None else check_not_before(not_before_ms, now)
    cursor = con.cursor()
    cursor.row_factory = None  # the service's factory, whatever it is, is not ours
    with store_errors():
        version = int(cursor.execute("PRAGMA user_version").fetchone()[0])
        if version != SCHEMA_VERSION:
            raise NotAQueue(f"the file holds no version {SCHEMA_VERSION} queue (version "
                            f"{version}): open it once with SQLiteStore(path, create=True, "
                            f"shared=True)")
        cursor.execute("SAVEPOINT lease_enqueue_in")
        try:
            results = judge_intake(_intake(cursor, events, now, available_at, policy,
                                           trace=capture()), on_conflict)
        except BaseException:
            cursor.execute("ROLLBACK TO lease_enqueue_in")
            cursor.execute("RELEASE lease_enqueue_in")
            raise
        cursor.execute("RELEASE lease_enqueue_in")
    return results


def _insert(con: sqlite3.Connection | sqlite3.Cursor, intake: Intake, now_ms: int,
            available_at: int, policy: RetryPolicy, trace: str | None = None) -> list[str] | None:
    """Inside a transaction: a new pending job of the queue's own (its
    ordering line, if it has one), or None for the duplicate kept. A keyed
    job is held until ``_promote`` finds it first in line."""
    row = con.execute(CONTENT_OF,
                      (intake.id,)).fetchone()
    if row is not None:
        qty, digest, line, event_type, endpoint = row
        key = key_of_line(line, endpoint)
        if (qty, digest, key, event_type) != (intake.qty, intake.digest, intake.key,
                                              intake.type):
            raise conflict(intake, qty, digest, key, event_type)
        return None
    con.execute(
        INSERT_JOB,
        (intake.id, intake.qty, policy.max_attempts, available_at,
         available_at + policy.ttl_ms, intake.digest, intake.key,
         0 if intake.key is None else 1, intake.type, trace, intake.priority),
    )
    if intake.body is not None:
        con.execute(INSERT_BODY,
                    (intake.body,))
    return [] if intake.key is None else [intake.key]


# ------------------------------------------------------------------ ordered keys


def _promote(con: sqlite3.Connection | sqlite3.Cursor, keys: Iterable[str]) -> None:
    """Inside a transaction: each key's line given its first, if it has none."""
    for key in sorted(set(keys)):
        con.execute(PROMOTE, {"key": key})


def _keys_of(con: sqlite3.Connection, seqs: list) -> list[str]:
    """The ordering keys of the rows ``seqs``."""
    if not seqs or not con.execute(ANY_LINE).fetchone()[0]:
        return []
    marks = ", ".join("?" * len(seqs))
    return [key for (key,) in con.execute(
        f"SELECT DISTINCT ordering_key FROM jobs WHERE seq IN ({marks})"
        " AND ordering_key IS NOT NULL", seqs)]


def _rows_by_id(con: sqlite3.Connection, job_ids: list) -> dict[str, Any]:
    """Inside a transaction: what an operator's redrive or cancel judges of each
    named job (its marker, its reason and its key), by id."""
    unique = sorted(set(job_ids))
    if not unique:
        return {}
    marks = ", ".join("?" * len(unique))
    sql = (f"SELECT seq, id, status, reason, token, ordering_key, endpoint FROM jobs"
           f" WHERE id IN ({marks})")
    return {row["id"]: row for row in select_rows(con, sql, unique)}


# ------------------------------------------------------------------ one attempt


def claim_jobs(
    con: sqlite3.Connection,
    owner: str,
    now_ms: int,
    lease_ms: int,
    limit: int = 1,
    fault: Fault = None,
    endpoints: str | tuple[str, ...] | None = None,
) -> tuple[list, dict]:
    """The contract's claim transaction with the product's lease range: up to
    ``limit`` Leased jobs (ticket and body), and the quarantine's moves by
    reason ({"deadline": n, "exhausted": m}). ``endpoints`` None: the
    queue's own jobs; "*" or names: deliveries, fairly, within each
    endpoint's cap and bucket (lease.endpoints)."""
    check_connection(con)
    check_identifier("owner", owner)
    check_now(now_ms)
    check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    check_int("limit", limit, 1, MAX_BATCH)
    check_fault(fault)
    served = check_served(endpoints)
    with immediate(con):
        if is_paused(con):  # leases nothing, changes no job (lease.rules, "pause")
            worker_claimed(con, owner, now_ms, 0)
            return [], {"deadline": 0, "exhausted": 0}
        moved = quarantine(con, now_ms)
        if served is None:
            rows = [dict(zip(PICK_READY_NAMES, row, strict=True)) for row in batch.BATCH.read(
                con, PICK_READY_NAMES, PICK_READY, {"now": now_ms, "limit": limit})]
        else:
            rows = pick_deliveries(con, served, now_ms, limit)
        tickets = [lease_ticket(row, owner, now_ms, lease_ms) for row in rows]
        if tickets:
            batch.BATCH.update(con, LEASE_FIXED, LEASE_NAMES,
                               [(t["attempt"], t["token"], owner, t["lease_until"], row["seq"])
                                for row, t in zip(rows, tickets, strict=True)])
        worker_claimed(con, owner, now_ms, len(tickets))
        if tickets:
            call_fault(fault, "after-claim")
    if tickets:
        call_fault(fault, "after-commit")
    if served is None:
        return [Leased(ticket, row["body"], row["digest"], trace=row["trace"])
                for row, ticket in zip(rows, tickets, strict=True)], moved
    return [Leased(ticket, row["body"], row["digest"], row["endpoint"], row["message"],
                   row["trace"])
            for row, ticket in zip(rows, tickets, strict=True)], moved


def extend_lease(
    con: sqlite3.Connection,
    ticket: dict,
    now_ms: int,
    lease_ms: int,
    fault: Fault = None,
) -> dict | bool:
    """The contract's extension (whole-marker check) with the product's ranges."""
    check_connection(con)
    check_ticket(ticket, PRODUCT)
    check_now(now_ms)
    check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    check_fault(fault)
    with immediate(con):
        row = select_rows(con, MARKED_BY_ID, (ticket["id"],)).fetchone()
        if row is None or not marker_matches(row, ticket, now_ms):
            return False
        lease_until = extended_until(row["lease_until"], row["deadline"], now_ms, lease_ms)
        con.execute(EXTEND, (lease_until, row["seq"]))
        call_fault(fault, "after-extend")
    call_fault(fault, "after-commit")
    return {**ticket, "lease_until": lease_until}


def finish_jobs(
    con: sqlite3.Connection,
    items: list,
    now_ms: int,
    fault: Fault = None,
) -> list:
    """Record outcomes and their evidence in one transaction.

    ``items``: (ticket, outcome, delay_ms, Attempt). ``outcome`` is "ok",
    "retry", "permanent" — the contract's fenced finish — or None: an attempt
    that proved nothing (a bad ACK, an unclassified error), recorded as
    evidence while the job stays leased for its lease expiry to recover.
    Per item: (status, reason) as finish_batch gives it, False for a stale
    ticket (its attempt recorded, and counted in ``stale_finishes``), or
    ("leased", None) for an evidence-only item.
    """
    check_connection(con)
    if type(items) is not list or len(items) > MAX_BATCH:
        raise ValueError(f"items must be a list of at most {MAX_BATCH}")
    for item in items:
        check_finish_item(item)
    check_now(now_ms)
    check_fault(fault)
    finishing = [(t, o, d) for t, o, d, _ in items if o is not None]
    endpoints_of: dict[str, str] = {}
    with immediate(con):
        results, updates, seqs = _judge_marked(con, finishing, now_ms, endpoints_of) \
            if finishing else ([], [], [])
        outcomes = iter(results)
        merged = [next(outcomes) if outcome is not None else ("leased", None)
                  for _, outcome, _, _ in items]
        done, rows = _plan_evidence(items, merged, _attempts_high(con), now_ms)
        # a delivery's evidence goes on its row in the finish's own UPDATE
        evidence = [value for value, (_, outcome, _, _) in zip(done, items, strict=True)
                    if outcome is not None]
        more = [value for value, result in zip(evidence, results, strict=True)
                if result is not False]
        plain = [update for update, value in zip(updates, more, strict=True) if value is None]
        rich = [(*update[:3], *value, update[3])
                for update, value in zip(updates, more, strict=True) if value is not None]
        if plain:
            batch.BATCH.update(con, FINISH_FIXED, FINISH_NAMES, plain)
        if rich:
            batch.BATCH.update(con, FINISH_FIXED, FINISH_NAMES + _DONE_COLUMNS, rich)
        _record_attempts(con, rows, merged)
        found = iter(seqs)
        finished = [next(found) if outcome is not None else None for _, outcome, _, _ in items]
        # a line whose first was delivered: the next one goes
        _promote(con, _keys_of(con, [seq for seq, result in zip(finished, merged, strict=True)
                                     if result and result[0] == "done"]))
        if endpoints_of:
            _judge_circuits(con, items, merged, endpoints_of, now_ms)
        add_minutes(con, minute_rollup(items, merged, endpoints_of, now_ms))
        changed = any(results)
        if changed:
            call_fault(fault, "after-finish")
    if changed:
        call_fault(fault, "after-commit")
    return merged


def _judge_circuits(con: sqlite3.Connection, items: list, results: list,
                    endpoints_of: dict[str, str], now_ms: int) -> None:
    """Inside the finish's transaction: what each delivery's attempt tells
    its endpoint's breaker (not a stale finish's: a sender whose lease ran
    out speaks of a time the breaker has moved past)."""
    signals: list[tuple[str, str, Attempt]] = []
    for (ticket, outcome, _, seen), result in zip(items, results, strict=True):
        endpoint = endpoints_of.get(ticket["id"])
        if endpoint is None or result is False:
            continue
        signal = signal_of(outcome, seen)
        if signal is not None:
            signals.append((endpoint, signal, seen))
    if signals:
        endpoints.judge_circuits(con, signals, now_ms)


def _judge_marked(con: sqlite3.Connection, items: list, now_ms: int,
                  endpoints_of: dict[str, str]) -> tuple[list, list, list]:
    """Inside a transaction: the fenced finish of each (ticket, outcome, delay_ms),
    in order, as single finishes in sequence would do it (a job finished earlier
    in the list is no longer leased for a later item). Per item (status,
    reason) or False; the rows' updates (status, reason, available_at, seq);
    per item the row's seq (None when False). ``endpoints_of`` gets the
    endpoint of each delivery among them, by id."""
    ids = sorted({ticket["id"] for ticket, _, _ in items})
    found = batch.BATCH.read(
        con, _FINISH_NAMES,
        f"SELECT {MARKED}, endpoint FROM jobs WHERE id IN ({', '.join('?' * len(ids))})", ids)
    # dicts made straight from tuples: a sqlite3.Row copied into one costs twice
    rows = {row[1]: dict(zip(_FINISH_NAMES, row, strict=True)) for row in found}  # [1]: id
    endpoints_of.update((job_id, row["endpoint"]) for job_id, row in rows.items()
                        if row["endpoint"] is not None)
    return judge_rows(rows, items, now_ms)


# What a finish reads of a row: the contract's marker, and a delivery's endpoint.
_FINISH_NAMES = (*MARKED_NAMES, "endpoint")


# The evidence of the attempt that made a job done, on its row (see version 1).
_DONE_COLUMNS = ("done_by", "done_started_ms", "done_latency_ms", "done_http_status",
                 "done_after")


def _plan_evidence(items: list, results: list, last: int, now_ms: int) -> tuple[list, list]:
    """Pure: each attempt's evidence, ``last`` being the largest attempts seq
    yet. The attempt that made a job done goes on the job's row (per item its
    done_* values, None for every other item: its end is available_at); every
    other attempt (a retry, a refusal, a stale finish, evidence only) is an
    attempts row, numbered on from ``last``."""
    rows: list[tuple] = []
    done: list[tuple | None] = []
    for (ticket, outcome, _, seen), result in zip(items, results, strict=True):
        if result is not False and result[0] == "done":
            done.append((ticket["owner"], seen.started_ms, seen.latency_ms, seen.http_status,
                         last + len(rows)))
            continue
        done.append(None)
        status, reason = ("stale", None) if result is False else result
        error = None if seen.error is None else seen.error[:MAX_ERROR_CHARS]
        rows.append((last + len(rows) + 1, ticket["id"], ticket["token"], ticket["attempt"],
                     ticket["owner"], seen.started_ms, now_ms, outcome or "none", status, reason,
                     seen.http_status, error, seen.latency_ms))
    return done, rows


def _record_attempts(con: sqlite3.Connection, rows: list, results: list) -> None:
    """Inside the finish transaction: the attempts rows, and the stale finishes counted."""
    if rows:
        con.executemany(
            RECORD_ATTEMPTS, rows)
    stale = sum(1 for result in results if result is False)
    if stale:
        _tally(con, "stale_finishes", stale)


def _attempts_high(con: sqlite3.Connection) -> int:
    """The largest attempts seq ever written: a prune may have deleted the
    newest row, and a seq taken again would sort a later attempt before the
    delivery it followed (done_after)."""
    return int(con.execute(
        ATTEMPTS_HIGH).fetchone()[0])


def _tally(con: sqlite3.Connection, name: str, n: int) -> None:
    con.execute(TALLY, (name, n))


# ------------------------------------------------------------------ the operator


def redrive_jobs(
    con: sqlite3.Connection,
    job_ids: list,
    now_ms: int,
    ttl_ms: int,
    note: str,
    fault: Fault = None,
    actor: str | None = None,
) -> list:
    """The contract's redrive (audit row and release together, token kept) with
    the product's ids, time to live and notes, and who did it (``actor``, in
    the audit row). Per id True or its ValueError."""
    check_connection(con)
    check_ids(job_ids)
    check_now(now_ms)
    check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
    check_note(note)
    check_actor(actor)
    check_fault(fault)
    with immediate(con):
        rows = _rows_by_id(con, job_ids)
        results, audits, releases = redrive_decisions(rows, job_ids)
        keys = sorted({row["ordering_key"] for row in rows.values()
                       if row["ordering_key"] is not None})
        firsts = {row["ordering_key"]: row for key in keys
                  for row in select_rows(con, FIRSTS, (key,))}
        results = in_flight_refusals(rows, firsts, results, job_ids)
        audits = kept_audits(audits, results, job_ids)
        releases = [rows[job_id]["seq"] for job_id, _ in audits]
        if audits:
            con.executemany(
                AUDIT_REDRIVES,
                [(job_id, token, now_ms, note, actor) for job_id, token in audits])
            call_fault(fault, "after-audit")
            # A cancelled job left its line: it comes back held, and the
            # demotion below gives it its place again.
            con.executemany(
                RELEASE,
                [(now_ms, now_ms + ttl_ms, seq) for seq in releases])
            endpoints.has_work(con, {rows[job_id]["endpoint"] for job_id, _ in audits
                                     if rows[job_id]["endpoint"] is not None})
            for key in keys:
                con.execute(DEMOTE, {"key": key})
            _promote(con, keys)
            call_fault(fault, "after-redrive")
    if audits:
        call_fault(fault, "after-commit")
    return results


def cancel_jobs(
    con: sqlite3.Connection,
    job_ids: list,
    now_ms: int,
    note: str,
    fault: Fault = None,
    actor: str | None = None,
) -> list:
    """Cancel pending or dead jobs: each becomes dead/cancelled with an audit
    row in ``cancels`` (what it was, its token, the note), together.

    A leased job is refused (its send may be on the wire: let it finish or
    its lease run out, then cancel), and so is a done one. Per id True or
    the ValueError; a refusal does not stop the others. A cancelled job
    leaves the dead letters only by a redrive, like any dead job.
    Hooks: fault("after-audit"), fault("after-cancel"), fault("after-commit").
    """
    check_connection(con)
    check_ids(job_ids)
    check_now(now_ms)
    check_note(note)
    check_actor(actor)
    check_fault(fault)
    with immediate(con):
        results, audits = _cancel(con, job_ids, now_ms, note, actor, fault)
    if audits:
        call_fault(fault, "after-commit")
    return results


def _cancel(con: sqlite3.Connection, job_ids: list, now_ms: int, note: str,
            actor: str | None, fault: Fault = None) -> tuple[list, list]:
    """Inside a write transaction: the cancels, each with its audit row."""
    rows = _rows_by_id(con, job_ids)
    results, audits = cancel_decisions(rows, job_ids)
    if audits:
        con.executemany(
            AUDIT_CANCELS,
            [(job_id, token, now_ms, note, was, actor) for _, job_id, token, was in audits])
        call_fault(fault, "after-audit")
        con.executemany(
            CANCEL,
            [(now_ms, seq) for seq, _, _, _ in audits])
        # a line whose first was cancelled: the next one goes
        _promote(con, {rows[job_id]["ordering_key"] for _, job_id, _, _ in audits
                       if rows[job_id]["ordering_key"] is not None})
        call_fault(fault, "after-cancel")
    return results, audits


# ------------------------------------------------------------------ endpoints


def recover_endpoint(con: sqlite3.Connection, name: str, since_ms: int, now_ms: int,
                     ttl_ms: int, note: str, *, ids: list | None = None,
                     dry_run: bool = False, actor: str | None = None,
                     limit: int = MAX_RECOVER) -> list[str]:
    """Send again an endpoint's deliveries finished (done or dead) since
    ``since_ms`` (lease.store.Store.recover_endpoint); their ids, in seq order."""
    check_connection(con)
    check_endpoint_name(name)
    check_now(since_ms, "since_ms")
    check_now(now_ms)
    check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
    check_int("limit", limit, 1, MAX_RECOVER)
    check_note(note)
    check_actor(actor)
    only = None if ids is None else set(check_recover_ids(ids))
    with immediate(con):
        endpoints.endpoint_row(con, name)  # EndpointError when unknown
        rows = [row for row in select_rows(con, RECOVERABLE, {"name": name, "since": since_ms,
                                                             "limit": limit})
                if only is None or row["id"] in only]
        if dry_run or not rows:
            return [row["id"] for row in rows]
        done = [row for row in rows if row["status"] == "done" and row["done_by"] is not None]
        high = _attempts_high(con)
        con.executemany(RECORD_ATTEMPTS, [
            (high + n, row["id"], row["token"], row["attempts"], row["done_by"],
             row["done_started_ms"], row["available_at"], "ok", "done", None,
             row["done_http_status"], None, row["done_latency_ms"])
            for n, row in enumerate(done, 1)])
        con.executemany(AUDIT_REDRIVES, [(row["id"], row["token"], now_ms, note, actor)
                                         for row in rows])
        con.executemany(RECOVER, [(now_ms, now_ms + ttl_ms, row["seq"]) for row in rows])
        endpoints.has_work(con, (name,))
        keys = sorted({row["ordering_key"] for row in rows if row["ordering_key"] is not None})
        for key in keys:
            con.execute(DEMOTE, {"key": key})
        _promote(con, keys)
    return [row["id"] for row in rows]


def add_endpoint(con: sqlite3.Connection, endpoint: Endpoint, now_ms: int,
                 note: str | None = None, actor: str | None = None) -> None:
    check_connection(con)
    check_now(now_ms)
    with immediate(con):
        migrate_here(con)
        endpoints.add_endpoint(con, endpoint, now_ms, note, actor)


def update_endpoint(con: sqlite3.Connection, name: str, changes: dict, now_ms: int,
                    note: str | None = None, actor: str | None = None) -> Endpoint:
    check_connection(con)
    check_now(now_ms)
    with immediate(con):
        return endpoints.update_endpoint(con, name, changes, now_ms, note, actor)


def remove_endpoint(con: sqlite3.Connection, name: str, now_ms: int, *,
                    cancel_live: bool = False, note: str | None = None,
                    actor: str | None = None) -> int:
    """Remove an endpoint (lease.store.Store.remove_endpoint); how many of its
    deliveries were cancelled, in the same transaction."""
    check_connection(con)
    check_now(now_ms)
    if type(cancel_live) is not bool:
        raise ValueError(f"cancel_live must be a bool, got {cancel_live!r:.40}")
    if note is not None:
        check_note(note)
    check_actor(actor)
    with immediate(con):
        endpoints.endpoint_row(con, name)  # EndpointError when unknown
        ids = endpoints.refuse_removal(name, endpoints.live_deliveries(con, name), cancel_live)
        for start in range(0, len(ids), MAX_BATCH):
            _cancel(con, ids[start:start + MAX_BATCH], now_ms,
                    note or f"endpoint {name} removed", actor)
        endpoints.remove_endpoint(con, name, now_ms, note, actor)
    return len(ids)


def prune_done(
    con: sqlite3.Connection,
    finished_before_ms: int,
    limit: int = MAX_BATCH,
) -> int:
    """Delete up to ``limit`` done jobs that finished before the cutoff, with
    their attempts and audit rows, in one transaction; how many. Live,
    dead and cancelled jobs are never touched. Call again until it returns
    0 for a large backlog: each transaction stays short. An id whose job was
    pruned is new again: enqueued again, it is a new job.
    """
    check_connection(con)
    check_now(finished_before_ms, "finished_before_ms")
    check_int("limit", limit, 1, MAX_BATCH)
    with immediate(con):
        done = con.execute(
            PRUNABLE, (finished_before_ms, limit)).fetchall()
        ids = [(job_id,) for _, job_id in done]
        if done:  # the high-water mark outlives the rows: seqs are never taken again
            con.execute(KEEP_ATTEMPTS_HIGH,
                        (_attempts_high(con),))
        con.executemany(PRUNE_ATTEMPTS, ids)
        con.executemany(PRUNE_REDRIVES, ids)
        con.executemany(PRUNE_CANCELS, ids)
        seqs = [(seq,) for seq, _ in done]
        con.executemany(PRUNE_BODIES, seqs)
        con.executemany(PRUNE_JOBS, seqs)
        prune_workers(con, finished_before_ms)
        prune_minutes(con, finished_before_ms)
    return len(done)


