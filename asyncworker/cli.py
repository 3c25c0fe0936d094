"""The ``asyncworker`` command line (also ``python -m asyncworker``).

QUEUE, wherever a command names one, is a SQLite file's path or a
``postgresql://`` (``postgres://``) URL: every command opens it through
``lease.stores.open_store`` and speaks to the ``Store`` alone, so a command
does the same on either store. A URL is shown without its password, in every
line the command prints.

Every argument is checked before a queue is opened. An error is one line on
stderr, never a traceback, and leaves every queue as it was. The commands that
write open a queue migrated to this version: a file written by the contract
alone (schema version 0) is migrated forward once, every row kept; the
commands that look (stats, dead, inspect) open it read-only, whatever its
version, and write nothing.

Exit codes (the same text is in ``--help`` and in the README):

- 0: done; for ``run``, no job went dead in this run.
- 1: the work failed: a conflict (``enqueue``), a refused redrive or cancel,
  no such job (``inspect``), a receiver that did not answer (``stats``),
  evidence that contradicts itself (``demo``), a database or file error such
  as a read-only or locked queue, a folder it cannot write in, or a database
  server it cannot reach or log in to (any command). Standard output closed
  early (``| head``): 1 as well, quietly.
- 2: bad usage, or a missing, foreign or damaged file or folder, or a database
  without a queue (a queue of a newer schema version too); for ``serve`` also
  an inbox it cannot open or a port it cannot bind; for ``run``, a ``--metrics`` port it
  cannot bind.
- 3: ``run`` only: some jobs went dead in this run (its summary counts them
  by reason); also ``run --until-idle`` that ended idle with ordering keys
  blocked behind a dead job (its summary names each key and its dead head).
- 130: interrupted: Ctrl-C (``run`` and ``serve`` stop gracefully on the first
  signal instead); ``run`` aborted by a second signal (its summary names the
  leases it left to run out).
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
from array import array
from contextlib import ExitStack, closing
from datetime import UTC, datetime
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    Iterator,
    NamedTuple,
    NoReturn,
    Optional,
    Sequence,
    TextIO,
)
from urllib.parse import quote

from lease.clock import wall_clock_ms
from lease.policy import (
    DEFAULT_POLICY,
    MAX_BODY_BYTES,
    PRODUCT,
    RetryPolicy,
    check_note,
    check_ordering_key,
    check_product_event,
)
from lease.records import Conflicts, NotAQueue, StoreError
from lease.signing import TOLERANCE_S
from lease.store import Store
from lease.stores import is_postgres_url, open_store
from lease.worker import (
    MAX_BATCH,
    MAX_QTY,
    Conflict,
    check_identifier,
    check_job_id,
    parse_json,
)

# asyncio, aiohttp and urllib are imported only by the commands that use them: every
# other command starts in half the time.
if TYPE_CHECKING:
    from asyncworker.dispatcher import Dispatcher, DispatcherStats
    from lease.http import Destination

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEAD = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

EXIT_CODES = """\
exit codes:
  0    done (run: and no job went dead in this run)
  1    the work failed: a conflict, a refused redrive or cancel, no such job,
       no answer from the receiver, a database or file error (read-only,
       locked, a server it cannot reach or log in to); also, quietly, when
       standard output is closed early (| head)
  2    bad usage, or a missing, foreign, damaged or newer-version file or folder,
       or a database without a queue (serve: also an inbox it cannot open or a
       port it cannot bind; run: a --metrics port it cannot bind)
  3    run: some jobs went dead in this run (the summary counts them by reason);
       also run --until-idle ending idle with ordering keys blocked behind a
       dead job (the summary names each key and its dead head)
  130  interrupted (run and serve stop gracefully on SIGINT/SIGTERM instead;
       run aborted by a second signal: the summary names the leases left)"""

DEAD_REASONS = ("deadline", "exhausted", "permanent", "cancelled")
INSECURE_FLAG = "--insecure-plain-http"
ACK_POLICIES = ("echo-id", "status")
# A JSON line's cap: a body's canonical text is at most MAX_BODY_BYTES, but the
# line may spell it with spaces and \u escapes (an astral character is 12 bytes
# as \ud83d\ude00, 4 as UTF-8). A longer line cannot hold a valid event.
MAX_LINE_BYTES = 4 * MAX_BODY_BYTES
SHOW_EACH = 20  # per-job lines up to this many jobs (or with --verbose), a count always
PROGRESS_EVERY = 10_000  # enqueue --file: a progress line on a terminal this often
_BOM = b"\xef\xbb\xbf"
_AGE_UNITS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1, "": 1}
MAX_AGE_MS = 36_500 * _AGE_UNITS["d"]  # a hundred years: far beyond any retention


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
    """An owner's name: the contract's identifier (it is written into every lease)."""
    try:
        return check_identifier("value", text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 1-64 ASCII letters, digits, '_' or '-': {text!r}") from None


def _job_id(text: str) -> str:
    """A job id by the product's rule (UUIDs, order:123, tenant/7)."""
    try:
        return check_job_id("value", text, PRODUCT)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {PRODUCT.job_id_rule}: {text!r:.80}") from None


def _note(text: str) -> str:
    try:
        return check_note(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _body(text: str) -> dict:
    """--body: one JSON object, strictly, within the body's size cap."""
    try:
        body = parse_json(text)
        check_product_event({"id": "body", "body": body})  # the object and its size
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert isinstance(body, dict)  # check_product_event refused anything else
    return body


def parse_age(text: str) -> int:
    """AGE as 7d, 12h, 30m, 90s, 250ms or a plain number of milliseconds."""
    found = re.fullmatch(r"([0-9]{1,20})(d|h|m|s|ms|)", text)
    if not found:
        raise argparse.ArgumentTypeError(
            f"not an age (7d, 12h, 30m, 90s or milliseconds): {text!r:.40}")
    age_ms = int(found.group(1)) * _AGE_UNITS[found.group(2)]
    if age_ms > MAX_AGE_MS:
        raise argparse.ArgumentTypeError(f"at most {MAX_AGE_MS // _AGE_UNITS['d']}d, got {text}")
    return age_ms


def _reason(text: str) -> str:
    if text not in DEAD_REASONS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(DEAD_REASONS)}: {text!r}")
    return text


def _default_owner() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


def _ms(value: int) -> str:
    """A duration for --help: 259200000 as '259200000 ms = 3d'."""
    for unit in ("d", "h", "m", "s"):
        if value >= _AGE_UNITS[unit] and value % _AGE_UNITS[unit] == 0:
            return f"{value} = {value // _AGE_UNITS[unit]}{unit}"
    return str(value)


# ------------------------------------------------------------------ the parser

PRUNE_INBOX_HELP = f"""\
delete the inbox's rows first seen more than AGE ago, in short batches (safe
beside a running serve). The trade-off: the inbox absorbs a duplicate only
while it keeps that id's row. A pruned row is a duplicate no longer absorbed:
a resend of that id after the window is applied again. Pick a window longer
than the senders' whole retry budget (a job's time to live: {_ms(DEFAULT_POLICY.ttl_ms)}
by default) plus the time a stale sender may still be sending."""


QUEUE_HELP = ("the queue: a SQLite file's path, or a postgresql:// URL "
              "(postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE)")


