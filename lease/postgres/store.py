"""``PostgresStore``: the ``lease.store.Store`` of one PostgreSQL database, and
``enqueue_in``, the transactional outbox on a service's own connection."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg_pool
from psycopg import pq
from psycopg.rows import dict_row, tuple_row

from lease.breaker import check_release
from lease.endpoints import (
    ALL,
    MAX_RECOVER,
    Endpoint,
    EndpointError,
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
    check_ordering_key,
    check_product_event,
)
from lease.postgres import console
from lease.postgres.endpoints import (
    Claim,
    Fanout,
    add,
    audit,
    claim_deliveries,
    fan_out,
    has_work,
    judge,
    judge_circuits,
    lock_circuits,
    lock_endpoints_of,
    locked,
    read_audit,
    read_configs,
    read_deliveries,
    read_endpoints,
    read_stats,
    send_rotation,
    update,
)
from lease.postgres.listener import Listener
from lease.postgres.queues import Queue, queue_names
from lease.postgres.reads import (
    by_key,
    dicts,
    job_filter,
    job_rows,
    read_counts,
    read_depth,
    read_snapshot,
    read_stale_finishes,
)
from lease.postgres.release import release_jobs
from lease.postgres.schema import (
    CONNECT_TIMEOUT_S,
    INTAKE_CHUNK,
    NOW,
    PREPARE_THRESHOLD,
    SCHEMA_VERSION,
    TABLES,
    check_tables,
    check_version,
    connect,
    mapped,
    migrate,
    no_queue,
    queue_version,
    redact,
)
from lease.postgres.statements import (
    AUDIT_CANCELS,
    AUDIT_REDRIVES,
    BLOCKED_HEADS,
    BY_KEY_FROM,
    BY_KEY_ONLY,
    CANCEL,
    CONTENTS,
    DEAD,
    DEMOTE,
    EXTEND_IF_STILL_LEASED,
    FINISH_IF_STILL_LEASED,
    FIRSTS,
    HISTORY_ATTEMPTS,
    IDLE,
    IDLE_OWN,
    IDLE_SERVED,
    INSERT_NEW,
    KEY_OR_LINES,
    LIST_JOBS,
    LOCK_KEYS,
    LOCK_KEYS_OF,
    MARKED,
    PICK_AND_LEASE,
    PROMOTE,
    PRUNABLE,
    QUARANTINE,
    RECORD_ATTEMPTS,
    RECORD_DONE,
    RECOVER,
    RECOVERABLE,
    RELEASE,
    SEQSCAN_AGAIN,
    TALLY,
    array_text,
    unnest_columns,
)
from lease.queues import split_url
from lease.records import MAX_ERROR_CHARS, Claimed, Leased, check_on_conflict, judge_intake
from lease.rules import (
    STATUSES,
    WORKER_BEAT_MS,
    cancel_decisions,
    check_finish_item,
    check_ids,
    check_minutes_query,
    check_worker,
    claim_rank,
    in_flight_refusals,
    kept_audits,
    minute_rollup,
)
from lease.tracing import capture
from lease.worker import (
    MAX_BATCH,
    Fault,
    NotAQueue,
    StoreError,
    call_fault,
    check_fault,
    check_identifier,
    check_int,
    check_job_id,
    check_now,
    check_ticket,
    extended_until,
    judge_finish,
    marker_matches,
    redrive_decisions,
)


def _text(error: str | None) -> str | None:
    """An attempt's error as PostgreSQL's text can hold it: capped as kept,
    a NUL (which text cannot hold) and a lone surrogate replaced."""
    if error is None:
        return None
    capped = error[:MAX_ERROR_CHARS].replace("\x00", "\ufffd")
    return capped.encode("utf-8", "replace").decode("utf-8")


# ------------------------------------------------------------------ the store


class PostgresStore:
    """The ``lease.store.Store`` of one PostgreSQL database, on a pool of
    ``threads`` connections: ``threads`` threads may call it at once.

    ``queue`` (or the URL's ``queue`` parameter) names a queue of the
    database other than the default one (``lease.queues``)."""

    kind = "postgresql"

    def __init__(self, url: str, *, create: bool = False, read_only: bool = False,
                 clock: Callable[[], int] | None = None, threads: int = 1,
                 queue: str | None = None) -> None:
        if not isinstance(url, str):
            raise ValueError(f"url must be a str, got {type(url).__name__}")
        check_int("threads", threads, 1, 1000)
        if clock is not None and not callable(clock):
            raise ValueError("clock must be None or callable")
        url, named = split_url(url, queue)
        self.queue = Queue(named)
        self.name = redact(url) + self.queue.suffix
        self.threads = threads
        self.read_only = read_only
        self._url = url
        self._clock = clock
        self._open_queue(create)
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=threads, open=False, name=f"lease {self.name}",
            kwargs={"autocommit": True, "prepare_threshold": PREPARE_THRESHOLD,
                    "connect_timeout": CONNECT_TIMEOUT_S, **self.queue.connect_kwargs},
            configure=self._configure)
        try:
            self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except psycopg_pool.PoolTimeout:
            self._pool.close()
            raise StoreError(f"cannot connect to {self.name}: no connection within "
                             f"{CONNECT_TIMEOUT_S} s") from None

    def _open_queue(self, create: bool) -> None:
        """Check (and unless read only, create or migrate) the queue on a
        connection of its own, before the pool opens."""
        conn = connect(self._url, self.name, **self.queue.connect_kwargs)
        try:
            with mapped(self.name):
                version = queue_version(conn)
                check_version(version, self.name)
                if version is None and (self.read_only or not create):
                    raise no_queue(self.name)
                if version != SCHEMA_VERSION and not self.read_only:
                    migrate(conn, self.name, self.queue.migration_lock)
                    version = SCHEMA_VERSION
                assert version is not None  # refused or migrated above
                # A reader looks at an older queue as it is (without the columns
                # it has not got yet): a writer migrates it.
                check_tables(conn, self.name, version)
                self._actors = "actor" in TABLES[version]["redrives"]
                self._keys = "ordering_key" in TABLES[version]["jobs"]
                self._endpoints = "endpoints" in TABLES[version]
        finally:
            conn.close()

    def _configure(self, conn: psycopg.Connection) -> None:
        # A read-only store's every transaction is READ ONLY (BEGIN READ ONLY).
        conn.read_only = self.read_only

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listener(self) -> Listener:
        """Wake-ups when work becomes available, on a connection of its own."""
        return Listener(self._url, self.name, self.queue.channel)

    # -- the one transaction helper

    @contextmanager
    def _tx(self, *, read_only: bool = False,
            snapshot: bool = False) -> Iterator[psycopg.Connection]:
        """One transaction on a pooled connection: COMMIT at the end, ROLLBACK on
        any exception (BaseException: a cancelled caller leaves nothing open).

        psycopg's errors in the store's words: a serialization failure, a
        deadlock, a lock not available and a lost connection are Busy (the same
        call may succeed after a short pause); a missing table is NotAQueue;
        anything else a StoreError with the server's message. Whatever a fault
        hook raises passes through as it is, after the rollback.

        A connection lost during COMMIT leaves the outcome unknown: it is raised
        as Busy all the same, because every operation is safe to retry under
        the fence: a retried claim leases other rows (the first lease expires
        and its job is claimed again); a retried finish or extension finds the
        marker changed and reports the ticket stale; a retried enqueue sees its
        events as duplicates; a retried redrive or cancel sees the job no
        longer dead or already cancelled.
        """
        with mapped(self.name), self._pool.connection() as conn, conn.transaction():
            if snapshot:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            elif read_only and not self.read_only:
                conn.execute("SET TRANSACTION READ ONLY")
            yield conn

    def _now_in(self, conn: psycopg.Connection, now_ms: int | None,
                read: psycopg.Cursor[Any] | None = None) -> int:
        """The time the transaction judges by: the caller's, the injected clock's,
        or the server's, read as the transaction's first statement (``read``:
        that statement sent already)."""
        if now_ms is not None:
            return now_ms
        if self._clock is not None:
            return check_now(self._clock(), "clock value")
        row = (read or conn.execute(NOW)).fetchone()
        assert row is not None  # a SELECT of one value returns one row
        return int(row[0])

    def _now_and_pause(self, conn: psycopg.Connection, now_ms: int | None) -> tuple[int, bool]:
        """A claim's first statement: the time it judges by (as ``_now_in``)
        and whether the queue is paused, in one round trip."""
        if now_ms is None and self._clock is None:
            row = conn.execute(console.NOW_AND_PAUSED).fetchone()
            assert row is not None  # a SELECT of values returns one row
            return int(row[0]), bool(row[1])
        now = self._now_in(conn, now_ms)
        row = conn.execute(console.IS_PAUSED).fetchone()
        return now, bool(row and row[0])

    def now_ms(self) -> int:
        with self._tx(read_only=True) as conn:
            return self._now_in(conn, None)

    def schema_version(self) -> int:
        with self._tx(read_only=True) as conn:
            version = queue_version(conn)
        if version is None:
            raise no_queue(self.name)
        return version

    # -- intake

    def enqueue_events(self, events: Iterable[object], policy: RetryPolicy = DEFAULT_POLICY, *,
                       now_ms: int | None = None, not_before_ms: int | None = None,
                       on_progress: Callable[[int], None] | None = None,
                       on_conflict: str = "return") -> list:
        """All or none in one transaction, as ``lease.sqlite.enqueue_events``
        (``on_conflict`` too); ``events`` is read and inserted in chunks, never
        held whole."""
        if now_ms is not None:
            check_now(now_ms)
        if not isinstance(policy, RetryPolicy):
            raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        check_on_conflict(on_conflict)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            available_at = now if not_before_ms is None else check_not_before(not_before_ms, now)
            return judge_intake(_intake(conn, events, available_at, policy, on_progress,
                                        capture(), channel=self.queue.channel), on_conflict)

    # -- one attempt

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: int | None = None, fault: Fault = None,
                   endpoints: str | tuple[str, ...] | None = None) -> Claimed:
        """The queue's own jobs (``endpoints`` None), or deliveries to the
        served endpoints, fairly, within their caps and buckets
        (``lease.postgres.endpoints.claim_deliveries``)."""
        check_identifier("owner", owner)
        served = check_served(endpoints)
        if now_ms is not None:
            check_now(now_ms)
        check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
        check_int("limit", limit, 1, MAX_BATCH)
        check_fault(fault)
        with self._tx() as conn:
            now, paused = self._now_and_pause(conn, now_ms)
            moved = {"deadline": 0, "exhausted": 0}
            if paused:  # leases nothing, changes no job (lease.rules, "pause")
                console.worker_claimed(conn, owner, now, 0)
                return Claimed([], moved, now)
            args = {"now": now, "limit": limit, "owner": owner, "lease_ms": lease_ms,
                    "beat": WORKER_BEAT_MS}
            # The quarantine first, as on SQLite; then the pick, or for a
            # claim of deliveries its first look at the rotation (SKIP LOCKED:
            # it never waits for a lock, so it is in no cycle of locks), in
            # the same round trip.
            claim = Claim(owner, lease_ms, limit, now)
            with conn.pipeline() as pipeline:
                moves = [(reason, conn.execute(statement, args))
                         for reason, statement in QUARANTINE]
                self._before_pick(pipeline)
                if served is None:
                    picked = conn.execute(PICK_AND_LEASE, args)
                else:
                    picked, rotation = None, send_rotation(conn, served, claim)
            for reason, cursor in moves:
                moved[reason] += cursor.rowcount
            if picked is not None:
                leased = [Leased({"id": job_id, "qty": qty, "owner": owner, "token": token,
                                  "attempt": attempt, "lease_until": until}, body, digest,
                                 trace=trace)
                          for _, job_id, qty, token, attempt, until, body, digest, trace, _
                          in sorted(picked.fetchall(), key=claim_rank)]
            else:
                leased = claim_deliveries(conn, rotation, claim, self._before_lease)
                if not claim.rounds:  # no statement leased, none recorded the claim
                    console.worker_claimed(conn, owner, now, 0)
            if leased:
                call_fault(fault, "after-claim")
        if leased:
            call_fault(fault, "after-commit")
        return Claimed(leased, moved, now)

    def _before_pick(self, pipeline: psycopg.Pipeline) -> None:
        """Inside a claim, between its quarantine and its pick: nothing (the
        statements go in one pipeline, none waited for). The moment another
        transaction's lock, which made the quarantine skip a row, can end
        before the pick reads; a test's subclass syncs the pipeline here and
        ends one, to prove the pick's own rule."""

    def _before_lease(self) -> None:
        """Inside a claim of deliveries, its first endpoints judged (the
        limited ones locked), before anything is leased: nothing. A test's
        subclass waits here, to prove that another claim of those endpoints
        waits for this one."""

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Fault = None) -> dict | bool:
        check_ticket(ticket, PRODUCT)
        if now_ms is not None:
            check_now(now_ms)
        check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
        check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            row = _lock(conn, MARKED, [ticket["id"]]).get(ticket["id"])
            if row is None or not marker_matches(row, ticket, now):
                return False
            new_until = extended_until(row["lease_until"], row["deadline"], now, lease_ms)
            if conn.execute(EXTEND_IF_STILL_LEASED, {
                    "new_until": new_until, "now": now, "seq": row["seq"], **_marker(ticket)},
                    ).rowcount != 1:
                return False
            call_fault(fault, "after-extend")
        call_fault(fault, "after-commit")
        return {**ticket, "lease_until": new_until}

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Fault = None) -> list:
        """``lease.sqlite.finish_jobs`` on PostgreSQL: the items in order, as
        single finishes in sequence, with each attempt's evidence."""
        if type(items) is not list or len(items) > MAX_BATCH:
            raise ValueError(f"items must be a list of at most {MAX_BATCH}")
        for item in items:
            check_finish_item(item)
        if now_ms is not None:
            check_now(now_ms)
        check_fault(fault)
        with self._tx() as conn:
            # the time and the items' deliveries with their breakers, in one round trip
            with conn.pipeline():
                clock = conn.execute(NOW) if now_ms is None and self._clock is None else None
                found = read_deliveries(conn, items) if self._endpoints else None
            now = self._now_in(conn, now_ms, clock)
            # the breakers' rows first (the order of every lock here), then
            # the keys and the rows of the jobs
            endpoints_of, circuits = lock_circuits(conn, items, now, found)
            judged = iter(_finish_marked(conn, items, now))
            verdicts = [next(judged) if outcome is not None else None
                        for _, outcome, _, _ in items]
            results = [("leased", None) if v is None else v and v[:2] for v in verdicts]
            # the writes that follow, whose results nothing reads (but a
            # done job's moved ``done_after``): sent together, one round trip
            with conn.pipeline():
                _record_attempts(conn, items, results,
                                 [v[2] if v else None for v in verdicts], now)
                if circuits:
                    judge_circuits(conn, items, results, endpoints_of, circuits, now)
                console.add_minutes(conn, minute_rollup(items, results, endpoints_of, now))
            changed = any(verdicts)
            if changed:
                call_fault(fault, "after-finish")
        if changed:
            call_fault(fault, "after-commit")
        return results

    def release_jobs(self, tickets: list, *, reason: str,
                     now_ms: int | None = None) -> list:
        """``lease.sqlite.release.release_jobs`` on PostgreSQL (lease.postgres.release)."""
        check_release(tickets, reason)
        if now_ms is not None:
            check_now(now_ms)
        if not tickets:
            return []
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            return release_jobs(conn, tickets, now, reason, endpoints=self._endpoints)

    # -- the operator

    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: int | None = None, fault: Fault = None,
                     actor: str | None = None) -> list:
        """``lease.sqlite.redrive_jobs``: per id True or its ValueError; each
        redriven job's audit row (the note, who did it) and release together."""
        check_ids(job_ids)
        if now_ms is not None:
            check_now(now_ms)
        check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
        check_note(note)
        check_actor(actor)
        check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            if self._endpoints:  # their endpoints' rows first (lease.postgres.endpoints)
                lock_endpoints_of(conn, sorted(set(job_ids)))
            rows = _lock_keys_and_rows(conn, "seq, id, status, reason, token, ordering_key"
                                       + (", endpoint" if self._endpoints else ""), job_ids)
            results, audits, releases = redrive_decisions(rows, job_ids)
            keys = sorted({row["ordering_key"] for row in rows.values()
                           if row["ordering_key"] is not None})
            firsts = {row["ordering_key"]: row for row in dicts(conn, FIRSTS, (keys,))} \
                if keys else {}
            results = in_flight_refusals(rows, firsts, results, job_ids)
            audits = kept_audits(audits, results, job_ids)
            releases = [rows[job_id]["seq"] for job_id, _ in audits]
            if audits:
                conn.execute(AUDIT_REDRIVES, (now, note, actor, *unnest_columns(audits)))
                call_fault(fault, "after-audit")
                conn.execute(RELEASE, (now, now + ttl_ms, releases))
                if self._endpoints:  # redriven deliveries: their endpoints in the rotation
                    has_work(conn, {str(rows[job_id]["endpoint"]) for job_id, _ in audits
                                    if rows[job_id].get("endpoint") is not None})
                if keys:  # a cancelled job back in its place; each line's first
                    conn.execute(DEMOTE, {"keys": keys})
                    conn.execute(PROMOTE, {"keys": keys})
                call_fault(fault, "after-redrive")
                conn.execute("SELECT pg_notify(%s, '')", (self.queue.channel,))
        if audits:
            call_fault(fault, "after-commit")
        return results

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: int | None = None,
                    fault: Fault = None, actor: str | None = None) -> list:
        """``lease.sqlite.cancel_jobs``: per id True or its ValueError; each
        cancelled job's audit row (the note, who did it) and its move to
        dead/cancelled together."""
        check_ids(job_ids)
        if now_ms is not None:
            check_now(now_ms)
        check_note(note)
        check_actor(actor)
        check_fault(fault)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            rows = _lock_keys_and_rows(conn, "seq, id, status, reason, token, ordering_key",
                                       job_ids)
            results, audits = cancel_decisions(rows, job_ids)
            self._cancel_audited(conn, rows, audits, now, note, actor, fault)
        if audits:
            call_fault(fault, "after-commit")
        return results

    def _cancel_locked(self, conn: psycopg.Connection, rows: dict[str, dict[str, Any]],
                       job_ids: list, now: int, note: str, actor: str | None) -> int:
        """Inside a transaction holding these rows and their keys: the cancel
        path, audited; how many were cancelled."""
        _, audits = cancel_decisions(rows, job_ids)
        self._cancel_audited(conn, rows, audits, now, note, actor, None)
        return len(audits)

    def _cancel_audited(self, conn: psycopg.Connection, rows: dict[str, dict[str, Any]],
                        audits: list, now: int, note: str, actor: str | None,
                        fault: Fault) -> None:
        if not audits:
            return
        conn.execute(AUDIT_CANCELS, (now, note, actor, *unnest_columns(
            [(job_id, token, was) for _, job_id, token, was in audits])))
        call_fault(fault, "after-audit")
        conn.execute(CANCEL, (now, [seq for seq, _, _, _ in audits]))
        # a line whose first was cancelled: the next one goes
        lines = sorted({rows[job_id]["ordering_key"] for _, job_id, _, _ in audits
                        if rows[job_id]["ordering_key"] is not None})
        if lines:
            conn.execute(PROMOTE, {"keys": lines})
        call_fault(fault, "after-cancel")

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int:
        """``lease.sqlite.prune_done``: up to ``limit`` done jobs finished before
        the cutoff, with their attempts and audit rows, in one transaction."""
        check_now(finished_before_ms, "finished_before_ms")
        check_int("limit", limit, 1, MAX_BATCH)
        with self._tx() as conn:
            done = conn.execute(PRUNABLE, (finished_before_ms, limit)).fetchall()
            ids = [job_id for _, job_id in done]
            if done:
                for table in ("attempts", "redrives", "cancels"):
                    conn.execute(f"DELETE FROM lease.{table} WHERE id = ANY(%s::text[])",
                                 (ids,))
                conn.execute("DELETE FROM lease.jobs WHERE seq = ANY(%s::bigint[])",
                             ([seq for seq, _ in done],))
            console.prune_workers(conn, finished_before_ms)
            console.prune_minutes(conn, finished_before_ms)
        return len(done)

    # -- the queue's pause (lease.postgres.console)

    def pause(self, note: str, *, actor: str | None = None,
              now_ms: int | None = None) -> bool:
        return self._set_paused("pause", note, actor, now_ms)

    def resume(self, note: str, *, actor: str | None = None,
               now_ms: int | None = None) -> bool:
        return self._set_paused("resume", note, actor, now_ms)

    def _set_paused(self, action: str, note: str, actor: str | None,
                    now_ms: int | None) -> bool:
        if now_ms is not None:
            check_now(now_ms)
        with self._tx() as conn:
            return console.set_paused(conn, action, self._now_in(conn, now_ms), note, actor)

    def paused(self) -> dict[str, Any] | None:
        with self._tx(read_only=True) as conn:
            return console.paused(conn)

    def register_worker(self, owner: str, host: str, pid: int, *,
                        now_ms: int | None = None) -> None:
        check_worker(owner, host, pid)
        if now_ms is not None:
            check_now(now_ms)
        with self._tx() as conn:
            console.register_worker(conn, owner, host, pid, self._now_in(conn, now_ms))

    def minutes(self, since_ms: int, endpoint: str | None = None) -> list[dict[str, Any]]:
        check_minutes_query(since_ms, endpoint)
        with self._tx(read_only=True) as conn:
            return console.minutes(conn, since_ms, endpoint)

    def workers(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        if now_ms is not None:
            check_now(now_ms)
        with self._tx(read_only=True) as conn:
            return console.workers(conn, self._now_in(conn, now_ms))

    def queue_audit(self) -> list[dict[str, Any]]:
        with self._tx(read_only=True) as conn:
            return console.queue_audit(conn)

    # -- observations (read only)

    def counts(self) -> dict[str, int]:
        with self._tx(read_only=True) as conn:
            return read_counts(conn)

    def is_drained(self) -> bool:
        with self._tx(read_only=True) as conn:
            row = conn.execute("SELECT EXISTS (SELECT 1 FROM lease.jobs"
                               " WHERE status IN ('pending', 'leased'))").fetchone()
        return not (row and row[0])

    def is_idle(self) -> bool:
        """reads.is_idle of SQLite: nothing claimable now or later without an operator."""
        if not self._keys:
            return self.is_drained()
        with self._tx(read_only=True) as conn:
            row = conn.execute(IDLE).fetchone()
        return bool(row and row[0])

    def is_idle_for(self, endpoints: str | tuple[str, ...] | None) -> bool:
        """``is_idle`` of what a claim with these ``endpoints`` may take."""
        served = check_served(endpoints)
        if not self._endpoints:
            return self.is_idle() if served is None else True
        with self._tx(read_only=True) as conn:
            if served is None:
                row = conn.execute(IDLE_OWN).fetchone()
            else:
                row = conn.execute(IDLE_SERVED, {
                    "all": served == ALL, "names": [] if served == ALL else list(served)},
                    ).fetchone()
        return bool(row and row[0])

    def queue_depth(self, now_ms: int | None = None) -> dict[str, Any]:
        if now_ms is not None:
            check_now(now_ms)
        with self._tx(snapshot=True) as conn:
            now = self._now_in(conn, now_ms)
            return read_depth(conn, now, keys=self._keys, endpoints=self._endpoints)

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]:
        """reads.blocked_heads of SQLite: each blocked key's dead first job."""
        check_int("limit", limit, 1, MAX_BATCH)
        if not self._keys:
            return []
        sql = BLOCKED_HEADS.format(endpoint=", h.endpoint" if self._endpoints else "")
        with self._tx(read_only=True) as conn:
            rows = job_rows(dicts(conn, sql, {"limit": limit}))
        for row in rows:
            row.setdefault("endpoint", None)
        return rows

    def snapshot(self, now_ms: int | None = None) -> dict[str, Any]:
        """What reads.snapshot of SQLite gives for a product queue, read in one
        REPEATABLE READ transaction so the figures agree."""
        if now_ms is not None:
            check_now(now_ms)
        with self._tx(snapshot=True) as conn:
            now = self._now_in(conn, now_ms)
            return read_snapshot(conn, now, keys=self._keys)

    def job_history(self, job_id: str) -> dict[str, Any] | None:
        """A job's whole row, its redrives, every attempt in the order written,
        its cancels (reads.job_history of SQLite); None if there is no such job."""
        check_job_id("job_id", job_id, PRODUCT)
        actor = ", actor" if self._actors else ""
        with self._tx(snapshot=True) as conn:
            found = dicts(conn, "SELECT * FROM lease.jobs WHERE id = %s", (job_id,))
            history = {
                "redrives": dicts(conn, f"SELECT seq, token, at_ms, note{actor}"
                                   " FROM lease.redrives WHERE id = %s ORDER BY seq", (job_id,)),
                "attempts": dicts(conn, HISTORY_ATTEMPTS, {"id": job_id}),
                "cancels": dicts(conn, f"SELECT seq, token, at_ms, note, was{actor}"
                                  " FROM lease.cancels WHERE id = %s ORDER BY seq", (job_id,)),
            }
        if not found:
            return None
        return {"job": job_rows(found)[0], **history}

    def dead_jobs(self, reason: str | None = None, limit: int | None = None, *,
                  key: str | None = None,
                  endpoint: str | None = None) -> list[dict[str, Any]]:
        """Dead jobs in seq order, of one reason and one ordering key if given,
        each with its last recorded error (reads.dead_jobs of SQLite)."""
        if reason is not None:
            check_identifier("reason", reason)
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        if key is not None:
            check_ordering_key(key, "key")
        if endpoint is not None:
            check_identifier("endpoint", endpoint)
            if not self._endpoints:
                return []
        with self._tx(read_only=True) as conn:
            return job_rows(dicts(conn, DEAD.format(
                key=KEY_OR_LINES if self._endpoints else "ordering_key = %(key)s::text",
                endpoint="endpoint = %(endpoint)s::text" if self._endpoints else "false"),
                {"reason": reason, "key": key, "limit": limit, "endpoint": endpoint}))

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r:.40}")
        with self._tx(read_only=True) as conn:
            return job_rows(dicts(
                conn, "SELECT * FROM lease.jobs WHERE status = %s ORDER BY seq", (status,)))

    def list_jobs(self, *, status: str | None = None, reason: str | None = None,
                  id_prefix: str | None = None, after_seq: int | None = None,
                  limit: int = 50, key: str | None = None,
                  endpoint: str | None = None, error: str | None = None,
                  http_status: int | str | None = None, from_ms: int | None = None,
                  to_ms: int | None = None) -> list[dict[str, Any]]:
        """reads.list_jobs of SQLite: one page of whole rows in seq order after
        ``after_seq``, filtered, a dead row with its last error."""
        where, args = job_filter(status, reason, id_prefix, after_seq, limit, key, endpoint,
                                 endpoints=self._endpoints, error=error,
                                 http_status=http_status, from_ms=from_ms, to_ms=to_ms)
        if endpoint is not None and not self._endpoints:
            return []  # a queue from before endpoints: no job has one
        # the filter's own checks and clauses, in this driver's placeholders
        sql = LIST_JOBS.format(where=where)
        with self._tx(read_only=True) as conn:
            return job_rows(dicts(conn, sql, [*args, limit]))

    def stale_finishes(self) -> int:
        with self._tx(read_only=True) as conn:
            return read_stale_finishes(conn)

    # -- endpoints (lease.postgres.endpoints): each change one transaction with its audit row

    def add_endpoint(self, endpoint: Endpoint, *, note: str | None = None,
                     actor: str | None = None, now_ms: int | None = None) -> None:
        if not isinstance(endpoint, Endpoint):
            raise ValueError(f"endpoint must be an Endpoint, got {type(endpoint).__name__}")
        self._check_change(note, actor, now_ms)
        with self._tx() as conn:
            add(conn, endpoint, self._now_in(conn, now_ms), note, actor)

    def update_endpoint(self, name: str, changes: dict[str, Any], *, note: str | None = None,
                        actor: str | None = None, now_ms: int | None = None) -> Endpoint:
        check_endpoint_name(name)
        if type(changes) is not dict or not changes:
            raise ValueError("changes must be a non-empty dict of an endpoint's fields")
        self._check_change(note, actor, now_ms)
        with self._tx() as conn:
            changed = update(conn, name, changes, self._now_in(conn, now_ms), note, actor)
            if changes.get("enabled") is True:  # its waiting deliveries may go now
                conn.execute("SELECT pg_notify(%s, '')", (self.queue.channel,))
            return changed

    def remove_endpoint(self, name: str, *, cancel_live: bool = False,
                        note: str | None = None, actor: str | None = None,
                        now_ms: int | None = None) -> int:
        """The endpoint's row locked first, then its deliveries' keys and rows
        (the order of every lock here); each pending delivery cancelled as
        ``cancel_jobs`` cancels, with its audit row."""
        check_endpoint_name(name)
        if type(cancel_live) is not bool:
            raise ValueError(f"cancel_live must be a bool, got {cancel_live!r:.40}")
        self._check_change(note, actor, now_ms)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            locked(conn, name)
            live = [job_id for (job_id,) in conn.execute(
                "SELECT id FROM lease.jobs WHERE endpoint = %s AND status IN"
                " ('pending', 'leased') ORDER BY seq", (name,))]
            cancelled = 0
            if live:  # their keys, then their rows (a claim may have leased one since)
                rows = _lock_keys_and_rows(conn, "seq, id, status, reason, token, ordering_key",
                                           live)
                live = [job_id for job_id in live if rows[job_id]["status"] in
                        ("pending", "leased")]
                _refuse_removal(name, [rows[job_id]["status"] for job_id in live],
                                cancel_live)
                cancelled = self._cancel_locked(conn, rows, live, now,
                                                note or f"endpoint {name} removed", actor)
            conn.execute("DELETE FROM lease.endpoints WHERE name = %s", (name,))
            audit(conn, name, now, "remove", [], note, actor)
        return cancelled

    def recover_endpoint(self, name: str, since_ms: int, ttl_ms: int, note: str, *,
                         ids: list | None = None, dry_run: bool = False,
                         actor: str | None = None, now_ms: int | None = None) -> list[str]:
        """Send again an endpoint's deliveries finished (done or dead) since
        ``since_ms`` (lease.store.Store.recover_endpoint); their ids, in seq
        order. The endpoint's row, then the keys of its deliveries, then their
        rows: the order of every lock here."""
        check_endpoint_name(name)
        check_now(since_ms, "since_ms")
        check_int("ttl_ms", ttl_ms, 1, PRODUCT.max_ttl_ms)
        check_note(note)
        check_actor(actor)
        if type(dry_run) is not bool:
            raise ValueError(f"dry_run must be a bool, got {dry_run!r:.40}")
        only = None if ids is None else set(check_recover_ids(ids))
        if now_ms is not None:
            check_now(now_ms)
        with self._tx() as conn:
            now = self._now_in(conn, now_ms)
            locked(conn, name)
            args = {"name": name, "since": since_ms, "limit": MAX_RECOVER}
            found = [job_id for (job_id,) in conn.execute(
                "SELECT id FROM lease.jobs WHERE endpoint = %(name)s AND status IN"
                " ('done', 'dead') AND available_at >= %(since)s ORDER BY seq"
                " LIMIT %(limit)s", args)]
            if found and not dry_run:
                conn.execute(LOCK_KEYS_OF, (sorted(set(found)),))
            rows = [row for row in dicts(conn, RECOVERABLE, args)
                    if only is None or row["id"] in only] if found else []
            if dry_run or not rows:
                return [row["id"] for row in rows]
            _recover(conn, name, rows, now, ttl_ms, note, actor, self.queue.channel)
        return [row["id"] for row in rows]

    def _check_change(self, note: str | None, actor: str | None, now_ms: int | None) -> None:
        if note is not None:
            check_note(note)
        check_actor(actor)
        if now_ms is not None:
            check_now(now_ms)

    def endpoint_configs(self, names: tuple[str, ...] | None = None) -> list[Endpoint]:
        if names is not None:
            names = tuple(check_endpoint_name(name) for name in names)
        if not self._endpoints:
            return []
        with self._tx(read_only=True) as conn:
            return read_configs(conn, names)

    def endpoints(self) -> list[dict[str, Any]]:
        if not self._endpoints:
            return []
        with self._tx(read_only=True) as conn:
            return read_endpoints(conn)

    def endpoint_stats(self) -> list[dict[str, Any]]:
        if not self._endpoints:
            return []
        with self._tx(snapshot=True) as conn:
            return read_stats(conn)

    def endpoint_audit(self, name: str | None = None) -> list[dict[str, Any]]:
        if name is not None:
            check_endpoint_name(name)
        if not self._endpoints:
            return []
        with self._tx(read_only=True) as conn:
            return read_audit(conn, name)


