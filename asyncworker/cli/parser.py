"""The command line's arguments: ``build_parser``, every command's options
and their types, each option checked as it is parsed (a bad one is one line
and exit code 2, before anything is opened). Each command's handler lives in
its group's module (``intake``, ``running``, ``reads``, ``actions``,
``launchers``)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from asyncworker.cli import actions, endpoints, intake, launchers, reads, running
from asyncworker.cli.config import add_config_argument
from asyncworker.cli.exits import EXIT_CODES, EXIT_USAGE
from asyncworker.cli.output import AGE_UNITS, SHOW_EACH, duration
from asyncworker.operations import DEAD_REASONS, one_line
from lease.breaker import DISABLE_AFTER_MS
from lease.endpoints import MAX_BURST, MAX_IN_FLIGHT, MAX_RATE, check_endpoint_name
from lease.policy import (
    DEFAULT_POLICY,
    MAX_BODY_BYTES,
    PRODUCT,
    check_actor,
    check_event_type,
    check_note,
    check_ordering_key,
    check_product_event,
)
from lease.queues import check_queue_name
from lease.rules import check_error_filter, status_range
from lease.signing import TOLERANCE_S
from lease.worker import MAX_BATCH, MAX_QTY, check_identifier, check_job_id, parse_json

ACK_POLICIES = ("echo-id", "status")
MAX_AGE_MS = 36_500 * AGE_UNITS["d"]  # a hundred years: far beyond any retention
NEVER = endpoints.NEVER  # --disable-after never: the breaker never disables the endpoint
MIN_DISABLE_AFTER_MS, MAX_DISABLE_AFTER_MS = AGE_UNITS["m"], 365 * AGE_UNITS["d"]


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


def _scrape_interval(text: str) -> float:
    """--interval: seconds, 0..3600 (0 reads the store at every scrape)."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", text):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r:.40}")
    value = float(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in 0..3600 seconds, got {text}")
    return value


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


def _actor(text: str) -> str:
    try:
        checked = check_actor(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert checked is not None
    return checked


def _event_type(text: str) -> str:
    try:
        return check_event_type(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _subscription(text: str) -> str:
    """--type of an endpoint: an event type, or '*' (every type)."""
    return text if text == "*" else _event_type(text)


def _endpoint_name(text: str) -> str:
    try:
        return check_endpoint_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"an endpoint's name is 1-64 ASCII letters, digits, '_' or '-': {text!r:.80}"
        ) from None


def _rate(text: str) -> float:
    """--rate: requests a second, a positive finite number up to MAX_RATE."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", text):
        raise argparse.ArgumentTypeError(f"not a number of requests a second: {text!r:.40}")
    value = float(text)
    if not 0 < value <= MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_RATE:g}, "
                                         f"got {text}")
    return value


def parse_age(text: str) -> int:
    """AGE as 7d, 12h, 30m, 90s, 250ms or a plain number of milliseconds."""
    found = re.fullmatch(r"([0-9]{1,20})(d|h|m|s|ms|)", text)
    if not found:
        raise argparse.ArgumentTypeError(
            f"not an age (7d, 12h, 30m, 90s or milliseconds): {text!r:.40}")
    age_ms = int(found.group(1)) * AGE_UNITS[found.group(2)]
    if age_ms > MAX_AGE_MS:
        raise argparse.ArgumentTypeError(f"at most {MAX_AGE_MS // AGE_UNITS['d']}d, got {text}")
    return age_ms


def _disable_after(text: str) -> int | str:
    """--disable-after: how long an endpoint may fail, with no delivery in
    between, before it is disabled: 1m..365d, or never."""
    if text == "never":
        return NEVER
    try:
        value = parse_age(text)
    except argparse.ArgumentTypeError:
        value = None
    if value is None or not MIN_DISABLE_AFTER_MS <= value <= MAX_DISABLE_AFTER_MS:
        raise argparse.ArgumentTypeError(
            f"a duration of 1m..365d (3d, 12h, 90m) or never, got {text!r:.40}")
    return value


def parse_since(text: str) -> tuple[str, int]:
    """--since: ("at", ms) for an ISO 8601 time (UTC unless it names an offset:
    2026-12-04T17:00:00Z, 2026-12-04 19:00+02:00, 2026-12-04), or ("ago", ms)
    for an age with its unit (2h, 30m: parse_age's, before now by the queue's
    clock). A bare number is refused: milliseconds or a year?"""
    if re.fullmatch(r"[0-9]{1,20}(d|h|m|s|ms)", text):
        return "ago", parse_age(text)
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or not re.match(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
        raise argparse.ArgumentTypeError(
            f"an ISO 8601 time (2026-12-04T17:00:00Z; UTC without an offset) or an age "
            f"before now (2h, 30m, 7d), got {text!r:.60}")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    ms = int(moment.timestamp() * 1000)
    if ms < 0:
        raise argparse.ArgumentTypeError(f"a time after 1970, got {text!r:.60}")
    return "at", ms


def _reason(text: str) -> str:
    if text not in DEAD_REASONS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(DEAD_REASONS)}: {text!r}")
    return text


def _ordering_key(text: str) -> str:
    try:
        return check_ordering_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


# ------------------------------------------------------------------ the parser

PRUNE_INBOX_HELP = f"""\
delete the inbox's rows first seen more than AGE ago, in short batches (safe
beside a running serve). The trade-off: the inbox absorbs a duplicate only
while it keeps that id's row. A pruned row is a duplicate no longer absorbed:
a resend of that id after the window is applied again. Pick a window longer
than the senders' whole retry budget (a job's time to live: {duration(DEFAULT_POLICY.ttl_ms)}
by default) plus the time a stale sender may still be sending."""


QUEUE_HELP = ("the queue: a SQLite file's path, or a postgresql:// URL "
              "(postgresql://USER@HOST[:PORT]/DATABASE, or postgresql:///?service=NAME; "
              "the password from PGPASSFILE, ~/.pgpass or PGPASSWORD, never the URL)")


def _queue_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue", metavar="QUEUE", help=f"{QUEUE_HELP}; it must exist")
    _queue_name_argument(p)


def _queue_name(text: str) -> str:
    """The name as given ("default" too: given, it wins over the environment)."""
    try:
        check_queue_name(text)
        return text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _queue_name_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--queue-name", metavar="NAME", type=_queue_name, default=None,
                   help="a named queue of QUEUE's database (its schema lease_NAME) or beside "
                        "QUEUE's file (STEM.NAME.SUFFIX: queue.db's orders is "
                        "queue.orders.db); default: the default queue. Also "
                        "ASYNCWORKER_QUEUE_NAME, for every command (docs/queues.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="asyncworker",
                    description="A durable job dispatcher on one SQLite file, or on one "
                                "PostgreSQL database shared by many hosts. QUEUE is a file's "
                                "path or a postgresql:// URL.")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=Parser)

    def command(name: str, help_text: str, handler: Callable[[argparse.Namespace], int],
                description: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=description or help_text)
        sub.set_defaults(handler=handler)
        _log_arguments(sub)
        return sub

    p = command("init", "create a queue (a file, or the tables in a PostgreSQL database), "
                "or migrate an older one forward", intake.init,
                "create a queue: a SQLite file, or the queue's tables (schema \"lease\") in "
                "a PostgreSQL database; an existing queue is kept, and one written by an "
                "older version (a file of the contract's schema) is migrated forward once, in "
                "one transaction, every row kept")
    p.add_argument("queue", metavar="QUEUE",
                   help="the queue to create or bring to this version: a file's path, or a "
                        "postgresql:// URL of an existing database")
    _queue_name_argument(p)
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
                               "JSON lines with --file", intake.enqueue))
    p = command("run", "dispatch jobs to a receiver with the async dispatcher", running.run)
    _run_arguments(p)
    add_config_argument(p)

    p = command("serve", "run the receiver (an inbox that deduplicates)", running.serve)
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
    add_config_argument(p)

    p = command("stats", "counts by status, oldest unfinished age, attempts, dead, redrives, "
                "cancels, stale finishes (reads only)", reads.stats)
    _queue_argument(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--receiver", metavar="URL", default=None,
                   help="also show this receiver's counters (the URL it receives on: https, "
                        "or http to loopback)")
    _tls_arguments(p, reaches="--receiver")

    p = command("dead", "list dead jobs, each one's ordering key and last error (reads only)",
                reads.dead)
    _queue_argument(p)
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"only this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--key", metavar="KEY", type=_ordering_key, default=None,
                   help="only dead jobs with this ordering key (exactly)")
    _dead_filter_arguments(p, "only")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="at most N jobs")
    p.add_argument("--json", action="store_true",
                   help="the dead jobs as a JSON array of their rows (each with its ordering "
                        "key and last error)")

    p = command("inspect", "a job's row, every attempt, its redrives and cancels (reads only)",
                reads.inspect)
    _queue_argument(p)
    p.add_argument("id", type=_job_id, help="job id")
    p.add_argument("--json", action="store_true", help="the whole record as JSON")

    _operator_commands(command)
    _endpoint_commands(commands)

    p = command("bench", "measure throughput and latency against their limits", launchers.bench)
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
    p.add_argument("--endpoints", action="store_true",
                   help="measure the endpoint targets instead (the claim with 10,000 "
                        "endpoints, fairness, fan-out), on SQLite and with --store on "
                        "PostgreSQL")
    p.add_argument("--full-size", action="store_true",
                   help="with --endpoints: 1,000,000 ready deliveries (default 100,000)")

    p = command("demo", "the crash-after-ACK story, end to end, on loopback", launchers.demo)
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
                   help="UTF-8 JSON lines, {\"id\", \"qty\"} or {\"id\", \"body\": {...}}, each "
                        "with an optional \"key\" and \"type\" (a "
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
    p.add_argument("--type", metavar="TYPE", type=_event_type,
                   help="event type (invoice.paid, user/created: 1-100 letters, digits or "
                        "_ . : / -): a queue's endpoints subscribe by it (given to every "
                        "event that has no \"type\" of its own)")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, PRODUCT.max_ttl_ms),
                   default=DEFAULT_POLICY.ttl_ms,
                   help=f"time to live from the first moment it may run, up to "
                        f"{duration(PRODUCT.max_ttl_ms)} "
                        f"(default {duration(DEFAULT_POLICY.ttl_ms)})")
    p.add_argument("--max-attempts", metavar="N", type=_int_in(1, PRODUCT.max_attempts),
                   default=DEFAULT_POLICY.max_attempts,
                   help=f"attempt budget, 1..{PRODUCT.max_attempts} "
                        f"(default {DEFAULT_POLICY.max_attempts})")
    p.add_argument("--delay-ms", metavar="MS", type=_int_in(0, PRODUCT.max_delay_ms), default=0,
                   help=f"delayed delivery: no attempt before now + MS, up to "
                        f"{duration(PRODUCT.max_delay_ms)} (default 0)")


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


def _run_arguments(p: argparse.ArgumentParser) -> None:
    _queue_argument(p)
    p.add_argument("--url", metavar="URL", default=None,
                   help="the receiver of the queue's own jobs: https://HOST[:PORT]/PATH (its "
                        "certificate and host name verified), or http:// to a loopback "
                        "address (127.0.0.1, ::1, localhost); plain http to any other host "
                        "only with --insecure-plain-http. Without --url: the deliveries to "
                        "the queue's endpoints (asyncworker endpoint), each sent as its "
                        "endpoint says")
    p.add_argument("--endpoint", metavar="NAME", dest="endpoints", action="append",
                   type=_endpoint_name, default=None,
                   help="without --url: serve only this endpoint's deliveries (repeatable; "
                        "default every endpoint of the queue, those added later included)")
    _destination_arguments(p)
    p.add_argument("--concurrency", metavar="N", type=_int_in(1, 10_000), default=16,
                   help="sends in flight (default 16)")
    p.add_argument("--lease-ms", metavar="MS", type=_int_in(1, PRODUCT.max_lease_ms),
                   default=DEFAULT_POLICY.lease_ms,
                   help=f"lease per claim, up to {duration(PRODUCT.max_lease_ms)} "
                        f"(default {duration(DEFAULT_POLICY.lease_ms)})")
    p.add_argument("--send-timeout", metavar="DURATION", type=parse_age, default=None,
                   help="how long one send may take: 30s, 5m, 2h or milliseconds, up to the "
                        f"retry budget (a job's time to live, {duration(DEFAULT_POLICY.ttl_ms)}); "
                        "longer than the lease, the lease is extended while the send runs "
                        "(default: what the lease leaves when the send starts, less the time "
                        "kept for the finish, a fifth of the lease up to 2 s). A send starts "
                        "only when its lease can cover it: one capped by the job's deadline "
                        "with too little left is retried, unsent")
    p.add_argument("--backoff-base-ms", metavar="MS", type=_int_in(1, PRODUCT.max_delay_ms),
                   default=DEFAULT_POLICY.backoff_base_ms,
                   help=f"first retry delay, doubling each attempt "
                        f"(default {duration(DEFAULT_POLICY.backoff_base_ms)})")
    p.add_argument("--backoff-cap-ms", metavar="MS", type=_int_in(1, PRODUCT.max_delay_ms),
                   default=DEFAULT_POLICY.backoff_cap_ms,
                   help=f"longest retry delay, up to {duration(PRODUCT.max_delay_ms)} "
                        f"(default {duration(DEFAULT_POLICY.backoff_cap_ms)})")
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
    p.add_argument("--no-endpoint-label", dest="endpoint_label", action="store_false",
                   help="the deliveries' metrics without their endpoint label: totals only, "
                        "one series each however many endpoints (for a queue of very many "
                        "endpoints; by default a series per endpoint served)")


def _destination_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ack", choices=ACK_POLICIES, default=None,
                   help="what counts as delivered: echo-id (default) a 2xx JSON object naming "
                        "the job's id, the receiver's proof it read this request; status any "
                        "2xx (the webhook convention: weaker evidence, see the README)")
    _tls_arguments(p, reaches="--url",
                   secret="sign every request (Standard Webhooks) with the whsec_ secrets in "
                          "this file, one a line (# comments); two during a rotation")


def _tls_arguments(p: argparse.ArgumentParser, *, serves: bool = False,
                   reaches: str | None = None, secret: str | None = None) -> None:
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
                actions.redrive)
    _queue_argument(p)
    p.add_argument("id", nargs="?", type=_job_id, default=None, help="one dead job's id")
    p.add_argument("--reason", metavar="REASON", type=_reason, default=None,
                   help=f"bulk: every dead job of this reason ({', '.join(DEAD_REASONS)})")
    p.add_argument("--note", metavar="NOTE", type=_note, required=True,
                   help="audit note: free text, 1-500 characters, no control characters")
    p.add_argument("--ttl-ms", metavar="MS", type=_int_in(1, PRODUCT.max_ttl_ms),
                   default=DEFAULT_POLICY.ttl_ms,
                   help=f"time to live from now, up to {duration(PRODUCT.max_ttl_ms)} "
                        f"(default {duration(DEFAULT_POLICY.ttl_ms)})")
    _bulk_arguments(p)

    p = command("cancel", "cancel pending or dead jobs with a note, one audit row each",
                actions.cancel, "cancel pending or dead jobs: each becomes dead/cancelled with an "
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

    for verb, help_text in (
            ("pause", "pause the queue: every claim, on every host, leases nothing until "
                      "resume (leases in flight finish); audited with the note"),
            ("resume", "resume a paused queue: dispatchers claim again; audited with the note")):
        p = command(verb, help_text, getattr(actions, verb))
        _queue_argument(p)
        p.add_argument("--note", metavar="NOTE", type=_note, required=True,
                       help="audit note: free text, 1-500 characters, no control characters")
        p.add_argument("--actor", metavar="NAME", type=_actor, default=None,
                       help="who does it, for the audit row (1-100 characters)")

    p = command("prune", "delete done jobs that finished more than AGE ago, with their "
                "evidence", actions.prune, "delete done jobs that finished more than AGE ago, with "
                "their attempts and audit rows, in short transactions of up to "
                f"{MAX_BATCH}. Pending, leased and dead jobs are never touched. An id whose "
                "job was pruned is new again: enqueued again, it is a new job.")
    _queue_argument(p)
    p.add_argument("--older-than", metavar="AGE", type=parse_age, required=True,
                   help="7d, 12h, 30m, 90s, or milliseconds")

    p = command("ui", "serve the operator's web page for QUEUE (read-only unless "
                "--allow-changes)", launchers.ui,
                "serve the operator's web page: the queue by status, jobs with their evidence, "
                "dead letters by reason with bulk redrive and cancel. Read-only unless "
                "--allow-changes; loopback only unless --token-file is given (then https, or "
                "--insecure-plain-http); it answers only to the bound address's names and "
                "--allowed-host; every change is a POST with a CSRF token from the page itself.")
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
    add_config_argument(p)

    p = command("metrics", "serve the queue's own metrics for Prometheus (reads only)",
                launchers.metrics,
                "serve /metrics of QUEUE: jobs by status, ready now and the oldest's age, "
                "blocked keys, endpoints by state, and per endpoint the same. The store is "
                "read at most once per --interval however many scrape; read-only; loopback "
                "unless --host; it answers only to the bound address's names and "
                "--allowed-host. The page (asyncworker ui) serves the same at /metrics.")
    _queue_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_int_in(0, 65535), default=9465,
                   help="port (default 9465; 0 picks a free one); the URL is printed first")
    p.add_argument("--allowed-host", metavar="NAME", action="append", default=[],
                   help="a name it answers to besides the bound address's own: NAME at any "
                        "port, or NAME:PORT; repeatable")
    p.add_argument("--interval", type=_scrape_interval, default=None, metavar="SECONDS",
                   help="read the store at most once per SECONDS (by default 15, a "
                        "scrape interval); scrapes between reads get the last figures")
    p.add_argument("--no-endpoint-label", dest="endpoint_label", action="store_false",
                   help="no series per endpoint (for very many endpoints): the counts of "
                        "endpoints by state stay")

    p = command("prune-inbox", "delete inbox rows first seen more than AGE ago (see the "
                "trade-off in its --help)", actions.prune_inbox, PRUNE_INBOX_HELP)
    p.add_argument("inbox", help="existing inbox file")
    p.add_argument("--older-than", metavar="AGE", type=parse_age, required=True,
                   help="7d, 12h, 30m, 90s, or milliseconds; longer than the senders' retry "
                        "budget")


def _bulk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", metavar="KEY", type=_ordering_key, default=None,
                   help="bulk, with --reason: only dead jobs with this ordering key "
                        "(exactly; not with a job ID)")
    _dead_filter_arguments(p, "bulk, with --reason: only")
    p.add_argument("--limit", metavar="N", type=_int_in(1, 10**9), default=None,
                   help="bulk: at most N jobs")
    p.add_argument("--dry-run", action="store_true", help="bulk: list, change nothing")
    p.add_argument("--verbose", action="store_true",
                   help=f"a line per job however many (by default only up to {SHOW_EACH})")


def _dead_filter_arguments(p: argparse.ArgumentParser, only: str) -> None:
    """The dead letters' narrower filters: the last attempt's error and HTTP
    status, and when they went dead (the page's filters, by the same rules)."""
    p.add_argument("--error", metavar="TEXT", type=_error_filter, default=None,
                   help=f"{only} dead jobs whose last attempt's error contains TEXT "
                        "(case-sensitive)")
    p.add_argument("--http-status", metavar="STATUS", type=_http_status, default=None,
                   help=f"{only} dead jobs whose last attempt got this HTTP status: 503, "
                        "or a class, 5xx")
    p.add_argument("--since", metavar="TIME", type=parse_since, default=None,
                   help=f"{only} jobs gone dead at or after TIME: ISO 8601 "
                        "(2026-12-04T17:00:00Z; UTC without an offset) or an age before "
                        "now (2h, 30m)")
    p.add_argument("--until", metavar="TIME", type=parse_since, default=None,
                   help=f"{only} jobs gone dead before TIME (as --since)")


def _error_filter(text: str) -> str:
    try:
        return check_error_filter(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("error must be", "must be")) from None


def _http_status(text: str) -> str:
    try:
        status_range(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"an HTTP status (503) or a class (5xx), got {text!r:.20}") from None
    return text


# ------------------------------------------------------------------ endpoint


ENDPOINT_HELP = """\
a queue's endpoints: the destinations of its messages. Once a queue has one,
each event enqueued is a message that fans out, in its intake's transaction,
to one delivery per endpoint subscribed to its type (--type; '*' takes every
type). A delivery is a job like any other (lease, attempts, dead letter,
redrive, cancel); `run QUEUE` without --url sends them. An endpoint's cap
(--max-in-flight) and rate (--rate, --burst) hold across every dispatcher.
Secrets and header values are read from files only, never shown."""


RECOVER_HELP = """\
send again an endpoint's deliveries that finished (done or dead) since TIME:
after an outage in which the receiver lost what it had acknowledged, or one
that sent them dead. Each is pending again as a new attempt with a fresh
budget (--ttl; attempts from 0), with a redrive audit row (the note and the
actor); a done one keeps its delivering attempt in its history.

Without --confirm it is a dry run, nothing sent: how many, the first ids,
a fingerprint of the set, and the command that confirms. With --confirm
FINGERPRINT exactly the deliveries of that set are sent, and only if the set
is still the one shown; otherwise nothing is sent (exit 1): run the dry run
again. The receiver's inbox absorbs a delivery it already applied (the same
id), so one it had kept is acknowledged again, not applied twice."""


def _endpoint_commands(commands: Any) -> None:
    """``endpoint add|list|show|update|disable|enable|remove QUEUE ...``."""
    group = commands.add_parser("endpoint", help="add, list, show, change and remove a "
                                "queue's endpoints (its messages' destinations)",
                                description=ENDPOINT_HELP)
    actions_ = group.add_subparsers(dest="action", required=True, metavar="ACTION",
                                    parser_class=Parser)

    def action(name: str, help_text: str, description: str | None = None
               ) -> argparse.ArgumentParser:
        sub = actions_.add_parser(name, help=help_text, description=description or help_text)
        sub.set_defaults(handler=endpoints.HANDLERS[name])
        _log_arguments(sub)
        _queue_argument(sub)
        return sub

    p = action("add", "add an endpoint: from now on each message of its types fans out to it",
               "add an endpoint. From now on each message subscribed to its types (--type) "
               "gets a delivery to it; messages enqueued before are not sent to it.")
    p.add_argument("name", metavar="NAME", type=_endpoint_name,
                   help="its name: 1-64 ASCII letters, digits, '_' or '-' (it ends each of "
                        "its deliveries' ids: MESSAGE@NAME)")
    p.add_argument("url", metavar="URL",
                   help="where its deliveries are POSTed: https://HOST[:PORT]/PATH, or "
                        "http:// to a loopback address (another host with "
                        "--insecure-plain-http)")
    _endpoint_options(p, adding=True)

    p = action("list", "the queue's endpoints, one a line (reads only)")
    p.add_argument("--json", action="store_true",
                   help="a JSON array of their public fields (no secret, no header value)")

    p = action("show", "one endpoint: its fields, its deliveries' figures, its audit rows "
               "(reads only)")
    p.add_argument("name", metavar="NAME", type=_endpoint_name, help="the endpoint")
    p.add_argument("--json", action="store_true",
                   help="the whole record as JSON (no secret, no header value)")

    p = action("update", "change an endpoint's fields (only the ones given); an audit row "
               "names the fields changed, never their values")
    p.add_argument("name", metavar="NAME", type=_endpoint_name, help="the endpoint")
    p.add_argument("--url", metavar="URL", default=None, help="a new URL")
    _endpoint_options(p, adding=False)

    for verb, what in (("disable", "its deliveries are kept, and wait; none is claimed "
                        "until it is enabled again (new messages still fan out to it)"),
                       ("enable", "its waiting deliveries are claimed again")):
        p = action(verb, f"{verb} an endpoint: {what}")
        p.add_argument("name", metavar="NAME", type=_endpoint_name, help="the endpoint")
        _audit_options(p)

    p = action("remove", "remove an endpoint (refused while it has live deliveries)",
               "remove an endpoint. Refused, nothing changed, while it has deliveries pending "
               "or in flight: --cancel-deliveries (with --note) cancels the pending ones with "
               "the removal, each with an audit row; one in flight (its send may be on the "
               "wire) refuses the removal still: disable the endpoint, and remove it once "
               "they have finished. Its finished deliveries keep its name.")
    p.add_argument("name", metavar="NAME", type=_endpoint_name, help="the endpoint")
    p.add_argument("--cancel-deliveries", action="store_true",
                   help="cancel its pending deliveries with the removal (needs --note)")
    _audit_options(p)

    p = action("recover", "send again its deliveries finished (done or dead) since a time: "
               "a dry run, then --confirm", RECOVER_HELP)
    p.add_argument("name", metavar="NAME", type=_endpoint_name, help="the endpoint")
    p.add_argument("--since", metavar="TIME", type=parse_since, required=True,
                   help="its deliveries finished since this time: ISO 8601 "
                        "(2026-12-04T17:00:00Z; UTC when no offset is given), or an age "
                        "before now by the queue's clock (2h, 30m, 7d)")
    p.add_argument("--ttl", metavar="DURATION", type=parse_age, default=DEFAULT_POLICY.ttl_ms,
                   help=f"each one's time to live from now: 3d, 12h, 30m or milliseconds "
                        f"(default {duration(DEFAULT_POLICY.ttl_ms)})")
    p.add_argument("--confirm", metavar="FINGERPRINT", default=None,
                   help="send them: the fingerprint the dry run printed; refused, nothing "
                        "sent, when the set is another one by then")
    p.add_argument("--verbose", action="store_true",
                   help=f"the dry run lists every id (by default the first {SHOW_EACH})")
    p.add_argument("--json", action="store_true",
                   help="what was found (and sent) as one JSON object")
    _audit_options(p)


def _audit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--note", metavar="NOTE", type=_note, default=None,
                   help="audit note: free text, 1-500 characters, no control characters")
    p.add_argument("--actor", metavar="NAME", type=_actor, default=None,
                   help="who makes the change, for the audit row (1-100 characters)")


