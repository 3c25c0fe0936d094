"""The receiver as a real process (``asyncworker serve``) against bad files,
bad bytes, and slow or abusive clients.

Every case asserts what a caller sees (exit code and one line on stderr, or
the status of each answer), that no traceback reaches stderr, that refused
requests leave the inbox file as it was, and that the receiver still serves.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncworker.receiving.inbox import read_inbox
from lease import http as sync_http
from tests.support.receiving import FOREIGN, folder_state, snapshot
from tests.support.servers import ReceiverProcess

# ------------------------------------------------------------------ bad files


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", "serve", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", FOREIGN)
def test_serve_refuses_what_is_not_an_inbox(tmp_path: Path, case: str):
    build, _ = FOREIGN[case]  # the wording is the CLI's, which may check a path first
    folder = tmp_path / "files"
    folder.mkdir()
    path = build(folder)
    before = folder_state(folder)
    out = serve("--inbox", str(path))
    assert (out.returncode, out.stdout) == (2, ""), out
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert str(path) in out.stderr or str(path.parent) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert folder_state(folder) == before


def test_serve_refuses_a_port_in_use_and_creates_nothing(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = serve("--inbox", str(tmp_path / "inbox.db"), "--port", str(port))
    assert (out.returncode, out.stdout) == (2, ""), out
    assert len(out.stderr.splitlines()) == 1 and "Address already in use" in out.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ bad bytes


def exchange(port: int, payload: bytes, timeout: float = 10) -> bytes:
    """Send the bytes, read until the server closes (no half-close: aiohttp
    takes one as the client leaving)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def post(body: bytes, *, ctype: str = "application/json", extra: str = "",
         length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (f"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {length}\r\n{extra}Connection: close\r\n\r\n").encode() + body


def chunked(*chunks: bytes) -> bytes:
    return (b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"".join(chunks))


EVENT = b'{"id": "h", "qty": 1}'
ABUSE = {
    "not HTTP at all": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", 400),
    "HTTP/0.9 (a read: answered)": (b"GET /stats\r\n\r\n", 200),
    "unknown method": (b"BREW /events HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 400),
    "GET /events": (b"GET /events HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    "no such path": (post(EVENT).replace(b"/events", b"/events/../x", 1), 404),
    "request line of 100 KB": (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n", 400),
    "header of 100 KB": (post(EVENT, extra=f"X-Big: {'a' * 100_000}\r\n"), 400),
    "300 headers": (post(EVENT, extra="".join(f"X-{n}: y\r\n" for n in range(300))), 400),
    "NUL in a header": (post(EVENT, extra="X-A: a\x00b\r\n"), 400),
    "negative length": (post(EVENT, length=-1), 400),
    "two lengths": (post(EVENT, extra="Content-Length: 3\r\n"), 400),
    "length and chunked": (post(EVENT, extra="Transfer-Encoding: chunked\r\n"), 400),
    "bad chunk size": (chunked(b"zz\r\n" + EVENT + b"\r\n0\r\n\r\n"), 400),
    "chunked past 64 KiB": (chunked(b"8000\r\n" + b"x" * 32768 + b"\r\n8001\r\n"
                                    + b"y" * 32769 + b"\r\n0\r\n\r\n"), 413),
    "body past 64 KiB": (post(b"[" + b" " * 65_535 + b"]"), 413),
    "short body, then gone": (post(EVENT, length=100)[:-2], None),
    "nested 4000 deep": (post(b"[" * 4000), 400),
    "nested 65,000 deep": (post(b"[" * 65_000), 400),
    "a payload nested 20,000 deep": (post(b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
                                          extra="webhook-id: deep\r\n"), 400),
    "a payload with a lone surrogate": (post(b'{"a": "\\ud800"}', extra="webhook-id: s\r\n"),
                                        400),
    "a payload with NaN deep inside": (post(b'{"a": [1, {"b": NaN}]}',
                                            extra="webhook-id: n\r\n"), 400),
    "a payload with a duplicate key deep inside": (
        post(b'{"a": {"b": 1, "b": 2}}', extra="webhook-id: k\r\n"), 400),
    "a payload without a webhook-id": (post(b'{"order": 1}'), 400),
    "two webhook-ids": (post(b'{"order": 1}', extra="webhook-id: a\r\nwebhook-id: b\r\n"),
                        400),
    "a webhook-id of 10,000 characters": (post(b'{"order": 1}',
                                               extra=f"webhook-id: {'w' * 10_000}\r\n"), 400),
    "a webhook-id with a space": (post(b'{"order": 1}', extra="webhook-id: a b\r\n"), 400),
    "a lab event whose webhook-id is another": (post(EVENT, extra="webhook-id: other\r\n"),
                                                400),
    "not UTF-8": (post(b'{"id": "\xff", "qty": 1}'), 400),
    "UTF-16": (post('{"id": "u16", "qty": 1}'.encode("utf-16")), 400),
    "byte order mark": (post(b"\xef\xbb\xbf" + EVENT), 400),
    "two tokens": (post(EVENT, extra="X-Lease-Token: 9\r\nX-Lease-Token: 1\r\n"), 400),
    "a token of 10,000 digits": (post(EVENT, extra=f"X-Lease-Token: {'9' * 10_000}\r\n"), 400),
    "text/plain": (post(EVENT, ctype="text/plain"), 400),
    "qty of 400 digits": (post(b'{"id": "h", "qty": ' + b"9" * 400 + b"}"), 400),
    "qty 1e400": (post(b'{"id": "h", "qty": 1e400}'), 400),
    "Infinity": (post(b'{"id": "h", "qty": Infinity}'), 400),
    "a stats request with a body": (b"GET /stats HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                    b"Connection: close\r\n\r\nhello", 200),
}


def status_of(answer: bytes) -> int | None:
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[0].startswith(b"HTTP/") else None


def test_abusive_bytes_get_a_clear_answer_and_change_nothing(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        assert sync_http.send_http(rx.url, {"id": "seed", "qty": 3}, timeout=5)
        before = snapshot(inbox)
        got = {}
        for name, (payload, status) in ABUSE.items():
            if status is None:  # the client leaves mid-body: nobody to answer
                with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as sock:
                    sock.sendall(payload)
                got[name] = None
            else:
                got[name] = status_of(exchange(rx.port, payload))
        assert got == {name: status for name, (_, status) in ABUSE.items()}
        assert snapshot(inbox) == before
        assert sync_http.send_http(rx.url, {"id": "after", "qty": 2}, timeout=5)
        final = rx.final_counters()
    assert "Traceback" not in rx.stderr and "Error handling" not in rx.stderr, rx.stderr
    assert read_inbox(inbox).applied == {"seed": 3, "after": 2}
    assert (final["applied"], final["process_bad_http"] > 0) == (2, True)


# ------------------------------------------------------------------ slow clients


def test_three_hundred_half_open_connections_are_let_go(tmp_path: Path):
    """With its defaults (10 s to send a head, 10 s for a body), the receiver
    drops 300 half-open connections within the bound, and answers a normal
    POST at once while they are held."""
    inbox = tmp_path / "inbox.db"
    head = b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Le"
    body = (b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"id\": ")
    with ReceiverProcess(inbox) as rx:
        socks = []
        try:
            for n in range(300):
                sock = socket.create_connection(("127.0.0.1", rx.port), timeout=10)
                socks.append(sock)
                sock.sendall(head if n % 2 else body)
            started = time.monotonic()
            assert sync_http.send_http(rx.url, {"id": "served", "qty": 1}, timeout=5)
            assert time.monotonic() - started < 5
            answers = _until_all_closed(socks, give_up=40)
        finally:
            for sock in socks:
                sock.close()
        final = rx.final_counters()
    assert sum(a == b"" for a in answers) == 150  # heads never completed: closed
    assert sum(a.startswith(b"HTTP/1.1 408 ") for a in answers) == 150
    assert (final["process_timed_out"], final["process_open_connections"]) == (150, 0)
    assert "Traceback" not in rx.stderr
    assert read_inbox(inbox).applied == {"served": 1}


def _until_all_closed(socks: list[socket.socket], give_up: float) -> list[bytes]:
    """What each socket received until the server closed it."""
    got = {sock: b"" for sock in socks}
    open_ = set(socks)
    deadline = time.monotonic() + give_up
    while open_:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(open_)} connections still held after {give_up} s"
        ready, _, _ = select.select(list(open_), [], [], min(left, 1.0))
        for sock in ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            got[sock] += chunk
            if not chunk:
                open_.discard(sock)
    return [got[sock] for sock in socks]


def test_stats_answer_json_while_abused(tmp_path: Path):
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        exchange(rx.port, b"\x00" * 64 + b"\r\n\r\n")
        figures = rx.stats()
    assert json.loads(json.dumps(figures)) == figures
    assert all(isinstance(value, (int, float)) for value in figures.values())
