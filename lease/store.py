"""The one store interface: what every front end asks of a queue, on any store.

The dispatcher, the synchronous API, the CLI, the observations and the
operator's tools speak to a ``Store``; ``lease.sqlite.SQLiteStore`` (one
file, one writer at a time) and ``lease.postgres.PostgresStore`` (many
hosts, one database) implement it. The rules are not here: validation, the
retry delay, the verdicts, the finish decision and the marker check live in
``lease.worker`` and every store calls them. A store adds only how its
rows are read and written.

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
decided in one place, ``BusyRetry``; each caller only says when to give up.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Iterable,
    NamedTuple,
    Optional,
    Protocol,
    TypeVar,
    Union,
    runtime_checkable,
)

from lease.policy import DEFAULT_POLICY, PRODUCT, RetryPolicy
from lease.worker import (
    MAX_BATCH,
    Busy,
    Conflict,
    Fault,
    NotAQueue,
    StoreError,
    _check_callable,
    _check_int,
    check_identifier,
    check_jitter,
    check_now,
    check_second_clock,
    classify_result,
)

__all__ = [
    "Attempt",
    "Busy",
    "BusyRetry",
    "Claimed",
    "Conflicts",
    "Leased",
    "MAX_ERROR_CHARS",
    "ON_CONFLICT",
    "NotAQueue",
    "Store",
    "StoreError",
    "is_postgres_url",
    "open_store",
    "run_once",
    "run_queue",
]

T = TypeVar("T")

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


MAX_ERROR_CHARS = 500  # an attempt's error text, as kept

# What an intake does when an event conflicts (the same id kept with other
# content): "raise" refuses the whole call with Conflicts, nothing of it
# written; "return" gives each Conflict in the results and writes the rest.
ON_CONFLICT = ("raise", "return")
_NAMED_CONFLICTS = 5  # in a Conflicts' message; all of them are in .conflicts


class Conflicts(Conflict):
    """An intake refused whole: some of its events conflict with the content
    kept for their id, and nothing of the call was written. ``results`` holds
    per event what the intake found (True new, False duplicate, or its
    Conflict); ``conflicts`` the (index, Conflict) of each conflicting one,
    in order. A Conflict itself, so ``except Conflict`` catches it."""

    def __init__(self, results: list) -> None:
        self.results = results
        self.conflicts = [(index, result) for index, result in enumerate(results)
                          if isinstance(result, Conflict)]
        named = "; ".join(f"event {index + 1}: {conflict}"
                          for index, conflict in self.conflicts[:_NAMED_CONFLICTS])
        more = len(self.conflicts) - _NAMED_CONFLICTS
        super().__init__(f"{len(self.conflicts)} of {len(results)} events conflict, nothing "
                         f"was enqueued: {named}{f'; and {more} more' if more > 0 else ''}")


def check_on_conflict(on_conflict: object) -> str:
    if on_conflict not in ON_CONFLICT:
        raise ValueError(f"on_conflict must be one of {ON_CONFLICT}, got {on_conflict!r:.40}")
    return on_conflict  # one of the strings above


def judge_intake(results: list, on_conflict: str) -> list:
    """The intake's results, or (``on_conflict="raise"`` and an event
    conflicts) Conflicts, raised inside the intake's transaction or savepoint
    so that nothing of it is written. Every store's intake ends here."""
    if on_conflict == "raise" and any(isinstance(result, Conflict) for result in results):
        raise Conflicts(results)
    return results


class Attempt(NamedTuple):
    """What one attempt saw, recorded with its finish. ``started_ms`` is the
    store's time of the claim; ``latency_ms`` the send's own duration."""

    started_ms: int
    latency_ms: Optional[int] = None
    http_status: Optional[int] = None
    error: Optional[str] = None

    @classmethod
    def of(cls, started_ms: int, latency_ms: int, error: Optional[BaseException],
           delivered_status: Optional[int] = None) -> Attempt:
        """The evidence of a send that returned (error None: the HTTP status of
        its answer, ``delivered_status``, when it had one) or raised ``error``:
        the HTTP status the sender put on it, its class and message, capped."""
        if error is None:
            return cls(started_ms, latency_ms, delivered_status)
        return cls(started_ms, latency_ms, _http_status(error), _error_text(error))


