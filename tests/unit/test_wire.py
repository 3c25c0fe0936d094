"""The dispatcher's HTTP/1.1 client (``asyncworker.wire``) against a scripted
raw server on loopback: which connections it keeps, reuses and gives up, and
what it refuses. The verdict table, timeouts, TLS and hostile answers are
the senders' shared tests (test_sender*.py, test_hostile.py), which run this
client as the "async" sender."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from asyncworker import send_http, wire
from asyncworker.wire import WireClient, request_bytes
from lease.http import Destination, Outgoing
from lease.worker import BadAck, Retryable

EVENT = {"id": "snack-7", "qty": 7}
ACK = json.dumps({"id": "snack-7"}).encode()

# answer(request number on its connection, request bytes) -> bytes to write, or None: close
Script = Callable[[int, bytes], Awaitable[bytes | None]]


def ok(body: bytes = ACK, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


class RawServer:
    """Reads whole requests (head and Content-Length body) off each connection
    and writes what the script says; counts connections, and those open at once."""

    def __init__(self, script: Script, close_after: bool = False, reset_after: bool = False,
                 close_on_accept: bool = False) -> None:
        self.script = script
        self.close_after = close_after  # close each connection after its first answer
        self.reset_after = reset_after  # ... by a TCP reset
        self.close_on_accept = close_on_accept  # answer and close before any request
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/events"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            if self.close_on_accept:  # as a server at its limit does: 503, then close
                writer.write(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
                return
            number = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                reply = await self.script(number, request)
                number += 1
                if reply is None:
                    return
                writer.write(reply)
                await writer.drain()
                if self.reset_after:
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if self.close_after:
                    return
        except ConnectionError:
            self.closed_by_client += 1
        finally:
            self.open_now -= 1
            writer.close()


def always(reply: bytes) -> Script:
    return after(0, reply)


def after(seconds: float, reply: bytes) -> Script:
    """Each request answered with ``reply``, ``seconds`` after it came."""
    async def script(number: int, request: bytes) -> bytes | None:
        if seconds:
            await asyncio.sleep(seconds)
        return reply

    return script


async def test_one_connection_serves_every_send_in_turn():
    async with RawServer(always(ok())) as server, WireClient(limit=4) as client:
        for token in range(1, 6):
            assert await send_http(server.url, EVENT, timeout=5, token=token,
                                   session=client) is True
    assert server.connections == 1
    first = server.requests[0]
    port = server.url.split(":")[2].split("/")[0]
    assert first.startswith(b"POST /events HTTP/1.1\r\nHost: 127.0.0.1:%s\r\n" % port.encode())
    assert first.endswith(b"\r\n\r\n" + json.dumps(EVENT).encode())
    assert b"Content-Length: %d\r\n" % len(json.dumps(EVENT)) in first
    assert b"X-Lease-Token: 5\r\n" in server.requests[4]


async def test_an_answer_that_says_close_is_not_reused():
    async with RawServer(always(ok(extra="Connection: close\r\n"))) as server, \
            WireClient() as client:
        for _ in range(3):
            assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 3


async def test_sends_beyond_the_limit_wait_for_a_connection():
    async with RawServer(after(0.05, ok())) as server, WireClient(limit=2) as client:
        results = await asyncio.gather(*(send_http(server.url, EVENT, timeout=10,
                                                   session=client) for _ in range(8)))
    assert results == [True] * 8
    assert server.most_open <= 2
    assert server.connections == 2


async def test_a_send_waiting_for_a_connection_is_bounded_by_its_timeout():
    async with RawServer(after(5, ok())) as server, WireClient(limit=1) as client:
        first = asyncio.ensure_future(send_http(server.url, EVENT, timeout=10, session=client))
        await asyncio.sleep(0)
        with pytest.raises(Retryable, match="timed out after 0.3s"):
            await send_http(server.url, EVENT, timeout=0.3, session=client)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    assert server.connections == 1


async def test_an_idle_connection_past_its_time_is_closed_not_reused(monkeypatch):
    monkeypatch.setattr(wire, "IDLE_SECONDS", -1.0)  # every idle connection is stale
    async with RawServer(always(ok())) as server, WireClient() as client:
        for _ in range(3):
            assert await send_http(server.url, EVENT, timeout=5, session=client) is True
        await asyncio.sleep(0.05)
    assert server.connections == 3
    assert server.closed_by_client >= 2


async def test_a_connection_the_server_closed_while_idle_is_replaced():
    async with RawServer(always(ok()), close_after=True) as server, WireClient() as client:
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
        for _ in range(500):  # the server's close reaches the idle connection
            if not client._open:
                break
            await asyncio.sleep(0.01)
        assert not client._open
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 2


async def test_a_chunked_answer_keeps_its_connection():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % len(ACK) + ACK + b"\r\n0\r\n\r\n")
    async with RawServer(always(chunked)) as server, WireClient() as client:
        for _ in range(2):
            assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 1


async def test_an_answer_without_a_length_ends_with_its_connection():
    reply = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + ACK
    async with RawServer(always(reply), close_after=True) as server, WireClient() as client:
        for _ in range(2):
            assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 2
    async with RawServer(always(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + ACK),
                         close_after=True) as server, WireClient() as client:
        with pytest.raises(Retryable, match="closed the connection before a whole answer"):
            await send_http(server.url, EVENT, timeout=5, session=client)


async def test_an_informational_answer_is_skipped():
    reply = b"HTTP/1.1 100 Continue\r\n\r\n" + ok()
    async with RawServer(always(reply)) as server, WireClient() as client:
        for _ in range(2):
            assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 1


async def test_a_head_over_the_bound_is_a_bad_ack():
    headers = "".join(f"X-Pad-{i}: {'p' * 100}\r\n" for i in range(400))  # ~42 KB
    reply = f"HTTP/1.1 200 OK\r\n{headers}Content-Length: {len(ACK)}\r\n\r\n".encode() + ACK
    async with RawServer(always(reply)) as server, WireClient() as client:
        with pytest.raises(BadAck, match="head is over 32768 bytes"):
            await send_http(server.url, EVENT, timeout=5, session=client)
        assert not client._open


async def test_a_body_over_the_cap_is_read_no_further_and_its_connection_dropped():
    huge = json.dumps({"id": "snack-7", "pad": "x" * 200_000}).encode()
    async with RawServer(always(ok(huge))) as server, WireClient() as client:
        with pytest.raises(BadAck) as refused:
            await send_http(server.url, EVENT, timeout=5, session=client)
        assert refused.value.http_status == 200
        assert "4096" in str(refused.value)
        with pytest.raises(BadAck):
            await send_http(server.url, EVENT, timeout=5, session=client)
    assert server.connections == 2


async def test_bytes_behind_a_whole_answer_spoil_the_connection():
    async with RawServer(always(ok() + ok())) as server, WireClient() as client:
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 2


async def test_a_cancelled_send_closes_its_connection():
    async def stall_first(number: int, request: bytes) -> bytes | None:
        if len(server.requests) == 1:
            await asyncio.sleep(5)
        return ok()

    async with RawServer(stall_first) as server, WireClient() as client:
        pending = asyncio.ensure_future(send_http(server.url, EVENT, timeout=10, session=client))
        for _ in range(200):
            if server.requests:
                break
            await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert not client._open
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
    assert server.connections == 2


async def test_a_closed_client_sends_nothing():
    async with RawServer(always(ok())) as server:
        client = WireClient()
        await client.close()
        with pytest.raises(RuntimeError, match="closed"):
            await send_http(server.url, EVENT, timeout=5, session=client)
    assert server.connections == 0


def test_a_header_that_would_split_the_request_is_refused():
    destination = Destination("http://127.0.0.1:9/events")
    for value in ("a\r\nX-Evil: 1", "a\nb", "a\0b"):
        with pytest.raises(ValueError, match="line break or NUL"):
            request_bytes(destination, Outgoing("x", b"{}", {"X-Test": value}))
    with pytest.raises(ValueError, match="limit must be an int"):
        WireClient(limit=0)


def test_the_host_header_names_the_port_only_when_it_is_not_the_default():
    parts = Outgoing("x", b"{}", {})
    assert b"Host: example.com\r\n" in request_bytes(Destination("https://example.com/h"), parts)
    assert b"Host: example.com:8443\r\n" in request_bytes(
        Destination("https://example.com:8443/h"), parts)
    assert b"Host: [::1]:8080\r\n" in request_bytes(Destination("http://[::1]:8080/h"), parts)
    assert request_bytes(Destination("https://example.com/h?a=1&b=2"), parts).startswith(
        b"POST /h?a=1&b=2 HTTP/1.1\r\n")


def by_token(answers: dict[int, bytes], otherwise: bytes = b"") -> Script:
    """The answer for each request's token; ``otherwise`` (nothing: no answer yet)."""
    async def script(number: int, request: bytes) -> bytes | None:
        return answers.get(tokens(request), otherwise)

    return script


