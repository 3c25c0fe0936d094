"""``init`` and ``enqueue``: a queue made (or migrated forward) and filled,
one event or a stream of JSON lines in one transaction."""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from array import array
from collections.abc import Iterator
from contextlib import ExitStack, closing
from typing import Any, BinaryIO
from urllib.parse import quote

from asyncworker.cli.exits import EXIT_FAILED, EXIT_OK
from asyncworker.cli.output import to_stderr
from asyncworker.operations import UsageError, about, check_queue_path, open_queue_store, shown
from lease.policy import MAX_BODY_BYTES, RetryPolicy, check_product_event
from lease.records import Conflicts, NotAQueue
from lease.store import Store
from lease.stores import is_postgres_url, open_store
from lease.worker import Conflict, parse_json

# A JSON line's cap: a body's canonical text is at most MAX_BODY_BYTES, but the
# line may spell it with spaces and \u escapes (an astral character is 12 bytes
# as \ud83d\ude00, 4 as UTF-8). A longer line cannot hold a valid event.
MAX_LINE_BYTES = 4 * MAX_BODY_BYTES
PROGRESS_EVERY = 10_000  # enqueue --file: a progress line on a terminal this often
_BOM = b"\xef\xbb\xbf"


# ------------------------------------------------------------------ init


def init(args: argparse.Namespace) -> int:
    queue = args.queue
    if not is_postgres_url(queue):
        if os.path.exists(queue) and not os.path.isfile(queue):
            raise UsageError(f"not a file: {queue}")
        if not os.path.isdir(os.path.dirname(os.path.abspath(queue))):
            raise UsageError(f"folder not found: {os.path.dirname(queue)}")
    if args.shared and is_postgres_url(queue):
        raise UsageError("--shared is for a SQLite file: a PostgreSQL queue lives in its own "
                         "schema beside the service's tables already")
    if args.journal is not None and is_postgres_url(queue):
        raise UsageError("--journal is for a SQLite file: a PostgreSQL queue has the "
                         "server's write-ahead log")
    if args.journal is not None and args.shared:
        raise UsageError("--journal goes without --shared: a shared file keeps the "
                         "service's journal mode")
    before = _shared_version_before(queue) if args.shared else _version_before(queue)
    with closing(open_queue_store(queue, create=True, shared=args.shared,
                                  journal=args.journal)) as store:
        after = store.schema_version()
        mode = store.journal if store.kind == "sqlite" else None  # type: ignore[attr-defined]
        journal = "" if mode in (None, "delete") else f", journal {mode}"  # the default unsaid
    if before is None:
        print(f"created queue {shown(queue)} (schema version {after}{journal})")
    elif before < after:
        print(f"migrated queue {shown(queue)} from schema version {before} to {after}, "
              f"every row kept{journal}")
    else:
        print(f"kept existing queue {shown(queue)} (schema version {after}{journal})")
    return EXIT_OK