def _queue_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue", metavar="QUEUE", help=f"{QUEUE_HELP}; it must exist")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="asyncworker",
                    description="A durable job dispatcher on one SQLite file, or on one "
                                "PostgreSQL database shared by many hosts. QUEUE is a file's "
                                "path or a postgresql:// URL.")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=Parser)

    def command(name: str, help_text: str, handler: Callable[[argparse.Namespace], int],
                description: Optional[str] = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=description or help_text)
        sub.set_defaults(handler=handler)
        _log_arguments(sub)
        return sub

    p = command("init", "create a queue (a file, or the tables in a PostgreSQL database), "
                "or migrate an older one forward", _init,
                "create a queue: a SQLite file, or the queue's tables (schema \"lease\") in "
                "a PostgreSQL database; an existing queue is kept, and one written by an "
                "older version (a file of the contract's schema) is migrated forward once, in "
                "one transaction, every row kept")
    p.add_argument("queue", metavar="QUEUE",
                   help="the queue to create or bring to this version: a file's path, or a "
                        "postgresql:// URL of an existing database")
    p.add_argument("--shared", action="store_true",
                   help="the queue shares its SQLite file with a service's own tables, to be "
                        "enqueued in the service's transactions (lease.sqlite.enqueue_in); "
                        "recorded in the file, so later commands need no flag")
    p.add_argument("--journal", choices=("delete", "wal"), default=None,
                   help="a SQLite file's journal: delete (the default for a new file: the "
                        "rollback journal of the lab's format) or wal (write-ahead log: one "
                        "fsync a COMMIT instead of several, readers never block the writer; "
                        "a copy must take the -wal file too, and every process must be on "
                        "this host). Kept by every later open; every COMMIT is durable in "
                        "both")

    _enqueue_arguments(command("enqueue", "add jobs: one with --id and --qty or --body, or "
                               "JSON lines with --file", _enqueue))
    _run_arguments(command("run", "dispatch jobs to a receiver with the async dispatcher",
                           _run))

    p = command("serve", "run the receiver (an inbox that deduplicates)", _serve)
    p.add_argument("--inbox", metavar="PATH", required=True,
                   help="inbox file (created if missing, in an existing folder)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); one that is not loopback "
                        "(0.0.0.0, a network's address) needs --secret-file")
    p.add_argument("--port", metavar="PORT", type=_int_in(0, 65535), default=0,
                   help="port (default 0: any)")
    p.add_argument("--path", metavar="PATH", default="/events",
                   help="the path events are POSTed to (default /events); GET /stats and "
                        "/metrics stay at the root")
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
    _loop_argument(p)
    _tls_arguments(p, serves=True,
                   secret="verify every POST's Standard Webhooks signature against the whsec_ "
                          "secrets in this file, one a line (any one verifies: rotation); a "
                          "request that fails is 401, nothing touched")
    p.add_argument("--signature-tolerance-s", metavar="S", type=_int_in(1, 86_400),
                   default=None,
                   help=f"how far a signed request's timestamp may be from this clock, in "
                        f"seconds (default {TOLERANCE_S}; a replay inside it is a duplicate)")

    p = command("stats", "counts by status, oldest unfinished age, attempts, dead, redrives, "
                "cancels, stale finishes (reads only)", _stats)
    _queue_argument(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--receiver", metavar="URL", default=None,
                   help="also show this receiver's counters (the URL it receives on: https, "
                        "or http to loopback)")
    _tls_arguments(p, reaches="--receiver")

    p = command("dead", "list dead jobs, each one's ordering key and last error (reads only)",
                _dead)
    _queue_argument(p)
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"only this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--key", metavar="KEY", type=_ordering_key, default=None,
                   help="only dead jobs with this ordering key (exactly)")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="at most N jobs")
    p.add_argument("--json", action="store_true",
                   help="the dead jobs as a JSON array of their rows (each with its ordering "
                        "key and last error)")

    p = command("inspect", "a job's row, every attempt, its redrives and cancels (reads only)",
                _inspect)
    _queue_argument(p)
    p.add_argument("id", type=_job_id, help="job id")
    p.add_argument("--json", action="store_true", help="the whole record as JSON")

    _operator_commands(command)

    p = command("bench", "measure throughput and latency against their limits", _bench)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument("--peers", action="store_true",
                   help="also measure the peer queues, where installed (huey, persist-queue "
                        "and litequeue; with --store, procrastinate and pgqueuer)")
    p.add_argument("--store", metavar="URL", default=None,
                   help="also measure PostgreSQL: a postgresql:// URL, or 'postgres' to "
                        "start a server for the run with durable settings (from a checkout)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave each receiver and its clients to the scheduler (default: the "
                        "receiver on half of the CPUs, its clients on the other half)")

    p = command("demo", "the crash-after-ACK story, end to end, on loopback", _demo)
    p.add_argument("--jobs", metavar="N", type=_int_in(10, 100_000), default=300,
                   help="snack orders (default 300)")
    p.add_argument("--concurrency", metavar="N", type=_int_in(1, 1000), default=16,
                   help="sends in flight per dispatcher (default 16)")
    p.add_argument("--keep", default=None,
                   help="keep the files in this folder (new or empty)")
    p.add_argument("--store", metavar="URL", default=None,
                   help="tell it on this PostgreSQL database (a postgresql:// URL) instead of "
                        "a new queue file: its queue is created if missing and must hold no "
                        "job (the demo never mixes with real work); the demo's jobs stay in "
                        "it afterwards")
    return parser


def _enqueue_arguments(p: argparse.ArgumentParser) -> None:
    _queue_argument(p)
    p.add_argument("--id", metavar="ID", type=_job_id,
                   help=f"job id: {PRODUCT.job_id_rule}, e.g. a UUID, order:123, tenant/7")
    p.add_argument("--qty", metavar="N", type=_int_in(1, MAX_QTY),
                   help=f"quantity of a lab event {{\"id\", \"qty\"}}, 1..{MAX_QTY} (its id "
                        "by the lab's rule: 1-64 ASCII letters, digits, '_' or '-')")
    p.add_argument("--body", metavar="JSON", type=_body,
                   help=f"the payload: one JSON object, at most {MAX_BODY_BYTES} bytes as "
                        "canonical JSON (sorted keys, no spaces)")
    p.add_argument("--file", metavar="PATH",
                   help="UTF-8 JSON lines, {\"id\", \"qty\"} or {\"id\", \"body\": {...}} (a "
                        "file, pipe or FIFO; '-' reads standard input), streamed into one "
                        "transaction: all or nothing. A bad line, or any line whose id is "
                        "kept with other content (a conflict), enqueues nothing; each "
                        "conflicting line is named")
    p.add_argument("--skip-conflicts", action="store_true",
                   help="with --file: enqueue the other lines when some conflict (each "
                        "conflicting line is still named, and the exit code is 1)")
    p.add_argument("--key", metavar="KEY", type=_ordering_key,
                   help="ordering key: jobs with the same key are delivered one at a time, in "
                        "intake order (given to every event that has none of its own)")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, PRODUCT.max_ttl_ms),
                   default=DEFAULT_POLICY.ttl_ms,
                   help=f"time to live from the first moment it may run, up to "
                        f"{_ms(PRODUCT.max_ttl_ms)} (default {_ms(DEFAULT_POLICY.ttl_ms)})")
    p.add_argument("--max-attempts", metavar="N", type=_int_in(1, PRODUCT.max_attempts),
                   default=DEFAULT_POLICY.max_attempts,
                   help=f"attempt budget, 1..{PRODUCT.max_attempts} "
                        f"(default {DEFAULT_POLICY.max_attempts})")
    p.add_argument("--delay-ms", metavar="MS", type=_int_in(0, PRODUCT.max_delay_ms), default=0,
                   help=f"delayed delivery: no attempt before now + MS, up to "
                        f"{_ms(PRODUCT.max_delay_ms)} (default 0)")


def _log_arguments(p: argparse.ArgumentParser) -> None:
    from asyncworker.logs import FORMATS, LEVELS

    p.add_argument("--log-level", choices=LEVELS, default=None,
                   help="the least severe log records shown on stderr (default info for run: "
                        "every retry, dead job, stale finish, lost lease, bad ACK and error is "
                        "a line, a job done only at debug; warning for every other command)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text (default): timestamp, level, logger, message, then key=value "
                        "facts; json: one object a line with ts, level, logger, msg and the "
                        "facts as keys (run's banner, progress and summary lines, serve's "
                        "last line and a command's error line too)")


