"""``WireClient``: the dispatcher's HTTP/1.1 client, kept-alive connections on
asyncio protocols and the answer parsed by httptools (llhttp, the parser
aiohttp and Node.js use).

Why not aiohttp's ``ClientSession`` for the dispatcher's own sends: a
dispatcher sends one kind of request, a small POST whose bytes and headers
``lease.http`` has already built and checked, and reads one kind of answer,
at most ``ACK_LIMIT`` + 1 bytes. A ``ClientSession`` request builds a request
object, a response object, header multidicts, timers and trace hooks for
each send: several times the event loop's CPU a request that these few
protocol callbacks take (measured: docs/benchmarks.md). A benchmark tool
must not spend more than the receiver it measures. Callers' own aiohttp
sessions stay supported by ``send_http``.

What it keeps of a careful client: the whole exchange bounded by one
deadline (the wait for a connection, DNS, connect, TLS handshake, the last
byte read); TLS by the destination's context (certificate and hostname
verified); no redirects followed, no proxy settings read, nothing
decompressed; an answer's head bounded (``MAX_HEAD_BYTES``) and its body read
one byte past the cap, never more; a connection reused only after a whole
answer that keeps it alive, and never after an error, a timeout or a cancel;
idle connections closed after ``IDLE_SECONDS``, below the 5 s keep-alive of
Node's and uvicorn's servers, so that the client, not the server, closes an
idle connection, and a server's close seldom races a send. A cancelled send
is never sent later, and a send never outlives its deadline, whatever else
happens to its connection or its client.

A failure is a ``Retryable`` (timeout, DNS, refused, TLS, a connection that
closed before its whole answer) or a ``BadAck`` (an answer that is not HTTP),
in the same words as ``asyncworker.sender``'s aiohttp path.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from collections.abc import Callable
from typing import Any, cast

import httptools

from lease.http import ACK_LIMIT, Destination, Outgoing, transport_text
from lease.worker import BadAck, Retryable

__all__ = ["IDLE_SECONDS", "MAX_HEAD_BYTES", "WireClient"]

MAX_HEAD_BYTES = 32_768  # an answer's status line and headers, at most
IDLE_SECONDS = 4.0  # an idle connection is closed after this long

# tls, host, port, the TLS context itself: an id could be reused by another
# context once the first is gone, and a connection verified under one trust
# store must never serve another
_Key = tuple[bool, str, int, ssl.SSLContext | None]
_Answer = tuple[int, bytes, str | None]  # status, body (<= ACK_LIMIT + 1 bytes), Retry-After


@functools.lru_cache(maxsize=256)
def _request_line(target: str, host: str, port: int, tls: bool) -> bytes:
    """The request line and Host header of one route, built once."""
    name = f"[{host}]" if ":" in host else host
    if port != (443 if tls else 80):
        name = f"{name}:{port}"
    return f"POST {target} HTTP/1.1\r\nHost: {name}\r\n".encode("ascii")


def request_bytes(destination: Destination, outgoing: Outgoing) -> bytes:
    """The whole request: line, headers, length, body. A header that could
    split the request (CR, LF or NUL in a name or value) is a ValueError."""
    route = destination.route
    lines = [_request_line(route.target, route.host, route.port, route.tls)]
    for name, value in outgoing.headers.items():
        text = f"{name}: {value}\r\n"
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value or "\0" in text:
            raise ValueError(f"header {name!r:.40} holds a line break or NUL")
        lines.append(text.encode("latin-1"))
    lines.append(b"Content-Length: %d\r\n\r\n" % len(outgoing.body))
    lines.append(outgoing.body)
    return b"".join(lines)


class _Connection(asyncio.Protocol):
    """One kept-alive connection: at most one request in flight on it."""

    def __init__(self, client: WireClient, key: _Key, where: str) -> None:
        self._client = client
        self.key = key
        self._where = where  # host:port, for errors
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[_Answer] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._stray = False
        self._reset()

    def _reset(self) -> None:
        self._head_bytes = 0  # raw bytes while the head is open
        self._head_size = 0  # the head's fields, as parsed
        self._bad: BadAck | None = None
        self._head_done = False
        self._body = bytearray()
        self._over = False  # more body than an ACK can be: read no further
        self._framed = False  # Content-Length or chunked: its end is known
        self._retry_after: str | None = None

    @property
    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def is_waiting(self, waiter: asyncio.Future[_Answer]) -> bool:
        """``waiter``'s answer has not come: the connection is still its own."""
        return self._waiter is waiter

    # ----------------------------------------------------------- the exchange

    def exchange(self, request: bytes, deadline: float, seconds: float) -> asyncio.Future[_Answer]:
        assert self.transport is not None and self._waiter is None and not self.closed
        loop = self._client.loop
        self._waiter = loop.create_future()
        self._reset()
        self._timer = loop.call_at(deadline, self._expire, seconds)
        self.transport.write(request)
        return self._waiter

    def _expire(self, seconds: float) -> None:
        self._timer = None
        self._fail(Retryable(f"timed out after {seconds}s"))

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self.close()  # never reused after an error
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _answer(self, reusable: bool) -> None:
        waiter, self._waiter = self._waiter, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        answer = (self._parser.get_status_code(), bytes(self._body[:ACK_LIMIT + 1]),
                  self._retry_after)
        if reusable and not self.closed:
            self._client._release(self)
        else:
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def close(self, why: str = "was closed before a whole answer") -> None:
        """Abort: a send in flight on it fails (Retryable), now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter, self._waiter = self._waiter, None
        if not self.closed:
            self.closed = True
            self._client._forget(self)
            if self.transport is not None:
                self.transport.abort()
        if waiter is not None and not waiter.done():
            waiter.set_exception(Retryable(f"connection failed: the connection to "
                                           f"{self._where} {why}"))

    # ------------------------------------------------- asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is not an asyncio.Transport subclass; it has its methods
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: this stream is not HTTP we trust
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # 101 Switching Protocols, or an answer to an Upgrade we never sent: the
            # status is all an ACK can be judged by.
            self._answer(reusable=False)
        except httptools.HttpParserError as exc:
            self._fail(BadAck(f"malformed answer: {exc!r:.200}"))
        else:
            if self._bad is not None:
                self._fail(self._bad)
            elif self._over and self._waiter is not None:
                self._answer(reusable=False)  # the rest of the body is never read
            elif not self._head_done and self._waiter is not None:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._fail(BadAck(f"malformed answer: its head is over {MAX_HEAD_BYTES} "
                                      "bytes"))
        if self._stray:  # a second answer behind the first: never reuse this stream
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost judges what arrived

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed by us: close() has failed what was in flight
            return
        self.closed = True
        self._client._forget(self)
        if self._waiter is None or self._waiter.done():
            self.close()  # the timer, if any
            return
        status = self._parser.get_status_code() if self._head_done else 0
        if self._head_done and not self._framed and exc is None and status not in (204, 304):
            self._answer(reusable=False)  # an answer that ends where its connection ends
            return
        why = f": {exc!r:.120}" if exc is not None else ""
        self._fail(Retryable(f"connection failed: {self._where} closed the connection "
                             f"before a whole answer{why}"))

    # ------------------------------------------------ httptools' callbacks

    def on_message_begin(self) -> None:
        if self._waiter is None:
            self._stray = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        lowered = name.lower()
        if lowered == b"retry-after":
            self._retry_after = value.decode("latin-1")
        elif lowered == b"content-length":
            self._framed = True
        elif lowered == b"transfer-encoding":
            # Only chunked ends by itself; any other coding last is read to the close.
            self._framed = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"

    def on_headers_complete(self) -> None:
        self._head_done = True
        if self._head_size > MAX_HEAD_BYTES:
            self._bad = BadAck(f"malformed answer: its head is over {MAX_HEAD_BYTES} bytes")

    def on_body(self, body: bytes) -> None:
        if self._bad is not None:
            return
        room = ACK_LIMIT + 1 - len(self._body)
        if len(body) >= room:
            self._body += body[:room]
            self._over = True
        else:
            self._body += body

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if self._bad is not None:
            return
        if 100 <= status < 200:  # 100 Continue, 103 Early Hints: the answer is yet to come
            self._reset()
            return
        if self._waiter is not None:
            self._answer(reusable=self._parser.should_keep_alive() and not self._over)


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


async def _open(loop: asyncio.AbstractEventLoop, factory: Callable[[], _Connection],
                host: str, port: int, context: ssl.SSLContext | None,
                deadline: float) -> _Connection:
    """A connection by ``deadline`` (TimeoutError after it).

    The connect is a task of its own, and this waits for whichever comes
    first: the connect, the deadline, or a cancel of the send. Not wait_for:
    before 3.12 it hands back a connection made just as the send was
    cancelled, and the cancelled send would go out anyway. A connect given
    up is cancelled, and a connection it made all the same is closed."""
    connecting = loop.create_task(loop.create_connection(
        factory, host, port, ssl=context, server_hostname=host if context else None))
    first: asyncio.Future[None] = loop.create_future()

    def wake(*_: object) -> None:
        if not first.done():
            first.set_result(None)

    connecting.add_done_callback(wake)
    timer = loop.call_at(deadline, wake)
    try:
        await first
    except BaseException:  # the send was cancelled
        _give_up(connecting)
        raise
    finally:
        timer.cancel()
    if not connecting.done():  # the deadline came first
        _give_up(connecting)
        raise TimeoutError()
    _, protocol = connecting.result()  # or the connect's own error (DNS, refused, TLS)
    return protocol


def _give_up(connecting: asyncio.Task) -> None:
    """A connect nobody waits for: cancelled, and its connection closed if made."""
    if connecting.done():
        _close_if_made(connecting)
    else:
        connecting.cancel()
        connecting.add_done_callback(_close_if_made)


def _close_if_made(connecting: asyncio.Task) -> None:
    if not connecting.cancelled() and connecting.exception() is None:  # retrieved, either way
        transport, _ = connecting.result()
        transport.close()


class WireClient:
    """Kept-alive HTTP/1.1 connections for ``send_http`` (``session=``): at most
    ``limit`` open at once, reused per host, port and TLS context. Use it
    from one event loop; ``close()`` (or ``async with``) aborts them all, and
    every send still in flight or waiting fails at once."""

    def __init__(self, limit: int = 100) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be an int of at least 1, got {limit!r}")
        self.limit = limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: dict[_Key, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._room: collections.deque[asyncio.Future[None]] = collections.deque()
        self._connecting = 0
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def post(self, destination: Destination, outgoing: Outgoing,
                   seconds: float) -> _Answer:
        """One exchange within ``seconds``: (status, the body's first
        ACK_LIMIT + 1 bytes at most, the Retry-After header or None)."""
        if self.closed:
            raise RuntimeError("this WireClient is closed")
        request = request_bytes(destination, outgoing)
        loop = self.loop
        deadline = loop.time() + seconds
        route = destination.route
        context = destination.ssl_context if route.tls else None
        key = (route.tls, route.host, route.port, context)
        connection = self._idle_connection(key, loop.time())
        if connection is None:
            connection = await self._connection(key, destination, context, deadline, seconds)
        waiter = connection.exchange(request, deadline, seconds)
        try:
            return await waiter
        except asyncio.CancelledError:
            if connection.is_waiting(waiter):  # unanswered: of no further use
                connection.close()
            raise  # answered as the send was cut: the connection went back whole

    def _idle_connection(self, key: _Key, now: float) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not connection.usable or now - connection.idle_since >= IDLE_SECONDS:
                connection.close()
            else:
                return connection
        self._idle.pop(key, None)  # no list kept for a route with nothing idle
        return None

    async def _connection(self, key: _Key, destination: Destination,
                          context: ssl.SSLContext | None, deadline: float,
                          seconds: float) -> _Connection:
        """An idle connection of ``key`` freed meanwhile, or a new one."""
        loop = self.loop
        route = destination.route
        while (room := self._reserve(key)) is False:
            await self._wait_for_room(deadline, seconds)
        if isinstance(room, _Connection):
            return room
        where = f"{route.host}:{route.port}"
        try:  # the room reserved is this connection's until it is open or failed
            protocol = await _open(loop, lambda: _Connection(self, key, where), route.host,
                                   route.port, context, deadline)
        except TimeoutError as exc:
            raise Retryable(f"timed out after {seconds}s") from exc
        except OSError as exc:  # DNS, refused, TLS: before any byte of the request
            text = transport_text(exc, route.host, route.port)
            raise Retryable(text or f"connection failed: {exc!r:.200}") from exc
        finally:
            self._connecting -= 1
            self._wake()
        if self.closed:
            protocol.close()
            raise RuntimeError("this WireClient is closed")
        if protocol.closed:  # the server closed it, or sent bytes unasked, at once
            raise Retryable(f"connection failed: {where} closed the connection before a "
                            "whole answer")
        self._open.add(protocol)
        return protocol

    async def _wait_for_room(self, deadline: float, seconds: float) -> None:
        """Until a connection closes or goes idle, or the deadline (Retryable)."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        self._room.append(waiter)
        timer = self.loop.call_at(deadline, _time_out, waiter)
        try:
            await waiter
        except TimeoutError as exc:
            raise Retryable(f"timed out after {seconds}s") from exc
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._wake()  # woken as it was cancelled: the wake goes to the next
            raise
        finally:
            timer.cancel()
            if waiter in self._room:
                self._room.remove(waiter)

    def _reserve(self, key: _Key) -> _Connection | bool:
        """An idle connection of ``key``; else True with room reserved for a new
        one (an idle connection to another route is closed to make it); else
        False: ``limit`` connections are open or being opened."""
        idle = self._idle_connection(key, self.loop.time())
        if idle is not None:
            return idle
        if len(self._open) + self._connecting < self.limit or self._close_one_idle():
            self._connecting += 1
            return True
        return False

    def _close_one_idle(self) -> bool:
        idle = next(iter(self._idle.values()), None)  # never an empty list: _forget drops it
        if idle is None:
            return False
        idle[0].close()  # the longest idle of its route; close() forgets it
        return True

    def _wake(self) -> None:
        while self._room:
            waiter = self._room.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _release(self, connection: _Connection) -> None:
        if self.closed:
            connection.close()
            return
        connection.idle_since = self.loop.time()
        self._idle.setdefault(connection.key, []).append(connection)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(IDLE_SECONDS, self._sweep)
        self._wake()  # one who waits for room takes it, or closes it for a route of theirs

    def _sweep(self) -> None:
        """Close what has been idle ``IDLE_SECONDS``, and look again while any is idle."""
        self._sweeper = None
        now = self.loop.time()
        stale = [connection for idle in self._idle.values() for connection in idle
                 if now - connection.idle_since >= IDLE_SECONDS]
        for connection in stale:
            connection.close()
        if any(self._idle.values()):
            self._sweeper = self.loop.call_later(max(IDLE_SECONDS / 4, 0.05), self._sweep)

    def _forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)
            if not idle:  # a route's list goes with its last idle connection, and with
                del self._idle[connection.key]  # it the key's hold on its TLS context
        if connection in self._open:
            self._open.discard(connection)
            self._wake()

    async def close(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """``close()`` from a plain function: nothing in it waits."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._open):
            connection.close("was closed with its WireClient")
        self._idle.clear()
        while self._room:
            waiter = self._room.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("this WireClient is closed"))

    async def __aenter__(self) -> WireClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
