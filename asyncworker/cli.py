"""The ``asyncworker`` command line (also ``python -m asyncworker``).

Every argument is checked before a file is opened. An error is one line on
stderr, never a traceback, and leaves every file as it was.

Exit codes (the same text is in ``--help`` and in the README):

- 0: done; for ``run``, no job went dead in this run.
- 1: the work failed: a conflict (``enqueue``), a refused redrive, no such
  job (``inspect``), a receiver that did not answer (``stats``), evidence
  that contradicts itself (``demo``), a database or file error such as a
  read-only or locked queue, or a folder it cannot write in (any command).
  Standard output closed early (``| head``): 1 as well, quietly.
- 2: bad usage, or a missing, foreign or damaged file or folder; for
  ``serve`` also an inbox it cannot open or a port it cannot bind.
- 3: ``run`` only: some jobs went dead in this run (its summary counts them
  by reason).
- 130: interrupted by Ctrl-C (``run`` and ``serve`` stop gracefully instead).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    NoReturn,
    Optional,
    Sequence,
    TextIO,
)

from lease import observe
from lease.http import check_url
from lease.worker import (
    MAX_ATTEMPTS,
    MAX_BATCH,
    MAX_MS,
    MAX_QTY,
    Conflict,
    check_event,
    check_identifier,
    enqueue_many,
    open_queue,
    parse_event,
    redrive_many,
)

# asyncio, aiohttp and urllib are imported only by the commands that use them: every
# other command starts in half the time.
if TYPE_CHECKING:
    from asyncworker.dispatcher import Dispatcher, DispatcherStats

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEAD = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

EXIT_CODES = """\
exit codes:
  0    done (run: and no job went dead in this run)
  1    the work failed: a conflict, a refused redrive, no such job, no answer
       from the receiver, a database or file error (read-only, locked);
       also, quietly, when standard output is closed early (| head)
  2    bad usage, or a missing, foreign or damaged file or folder
       (serve: also an inbox it cannot open or a port it cannot bind)
  3    run: some jobs went dead in this run (the summary counts them by reason)
  130  interrupted (run and serve stop gracefully on SIGINT/SIGTERM instead)"""

DEAD_REASONS = ("deadline", "exhausted", "permanent")
MAX_LINE_BYTES = 1 << 16  # far above any valid event; a longer line is not one
SHOW_EACH = 20  # per-job lines up to this many jobs (or with --verbose), a count always
_BOM = b"\xef\xbb\xbf"


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("lease-dispatcher")
    except metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """--version, reading the package metadata only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(f"asyncworker {package_version()}")
        sys.stdout.flush()
        parser.exit()


class UsageError(Exception):
    """Bad usage or a missing file: one line on stderr, exit code 2."""


class WorkFailed(Exception):
    """The command ran but its work failed: one line on stderr, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line and the exit codes in every --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # argparse 3.11 drops a "--" that is a value (--id=--, or "inspect q -- --")
        # and hands on an empty list; "--" is a valid identifier, so keep it.
        if action.nargs in (None, "?") and arg_strings == ["--"]:
            return self._get_value(action, "--")
        return super()._get_values(action, arg_strings)


def one_line(text: str) -> str:
    """Control characters (a newline in a file name, say) shown escaped: one line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


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


def _reason(text: str) -> str:
    if text not in DEAD_REASONS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(DEAD_REASONS)}: {text!r}")
    return text


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
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version")
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
    p.add_argument("--file", metavar="PATH",
                   help="UTF-8 JSON lines {\"id\", \"qty\"} (a file, pipe or FIFO); "
                        "'-' reads standard input")
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
    p.add_argument("--inbox", metavar="PATH", required=True,
                   help="inbox file (created if missing, in an existing folder)")
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

    p = command("stats", "counts by status, oldest unfinished age, attempts, dead, redrives "
                "(reads only)", _stats)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--receiver", metavar="URL", type=_url, default=None,
                   help="also show this receiver's counters (its /events URL)")

    p = command("dead", "list dead jobs (reads only)", _dead)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"only this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="at most N jobs")

    p = command("inspect", "a job's row and its redrive history (reads only)", _inspect)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("id", type=_identifier, help="job id")

    p = command("redrive", "release dead jobs with a fresh budget, one audit row each",
                _redrive)
    p.add_argument("queue", help="existing queue file")
    p.add_argument("id", nargs="?", type=_identifier, default=None, help="one dead job's id")
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"bulk: every dead job of this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--note", metavar="NOTE", type=_identifier, required=True,
                   help="audit note (an identifier, e.g. fixed-address)")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, MAX_MS), default=60_000,
                   help="time to live from now (default 60000)")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="bulk: at most N jobs")
    p.add_argument("--dry-run", action="store_true", help="bulk: list, change nothing")
    p.add_argument("--verbose", action="store_true",
                   help=f"a line per job however many (by default only up to {SHOW_EACH})")

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


