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

The package, by module: ``parser`` (every command's arguments), ``config``
(the options of run, serve and ui from ``ASYNCWORKER_<OPTION>`` and a TOML
file, the command line first; ``--queue-name`` from the environment for every
command), one module
per group of commands (``intake``: init, enqueue; ``running``: run, serve;
``reads``: stats, dead, inspect; ``actions``: redrive, cancel, prune,
prune-inbox; ``endpoints``: endpoint add, list, show, update, disable, enable,
remove; ``launchers``: ui, bench, demo, each importing what it starts on
use), ``output`` (what they print), ``exits`` (the codes below) and ``demo``
(the demo's story). What the operator's page does too is in
``asyncworker.operations``. ``main`` turns each error into one line and its
exit code.

Exit codes (the same text is in ``--help`` and in the README):

- 0: done; for ``run``, no job went dead in this run.
- 1: the work failed: a conflict (``enqueue``), a refused redrive or cancel,
  no such job (``inspect``), no such endpoint, an endpoint's name taken or its
  removal refused (``endpoint``), a receiver that did not answer (``stats``),
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
import os
import sqlite3
import sys
from collections.abc import Sequence

from asyncworker.cli.config import parse_arguments
from asyncworker.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE
from asyncworker.cli.output import to_stderr
from asyncworker.cli.parser import build_parser
from asyncworker.operations import (
    UsageError,
    WorkFailed,
    about,
    named_queue,
    one_line,
    passwords,
)
from lease.records import NotAQueue, StoreError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):  # a file name that is not UTF-8, printed
        sys.stdout.reconfigure(errors="backslashreplace")
    args = argparse.Namespace(command=None)
    try:
        # bad arguments, from the command line, the environment or --config: exit 2, one line
        args = parse_arguments(build_parser(), argv)
        _name_queue(args)
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


def _name_queue(args: argparse.Namespace) -> None:
    """The one place ``--queue-name`` applies: QUEUE becomes what names the
    named queue (a URL's parameter, a file beside), so every command opens it
    as it opens any queue. ``queues_of`` keeps QUEUE as given, where the
    queues beside it are listed from."""
    if getattr(args, "queue", None) is None:
        return
    args.queues_of = args.queue
    args.queue = named_queue(args.queue, getattr(args, "queue_name", None))


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    name = _named(args)
    for password in passwords(name) if name else ():  # whatever a driver's message quoted
        message = message.replace(password, "***")
    from asyncworker.logs import current_format, say

    command = args.command
    if getattr(args, "action", None):  # endpoint add, endpoint remove, ...
        command = f"{command} {args.action}"
    if current_format() == "json":  # the error as the object of a record, its facts as keys
        say(one_line(message), f"asyncworker.{command.replace(' ', '.')}", "error",
            exit_code=code)
    else:
        to_stderr(f"asyncworker {command}: {one_line(message)}\n")
    return code


def _named(args: argparse.Namespace) -> str | None:
    return getattr(args, "queue", None) or getattr(args, "store", None) or getattr(
        args, "inbox", None)


def _configure_logs(args: argparse.Namespace) -> None:
    from asyncworker.logs import configure

    level = args.log_level or ("info" if args.command == "run" else "warning")
    configure(level, args.log_format)


def _quiet_exit_on_broken_pipe() -> int:
    # The Python docs' recipe (library/signal, "Note on SIGPIPE"): the reader
    # has gone; point stdout at devnull so the interpreter's final flush
    # cannot fail again, and exit without a word.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILED
