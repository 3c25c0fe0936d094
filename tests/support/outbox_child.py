"""A service's process for the outbox tests: it writes an order row and
enqueues its event in one transaction, then dies for real (os._exit: no
finally, no close, no rollback) before or after its COMMIT.

    python -m tests.support.outbox_child SPEC_JSON
    spec: {"kind": "sqlite"|"postgresql", "target": PATH_OR_URL, "order": ID,
           "die": "before-commit"|"after-commit"}
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys


def sqlite_service(spec: dict) -> None:
    from lease.sqlite import enqueue_in

    shop = sqlite3.connect(spec["target"], isolation_level=None)
    shop.execute("BEGIN IMMEDIATE")
    shop.execute("INSERT INTO orders (id) VALUES (?)", (spec["order"],))
    enqueue_in(shop, [{"id": spec["order"], "key": "cust", "body": {"o": spec["order"]}}])
    if spec["die"] == "after-commit":
        shop.execute("COMMIT")
    os._exit(73)


def postgres_service(spec: dict) -> None:
    import psycopg

    from lease.postgres import enqueue_in

    conn = psycopg.connect(spec["target"], autocommit=True)
    with conn.transaction():
        conn.execute("INSERT INTO orders (id) VALUES (%s)", (spec["order"],))
        enqueue_in(conn, [{"id": spec["order"], "key": "cust", "body": {"o": spec["order"]}}])
        if spec["die"] == "before-commit":
            os._exit(73)
    os._exit(73)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    (sqlite_service if spec["kind"] == "sqlite" else postgres_service)(spec)
    os._exit(0)  # never reached: the parent sees 0, not 73