def tokens(request: bytes) -> int:
    return int(request.split(b"X-Lease-Token: ")[1].split(b"\r\n")[0])


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_a_send_cut_as_its_answer_comes_leaves_the_connection_to_the_next():
    # A and C in flight on a connection each, the server silent; then, in one
    # loop step, both answers arrive and C is cancelled. A sends again at once
    # and takes C's connection, just back in the pool: C's cancel must not
    # touch it.
    async with RawServer(by_token({3: ok()})) as server, WireClient(limit=2) as client:
        async def a() -> object:
            await send_http(server.url, EVENT, timeout=5, token=1, session=client)
            return await send_http(server.url, EVENT, timeout=2, token=3, session=client)

        task_a = asyncio.ensure_future(a())
        await until(lambda: len(server.requests) == 1)
        (a_connection,) = client._open
        task_c = asyncio.ensure_future(send_http(server.url, EVENT, timeout=5, token=2,
                                                 session=client))
        await until(lambda: len(server.requests) == 2)
        (c_connection,) = client._open - {a_connection}
        a_connection.data_received(ok())
        c_connection.data_received(ok())
        task_c.cancel()
        assert await asyncio.wait_for(task_a, 10) is True
        with pytest.raises(asyncio.CancelledError):
            await task_c
    assert [tokens(request) for request in server.requests] == [1, 2, 3]