def _http_status(error: BaseException) -> Optional[int]:
    """The HTTP status the sender put on its exception, if it is one."""
    try:
        status = getattr(error, "http_status", None)
    except Exception:  # a foreign exception's property: no status, not a lost finish
        return None
    return status if type(status) is int and 100 <= status <= 999 else None


def _error_text(error: BaseException) -> str:
    """The exception as evidence: its class and message, capped as it is kept."""
    name = type(error).__name__
    try:
        text = str(error)
    except Exception:  # a broken __str__ must not lose the finish: the class alone
        return name
    return f"{name}: {text}"[:MAX_ERROR_CHARS] if text else name


class Leased(NamedTuple):
    """A claimed job: its ticket (the contract's six keys), its body's
    canonical JSON text and that text's sha256 from the intake (both None
    for a {"id", "qty"} event)."""

    ticket: dict
    body: Optional[str]
    digest: Optional[str] = None

    @property
    def event(self) -> dict:
        """The event as enqueued: {"id", "qty"} or {"id", "body"} (body as text)."""
        if self.body is None:
            return {"id": self.ticket["id"], "qty": self.ticket["qty"]}
        return {"id": self.ticket["id"], "body": self.body}


class Claimed(NamedTuple):
    """One claim transaction: the jobs leased, the quarantine's moves to dead
    by reason ({"deadline": n, "exhausted": m}), and the store's time it
    judged by (the leases end at ``ticket["lease_until"]`` on that clock)."""

    leased: list[Leased]
    moved: dict[str, int]
    now_ms: int


# (ticket, outcome or None for evidence only, delay_ms, Attempt)
FinishItem = tuple[dict, Optional[str], int, Attempt]
# per item: (status, reason), False for a stale ticket, ("leased", None) for evidence only
Finished = Union[tuple[str, Optional[str]], bool]


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
                       now_ms: Optional[int] = None, not_before_ms: Optional[int] = None,
                       on_progress: Optional[Callable[[int], None]] = None,
                       on_conflict: str = "return") -> list:
        """All or none, in one transaction; per event True (new), False (the same
        id and content: a duplicate, untouched) or its Conflict, the others
        written; ``on_conflict="raise"``: any conflict is Conflicts, and
        nothing is written."""
        ...

    # -- one attempt
    def claim_jobs(self, owner: str, lease_ms: int, limit: int = 1, *,
                   now_ms: Optional[int] = None, fault: Fault = None) -> Claimed: ...

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: Optional[int] = None,
                     fault: Fault = None) -> Union[dict, bool]:
        """The new ticket, or False: the whole marker no longer matches."""
        ...

    def finish_jobs(self, items: list, *, now_ms: Optional[int] = None,
                    fault: Fault = None) -> list:
        """``items`` of FinishItem; per item a Finished."""
        ...

    # -- the operator
    def redrive_jobs(self, job_ids: list, ttl_ms: int, note: str, *,
                     now_ms: Optional[int] = None, fault: Fault = None,
                     actor: Optional[str] = None) -> list:
        """Per id True or its ValueError; each release atomic with its audit row
        (the note, and who did it: ``actor``)."""
        ...

    def cancel_jobs(self, job_ids: list, note: str, *, now_ms: Optional[int] = None,
                    fault: Fault = None, actor: Optional[str] = None) -> list: ...

    def prune_done(self, finished_before_ms: int, limit: int = MAX_BATCH) -> int: ...

    # -- observations (read only)
    def counts(self) -> dict[str, int]: ...

    def is_drained(self) -> bool: ...

    def is_idle(self) -> bool: ...

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]: ...

    def snapshot(self, now_ms: Optional[int] = None) -> dict[str, Any]: ...

    def job_history(self, job_id: str) -> Optional[dict[str, Any]]: ...

    def dead_jobs(self, reason: Optional[str] = None, limit: Optional[int] = None, *,
                  key: Optional[str] = None) -> list[dict[str, Any]]:
        """Dead jobs in seq order, optionally of one reason and of one ordering
        ``key`` (an exact match; a job without a key has none), at most
        ``limit`` of them; each with ``last_error`` where attempts are recorded."""
        ...

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]: ...

    def list_jobs(self, *, status: Optional[str] = None, reason: Optional[str] = None,
                  id_prefix: Optional[str] = None, after_seq: Optional[int] = None,
                  limit: int = 50, key: Optional[str] = None) -> list[dict[str, Any]]:
        """One page of whole rows in seq order after ``after_seq`` (keyset
        pagination), filtered (``key``: one ordering key, exactly); a dead row
        with ``last_error``."""
        ...

    def stale_finishes(self) -> int: ...


