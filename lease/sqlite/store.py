"""``SQLiteStore``: the ``lease.store.Store`` of one SQLite file."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from lease.clock import wall_clock_ms
from lease.endpoints import Endpoint, check_served
from lease.policy import (
    DEFAULT_POLICY,
    RetryPolicy,
)
from lease.records import (
    Claimed,
)
from lease.rules import check_minutes_query
from lease.sqlite import console, jobs, reads, release
from lease.sqlite.errors import store_errors
from lease.sqlite.jobs import (
    cancel_jobs,
    claim_jobs,
    enqueue_events,
    extend_lease,
    finish_jobs,
    prune_done,
    redrive_jobs,
)
from lease.sqlite.reads import stale_finishes
from lease.sqlite.schema import (
    check_journal,
    check_version,
    is_wal_file,
    journal_mode,
    open_shared,
    open_store,
    open_wal,
    schema_version,
)
from lease.worker import (
    MAX_BATCH,
    Fault,
    check_int,
    check_now,
    check_path,
    open_queue,
)


class SQLiteStore:
    """The ``lease.store.Store`` of one SQLite file (the functions above, and
    ``lease.sqlite.reads`` for the reads) on one connection: one thread at a time.

    The store's clock is this host's wall clock: every writer of a local file
    runs on the same host. ``connection`` is the file's sqlite3 connection,
    for the contract's own functions.
    """

    kind = "sqlite"
    threads = 1

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False,
                 read_only: bool = False, clock: Callable[[], int] | None = None,
                 migrate: bool = True, shared: bool = False,
                 journal: str | None = None) -> None:
        """``migrate=False`` leaves a contract file at its version until the
        first intake migrates it in its own transaction (``enqueue_events``):
        an intake refused halfway then leaves the file exactly as it was.

        ``shared=True`` declares that the queue shares its file with a
        service's own tables (``open_shared``); a file declared so once is
        opened as shared ever after, by every store, without being told.

        ``journal`` switches the file's journal mode ("wal" or "delete", see
        ``open_store``); None keeps the one it has. A shared file keeps the
        service's."""
        self.name = check_path(path, "queue")
        check_journal(journal)
        if journal is not None and (shared or read_only):
            raise ValueError("journal is not for a shared file (a shared file keeps the "
                             "service's journal mode) nor for a read-only store")
        self.read_only = read_only
        self.shared = False
        self._clock = clock or wall_clock_ms
        with store_errors():
            if read_only:
                self.connection = reads.open_readonly(self.name)
                return
            if not create and not os.path.isfile(self.name):
                raise FileNotFoundError(f"queue file not found: {self.name}")
            found = None
            if shared or os.path.isfile(self.name):
                found = open_shared(self.name, create=create, declare=shared)
            if found is not None:
                self.connection, self.shared = found, True
                return
            if migrate or journal is not None:
                self.connection = open_store(self.name, create=create, journal=journal)
                return
            # a WAL file stays one: the contract's opener would insist on its journal
            self.connection = open_wal(self.name) if is_wal_file(self.name) \
                else open_queue(self.name, create=create)
            try:
                check_version(self.connection)
            except BaseException:
                self.connection.close()
                raise

    def close(self) -> None:
        self.connection.close()

    @property
    def journal(self) -> str:
        """The file's journal mode: "delete" (the default), "wal", or a shared
        file's own."""
        with store_errors():
            return journal_mode(self.connection)

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def now_ms(self) -> int:
        return check_now(self._clock(), "clock value")

    def _now(self, now_ms: int | None) -> int:
        return self.now_ms() if now_ms is None else now_ms

    def schema_version(self) -> int:
        with store_errors():
            return schema_version(self.connection)

    def enqueue_events(self, events: Iterable[object], policy: RetryPolicy = DEFAULT_POLICY, *,
                       now_ms: int | None = None, not_before_ms: int | None = None,
                       on_progress: Callable[[int], None] | None = None,
                       on_conflict: str = "return") -> list:
        with store_errors():
            return enqueue_events(self.connection, events, self._now(now_ms), policy,
                                  not_before_ms=not_before_ms, on_progress=on_progress,
                                  on_conflict=on_conflict)

    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: int | None = None, fault: Fault = None,
                   endpoints: str | tuple[str, ...] | None = None) -> Claimed:
        now = self._now(now_ms)
        with store_errors():
            leased, moved = claim_jobs(self.connection, owner, now, lease_ms, limit, fault,
                                       endpoints)
        return Claimed(leased, moved, now)

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Fault = None) -> dict | bool:
        with store_errors():
            return extend_lease(self.connection, ticket, self._now(now_ms), lease_ms, fault)

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Fault = None) -> list:
        with store_errors():
            return finish_jobs(self.connection, items, self._now(now_ms), fault)

    def release_jobs(self, tickets: list, *, reason: str,
                     now_ms: int | None = None) -> list:
        with store_errors():
            return release.release_jobs(self.connection, tickets, self._now(now_ms), reason)

    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: int | None = None, fault: Fault = None,
                     actor: str | None = None) -> list:
        with store_errors():
            return redrive_jobs(self.connection, job_ids, self._now(now_ms), ttl_ms, note, fault,
                                actor)

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: int | None = None,
                    fault: Fault = None, actor: str | None = None) -> list:
        with store_errors():
            return cancel_jobs(self.connection, job_ids, self._now(now_ms), note, fault, actor)

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int:
        with store_errors():
            return prune_done(self.connection, finished_before_ms, limit)

    def pause(self, note: str, *, actor: str | None = None,
              now_ms: int | None = None) -> bool:
        with store_errors():
            return console.set_paused(self.connection, "pause", self._now(now_ms), note, actor)

    def resume(self, note: str, *, actor: str | None = None,
               now_ms: int | None = None) -> bool:
        with store_errors():
            return console.set_paused(self.connection, "resume", self._now(now_ms), note, actor)

    def paused(self) -> dict[str, Any] | None:
        with store_errors():
            return console.paused(self.connection)

    def queue_audit(self) -> list[dict[str, Any]]:
        with store_errors():
            return console.queue_audit(self.connection)

    def register_worker(self, owner: str, host: str, pid: int, *,
                        now_ms: int | None = None) -> None:
        with store_errors():
            console.register_worker(self.connection, owner, host, pid, self._now(now_ms))

    def minutes(self, since_ms: int, endpoint: str | None = None) -> list[dict[str, Any]]:
        check_minutes_query(since_ms, endpoint)
        with store_errors():
            return console.minutes(self.connection, since_ms, endpoint)

    def workers(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        with store_errors():
            return console.workers(self.connection, self._now(now_ms))

    def counts(self) -> dict[str, int]:
        with store_errors():
            return reads.counts(self.connection)

    def is_drained(self) -> bool:
        with store_errors():
            return reads.is_drained(self.connection)

    def is_idle(self) -> bool:
        with store_errors():
            return reads.is_idle(self.connection)

    def is_idle_for(self, endpoints: str | tuple[str, ...] | None) -> bool:
        served = check_served(endpoints)
        with store_errors():
            return reads.is_idle_for(self.connection, served)

    def queue_depth(self, now_ms: int | None = None) -> dict[str, Any]:
        with store_errors():
            return reads.depth(self.connection, self._now(now_ms))

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]:
        check_int("limit", limit, 1, MAX_BATCH)
        with store_errors():
            return reads.blocked_heads(self.connection, limit)

    def snapshot(self, now_ms: int | None = None) -> dict[str, Any]:
        with store_errors():
            return reads.snapshot(self.connection, self._now(now_ms))

    def job_history(self, job_id: str) -> dict[str, Any] | None:
        with store_errors():
            return reads.job_history(self.connection, job_id)

    def dead_jobs(self, reason: str | None = None, limit: int | None = None, *,
                  key: str | None = None, endpoint: str | None = None) -> list[dict[str, Any]]:
        with store_errors():
            return reads.dead_jobs(self.connection, reason, limit, key=key, endpoint=endpoint)

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]:
        with store_errors():
            return reads.jobs_with_status(self.connection, status)

    def list_jobs(self, *, status: str | None = None, reason: str | None = None,
                  id_prefix: str | None = None, after_seq: int | None = None,
                  limit: int = 50, key: str | None = None,
                  endpoint: str | None = None, error: str | None = None,
                  http_status: int | str | None = None, from_ms: int | None = None,
                  to_ms: int | None = None) -> list[dict[str, Any]]:
        with store_errors():
            return reads.list_jobs(self.connection, status=status, reason=reason,
                                     id_prefix=id_prefix, after_seq=after_seq, limit=limit,
                                     key=key, endpoint=endpoint, error=error,
                                     http_status=http_status, from_ms=from_ms, to_ms=to_ms)

    def stale_finishes(self) -> int:
        with store_errors():
            return stale_finishes(self.connection)

    # -- endpoints
    def add_endpoint(self, endpoint: Endpoint, *, note: str | None = None,
                     actor: str | None = None, now_ms: int | None = None) -> None:
        with store_errors():
            jobs.add_endpoint(self.connection, endpoint, self._now(now_ms), note, actor)

    def update_endpoint(self, name: str, changes: dict[str, Any], *, note: str | None = None,
                        actor: str | None = None, now_ms: int | None = None) -> Endpoint:
        with store_errors():
            return jobs.update_endpoint(self.connection, name, changes, self._now(now_ms),
                                        note, actor)

    def remove_endpoint(self, name: str, *, cancel_live: bool = False,
                        note: str | None = None, actor: str | None = None,
                        now_ms: int | None = None) -> int:
        with store_errors():
            return jobs.remove_endpoint(self.connection, name, self._now(now_ms),
                                        cancel_live=cancel_live, note=note, actor=actor)

    def recover_endpoint(self, name: str, since_ms: int, ttl_ms: int, note: str, *,
                         ids: list | None = None, dry_run: bool = False,
                         actor: str | None = None, now_ms: int | None = None) -> list[str]:
        with store_errors():
            return jobs.recover_endpoint(self.connection, name, since_ms, self._now(now_ms),
                                         ttl_ms, note, ids=ids, dry_run=dry_run, actor=actor)

    def endpoint_configs(self, names: tuple[str, ...] | None = None) -> list[Endpoint]:
        with store_errors():
            return reads.endpoint_configs(self.connection, names)

    def endpoints(self) -> list[dict[str, Any]]:
        with store_errors():
            return reads.endpoints_of(self.connection)

    def endpoint_stats(self) -> list[dict[str, Any]]:
        with store_errors():
            return reads.endpoint_stats(self.connection)

    def endpoint_audit(self, name: str | None = None) -> list[dict[str, Any]]:
        with store_errors():
            return reads.endpoint_audit(self.connection, name)
