"""The PostgreSQL driver: many hosts, one database, the same rules.

``PostgresStore`` implements ``lease.store.Store`` on psycopg 3 with a
connection pool, for the same results as ``lease.sqlite.SQLiteStore`` row for
row. The rules are not here: every argument goes through the validators of
``lease.worker``/``lease.policy``/``lease.rules``, every verdict through
``finish_decision`` and ``marker_matches``, every refusal through the same
decision functions. What is here is how PostgreSQL's rows are locked, read and
written so that, at READ COMMITTED with many writers at once, no interleaving
of transactions can let a stale ticket win:

- a claim picks with ``FOR UPDATE SKIP LOCKED`` inside a CTE: it never blocks
  on or deadlocks with another claimer, and the planner cannot update more
  rows than the limit;
- an extension or a finish locks its rows (``FOR UPDATE``, in seq order, so two
  of them never deadlock), judges them in Python by the rules, and then every
  UPDATE carries the whole marker in its WHERE and checks its row count;
- time is the database server's clock, read inside the transaction as its
  first statement, so hosts whose clocks are skewed cannot steal or keep a
  lease (``clock=`` injects another, for tests).

Ordered keys (``lease.sqlite``'s docstring, "Ordered keys"): the same ``held`` mark on
the first job of each key's line, moved by the same transactions. Here many
writers run at once, so every transaction that moves a mark (an intake, a
finish, a redrive, a cancel) first takes a transaction-level advisory lock
on each of its keys, in one order, before it locks any row: two of them on
one key run one after the other and see each other's rows. A claim takes no
key lock: it only leases marked jobs, and the one move of a mark away from a
job a claim could take (a cancelled job redriven to its place) locks that job
first (FOR UPDATE), so a claim in flight either committed (and the redrive
sees it) or skips it.

A service enqueues inside its own transaction with ``enqueue_in`` (the
transactional outbox): on its own psycopg connection, the server's clock, the
NOTIFY delivered at the service's COMMIT.

The tables live in a schema of their own (``lease``), so a service's own
``jobs`` table cannot collide; they have the SQLite product file's columns in
its order. Versioned migrations (``lease.schema_migrations``) each run in one
transaction under an advisory lock: two hosts starting at once migrate once.

Endpoints as data (``lease.endpoints``, schema version 4): the intake fans a
message out to one delivery per subscribed endpoint; a claim of deliveries
locks the rows of the endpoints with a cap or a rate (FOR UPDATE, in name
order) before it counts their live leases and reads their buckets, so the
caps hold across every host (``endpoints``'s docstring).

Named queues (``lease.queues``): the queue ``orders`` lives in schema
``lease_orders`` of the same database, with its own migrations, NOTIFY channel
and advisory locks; its connections rewrite every statement for its schema
(``queues``), so the statements here are written once, for ``lease``.

Layout: ``schema`` (versions, migrations, connections, errors), ``statements``
(the SQL, named), ``reads`` (the observations), ``endpoints`` (the fan-out,
the claim of deliveries, the endpoints' changes and reads), ``store``
(``PostgresStore`` and ``enqueue_in``), ``listener`` (the wake-ups). Nothing
here imports the SQLite driver.
"""

from lease.postgres.listener import Listener
from lease.postgres.schema import CHANNEL, SCHEMA, SCHEMA_VERSION, redact
from lease.postgres.store import PostgresStore, enqueue_in, list_queues

__all__ = ["CHANNEL", "SCHEMA", "SCHEMA_VERSION", "Listener", "PostgresStore", "enqueue_in",
           "list_queues", "redact"]