def list_queues(url: str) -> list[str]:
    """The queues in the database of ``url`` (whatever queue it names), the
    default one as ``default``, first; on a connection of its own with no
    queue's rewriting (the listing names every schema)."""
    url, _ = split_url(url)
    name = redact(url)
    conn = connect(url, name)
    try:
        with mapped(name):
            return queue_names(conn)
    finally:
        conn.close()


def _recover(conn: psycopg.Connection, name: str, rows: list[dict[str, Any]], now: int,
             ttl_ms: int, note: str, actor: str | None, channel: str) -> None:
    """Inside a recovery, its rows locked: a done one's delivering attempt
    kept as an attempts row, an audit row each, each pending with a fresh
    budget, each line given its first."""
    done = [row for row in rows if row["status"] == "done" and row["done_by"] is not None]
    if done:
        conn.execute(RECORD_ATTEMPTS, unnest_columns([
            (row["id"], row["token"], row["attempts"], row["done_by"], row["done_started_ms"],
             row["available_at"], "ok", "done", None, row["done_http_status"], None,
             row["done_latency_ms"]) for row in done]))
    conn.execute(AUDIT_REDRIVES, (now, note, actor, *unnest_columns(
        [(row["id"], row["token"]) for row in rows])))
    conn.execute(RECOVER, (now, now + ttl_ms, [row["seq"] for row in rows]))
    has_work(conn, (name,))
    keys = sorted({row["ordering_key"] for row in rows if row["ordering_key"] is not None})
    if keys:
        conn.execute(DEMOTE, {"keys": keys})
        conn.execute(PROMOTE, {"keys": keys})
    conn.execute("SELECT pg_notify(%s, '')", (channel,))


