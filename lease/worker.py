"""A durable job queue on one SQLite file: leases, fencing tokens, a finite
retry budget and a dead-letter quarantine with an audited redrive.

This module is the synchronous contract. It uses the standard library only
and imports nothing from its own package, so it can be loaded as a lone file
by its path.

Work moves between states only through short ``BEGIN IMMEDIATE``
transactions; the slow part (the send) happens between two of them with no
lock held::

    enqueue -> pending --claim--> leased --finish ok--> done
                 ^  ^               |  '--finish retry--> pending
                 |  '-lease expires-'  '--permanent / budget / deadline--> dead
                 '------------ redrive (audit row, fresh budget) <-------- dead

The claim token fences the queue's own completion records. It does not stop
a stale send from reaching a receiver: the receiver's inbox, deduplicating by
ID and quantity, is what makes a duplicate send harmless.

Layout: exceptions, validators, the transaction helper, pure decisions, then
the public functions in lifecycle order. The validators, the transaction
helper and the pure decisions (rows in, decisions out) have public names: the
product's drivers (``lease.sqlite``, ``lease.postgres``) call them and run
transactions of their own. ``__all__`` lists the lab's API alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from re import Pattern
from typing import Any, NamedTuple

__all__ = [
    "LeaseError",
    "Conflict",
    "Retryable",
    "Permanent",
    "BadAck",
    "StoreError",
    "Busy",
    "NotAQueue",
    "MAX_NOW_MS",
    "Limits",
    "LAB",
    "MAX_TOKEN",
    "RETRY_BASE_MS",
    "RETRY_CAP_MS",
    "retry_delay",
    "check_jitter",
    "check_now",
    "check_second_clock",
    "check_run_args",
    "check_identifier",
    "check_job_id",
    "check_event",
    "parse_json",
    "parse_event",
    "classify_result",
    "classify_error",
    "finish_decision",
    "open_queue",
    "enqueue",
    "enqueue_many",
    "claim",
    "claim_many",
    "claim_batch",
    "extend",
    "finish",
    "finish_many",
    "finish_batch",
    "redrive",
    "redrive_many",
    "run_once",
    "run_file",
]

# ---------------------------------------------------------------------------
# Exceptions: one family, each docstring is its meaning.
# ---------------------------------------------------------------------------


class LeaseError(Exception):
    """Base of every error this queue raises on purpose (besides ValueError)."""


class Conflict(LeaseError):
    """The same job ID was enqueued before with another quantity."""


class Retryable(LeaseError):
    """The send failed in a way that may succeed later; retry with backoff."""


class Permanent(LeaseError):
    """The send was refused for good; retrying cannot help."""


class BadAck(LeaseError):
    """The send answered, but not with evidence of completion."""


class StoreError(LeaseError):
    """The store could not do what was asked; nothing of the call was written."""


class Busy(StoreError):
    """Transient: another writer holds the lock, or the connection was lost
    before anything committed. The same call may succeed after a short pause."""


class NotAQueue(StoreError, ValueError):
    """The file or database holds something other than a queue this code can
    use (foreign tables, other columns, a newer schema). Nothing was changed."""


# ---------------------------------------------------------------------------
# Limits of the contract.
# ---------------------------------------------------------------------------

MAX_NOW_MS = 10**15 - 60_000
MAX_TOKEN = 10**15
MAX_MS = 60_000
MAX_ATTEMPTS = 16
MAX_QTY = 1000
MAX_BATCH = 10_000  # most jobs one claim_many / finish_many transaction handles
RETRY_BASE_MS = 100
RETRY_CAP_MS = 1000
OUTCOMES = ("ok", "retry", "permanent")
TICKET_KEYS = frozenset({"id", "qty", "owner", "token", "attempt", "lease_until"})
EVENT_KEYS = frozenset({"id", "qty"})

# fullmatch, never match(...$): "$" lets a trailing newline through.
_IDENTIFIER = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Limits(NamedTuple):
    """The ranges a front end accepts. A limit is data: the contract's
    functions check against LAB; the product's wider policy (lease.policy)
    passes its own Limits to the very same validators and rules."""

    job_id: Pattern[str]  # what a job id may be (fullmatch)
    job_id_rule: str  # the same, in words, for the error message
    min_qty: int
    max_qty: int
    max_attempts: int
    max_ttl_ms: int
    max_lease_ms: int
    max_delay_ms: int  # a retry delay and a backoff's base and cap


LAB = Limits(_IDENTIFIER, "1-64 ASCII letters, digits, '_' or '-'", 1, MAX_QTY, MAX_ATTEMPTS,
             MAX_MS, MAX_MS, MAX_MS)

Fault = Callable[[str], object] | None
Verdict = tuple[str, int]

# ---------------------------------------------------------------------------
# Validators: each raises ValueError naming the argument, and mutates nothing.
# ---------------------------------------------------------------------------


def check_int(name: str, value: object, low: int, high: int) -> int:
    # type() is, not isinstance: bool is an int subclass and is rejected.
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


def check_identifier(name: str, value: object) -> str:
    """An owner, a note, or a lab job id: 1-64 ASCII letters, digits, '_' or '-'."""
    return check_job_id(name, value, LAB)


def check_job_id(name: str, value: object, limits: Limits = LAB) -> str:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    if not limits.job_id.fullmatch(value):
        raise ValueError(f"{name} must be {limits.job_id_rule}, got {value!r:.80}")
    return value


def _check_exact_dict(name: str, value: object, keys: frozenset) -> dict:
    if type(value) is not dict:
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    if value.keys() != keys:
        raise ValueError(
            f"{name} must have exactly the keys {sorted(keys)}, got {sorted(map(str, value))}"
        )
    return value


def check_fault(fault: object) -> None:
    if fault is not None and not callable(fault):
        raise ValueError("fault must be None or callable")


def check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise ValueError(f"{name} must be callable")


def check_connection(con: object) -> sqlite3.Connection:
    if not isinstance(con, sqlite3.Connection):
        raise ValueError(f"con must be a sqlite3.Connection, got {type(con).__name__}")
    if con.in_transaction:
        raise ValueError("con must not have an open transaction")
    return con


def check_now(value: object, name: str = "now_ms") -> int:
    """Validate a clock value: an exact int in 0..MAX_NOW_MS."""
    return check_int(name, value, 0, MAX_NOW_MS)


def check_jitter(jitter: object) -> float:
    """Validate a jitter ratio: an exact int or float, finite, in 0..1."""
    if type(jitter) not in (int, float):
        raise ValueError(f"jitter must be an int or float, got {type(jitter).__name__}")
    assert isinstance(jitter, (int, float))
    # The range check alone rejects NaN and both infinities (every comparison
    # with NaN is False), and never converts a huge int to float.
    if not 0 <= jitter <= 1:
        raise ValueError(f"jitter must be finite and in 0..1, got {jitter!r}")
    return jitter


def check_second_clock(first_ms: int, second: object) -> int:
    """Validate the clock value read after a send: valid and not behind the first."""
    second_ms = check_now(second, "second clock value")
    if second_ms < first_ms:
        raise ValueError(f"clock went backwards: {second_ms} < {first_ms}")
    return second_ms


def check_event(event: object) -> dict:
    """Validate an event: an exact dict with only an identifier id and qty 1..1000."""
    _check_exact_dict("event", event, EVENT_KEYS)
    assert isinstance(event, dict)
    check_identifier("event id", event["id"])
    check_int("event qty", event["qty"], 1, MAX_QTY)
    return event


def parse_json(data: str | bytes) -> object:
    """JSON text, strictly: UTF-8 (bytes are decoded here: json would take
    UTF-16 and a byte order mark too), no duplicate keys at any depth (a
    parser that keeps the last one would read another value than one that
    keeps the first), no NaN or Infinity. ValueError naming the problem."""
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"JSON must be str or bytes, got {type(data).__name__}")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return _STRICT_JSON.decode(text)
    except UnicodeDecodeError as exc:
        raise ValueError(f"JSON is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None


def _unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate key in JSON object: {sorted(keys)!r:.80}")
    return dict(pairs)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every call: json.loads with hooks would build a new one each time.
_STRICT_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def parse_event(data: str | bytes) -> dict:
    """An event from its JSON text: parse_json, then check_event."""
    return check_event(parse_json(data))


def check_ticket(ticket: object, limits: Limits = LAB) -> dict:
    """A ticket as claim returns it: exactly its six keys, each in range."""
    if type(ticket) is dict and ticket.keys() == TICKET_KEYS:
        # Every check below in one expression, for the common case of a good
        # ticket; any miss goes through them one by one for the error's words.
        job_id, owner, qty = ticket["id"], ticket["owner"], ticket["qty"]
        token, attempt, until = ticket["token"], ticket["attempt"], ticket["lease_until"]
        if (type(qty) is int and type(token) is int and type(attempt) is int
                and type(until) is int and type(job_id) is str and type(owner) is str
                and limits.min_qty <= qty <= limits.max_qty and 1 <= token <= MAX_TOKEN
                and 1 <= attempt <= limits.max_attempts and 1 <= until <= MAX_TOKEN
                and limits.job_id.fullmatch(job_id) and _IDENTIFIER.fullmatch(owner)):
            return ticket
    _check_exact_dict("ticket", ticket, TICKET_KEYS)
    assert isinstance(ticket, dict)
    check_job_id("ticket id", ticket["id"], limits)
    check_identifier("ticket owner", ticket["owner"])
    check_int("ticket qty", ticket["qty"], limits.min_qty, limits.max_qty)
    check_int("ticket token", ticket["token"], 1, MAX_TOKEN)
    check_int("ticket attempt", ticket["attempt"], 1, limits.max_attempts)
    check_int("ticket lease_until", ticket["lease_until"], 1, MAX_TOKEN)
    return ticket


def check_outcome(outcome: object) -> str:
    if type(outcome) is not str or outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r:.80}")
    return outcome


# ---------------------------------------------------------------------------
# The one transaction helper.
# ---------------------------------------------------------------------------


@contextmanager
def immediate(con: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT; roll back and re-raise on any exception.

    BEGIN stays outside the try: if it fails, there is nothing of ours to roll
    back. BaseException, not Exception: a KeyboardInterrupt or a cancelled
    task must not leave a transaction open on a borrowed connection.
    """
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise


def select_rows(con: sqlite3.Connection, sql: str, params: object = (),
                row_factory: Any = sqlite3.Row) -> sqlite3.Cursor:
    """A query whose rows read by column name. The factory is set on this cursor
    only: the connection a caller gets from open_queue returns plain tuples."""
    cursor = con.cursor()
    cursor.row_factory = row_factory
    return cursor.execute(sql, params)  # type: ignore[arg-type]


def select_tuples(con: sqlite3.Connection, sql: str, params: object = ()) -> sqlite3.Cursor:
    """A query whose rows are plain tuples, whatever factory the connection has."""
    return select_rows(con, sql, params, None)


def call_fault(fault: Fault, point: str) -> None:
    if fault is not None:
        fault(point)


# ---------------------------------------------------------------------------
# Pure decisions: no I/O, no clock. Both run_once and the async runtime call
# these; no rule below exists anywhere else in the project.
# ---------------------------------------------------------------------------


def retry_delay(
    attempt: int, base_ms: int, cap_ms: int, jitter: float, *, limits: Limits = LAB
) -> int:
    """floor(min(cap_ms, base_ms * 2**(attempt-1)) * jitter): cap first, then jitter."""
    check_int("attempt", attempt, 1, limits.max_attempts)
    check_int("base_ms", base_ms, 1, limits.max_delay_ms)
    check_int("cap_ms", cap_ms, base_ms, limits.max_delay_ms)
    check_jitter(jitter)
    return math.floor(min(cap_ms, base_ms * 2 ** (attempt - 1)) * jitter)