def _loop_argument(p: argparse.ArgumentParser) -> None:
    from asyncworker.eventloop import LOOPS

    p.add_argument("--loop", choices=LOOPS, default="auto",
                   help="the event loop: auto (default: uvloop when installed, the 'fast' "
                        "extra; asyncio's otherwise), asyncio, or uvloop (an error when it "
                        "is not installed)")


def _metrics_address(text: str) -> tuple[str, int]:
    """--metrics: HOST:PORT, [IPv6]:PORT, :PORT or PORT; loopback when no host is given."""
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 address goes in brackets, [{host}]:PORT")
    if host and (not host.isprintable() or any(c.isspace() for c in host)):
        raise argparse.ArgumentTypeError(f"not a host name or address: {host!r:.80}")
    if not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"the port must be 0..65535, got {port!r:.80}")
    return host or "127.0.0.1", int(port)


def _run_arguments(p: argparse.ArgumentParser) -> None:
    _queue_argument(p)
    p.add_argument("--url", metavar="URL", required=True,
                   help="the receiver: https://HOST[:PORT]/PATH (its certificate and host "
                        "name verified), or http:// to a loopback address (127.0.0.1, ::1, "
                        "localhost); plain http to any other host only with "
                        "--insecure-plain-http")
    _destination_arguments(p)
    p.add_argument("--concurrency", metavar="N", type=_int_in(1, 10_000), default=16,
                   help="sends in flight (default 16)")
    p.add_argument("--lease-ms", metavar="MS", type=_int_in(1, PRODUCT.max_lease_ms),
                   default=DEFAULT_POLICY.lease_ms,
                   help=f"lease per claim, up to {_ms(PRODUCT.max_lease_ms)} "
                        f"(default {_ms(DEFAULT_POLICY.lease_ms)})")
    p.add_argument("--send-timeout", metavar="DURATION", type=parse_age, default=None,
                   help="how long one send may take: 30s, 5m, 2h or milliseconds, up to the "
                        f"retry budget (a job's time to live, {_ms(DEFAULT_POLICY.ttl_ms)}); "
                        "longer than the lease, the lease is extended while the send runs "
                        "(default: what the lease leaves when the send starts, less the time "
                        "kept for the finish, a fifth of the lease up to 2 s). A send starts "
                        "only when its lease can cover it: one capped by the job's deadline "
                        "with too little left is retried, unsent")
    p.add_argument("--backoff-base-ms", metavar="MS", type=_int_in(1, PRODUCT.max_delay_ms),
                   default=DEFAULT_POLICY.backoff_base_ms,
                   help=f"first retry delay, doubling each attempt "
                        f"(default {_ms(DEFAULT_POLICY.backoff_base_ms)})")
    p.add_argument("--backoff-cap-ms", metavar="MS", type=_int_in(1, PRODUCT.max_delay_ms),
                   default=DEFAULT_POLICY.backoff_cap_ms,
                   help=f"longest retry delay, up to {_ms(PRODUCT.max_delay_ms)} "
                        f"(default {_ms(DEFAULT_POLICY.backoff_cap_ms)})")
    p.add_argument("--jitter", metavar="J", type=_probability, default=DEFAULT_POLICY.jitter,
                   help=f"random share of each delay, 0..1 (default {DEFAULT_POLICY.jitter}: "
                        "from half the step to the whole)")
    p.add_argument("--owner", metavar="NAME", type=_identifier, default=None,
                   help="this dispatcher's name (default HOST-PID)")
    p.add_argument("--until-idle", action="store_true",
                   help="stop once the queue is idle: nothing to claim now or later without "
                        "an operator (every job done or dead, or waiting behind a dead first "
                        "job of its ordering key; retry delays and leases are waited for); "
                        "keys left blocked are named, and exit 3")
    p.add_argument("--batch-size", metavar="N", type=_int_in(1, 10_000), default=64,
                   help="most jobs per claim transaction; a finish group records what up to "
                        "four claims sent (default 64; 1: a claim per job)")
    p.add_argument("--poll-ms", metavar="MS", type=_int_in(1, 60_000), default=50,
                   help="how long an idle dispatcher waits before looking again (default 50)")
    p.add_argument("--prefetch", metavar="N", type=_int_in(0, 10_000), default=None,
                   help="claimed jobs that may wait for a send slot, so that a send that ends "
                        "starts the next at once (default: twice the concurrency, at most twice "
                        "the batch size; 0: none)")
    _loop_argument(p)
    p.add_argument("--crash-after-acks", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="failure drill: die by SIGKILL right after the N-th ACK, before "
                        "recording it; the job and its token are named on stderr first")
    p.add_argument("--metrics", metavar="HOST:PORT", type=_metrics_address, default=None,
                   help="serve /metrics (Prometheus) and /healthz (200 while dispatching "
                        "and the store answers, else 503) while it runs; HOST defaults to "
                        "127.0.0.1 (:PORT or PORT alone), another address only when written "
                        "out (0.0.0.0:9100); port 0 picks a free one; the URL is printed on "
                        "stderr first (\"metrics: URL\"); a port it cannot bind is exit 2")


def _destination_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ack", choices=ACK_POLICIES, default="echo-id",
                   help="what counts as delivered: echo-id (default) a 2xx JSON object naming "
                        "the job's id, the receiver's proof it read this request; status any "
                        "2xx (the webhook convention: weaker evidence, see the README)")
    _tls_arguments(p, reaches="--url",
                   secret="sign every request (Standard Webhooks) with the whsec_ secrets in "
                          "this file, one a line (# comments); two during a rotation")


def _tls_arguments(p: argparse.ArgumentParser, *, serves: bool = False,
                   reaches: Optional[str] = None, secret: Optional[str] = None) -> None:
    """The TLS and secret options of every command that serves https (``serves``)
    or reaches a receiver (``reaches``: the flag that names its URL), worded
    here once and checked by ``served_tls``, ``reached`` and ``read_secret_file``."""
    if serves:
        p.add_argument("--tls-cert", metavar="PATH", default=None,
                       help="serve https with this certificate chain (PEM), with --tls-key")
        p.add_argument("--tls-key", metavar="PATH", default=None,
                       help="the certificate's private key (PEM, unencrypted)")
    if reaches is not None:
        p.add_argument("--ca-file", metavar="PATH", default=None,
                       help=f"{reaches} over https: trust only the CA certificates (PEM) in "
                            f"this file, not the system's store")
        served = ("serve this page, and " if serves else "")
        p.add_argument("--insecure-plain-http", action="store_true",
                       help=f"{served}reach {reaches} over plain http where it is not "
                            f"loopback: anyone on the path can read what crosses it (events "
                            f"and signatures, figures, a token) and change it")
    if secret is not None:
        p.add_argument("--secret-file", metavar="PATH", default=None,
                       help=f"{secret}; refused if every user may write it, a warning if "
                            f"others may read it")