def is_postgres_url(target: object) -> bool:
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def open_store(target: Union[str, os.PathLike[str]], *, create: bool = False,
               read_only: bool = False, clock: Optional[Callable[[], int]] = None,
               threads: int = 1, shared: bool = False,
               journal: Optional[str] = None) -> Store:
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
                             threads=threads)
    from lease.sqlite import SQLiteStore

    return SQLiteStore(target, create=create, read_only=read_only, clock=clock, shared=shared,
                       journal=journal)


@dataclass(frozen=True)
class BusyRetry:
    """How a ``Busy`` store is retried, for every caller: a short jittered pause
    (1-10 ms: another writer's transaction is short), for up to ``patience_s``
    unless the caller gives up sooner (a finish whose leases have all ended)."""

    patience_s: float = 5.0
    min_pause_s: float = 0.001
    max_pause_s: float = 0.010

    def pause_s(self, draw: float) -> float:
        return self.min_pause_s + (self.max_pause_s - self.min_pause_s) * draw

    def call(self, fn: Callable[[], T], *, on_busy: Optional[Callable[[Busy], None]] = None,
             draw: Callable[[], float] = random.random,
             sleep: Callable[[float], None] = time.sleep) -> T:
        """``fn()``, retried while it raises Busy, for up to ``patience_s``."""
        give_up = time.monotonic() + self.patience_s
        while True:
            try:
                return fn()
            except Busy as busy:
                if on_busy is not None:
                    on_busy(busy)
                if time.monotonic() >= give_up:
                    raise
            sleep(self.pause_s(draw()))


PATIENT = BusyRetry()


# ------------------------------------------------------------------ one cycle


def run_once(
    store: Store,
    owner: str,
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
    *,
    policy: RetryPolicy = DEFAULT_POLICY,
    clock: Optional[Callable[[], int]] = None,
) -> Optional[dict]:
    """Claim one job of any store, send it with no transaction open, finish it
    with its attempt's evidence: the product's twin of ``lease.worker.run_once``.

    None when there is no work, else {"id", "token", "status"} (the finish's
    status, or "stale"). ``send(event)`` gets {"id", "qty"} or {"id", "body"};
    Retryable and Permanent are judged by ``policy``; a bad ACK and any other
    error propagate with the job left leased, for its lease expiry and budget
    to recover, its attempt recorded as evidence first. ``clock`` (ms) judges
    instead of the store's clock.
    """
    check_jitter(jitter)  # first, before any clock is read, as the contract's run_once
    check_identifier("owner", owner)
    _check_int("lease_ms", lease_ms, 1, PRODUCT.max_lease_ms)
    _check_callable("send", send)
    if clock is not None:
        _check_callable("clock", clock)
    first = None if clock is None else check_now(clock(), "clock value")
    claimed = PATIENT.call(lambda: store.claim_jobs(owner, lease_ms, 1, now_ms=first))
    if not claimed.leased:
        return None
    [job] = claimed.leased
    ticket = job.ticket
    started = time.perf_counter()
    error: Optional[BaseException] = None
    verdict: Optional[tuple[str, int]]
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
    status = finished[0] if finished else "stale"
    return {"id": ticket["id"], "token": ticket["token"], "status": status}


def run_queue(
    target: Union[str, os.PathLike[str]],
    owner: str,
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
    *,
    policy: RetryPolicy = DEFAULT_POLICY,
    clock: Optional[Callable[[], int]] = None,
) -> Optional[dict]:
    """run_once on an existing queue (a file's path or a ``postgresql://`` URL),
    with a store opened for it and always closed: the equivalent of
    ``lease.worker.run_file`` on any store. A missing queue is never created."""
    store = open_store(target, create=False)
    try:
        return run_once(store, owner, send, jitter, lease_ms, policy=policy, clock=clock)
    finally:
        store.close()