def _check_queue_path(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"queue file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"not a file: {path}")


def _existing_queue(path: str) -> sqlite3.Connection:
    """Open an existing queue to change it; a missing or foreign file is a usage error."""
    _check_queue_path(path)
    if os.path.getsize(path) == 0:  # SQLite would take it for an empty queue and fill it
        raise UsageError(f"{path}: not a queue file: it is empty (init makes one)")
    try:
        return open_queue(path, create=False)
    except sqlite3.OperationalError:  # locked, read-only, I/O: the work failed, exit 1
        raise
    except (ValueError, sqlite3.DatabaseError) as exc:  # not a queue: usage, exit 2
        raise UsageError(f"{path}: {exc}") from None


def _readonly_queue(path: str) -> sqlite3.Connection:
    """Open an existing queue only to look: nothing is written, not even the journal mode."""
    _check_queue_path(path)
    try:
        return observe.open_readonly(path)
    except sqlite3.OperationalError:  # locked, I/O: the work failed, exit 1
        raise
    except (ValueError, sqlite3.DatabaseError) as exc:  # not a queue: usage, exit 2
        raise UsageError(f"{path}: {exc}") from None


def _print_table(rows: list[tuple], out: TextIO = sys.stdout) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


def _print_bounded(lines: list[str], verbose: bool, file: TextIO) -> None:
    """Every line when few or asked for; else the first SHOW_EACH and how many more."""
    shown = lines if verbose or len(lines) <= SHOW_EACH else lines[:SHOW_EACH]
    for line in shown:
        print(line, file=file)
    if len(shown) < len(lines):
        print(f"... and {len(lines) - len(shown)} more (--verbose lists them all)", file=file)


# ------------------------------------------------------------------ commands


def _init(args: argparse.Namespace) -> int:
    if os.path.exists(args.queue) and not os.path.isfile(args.queue):
        raise UsageError(f"not a file: {args.queue}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.queue))):
        raise UsageError(f"folder not found: {os.path.dirname(args.queue)}")
    existed = os.path.exists(args.queue)
    try:
        open_queue(args.queue).close()
    except sqlite3.OperationalError:  # locked, a folder it cannot write in: exit 1
        raise
    except (ValueError, sqlite3.DatabaseError) as exc:  # not a queue: usage, exit 2
        raise UsageError(f"{args.queue}: {exc}") from None
    print(f"{'kept existing' if existed else 'created'} queue {args.queue}")
    return EXIT_OK


def _read_source(source: str) -> list[dict]:
    """The events of a file, a pipe or FIFO (/dev/fd/N, mkfifo), or '-' for stdin."""
    if source == "-":
        return read_events(sys.stdin.buffer)
    try:
        with open(source, "rb") as file:
            return read_events(file)
    except FileNotFoundError:
        raise UsageError(f"file not found: {source}") from None
    except IsADirectoryError:
        raise UsageError(f"not a file: {source}") from None
    except OSError as exc:  # permission denied, an unreadable device, ...
        raise UsageError(f"cannot read {source}: {exc.strerror or exc}") from None


def parse_event_line(raw: bytes) -> Optional[dict]:
    """One JSON line as a checked event; None for a blank line; ValueError names the fault.

    The JSON rules are the receiver's (``parse_event``: no duplicate keys, no NaN)."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                         ) from None
    return parse_event(text) if text.strip() else None


def read_events(file: BinaryIO) -> list[dict]:
    """Every line parsed and checked before anything goes in: all or nothing.

    Read a line at a time, each at most MAX_LINE_BYTES: /dev/zero is a line
    too long, not a memory exhausted. A UTF-8 byte order mark at the start is
    skipped (editors write one)."""
    events = []
    for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            event = parse_event_line(raw.rstrip(b"\n"))
        except ValueError as exc:
            raise UsageError(f"line {number}: {exc}; nothing was enqueued") from None
        if event is not None:
            events.append(event)
    return events


def _enqueue(args: argparse.Namespace) -> int:
    single = args.id is not None or args.qty is not None
    if single == (args.file is not None):
        raise UsageError("give either --id and --qty, or --file")
    if single and (args.id is None or args.qty is None):
        raise UsageError("--id and --qty go together")
    _check_queue_path(args.queue)  # before a FIFO is read: a missing queue fails at once
    if single:
        try:  # argparse has its quirks ("--qty=--"): the event is checked again, whole
            events = [check_event({"id": args.id, "qty": args.qty})]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        events = _read_source(args.file)
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
    _existing_queue(args.queue).close()  # missing or foreign: exit 2 before anything runs
    from asyncworker.dispatcher import Dispatcher

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
    import asyncio

    try:
        stats = asyncio.run(_dispatch(dispatcher, args.until_idle, banner))
    except sqlite3.DatabaseError as exc:
        raise WorkFailed(f"{args.queue}: {exc}") from None
    print(json.dumps({"owner": owner, **stats.as_dict()}))
    return EXIT_DEAD if stats.dead else EXIT_OK


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
    import asyncio

    from asyncworker.dispatcher import run_until_signalled

    async with dispatcher:
        progress = asyncio.create_task(_progress(dispatcher.stats), name="progress")
        try:
            return await run_until_signalled(
                dispatcher, until_idle=until_idle, on_stop=lambda line: _log(line + "\n"),
                # printed once a signal means a graceful stop: a supervisor may wait for it
                on_ready=lambda: _log(banner + "\n"))
        finally:
            progress.cancel()
            _show_progress(dispatcher.stats, 0.0, final=True)


def _log(line: str) -> None:
    """A line on stderr; a closed stderr (a reader gone) does not stop the work."""
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except BrokenPipeError:
        pass


def progress_line(stats: DispatcherStats, rate: float) -> str:
    reasons = " ".join(f"{reason}:{n}" for reason, n in sorted(stats.dead_by_reason.items())
                       if n)
    return (f"done {stats.ok}  retried {stats.retried}  dead {stats.dead}"
            f"{f' ({reasons})' if reasons else ''}  stale {stats.stale}  "
            f"bad-acks {stats.bad_acks}  errors {stats.errors}  in flight {stats.in_flight}  "
            f"sending {stats.sending}  rate {rate:.0f}/s")


def _show_progress(stats: DispatcherStats, rate: float, *, final: bool = False) -> None:
    line = progress_line(stats, rate)
    if sys.stderr.isatty():  # one live line, redrawn in place
        _log("\r\x1b[2K" + line + ("\n" if final else ""))
    else:  # plain log lines for files and pipes
        _log(("summary: " if final else "") + line + "\n")


async def _progress(stats: DispatcherStats) -> None:
    import asyncio

    interval = 0.5 if sys.stderr.isatty() else 2.0
    last_ok, last_time = stats.ok, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        _show_progress(stats, (stats.ok - last_ok) / (now - last_time))
        last_ok, last_time = stats.ok, now


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from asyncworker.receiver import Faults, serve

    faults = Faults(latency_ms=args.latency_ms, p_503=args.p_503, p_drop=args.p_drop,
                    seed=args.seed)
    try:
        check_url(f"http://{args.host}:1/events" if ":" not in args.host
                  else f"http://[{args.host}]:1/events")
    except ValueError as exc:
        raise UsageError(f"--host: {exc}") from None
    try:
        asyncio.run(serve(args.inbox, args.host, args.port, faults=faults, max_group=args.group))
    except BrokenPipeError:
        raise
    # The receiver refuses before it prints its URL: a foreign or damaged inbox
    # (ValueError, or SQLite's own error) or a port it cannot bind (OSError).
    except ValueError as exc:  # the receiver's message names the file
        raise UsageError(str(exc)) from None
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"--inbox {args.inbox}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{args.host} port {args.port}: {exc.strerror or exc}") from None
    return EXIT_OK


def receiver_stats(events_url: str) -> dict:
    """GET the receiver's /stats (no proxy, loopback only)."""
    import urllib.request

    check_url(events_url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(events_url.rsplit("/", 1)[0] + "/stats", timeout=10) as answer:
        found = json.loads(answer.read(1 << 20))
    if not isinstance(found, dict):
        raise ValueError(f"a JSON {type(found).__name__}, not an object")
    return found


def _stats(args: argparse.Namespace) -> int:
    with closing(_readonly_queue(args.queue)) as con:
        snap = observe.snapshot(con, wall_clock_ms())
    if args.receiver:
        try:
            snap["receiver"] = receiver_stats(args.receiver)
        except OSError as exc:
            raise WorkFailed(f"receiver at {args.receiver} did not answer: {exc}") from None
        except ValueError as exc:  # another server on that port, say
            raise WorkFailed(f"receiver at {args.receiver} answered no stats: {exc}") from None
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
    with closing(_readonly_queue(args.queue)) as con:
        jobs = observe.dead_jobs(con, args.reason, args.limit)
    if jobs:
        _print_table([_JOB_COLUMNS] + [tuple(j[c] for c in _JOB_COLUMNS) for j in jobs])
    sys.stdout.flush()  # the table first, then its count, in a terminal too
    print(f"{len(jobs)} dead", file=sys.stderr)
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    with closing(_readonly_queue(args.queue)) as con:
        history = observe.job_history(con, args.id)
    if history is None:
        raise WorkFailed(f"no job {args.id!r} in {args.queue}")
    print(json.dumps(history, indent=2))
    return EXIT_OK


def redrive_in_chunks(con: sqlite3.Connection, ids: list[str], ttl_ms: int,
                      note: str) -> list[tuple[str, object]]:
    """(id, True or its ValueError) for each id, MAX_BATCH per transaction.

    A failure part-way (a database error) leaves the chunks before it whole
    and the rest untouched; it is raised as WorkFailed with that count."""
    results: list[tuple[str, object]] = []
    for start in range(0, len(ids), MAX_BATCH):
        chunk = ids[start:start + MAX_BATCH]
        try:
            answers = redrive_many(con, chunk, wall_clock_ms(), ttl_ms, note)
        except sqlite3.Error as exc:
            done = sum(answer is True for _, answer in results)
            raise WorkFailed(f"{exc}; {done} redriven before it, the rest untouched") from None
        results += zip(chunk, answers, strict=True)
    return results


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
            _print_bounded([f"would redrive {job_id}" for job_id in ids], args.verbose,
                           sys.stdout)
            print(f"{len(ids)} to redrive (dry run, nothing changed)")
            return EXIT_OK
        results = redrive_in_chunks(con, ids, args.ttl_ms, args.note)
    redriven = [f"redrove {job_id}" for job_id, answer in results if answer is True]
    refused = [f"not redriven: {answer}" for _, answer in results if answer is not True]
    _print_bounded(redriven, args.verbose, sys.stdout)
    sys.stdout.flush()
    _print_bounded(refused, args.verbose, sys.stderr)
    print(f"{len(redriven)} redriven, {len(refused)} refused")
    return EXIT_FAILED if refused else EXIT_OK


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


def _quiet_exit_on_broken_pipe() -> int:
    # The Python docs' recipe (library/signal, "Note on SIGPIPE"): the reader
    # has gone; point stdout at devnull so the interpreter's final flush
    # cannot fail again, and exit without a word.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILED


def _where(args: argparse.Namespace) -> str:
    path = getattr(args, "queue", None) or getattr(args, "inbox", None)
    return f"{path}: " if path else ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):  # a file name that is not UTF-8, printed
        sys.stdout.reconfigure(errors="backslashreplace")
    args = argparse.Namespace(command=None)
    try:
        args = build_parser().parse_args(argv)  # bad arguments: exit 2 with one line
        code = int(args.handler(args))
        sys.stdout.flush()  # a reader that left shows here, inside the guard
        return code
    except BrokenPipeError:
        return _quiet_exit_on_broken_pipe()
    except UsageError as exc:
        return _fail(args, f"error: {exc}", EXIT_USAGE)
    except WorkFailed as exc:
        return _fail(args, str(exc), EXIT_FAILED)
    except sqlite3.Error as exc:  # a read-only, locked or damaged file, whatever the command
        return _fail(args, f"{_where(args)}{exc}", EXIT_FAILED)
    except OSError as exc:
        return _fail(args, str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    _log(f"asyncworker {args.command}: {one_line(message)}\n")
    return code