def _refuse_removal(name: str, statuses: list[str], cancel_live: bool) -> None:
    """EndpointError when an endpoint with these live deliveries cannot go
    (the SQLite driver's words)."""
    leased = statuses.count("leased")
    if statuses and not cancel_live:
        raise EndpointError(
            f"endpoint {name!r} has {len(statuses)} deliveries still to send ({leased} "
            f"leased): cancel them with the removal (cancel_live, --cancel-deliveries), or "
            f"remove it once they are delivered")
    if leased:
        raise EndpointError(f"endpoint {name!r} has {leased} deliveries on the wire now "
                            f"(leased): remove it once their leases end")


def enqueue_in(conn: psycopg.Connection, events: Iterable[object],
               policy: RetryPolicy = DEFAULT_POLICY, *, now_ms: int | None = None,
               not_before_ms: int | None = None, on_conflict: str = "raise",
               queue: str | None = None) -> list:
    """The transactional outbox: enqueue on the service's own psycopg
    connection, inside its transaction, so the jobs commit or roll back with
    the service's rows. Per event True (new) or False (a duplicate); an event
    whose id is kept with other content raises Conflicts after this call's
    rows are rolled back, unless ``on_conflict="return"``: as
    ``lease.sqlite.enqueue_in``.

    ``conn`` has a transaction open: inside ``with conn.transaction():``, or a
    connection that is not autocommit after the service's own first statement.
    A connection with none open is refused: the jobs would commit on their
    own, or begin a transaction the service does not know it has. All or
    none: a bad event rolls back this call's rows (a savepoint), never the
    service's. The time is the server's clock (``now_ms`` overrides it); the
    dispatchers' wake-up is NOTIFY'd, delivered at the service's COMMIT.
    The database must hold the queue at this version (``PostgresStore(url,
    create=True)`` makes or migrates it); ``queue`` names a queue other than
    the default one (``lease.queues``), its statements rewritten for its
    schema on this connection's cursor alone.
    """
    if not isinstance(conn, psycopg.Connection):
        raise ValueError(f"conn must be a psycopg.Connection, got {type(conn).__name__}")
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.INERROR:
        raise ValueError("the service's transaction has already failed: roll it back first")
    if status != pq.TransactionStatus.INTRANS:
        raise ValueError("enqueue_in needs the service's open transaction (with "
                         "conn.transaction(): the service's writes, then enqueue_in): "
                         f"conn has none ({status.name})")
    if now_ms is not None:
        check_now(now_ms)
    if not isinstance(policy, RetryPolicy):
        raise ValueError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
    check_on_conflict(on_conflict)
    where = Queue(queue)
    name = redact(conn.info.dsn) + where.suffix
    with mapped(name), conn.transaction():  # a savepoint inside the service's transaction
        cursor = where.cursor(conn, row_factory=tuple_row)  # the service's factory is not ours
        version = queue_version(cursor)  # type: ignore[arg-type]
        if version != SCHEMA_VERSION:
            raise NotAQueue(f"{name} holds no version {SCHEMA_VERSION} queue (version "
                            f"{version}): PostgresStore(url, create=True) makes it")
        if now_ms is None:
            row = cursor.execute(NOW).fetchone()
            assert row is not None  # a SELECT of one value returns one row
            now_ms = int(row[0])
        available_at = now_ms if not_before_ms is None \
            else check_not_before(not_before_ms, now_ms)
        return judge_intake(_intake(cursor, events, available_at, policy, None, capture(),
                                    channel=where.channel), on_conflict)


