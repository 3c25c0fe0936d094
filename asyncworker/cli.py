"""The ``asyncworker`` command line (also ``python -m asyncworker``).

Exit codes: 0 ok, 1 the work failed, 2 bad usage or a missing file (a
one-line error, no traceback, nothing created or changed). Every argument is
checked before a file is opened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sqlite3
import sys
import time
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence, TextIO

from lease import observe
from lease.http import check_url
from lease.worker import (
    MAX_ATTEMPTS,
    MAX_MS,
    MAX_QTY,
    Conflict,
    check_event,
    check_identifier,
    enqueue_many,
    open_queue,
    redrive,
)

if TYPE_CHECKING:  # aiohttp is imported only by the commands that use it: a faster CLI
    from asyncworker.dispatcher import Dispatcher, DispatcherStats

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class UsageError(Exception):
    """Bad usage or a missing file: one line on stderr, exit code 2."""


class WorkFailed(Exception):
    """The command ran but its work failed: one line on stderr, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# ------------------------------------------------------------------ argument types


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"-?[0-9]+", text):
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {text}")
    return value


def _identifier(text: str) -> str:
    try:
        return check_identifier("value", text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 1-64 ASCII letters, digits, '_' or '-': {text!r}") from None


def _url(text: str) -> str:
    try:
        check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _default_owner() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


# ------------------------------------------------------------------ the parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="asyncworker",
                    description="A durable job dispatcher on one SQLite file.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=Parser)

    def command(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]
                ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    p = command("init", "create a queue file", _init)
    p.add_argument("queue", help="queue file to create (an existing queue is kept as it is)")

    p = command("enqueue", "add jobs: one with --id/--qty, or JSON lines with --file", _enqueue)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--id", metavar="ID", type=_identifier, help="job id")
    p.add_argument("--qty", metavar="N", type=_int_in(1, MAX_QTY), help="quantity, 1..1000")
    p.add_argument("--file", help="JSON lines {\"id\", \"qty\"}; '-' reads standard input")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, MAX_MS), default=60_000,
                   help="time to live from now (default 60000)")
    p.add_argument("--max-attempts", metavar="N", type=_int_in(1, MAX_ATTEMPTS), default=3,
                   help="attempt budget (default 3)")

    p = command("run", "dispatch jobs to a receiver with the async dispatcher", _run)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--url", metavar="URL", type=_url, required=True, help="receiver URL, http://127.0.0.1:PORT/events")
    p.add_argument("--concurrency", metavar="N", type=_int_in(1, 10_000), default=16,
                   help="sends in flight (default 16)")
    p.add_argument("--lease-ms", metavar="MS", type=_int_in(1, MAX_MS), default=30_000,
                   help="lease per claim (default 30000)")
    p.add_argument("--owner", metavar="NAME", type=_identifier, default=None,
                   help="this dispatcher's name (default HOST-PID)")
    p.add_argument("--until-idle", action="store_true",
                   help="stop once every job is done or dead")
    p.add_argument("--batch-size", metavar="N", type=_int_in(1, 10_000), default=64,
                   help="most jobs per claim or finish transaction (default 64; 1: one each)")
    p.add_argument("--poll-ms", metavar="MS", type=_int_in(1, 60_000), default=50,
                   help="how long an idle dispatcher waits before looking again (default 50)")
    p.add_argument("--crash-after-acks", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="failure drill: die by SIGKILL right after the N-th ACK, before "
                        "recording it")

    p = command("serve", "run the receiver (an inbox that deduplicates)", _serve)
    p.add_argument("--inbox", required=True, help="inbox file (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    p.add_argument("--port", metavar="PORT", type=_int_in(0, 65535), default=0,
                   help="port (default 0: any)")
    p.add_argument("--latency-ms", metavar="MS", type=_int_in(0, 60000), default=0,
                   help="injected delay before each commit")
    p.add_argument("--p-503", metavar="P", type=_probability, default=0.0,
                   help="probability of answering 503 before commit")
    p.add_argument("--p-drop", metavar="P", type=_probability, default=0.0,
                   help="probability of closing the connection after commit, unanswered")
    p.add_argument("--seed", metavar="N", type=_int_in(0, 2**63), default=None,
                   help="seed of the injected faults")
    p.add_argument("--group", metavar="N", type=_int_in(1, 10000), default=64,
                   help="most requests in one commit (1 turns grouping off)")

    p = command("stats", "counts by status, oldest unfinished age, attempts, dead, redrives",
                _stats)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--receiver", metavar="URL", type=_url, default=None,
                   help="also show this receiver's counters (its /events URL)")

    p = command("dead", "list dead jobs", _dead)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--reason", metavar="REASON", type=_identifier, default=None,
                   help="only this reason (deadline, exhausted, permanent)")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="at most N jobs")

    p = command("inspect", "a job's row and its redrive history", _inspect)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("id", type=_identifier, help="job id")

    p = command("redrive", "release dead jobs with a fresh budget, one audit row each",
                _redrive)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("id", nargs="?", type=_identifier, default=None, help="one dead job's id")
    p.add_argument("--reason", metavar="REASON", type=_identifier, default=None,
                   help="bulk: every dead job of this reason")
    p.add_argument("--note", metavar="NOTE", type=_identifier, required=True,
                   help="audit note (an identifier, e.g. fixed-address)")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, MAX_MS), default=60_000,
                   help="time to live from now (default 60000)")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="bulk: at most N jobs")
    p.add_argument("--dry-run", action="store_true", help="bulk: list, change nothing")

    p = command("bench", "measure throughput and latency against their limits", _bench)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument("--peers", action="store_true",
                   help="also measure huey, persist-queue and litequeue, where installed")

    p = command("demo", "the crash-after-ACK story, end to end, on loopback", _demo)
    p.add_argument("--jobs", metavar="N", type=_int_in(10, 100_000), default=300,
                   help="snack orders (default 300)")
    p.add_argument("--concurrency", metavar="N", type=_int_in(1, 1000), default=16,
                   help="sends in flight per dispatcher (default 16)")
    p.add_argument("--keep", default=None,
                   help="keep the files in this folder (new or empty)")
    return parser