async def test_a_send_cut_as_room_frees_up_is_never_sent():
    async with RawServer(by_token({4: ok()})) as server, WireClient(limit=1) as client:
        first = asyncio.ensure_future(send_http(server.url, EVENT, timeout=5, token=1,
                                                session=client))
        await until(lambda: len(server.requests) == 1)
        (connection,) = client._open
        cut = asyncio.ensure_future(send_http(server.url, EVENT, timeout=5, token=2,
                                              session=client))
        await until(lambda: len(client._room) == 1)
        connection.data_received(ok())  # the first is answered: its connection is free
        cut.cancel()  # in the same step
        assert await first is True
        with pytest.raises(asyncio.CancelledError):
            await cut
        # A request cut but sent would be on the one connection before this one.
        assert await send_http(server.url, EVENT, timeout=5, token=4, session=client) is True
    assert [tokens(request) for request in server.requests] == [1, 4]


async def test_closing_the_client_ends_every_send_at_once():
    async with RawServer(by_token({})) as server:
        client = WireClient(limit=1)
        in_flight = asyncio.ensure_future(send_http(server.url, EVENT, timeout=30, token=1,
                                                    session=client))
        await until(lambda: len(server.requests) == 1)
        waiting = [asyncio.ensure_future(send_http(server.url, EVENT, timeout=30, token=2,
                                                   session=client)) for _ in range(2)]
        await until(lambda: len(client._room) == 2)
        await client.close()
        with pytest.raises(Retryable, match="closed with its WireClient"):
            await asyncio.wait_for(in_flight, 5)
        for send in waiting:
            with pytest.raises(RuntimeError, match="closed"):
                await asyncio.wait_for(send, 5)


