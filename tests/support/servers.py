"""Real servers for the tests, all on 127.0.0.1 with port 0.

- ``ReceiverProcess``: the project's receiver as its own process
  (``python -m asyncworker serve``), stopped with SIGTERM, killed if it hangs;
  over https with ``cafile`` (the CA its certificate is checked against).
- ``HostileServer``: a small raw HTTP server in a thread whose answer is set
  per test (wrong IDs, redirects, trickles, closed connections, ...).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


class ReceiverProcess:
    """``command`` replaces ``python -m asyncworker serve --inbox INBOX`` (a
    script that serves and prints its URL first, as serve does)."""

    def __init__(self, inbox: Path, *args: str, cafile: os.PathLike | None = None,
                 command: list[str] | None = None) -> None:
        self.inbox = inbox
        self.stdout = self.stderr = ""
        start = command or [sys.executable, "-m", "asyncworker", "serve", "--inbox", str(inbox)]
        self.proc = subprocess.Popen([*start, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        scheme = "https" if cafile is not None else "http"
        if not self.url.startswith(f"{scheme}://"):
            self.stop()
            raise RuntimeError(f"receiver did not start: {self.url!r} {self.stderr}")
        scheme, _, rest = self.url.partition("://")
        self.base = f"{scheme}://{rest.split('/', 1)[0]}"  # the root: /stats and /metrics
        self.port = int(self.base.rsplit(":", 1)[1])
        self.tls = None if cafile is None else ssl.create_default_context(cafile=os.fspath(cafile))

    def stats(self) -> dict:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=self.tls))
        with opener.open(self.base + "/stats", timeout=10) as answer:
            return json.loads(answer.read())

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.proc.stdout is not None and self.proc.stdout.closed:
            return self.proc.returncode  # stopped and read already
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
        return self.proc.returncode

    def final_counters(self) -> dict:
        """Stop gracefully; the counters it printed on its way out (its last line)."""
        assert self.stop() == 0 and "Traceback" not in self.stderr, self.stderr
        return dict(json.loads(self.stdout.strip().splitlines()[-1]))

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Request:
    def __init__(self, line: str, headers: dict, body: bytes) -> None:
        self.line, self.headers, self.body = line, headers, body


Behaviour = Callable[["Request", socket.socket], None]


def answer(status: int, body: bytes = b"", headers: dict | None = None) -> Behaviour:
    def act(request: Request, sock: socket.socket) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        for key, value in (headers or {}).items():
            head += f"{key}: {value}\r\n"
        sock.sendall(head.encode() + b"\r\n" + body)

    return act


def ack_for(sent_id: str | None = None, **extra: object) -> Behaviour:
    """200 with a JSON ACK naming sent_id (default: the id the request carried)."""

    def act(request: Request, sock: socket.socket) -> None:
        got = json.loads(request.body)["id"] if sent_id is None else sent_id
        answer(200, json.dumps({"id": got, **extra}).encode(),
               {"Content-Type": "application/json"})(request, sock)

    return act


def close_unanswered(request: Request, sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)


def hang(request: Request, sock: socket.socket) -> None:
    time.sleep(3)


def trickle(request: Request, sock: socket.socket) -> None:
    """Headers at once, then one byte of a long body every 0.1 s."""
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n"
                 b"Content-Type: application/json\r\n\r\n")
    for _ in range(100):
        time.sleep(0.1)
        try:
            sock.sendall(b" ")
        except OSError:
            return


def garbage(request: Request, sock: socket.socket) -> None:
    sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")


class HostileServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.requests: list[Request] = []
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                request = _read_request(self.request)
                if request is None:
                    return
                server.requests.append(request)
                server.behaviour(request, self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/events"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_request(sock: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(":", 1) for line in lines[1:] if ":" in line)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Request(lines[0], headers, body)


def free_port() -> int:
    """A port with nothing listening (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen, signum: int = signal.SIGTERM,
                 timeout: float = 30) -> tuple[str, str]:
    """Signal a child (unless it has ended), wait for it, kill it if it hangs:
    what it printed on stdout and stderr."""
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=timeout)