# ------------------------------------------------------------------ helpers


def _existing_queue(path: str) -> sqlite3.Connection:
    """Open an existing queue; a missing or foreign file is a usage error."""
    if not os.path.isfile(path):
        raise UsageError(f"queue file not found: {path}")
    try:
        return open_queue(path, create=False)
    except (ValueError, sqlite3.DatabaseError) as exc:
        raise UsageError(f"{path}: {exc}") from None


def _print_table(rows: list[tuple], out: TextIO = sys.stdout) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


# ------------------------------------------------------------------ commands


def _init(args: argparse.Namespace) -> int:
    if os.path.exists(args.queue) and not os.path.isfile(args.queue):
        raise UsageError(f"not a file: {args.queue}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.queue))):
        raise UsageError(f"folder not found: {os.path.dirname(args.queue)}")
    existed = os.path.exists(args.queue)
    try:
        open_queue(args.queue).close()
    except (ValueError, sqlite3.DatabaseError) as exc:
        raise UsageError(f"{args.queue}: {exc}") from None
    print(f"{'kept existing' if existed else 'created'} queue {args.queue}")
    return EXIT_OK


def _read_events(source: str) -> list[dict]:
    """Every line parsed and checked before anything goes in: all or nothing."""
    if source == "-":
        lines = sys.stdin.read().splitlines()
    else:
        if not os.path.isfile(source):
            raise UsageError(f"file not found: {source}")
        lines = Path(source).read_text(encoding="utf-8").splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(check_event(json.loads(line)))
        except ValueError as exc:
            raise UsageError(f"line {number}: {exc}; nothing was enqueued") from None
    return events


def _enqueue(args: argparse.Namespace) -> int:
    single = args.id is not None or args.qty is not None
    if single == (args.file is not None):
        raise UsageError("give either --id and --qty, or --file")
    if single and (args.id is None or args.qty is None):
        raise UsageError("--id and --qty go together")
    if single:
        try:  # argparse has its quirks ("--qty=--"): the event is checked again, whole
            events = [check_event({"id": args.id, "qty": args.qty})]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        events = _read_events(args.file)
    counts = {"new": 0, "duplicate": 0, "conflicting": 0}
    with closing(_existing_queue(args.queue)) as con:
        results = enqueue_many(con, events, wall_clock_ms(), args.ttl_ms, args.max_attempts)
    for result in results:
        if isinstance(result, Conflict):
            counts["conflicting"] += 1
            print(f"conflict: {result}", file=sys.stderr)
        else:
            counts["new" if result else "duplicate"] += 1
    print(", ".join(f"{n} {what}" for what, n in counts.items()))
    return EXIT_FAILED if counts["conflicting"] else EXIT_OK


def _run(args: argparse.Namespace) -> int:
    from asyncworker.dispatcher import Dispatcher

    _existing_queue(args.queue).close()  # missing or foreign: exit 2 before anything runs
    owner = args.owner or _default_owner()
    send = None
    if args.crash_after_acks is not None:
        send = _crashing_sender(args.url, args.lease_ms, args.crash_after_acks)
    try:
        dispatcher = Dispatcher(args.queue, owner, url=None if send else args.url, send=send,
                                concurrency=args.concurrency, lease_ms=args.lease_ms,
                                poll_interval=args.poll_ms / 1000, batch_size=args.batch_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    banner = (f"run: owner {owner}, queue {args.queue}, url {args.url}, concurrency "
              f"{args.concurrency}, lease {args.lease_ms} ms")
    try:
        stats = asyncio.run(_dispatch(dispatcher, args.until_idle, banner))
    except sqlite3.DatabaseError as exc:
        raise WorkFailed(f"{args.queue}: {exc}") from None
    print(json.dumps({"owner": owner, **stats.as_dict()}))
    return EXIT_OK


def _crashing_sender(url: str, lease_ms: int, after: int) -> Any:
    """The default send, plus a failure drill: SIGKILL itself right after an ACK."""
    import signal

    from asyncworker.sender import send_http

    acks = 0

    async def send(event: dict, token: int) -> object:
        nonlocal acks
        acked = await send_http(url, event, timeout=lease_ms / 1000, token=token)
        acks += 1
        if acks >= after:
            os.kill(os.getpid(), signal.SIGKILL)  # the receiver committed; we never record it
        return acked

    return send


async def _dispatch(dispatcher: Dispatcher, until_idle: bool, banner: str) -> DispatcherStats:
    from asyncworker.dispatcher import run_until_signalled

    async with dispatcher:
        progress = asyncio.create_task(_progress(dispatcher.stats), name="progress")
        try:
            return await run_until_signalled(
                dispatcher, until_idle=until_idle,
                on_stop=lambda msg: print(msg, file=sys.stderr, flush=True),
                # printed once a signal means a graceful stop: a supervisor may wait for it
                on_ready=lambda: print(banner, file=sys.stderr, flush=True))
        finally:
            progress.cancel()
            _show_progress(dispatcher.stats, 0.0, final=True)


def _show_progress(stats: DispatcherStats, rate: float, *, final: bool = False) -> None:
    line = (f"done {stats.ok}  retried {stats.retried}  dead {stats.dead + stats.permanent}  "
            f"stale {stats.stale}  bad-acks {stats.bad_acks}  errors {stats.errors}  "
            f"in flight {stats.in_flight}  rate {rate:.0f}/s")
    if sys.stderr.isatty():  # one live line, redrawn in place
        sys.stderr.write("\r\x1b[2K" + line + ("\n" if final else ""))
    else:  # plain log lines for files and pipes
        sys.stderr.write(("summary: " if final else "") + line + "\n")
    sys.stderr.flush()


async def _progress(stats: DispatcherStats) -> None:
    interval = 0.5 if sys.stderr.isatty() else 2.0
    last_ok, last_time = stats.ok, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        _show_progress(stats, (stats.ok - last_ok) / (now - last_time))
        last_ok, last_time = stats.ok, now


def _serve(args: argparse.Namespace) -> int:
    from asyncworker.receiver import Faults, serve

    faults = Faults(latency_ms=args.latency_ms, p_503=args.p_503, p_drop=args.p_drop,
                    seed=args.seed)
    try:
        check_url(f"http://{args.host}:1/events" if ":" not in args.host
                  else f"http://[{args.host}]:1/events")
    except ValueError as exc:
        raise UsageError(f"--host: {exc}") from None
    asyncio.run(serve(args.inbox, args.host, args.port, faults=faults, max_group=args.group))
    return EXIT_OK


def receiver_stats(events_url: str) -> dict:
    """GET the receiver's /stats (no proxy, loopback only)."""
    check_url(events_url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(events_url.rsplit("/", 1)[0] + "/stats", timeout=10) as answer:
        return dict(json.loads(answer.read(1 << 20)))


def _stats(args: argparse.Namespace) -> int:
    with closing(_existing_queue(args.queue)) as con:
        snap = observe.snapshot(con, wall_clock_ms())
    if args.receiver:
        try:
            snap["receiver"] = receiver_stats(args.receiver)
        except OSError as exc:
            raise WorkFailed(f"receiver at {args.receiver} did not answer: {exc}") from None
    if args.json:
        print(json.dumps(snap, indent=2, sort_keys=True))
        return EXIT_OK
    age = snap["oldest_unfinished_age_ms"]
    rows: list[tuple] = [("jobs", snap["jobs"])]
    rows += [(f"  {status}", n) for status, n in snap["by_status"].items()]
    rows += [("oldest unfinished", "-" if age is None else f"{age} ms"),
             ("expired leases", snap["expired_leases"]),
             ("attempts", " ".join(f"{k}:{v}" for k, v in snap["attempts"].items()) or "-"),
             ("dead by reason", " ".join(f"{k}:{v}" for k, v in snap["dead_by_reason"].items())
              or "-"),
             ("redrives", f"{snap['redrives']} ({snap['redriven_jobs']} jobs)")]
    for key, value in snap.get("receiver", {}).items():
        rows.append((f"receiver {key}", value))
    _print_table(rows)
    return EXIT_OK


_JOB_COLUMNS = ("id", "qty", "status", "reason", "attempts", "max_attempts", "token")


def _dead(args: argparse.Namespace) -> int:
    with closing(_existing_queue(args.queue)) as con:
        jobs = observe.dead_jobs(con, args.reason, args.limit)
    if jobs:
        _print_table([_JOB_COLUMNS] + [tuple(j[c] for c in _JOB_COLUMNS) for j in jobs])
    print(f"{len(jobs)} dead", file=sys.stderr)
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    with closing(_existing_queue(args.queue)) as con:
        history = observe.job_history(con, args.id)
    if history is None:
        raise WorkFailed(f"no job {args.id!r} in {args.queue}")
    print(json.dumps(history, indent=2))
    return EXIT_OK


def _redrive(args: argparse.Namespace) -> int:
    if (args.id is None) == (args.reason is None):
        raise UsageError("give either a job ID or --reason")
    if args.id is not None and (args.limit is not None or args.dry_run):
        raise UsageError("--limit and --dry-run go with --reason")
    with closing(_existing_queue(args.queue)) as con:
        if args.id is not None:
            ids = [args.id]
        else:
            ids = [job["id"] for job in observe.dead_jobs(con, args.reason, args.limit)]
        if args.dry_run:
            for job_id in ids:
                print(f"would redrive {job_id}")
            print(f"{len(ids)} to redrive (dry run, nothing changed)")
            return EXIT_OK
        failed = 0
        for job_id in ids:
            try:
                redrive(con, job_id, wall_clock_ms(), args.ttl_ms, args.note)
                print(f"redrove {job_id}")
            except ValueError as exc:
                failed += 1
                print(f"not redriven: {exc}", file=sys.stderr)
    print(f"{len(ids) - failed} redriven, {failed} refused")
    return EXIT_FAILED if failed else EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from asyncworker.bench import run_bench

    run_bench(quick=args.quick, peers=args.peers)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from asyncworker.demo import run_demo

    if args.keep is not None:
        keep = Path(args.keep)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise UsageError(f"--keep needs a new or empty folder: {args.keep}")
    return run_demo(jobs=args.jobs, concurrency=args.concurrency, keep=args.keep)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # bad arguments: exit 2 with one line
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"asyncworker {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except WorkFailed as exc:
        print(f"asyncworker {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