async def test_a_server_that_closes_on_accept_costs_no_room():
    async with RawServer(always(ok()), close_on_accept=True) as bad, \
            RawServer(always(ok())) as good, WireClient(limit=2) as client:
        for _ in range(20):  # its 503 read as an answer, or its close before any
            with pytest.raises(Retryable, match="closed the connection|answered 503"):
                await send_http(bad.url, EVENT, timeout=5, session=client)
        assert not client._open and client._connecting == 0
        assert await send_http(good.url, EVENT, timeout=5, session=client) is True


async def test_idle_connections_are_closed_without_a_send(monkeypatch):
    monkeypatch.setattr(wire, "IDLE_SECONDS", 0.05)
    async with RawServer(always(ok())) as server, WireClient() as client:
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True
        await until(lambda: server.closed_by_client == 1)
        assert not client._open


async def test_a_coding_other_than_chunked_is_read_to_the_close():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n" + ACK
    async with RawServer(always(reply), close_after=True) as server, WireClient() as client:
        assert await send_http(server.url, EVENT, timeout=5, session=client) is True


async def test_a_body_cut_by_a_reset_is_no_answer():
    reply = b"HTTP/1.0 200 OK\r\n\r\n" + ACK[:5]
    async with RawServer(always(reply), reset_after=True) as server, WireClient() as client:
        with pytest.raises(Retryable, match="before a whole answer"):
            await send_http(server.url, EVENT, timeout=5, session=client)


async def test_a_route_with_nothing_idle_keeps_no_entry(monkeypatch):
    # A long-lived client that sends to many routes (or many destinations, each with
    # a TLS context of its own) must not keep an entry, and a context, per route.
    monkeypatch.setattr(wire, "IDLE_SECONDS", 0.05)
    async with WireClient(limit=2) as client:
        for _ in range(4):
            async with RawServer(always(ok())) as server:
                assert await send_http(server.url, EVENT, timeout=5, session=client) is True
        await until(lambda: not client._open)
        assert client._idle == {}


async def test_a_connection_made_as_its_send_is_cancelled_is_closed_and_never_used(
        monkeypatch):
    """The connect completes, and the send is cancelled before it resumes: the
    request must not go out. wait_for before 3.12 hands the connection back
    all the same (on 3.10 the send went out: this test failed), and so does a
    connect awaited in the send's own task when the cancel comes in its step."""
    loop = asyncio.get_running_loop()
    real = loop.create_connection
    made: list[asyncio.BaseTransport] = []

    async def connect_then_cancel(*args, **kwargs):
        transport, protocol = await real(*args, **kwargs)
        made.append(transport)
        sending.cancel()
        return transport, protocol

    monkeypatch.setattr(loop, "create_connection", connect_then_cancel)
    async with RawServer(always(ok())) as server, WireClient(limit=1) as client:
        sending = asyncio.ensure_future(send_http(server.url, EVENT, timeout=5, token=1,
                                                  session=client))
        with pytest.raises(asyncio.CancelledError):
            await sending
        await until(lambda: bool(made) and made[0].is_closing())
        assert not client._open and client._connecting == 0
        await until(lambda: server.closed_by_client == 1)
        monkeypatch.setattr(loop, "create_connection", real)
        assert await send_http(server.url, EVENT, timeout=5, token=2, session=client) is True
    assert [tokens(request) for request in server.requests] == [2]


async def test_a_connect_past_its_deadline_is_given_up_and_cancelled(monkeypatch):
    loop = asyncio.get_running_loop()
    cancelled = asyncio.Event()

    async def never_connects(*args, **kwargs):
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    monkeypatch.setattr(loop, "create_connection", never_connects)
    async with WireClient(limit=1) as client:
        with pytest.raises(Retryable, match="timed out after 0.2s"):
            await send_http("http://127.0.0.1:9/events", EVENT, timeout=0.2, token=1,
                            session=client)
        await asyncio.wait_for(cancelled.wait(), 5)
        assert client._connecting == 0 and not client._open
