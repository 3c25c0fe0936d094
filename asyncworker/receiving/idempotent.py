"""An idempotent receiver for your own service: what ``asyncworker serve`` does,
as a library, on your own SQLite file.

Each POST is, in this order: read whole (within a size cap and a read time);
verified, when secrets are given (``lease.signing``, the Standard Webhooks
way: a request that does not verify is 401 and touches nothing); parsed (a
JSON object, named by its ``webhook-id`` header); then, in ONE transaction on
your file, deduplicated by its id and the sha256 of its canonical body, your
``effect(con, event)`` applied, and the id recorded. The answer leaves only
after COMMIT, so a sender that got a 200 knows the effect is durable, and a
sender that got nothing sends again and gets ``duplicate``:

| request                                  | answer                                  |
| ---------------------------------------- | --------------------------------------- |
| a new event                              | 200 ``{"id", "status": "applied"}``       |
| the same id and body (any key order)     | 200 ``{"id", "status": "duplicate"}``     |
| the same id, another body                | 409                                     |
| the effect raises ``Reject("why")``        | 422 ``{"error": "why"}``                  |
| the effect raises anything else          | 500 (the sender retries)                |
| the file stays locked by another writer  | 503 (the sender retries)                |
| a signature missing, malformed, wrong, stale or future | 401 naming the kind       |
| not JSON, not an object, no or a bad ``webhook-id`` | 400                          |
| a body over ``MAX_BODY_BYTES`` (64 KiB)    | 413                                     |
| a body not received within ``read_timeout`` | 408                                  |

Only the first row commits anything: on every other one the effect was not
called, or was rolled back with the rest.

The 200 answer names the id, so the dispatcher's default ``echo-id`` ACK
policy (the strong one) takes it as proof of delivery.

The effect is a plain synchronous function. It runs on the library's own
thread, inside the open transaction, with the library's connection: it must
use only the connection it is given (another connection would commit on its
own, outside the transaction, and could not be rolled back with it), must not
commit, roll back or begin (refused: the statement fails, so the effect
raises and nothing is committed), and must not write the library's table.
It should be quick: events are applied one at a time, in arrival order, which
is also what makes concurrent duplicates apply exactly once.

Your tables are yours: the library creates only ``received_events`` (id,
digest, first_seen_ms) beside them, and refuses a file whose
``received_events`` is not its own. It sets no file-wide pragma (the journal
mode stays yours); its connection waits up to 5 s for another writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from asyncworker import tracing
from asyncworker.receiving.requests import Signatures, check_signature, error, read_body
from lease.http import ID_HEADER
from lease.policy import MAX_BODY_BYTES, PRODUCT, canonical_body
from lease.signing import TOLERANCE_S
from lease.worker import check_job_id, immediate, parse_json

__all__ = [
    "APPLIED",
    "CONFLICT",
    "DUPLICATE",
    "TABLE",
    "Effect",
    "Event",
    "IdempotentReceiver",
    "Reject",
    "add_receiver",
    "receiver_app",
]

APPLIED, DUPLICATE, CONFLICT = "applied", "duplicate", "conflict"
TABLE = "received_events"
_COLUMNS = ["id", "digest", "first_seen_ms"]
_CREATE = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id TEXT PRIMARY KEY, digest TEXT NOT NULL, first_seen_ms INTEGER NOT NULL)"""
log = logging.getLogger("asyncworker.idempotent")


@dataclass(frozen=True)
class Event:
    """What the effect is given: the event's id (its ``webhook-id``), its body
    (a JSON object, as parsed) and the sha256 of the body's canonical text."""

    id: str
    body: dict
    digest: str


Effect = Callable[[sqlite3.Connection, Event], None]


class Reject(Exception):
    """Raised by an effect to refuse an event for good (422, nothing committed):
    its message is the answer's error. The sender does not retry a 422."""


# ------------------------------------------------------------------ the transaction


def check_file(path: str | os.PathLike) -> str:
    """The path as a str, once it is known that the library can use the file:
    missing (created at startup), or SQLite whose ``received_events`` table,
    if any, is the library's. ValueError naming the file otherwise; nothing is
    created or changed."""
    text = os.fspath(path)
    if not os.path.exists(text):
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise ValueError(f"{text}: its directory does not exist")
        return text
    if not os.path.isfile(text):
        raise ValueError(f"{text}: not a file")
    try:
        con = sqlite3.connect(f"file:{_uri_path(text)}?mode=ro", uri=True)
        try:
            columns = [row[1] for row in con.execute(f"PRAGMA table_info({TABLE})")]
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{text}: not a SQLite database the receiver can read ({exc})") from None
    _check_columns(text, columns)
    return text