def classify_result(result: object) -> Verdict:
    """A send's return value: only an exact True is an ACK; anything else is BadAck."""
    if result is True:
        return ("ok", 0)
    raise BadAck(f"send returned {result!r:.80}, not True")


def classify_error(
    error: BaseException,
    attempt: int,
    jitter: float,
    *,
    base_ms: int = RETRY_BASE_MS,
    cap_ms: int = RETRY_CAP_MS,
    limits: Limits = LAB,
) -> Verdict | None:
    """A send's exception as (outcome, delay_ms), or None when it is not ours to classify.

    Permanent is checked first: a refusal for good is never retried. The
    backoff is the lab's (100 ms doubling to 1 s) unless a policy gives its own.
    """
    if isinstance(error, Permanent):
        return ("permanent", 0)
    if isinstance(error, Retryable):
        return ("retry", retry_delay(attempt, base_ms, cap_ms, jitter, limits=limits))
    return None


def finish_decision(
    outcome: str, attempts: int, max_attempts: int, deadline: int, now_ms: int, delay_ms: int
) -> tuple[str, str | None, int]:
    """(status, reason, available_at) of a valid finish."""
    if outcome == "ok":
        return ("done", None, now_ms)
    if outcome == "permanent":
        return ("dead", "permanent", now_ms)
    if attempts >= max_attempts:
        return ("dead", "exhausted", now_ms)
    if now_ms + delay_ms >= deadline:
        return ("dead", "deadline", now_ms)
    return ("pending", "retry", now_ms + delay_ms)


def lease_ticket(row: Mapping, owner: str, now_ms: int, lease_ms: int) -> dict:
    """The ticket of a picked row (seq, id, qty, attempts, token, deadline)
    leased to ``owner``: the next attempt and token, a lease capped by the
    deadline. Every store's claim writes these values."""
    return {
        "id": row["id"],
        "qty": row["qty"],
        "owner": owner,
        "token": row["token"] + 1,
        "attempt": row["attempts"] + 1,
        "lease_until": min(now_ms + lease_ms, row["deadline"]),
    }


def extended_until(lease_until: int, deadline: int, now_ms: int, lease_ms: int) -> int:
    """An extended lease's end: never backwards, never past the deadline."""
    return max(lease_until, min(now_ms + lease_ms, deadline))


def judge_finish(
    row: dict | None, ticket: dict, outcome: str, delay_ms: int, now_ms: int
) -> tuple[str, str | None, int] | None:
    """One fenced finish on the row of its job (the marker and budget columns,
    None when missing): (status, reason, available_at), or None for a stale
    ticket. The row is updated in place, so a later finish of the same job in
    one transaction sees it finished, as single finishes in sequence would."""
    if row is None or not marker_matches(row, ticket, now_ms):
        return None
    status, reason, available_at = finish_decision(
        outcome, row["attempts"], row["max_attempts"], row["deadline"], now_ms, delay_ms
    )
    row.update(status=status, reason=reason, available_at=available_at, owner=None,
               lease_until=None)
    return status, reason, available_at


def marker_matches(row: Mapping, ticket: dict, now_ms: int) -> bool:
    """The whole marker, and the time: an owner alone can be a stale run."""
    return (
        row["status"] == "leased"
        and row["qty"] == ticket["qty"]
        and row["owner"] == ticket["owner"]
        and row["token"] == ticket["token"]
        and row["attempts"] == ticket["attempt"]
        and row["lease_until"] == ticket["lease_until"]
        and now_ms < row["lease_until"]
        and now_ms < row["deadline"]
    )


