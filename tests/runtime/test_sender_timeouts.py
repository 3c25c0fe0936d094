"""Both senders' timeout bounds the whole exchange, and the answer cap holds, whatever
the server's pacing and framing.

Each row runs against the sync sender (``lease.http``) and the async one
(``asyncworker.sender``) and a raw server that plays a script of bytes and
pauses: the headers or the body trickled, with a length, without one (read to
close), chunked; a server that reads the request and says nothing, one that
never reads it, one that never accepts. A per-read socket timeout restarts with
every byte; only an absolute deadline ends these exchanges in time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat

import pytest

from asyncworker import new_session
from asyncworker import send_http as async_send
from lease import http as sync_http
from lease.policy import MAX_BODY_BYTES, canonical_body
from lease.worker import BadAck, Retryable

EVENT = {"id": "snack-7", "qty": 7}
TIMEOUT = 0.5
MARGIN = 1.5  # generous: the bound is the point, not the machine's speed
TRICKLE = 0.1  # seconds between pieces: far less than TIMEOUT, so per-read timeouts never fire
# A valid ACK, padded (JSON allows trailing blanks) so that trickled it lasts 6 s.
ACK = json.dumps({"id": EVENT["id"]}).encode() + b" " * 43

Piece = tuple[float, bytes | None]  # wait this long, then send these bytes (None: read
# the next request on this connection)


@dataclass(frozen=True)
class Script:
    """What the server does on a connection: read the request or not, send pieces,
    then close (the end of a read-to-close answer) or hold the connection open."""

    pieces: Callable[[], Iterable[Piece]] = tuple
    reads_request: bool = True
    closes: bool = False


# framing name -> (head, body pieces, closes) for an answer body
FRAMINGS: dict[str, Callable[[bytes], tuple[bytes, list[bytes], bool]]] = {
    "length": lambda body: (_head(b"Content-Length: %d" % len(body)), _bytes(body), False),
    "length, close": lambda body: (
        _head(b"Content-Length: %d" % len(body), b"Connection: close"), _bytes(body), False),
    "http/1.0": lambda body: (
        _head(b"Content-Length: %d" % len(body), version=b"1.0"), _bytes(body), False),
    "to close": lambda body: (_head(b"Connection: close"), _bytes(body), True),
    "chunked": lambda body: (
        _head(b"Transfer-Encoding: chunked"),
        [b"1\r\n%c\r\n" % byte for byte in body] + [b"0\r\n\r\n"], False),
}


def _head(*lines: bytes, version: bytes = b"1.1") -> bytes:
    return b"\r\n".join([b"HTTP/%s 200 OK" % version, b"Content-Type: application/json",
                         *lines]) + b"\r\n\r\n"


def _bytes(data: bytes) -> list[bytes]:
    return [bytes([byte]) for byte in data]


def paced(framing: str, pacing: str, interval: float) -> Script:
    """The ACK in ``framing``, its head or its body sent one piece per ``interval``."""
    head, body, closes = FRAMINGS[framing](ACK)
    if pacing == "head":
        pieces = [(interval, piece) for piece in _bytes(head)] + [(0.0, b"".join(body))]
    else:
        pieces = [(0.0, head)] + [(interval, piece) for piece in body]
    return Script(lambda: pieces, closes=closes)


def endless(head: bytes, piece: bytes) -> Script:
    """``head``, then ``piece`` again and again, as fast as the client reads."""
    return Script(lambda: chain([(0.0, head)], zip(repeat(0.0), repeat(piece))))


@dataclass
class PacedServer:
    """A raw HTTP server on 127.0.0.1, port 0, in threads: plays ``script`` on every
    connection. With ``accepts=False`` it listens with a full backlog and never accepts."""

    script: Script
    accepts: bool = True
    requests: list[bytes] = field(default_factory=list)  # the request bodies it read
    accepted: int = 0

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.fillers: list[socket.socket] = []
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/events"
        if self.accepts:
            self._thread(self._accept_loop)
        else:
            self._fill_backlog()

    def _thread(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _fill_backlog(self) -> None:
        """Connect until a connect is not answered: from then on no SYN is."""
        for _ in range(16):
            probe = socket.socket()
            probe.settimeout(0.2)
            try:
                probe.connect(self.sock.getsockname())
            except TimeoutError:
                probe.close()
                return
            self.fillers.append(probe)
        raise AssertionError("the backlog never filled")

    def _accept_loop(self) -> None:
        self.sock.settimeout(0.05)  # to notice ``stop``
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._thread(self._play, conn)

    def _play(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each piece on its own
            conn.settimeout(5)
            try:
                if self.script.reads_request:
                    self.requests.append(_read_request(conn))
                for pause, data in self.script.pieces():
                    if self.stop.wait(pause):
                        return
                    if data is None:
                        self.requests.append(_read_request(conn))
                    else:
                        conn.sendall(data)
            except OSError:  # the client gave up, as it should
                return
            if not self.script.closes:
                self.stop.wait()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        for sock in (*self.fillers, self.sock):
            sock.close()


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed before its request's end")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    return body


@pytest.fixture
def serve() -> Iterator[Callable[..., PacedServer]]:
    servers: list[PacedServer] = []

    def start(script: Script, **kwargs: bool) -> PacedServer:
        servers.append(PacedServer(script, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(params=["sync", "async", "aiohttp"])
def send(request: pytest.FixtureRequest) -> Callable[..., bool]:
    """send(url, event, timeout=...) -> verdict, whichever sender is under test (the
    async one on its own client, or on a caller's aiohttp session)."""
    if request.param == "sync":
        return sync_http.send_http

    async def on_aiohttp(url: str, event: dict, **kwargs: float) -> bool:
        async with new_session() as session:
            return await async_send(url, event, session=session, **kwargs)

    def run(url: str, event: dict, **kwargs: float) -> bool:
        if request.param == "aiohttp":
            return asyncio.run(on_aiohttp(url, event, **kwargs))
        return asyncio.run(async_send(url, event, **kwargs))

    return run


def timed(send: Callable[..., bool], url: str, timeout: float,
          expected: type[Exception], match: str) -> float:
    """Seconds until ``send`` raised ``expected``."""
    started = time.monotonic()
    with pytest.raises(expected, match=match):
        send(url, EVENT, timeout=timeout)
    return time.monotonic() - started


def sent_once(server: PacedServer) -> bool:
    return [json.loads(body) for body in server.requests] == [EVENT]


PACED = [(framing, pacing) for framing in FRAMINGS for pacing in ("head", "body")]
PACED_IDS = [f"{pacing} trickled, {framing}" for framing, pacing in PACED]


@pytest.mark.parametrize(("framing", "pacing"), PACED, ids=PACED_IDS)
def test_a_trickled_answer_times_out(send, serve, framing, pacing):
    server = serve(paced(framing, pacing, TRICKLE))
    assert timed(send, server.url, TIMEOUT, Retryable, "timed out") < TIMEOUT + MARGIN
    assert sent_once(server)


@pytest.mark.parametrize(("framing", "pacing"), PACED, ids=PACED_IDS)
def test_the_same_answer_paced_within_the_timeout_is_an_ack(send, serve, framing, pacing):
    """The scripts above are valid answers: only their pacing makes them fail."""
    server = serve(paced(framing, pacing, 0.001))
    assert send(server.url, EVENT, timeout=5) is True
    assert sent_once(server)


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
SILENCES = {
    "reads the request, answers nothing": Script(),
    "accepts, never reads": Script(reads_request=False),
    "endless informational answers": Script(lambda: zip(repeat(TRICKLE), repeat(CONTINUE))),
}


@pytest.mark.parametrize("script", SILENCES.values(), ids=SILENCES.keys())
def test_a_silent_server_times_out(send, serve, script):
    server = serve(script)
    assert timed(send, server.url, TIMEOUT, Retryable, "timed out") < TIMEOUT + MARGIN
    assert server.accepted == 1
    assert sent_once(server) if script.reads_request else server.requests == []


def test_a_payload_at_the_cap_is_sent_whole_and_held_to_the_bound(send, serve):
    """64 KiB of body go out in full; the silence after them ends at the deadline."""
    text, _ = canonical_body({"pad": "x" * (MAX_BODY_BYTES - len('{"pad":""}'))})
    assert len(text) == MAX_BODY_BYTES
    server = serve(Script())
    started = time.monotonic()
    with pytest.raises(Retryable, match="timed out"):
        send(server.url, {"id": "order:1", "body": text}, timeout=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT + MARGIN
    assert server.requests == [text.encode()]


def test_a_server_that_never_accepts_times_out(send, serve):
    server = serve(Script(), accepts=False)
    assert timed(send, server.url, TIMEOUT, Retryable, "timed out") < TIMEOUT + MARGIN


ENDLESS = {
    "announced length": endless(_head(b"Content-Length: 1000000000"), b"x" * 1000),
    "read to close": endless(_head(b"Connection: close"), b"x" * 1000),
    "chunked": endless(_head(b"Transfer-Encoding: chunked"), b"3e8\r\n" + b"x" * 1000 + b"\r\n"),
}


@pytest.mark.parametrize("script", ENDLESS.values(), ids=ENDLESS.keys())
def test_an_endless_answer_stops_at_the_cap(send, serve, script):
    """Reading past the cap would run into the (long) timeout: Retryable, not BadAck."""
    server = serve(script)
    assert timed(send, server.url, 10, BadAck, "larger than 4096 bytes") < MARGIN
    assert sent_once(server)


ENDLESS_LINES = {
    "status line": endless(b"HTTP/1.1 200 ", b"O" * 1000),
    "header line": endless(b"HTTP/1.1 200 OK\r\nX-Pad: ", b"p" * 1000),
    "header lines": endless(b"HTTP/1.1 200 OK\r\n", b"X-Pad: p\r\n"),
    "chunk size line": endless(_head(b"Transfer-Encoding: chunked"), b"0" * 1000),
}


@pytest.mark.parametrize("script", ENDLESS_LINES.values(), ids=ENDLESS_LINES.keys())
def test_an_endless_line_is_refused_or_times_out(send, serve, script):
    """A line or a head with no end is never read whole: malformed where the parser
    limits a line, out of time where it streams (llhttp reads endless zeros as one size)."""
    server = serve(script)
    started = time.monotonic()
    with pytest.raises((BadAck, Retryable)):
        send(server.url, EVENT, timeout=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT + MARGIN
    assert sent_once(server)


async def test_a_pooled_connection_is_held_to_the_same_bound(serve):
    """With a caller's session the second send reuses the first one's connection,
    and its answer trickles."""
    head, body, _ = FRAMINGS["length"](ACK)
    first = [(0.0, head + b"".join(body)), (0.0, None)]
    server = serve(Script(lambda: first + [(0.0, head)] + [(TRICKLE, b) for b in body]))
    async with new_session(limit=1) as session:
        assert await async_send(server.url, EVENT, timeout=5, session=session) is True
        started = time.monotonic()
        with pytest.raises(Retryable, match="timed out"):
            await async_send(server.url, EVENT, timeout=TIMEOUT, session=session)
        assert time.monotonic() - started < TIMEOUT + MARGIN
    assert server.accepted == 1
    assert [json.loads(request) for request in server.requests] == [EVENT, EVENT]