def _operator_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("redrive", "release dead jobs with a fresh budget, one audit row each",
                _redrive)
    _queue_argument(p)
    p.add_argument("id", nargs="?", type=_job_id, default=None, help="one dead job's id")
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"bulk: every dead job of this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--note", metavar="NOTE", type=_note, required=True,
                   help="audit note: free text, 1-500 characters, no control characters")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, PRODUCT.max_ttl_ms),
                   default=DEFAULT_POLICY.ttl_ms,
                   help=f"time to live from now, up to {_ms(PRODUCT.max_ttl_ms)} "
                        f"(default {_ms(DEFAULT_POLICY.ttl_ms)})")
    _bulk_arguments(p)

    p = command("cancel", "cancel pending or dead jobs with a note, one audit row each",
                _cancel, "cancel pending or dead jobs: each becomes dead/cancelled with an "
                "audit row (what it was, the note), together. A leased job is refused (its "
                "send may be on the wire: cancel it once it is back), and so is a done one. "
                "A cancelled job leaves the dead letters only by a redrive.")
    _queue_argument(p)
    p.add_argument("ids", nargs="*", type=_job_id, metavar="ID", help="jobs to cancel")
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help="bulk: every dead job of this reason "
                        f"({', '.join(r for r in DEAD_REASONS if r != 'cancelled')})")
    p.add_argument("--note", metavar="NOTE", type=_note, required=True,
                   help="audit note: free text, 1-500 characters, no control characters")
    _bulk_arguments(p)

    p = command("prune", "delete done jobs that finished more than AGE ago, with their "
                "evidence", _prune, "delete done jobs that finished more than AGE ago, with "
                "their attempts and audit rows, in short transactions of up to "
                f"{MAX_BATCH}. Pending, leased and dead jobs are never touched. An id whose "
                "job was pruned is new again: enqueued again, it is a new job.")
    _queue_argument(p)
    p.add_argument("--older-than", metavar="AGE", type=parse_age, required=True,
                   help="7d, 12h, 30m, 90s, or milliseconds")

    p = command("ui", "serve the operator's web page for QUEUE (read-only unless "
                "--allow-changes)", _ui, "serve the operator's web page: the queue by status, "
                "jobs with their evidence, dead letters by reason with bulk redrive and cancel. "
                "Read-only unless --allow-changes; loopback only unless --token-file is given "
                "(then https, or --insecure-plain-http); it answers only to the bound "
                "address's names and --allowed-host; every change is a POST with a CSRF token "
                "from the page itself.")
    _queue_argument(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; another needs --token-file, "
                        "and --tls-cert or --insecure-plain-http)")
    p.add_argument("--port", type=_int_in(0, 65535), default=8080,
                   help="port (default 8080; 0 picks a free one); the URL is printed first")
    p.add_argument("--allowed-host", metavar="NAME", action="append", default=[],
                   help="a name the page answers to besides the bound address's own "
                        "(127.0.0.1, localhost and [::1] at the bound port, or the address "
                        "given to --host): NAME at any port, or NAME:PORT; repeatable. A "
                        "request naming any other Host is refused (421), nothing read")
    p.add_argument("--allow-changes", action="store_true",
                   help="allow redrive and cancel from the page (each needs a note)")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help="a file whose first line is the access token, or LABEL:TOKEN; the "
                        "label is the operator's name in the audit rows; refused if every "
                        "user may write it, a warning if others may read it")
    p.add_argument("--receiver", metavar="URL", default=None,
                   help="the receiver's /stats URL: its applied, duplicates and refusals on "
                        "the overview")
    _tls_arguments(p, serves=True, reaches="--receiver")

    p = command("prune-inbox", "delete inbox rows first seen more than AGE ago (see the "
                "trade-off in its --help)", _prune_inbox, PRUNE_INBOX_HELP)
    p.add_argument("inbox", help="existing inbox file")
    p.add_argument("--older-than", metavar="AGE", type=parse_age, required=True,
                   help="7d, 12h, 30m, 90s, or milliseconds; longer than the senders' retry "
                        "budget")


def _bulk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", metavar="KEY", type=_ordering_key, default=None,
                   help="bulk, with --reason: only dead jobs with this ordering key "
                        "(exactly; not with a job ID)")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="bulk: at most N jobs")
    p.add_argument("--dry-run", action="store_true", help="bulk: list, change nothing")
    p.add_argument("--verbose", action="store_true",
                   help=f"a line per job however many (by default only up to {SHOW_EACH})")


# ------------------------------------------------------------------ helpers


