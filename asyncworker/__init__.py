"""The asyncio runtime of the lease queue: dispatcher, strict sender, receiver.

The rules (validation, retry, fencing) live once, in :mod:`lease.worker`;
this package calls them.
"""

from asyncworker.dispatcher import (
    Dispatcher,
    DispatcherStats,
    LeaseLost,
    dispatcher_context,
    run_once,
    run_until_signalled,
)
from asyncworker.receiver import Faults, make_app, serve
from asyncworker.sender import new_session, send_http
from asyncworker.store import QueueThread

__all__ = [
    "Dispatcher",
    "DispatcherStats",
    "Faults",
    "LeaseLost",
    "QueueThread",
    "dispatcher_context",
    "make_app",
    "new_session",
    "run_once",
    "run_until_signalled",
    "send_http",
    "serve",
]
