"""``asyncworker ui QUEUE``: the page served until SIGINT or SIGTERM.

Everything is checked before the port is bound: the token file, the host
(not loopback: a token is required, and https or --insecure-plain-http, so the
token never crosses a network in the clear unasked), the names it answers to,
the TLS files, the receiver's URL with its TLS options and the queue itself
(opened once, read-only unless --allow-changes), so a refusal is one line and
the command's exit code (2: bad usage or not a queue; 1: a store that fails). The
port is bound before the app is made, so that the names the page answers to
carry the port it got.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import signal
import socket
import ssl
from contextlib import closing

from aiohttp import web

from asyncworker.operations import (
    UsageError,
    check_private_file,
    check_small_file,
    open_queue_store,
    reached,
    served_tls,
    shown,
)
from asyncworker.receiving.server import server_tls_context
from asyncworker.service import Notifier
from asyncworker.ui.pages import ui_app
from asyncworker.ui.safety import LOOPBACK_NAMES, Access, Hosts, parse_token_line
from lease.http import is_loopback
from lease.policy import check_actor

__all__ = ["serve_ui"]

MAX_TOKEN_FILE_BYTES = 64 * 1024  # a token file holds a line; a larger one is a wrong path


def serve_ui(args: argparse.Namespace) -> None:
    """Serve the page with the ``ui`` command's arguments until SIGINT or SIGTERM.
    A refusal before the port is bound is a UsageError; a store that fails, a
    StoreError (the command line's exit codes 2 and 1)."""
    access = None if args.token_file is None else read_token_file(args.token_file)
    https = served_tls(args)
    if not is_loopback(args.host):
        if access is None:
            raise UsageError(f"--host {args.host} is not a loopback address: anyone who can "
                             f"reach it could use the page; give --token-file (or bind "
                             f"127.0.0.1)")
        if not https and not args.insecure_plain_http:
            raise UsageError(f"--host {args.host} is not a loopback address: over plain http "
                             f"the token crosses the network in the clear; give --tls-cert "
                             f"and --tls-key (or --insecure-plain-http)")
    if args.allowed_host:
        try:
            Hosts(args.allowed_host)  # each one's form, before anything binds
        except ValueError as exc:
            raise UsageError(f"--allowed-host: {exc}") from None
    receiver = reached(args, "--receiver", args.receiver, serves=True)
    with closing(open_queue_store(args.queue, read_only=not args.allow_changes)):
        pass  # a queue, of a version this page reads: checked before anything binds
    try:
        tls = server_tls_context(args.tls_cert, args.tls_key) if https else None
    except ValueError as exc:  # changed since it was checked
        raise UsageError(str(exc)) from None
    sock = _bind(args.host, args.port)
    with closing(sock):
        port = sock.getsockname()[1]
        app = ui_app(args.queue, allow_changes=args.allow_changes,
                     token=None if access is None else access.token,
                     receiver_url=receiver, operator=_operator(access),
                     allowed_hosts=answers_to(args.host, port, args.allowed_host),
                     queues_of=getattr(args, "queues_of", None))
        asyncio.run(_serve(app, args, sock, tls))


def answers_to(host: str, port: int, allowed: list[str]) -> list[str]:
    """The names the page answers to: the bound address's (loopback's three when
    it is loopback or every address, else the address itself) at the bound port,
    and each --allowed-host as given."""
    literal = f"[{host.strip('[]')}]" if ":" in host else host
    names = [] if host in ("0.0.0.0", "::", "[::]") else [literal]
    if is_loopback(host) or not names:
        names += LOOPBACK_NAMES
    return [f"{name}:{port}" for name in names] + list(allowed)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the app is made (its port is in the names
    the page answers to); a port it cannot bind is a usage error, exit 2."""
    try:
        family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        raise UsageError(f"{host} port {port}: {exc.strerror or exc}") from None


def read_token_file(path: str) -> Access:
    """The token file's first line, TOKEN or LABEL:TOKEN; a one-line UsageError
    that names the file, never the secret."""
    check_small_file("--token-file", path, MAX_TOKEN_FILE_BYTES)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError:
        raise UsageError(f"--token-file: {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"--token-file: cannot read {path}: {exc.strerror or exc}") from None
    try:
        access = parse_token_line(text)
    except ValueError as exc:
        raise UsageError(f"--token-file: {path}: {exc}") from None
    check_private_file("--token-file", path)
    return access


def _operator(access: Access | None) -> str | None:
    """Who the audit rows name: the token's label, else the user who started the page."""
    if access is not None and access.label is not None:
        return access.label
    try:
        return check_actor(getpass.getuser()[:100] or None)
    except (OSError, KeyError, ValueError):  # no name to be had: the rows name nobody
        return None


async def _serve(app: web.Application, args: argparse.Namespace, sock: socket.socket,
                 tls: ssl.SSLContext | None) -> None:
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()  # opens the queue
    try:
        await web.SockSite(runner, sock, ssl_context=tls).start()
        port = sock.getsockname()[1]
        host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host
        mode = "changes allowed" if args.allow_changes else "read-only"
        scheme = "http" if tls is None else "https"
        url = f"{scheme}://{host}:{port}/"
        print(f"asyncworker ui: {shown(args.queue)} at {url} ({mode})", flush=True)
        await _until_signalled(f"serving the page of {shown(args.queue)} at {url}")
    finally:
        await runner.cleanup()


async def _until_signalled(serving: str) -> None:
    """Serve until SIGINT or SIGTERM, saying READY (``serving``: its status) and
    then STOPPING to a service manager that runs us with Type=notify."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    notifier = Notifier.from_environment()
    try:
        notifier.ready(serving)  # the queue opened, the port listening
        await stop.wait()
        notifier.stopping("closing")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        notifier.close()