def shown(queue: str) -> str:
    """A queue as it may be printed: a URL without its password (in its user
    part or as a ``password=`` parameter); a path as it is."""
    if not is_postgres_url(queue):
        return queue
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(queue)
    except ValueError:  # an unbalanced [ in the host, say: nothing of it is shown
        return queue.split("://", 1)[0] + "://(a URL that does not parse)"
    netloc = parts.netloc
    if "@" in netloc:
        user_part, _, hosts = netloc.rpartition("@")  # a password may hold an "@"
        user = user_part.split(":", 1)[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = "&".join(item for item in parts.query.split("&")
                     if item and item.split("=", 1)[0].strip().lower() != "password")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _passwords(queue: str) -> list[str]:
    """The password a URL carries, in every spelling a message might quote."""
    if not is_postgres_url(queue):
        return []
    from urllib.parse import parse_qsl, unquote, urlsplit

    try:
        parts = urlsplit(queue)
        found = [parts.password or ""]
        found += [value for key, value in parse_qsl(parts.query) if key.lower() == "password"]
    except ValueError:
        return []
    return [word for text in found if text for word in {text, unquote(text)}]


def _check_queue_path(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"queue file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"not a file: {path}")


def open_queue_store(queue: str, *, create: bool = False, read_only: bool = False,
                     migrate: bool = True, shared: bool = False,
                     journal: Optional[str] = None) -> Store:
    """The store QUEUE names, for a command: a file is checked first (missing, a
    folder, empty: usage errors), a URL's server is reached and its queue found.

    Not a queue (a foreign file or database, a newer version): UsageError, exit 2,
    nothing changed. A store that fails (locked, read-only, a server that cannot
    be reached): StoreError, exit 1 (main). ``read_only`` writes nothing at all
    (a file's journal mode included); otherwise the queue is migrated to this
    version, unless ``migrate=False`` leaves a file's migration to the intake's
    own transaction, so an intake refused halfway leaves it exactly as it was.
    """
    if not is_postgres_url(queue) and not create:
        _check_queue_path(queue)
        if not read_only and os.path.getsize(queue) == 0:  # SQLite would fill it silently
            raise UsageError(f"{queue}: not a queue file: it is empty (init makes one)")
    try:
        if migrate or shared or journal or is_postgres_url(queue):
            return open_store(queue, create=create, read_only=read_only, shared=shared,
                              journal=journal)
        from lease.sqlite import SQLiteStore

        return SQLiteStore(queue, create=create, migrate=False)
    except NotAQueue as exc:
        raise UsageError(about(queue, exc)) from None
    except StoreError:  # locked, read-only, unreachable: the work failed, exit 1
        raise
    except FileNotFoundError as exc:  # removed since it was checked
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a foreign file, by the contract's own refusal
        raise UsageError(about(queue, exc)) from None


def about(queue: Optional[str], error: object) -> str:
    """An error's message, led by the queue it is about unless it names it already.
    A database server's message may span lines: one line here, its words kept."""
    message = str(error)
    if queue is None:
        return message
    if is_postgres_url(queue):
        message = re.sub(r"\s*\n\s*", " ", message.strip())
    return message if shown(queue) in message else f"{shown(queue)}: {message}"


# A secrets file holds a few lines; a larger one is a wrong path (a log, an image).
MAX_SECRETS_FILE_BYTES = 64 * 1024


def _check_small_file(flag: str, path: str, cap: int = 1 << 20) -> None:
    """An existing, readable, regular file of at most ``cap`` bytes: a device, a FIFO
    or a folder named by mistake is refused before anything reads it."""
    if not os.path.exists(path):
        raise UsageError(f"{flag}: file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: not a file: {path}")
    try:
        with open(path, "rb") as file:
            size = len(file.read(cap + 1))
    except OSError as exc:  # permission denied, say
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if size > cap:
        raise UsageError(f"{flag}: {path} is larger than {cap} bytes: not the file meant")


def read_secret_file(path: str) -> tuple[bytes, ...]:
    """The keys of a secrets file; a one-line UsageError that names the file and
    the line, never a secret (lease.signing's messages never quote one)."""
    from lease.signing import read_secrets

    _check_small_file("--secret-file", path, MAX_SECRETS_FILE_BYTES)
    try:
        keys = read_secrets(path)
    except UnicodeDecodeError:
        raise UsageError(f"--secret-file: {path} is not UTF-8 text") from None
    except ValueError as exc:
        raise UsageError(f"--secret-file: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--secret-file: cannot read {path}: {exc.strerror or exc}") from None
    check_private_file("--secret-file", path)
    return keys


def check_private_file(flag: str, path: str) -> None:
    """A secret's file (--secret-file, --token-file), once read: one every user may
    write is refused (anyone could have put their own secret in it); one others
    may read or write is used, with one warning line on stderr."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError as exc:  # gone since it was read
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if mode & 0o002:
        raise UsageError(f"{flag}: {path} is writable by every user (mode {mode:04o}): anyone "
                         f"could have replaced the secret; chmod 600 it and check its content")
    if mode & 0o077:
        import logging

        logging.getLogger("asyncworker.cli").warning(
            f"{flag}: {path} is open to other users (mode {mode:04o}): chmod 600 it, so that "
            f"only its owner reads it")


def check_ca_file(path: str) -> None:
    """A regular file from which the senders' TLS context loads CA certificates."""
    from lease.http import client_context

    _check_small_file("--ca-file", path)
    try:
        client_context(path)
    except ValueError as exc:
        raise UsageError(f"--ca-file: {exc}") from None


class _EncryptedKey(Exception):
    """OpenSSL asked for a passphrase: a daemon has no one to type it."""


def _no_passphrase() -> str:
    raise _EncryptedKey


def check_tls_files(cert: Optional[str], key: Optional[str]) -> None:
    """--tls-cert and --tls-key: both or neither, each a file, the key unencrypted
    and the certificate's own. Loaded here once so that each fault has its name
    (ssl says "PEM lib" for most of them)."""
    import ssl

    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if cert is None or key is None:
        return
    _check_small_file("--tls-cert", cert)
    _check_small_file("--tls-key", key)
    try:
        ssl.create_default_context(cafile=cert)
    except ssl.SSLError:
        raise UsageError(f"--tls-cert: {cert} holds no PEM certificate") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise UsageError(f"--tls-key: {key} is encrypted (a passphrase): give the key "
                         "unencrypted, readable only by the receiver's user") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise UsageError(f"--tls-key: {key} is not the key of --tls-cert {cert}") from None
        raise UsageError(f"--tls-key: {key} holds no PEM private key ({exc.reason or exc})"
                         ) from None


def served_tls(args: argparse.Namespace) -> bool:
    """--tls-cert and --tls-key (``_tls_arguments(serves=True)``) checked: https or not."""
    check_tls_files(args.tls_cert, args.tls_key)
    return args.tls_cert is not None


def reached(args: argparse.Namespace, flag: str, url: Optional[str], *, ack: str = "echo-id",
            secrets: tuple[bytes, ...] = (), serves: bool = False) -> Optional[Destination]:
    """The receiver ``url`` (given as ``flag``) names, with --ca-file and
    --insecure-plain-http (``_tls_arguments(reaches=flag)``), as the destination
    the senders check once more; None when no URL is given. Every fault is a
    one-line usage error, before the queue is opened. ``serves``: the command
    serves too, so --insecure-plain-http means something without the URL."""
    from lease.http import Destination, PlainHttpRefused

    if url is None:
        if args.ca_file is not None or (args.insecure_plain_http and not serves):
            raise UsageError(f"--ca-file{'' if serves else ' and --insecure-plain-http'} "
                             f"go{'es' if serves else ''} with {flag}")
        return None
    if args.ca_file is not None:
        if not url.startswith("https://"):
            raise UsageError(f"--ca-file goes with an https:// {flag}")
        check_ca_file(args.ca_file)
    try:
        return Destination(url, ack=ack, ca_file=args.ca_file, secrets=secrets,
                           insecure_http=args.insecure_plain_http)
    except PlainHttpRefused as exc:  # the flag that allows it, not the argument
        raise UsageError(f"{flag}: {PlainHttpRefused(exc.host, INSECURE_FLAG)}") from None
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _destination(args: argparse.Namespace) -> Destination:
    """run's --url and its flags: every fault a usage error, before the queue is opened."""
    secrets = () if args.secret_file is None else read_secret_file(args.secret_file)
    destination = reached(args, "--url", args.url, ack=args.ack, secrets=secrets)
    assert destination is not None  # --url is required
    return destination


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


def _cell(value: object, width: int = 60) -> str:
    """A table cell: one line, at most `width` characters, '-' for nothing."""
    if value is None:
        return "-"
    text = one_line(str(value))
    return text if len(text) <= width else text[:width - 3] + "..."


def _when(ms: Optional[int]) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}Z"


# ------------------------------------------------------------------ init, enqueue


def _init(args: argparse.Namespace) -> int:
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


def _shared_version_before(queue: str) -> Optional[int]:
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


def _version_before(queue: str) -> Optional[int]:
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


def parse_event_line(raw: bytes) -> Optional[object]:
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


def _single_event(args: argparse.Namespace) -> Optional[dict]:
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


def _ordering_key(text: str) -> str:
    try:
        return check_ordering_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _keyed(events: Any, key: Optional[str]) -> Any:
    """Every event with --key, unless it carries a key of its own."""
    if key is None:
        return events
    return ({**event, "key": key} if isinstance(event, dict) and "key" not in event
            else event for event in events)


def _enqueue(args: argparse.Namespace) -> int:
    event = _single_event(args)
    if args.skip_conflicts and event is not None:
        raise UsageError("--skip-conflicts goes with --file")
    policy = RetryPolicy(max_attempts=args.max_attempts, ttl_ms=args.ttl_ms)
    if not is_postgres_url(args.queue):
        _check_queue_path(args.queue)  # before a FIFO is read: a missing queue fails at once
    with ExitStack() as stack:
        lines = None
        if event is None:
            source = _open_source(args.file)
            if source is not sys.stdin.buffer:
                stack.enter_context(source)
            lines = JsonLines(source)
        store = stack.enter_context(closing(open_queue_store(args.queue, migrate=False)))
        events = _keyed([event] if lines is None else lines, args.key)
        # a file is all or nothing, unless asked to skip; one event is either
        on_conflict = "return" if lines is None or args.skip_conflicts else "raise"
        try:
            results = _intake(store, events, policy, args.delay_ms, lines, on_conflict)
        except Conflicts as refused:
            _report_intake(refused.results, lines, written=False)
            _log(f"nothing was enqueued: {len(refused.conflicts)} conflicting of "
                 f"{len(refused.results)} events (--skip-conflicts enqueues the others)\n")
            return EXIT_FAILED
    return _report_intake(results, lines)


def _intake(store: Store, events: Any, policy: RetryPolicy, delay_ms: int,
            lines: Optional[JsonLines] = None, on_conflict: str = "return") -> list:
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
        if live and events.number >= PROGRESS_EVERY:
            _log("\r\x1b[2K")  # the live line erased: the summary follows on stdout


def _enqueue_progress(done: int) -> None:
    if done % PROGRESS_EVERY == 0:
        _log(f"\r\x1b[2Kenqueue: {done} events read, one transaction, nothing committed yet")


def _report_intake(results: list, lines: Optional[JsonLines], written: bool = True) -> int:
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


# ------------------------------------------------------------------ run


def _retry_policy(args: argparse.Namespace) -> RetryPolicy:
    if args.backoff_cap_ms < args.backoff_base_ms:
        raise UsageError(f"--backoff-cap-ms ({args.backoff_cap_ms}) must be at least "
                         f"--backoff-base-ms ({args.backoff_base_ms})")
    return RetryPolicy(backoff_base_ms=args.backoff_base_ms,
                       backoff_cap_ms=args.backoff_cap_ms, jitter=args.jitter,
                       lease_ms=args.lease_ms)


def _run(args: argparse.Namespace) -> int:
    policy = _retry_policy(args)
    destination = _destination(args)
    # missing or foreign: exit 2 before anything runs; a file is migrated here, once
    open_queue_store(args.queue).close()
    from asyncworker.dispatcher import Dispatcher

    owner = args.owner or _default_owner()
    send_timeout_ms = _send_timeout_ms(args, policy)
    send = None
    if args.crash_after_acks is not None:
        send = _crashing_sender(destination, send_timeout_ms or args.lease_ms,
                                args.crash_after_acks)
    try:
        dispatcher = Dispatcher(args.queue, owner, destination=None if send else destination,
                                send=send, concurrency=args.concurrency, lease_ms=args.lease_ms,
                                send_timeout_ms=send_timeout_ms,
                                poll_interval=args.poll_ms / 1000, batch_size=args.batch_size,
                                prefetch=args.prefetch, policy=policy)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    keys = len(destination.secrets)  # how many, never which
    signed = f"signed with {keys} secret{'s' if keys > 1 else ''}" if keys else "unsigned"
    banner = (f"run: owner {owner}, queue {shown(args.queue)}, url {args.url} (ack {args.ack}, "
              f"{signed}), concurrency {args.concurrency}, lease {args.lease_ms} ms, backoff "
              f"{policy.backoff_base_ms}..{policy.backoff_cap_ms} ms, jitter {policy.jitter}")
    from asyncworker import eventloop

    loop = _usable_loop(args.loop)
    eventloop.tune_gc()  # this process is the dispatcher's own
    try:
        end = eventloop.run(_dispatch(dispatcher, args.until_idle, banner, args.metrics), loop)
    except StoreError as exc:  # the queue failed under the run: its summary is not printed
        raise WorkFailed(about(args.queue, exc)) from None
    stats = dispatcher.stats
    summary = {"owner": owner, **stats.as_dict(), "seconds": round(end.seconds, 3),
               "rate": round(end.rate, 1)}
    if dispatcher.aborted:
        summary["leases_left"] = dispatcher.left_leased
    if end.blocked is not None:
        summary["blocked_heads"] = end.blocked
    print(json.dumps(summary))
    if dispatcher.aborted:  # interrupted: what it left runs out by its leases
        return EXIT_INTERRUPTED
    return EXIT_DEAD if stats.dead or end.blocked else EXIT_OK


def _send_timeout_ms(args: argparse.Namespace, policy: RetryPolicy) -> Optional[int]:
    """--send-timeout, within the retry budget; None: each send bounded by its lease."""
    if args.send_timeout is None:
        return None
    if not 1 <= args.send_timeout <= policy.ttl_ms:
        raise UsageError(f"--send-timeout must be 1 ms up to the retry budget, a job's time "
                         f"to live ({_ms(policy.ttl_ms)} ms), got {args.send_timeout} ms")
    return args.send_timeout


def _usable_loop(loop: str) -> str:
    """--loop, checked before anything starts: uvloop asked for and missing is a usage error."""
    from asyncworker.eventloop import loop_in_use

    try:
        return loop_in_use(loop)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None


CRASH_DRILL = "crash drill: SIGKILL right after the ACK of"  # then: ID token N


def _crashing_sender(destination: Destination, timeout_ms: int, after: int) -> Any:
    """The default send to the destination (its TLS, ACK policy and signatures),
    plus a failure drill: SIGKILL itself right after an ACK."""
    import signal

    from asyncworker.sender import send_http

    acks = 0

    async def send(event: dict, token: int) -> object:
        nonlocal acks
        acked = await send_http(destination, event, timeout=timeout_ms / 1000, token=token)
        acks += 1
        if acks >= after:
            # Which job, for the evidence: the receiver committed it, the queue never hears.
            sys.stderr.write(f"{CRASH_DRILL} {event['id']} token {token}, before recording "
                             "it\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return acked

    return send


class RunEnd(NamedTuple):
    """How a run ended: its length and rate (jobs done a second), and, for a run
    that ended idle (--until-idle, no signal), the keys blocked by a dead first
    job (``Store.blocked_heads``; None when not asked)."""

    seconds: float
    rate: float
    blocked: Optional[list[dict]]


async def _dispatch(dispatcher: Dispatcher, until_idle: bool, banner: str,
                    metrics: Optional[tuple[str, int]] = None) -> RunEnd:
    import asyncio

    from asyncworker.dispatcher import run_until_signalled

    # Bound before the queue is opened: a port taken is exit 2 with nothing claimed.
    served = None if metrics is None else await _serve_metrics(dispatcher, *metrics)
    signalled: list[str] = []
    started = time.monotonic()

    def on_stop(line: str) -> None:
        signalled.append(line)
        _say(line)

    try:
        async with dispatcher:
            progress = asyncio.create_task(_progress(dispatcher.stats), name="progress")
            blocked = None
            try:
                await run_until_signalled(
                    dispatcher, until_idle=until_idle, on_stop=on_stop,
                    # printed once a signal means a graceful stop: a supervisor may wait for it
                    on_ready=lambda: _say(banner, owner=dispatcher.owner))
                if until_idle and not signalled:  # idle: is anything blocked?
                    blocked = await dispatcher.queue.call(lambda store: store.blocked_heads())
            finally:
                progress.cancel()
                seconds = time.monotonic() - started
                rate = dispatcher.stats.ok / seconds if seconds > 0 else 0.0
                _show_progress(dispatcher.stats, rate, final=True)
            if dispatcher.aborted:
                _say_left_leased(dispatcher.left_leased)
            if blocked:
                _say_blocked(blocked)
            return RunEnd(seconds, rate, blocked)
    finally:
        if served is not None:
            await served.cleanup()


def _say_left_leased(left: list[dict]) -> None:
    """An aborted run's last line: the leases it left to run out, by id/token."""
    if not left:
        _say("aborted: no job left leased", leases_left=left)
        return
    last = max(one["lease_until"] for one in left)
    named = " ".join(f"{one['id']}/{one['token']}" for one in left[:SHOW_EACH])
    more = f" and {len(left) - SHOW_EACH} more" if len(left) > SHOW_EACH else ""
    _say(f"aborted: {_count(len(left), 'job')} left leased, to be claimed again once their "
         f"leases run out (the last at {_when(last)}): {named}{more}", leases_left=left)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _say_blocked(blocked: list[dict]) -> None:
    """An idle run's last line: each key blocked by a dead first job, and that job."""
    named = ", ".join(f"{one['key']} (dead head {one['id']}, {one['reason']}; "
                      f"{one['waiting']} waiting)" for one in blocked[:SHOW_EACH])
    more = f" and {len(blocked) - SHOW_EACH} more" if len(blocked) > SHOW_EACH else ""
    _say(f"idle: {_count(len(blocked), 'ordering key')} blocked by a dead job, nothing to "
         f"claim until it is redriven or cancelled: {named}{more}", blocked_heads=blocked)


async def _serve_metrics(dispatcher: Dispatcher, host: str, port: int) -> Any:
    """/metrics and /healthz on this loop while the dispatcher runs; the URL on stderr."""
    from asyncworker.metrics import start_metrics_server

    try:
        runner, url = await start_metrics_server(dispatcher, host, port)
    except OSError as exc:  # taken, not this host's address, or a name that does not resolve
        raise UsageError(f"--metrics {host}:{port}: cannot serve there: "
                         f"{exc.strerror or exc}") from None
    _say(f"metrics: {url}/metrics and /healthz", metrics_url=f"{url}/metrics",
         health_url=f"{url}/healthz")
    return runner


def _say(line: str, **fields: Any) -> None:
    """One of run's own lines (banner, metrics URL, stop notices, progress): as it
    is, or with --log-format json one object with its facts as keys."""
    from asyncworker.logs import say

    say(line, "asyncworker.run", **fields)


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
            f"unrecorded-busy {stats.unrecorded_busy}  "
            f"bad-acks {stats.bad_acks}  errors {stats.errors}  in flight {stats.in_flight}  "
            f"sending {stats.sending}  rate {rate:.0f}/s"
            f"{f'  left leased {stats.left_leased}' if stats.left_leased else ''}")


def _show_progress(stats: DispatcherStats, rate: float, *, final: bool = False) -> None:
    line = progress_line(stats, rate)
    from asyncworker.logs import current_format

    if current_format() == "json":  # one object a line, the figures as keys
        _say(("summary: " if final else "") + line, **stats.as_dict(), rate=round(rate, 1))
    elif sys.stderr.isatty():  # one live line, redrawn in place
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


# ------------------------------------------------------------------ serve


def _serve(args: argparse.Namespace) -> int:
    # The flags' files first, before aiohttp is even imported; serve checks the
    # rest (the host with the secrets, the path, the inbox) before it binds.
    served_tls(args)
    secrets = None if args.secret_file is None else read_secret_file(args.secret_file)
    if args.signature_tolerance_s is not None and secrets is None:
        raise UsageError("--signature-tolerance-s goes with --secret-file")
    from asyncworker import eventloop
    from asyncworker.receiver import Faults, serve

    faults = Faults(latency_ms=args.latency_ms, p_503=args.p_503, p_drop=args.p_drop,
                    seed=args.seed)
    loop = _usable_loop(args.loop)
    eventloop.tune_gc()  # this process is the receiver's own
    try:
        eventloop.run(serve(args.inbox, args.host, args.port, faults=faults, max_group=args.group,
                            secrets=secrets, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            tolerance_s=args.signature_tolerance_s or TOLERANCE_S,
                            path=args.path), loop)
    except BrokenPipeError:
        raise
    # The receiver refuses before it binds or prints its URL: a foreign or damaged
    # inbox, a network address without a secret, a bad path (ValueError, or
    # SQLite's own error), or a port it cannot bind (OSError).
    except ValueError as exc:  # the receiver's message names the file or the flag
        raise UsageError(str(exc)) from None
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"--inbox {args.inbox}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{args.host} port {args.port}: {exc.strerror or exc}") from None
    return EXIT_OK