def _lookups(chunk: list[Intake], fan: Fanout | None) -> int:
    """At most how many ids a chunk's lookup reads: its events, or for a
    fan-out its events times the endpoints."""
    return len(chunk) * (1 if fan is None else max(1, fan.size()))


def _intake(conn: Any, events: Iterable[object], available_at: int, policy: RetryPolicy,
            on_progress: Callable[[int], None] | None, trace: str | None = None, *,
            channel: str) -> list:
    """Inside a transaction (``conn`` a connection or a cursor): the events
    read, checked and inserted in chunks, never held whole; the wake-up.
    Every job keeps ``trace``, the context the intake ran in (lease.tracing)."""
    stream = iter(events)
    results: list = []
    fan = Fanout.of(conn)  # the endpoints, locked; None: none, each event one job
    seqscan: str | None = None  # the setting before this intake turned it off
    while True:
        chunk = [check_product_event(event) for event in itertools.islice(stream, INTAKE_CHUNK)]
        if not chunk:
            break
        if seqscan is None and _lookups(chunk, fan) > BY_KEY_FROM:
            seqscan = conn.execute(BY_KEY_ONLY).fetchone()[0]
        written = _insert(conn, chunk, available_at, policy, trace) if fan is None \
            else fan_out(conn, chunk, available_at, policy, fan, trace)
        for result in written:
            results.append(result)
            if on_progress is not None and len(results) % 1000 == 0:
                on_progress(len(results))
    if fan is not None:
        fan.save(conn)
    if any(result is True for result in results):
        conn.execute("SELECT pg_notify(%s, '')", (channel,))
    if seqscan is not None:
        conn.execute(SEQSCAN_AGAIN, (seqscan,))
    return results


