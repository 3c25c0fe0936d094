"""Which store a queue is named by, and the synchronous cycle on any store.

``open_store`` opens a ``postgresql://`` URL with ``lease.postgres`` and a
file's path with ``lease.sqlite``: the factory lives here, beside the drivers,
so that the interface (``lease.store``) imports none of them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from lease.policy import DEFAULT_POLICY, PRODUCT, RetryPolicy
from lease.queues import DEFAULT, check_queue_name, family, sqlite_path
from lease.records import Attempt, NotAQueue
from lease.retrying import PATIENT
from lease.store import Store
from lease.worker import (
    StoreError,
    check_callable,
    check_identifier,
    check_int,
    check_jitter,
    check_now,
    check_second_clock,
    classify_result,
    cycle_result,
)

__all__ = ["POSTGRES_SCHEMES", "is_postgres_url", "list_queues", "open_store", "run_queue",
           "run_store_once"]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: object) -> bool:
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def open_store(target: str | os.PathLike[str], *, create: bool = False,
               read_only: bool = False, clock: Callable[[], int] | None = None,
               threads: int = 1, shared: bool = False,
               journal: str | None = None, queue: str | None = None) -> Store:
    """The store a queue is named by: a ``postgresql://`` URL, or a SQLite file's path.

    ``create`` makes a missing file (SQLite) or the missing tables (both);
    without it a missing queue is FileNotFoundError for a file and NotAQueue
    for a database without the queue's tables. ``read_only`` opens for the
    observations alone and never writes, repairs or migrates. ``threads``: how
    many threads will call it at once (PostgreSQL's pool size; SQLite has one).
    ``shared`` declares that a SQLite queue shares its file with a service's
    own tables (``lease.sqlite.open_shared``: recorded in the file, so later
    opens need not say it); a PostgreSQL queue always lives in a schema of its
    own beside the service's tables, so there it changes nothing.
    ``journal`` ("wal" or "delete") switches a SQLite file's journal mode, kept
    by every later open (``lease.sqlite.SQLiteStore``); None keeps the file's.
    ``queue`` names a queue other than the default one (``lease.queues``): in
    the same database (a URL may name it instead, ``?queue=NAME``), or in a
    file beside the one named (``queue.db``: ``queue.NAME.db``).
    """
    if is_postgres_url(target):
        if journal is not None:
            raise ValueError("journal is a SQLite file's choice: a PostgreSQL queue has "
                             "the server's write-ahead log")
        try:
            from lease.postgres import PostgresStore
        except ImportError as exc:  # the optional extra is not installed
            raise StoreError(f"a postgresql:// queue needs psycopg 3: "
                             f"pip install 'lease-dispatcher[postgres]' ({exc})") from None
        return PostgresStore(str(target), create=create, read_only=read_only, clock=clock,
                             threads=threads, queue=queue)
    from lease.sqlite import SQLiteStore

    return SQLiteStore(sqlite_path(target, queue), create=create, read_only=read_only,
                       clock=clock, shared=shared, journal=journal)


def list_queues(target: str | os.PathLike[str]) -> list[str]:
    """The queues of one database, or of one file and those beside it, by
    name: ``default`` (the database's schema ``lease``, or the file itself)
    first, when it is a queue, then the named ones in order. ``target`` may
    name any of them."""
    if is_postgres_url(target):
        from lease.postgres import list_queues as in_database

        return in_database(str(target))
    base, _ = family(target)
    folder, name = os.path.split(base)
    stem, suffix = os.path.splitext(name)
    found = [DEFAULT] if _is_queue(base) else []
    beside = sorted(entry for entry in os.listdir(folder or ".")
                    if entry.startswith(f"{stem}.") and entry.endswith(suffix))
    for entry in beside:
        middle = entry[len(stem) + 1:len(entry) - len(suffix)] if suffix else entry[len(stem) + 1:]
        path = os.path.join(folder, entry)
        if _named(middle) and _is_queue(path):
            found.append(middle)
    return found


def _named(middle: str) -> bool:
    """``stem.MIDDLE.suffix`` is a named queue's file: MIDDLE is a queue's name."""
    try:
        return check_queue_name(middle) is not None
    except ValueError:
        return False


def _is_queue(path: str) -> bool:
    """A SQLite file holding a queue, opened read-only: nothing written."""
    if not os.path.isfile(path):
        return False
    try:
        open_store(path, read_only=True).close()
    except (NotAQueue, StoreError, OSError):
        return False
    return True


# ------------------------------------------------------------------ one cycle


def run_store_once(
    store: Store,
    owner: str,
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
    *,
    policy: RetryPolicy = DEFAULT_POLICY,
    clock: Callable[[], int] | None = None,
) -> dict | None:
    """Claim one job of any store, send it with no transaction open, finish it
    with its attempt's evidence: the product's member of the run_once family
    (``lease.worker.run_once``, the contract on one file, and
    ``asyncworker.run_once``, the contract on an event loop, share its last
    step, ``cycle_result``).

    None when there is no work, else {"id", "token", "status"} (the finish's
    status, or "stale"). ``send(event)`` gets {"id", "qty"} or {"id", "body"};
    Retryable and Permanent are judged by ``policy``; a bad ACK and any other
    error propagate with the job left leased, for its lease expiry and budget
    to recover, its attempt recorded as evidence first. ``clock`` (ms) judges
    instead of the store's clock.
    """
    check_jitter(jitter)  # first, before any clock is read, as the contract's run_once
    check_identifier("owner", owner)
    check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    check_callable("send", send)
    if clock is not None:
        check_callable("clock", clock)
    first = None if clock is None else check_now(clock(), "clock value")
    claimed = PATIENT.call(lambda: store.claim_jobs(owner, lease_ms, 1, now_ms=first))
    if not claimed.leased:
        return None
    [job] = claimed.leased
    ticket = job.ticket
    started = time.perf_counter()
    error: BaseException | None = None
    verdict: tuple[str, int] | None
    try:
        verdict = classify_result(send(job.event))
    except BaseException as exc:  # judged below; whatever is not ours propagates
        error = exc
        verdict = policy.judge(exc, ticket["attempt"], jitter)
    seen = Attempt.of(claimed.now_ms, round((time.perf_counter() - started) * 1000), error)
    second = None if clock is None else check_second_clock(claimed.now_ms, clock())
    outcome, delay_ms = verdict if verdict is not None else (None, 0)
    [finished] = PATIENT.call(lambda: store.finish_jobs([(ticket, outcome, delay_ms, seen)],
                                                        now_ms=second))
    if verdict is None:
        assert error is not None
        raise error
    return cycle_result(ticket, finished and finished[0])


def run_queue(
    target: str | os.PathLike[str],
    owner: str,
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
    *,
    policy: RetryPolicy = DEFAULT_POLICY,
    clock: Callable[[], int] | None = None,
) -> dict | None:
    """run_store_once on an existing queue (a file's path or a ``postgresql://`` URL),
    with a store opened for it and always closed: the equivalent of
    ``lease.worker.run_file`` on any store. A missing queue is never created."""
    store = open_store(target, create=False)
    try:
        return run_store_once(store, owner, send, jitter, lease_ms, policy=policy, clock=clock)
    finally:
        store.close()