# ------------------------------------------------------------------ looking


def _stats_url(url: str, ca_file: Optional[str] = None, insecure_http: bool = False,
               allow: Optional[str] = None) -> str:
    """The /stats beside a receiver's POST URL, by the senders' rule for the URL
    (https anywhere, plain http to loopback unless insecure_http); else ValueError,
    naming ``allow`` (a command's flag) as what allows plain http, if any does."""
    from urllib.parse import urlsplit

    from lease.http import Destination, PlainHttpRefused

    try:
        Destination(url, ca_file=ca_file, insecure_http=insecure_http)
    except PlainHttpRefused as exc:
        raise PlainHttpRefused(exc.host, allow) from None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/stats"


def receiver_stats(url: str, ca_file: Optional[str] = None, insecure_http: bool = False
                   ) -> dict:
    """GET the receiver's /stats: no proxy read, no redirect followed, https with
    its certificate verified (against ``ca_file`` only, when given)."""
    import ssl
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None  # a 3xx is an answer, not a receiver's stats

    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({}),
                                                  NoRedirect()]
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=ca_file)
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(_stats_url(url, ca_file, insecure_http), timeout=10) as answer:
        found = json.loads(answer.read(1 << 20))
    if not isinstance(found, dict):
        raise ValueError(f"a JSON {type(found).__name__}, not an object")
    return found


