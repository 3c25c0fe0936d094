"""The transactional outbox: a service's order and its event in one
transaction, then delivered in order per customer.

    python docs/examples/outbox_service.py shop.db

The service keeps its orders in its own SQLite file (WAL, as services often
run). The queue is declared to share that file once; after that, every order
is written with its event in the service's own transaction: both commit, or
neither does. Each event carries its customer as the ordering key, so one
customer's events are delivered one at a time, in the order they were
written, while other customers' go on beside them.
"""

from __future__ import annotations

import sqlite3
import sys

from lease.sqlite import SQLiteStore, enqueue_in
from lease.stores import run_store_once


def open_shop(path: str) -> sqlite3.Connection:
    """The service's own connection and table, as it has always had them."""
    shop = sqlite3.connect(path, isolation_level=None)
    shop.execute("PRAGMA journal_mode=WAL")
    shop.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL,"
                 " state TEXT NOT NULL)")
    return shop


def record(shop: sqlite3.Connection, order: str, customer: str, state: str) -> None:
    """The order's new state and its event, in one transaction."""
    shop.execute("BEGIN IMMEDIATE")
    try:
        shop.execute("INSERT INTO orders (id, customer, state) VALUES (?, ?, ?)"
                     " ON CONFLICT (id) DO UPDATE SET state = excluded.state",
                     (order, customer, state))
        enqueue_in(shop, [{"id": f"{order}:{state}", "key": customer,
                           "body": {"order": order, "state": state}}])
        shop.execute("COMMIT")
    except BaseException:
        shop.execute("ROLLBACK")
        raise


def main(path: str) -> None:
    shop = open_shop(path)
    SQLiteStore(path, create=True, shared=True).close()  # once: the queue lives here too
    for order, customer, state in [("o-1", "ann", "placed"), ("o-2", "bob", "placed"),
                                   ("o-1", "ann", "paid"), ("o-1", "ann", "shipped"),
                                   ("o-2", "bob", "cancelled")]:
        record(shop, order, customer, state)
    shop.close()

    delivered: list[str] = []

    def send(event: dict) -> bool:  # a receiver would get this over HTTP
        delivered.append(event["id"])
        return True

    with SQLiteStore(path) as queue:  # no flag: the file says it is shared
        while run_store_once(queue, "dispatcher-1", send, 0.5) is not None:
            pass
    for customer, prefix in (("ann", "o-1:"), ("bob", "o-2:")):
        print(customer, " ".join(d for d in delivered if d.startswith(prefix)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shop.db")