def _endpoint_options(p: argparse.ArgumentParser, *, adding: bool) -> None:
    """add's options; update takes each of them too, and the ways to clear one."""
    keep = "" if adding else " (update: replaces the ones it has)"
    p.add_argument("--ack", choices=ACK_POLICIES, default=None,
                   help="what counts as delivered: echo-id (default) a 2xx JSON object naming "
                        "the delivery's id; status any 2xx")
    p.add_argument("--ca-file", metavar="PATH", default=None,
                   help="an https URL: trust only the CA certificates (PEM) in this file")
    p.add_argument("--secret-file", metavar="PATH", default=None,
                   help=f"sign its requests (Standard Webhooks) with the whsec_ secrets in this "
                        f"file, one a line (# comments; two or more: a rotation, each request "
                        f"signed with every one){keep}; refused if every user may write it, a "
                        f"warning if others may read it")
    p.add_argument("--header-file", metavar="PATH", default=None,
                   help=f"static headers sent with each request: 'Name: value' a line "
                        f"(# comments; values are secrets, never shown){keep}; checked as a "
                        f"--secret-file is")
    p.add_argument("--type", metavar="TYPE", dest="types", action="append",
                   type=_subscription, default=None,
                   help=f"an event type it subscribes to (repeatable; '*': every type, "
                        f"alone){' (default *)' if adding else keep}")
    p.add_argument("--max-in-flight", metavar="N", type=_int_in(1, MAX_IN_FLIGHT), default=None,
                   help="at most N of its sends in flight at once, across every dispatcher "
                        "(default: no cap)")
    p.add_argument("--rate", metavar="R", type=_rate, default=None,
                   help="at most R requests a second to it, across every dispatcher "
                        "(default: no limit)")
    p.add_argument("--burst", metavar="B", type=_int_in(1, MAX_BURST), default=None,
                   help="with --rate: up to B requests at once after a quiet spell "
                        "(default: the rate rounded up)")
    p.add_argument("--insecure-plain-http", action="store_true", default=None,
                   help="allow a plain http URL to a host that is not loopback: anyone on "
                        "the path can read and change what crosses it")
    p.add_argument("--disable-after", metavar="DURATION", type=_disable_after, default=None,
                   help=f"disable it once it has failed this long with no delivery in between "
                        f"(its circuit breaker's evidence; its deliveries then wait for "
                        f"endpoint enable, none lost): 1m..365d (3d, 12h, 90m), or never"
                        f"{' (default ' + duration(DISABLE_AFTER_MS) + ')' if adding else ''}")
    if adding:
        p.add_argument("--disabled", action="store_true",
                       help="add it disabled: its deliveries wait until it is enabled")
    else:
        enabled = p.add_mutually_exclusive_group()
        enabled.add_argument("--disabled", dest="enabled", action="store_false", default=None,
                             help="disable it (as endpoint disable does)")
        enabled.add_argument("--enabled", dest="enabled", action="store_true", default=None,
                             help="enable it (as endpoint enable does)")
        p.add_argument("--secure-only", action="store_true",
                       help="take back --insecure-plain-http (its URL must then be https or "
                            "loopback)")
        p.add_argument("--clear-ca-file", action="store_true",
                       help="trust the system's CA store again")
        p.add_argument("--clear-secrets", action="store_true",
                       help="send its requests unsigned")
        p.add_argument("--clear-headers", action="store_true", help="send no static header")
        p.add_argument("--clear-max-in-flight", action="store_true", help="no cap")
        p.add_argument("--clear-rate", action="store_true",
                       help="no rate limit (its burst goes with it)")
    _audit_options(p)
