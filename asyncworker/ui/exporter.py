"""``asyncworker metrics QUEUE``: the queue's own metrics served alone, for a
Prometheus that scrapes a queue no page serves (``asyncworker.queue_metrics``).

It reads only (a read-only store), shows no secret and no job's content:
figures by status and by endpoint name. It binds loopback unless told
otherwise and answers only to the bound address's names and
``--allowed-host``, like the page, so a name rebound to it reads nothing.
Everything is checked before the port is bound (the queue, the names).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Awaitable, Callable
from contextlib import closing

from aiohttp import web

from asyncworker.operations import UsageError, open_queue_store, shown
from asyncworker.queue_metrics import DEFAULT_INTERVAL_S, QueueMetrics, queue_metrics_app
from asyncworker.ui.pages import Queue
from asyncworker.ui.safety import Hosts
from asyncworker.ui.serve import _bind, _until_signalled, answers_to

__all__ = ["exporter_app", "serve_metrics"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def exporter_app(metrics: QueueMetrics, hosts: Hosts) -> web.Application:
    """``/metrics`` of one queue, refusing (421) a Host it does not answer to."""
    @web.middleware
    async def named(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not hosts.admits(host, 443 if request.secure else 80):
            return web.Response(status=400 if host is None else 421,
                                text="refused: not a name this exporter answers to\n")
        return await handler(request)

    app = queue_metrics_app(metrics)
    app.middlewares.append(named)
    return app


def serve_metrics(args: argparse.Namespace) -> None:
    """Serve ``/metrics`` with the ``metrics`` command's arguments until SIGINT
    or SIGTERM. A refusal before the port is bound is a UsageError."""
    if args.allowed_host:
        try:
            Hosts(args.allowed_host)  # each one's form, before anything binds
        except ValueError as exc:
            raise UsageError(f"--allowed-host: {exc}") from None
    with closing(open_queue_store(args.queue, read_only=True)):
        pass  # a queue, of a version this reads: checked before anything binds
    sock = _bind(args.host, args.port)
    with closing(sock):
        port = sock.getsockname()[1]
        hosts = Hosts(answers_to(args.host, port, args.allowed_host))
        asyncio.run(_serve(args, hosts, sock))


async def _serve(args: argparse.Namespace, hosts: Hosts, sock: socket.socket) -> None:
    # the page's read-only queue: on SQLite a connection per read, which sees
    # what a dispatcher started later writes (a long-lived one may not)
    queue = Queue(str(args.queue), allow_changes=False)
    await queue.open()
    try:
        interval = DEFAULT_INTERVAL_S if args.interval is None else args.interval
        metrics = QueueMetrics(lambda: queue.look(lambda store: store.queue_depth()),
                               interval_s=interval, by_endpoint=args.endpoint_label)
        runner = web.AppRunner(exporter_app(metrics, hosts), handle_signals=False,
                               access_log=None)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            port = sock.getsockname()[1]
            host = f"[{args.host.strip('[]')}]" if ":" in args.host else args.host
            url = f"http://{host}:{port}/metrics"
            print(f"asyncworker metrics: {shown(args.queue)} at {url} "
                  f"(read at most every {interval:g} s)", flush=True)
            await _until_signalled(f"serving the metrics of {shown(args.queue)} at {url}")
        finally:
            await runner.cleanup()
    finally:
        await queue.close()
