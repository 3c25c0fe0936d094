"""``asyncworker ui QUEUE``: the page served until SIGINT or SIGTERM.

Everything is checked before the port is bound: the token file, the host
(not loopback: a token is required), the receiver's URL and the queue itself
(opened once, read-only unless --allow-changes), so a refusal is one line and
the CLI's exit code (2: bad usage or not a queue; 1: a store that fails).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import signal
from contextlib import closing
from typing import Optional

from aiohttp import web

from asyncworker.cli import (
    EXIT_OK,
    UsageError,
    _check_small_file,
    _stats_url,
    open_queue_store,
    shown,
)
from asyncworker.ui.pages import ui_app
from asyncworker.ui.safety import Access, is_loopback, parse_token_line
from lease.policy import check_actor

__all__ = ["serve_ui"]

MAX_TOKEN_FILE_BYTES = 64 * 1024  # a token file holds a line; a larger one is a wrong path


def serve_ui(args: argparse.Namespace) -> int:
    access = None if args.token_file is None else read_token_file(args.token_file)
    if access is None and not is_loopback(args.host):
        raise UsageError(f"--host {args.host} is not a loopback address: anyone who can "
                         f"reach it could use the page; give --token-file (or bind 127.0.0.1)")
    if args.receiver is not None:
        try:
            _stats_url(args.receiver)
        except ValueError as exc:
            raise UsageError(f"--receiver: {exc}") from None
    with closing(open_queue_store(args.queue, read_only=not args.allow_changes)):
        pass  # a queue, of a version this page reads: checked before anything binds
    app = ui_app(args.queue, allow_changes=args.allow_changes,
                 token=None if access is None else access.token,
                 receiver_url=args.receiver, operator=_operator(access))
    asyncio.run(_serve(app, args))
    return EXIT_OK


def read_token_file(path: str) -> Access:
    """The token file's first line, TOKEN or LABEL:TOKEN; a one-line UsageError
    that names the file, never the secret."""
    _check_small_file("--token-file", path, MAX_TOKEN_FILE_BYTES)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError:
        raise UsageError(f"--token-file: {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"--token-file: cannot read {path}: {exc.strerror or exc}") from None
    try:
        return parse_token_line(text)
    except ValueError as exc:
        raise UsageError(f"--token-file: {path}: {exc}") from None


def _operator(access: Optional[Access]) -> Optional[str]:
    """Who the audit rows name: the token's label, else the user who started the page."""
    if access is not None and access.label is not None:
        return access.label
    try:
        return check_actor(getpass.getuser()[:100] or None)
    except (OSError, KeyError, ValueError):  # no name to be had: the rows name nobody
        return None


async def _serve(app: web.Application, args: argparse.Namespace) -> None:
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()  # opens the queue
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            raise UsageError(f"{args.host} port {args.port}: {exc.strerror or exc}") from None
        port = runner.addresses[0][1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        mode = "changes allowed" if args.allow_changes else "read-only"
        print(f"asyncworker ui: {shown(args.queue)} at http://{host}:{port}/ ({mode})",
              flush=True)
        await _until_signalled()
    finally:
        await runner.cleanup()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
