"""The one store interface: what every front end asks of a queue, on any store.

The dispatcher, the synchronous API, the CLI, the observations and the
operator's tools speak to a ``Store``; ``lease.sqlite.SQLiteStore`` (one
file, one writer at a time) and ``lease.postgres.PostgresStore`` (many
hosts, one database) implement it, and ``lease.stores.open_store`` opens the
one a queue is named by; this module imports neither. The rules are not here:
validation, the retry delay, the verdicts, the finish decision and the marker
check live in ``lease.worker``, the product's own in ``lease.rules``, and
every store calls them. A store adds only how its rows are read and written.
The records it takes and gives are in ``lease.records``.

Time. Every operation that judges a lease takes ``now_ms``; None (the
default) means *the store's clock*: the host's wall clock for a SQLite file
(all its writers share the host), the database server's clock, read inside
the transaction, for PostgreSQL (hosts whose own clocks are skewed then
cannot steal or keep a lease). A store opened with ``clock=`` uses that
clock instead (tests). A claim returns the time it judged by, so a caller
can tell how long its leases have left in the store's own time.

Errors. A store raises ``Busy`` for what a short pause can cure (a SQLite
write lock held by another process; a PostgreSQL serialization failure,
deadlock or lost connection before COMMIT), ``NotAQueue`` for a file or
database that is not a queue it can use, ``Conflict`` per event at intake,
and ValueError for a bad argument. How long to keep retrying ``Busy`` is
decided in one place, ``lease.retrying.BusyRetry``; each caller only says
when to give up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from lease.policy import DEFAULT_POLICY, RetryPolicy
from lease.records import Claimed
from lease.worker import MAX_BATCH, Fault

__all__ = ["Store"]


@runtime_checkable
class Store(Protocol):
    """A queue. Every method is one short transaction (or one consistent read)
    and is safe to call from one thread at a time; ``threads`` says how many
    threads may call it at once (1 for SQLite's one connection, the pool's size
    for PostgreSQL)."""

    kind: str  # "sqlite" or "postgresql"
    name: str  # the file's path, or the URL without its password
    threads: int

    def close(self) -> None: ...

    def __enter__(self) -> Store: ...

    def __exit__(self, *exc: object) -> None: ...

    def schema_version(self) -> int: ...

    def now_ms(self) -> int:
        """The store's clock (one round trip on PostgreSQL)."""
        ...

    # -- intake
    def enqueue_events(self, events: Iterable[object], policy: RetryPolicy = DEFAULT_POLICY, *,
                       now_ms: int | None = None, not_before_ms: int | None = None,
                       on_progress: Callable[[int], None] | None = None,
                       on_conflict: str = "return") -> list:
        """All or none, in one transaction; per event True (new), False (the same
        id and content: a duplicate, untouched) or its Conflict, the others
        written; ``on_conflict="raise"``: any conflict is Conflicts, and
        nothing is written."""
        ...

    # -- one attempt
    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: int | None = None, fault: Fault = None) -> Claimed: ...

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Fault = None) -> dict | bool:
        """The new ticket, or False: the whole marker no longer matches."""
        ...

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Fault = None) -> list:
        """``items`` of FinishItem; per item a Finished."""
        ...

    # -- the operator
    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: int | None = None, fault: Fault = None,
                     actor: str | None = None) -> list:
        """Per id True or its ValueError; each release atomic with its audit row
        (the note, and who did it: ``actor``)."""
        ...

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: int | None = None,
                    fault: Fault = None, actor: str | None = None) -> list: ...

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int: ...

    # -- observations (read only)
    def counts(self) -> dict[str, int]: ...

    def is_drained(self) -> bool: ...

    def is_idle(self) -> bool: ...

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]: ...

    def snapshot(self, now_ms: int | None = None) -> dict[str, Any]: ...

    def job_history(self, job_id: str) -> dict[str, Any] | None: ...

    def dead_jobs(self, reason: str | None = None, limit: int | None = None, *,
                  key: str | None = None) -> list[dict[str, Any]]:
        """Dead jobs in seq order, optionally of one reason and of one ordering
        ``key`` (an exact match; a job without a key has none), at most
        ``limit`` of them; each with ``last_error`` where attempts are recorded."""
        ...

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]: ...

    def list_jobs(self, *, status: str | None = None, reason: str | None = None,
                  id_prefix: str | None = None, after_seq: int | None = None,
                  limit: int = 50, key: str | None = None) -> list[dict[str, Any]]:
        """One page of whole rows in seq order after ``after_seq`` (keyset
        pagination), filtered (``key``: one ordering key, exactly); a dead row
        with ``last_error``."""
        ...

    def stale_finishes(self) -> int: ...
