"""The asyncio runtime of the lease queue: the strict sender and the receiver.

The rules (validation, retry, fencing) live once, in :mod:`lease.worker`;
this package calls them.
"""

from asyncworker.receiver import Faults, make_app, serve
from asyncworker.sender import new_session, send_http

__all__ = ["Faults", "make_app", "new_session", "send_http", "serve"]