# ---------------------------------------------------------------------------
# Storage.
# ---------------------------------------------------------------------------

CONTRACT_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token INTEGER NOT NULL,
  available_at INTEGER NOT NULL, deadline INTEGER NOT NULL,
  owner TEXT, lease_until INTEGER, reason TEXT)""",
    """CREATE TABLE IF NOT EXISTS redrives (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL)""",
    # Partial indexes, so that claim's sweep and pick read only the rows they
    # may change, however many done/dead rows pile up and however long the
    # queue is. Indexes, not table changes: the two tables stay as specified.
    """CREATE INDEX IF NOT EXISTS jobs_live ON jobs(seq)
  WHERE status IN ('pending', 'leased')""",
    """CREATE INDEX IF NOT EXISTS jobs_live_deadline ON jobs(deadline)
  WHERE status IN ('pending', 'leased')""",
    """CREATE INDEX IF NOT EXISTS jobs_leased_until ON jobs(lease_until)
  WHERE status = 'leased'""",
    # Through the API this one stays empty; a row written by other means can land here.
    """CREATE INDEX IF NOT EXISTS jobs_pending_spent ON jobs(seq)
  WHERE status = 'pending' AND attempts >= max_attempts""",
)
_INDEXES = ("jobs_live", "jobs_live_deadline", "jobs_leased_until", "jobs_pending_spent")

CONTRACT_COLUMNS = {
    "jobs": [
        "seq", "id", "qty", "status", "attempts", "max_attempts", "token",
        "available_at", "deadline", "owner", "lease_until", "reason",
    ],
    "redrives": ["seq", "id", "token", "at_ms", "note"],
}


def check_schema(con: sqlite3.Connection) -> bool:
    """True if the queue is complete, False if something is still to create;
    ValueError for a SQLite file that holds something other than a queue.

    A file the product has migrated (``PRAGMA user_version`` >= 1) keeps these
    two tables as they are, with more columns after the contract's: the
    contract's functions work on it unchanged (lease.sqlite checks the rest).
    """
    version = con.execute("PRAGMA user_version").fetchone()[0]
    present = {
        name: [col[1] for col in con.execute(f"PRAGMA table_info({name})")]
        for name in CONTRACT_COLUMNS
    }
    if not any(present.values()):
        others = con.execute(
            "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        if others:
            raise NotAQueue(f"not a queue file: it holds other tables ({others[0][0]!r}, ...)")
        return False
    for name, columns in CONTRACT_COLUMNS.items():
        have = present[name]
        if have != columns and not (version >= 1 and have[:len(columns)] == columns):
            raise NotAQueue(f"not a queue file: table {name!r} has columns {have}")
    found = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    return found.issuperset(_INDEXES)


def check_path(path: object, what: str = "path") -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fsdecode(path)
    if text in ("", ":memory:") or text.startswith("file:"):
        raise ValueError(f"{what} must name a local file, got {text!r}")
    return text


def connect_file(text: str, create: bool) -> sqlite3.Connection:
    """An autocommit connection that waits 1 s for a competing writer; with
    create=False the file must exist and is opened read-write, never created."""
    if create:
        return sqlite3.connect(text, isolation_level=None, timeout=1.0)
    uri = Path(text).resolve().as_uri() + "?mode=rw"
    try:
        return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=1.0)
    except sqlite3.OperationalError as exc:
        raise FileNotFoundError(f"queue file not found: {text}") from exc


def open_queue(path: str | os.PathLike[str], *, create: bool = True) -> sqlite3.Connection:
    """Open (creating if missing) a queue file and return its connection.

    Settings, each for a reason: autocommit (isolation_level=None) so every
    transaction is one we opened; timeout=1 s so a competing writer waits a
    little, then we fail fast; the rollback journal (DELETE) and
    synchronous=FULL so a COMMIT is on disk before it returns. The tables are
    created only if missing, in one transaction; existing rows are kept.
    With create=False the file must already exist: it is opened read-write,
    never created.
    """
    return open_file(check_path(path), create, "DELETE")


def open_file(text: str, create: bool, journal: str | None) -> sqlite3.Connection:
    """``open_queue`` with the journal mode to set (the contract's DELETE), or
    None to keep the file's own (a product file made WAL keeps it)."""
    con = connect_file(text, create)
    try:
        if journal is not None:
            mode = con.execute(f"PRAGMA journal_mode={journal}").fetchone()[0]
            if mode != journal.lower():
                raise sqlite3.OperationalError(
                    f"could not set journal_mode={journal} (got {mode})")
        con.execute("PRAGMA synchronous=FULL")
        # A queue that is already complete needs no write lock to open: another
        # process may be writing it right now.
        if not check_schema(con):
            with immediate(con):
                check_schema(con)
                for statement in CONTRACT_SCHEMA:
                    con.execute(statement)
    except BaseException:
        con.close()
        raise
    return con


def enqueue(
    con: sqlite3.Connection,
    event: dict,
    now_ms: int,
    ttl_ms: int,
    max_attempts: int = 3,
    fault: Fault = None,
) -> bool:
    """Add a pending job; True if new, False for the same id and qty (row kept whole).

    Another qty for a known id raises Conflict. A duplicate intake never
    resets the budget: the existing row is left exactly as it is.
    """
    check_connection(con)
    check_event(event)
    check_now(now_ms)
    check_int("ttl_ms", ttl_ms, 1, MAX_MS)
    check_int("max_attempts", max_attempts, 1, MAX_ATTEMPTS)
    check_fault(fault)
    with immediate(con):
        if not _insert_new(con, event, now_ms, ttl_ms, max_attempts):
            return False
        call_fault(fault, "after-enqueue")
    call_fault(fault, "after-commit")
    return True


def _insert_new(
    con: sqlite3.Connection, event: dict, now_ms: int, ttl_ms: int, max_attempts: int
) -> bool:
    """Inside a transaction: insert a new pending job (True), keep a duplicate (False)."""
    job_id, qty = event["id"], event["qty"]
    row = con.execute("SELECT qty FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is not None:
        if row[0] != qty:
            raise Conflict(f"job {job_id!r} exists with qty {row[0]}, not {qty}")
        return False
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
        " available_at, deadline, owner, lease_until, reason)"
        " VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL)",
        (job_id, qty, max_attempts, now_ms, now_ms + ttl_ms),
    )
    return True


def enqueue_many(
    con: sqlite3.Connection,
    events: list,
    now_ms: int,
    ttl_ms: int,
    max_attempts: int = 3,
) -> list:
    """Many enqueues in one transaction: one COMMIT instead of one per event.

    Every event is checked first (a ValueError changes nothing). The result
    is what the single calls in sequence would give at the same now_ms, per
    event: True (new), False (duplicate, row kept whole), or the Conflict
    instance that enqueue would have raised; a conflict does not stop the
    others. The input list and its dicts are not changed.
    """
    check_connection(con)
    if type(events) is not list:
        raise ValueError(f"events must be a list, got {type(events).__name__}")
    for event in events:
        check_event(event)
    check_now(now_ms)
    check_int("ttl_ms", ttl_ms, 1, MAX_MS)
    check_int("max_attempts", max_attempts, 1, MAX_ATTEMPTS)
    results: list = []
    with immediate(con):
        for event in events:
            try:
                results.append(_insert_new(con, event, now_ms, ttl_ms, max_attempts))
            except Conflict as conflict:
                results.append(conflict)
    return results


# The quarantine of the contract, in three statements that each read only
# their candidates through an index. The first runs first: a missed deadline
# is the reason even when the budget is spent too.
QUARANTINE = (
    ("deadline", """UPDATE jobs SET status = 'dead', reason = 'deadline', owner = NULL,
  lease_until = NULL
WHERE status IN ('pending', 'leased') AND deadline <= :now
  AND (status = 'pending' OR lease_until <= :now)"""),
    ("exhausted", """UPDATE jobs SET status = 'dead', reason = 'exhausted', owner = NULL,
  lease_until = NULL
WHERE status = 'leased' AND lease_until <= :now AND attempts >= max_attempts"""),
    ("exhausted", """UPDATE jobs SET status = 'dead', reason = 'exhausted', owner = NULL,
  lease_until = NULL
WHERE status = 'pending' AND attempts >= max_attempts"""),
)

# What a lease (_lease_rows) reads of a picked row.
PICK_NAMES = ("seq", "id", "qty", "attempts", "token", "deadline")
PICK = f"""
SELECT {', '.join(PICK_NAMES)} FROM jobs
WHERE status IN ('pending', 'leased')
  AND ((status = 'pending' AND available_at <= :now)
    OR (status = 'leased' AND lease_until <= :now))
ORDER BY seq LIMIT :limit
"""


# Whether any of the quarantine's statements has a candidate: one statement of
# three index probes, so that a claim with nothing to move runs no UPDATE.
QUARANTINE_DUE = "SELECT " + " OR ".join(
    f"EXISTS (SELECT 1 FROM jobs WHERE {statement.split('WHERE', 1)[1]})"
    for _, statement in QUARANTINE)


def quarantine(con: sqlite3.Connection, now_ms: int) -> dict:
    """Inside a transaction: the contract's quarantine; the rows moved, by reason."""
    moved = {"deadline": 0, "exhausted": 0}
    if not select_tuples(con, QUARANTINE_DUE, {"now": now_ms}).fetchone()[0]:
        return moved  # none has a candidate, and a statement moving nothing changes none's
    for reason, statement in QUARANTINE:
        moved[reason] += con.execute(statement, {"now": now_ms}).rowcount
    return moved


def _lease_rows(con: sqlite3.Connection, rows: list, owner: str, now_ms: int,
                lease_ms: int) -> list:
    """Inside a transaction: lease the picked rows (mappings) to owner; their
    tickets, in order."""
    tickets = [lease_ticket(row, owner, now_ms, lease_ms) for row in rows]
    con.executemany(
        "UPDATE jobs SET status = 'leased', reason = NULL, attempts = ?, token = ?, owner = ?,"
        " lease_until = ? WHERE seq = ?",
        [(t["attempt"], t["token"], owner, t["lease_until"], row["seq"])
         for row, t in zip(rows, tickets, strict=True)])
    return tickets


def claim(
    con: sqlite3.Connection,
    owner: str,
    now_ms: int,
    lease_ms: int = 1000,
    fault: Fault = None,
) -> dict | None:
    """Lease the oldest available job to owner, or None.

    First, in the same transaction, move pending and expired-leased rows past
    their deadline or budget to dead; that move is committed even when no job
    is handed out. A live lease (lease_until > now_ms) is never touched.
    Hooks: fault("after-claim") after the update, fault("after-commit") after
    COMMIT, neither when None is returned. This is claim_many with a limit of 1.
    """
    tickets = claim_many(con, owner, now_ms, lease_ms, 1, fault)
    return tickets[0] if tickets else None


def claim_many(
    con: sqlite3.Connection,
    owner: str,
    now_ms: int,
    lease_ms: int = 1000,
    limit: int = 1,
    fault: Fault = None,
) -> list:
    """Up to ``limit`` tickets in one transaction: the same rows and tickets as
    ``limit`` claim calls in sequence at the same now_ms (stopping at the
    first None). The quarantine moves are committed even when the list is
    empty; the hooks run only when something was leased.
    """
    tickets, _ = claim_batch(con, owner, now_ms, lease_ms, limit, fault)
    return tickets


def claim_batch(
    con: sqlite3.Connection,
    owner: str,
    now_ms: int,
    lease_ms: int = 1000,
    limit: int = 1,
    fault: Fault = None,
) -> tuple[list, dict]:
    """claim_many, and what its quarantine moved: ``(tickets, {"deadline": n,
    "exhausted": m})``, so a dispatcher can count every job that ended in its
    run, the ones its claims moved to dead included."""
    check_connection(con)
    check_identifier("owner", owner)
    check_now(now_ms)
    check_int("lease_ms", lease_ms, 1, MAX_MS)
    check_int("limit", limit, 1, MAX_BATCH)
    check_fault(fault)
    return _claim_tx(con, owner, now_ms, lease_ms, limit, fault)


def _claim_tx(
    con: sqlite3.Connection, owner: str, now_ms: int, lease_ms: int, limit: int, fault: Fault
) -> tuple[list, dict]:
    """The claim transaction, arguments already checked: (tickets, quarantine moves)."""
    with immediate(con):
        moved = quarantine(con, now_ms)
        picked = [dict(zip(PICK_NAMES, row, strict=True))
                  for row in select_tuples(con, PICK, {"now": now_ms, "limit": limit})]
        tickets = _lease_rows(con, picked, owner, now_ms, lease_ms)
        if tickets:
            call_fault(fault, "after-claim")
    if tickets:
        call_fault(fault, "after-commit")
    return tickets, moved


def _load_marked(con: sqlite3.Connection, ticket: dict, now_ms: int) -> sqlite3.Row | None:
    row = select_rows(con, "SELECT * FROM jobs WHERE id = ?", (ticket["id"],)).fetchone()
    if row is None or not marker_matches(row, ticket, now_ms):
        return None
    return row


def extend(
    con: sqlite3.Connection,
    ticket: dict,
    now_ms: int,
    lease_ms: int,
    fault: Fault = None,
) -> dict | bool:
    """Push a live lease forward: the new ticket, or False for a stale marker.

    The same whole-marker check as finish; the token stays; the new
    lease_until is min(now_ms + lease_ms, deadline) and never moves backwards.
    """
    check_connection(con)
    check_ticket(ticket)
    check_now(now_ms)
    check_int("lease_ms", lease_ms, 1, MAX_MS)
    check_fault(fault)
    return _extend_tx(con, ticket, now_ms, lease_ms, fault)


def _extend_tx(
    con: sqlite3.Connection, ticket: dict, now_ms: int, lease_ms: int, fault: Fault
) -> dict | bool:
    """The extension transaction, arguments already checked."""
    with immediate(con):
        row = _load_marked(con, ticket, now_ms)
        if row is None:
            return False
        lease_until = extended_until(row["lease_until"], row["deadline"], now_ms, lease_ms)
        con.execute("UPDATE jobs SET lease_until = ? WHERE seq = ?", (lease_until, row["seq"]))
        call_fault(fault, "after-extend")
    call_fault(fault, "after-commit")
    return {**ticket, "lease_until": lease_until}


def finish(
    con: sqlite3.Connection,
    ticket: dict,
    outcome: str,
    now_ms: int,
    delay_ms: int = 0,
    fault: Fault = None,
) -> str | bool:
    """Record a send's outcome for a live lease: the new status, or False if stale.

    False, changing nothing, when the job is missing or not leased, when any
    field of the marker differs, or when now_ms has reached lease_until or
    the deadline: a late result never overwrites the current work. Hooks:
    fault("after-finish") after the update, fault("after-commit") after
    COMMIT, neither when False is returned. This is finish_many of one item.
    """
    [status] = finish_many(con, [(ticket, outcome, delay_ms)], now_ms, fault)
    return status


def finish_many(
    con: sqlite3.Connection,
    items: list,
    now_ms: int,
    fault: Fault = None,
) -> list:
    """Many finishes in one transaction: ``items`` is a list of
    (ticket, outcome, delay_ms); the result per item is what finish would
    return, called in sequence at the same now_ms (a ticket given twice is
    False the second time). Every item is checked before anything changes.
    """
    return [found and found[0] for found in finish_batch(con, items, now_ms, fault)]


def finish_batch(
    con: sqlite3.Connection,
    items: list,
    now_ms: int,
    fault: Fault = None,
) -> list:
    """finish_many, with the reason of each: per item ``(status, reason)``
    (reason None for done, "retry" for pending, the cause for dead), or False
    for a stale ticket. A dispatcher counts its dead by reason from this."""
    check_connection(con)
    if type(items) is not list or len(items) > MAX_BATCH:
        raise ValueError(f"items must be a list of at most {MAX_BATCH}")
    for item in items:
        if type(item) is not tuple or len(item) != 3:
            raise ValueError("each item must be a tuple (ticket, outcome, delay_ms)")
        check_ticket(item[0])
        check_outcome(item[1])
        check_int("delay_ms", item[2], 0, MAX_MS)
    check_now(now_ms)
    check_fault(fault)
    return _finish_tx(con, items, now_ms, fault)


def _finish_tx(con: sqlite3.Connection, items: list, now_ms: int, fault: Fault) -> list:
    """The finish transaction, arguments already checked."""
    with immediate(con):
        results = _finish_marked(con, items, now_ms) if items else []
        changed = any(results)
        if changed:
            call_fault(fault, "after-finish")
    if changed:
        call_fault(fault, "after-commit")
    return results


def _finish_marked(con: sqlite3.Connection, items: list, now_ms: int) -> list:
    """Inside a transaction: the fenced finish of each (ticket, outcome, delay_ms),
    in order, as single finishes in sequence would do it (a job finished earlier
    in the list is no longer leased for a later item). Per item (status,
    reason) or False."""
    ids = sorted({ticket["id"] for ticket, _, _ in items})
    found = select_tuples(
        con, f"SELECT {MARKED} FROM jobs WHERE id IN ({', '.join('?' * len(ids))})", ids)
    rows = {row[1]: dict(zip(MARKED_NAMES, row, strict=True)) for row in found}  # [1]: id
    results, updates, _ = judge_rows(rows, items, now_ms)
    con.executemany("UPDATE jobs SET owner = NULL, lease_until = NULL, status = ?, reason = ?,"
                    " available_at = ? WHERE seq = ?", updates)
    return results


def judge_rows(rows: Mapping[str, dict], items: list, now_ms: int) -> tuple[list, list, list]:
    """The fenced finish of each (ticket, outcome, delay_ms) on the rows read
    by id, in order, as single finishes in sequence would judge them. Per item
    (status, reason) or False; the rows' updates (status, reason,
    available_at, seq); per item the row's seq (None when False)."""
    results: list = []
    updates: list = []
    seqs: list = []
    for ticket, outcome, delay_ms in items:
        row = rows.get(ticket["id"])
        judged = judge_finish(row, ticket, outcome, delay_ms, now_ms)
        if judged is None or row is None:
            results.append(False)
            seqs.append(None)
            continue
        updates.append((*judged, row["seq"]))
        results.append(judged[:2])
        seqs.append(row["seq"])
    return results, updates, seqs


# What a finish reads of a row: the marker and the budget, never a payload.
MARKED = "seq, id, qty, status, attempts, max_attempts, token, deadline, owner, lease_until"
MARKED_NAMES = tuple(MARKED.split(", "))


def redrive(
    con: sqlite3.Connection,
    job_id: str,
    now_ms: int,
    ttl_ms: int,
    note: str,
    fault: Fault = None,
) -> bool:
    """Release a dead job with a fresh budget, and its audit row, together.

    The token is kept, so a ticket from before the quarantine stays stale.
    A missing or not-dead job is a ValueError. This is redrive_many of one.
    """
    check_identifier("job_id", job_id)
    [result] = redrive_many(con, [job_id], now_ms, ttl_ms, note, fault)
    if isinstance(result, ValueError):
        raise result
    return True


def redrive_many(
    con: sqlite3.Connection,
    job_ids: list,
    now_ms: int,
    ttl_ms: int,
    note: str,
    fault: Fault = None,
) -> list:
    """Many redrives in one transaction, each job atomic with its audit row.

    The result per id is True, or the ValueError that redrive would have
    raised (missing, or not dead: an id given twice is no longer dead the
    second time); a refusal does not stop the others. Hooks, only when
    something was redriven: fault("after-audit") after the audit rows,
    fault("after-redrive") after the releases, fault("after-commit").
    """
    check_connection(con)
    if type(job_ids) is not list or len(job_ids) > MAX_BATCH:
        raise ValueError(f"job_ids must be a list of at most {MAX_BATCH}")
    for job_id in job_ids:
        check_identifier("job_id", job_id)
    check_now(now_ms)
    check_int("ttl_ms", ttl_ms, 1, MAX_MS)
    check_identifier("note", note)
    check_fault(fault)
    return _redrive_tx(con, job_ids, now_ms, ttl_ms, note, fault)


def _redrive_tx(
    con: sqlite3.Connection, job_ids: list, now_ms: int, ttl_ms: int, note: str, fault: Fault
) -> list:
    """The redrive transaction, arguments already checked."""
    with immediate(con):
        unique = sorted(set(job_ids))
        marks = ", ".join("?" * len(unique))
        sql = f"SELECT seq, id, status, token FROM jobs WHERE id IN ({marks})"
        rows = {row["id"]: row for row in select_rows(con, sql, unique)} if unique else {}
        results, audits, releases = redrive_decisions(rows, job_ids)
        if audits:
            con.executemany(
                "INSERT INTO redrives (id, token, at_ms, note) VALUES (?, ?, ?, ?)",
                [(job_id, token, now_ms, note) for job_id, token in audits],
            )
            call_fault(fault, "after-audit")
            con.executemany(
                "UPDATE jobs SET status = 'pending', attempts = 0, available_at = ?,"
                " deadline = ?, owner = NULL, lease_until = NULL, reason = NULL WHERE seq = ?",
                [(now_ms, now_ms + ttl_ms, seq) for seq in releases],
            )
            call_fault(fault, "after-redrive")
    if audits:
        call_fault(fault, "after-commit")
    return results


def redrive_decisions(rows: Mapping[str, Mapping], job_ids: list) -> tuple[list, list, list]:
    """Pure: given the rows of the ids (id -> row with seq, id, status, token;
    a missing id has none), per id True or its ValueError, in order; the audit
    rows (id, token) and the seqs to release. Every store calls this."""
    released: set = set()
    results: list = []
    audits, releases = [], []
    for job_id in job_ids:
        row = rows.get(job_id)
        if row is None:
            results.append(ValueError(f"job {job_id!r} does not exist"))
        elif row["status"] != "dead" or job_id in released:
            status = "pending" if job_id in released else row["status"]
            results.append(ValueError(f"job {job_id!r} is {status}, not dead"))
        else:
            released.add(job_id)
            audits.append((job_id, row["token"]))
            releases.append(row["seq"])
            results.append(True)
    return results, audits, releases


# ---------------------------------------------------------------------------
# One claim-send-finish cycle.
# ---------------------------------------------------------------------------


def check_run_args(
    owner: object, clock: object, send: object, jitter: object, lease_ms: object
) -> None:
    """run_once's arguments, jitter first (before the clock is ever read)."""
    check_jitter(jitter)  # first, before the clock is read
    check_identifier("owner", owner)
    check_int("lease_ms", lease_ms, 1, MAX_MS)
    check_callable("clock", clock)
    check_callable("send", send)


# The steps every run_once of the family shares: this one (the contract),
# asyncworker.run_once (the contract on an event loop) and
# lease.stores.run_store_once (any store, the product's policy and evidence).


def lab_event(ticket: dict) -> dict:
    """What a lab send gets: a fresh {"id", "qty"}, never the ticket itself."""
    return {"id": ticket["id"], "qty": ticket["qty"]}


def lab_verdict(error: BaseException, attempt: int, jitter: float) -> Verdict:
    """A lab send's exception as its verdict; any other error propagates."""
    classified = classify_error(error, attempt, jitter)
    if classified is None:
        raise error
    return classified


def cycle_result(ticket: dict, status: object) -> dict:
    """One cycle's answer: {"id", "token", "status"}, "stale" for a refused finish."""
    return {"id": ticket["id"], "token": ticket["token"], "status": status or "stale"}


def run_once(
    con: sqlite3.Connection,
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
) -> dict | None:
    """Claim one job, send it with no transaction open, finish it.

    Returns None when there is no work, else {"id", "token", "status"} where
    status is the finish result or "stale". Retryable and Permanent become a
    retry (with retry_delay(attempt, 100, 1000, jitter)) or a permanent
    finish; BadAck and every other error propagate with the job left leased,
    for its lease expiry and budget to recover.
    """
    check_run_args(owner, clock, send, jitter, lease_ms)
    check_connection(con)
    first_ms = check_now(clock(), "clock value")
    ticket = claim(con, owner, first_ms, lease_ms)
    if ticket is None:
        return None
    # send gets its own copy: whatever it does to it, the marker stays ours.
    try:
        verdict = classify_result(send(lab_event(ticket)))
    except BaseException as error:
        verdict = lab_verdict(error, ticket["attempt"], jitter)
    second_ms = check_second_clock(first_ms, clock())
    outcome, delay_ms = verdict
    status = finish(con, ticket, outcome, second_ms, delay_ms)
    return cycle_result(ticket, status)


def run_file(
    path: str | os.PathLike[str],
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict], object],
    jitter: float,
    lease_ms: int = 1000,
) -> dict | None:
    """run_once on an existing queue file, with a connection owned and always closed.

    A missing file (or anything that is not a regular file) is
    FileNotFoundError; no empty queue is ever created in its place.
    """
    text = check_path(path)
    if not os.path.isfile(text):
        raise FileNotFoundError(f"queue file not found: {text}")
    check_run_args(owner, clock, send, jitter, lease_ms)
    con = open_queue(text, create=False)
    try:
        return run_once(con, owner, clock, send, jitter, lease_ms)
    finally:
        con.close()