def _shared_version_before(queue: str) -> int | None:
    """The version of the queue in a service's file, None when it holds none yet:
    read with a read-only connection of its own (the file is the service's)."""
    if not os.path.exists(queue) or os.path.getsize(queue) == 0:
        return None
    con = sqlite3.connect(f"file:{quote(os.path.abspath(queue))}?mode=ro", uri=True)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'"
                           " AND name = 'jobs'").fetchone():
            return None
        return int(con.execute("PRAGMA user_version").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{queue}: not a SQLite file: {exc}") from None
    finally:
        con.close()


def _version_before(queue: str) -> int | None:
    """The schema version QUEUE has before init, None when there is no queue yet.
    Looking changes nothing: a file is opened unmigrated, a database read-only."""
    if not is_postgres_url(queue):
        if not os.path.exists(queue) or os.path.getsize(queue) == 0:
            return None
        with closing(open_queue_store(queue, migrate=False)) as store:
            return store.schema_version()
    try:
        with closing(open_store(queue, read_only=True)) as store:
            return store.schema_version()
    except NotAQueue:  # no queue's tables yet (or foreign ones: creating says which)
        return None


# ------------------------------------------------------------------ enqueue


def parse_event_line(raw: bytes) -> object | None:
    """One JSON line's value, strictly; None for a blank line; ValueError names the fault.

    The JSON rules are the receiver's (no duplicate keys, no NaN); what the
    value must be is the intake's rule (``check_product_event``)."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                         ) from None
    return parse_json(text) if text.strip() else None


class JsonLines:
    """The events of a JSON lines stream, read one line at a time as they are
    consumed, each line at most MAX_LINE_BYTES: /dev/zero is a line too long,
    not a memory exhausted. ``number`` is the line read last (the one a
    refusal is about); ``lines[i]`` the line of the i-th event. A UTF-8 byte
    order mark at the start is skipped (editors write one)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.number = 0
        self.lines = array("Q")  # 8 bytes an event: 1.6 MB for 200,000

    def __iter__(self) -> Iterator[object]:
        for raw in iter(lambda: self.file.readline(MAX_LINE_BYTES + 1), b""):
            self.number += 1
            if self.number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            event = parse_event_line(raw.rstrip(b"\n"))
            if event is not None:
                self.lines.append(self.number)
                yield event


def _open_source(source: str) -> BinaryIO:
    """A file, a pipe or FIFO (/dev/fd/N, mkfifo), or '-' for stdin."""
    if source == "-":
        return sys.stdin.buffer
    try:
        return open(source, "rb")
    except FileNotFoundError:
        raise UsageError(f"file not found: {source}") from None
    except IsADirectoryError:
        raise UsageError(f"not a file: {source}") from None
    except OSError as exc:  # permission denied, an unreadable device, ...
        raise UsageError(f"cannot read {source}: {exc.strerror or exc}") from None


def _single_event(args: argparse.Namespace) -> dict | None:
    """The event of --id with --qty or --body; None for --file. Usage checked."""
    single = args.id is not None or args.qty is not None or args.body is not None
    if single == (args.file is not None):
        raise UsageError("give either --id with --qty or --body, or --file")
    if not single:
        return None
    if args.id is None or (args.qty is None) == (args.body is None):
        raise UsageError("--id goes with one of --qty or --body")
    event = {"id": args.id, "qty": args.qty} if args.body is None else {
        "id": args.id, "body": args.body}
    try:  # argparse has its quirks ("--qty=--"): the event is checked again, whole
        check_product_event(event)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return event


def _keyed(events: Any, key: str | None, field: str = "key") -> Any:
    """Every event with --key (``field``: or --type), unless it carries one of its own."""
    if key is None:
        return events
    return ({**event, field: key} if isinstance(event, dict) and field not in event
            else event for event in events)


def enqueue(args: argparse.Namespace) -> int:
    event = _single_event(args)
    if args.skip_conflicts and event is not None:
        raise UsageError("--skip-conflicts goes with --file")
    policy = RetryPolicy(max_attempts=args.max_attempts, ttl_ms=args.ttl_ms)
    if not is_postgres_url(args.queue):
        check_queue_path(args.queue)  # before a FIFO is read: a missing queue fails at once
    with ExitStack() as stack:
        lines = None
        if event is None:
            source = _open_source(args.file)
            if source is not sys.stdin.buffer:
                stack.enter_context(source)
            lines = JsonLines(source)
        store = stack.enter_context(closing(open_queue_store(args.queue, migrate=False)))
        events = _keyed(_keyed([event] if lines is None else lines, args.key),
                        args.type, "type")
        # a file is all or nothing, unless asked to skip; one event is either
        on_conflict = "return" if lines is None or args.skip_conflicts else "raise"
        try:
            results = _intake(store, events, policy, args.delay_ms, lines, on_conflict)
        except Conflicts as refused:
            _report_intake(refused.results, lines, written=False)
            to_stderr(f"nothing was enqueued: {len(refused.conflicts)} conflicting of "
                 f"{len(refused.results)} events (--skip-conflicts enqueues the others)\n")
            return EXIT_FAILED
    return _report_intake(results, lines)


def _intake(store: Store, events: Any, policy: RetryPolicy, delay_ms: int,
            lines: JsonLines | None = None, on_conflict: str = "return") -> list:
    """enqueue_events, a bad line named by its number; a progress line on a terminal.
    The delay is counted from the store's clock, as the job's first moment is."""
    live = sys.stderr.isatty() and lines is not None
    try:
        now = store.now_ms()
        return store.enqueue_events(events, policy, now_ms=now,
                                    not_before_ms=now + delay_ms if delay_ms else None,
                                    on_progress=_enqueue_progress if live else None,
                                    on_conflict=on_conflict)
    except NotAQueue as exc:  # found by the intake's migration: nothing was enqueued
        raise UsageError(about(store.name, exc)) from None
    except ValueError as exc:
        where = f"line {lines.number}: " if lines is not None else ""
        raise UsageError(f"{where}{exc}; nothing was enqueued") from None
    finally:
        if live and lines is not None and lines.number >= PROGRESS_EVERY:
            to_stderr("\r\x1b[2K")  # the live line erased: the summary follows on stdout


def _enqueue_progress(done: int) -> None:
    if done % PROGRESS_EVERY == 0:
        to_stderr(f"\r\x1b[2Kenqueue: {done} events read, one transaction, nothing committed yet")


def _report_intake(results: list, lines: JsonLines | None, written: bool = True) -> int:
    """Each conflict on stderr, by line; the counts on stdout (0 new and 0
    duplicate when the intake was refused whole and nothing was written)."""
    counts = {"new": 0, "duplicate": 0, "conflicting": 0}
    for index, result in enumerate(results):
        if isinstance(result, Conflict):
            counts["conflicting"] += 1
            where = "" if lines is None else f"line {lines.lines[index]}: "
            print(f"{where}conflict: {result}", file=sys.stderr)
        elif written:
            counts["new" if result else "duplicate"] += 1
    print(", ".join(f"{n} {what}" for what, n in counts.items()))
    return EXIT_FAILED if counts["conflicting"] else EXIT_OK
