"""``stats``, ``dead`` and ``inspect``: the queue looked at, opened read-only,
nothing written (not even a migration)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import closing

from asyncworker.cli.endpoints import circuit_lines, endpoint_stats_rows
from asyncworker.cli.exits import EXIT_OK
from asyncworker.cli.output import cell, event_cell, print_history, print_table, stats_rows
from asyncworker.operations import (
    WorkFailed,
    dead_filters,
    dead_matching,
    endpoint_figures,
    neighbour_queues,
    open_queue_store,
    paused_words,
    reached,
    receiver_stats,
    shown,
    when,
)


def stats(args: argparse.Namespace) -> int:
    reached(args, "--receiver", args.receiver)  # checked before the queue is opened
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        snap = store.snapshot()  # at the store's clock: a database's is its server's
        endpoints = endpoint_figures(store)
        if snap.get("blocked_keys"):  # named, each with its dead head
            snap["blocked_heads"] = store.blocked_heads(BLOCKED_SHOWN)
        paused = store.paused()
        at_work = store.workers()
    queues = neighbour_queues(getattr(args, "queues_of", args.queue))
    if queues is not None:  # a queue alone in its database shows what it always did
        snap["queues"] = queues
    if at_work:  # a queue no dispatcher claimed from shows what it always did
        snap["workers"] = at_work
    if paused is not None:  # a queue that runs shows what it always did
        snap["paused"] = paused
    if endpoints:  # a queue without endpoints shows what it always did
        snap["endpoints"] = endpoints
    if args.receiver:
        try:
            snap["receiver"] = receiver_stats(args.receiver, args.ca_file,
                                              args.insecure_plain_http)
        except OSError as exc:
            raise WorkFailed(f"receiver at {args.receiver} did not answer: {exc}") from None
        except ValueError as exc:  # another server on that port, say
            raise WorkFailed(f"receiver at {args.receiver} answered no stats: {exc}") from None
    if args.json:
        print(json.dumps(snap, indent=2, sort_keys=True))
        return EXIT_OK
    if paused is not None:
        print(paused_words(paused) + ": dispatchers lease nothing until resumed")
    print_table(stats_rows(snap))
    if snap.get("blocked_heads"):
        print()
        print_table(blocked_rows(snap["blocked_heads"]))
        more = snap["blocked_keys"] - len(snap["blocked_heads"])
        if more > 0:
            print(f"and {more} more blocked keys (the first {BLOCKED_SHOWN} by key shown)")
    if at_work:
        print()
        print_table(worker_rows(at_work))
    if endpoints:
        print()
        print_table(endpoint_stats_rows(endpoints))
        for line in circuit_lines(endpoints):
            print(line)
    return EXIT_OK


BLOCKED_SHOWN = 100  # blocked keys stats names, each with its dead head


def worker_rows(at_work: list[dict]) -> list[tuple]:
    """The dispatchers at work as a table: owner, host, pid, live leases, last claim."""
    return [("dispatcher", "host", "pid", "live leases", "last claim", "leased"),
            *((row["owner"], cell(row["host"]), cell(row["pid"]), row["live_leases"],
               when(row["last_claim_ms"]), row["last_claimed"]) for row in at_work)]


def blocked_rows(heads: list[dict]) -> list[tuple]:
    """The blocked keys as a table: key, endpoint, dead head, why, how many wait."""
    return [("blocked key", "endpoint", "dead first job", "reason", "waiting"),
            *((head["key"], head.get("endpoint") or "-", head["id"], head["reason"],
               head["waiting"]) for head in heads)]


_JOB_COLUMNS = ("id", "qty", "status", "reason", "attempts", "max_attempts", "token")


def dead(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        jobs = dead_matching(store, limit=args.limit, **dead_filters(args, store))
    if args.json:  # every column of each row, as stored (a key and a last error included)
        print(json.dumps(jobs, indent=2, ensure_ascii=False))
    elif jobs:
        has = jobs[0].keys()
        deliveries = any(j.get("endpoint") is not None for j in jobs)
        columns = (_JOB_COLUMNS[:1] + (("endpoint",) if deliveries else ())
                   + (("key",) if "ordering_key" in has else ())
                   + _JOB_COLUMNS[1:] + (("last_error",) if "last_error" in has else ()))
        print_table([columns] + [
            tuple(event_cell(j) if c == "qty" else cell(j.get("ordering_key" if c == "key"
                                                              else c)) for c in columns)
            for j in jobs])
    sys.stdout.flush()  # the table first, then its count, in a terminal too
    print(f"{len(jobs)} dead", file=sys.stderr)
    return EXIT_OK


def inspect(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        history = store.job_history(args.id)
    if history is None:
        raise WorkFailed(f"no job {args.id!r} in {shown(args.queue)}")
    if args.json:
        print(json.dumps(history, indent=2, ensure_ascii=False))
    else:
        print_history(history)
    return EXIT_OK
