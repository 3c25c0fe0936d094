"""The asyncio runtime of the lease queue: dispatcher, strict sender, receiver.

The rules (validation, retry, fencing) live once, in :mod:`lease.worker`;
this package calls them. Names are loaded on first use, so the command line
starts without importing aiohttp for commands that do not need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncworker.dispatcher import (
        Dispatcher,
        DispatcherStats,
        LeaseLost,
        dispatcher_context,
        retry_delay_ms,
        run_once,
        run_until_signalled,
    )
    from asyncworker.metrics import add_metrics_routes, health_handler, metrics_app
    from asyncworker.receiving.server import Faults, make_app, serve
    from asyncworker.sender import Destination, new_session, send_http
    from asyncworker.store import AsyncStore, QueueThread
    from asyncworker.wire import WireClient

_HOMES = {
    "Dispatcher": "dispatcher",
    "DispatcherStats": "dispatcher",
    "LeaseLost": "dispatcher",
    "dispatcher_context": "dispatcher",
    "health_handler": "metrics",
    "retry_delay_ms": "dispatcher",
    "run_once": "dispatcher",
    "run_until_signalled": "dispatcher",
    "Destination": "sender",
    "add_metrics_routes": "metrics",
    "metrics_app": "metrics",
    "Faults": "receiving.server",
    "make_app": "receiving.server",
    "serve": "receiving.server",
    "new_session": "sender",
    "send_http": "sender",
    "WireClient": "wire",
    "QueueThread": "store",
    "AsyncStore": "store",
}

__all__ = [
    "AsyncStore",
    "Destination",
    "Dispatcher",
    "DispatcherStats",
    "Faults",
    "LeaseLost",
    "QueueThread",
    "WireClient",
    "add_metrics_routes",
    "dispatcher_context",
    "health_handler",
    "make_app",
    "metrics_app",
    "new_session",
    "retry_delay_ms",
    "run_once",
    "run_until_signalled",
    "send_http",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'asyncworker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncworker.{_HOMES[name]}"), name)
