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

from lease.endpoints import Endpoint
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
                   now_ms: int | None = None, fault: Fault = None,
                   endpoints: str | tuple[str, ...] | None = None) -> Claimed:
        """Quarantine, then lease up to ``limit`` ready jobs to ``owner``.

        ``endpoints`` None: the queue's own jobs (no endpoint), the higher
        priority first, then in seq order, as before endpoints existed.
        ``"*"`` or names: deliveries to those endpoints (every one, or the
        ones named), in fair (rank, seq) order, each endpoint's the higher
        priority first, then in the order they became due; returned the
        higher priority first, then by seq. Each endpoint's taken only while
        it is enabled, under its
        ``max_in_flight`` (less its live leases, counted inside the claim)
        and within its token bucket (refilled by the store's clock, spent
        by one token a lease, kept in the store): ``lease.endpoints``'s
        rules, so the caps hold across every dispatcher and host."""
        ...

    def extend_lease(self, ticket: dict, lease_ms: int, *, now_ms: int | None = None,
                     fault: Fault = None) -> dict | bool:
        """The new ticket, or False: the whole marker no longer matches."""
        ...

    def finish_jobs(self, items: list, *, now_ms: int | None = None,
                    fault: Fault = None) -> list:
        """``items`` of FinishItem; per item a Finished."""
        ...

    def release_jobs(self, tickets: list, *, reason: str,
                     now_ms: int | None = None) -> list:
        """Give claimed jobs back unsent, in one transaction
        (``lease.breaker.release_decisions``): per ticket True (pending again,
        its lease cleared, its attempt count as before the claim, due at once
        in its place; its token kept, so the ticket stays stale; no attempt
        row: nothing was sent) or False (stale: the ticket no longer holds the
        job, its lease or deadline passed; nothing changed). ``reason`` is one
        of ``lease.breaker.RELEASE_REASONS``; "circuit" counts each delivery
        released in its endpoint's attempts saved. The claims honour the
        circuit: a released delivery is claimed again when its endpoint's
        circuit lets it."""
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

    # -- the queue's pause: each change one transaction with its audit row
    def pause(self, note: str, *, actor: str | None = None,
              now_ms: int | None = None) -> bool:
        """Pause the queue: from its commit on, every claim (the queue's own
        jobs and the deliveries, on every host) leases nothing and changes
        nothing, not even its quarantine (``lease.rules``, "pause"). Leases
        already taken run to their end and finish as usual. False (nothing
        written) when it already is paused."""
        ...

    def resume(self, note: str, *, actor: str | None = None,
               now_ms: int | None = None) -> bool:
        """End the pause; False (nothing written) when it is not paused."""
        ...

    def paused(self) -> dict[str, Any] | None:
        """None, or since when, by whom and why: since_ms, actor, note."""
        ...

    def queue_audit(self) -> list[dict[str, Any]]:
        """Each pause and resume, oldest first: at_ms, action, note, actor."""
        ...

    # -- the per-minute rollup (lease.rules)
    def minutes(self, since_ms: int, endpoint: str | None = None) -> list[dict[str, Any]]:
        """The finishes per minute since ``since_ms`` (each written by the
        finish transaction itself), by minute then endpoint: minute_ms,
        endpoint ('' for the queue's own jobs), done, retried, dead, and
        ``buckets``: the send latencies counted in ``LATENCY_BOUNDS_MS``'s
        buckets (the last: above its last bound). ``endpoint`` None: every
        endpoint's rows and the queue's own; a name (or ''): that one's."""
        ...

    # -- the dispatchers at work (lease.rules)
    def register_worker(self, owner: str, host: str, pid: int, *,
                        now_ms: int | None = None) -> None:
        """A dispatcher's host and pid, and when it started, on its owner's row
        (a dispatcher calls it when it opens). Its claims record the rest."""
        ...

    def workers(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """The dispatchers seen in the last day, by owner: owner, host, pid,
        started_ms (None: never registered), last_claim_ms (the last claim
        that leased, or within WORKER_BEAT_MS of the last that did not),
        last_claimed (how many it leased) and live_leases (leases of that
        owner live at ``now_ms``)."""
        ...

    # -- observations (read only)
    def counts(self) -> dict[str, int]: ...

    def is_drained(self) -> bool: ...

    def is_idle(self) -> bool: ...

    def is_idle_for(self, endpoints: str | tuple[str, ...] | None) -> bool:
        """``is_idle`` of what a claim with these ``endpoints`` may take: the
        queue's own jobs (None), or the deliveries of the enabled endpoints
        served ("*" or names; a disabled endpoint's wait for an operator)."""
        ...

    def queue_depth(self, now_ms: int | None = None) -> dict[str, Any]:
        """What a metrics scrape reads (``lease.rules.queue_depth``): jobs by
        status, how many are ready now and the oldest one's age, the blocked
        keys, and per endpoint the same of its deliveries with its enabled flag
        and circuit state. One grouped scan of the jobs: its cost grows with
        them, so a scraper reads it at an interval (``asyncworker.queue_metrics``)."""
        ...

    def blocked_heads(self, limit: int = MAX_BATCH) -> list[dict[str, Any]]: ...

    def snapshot(self, now_ms: int | None = None) -> dict[str, Any]: ...

    def job_history(self, job_id: str) -> dict[str, Any] | None: ...

    def dead_jobs(self, reason: str | None = None, limit: int | None = None, *,
                  key: str | None = None, endpoint: str | None = None) -> list[dict[str, Any]]:
        """Dead jobs in seq order, optionally of one reason, of one ordering
        ``key`` (an exact match; a job without a key has none) and of one
        ``endpoint`` (its deliveries), at most ``limit`` of them; each with
        ``last_error`` where attempts are recorded."""
        ...

    def jobs_with_status(self, status: str) -> list[dict[str, Any]]: ...

    def list_jobs(self, *, status: str | None = None, reason: str | None = None,
                  id_prefix: str | None = None, after_seq: int | None = None,
                  limit: int = 50, key: str | None = None,
                  endpoint: str | None = None, error: str | None = None,
                  http_status: int | str | None = None, from_ms: int | None = None,
                  to_ms: int | None = None) -> list[dict[str, Any]]:
        """One page of whole rows in seq order after ``after_seq`` (keyset
        pagination), filtered (``key``: one ordering key, exactly;
        ``endpoint``: one endpoint's deliveries; ``error``: a substring of
        the last attempt's error, case-sensitive; ``http_status``: the last
        attempt's status, exactly (404) or by class ("4xx"); ``from_ms`` <=
        available_at < ``to_ms``: a done or dead job's is when it finished);
        a dead row with ``last_error``."""
        ...

    def stale_finishes(self) -> int: ...

    # -- endpoints (lease.endpoints): each change one transaction with its audit row
    def add_endpoint(self, endpoint: Endpoint, *, note: str | None = None,
                     actor: str | None = None, now_ms: int | None = None) -> None:
        """A new endpoint; EndpointError when its name is taken. From now on
        each message subscribed to its types fans out to it too."""
        ...

    def update_endpoint(self, name: str, changes: dict[str, Any], *, note: str | None = None,
                        actor: str | None = None, now_ms: int | None = None) -> Endpoint:
        """The endpoint with ``changes`` (``Endpoint.changed``), checked whole
        and written with an audit row naming the fields changed (never their
        values); EndpointError for an unknown name. ``{"enabled": False}``
        is disable: its deliveries stay, and wait."""
        ...

    def remove_endpoint(self, name: str, *, cancel_live: bool = False,
                        note: str | None = None, actor: str | None = None,
                        now_ms: int | None = None) -> int:
        """Remove an endpoint; how many live deliveries were cancelled. With
        live deliveries (pending or leased) and not ``cancel_live``:
        EndpointError, nothing changed. With ``cancel_live``: each pending
        one cancelled (an audit row each, as ``cancel_jobs``), then removed;
        a leased one refuses the removal (its send may be on the wire).
        Finished deliveries keep its name."""
        ...

    def recover_endpoint(self, name: str, since_ms: int, ttl_ms: int, note: str, *,
                         ids: list | None = None, dry_run: bool = False,
                         actor: str | None = None, now_ms: int | None = None) -> list[str]:
        """Send again every delivery of an endpoint finished (done or dead)
        since ``since_ms`` (when it finished), in seq order, at most
        ``MAX_RECOVER``: each one pending now with a fresh budget (attempts 0,
        ``ttl_ms`` to live, its token kept and raised by its next claim), a
        redrive audit row with the note and the actor, a done one's delivering
        attempt kept in its history. ``dry_run``: the ids it would send,
        nothing changed. ``ids``: only those of them (a dry run's, confirmed).
        The receiver's inbox absorbs what it already applied."""
        ...

    def endpoint_configs(self, names: tuple[str, ...] | None = None) -> list[Endpoint]:
        """The endpoints, secrets included: for the dispatcher that signs with
        them, never for a read that shows anything. By name."""
        ...

    def endpoints(self) -> list[dict[str, Any]]:
        """Every endpoint's ``Endpoint.public()`` (no secret, no header
        value), with ``created_ms`` and ``updated_ms``, by name."""
        ...

    def endpoint_stats(self) -> list[dict[str, Any]]:
        """Per endpoint, by name: ready, in_flight, done, retried (attempts
        that ended in a retry), dead and dead_by_reason, last_error (text and
        when), last_success (when), and the public fields."""
        ...

    def endpoint_audit(self, name: str | None = None) -> list[dict[str, Any]]:
        """The endpoints' audit rows (add, update, disable, enable, remove),
        oldest first: at_ms, endpoint, action, fields, note, actor."""
        ...
