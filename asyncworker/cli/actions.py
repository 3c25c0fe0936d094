"""The operator's changes: ``redrive`` and ``cancel`` (by id, or in bulk by
reason, each with a note and an audit row), ``pause`` and ``resume`` (the
queue's claims, audited), ``prune`` and ``prune-inbox``."""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from contextlib import closing

from asyncworker.cli.exits import EXIT_FAILED, EXIT_OK
from asyncworker.cli.output import print_bounded, print_outcome
from asyncworker.operations import (
    UsageError,
    WorkFailed,
    about,
    apply_in_chunks,
    dead_filters,
    dead_matching,
    open_queue_store,
    paused_words,
    when,
)
from lease.clock import wall_clock_ms
from lease.records import StoreError
from lease.store import Store
from lease.worker import MAX_BATCH

# ------------------------------------------------------------------ redrive, cancel


def _bulk_ids(args: argparse.Namespace, store: Store, ids: list[str]) -> list[str]:
    """The ids given, or every dead job of --reason (narrowed by --key, --error,
    --http-status, --since and --until, at most --limit), in the store's order."""
    if ids:
        return ids
    return [job["id"] for job in dead_matching(store, limit=args.limit,
                                               **dead_filters(args, store))]


_NARROWERS = ("key", "error", "http_status", "since", "until")


def _check_bulk(args: argparse.Namespace, ids: list[str]) -> None:
    what = "a job ID" if args.command == "redrive" else "job IDs"
    narrowed = [name for name in _NARROWERS if getattr(args, name) is not None]
    if narrowed and args.reason is None:
        # they narrow the dead jobs a bulk picks: a job named by its id is that job
        flags = ", ".join("--" + name.replace("_", "-") for name in narrowed)
        raise UsageError(f"{flags} go{'es' if len(narrowed) == 1 else ''} with --reason: "
                         f"they narrow a bulk {args.command} of dead jobs (a job given by "
                         "ID is that job, whatever its key, error or time)")
    if bool(ids) == (args.reason is not None):
        raise UsageError(f"give either {what} or --reason")
    if ids and (args.limit is not None or args.dry_run):
        raise UsageError("--limit and --dry-run go with --reason")


def redrive(args: argparse.Namespace) -> int:
    ids = [] if args.id is None else [args.id]
    _check_bulk(args, ids)
    if args.dry_run:
        return _dry_run(args, "redrive")

    with closing(open_queue_store(args.queue)) as store:
        results = apply_in_chunks(
            _bulk_ids(args, store, ids),
            lambda chunk: store.redrive_jobs(chunk, args.ttl_ms, args.note), "redriven")
    done = [f"redrove {job_id}" for job_id, answer in results if answer is True]
    refused = [f"not redriven: {answer}" for _, answer in results if answer is not True]
    print_outcome(done, refused, args.verbose, "redriven")
    return EXIT_FAILED if refused else EXIT_OK


def _dry_run(args: argparse.Namespace, verb: str) -> int:
    """The dead jobs of --reason (and --key), listed from a read-only look: nothing
    changes, not even a migration."""
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        ids = _bulk_ids(args, store, [])
    print_bounded([f"would {verb} {job_id}" for job_id in ids], args.verbose, sys.stdout)
    print(f"{len(ids)} to {verb} (dry run, nothing changed)")
    return EXIT_OK


def cancel(args: argparse.Namespace) -> int:
    _check_bulk(args, args.ids)
    if args.reason == "cancelled":
        raise UsageError("--reason cancelled: those jobs are cancelled already")
    if args.dry_run:
        return _dry_run(args, "cancel")

    with closing(open_queue_store(args.queue)) as store:
        results = apply_in_chunks(_bulk_ids(args, store, args.ids),
                                  lambda chunk: store.cancel_jobs(chunk, args.note),
                                  "cancelled")
    done = [f"cancelled {job_id}" for job_id, answer in results if answer is True]
    refused = [f"not cancelled: {answer}" for _, answer in results if answer is not True]
    print_outcome(done, refused, args.verbose, "cancelled")
    return EXIT_FAILED if refused else EXIT_OK


# ------------------------------------------------------------------ pause, resume


def pause(args: argparse.Namespace) -> int:
    """Pause the queue: every claim, on every host, leases nothing until resumed."""
    with closing(open_queue_store(args.queue)) as store:
        changed = store.pause(args.note, actor=args.actor)
        state = store.paused()
    if not changed:
        print(f"already {paused_words(state)}: nothing changed")
        return EXIT_OK
    print(f"{paused_words(state)}: dispatchers lease nothing until resumed "
          "(their leases in flight finish)")
    return EXIT_OK


def resume(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue)) as store:
        changed = store.resume(args.note, actor=args.actor)
    print("resumed: dispatchers claim again" if changed else "not paused: nothing changed")
    return EXIT_OK


# ------------------------------------------------------------------ prune, prune-inbox


def prune(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue)) as store:
        cutoff = max(0, store.now_ms() - args.older_than)  # the store's clock judges its jobs
        pruned = 0
        while True:  # short transactions: a running dispatcher waits for none for long
            try:
                count = store.prune_done(cutoff, MAX_BATCH)
            except StoreError as exc:
                raise WorkFailed(f"{about(args.queue, exc)}; {pruned} pruned before it, the "
                                 "rest untouched") from None
            if not count:
                break
            pruned += count
    print(f"{pruned} done jobs pruned (finished before {when(cutoff)})")
    return EXIT_OK


def prune_inbox(args: argparse.Namespace) -> int:
    if not os.path.exists(args.inbox):
        raise UsageError(f"inbox file not found: {args.inbox}")
    if not os.path.isfile(args.inbox):
        raise UsageError(f"not a file: {args.inbox}")
    from asyncworker.receiving import inbox

    now = wall_clock_ms()
    try:
        pruned = inbox.prune_inbox(args.inbox, min(args.older_than, now), now_ms=now)
    except sqlite3.OperationalError:  # locked, read-only, I/O: the work failed, exit 1
        raise
    except (ValueError, sqlite3.DatabaseError) as exc:  # not an inbox: usage, exit 2
        raise UsageError(f"{args.inbox}: {exc}") from None
    print(f"{pruned} inbox rows pruned (first seen before "
          f"{when(max(0, now - args.older_than))})")
    return EXIT_OK
