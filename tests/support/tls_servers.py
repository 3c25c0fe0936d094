"""TLS for the sending side's tests: a throwaway PKI (trustme) and real servers.

- ``Pki``: a CA, its PEM file, a good certificate (localhost, 127.0.0.2,
  127.0.0.1), an expired one, one for another name, and a second CA that
  trusts none of them.
- ``receiver``: an aiohttp server (https with a certificate, or plain http)
  on 127.0.0.1 or 127.0.0.2 whose POST handler records each request (its
  headers, body and the client's port: one port per connection) and answers
  as the test says (by default an echo-id ACK naming the ``webhook-id``).
- ``RawServer``: a thread that accepts TCP connections and does what the
  test says with each (no handshake at all, plain bytes to a TLS client, a
  TLS answer that trickles).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trustme
from aiohttp import web


class Pki:
    def __init__(self, tmp_path: Path) -> None:
        self.ca = trustme.CA()
        self.good = self.ca.issue_cert("localhost", "127.0.0.2", "127.0.0.1")
        self.expired = self.ca.issue_cert(
            "localhost", "127.0.0.2", "127.0.0.1",
            not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30),
            not_after=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1))
        self.other_name = self.ca.issue_cert("orders.example")
        self.ca_file = tmp_path / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.wrong_ca_file = tmp_path / "wrong-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(self.wrong_ca_file))


def server_context(cert: trustme.LeafCert) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    return context


@dataclass
class Seen:
    headers: dict[str, str]
    body: bytes
    path: str
    client_port: int


Answer = Callable[[Seen], Awaitable[web.StreamResponse]]


async def echo_id(seen: Seen) -> web.StreamResponse:
    return web.json_response({"id": seen.headers["webhook-id"]})


@dataclass
class Receiver:
    url: str  # scheme, host, port and the POST path
    port: int
    seen: list[Seen] = field(default_factory=list)

    @property
    def connections(self) -> int:
        return len({s.client_port for s in self.seen})


@contextlib.asynccontextmanager
async def receiver(cert: trustme.LeafCert | None, host: str = "127.0.0.2",
                   path: str = "/hooks/orders", answer: Answer = echo_id,
                   ) -> AsyncIterator[Receiver]:
    """A real aiohttp server for the length of the block (https when ``cert``)."""
    found: list[Seen] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen = Seen({k.lower(): v for k, v in request.headers.items()}, await request.read(),
                    request.path_qs, peer[1] if peer else 0)
        found.append(seen)
        return await answer(seen)

    app = web.Application()
    app.router.add_post(path.split("?")[0], handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0, ssl_context=server_context(cert) if cert else None)
    await site.start()
    port = runner.addresses[0][1]
    scheme = "https" if cert else "http"
    try:
        yield Receiver(f"{scheme}://{host}:{port}{path}", port, found)
    finally:
        await runner.cleanup()


Behaviour = Callable[[socket.socket, threading.Event], None]  # (connection, server closing)


class RawServer:
    """Accepts connections on 127.0.0.2 and runs ``behaviour`` on each, in a thread."""

    def __init__(self, behaviour: Behaviour, host: str = "127.0.0.2") -> None:
        self.behaviour = behaviour
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.closing = threading.Event()
        self.threads: list[threading.Thread] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.02)  # closing a listener does not wake an accept()
        while not self.closing.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        # OSError: the client gave up, which is what these tests provoke
        with sock, contextlib.suppress(OSError):
            self.behaviour(sock, self.closing)

    def close(self) -> None:
        self.closing.set()
        self.acceptor.join(10)
        self.listener.close()
        for thread in self.threads:
            thread.join(10)

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def silent(sock: socket.socket, closing: threading.Event) -> None:
    """Accept and say nothing (no TLS handshake) until the server closes."""
    closing.wait(10)


def not_tls(sock: socket.socket, closing: threading.Event) -> None:
    """A plain-http server's answer to a TLS client hello."""
    sock.recv(4096)
    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def tls_trickle(cert: trustme.LeafCert) -> Behaviour:
    """Over TLS: headers of a 100-byte answer at once, then a byte every 0.1 s."""
    context = server_context(cert)

    def act(sock: socket.socket, closing: threading.Event) -> None:
        sock.settimeout(10)
        with context.wrap_socket(sock, server_side=True) as tls:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                data += chunk
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n"
                        b"Content-Type: application/json\r\n\r\n")
            for _ in range(100):
                if closing.wait(0.1):
                    return
                tls.sendall(b" ")

    return act
