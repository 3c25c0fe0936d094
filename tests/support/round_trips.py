"""A TCP proxy on loopback between a PostgreSQL client and its server that
counts the client's round trips: every message after which the client waits
for the server (a simple Query, a Sync ending an extended query or a
pipeline, a Flush asking for the results of statements sent since the last
wait). Counted from the protocol, not from the packets, so how the kernel
splits the bytes changes nothing. The connection must not use TLS
(``sslmode=disable``)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from types import TracebackType

# The frontend messages a client waits after (PostgreSQL protocol 3).
WAITS = {b"Q", b"S", b"H"}
# The untyped requests a client may send before its startup packet.
_REQUESTS = {struct.pack("!I", 80877103), struct.pack("!I", 80877104)}


class RoundTrips:
    """``with RoundTrips(host, port) as proxy``: connect to ``proxy.port``;
    ``proxy.count`` is the round trips of every connection so far."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.count = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def __enter__(self) -> RoundTrips:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Every socket shut (a shutdown, not a close alone, wakes the thread
        blocked in accept), then every thread joined."""
        for sock in [self._listener, *self._sockets_now()]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)
            if thread.is_alive():
                raise RuntimeError(f"the proxy's thread {thread.name} did not end")

    def _sockets_now(self) -> list[socket.socket]:
        with self._lock:
            return list(self._sockets)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
            self._start(self._client_to_server, client, server)
            self._start(self._pump, server, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _close_write(sink)

    def _client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        """Forward the client's bytes, counting its messages that wait: the
        first message (the startup packet) has no type byte, every later one
        a type byte and a length that counts itself."""
        pending = b""
        started = sent = False
        try:
            while data := client.recv(65536):
                server.sendall(data)
                pending += data
                while True:
                    head = 4 if not started else 5
                    if len(pending) < head:
                        break
                    length = struct.unpack("!I", pending[head - 4:head])[0]
                    size = length if not started else 1 + length
                    if len(pending) < size:
                        break
                    kind = pending[:1] if started else b""
                    if kind in WAITS and (kind != b"H" or sent):
                        with self._lock:
                            self.count += 1
                    if started:
                        # a Flush right after a Sync asks for the rest of the
                        # same answer (psycopg's pipeline does): no new wait
                        sent = kind not in WAITS
                    # an SSL or GSS encryption request comes before the startup packet
                    started = started or pending[4:8] not in _REQUESTS
                    pending = pending[size:]
        except OSError:
            pass
        finally:
            _close_write(server)


def _close_write(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
