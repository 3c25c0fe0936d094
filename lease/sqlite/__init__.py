"""The SQLite driver, the product's queue on one file: payloads, wider budgets,
the evidence of every attempt, cancels, retention, and versioned migrations.

A product file is a contract file migrated forward: the contract's two tables
stay as they are, with columns added after the contract's and tables added
beside them, and ``PRAGMA user_version`` says which version it is. So the
contract's functions (``lease.worker``) still work on it, and every function
here runs the contract's own transactions (claim, extend, finish, redrive)
with the product's limits (``lease.policy.PRODUCT``). No rule is written
twice: what is new here is only what the contract has no column for.

Versions:

- 0: the contract's schema (``lease.worker.open_queue``);
- 1: ``jobs.body`` and ``jobs.digest``; the delivering attempt's evidence
  on a done job's row (``jobs.done_*``) and every other attempt's in
  ``attempts``; ``cancels``, their audit rows; ``tallies``, durable counters (the
  stale finishes refused); indexes for pruning done jobs and for a job's
  audit rows;
- 2: ``redrives.actor`` and ``cancels.actor``: who made an operator's change;
- 3: ``jobs.ordering_key`` and ``jobs.held``: ordered delivery per key (below);
- 4: ``bodies``, a job's payload in a table of its own, written once by the
  intake and deleted with the job (``jobs.body`` stays, always NULL).
  SQLite rewrites a whole record at each change of any column, so a body
  kept on the job's row was written again by the claim and by the finish,
  and its pages again by both COMMITs (what that cost is measured in
  ``docs/benchmarks-history.md``).

Every migration runs in one transaction: a crash leaves the old version
whole. A file newer than this code is refused untouched.

Ordered keys. Jobs enqueued with the same ``key`` are delivered one at a time
in intake order. A key's *line* is its jobs still to be delivered: pending,
leased, or dead but not cancelled (a dead job blocks the jobs behind it until
it is redriven, when it is first in line again, or cancelled, when the next
goes). Exactly one job of a non-empty line has ``held = 0``: its first, the
only one a claim may take; every other has ``held = 1``. Each transaction
that changes a line (intake, a finish that makes its first done, a cancel, a
redrive) moves the mark in the same transaction, by index probes on the key
alone, so a claim reads only the jobs it may take (``jobs_claimable``) however
long the lines are. Jobs without a key are never held.

A queue can share a file with a service's own tables, as a declared choice
(``SQLiteStore(path, create=True, shared=True)``): the declaration is a row in
``lease_meta``, so every later open accepts the file without being told, the
file keeps the journal mode the service gave it (WAL or a rollback journal),
and the service enqueues inside its own transaction with ``enqueue_in``. A file
with foreign tables that was never declared shared is refused as before.

Layout: ``schema`` (versions, migrations, opening), ``statements`` (the SQL,
named), ``batch`` (a batch of rows in one statement), ``jobs`` (the
transactions), ``reads`` (the observations, read only), ``store``
(``SQLiteStore``). The rules are the contract's (``lease.worker``) and the
product's (``lease.rules``); PostgreSQL's driver imports nothing from here.
"""

from lease.sqlite.jobs import (
    cancel_jobs,
    claim_jobs,
    enqueue_events,
    enqueue_in,
    extend_lease,
    finish_jobs,
    prune_done,
    redrive_jobs,
)
from lease.sqlite.reads import stale_finishes
from lease.sqlite.schema import (
    JOURNALS,
    SCHEMA_VERSION,
    check_journal,
    is_declared_shared,
    is_wal_file,
    journal_mode,
    migrate,
    open_shared,
    open_store,
    open_wal,
    schema_version,
)
from lease.sqlite.store import SQLiteStore

__all__ = [
    "JOURNALS",
    "SCHEMA_VERSION",
    "SQLiteStore",
    "cancel_jobs",
    "check_journal",
    "claim_jobs",
    "enqueue_events",
    "enqueue_in",
    "extend_lease",
    "finish_jobs",
    "is_declared_shared",
    "is_wal_file",
    "journal_mode",
    "migrate",
    "open_shared",
    "open_store",
    "open_wal",
    "prune_done",
    "redrive_jobs",
    "schema_version",
    "stale_finishes",
]