def _insert(conn: Any, chunk: list[Intake], available_at: int, policy: RetryPolicy,
            trace: str | None = None) -> list:
    """Inside the intake: per event True (new), False (a duplicate) or its
    Conflict, in order, as single intakes in sequence would give them. Only
    new ids reach the INSERT: a duplicate never draws a seq. The chunk's keys
    are locked first, so the jobs of a key take their seqs in the order their
    intakes commit; each key's line then gets its first if it has none."""
    keys = sorted({intake.key for intake in chunk if intake.key is not None})
    if keys:
        conn.execute(LOCK_KEYS, (keys,))
    kept = _contents(conn, sorted({intake.id for intake in chunk}))
    new: dict[str, Intake] = {}
    for intake in chunk:
        if intake.id not in kept:
            new.setdefault(intake.id, intake)
    inserted: set[str] = set()
    if new:
        inserted = {job_id for (job_id,) in conn.execute(INSERT_NEW, (
            policy.max_attempts, available_at, available_at + policy.ttl_ms, trace,
            *unnest_columns([(i.id, i.qty, i.body, i.digest, i.key, None, None, i.type,
                        i.priority) for i in new.values()])))}
        # another intake committed one of these ids meanwhile: judge by its row
        kept.update(_contents(conn, [job_id for job_id in new if job_id not in inserted]))
    results: list = []
    for intake in chunk:
        first = new.get(intake.id)
        if first is intake and intake.id in inserted:
            results.append(True)
        else:
            qty, digest, key, kind = kept.get(intake.id) or (
                first.qty, first.digest, first.key, first.type)  # type: ignore[union-attr]
            results.append(judge(intake, qty, digest, key, kind))
    lines = sorted({key for key in (new[job_id].key for job_id in inserted) if key is not None})
    if lines:
        conn.execute(PROMOTE, {"keys": lines})
    return results


