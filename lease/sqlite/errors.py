"""sqlite3's errors in the store's words."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from lease.worker import Busy, NotAQueue, StoreError

__all__ = ["store_errors"]


@contextmanager
def store_errors() -> Iterator[None]:
    """sqlite3's errors in the store's words: a held write lock is Busy (a
    short pause cures it); a file that is not a database is NotAQueue; any
    other failure of the file is a StoreError. The transaction was rolled
    back in every case (``immediate``)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise Busy(f"the queue file is locked by another writer: {exc}") from exc
        raise StoreError(f"queue file: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise NotAQueue(f"not a queue file: {exc}") from exc