def _uri_path(path: str) -> str:
    from urllib.parse import quote

    return quote(os.path.abspath(path))


def _check_columns(path: str, columns: list[str]) -> None:
    if columns and columns != _COLUMNS:
        raise ValueError(f"{path}: its table {TABLE} is not this library's "
                         f"(columns {columns}, expected {_COLUMNS}); nothing was changed")


def open_store(path: str) -> sqlite3.Connection:
    """The library's connection to the user's file, its table created if missing."""
    con = sqlite3.connect(path, isolation_level=None)  # BEGIN and COMMIT are ours
    try:
        con.execute("PRAGMA busy_timeout=5000")  # another writer: wait a little, then 503
        con.execute("PRAGMA synchronous=FULL")  # every COMMIT on disk before we answer
        with immediate(con):
            _check_columns(path, [row[1] for row in con.execute(f"PRAGMA table_info({TABLE})")])
            con.execute(_CREATE)
    except BaseException:
        con.close()
        raise
    return con


class EffectFailed(Exception):
    """The effect raised (its exception is the cause); the transaction was rolled back."""


def receive(con: sqlite3.Connection, event: Event, effect: Effect, now_ms: int) -> str:
    """One event, in one transaction: APPLIED (the effect ran and the id is
    recorded, committed), DUPLICATE or CONFLICT (nothing written). The effect
    raising rolls everything back: EffectFailed, or its Reject as is."""
    with immediate(con):
        row = con.execute(f"SELECT digest FROM {TABLE} WHERE id = ?", (event.id,)).fetchone()
        if row is not None:
            return DUPLICATE if row[0] == event.digest else CONFLICT
        with _effect_guard(con):
            try:
                effect(con, event)
            except Reject:
                raise
            except Exception as exc:
                raise EffectFailed(type(exc).__name__) from exc
        if not con.in_transaction:  # refused by the guard, so only if it is broken
            raise EffectFailed("the effect ended the transaction")
        con.execute(f"INSERT INTO {TABLE} (id, digest, first_seen_ms) VALUES (?, ?, ?)",
                    (event.id, event.digest, now_ms))
    return APPLIED


_TRANSACTION_CONTROL = sqlite3.SQLITE_TRANSACTION
_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE,
           sqlite3.SQLITE_DROP_TABLE, sqlite3.SQLITE_ALTER_TABLE, sqlite3.SQLITE_CREATE_INDEX,
           sqlite3.SQLITE_DROP_INDEX, sqlite3.SQLITE_CREATE_TRIGGER}


def _refuse_for_effect(action: int, arg1: str | None, arg2: str | None,
                       database: str | None, source: str | None) -> int:
    if action == _TRANSACTION_CONTROL:
        return sqlite3.SQLITE_DENY  # a COMMIT inside the effect would commit half an event
    if action in _WRITES and TABLE in (arg1, arg2):
        return sqlite3.SQLITE_DENY  # the record of what was received is the library's
    return sqlite3.SQLITE_OK


@contextlib.contextmanager
def _effect_guard(con: sqlite3.Connection) -> Iterator[None]:
    # Setting an authorizer expires every prepared statement, so even a cached
    # COMMIT is checked again while the effect runs.
    con.set_authorizer(_refuse_for_effect)
    try:
        yield
    finally:
        con.set_authorizer(None)


# ------------------------------------------------------------------ the handler


@dataclass(frozen=True)
class _Options:
    signatures: Signatures | None
    read_timeout: float