def _contents(conn: Any, ids: list[str]) -> dict[str, tuple]:
    if not ids:
        return {}
    return {job_id: (qty, digest, key_of_line(line, endpoint), kind)
            for job_id, qty, digest, line, kind, endpoint in by_key(conn, CONTENTS, ids)}


def _marker(ticket: dict) -> dict[str, Any]:
    """The ticket's marker as the fence's parameters."""
    return {"qty": ticket["qty"], "owner": ticket["owner"], "token": ticket["token"],
            "attempt": ticket["attempt"], "lease_until": ticket["lease_until"]}


# Rows by id, locked in seq order (two writers never deadlock). Each id is
# looked up by its index in a look-up the planner cannot flatten (LIMIT 1), as
# the finish's rows are (FINISH_IF_STILL_LEASED): with ``id = ANY(...)`` the
# planner reads the whole table instead wherever it has fewer than a few
# hundred thousand rows (a finish of 256 in a queue of 20,000: 2.7 ms against
# 0.6). The statement's one snapshot sees the same rows either way.
_LOCK_ROWS = """SELECT {columns} FROM lease.jobs WHERE seq = ANY(ARRAY(
  SELECT f.seq FROM unnest(%s::text[]) AS u(id)
  CROSS JOIN LATERAL (SELECT seq FROM lease.jobs j WHERE j.id = u.id LIMIT 1) f))
ORDER BY seq FOR UPDATE"""