def _stats(args: argparse.Namespace) -> int:
    reached(args, "--receiver", args.receiver)  # checked before the queue is opened
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        snap = store.snapshot()  # at the store's clock: a database's is its server's
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
    _print_table(_stats_rows(snap))
    return EXIT_OK


def _stats_rows(snap: dict) -> list[tuple]:
    age = snap["oldest_unfinished_age_ms"]
    rows: list[tuple] = [("jobs", snap["jobs"])]
    rows += [(f"  {status}", n) for status, n in snap["by_status"].items()]
    rows += [("oldest unfinished", "-" if age is None else f"{age} ms"),
             ("expired leases", snap["expired_leases"]),
             ("attempts", " ".join(f"{k}:{v}" for k, v in snap["attempts"].items()) or "-"),
             ("dead by reason", " ".join(f"{k}:{v}" for k, v in snap["dead_by_reason"].items())
              or "-"),
             ("redrives", f"{snap['redrives']} ({snap['redriven_jobs']} jobs)")]
    # What only a product file records: absent on a contract file, not shown as 0.
    for key, label in (("cancels", "cancels"), ("attempts_recorded", "attempts recorded"),
                       ("stale_finishes", "stale finishes"),
                       ("blocked_keys", "blocked keys"),
                       ("blocked_jobs", "jobs behind them")):
        if key in snap:
            rows.append((label, snap[key]))
    for key, value in snap.get("receiver", {}).items():
        rows.append((f"receiver {key}", value))
    return rows


_JOB_COLUMNS = ("id", "qty", "status", "reason", "attempts", "max_attempts", "token")


def _event_cell(job: dict) -> object:
    """A payload job (qty 0, a body) shows its body's size where a lab job shows its qty."""
    body = job.get("body")
    return job["qty"] if body is None else f"body {len(body.encode())} B"