class IdempotentReceiver:
    """One endpoint: ``handle`` is its aiohttp handler, ``context`` its
    cleanup context (opens the connection at startup, closes it at cleanup).
    ``add_receiver`` wires both into an app."""

    def __init__(self, db_path: str | os.PathLike, effect: Effect, *,
                 secrets: Sequence[bytes] | None = None, tolerance_s: int = TOLERANCE_S,
                 clock: Callable[[], float] = time.time, read_timeout: float = 10.0) -> None:
        if not callable(effect):
            raise ValueError(f"effect must be callable, got {type(effect).__name__}")
        if type(read_timeout) not in (int, float) or not 0 < read_timeout <= 3600:
            raise ValueError(f"read_timeout must be seconds in (0, 3600], got {read_timeout!r}")
        self._options = _Options(Signatures.of(secrets, tolerance_s, clock), read_timeout)
        self._path = check_file(db_path)
        self._effect, self._clock = effect, clock
        self._thread: ThreadPoolExecutor | None = None
        self._con: sqlite3.Connection | None = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=TABLE)
        try:
            self._con = await self._on_thread(open_store, self._path)
            yield
        finally:
            if self._con is not None:
                await self._on_thread(self._con.close)
            self._thread.shutdown(wait=True)

    async def _on_thread(self, function: Callable[..., Any], *args: Any) -> Any:
        # The connection's one thread: every statement on it runs there, in order.
        assert self._thread is not None, "the receiver's app has not started"
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    async def handle(self, request: web.Request) -> web.Response:
        """One POST. With tracing on (``asyncworker.tracing``), in a SERVER span
        continuing the sender's ``traceparent``, the inbox's outcome on it."""
        traced = tracing.tracer()
        if traced is None:
            return await self._handle(request, None)
        with tracing.receiving(traced, request.headers, request.method, request.path) as span:
            response = await self._handle(request, span)
            tracing.answered(span, response.status)
            return response

    async def _handle(self, request: web.Request, span: Any) -> web.Response:
        body = await read_body(request, self._options.read_timeout)
        if isinstance(body, web.Response):
            return body
        refused = check_signature(self._options.signatures, request, body)
        if refused is not None:
            return refused
        try:
            event = parse_event(request.content_type, body, request.headers.getall(ID_HEADER, []))
        except ValueError as exc:
            return error(400, str(exc))
        return await self._apply(event, span)

    async def _apply(self, event: Event, span: Any = None) -> web.Response:
        assert self._con is not None, "the receiver's app has not started"
        now_ms = int(self._clock() * 1000)
        try:
            outcome = await self._on_thread(receive, self._con, event, self._effect, now_ms)
        except Reject as exc:
            return error(422, str(exc) or "rejected by the effect")
        except EffectFailed as exc:
            log.error("effect failed for %r", event.id, exc_info=exc.__cause__)
            return error(500, f"the effect raised {exc}; nothing was committed")
        except sqlite3.Error as exc:
            return error(503, f"the receiver's database could not commit ({exc}); "
                               f"nothing was committed")
        if span is not None:
            tracing.noted(span, event.id, outcome)
        if outcome == CONFLICT:
            return error(409, f"{event.id!r} was received with another body; "
                               f"this one (sha256 {event.digest[:16]}...) was not applied")
        return web.json_response({"id": event.id, "status": outcome})


def parse_event(content_type: str, body: bytes, id_headers: list[str]) -> Event:
    """The event a request carries, else ValueError naming the problem."""
    if content_type != "application/json":
        raise ValueError(f"content type must be application/json, got {content_type!r}")
    if len(id_headers) != 1:
        raise ValueError(f"one {ID_HEADER} header must name the event, got {len(id_headers)}")
    event_id = check_job_id(ID_HEADER, id_headers[0], PRODUCT)
    value = parse_json(body)
    _, digest = canonical_body(value)  # a JSON object, or ValueError
    assert type(value) is dict  # canonical_body takes nothing else
    return Event(event_id, value, digest)


def add_receiver(app: web.Application, path: str, db_path: str | os.PathLike,
                 effect: Effect, **options: Any) -> IdempotentReceiver:
    """Receive events at ``POST path`` of ``app`` into ``db_path`` (options as
    ``IdempotentReceiver``: secrets, tolerance_s, clock, read_timeout).
    ValueError at once for a bad option or a file the library cannot use."""
    receiver = IdempotentReceiver(db_path, effect, **options)
    app.router.add_post(path, receiver.handle)
    app.cleanup_ctx.append(receiver.context)
    return receiver


def receiver_app(db_path: str | os.PathLike, effect: Effect, *, path: str = "/events",
                 **options: Any) -> web.Application:
    """An application that does nothing else: events at ``POST path``."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    add_receiver(app, path, db_path, effect, **options)
    return app
