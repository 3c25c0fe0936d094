"""A small orders service that receives each order event exactly once.

    python docs/examples/orders_service.py orders.db --secret-file secrets.txt \
        [--host 127.0.0.1] [--port 8080] [--tls-cert cert.pem --tls-key key.pem]

It prints its URL, then serves until SIGINT or SIGTERM. Point a dispatcher at
it (``asyncworker run QUEUE --url https://HOST:PORT/hooks/orders --secret-file
secrets.txt``): every job is a signed POST whose body is the order. The
library verifies the signature, then, in one transaction on orders.db, calls
``place_order`` and records the event's id: a resent event is a duplicate
and places nothing, and the answer leaves only after COMMIT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3

from aiohttp import web

from asyncworker.receiving.idempotent import Event, Reject, add_receiver
from asyncworker.receiving.server import server_tls_context
from lease.signing import read_secrets

SCHEMA = """CREATE TABLE IF NOT EXISTS orders (
  id TEXT PRIMARY KEY, item TEXT NOT NULL, qty INTEGER NOT NULL CHECK (qty > 0))"""


def place_order(con: sqlite3.Connection, event: Event) -> None:
    """The effect. It runs inside the library's transaction and must use only
    the connection it is given; whatever it writes commits with the event's id,
    or not at all."""
    item, qty = event.body.get("item"), event.body.get("qty")
    if type(item) is not str or type(qty) is not int or qty < 1:
        raise Reject("an order needs an item (text) and a qty (a positive integer)")
    con.execute("INSERT INTO orders (id, item, qty) VALUES (?, ?, ?)", (event.id, item, qty))


async def serve(args: argparse.Namespace) -> None:
    secrets = read_secrets(args.secret_file)
    tls = server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    with sqlite3.connect(args.db) as con:  # the service's own table, created once
        con.execute(SCHEMA)
    con.close()
    app = web.Application()
    add_receiver(app, "/hooks/orders", args.db, place_order, secrets=secrets)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, ssl_context=tls).start()
    host, port = runner.addresses[0][:2]
    print(f"{'https' if tls else 'http'}://{host}:{port}/hooks/orders", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()  # answers what is in progress, then closes the database


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", help="the service's SQLite file (created if missing)")
    parser.add_argument("--secret-file", required=True, help="whsec_ secrets, one a line")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    try:
        asyncio.run(serve(parser.parse_args()))
    except (OSError, ValueError) as exc:  # a bad file, an address in use: one line
        raise SystemExit(f"orders_service: {exc}") from None


if __name__ == "__main__":
    main()