def _dead(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        jobs = store.dead_jobs(args.reason, args.limit, key=args.key)
    if args.json:  # every column of each row, as stored (a key and a last error included)
        print(json.dumps(jobs, indent=2, ensure_ascii=False))
    elif jobs:
        has = jobs[0].keys()
        columns = (_JOB_COLUMNS[:1] + (("key",) if "ordering_key" in has else ())
                   + _JOB_COLUMNS[1:] + (("last_error",) if "last_error" in has else ()))
        _print_table([columns] + [
            tuple(_event_cell(j) if c == "qty" else _cell(j["ordering_key" if c == "key" else c])
                  for c in columns) for j in jobs])
    sys.stdout.flush()  # the table first, then its count, in a terminal too
    print(f"{len(jobs)} dead", file=sys.stderr)
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        history = store.job_history(args.id)
    if history is None:
        raise WorkFailed(f"no job {args.id!r} in {shown(args.queue)}")
    if args.json:
        print(json.dumps(history, indent=2, ensure_ascii=False))
    else:
        _print_history(history)
    return EXIT_OK


def _print_history(history: dict) -> None:
    """The job as name/value lines, then a table per kind of record."""
    job = history["job"]
    rows: list[tuple] = [
        ("id", job["id"]),
        *((("key", _cell(job["ordering_key"])),) if "ordering_key" in job else ()),
        ("event", _event_cell(job)),
        ("status", job["status"] if job["reason"] is None else f"{job['status']} "
                                                              f"({job['reason']})"),
        ("attempts", f"{job['attempts']} of {job['max_attempts']}"),
        ("token", job["token"]),
        ("available at", _when(job["available_at"])),
        ("deadline", _when(job["deadline"])),
        ("owner", _cell(job["owner"])),
        ("lease until", _when(job["lease_until"])),
    ]
    if job.get("body") is not None:
        rows.append(("body", _cell(job["body"], 100)))
        rows.append(("body sha256", job["digest"]))
    _print_table(rows)
    if "attempts" not in history:
        print("\nattempts: not recorded in this file's version (a command that writes "
              "migrates it)")
    else:
        _print_records("attempts", history["attempts"], (
            ("token", "token"), ("attempt", "attempt"), ("owner", "owner"),
            ("started", lambda a: _when(a["started_ms"])), ("outcome", "outcome"),
            ("result", lambda a: a["result"] if a["reason"] is None
             else f"{a['result']}/{a['reason']}"),
            ("http or error", _seen),
            ("latency", lambda a: "-" if a["latency_ms"] is None else f"{a['latency_ms']} ms")))
    _print_records("redrives", history["redrives"], (
        ("token", "token"), ("at", lambda r: _when(r["at_ms"])), ("note", "note"),
        *_actor_column(history["redrives"])))
    if "cancels" in history:
        _print_records("cancels", history["cancels"], (
            ("token", "token"), ("at", lambda r: _when(r["at_ms"])), ("was", "was"),
            ("note", "note"), *_actor_column(history["cancels"])))


def _actor_column(records: list[dict]) -> tuple:
    """Who made each audit row (the page's operator; '-' for a command), where recorded."""
    return (("actor", "actor"),) if records and "actor" in records[0] else ()


def _seen(attempt: dict) -> str:
    """What an attempt saw: its error, else its HTTP status."""
    if attempt["error"] is not None:
        return attempt["error"]
    return "-" if attempt["http_status"] is None else f"HTTP {attempt['http_status']}"


def _print_records(title: str, records: list[dict], columns: tuple) -> None:
    print(f"\n{title}: {len(records) or 'none'}")
    if records:
        _print_table([tuple(name for name, _ in columns)] + [
            tuple(_cell(get(r) if callable(get) else r[get], 80) for _, get in columns)
            for r in records])


# ------------------------------------------------------------------ the operator


def apply_in_chunks(ids: list[str], apply: Callable[[list[str]], list],
                    done: str) -> list[tuple[str, object]]:
    """(id, True or its ValueError) for each id, MAX_BATCH per transaction.

    A failure part-way (a store error) leaves the chunks before it whole
    and the rest untouched; it is raised as WorkFailed with that count."""
    results: list[tuple[str, object]] = []
    for start in range(0, len(ids), MAX_BATCH):
        chunk = ids[start:start + MAX_BATCH]
        try:
            answers = apply(chunk)
        except StoreError as exc:
            count = sum(answer is True for _, answer in results)
            raise WorkFailed(f"{exc}; {count} {done} before it, the rest untouched") from None
        results += zip(chunk, answers, strict=True)
    return results


def _bulk_ids(args: argparse.Namespace, store: Store, ids: list[str]) -> list[str]:
    """The ids given, or every dead job of --reason (of --key alone if given, at
    most --limit), in the store's order."""
    if ids:
        return ids
    return [job["id"] for job in store.dead_jobs(args.reason, args.limit, key=args.key)]


def _check_bulk(args: argparse.Namespace, ids: list[str]) -> None:
    what = "a job ID" if args.command == "redrive" else "job IDs"
    if args.key is not None and args.reason is None:
        # --key narrows the dead jobs a bulk picks: a job named by its id is that job
        raise UsageError(f"--key goes with --reason: it narrows a bulk {args.command} to "
                         "the dead jobs of one ordering key (a job given by ID is that job, "
                         "whatever its key)")
    if bool(ids) == (args.reason is not None):
        raise UsageError(f"give either {what} or --reason")
    if ids and (args.limit is not None or args.dry_run):
        raise UsageError("--limit and --dry-run go with --reason")


def _redrive(args: argparse.Namespace) -> int:
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
    return _print_outcome(done, refused, args, "redriven")


def _print_outcome(done: list[str], refused: list[str], args: argparse.Namespace,
                   past: str) -> int:
    _print_bounded(done, args.verbose, sys.stdout)
    sys.stdout.flush()
    _print_bounded(refused, args.verbose, sys.stderr)
    sys.stderr.flush()
    print(f"{len(done)} {past}, {len(refused)} refused")
    return EXIT_FAILED if refused else EXIT_OK


def _dry_run(args: argparse.Namespace, verb: str) -> int:
    """The dead jobs of --reason (and --key), listed from a read-only look: nothing
    changes, not even a migration."""
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        ids = _bulk_ids(args, store, [])
    _print_bounded([f"would {verb} {job_id}" for job_id in ids], args.verbose, sys.stdout)
    print(f"{len(ids)} to {verb} (dry run, nothing changed)")
    return EXIT_OK


def _cancel(args: argparse.Namespace) -> int:
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
    return _print_outcome(done, refused, args, "cancelled")


def _ui(args: argparse.Namespace) -> int:
    from asyncworker.ui import serve_ui  # aiohttp only for the commands that serve

    return serve_ui(args)


def _prune(args: argparse.Namespace) -> int:
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
    print(f"{pruned} done jobs pruned (finished before {_when(cutoff)})")
    return EXIT_OK


def _prune_inbox(args: argparse.Namespace) -> int:
    if not os.path.exists(args.inbox):
        raise UsageError(f"inbox file not found: {args.inbox}")
    if not os.path.isfile(args.inbox):
        raise UsageError(f"not a file: {args.inbox}")
    from asyncworker.inbox import prune_inbox

    now = wall_clock_ms()
    try:
        pruned = prune_inbox(args.inbox, min(args.older_than, now), now_ms=now)
    except sqlite3.OperationalError:  # locked, read-only, I/O: the work failed, exit 1
        raise
    except (ValueError, sqlite3.DatabaseError) as exc:  # not an inbox: usage, exit 2
        raise UsageError(f"{args.inbox}: {exc}") from None
    print(f"{pruned} inbox rows pruned (first seen before "
          f"{_when(max(0, now - args.older_than))})")
    return EXIT_OK


# ------------------------------------------------------------------ the rest


def _bench(args: argparse.Namespace) -> int:
    from asyncworker.bench import run_bench
    from lease.stores import is_postgres_url

    if args.store is not None and args.store != "postgres" and not is_postgres_url(args.store):
        # refused before the SQLite table runs, not after it
        raise UsageError(f"--store must be a postgresql:// URL or 'postgres' (a server "
                         f"started for the run), got {args.store!r:.80}")
    try:
        run_bench(quick=args.quick, peers=args.peers, store=args.store, pin=args.pin)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from asyncworker.demo import run_demo

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


def _quiet_exit_on_broken_pipe() -> int:
    # The Python docs' recipe (library/signal, "Note on SIGPIPE"): the reader
    # has gone; point stdout at devnull so the interpreter's final flush
    # cannot fail again, and exit without a word.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILED


def _named(args: argparse.Namespace) -> Optional[str]:
    return getattr(args, "queue", None) or getattr(args, "store", None) or getattr(
        args, "inbox", None)




def _configure_logs(args: argparse.Namespace) -> None:
    from asyncworker.logs import configure

    level = args.log_level or ("info" if args.command == "run" else "warning")
    configure(level, args.log_format)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):  # a file name that is not UTF-8, printed
        sys.stdout.reconfigure(errors="backslashreplace")
    args = argparse.Namespace(command=None)
    try:
        args = build_parser().parse_args(argv)  # bad arguments: exit 2 with one line
        _configure_logs(args)
        code = int(args.handler(args))
        sys.stdout.flush()  # a reader that left shows here, inside the guard
        return code
    except BrokenPipeError:
        return _quiet_exit_on_broken_pipe()
    except UsageError as exc:
        return _fail(args, f"error: {exc}", EXIT_USAGE)
    except WorkFailed as exc:
        return _fail(args, str(exc), EXIT_FAILED)
    except NotAQueue as exc:  # found after the open (a table gone meanwhile, say)
        return _fail(args, f"error: {about(_named(args), exc)}", EXIT_USAGE)
    except StoreError as exc:  # locked, read-only, a server unreachable or refusing us
        return _fail(args, about(_named(args), exc), EXIT_FAILED)
    except sqlite3.Error as exc:  # an inbox's file: read-only, locked or damaged
        return _fail(args, about(_named(args), exc), EXIT_FAILED)
    except OSError as exc:
        return _fail(args, str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    name = _named(args)
    for password in _passwords(name) if name else ():  # whatever a driver's message quoted
        message = message.replace(password, "***")
    from asyncworker.logs import current_format, say

    if current_format() == "json":  # the error as the object of a record, its facts as keys
        say(one_line(message), f"asyncworker.{args.command}", "error", exit_code=code)
    else:
        _log(f"asyncworker {args.command}: {one_line(message)}\n")
    return code