def _lock(conn: psycopg.Connection, columns: str, job_ids: list) -> dict[str, dict[str, Any]]:
    """The rows of these ids by id, locked in seq order (two writers never
    deadlock)."""
    unique = sorted(set(job_ids))
    if not unique:
        return {}
    locked = dicts(conn, _LOCK_ROWS.format(columns=columns), (unique,))
    return {row["id"]: row for row in locked}


def _lock_keys_and_rows(conn: psycopg.Connection, columns: str,
                        job_ids: list) -> dict[str, dict[str, Any]]:
    """The keys of these jobs' lines (advisory locks), then their rows as
    ``_lock``: two statements in one round trip, run in that order."""
    unique = sorted(set(job_ids))
    if not unique:
        return {}
    ids = array_text(unique)
    with conn.pipeline():
        conn.execute(LOCK_KEYS_OF, (ids,))
        locked = conn.cursor(row_factory=dict_row).execute(
            _LOCK_ROWS.format(columns=columns), (ids,))
    return {row["id"]: row for row in locked.fetchall()}


def _finish_marked(conn: psycopg.Connection, items: list, now: int) -> list:
    """Inside the finish: each finishing item judged by the rules on its locked
    row, in order (a job finished earlier in the list is no longer leased for a
    later item), then written only if still leased by its ticket. Per finishing
    item (status, reason, seq) or False.

    Every item's row is locked, an evidence-only item's too: a job's attempts
    are then written one transaction after another, in the order of their seqs.
    """
    rows = _lock_keys_and_rows(conn, f"{MARKED}, ordering_key",
                               [ticket["id"] for ticket, _, _, _ in items])
    verdicts: list = []
    writes: list[tuple] = []
    for ticket, outcome, delay_ms, seen in items:
        if outcome is None:
            continue
        row = rows.get(ticket["id"])
        judged = judge_finish(row, ticket, outcome, delay_ms, now)
        if judged is None or row is None:
            verdicts.append(False)
            continue
        status, reason, available_at = judged
        # a done job's delivering attempt goes on its row in the same UPDATE
        evidence = (seen.started_ms, seen.latency_ms, seen.http_status) \
            if status == "done" else (None, None, None)
        writes.append((row["seq"], status, reason, available_at, *_marker(ticket).values(),
                       *evidence))
        verdicts.append((status, reason, row["seq"]))
    if not writes:
        return verdicts
    names = ("seq", "status", "reason", "available_at", *_marker(items[0][0]),
             "started_ms", "latency_ms", "http_status")
    arrays = dict(zip(names, unnest_columns(writes), strict=True))
    written = {seq for (seq,) in conn.execute(FINISH_IF_STILL_LEASED,
                                              {"now": now, **arrays}).fetchall()}
    # a line whose first was delivered: the next one goes
    lines = sorted({row["ordering_key"] for row in rows.values() if row["status"] == "done"
                    and row["seq"] in written and row["ordering_key"] is not None})
    if lines:
        conn.execute(PROMOTE, {"keys": lines})
    return [v if v and v[2] in written else False for v in verdicts]


