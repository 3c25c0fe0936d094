"""The commands that start something larger, each imported on use: the
operator's page (``ui``: ``asyncworker.ui``), the queue's metrics
(``metrics``: ``asyncworker.ui.exporter``), the benchmarks (``bench``) and
the demo's story (``demo``: ``asyncworker.cli.demo``)."""

from __future__ import annotations

import argparse
from contextlib import closing
from pathlib import Path

from asyncworker.cli.exits import EXIT_OK
from asyncworker.operations import UsageError, open_queue_store, shown
from lease.stores import is_postgres_url


def ui(args: argparse.Namespace) -> int:
    from asyncworker.service import refuse_reload_in_process
    from asyncworker.ui import serve_ui  # aiohttp only for the commands that serve

    refuse_reload_in_process()  # a service, as run and serve are: SIGHUP never ends it
    serve_ui(args)
    return EXIT_OK


def metrics(args: argparse.Namespace) -> int:
    from asyncworker.ui.exporter import serve_metrics  # aiohttp only for the commands that serve

    serve_metrics(args)
    return EXIT_OK


def bench(args: argparse.Namespace) -> int:
    from asyncworker.bench.command import run_bench

    if args.store is not None and args.store != "postgres" and not is_postgres_url(args.store):
        # refused before the SQLite table runs, not after it
        raise UsageError(f"--store must be a postgresql:// URL or 'postgres' (a server "
                         f"started for the run), got {args.store!r:.80}")
    try:
        run_bench(quick=args.quick, peers=args.peers, store=args.store, pin=args.pin,
                  endpoints=args.endpoints, full_size=args.full_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def demo(args: argparse.Namespace) -> int:
    from asyncworker.cli.demo import run_demo

    if args.keep is not None:
        keep = Path(args.keep)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise UsageError(f"--keep needs a new or empty folder: {args.keep}")
    if args.store is not None:
        _check_demo_store(args.store)
    return run_demo(jobs=args.jobs, concurrency=args.concurrency, keep=args.keep,
                    store=args.store)


def _check_demo_store(url: str) -> None:
    """--store: a PostgreSQL database whose queue is empty (created if missing)."""
    if not is_postgres_url(url):
        raise UsageError(f"--store needs a postgresql:// URL (the default is a new queue "
                         f"file): {shown(url)!r:.80}")
    with closing(open_queue_store(url, create=True)) as store:
        jobs = sum(store.counts().values())
    if jobs:
        raise UsageError(f"--store {shown(url)}: its queue holds {jobs} job(s); the demo "
                         f"needs an empty queue so it never mixes with real work (give it a "
                         f"database of its own)")
