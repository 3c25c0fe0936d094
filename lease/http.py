"""The strict HTTP sender's rules, and its synchronous twin on ``http.client``.

An answer is evidence of completion only when it is a 2xx JSON object that
names the very ID that was sent, from a loopback ``/events`` URL, within a
size cap, without a redirect. ``ack_verdict`` is the one function that decides
this; the async sender in ``asyncworker`` calls it too.

| what came back                                      | verdict            |
| --------------------------------------------------- | ------------------ |
| 2xx, JSON object, ``"id"`` equal to the sent id      | True               |
| 2xx with a wrong/missing id, not JSON, over the cap | BadAck             |
| 3xx (redirects are never followed), 1xx             | BadAck             |
| 400, 409, 413, 422 and every other 4xx but 429      | Permanent          |
| 429, 5xx                                            | Retryable          |
| timeout, refused, reset, closed without an answer   | Retryable          |
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import ipaddress
import json
import math
import socket
import threading
import time
from typing import Literal, Optional, Tuple
from urllib.parse import urlsplit

from lease.worker import MAX_TOKEN, BadAck, Permanent, Retryable, check_event

__all__ = [
    "ACK_LIMIT",
    "TOKEN_HEADER",
    "ack_verdict",
    "check_timeout",
    "check_token",
    "check_url",
    "request_parts",
    "send_http",
]

ACK_LIMIT = 4096  # bytes of an answer we read; anything longer is not an ACK
TOKEN_HEADER = "X-Lease-Token"
EVENTS_PATH = "/events"


def check_url(url: object) -> Tuple[str, int]:
    """(host, port) of an ``http://<loopback>[:port]/events`` URL, else ValueError.

    Loopback is any 127.x.y.z, ::1 or localhost; nothing leaves this host.
    """
    if type(url) is not str:
        raise ValueError(f"url must be a str, got {type(url).__name__}")
    return _check_url_text(url)


@functools.lru_cache(maxsize=64)  # a dispatcher checks the same URL on every send
def _check_url_text(url: str) -> Tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"url must start with http://, got {url!r:.100}")
    if parts.path != EVENTS_PATH or parts.query or parts.fragment:
        raise ValueError(f"url path must be exactly {EVENTS_PATH}, got {url!r:.100}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry credentials")
    host = parts.hostname or ""
    if not _is_loopback(host):
        raise ValueError(f"url host must be loopback (127.0.0.0/8, ::1, localhost), got {host!r}")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"url port is invalid: {url!r:.100}") from exc
    return host, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_timeout(timeout: object) -> float:
    """A timeout in seconds: an int or float, finite, greater than 0."""
    if type(timeout) not in (int, float):
        raise ValueError(f"timeout must be an int or float, got {type(timeout).__name__}")
    assert isinstance(timeout, (int, float))
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be finite and > 0, got {timeout!r}")
    return float(timeout)


def check_token(token: object) -> Optional[int]:
    if token is None:
        return None
    if type(token) is not int or not 1 <= token <= MAX_TOKEN:
        raise ValueError(f"token must be None or an int in 1..{MAX_TOKEN}, got {token!r:.40}")
    return token


def request_parts(event: dict, token: Optional[int]) -> Tuple[bytes, dict]:
    """The request body (exactly id and qty) and headers, for both senders."""
    body = json.dumps({"id": event["id"], "qty": event["qty"]}).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[TOKEN_HEADER] = str(token)
    return body, headers


def ack_verdict(status: int, body: bytes, event_id: str) -> Literal[True]:
    """Decide what an HTTP answer proves. ``body`` holds at most ACK_LIMIT + 1 bytes."""
    if 200 <= status < 300:
        if len(body) > ACK_LIMIT:
            raise BadAck(f"answer is larger than {ACK_LIMIT} bytes")
        try:
            ack = json.loads(body)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise BadAck(f"answer is not JSON: {body[:60]!r}") from exc
        if not isinstance(ack, dict) or ack.get("id") != event_id:
            got = ack.get("id") if isinstance(ack, dict) else type(ack).__name__
            raise BadAck(f"ACK names {got!r:.80}, not {event_id!r}")
        return True
    if status == 429 or 500 <= status < 600:
        raise Retryable(f"receiver answered {status}")
    if 400 <= status < 500:
        raise Permanent(f"receiver refused with {status}: {body[:200]!r}")
    raise BadAck(f"receiver answered {status}; redirects are not followed")


def send_http(url: str, event: dict, *, timeout: float, token: Optional[int] = None) -> bool:
    """POST one event; True only for a verifiable ACK (see the module's table).

    ``timeout`` bounds the whole exchange, from connecting to the last byte of
    the answer: a watchdog shuts the socket down when it runs out, so a server
    that trickles its answer cannot hold the call longer. One request per
    call; this function never retries. http.client reads no proxy settings.
    """
    host, port = check_url(url)
    check_event(event)
    seconds = check_timeout(timeout)
    body, headers = request_parts(event, check_token(token))
    deadline = time.monotonic() + seconds
    conn = http.client.HTTPConnection(host, port, timeout=seconds)
    watchdog = threading.Timer(seconds, _shut, (conn,))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", EVENTS_PATH, body=body, headers=headers)
        response = conn.getresponse()
        answer = response.read(ACK_LIMIT + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise _transport_error(exc, seconds, time.monotonic() >= deadline) from exc
    finally:
        watchdog.cancel()
        conn.close()
    if time.monotonic() >= deadline:  # the watchdog may have cut the answer short
        raise Retryable(f"timed out after {seconds}s")
    if response.length and len(answer) <= ACK_LIMIT:  # fewer bytes than announced
        raise Retryable("connection closed in the middle of the answer")
    return ack_verdict(response.status, answer, event["id"])


def _transport_error(exc: BaseException, seconds: float, late: bool) -> Exception:
    """What a failed exchange means. Past the deadline it is a timeout, whatever
    the watchdog's shutdown made the socket say."""
    if late or isinstance(exc, (TimeoutError, socket.timeout)):
        return Retryable(f"timed out after {seconds}s")
    if isinstance(exc, (OSError, http.client.IncompleteRead)):
        return Retryable(f"connection failed: {exc!r:.200}")
    return BadAck(f"malformed answer: {exc!r:.200}")


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
