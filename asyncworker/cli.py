"""The ``asyncworker`` command line.

Exit codes: 0 ok, 1 the work failed, 2 bad usage or a missing file (a
one-line error, no traceback, nothing created or changed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Optional, Sequence

from asyncworker.receiver import Faults, serve

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage: reported on one line, exit code 2."""


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {text}")
    return value


def _int_in(low: int, high: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        if not text.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncworker",
        description="A durable job dispatcher on one SQLite file.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("serve", help="run the receiver (an inbox that deduplicates)",
                            description="Run the receiver: POST /events into a deduplicating "
                                        "SQLite inbox. Prints its URL on the first line.")
    p.add_argument("--inbox", required=True, help="inbox file (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    p.add_argument("--port", type=_int_in(0, 65535), default=0, help="port (default 0: any)")
    p.add_argument("--latency-ms", type=_int_in(0, 60000), default=0,
                   help="injected delay before each commit")
    p.add_argument("--p-503", type=_probability, default=0.0,
                   help="probability of answering 503 before commit")
    p.add_argument("--p-drop", type=_probability, default=0.0,
                   help="probability of closing the connection after commit, unanswered")
    p.add_argument("--seed", type=int, default=None, help="seed of the injected faults")
    p.add_argument("--group", type=_int_in(1, 10000), default=64,
                   help="most requests in one commit (1 turns grouping off)")
    p.set_defaults(handler=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    faults = Faults(latency_ms=args.latency_ms, p_503=args.p_503, p_drop=args.p_drop,
                    seed=args.seed)
    try:
        asyncio.run(serve(args.inbox, args.host, args.port, faults=faults,
                          max_group=args.group))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage line on bad arguments
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"asyncworker {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