def _record_attempts(conn: psycopg.Connection, items: list, results: list, seqs: list,
                     now: int) -> None:
    """Inside the finish: each attempt's evidence, as lease.sqlite records it.
    The attempt that made a job done is on the job's row already (the finish's
    UPDATE wrote it, ``done_after`` naming the newest attempts row before this
    finish); every other attempt (a retry, a refusal, a stale finish, evidence
    only) is an attempts row. A done job with an attempts row of its own
    earlier in this finish gets ``done_after`` moved on to the row written just
    before its delivering attempt."""
    rows: list[tuple] = []
    moved: list[tuple[int, int]] = []  # (seq of the done job, index of the row before it)
    earlier: set[str] = set()  # the ids with an attempts row so far in this finish
    for (ticket, outcome, _, seen), result, seq in zip(items, results, seqs, strict=True):
        if result is not False and result[0] == "done":
            if ticket["id"] in earlier:
                moved.append((seq, len(rows) - 1))
            continue
        status, reason = ("stale", None) if result is False else result
        earlier.add(ticket["id"])
        rows.append((ticket["id"], ticket["token"], ticket["attempt"], ticket["owner"],
                     seen.started_ms, now, outcome or "none", status, reason,
                     seen.http_status, _text(seen.error), seen.latency_ms))
    recorded = conn.execute(RECORD_ATTEMPTS, unnest_columns(rows)) if rows else None
    if moved:  # the one write that waits for the seqs of the rows just written
        assert recorded is not None  # a move names a row written before it
        written = sorted(seq for (seq,) in recorded)
        conn.execute(RECORD_DONE, unnest_columns([(seq, written[k]) for seq, k in moved]))
    stale = sum(1 for result in results if result is False)
    if stale:
        conn.execute(TALLY, ("stale_finishes", stale))


