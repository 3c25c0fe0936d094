"""The strict HTTP sender's rules, and its synchronous twin on ``http.client``.

An answer is evidence of completion only when it is a 2xx JSON object that
names the very ID that was sent, from a loopback ``/events`` URL, within a
size cap, without a redirect. ``ack_verdict`` is the one function that decides
this; the async sender in ``asyncworker`` calls it too.

| what came back                                      | verdict   | http_status |
| --------------------------------------------------- | --------- | ----------- |
| 2xx, JSON object, ``"id"`` equal to the sent id      | True      |             |
| 2xx with a wrong/missing id, not JSON, over the cap | BadAck    | the status  |
| 3xx (redirects are never followed), 1xx             | BadAck    | the status  |
| 400, 409, 413, 422 and every other 4xx but 429      | Permanent | the status  |
| 429, 5xx                                            | Retryable | the status  |
| timeout, refused, reset, closed without an answer   | Retryable | absent      |
| an answer cut off before its announced end          | Retryable | absent      |
| bytes that are not an HTTP answer                   | BadAck    | absent      |

``http_status`` (an int) is an attribute of the raised exception, set when
an HTTP answer's status line arrived and decided the verdict: the evidence of
the attempt (``getattr(error, "http_status", None)``). A transport failure has
no status, so none is invented.

Two kinds of event travel, both built by ``request_parts``:

- the lab's ``{"id", "qty"}`` (``check_event``: the contract's ids), sent as
  ``{"id": ..., "qty": ...}`` exactly as before;
- a payload event ``{"id", "body"}`` (``check_product_event``: the product's
  ids), its body a JSON object or the canonical text of one (what the store
  hands back), sent as that canonical text's UTF-8 bytes, byte for byte.

Every request carries the job id in a ``webhook-id`` header (the Standard
Webhooks name), ``Content-Type: application/json`` and, with a token, the
``X-Lease-Token`` header.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import math
import socket
import time
from typing import TYPE_CHECKING, Dict, Literal, NamedTuple, Optional, Tuple, Type
from urllib.parse import urlsplit

from lease.policy import MAX_BODY_BYTES, check_product_event
from lease.worker import MAX_TOKEN, BadAck, LeaseError, Permanent, Retryable, check_event

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "ACK_LIMIT",
    "ID_HEADER",
    "TOKEN_HEADER",
    "Outgoing",
    "ack_verdict",
    "check_timeout",
    "check_token",
    "check_url",
    "request_parts",
    "send_http",
]

ACK_LIMIT = 4096  # bytes of an answer we read; anything longer is not an ACK
TOKEN_HEADER = "X-Lease-Token"
ID_HEADER = "webhook-id"  # the Standard Webhooks name; a signature will cover it
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


class Outgoing(NamedTuple):
    """What both senders put on the wire for one event."""

    event_id: str  # the id an ACK must name
    body: bytes
    headers: Dict[str, str]


def request_parts(event: object, token: Optional[int]) -> Outgoing:
    """The checked event's request body and headers, for both senders.

    ValueError, before anything is sent, for an event that is neither a lab
    event nor a payload event (see the module's docstring).
    """
    event_id, body = _event_body(event)
    headers = {"Content-Type": "application/json", ID_HEADER: event_id}
    if token is not None:
        headers[TOKEN_HEADER] = str(token)
    return Outgoing(event_id, body, headers)


def _event_body(event: object) -> Tuple[str, bytes]:
    if type(event) is dict and event.keys() == {"id", "qty"}:
        check_event(event)  # the lab's event keeps the lab's rule and its bytes
        return event["id"], json.dumps({"id": event["id"], "qty": event["qty"]}).encode()
    text = None
    if type(event) is dict and event.keys() == {"id", "body"} and type(event["body"]) is str:
        text = event["body"]
        event = {"id": event["id"], "body": _parse_body(text)}
    intake = check_product_event(event)  # every other shape is refused here, by name
    assert intake.body is not None  # the {"id", "qty"} shape was handled above
    if text is not None and intake.body != text:
        # Not what the store writes: what is sent must be the very bytes whose
        # digest deduplicates the job, at intake and at the receiver.
        raise ValueError(f"event body is not canonical JSON text: {text!r:.80}")
    return intake.id, intake.body.encode()


def _parse_body(text: str) -> object:
    if len(text) > MAX_BODY_BYTES:  # a character is at least a byte: too long unparsed
        raise ValueError(f"event body is more than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"event body is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("event body is nested too deeply") from None


def ack_verdict(status: int, body: bytes, event_id: str) -> Literal[True]:
    """Decide what an HTTP answer proves. ``body`` holds at most ACK_LIMIT + 1 bytes.

    Every error raised carries ``http_status``, the status that decided it.
    """
    if 200 <= status < 300:
        if len(body) > ACK_LIMIT:
            raise _answered(BadAck, status, f"answer is larger than {ACK_LIMIT} bytes")
        try:
            ack = json.loads(body)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise _answered(BadAck, status, f"answer is not JSON: {body[:60]!r}") from exc
        if not isinstance(ack, dict) or ack.get("id") != event_id:
            got = ack.get("id") if isinstance(ack, dict) else type(ack).__name__
            raise _answered(BadAck, status, f"ACK names {got!r:.80}, not {event_id!r}")
        return True
    if status == 429 or 500 <= status < 600:
        raise _answered(Retryable, status, f"receiver answered {status}")
    if 400 <= status < 500:
        raise _answered(Permanent, status, f"receiver refused with {status}: {body[:200]!r}")
    raise _answered(BadAck, status, f"receiver answered {status}; redirects are not followed")


def _answered(kind: Type[LeaseError], status: int, message: str) -> LeaseError:
    """``kind(message)`` with the answer's status as evidence of the attempt."""
    error = kind(message)
    error.http_status = status  # type: ignore[attr-defined]  # documented in the table
    return error


def send_http(url: str, event: dict, *, timeout: float, token: Optional[int] = None) -> bool:
    """POST one event, lab or payload; True only for a verifiable ACK (see the
    module's table).

    ``timeout`` bounds the whole exchange, from connecting to the last byte of
    the answer, whatever the server's pacing: every connect, send and receive
    is given only the time left before one absolute deadline. One request per
    call; this function never retries. http.client reads no proxy settings.
    """
    host, port = check_url(url)
    seconds = check_timeout(timeout)
    outgoing = request_parts(event, check_token(token))
    deadline = time.monotonic() + seconds
    conn = _DeadlineConnection(host, port, deadline)
    try:
        conn.request("POST", EVENTS_PATH, body=outgoing.body, headers=outgoing.headers)
        response = conn.getresponse()
        with response:  # closes the socket now, even with the answer unread past the cap
            answer = response.read(ACK_LIMIT + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise _transport_error(exc, seconds, time.monotonic() >= deadline) from exc
    finally:
        conn.close()
    if response.length and len(answer) <= ACK_LIMIT:  # fewer bytes than announced
        raise Retryable("connection closed in the middle of the answer")
    return ack_verdict(response.status, answer, outgoing.event_id)


def _transport_error(exc: BaseException, seconds: float, late: bool) -> Exception:
    """What a failed exchange means. Past the deadline it is a timeout, whatever
    the socket said on the way."""
    if late or isinstance(exc, (TimeoutError, socket.timeout)):
        return Retryable(f"timed out after {seconds}s")
    if isinstance(exc, (OSError, http.client.IncompleteRead)):
        return Retryable(f"connection failed: {exc!r:.200}")
    return BadAck(f"malformed answer: {exc!r:.200}")


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive waits only for the time left.

    A socket timeout alone restarts with each call, so a server that sends one
    byte just inside it, over and over, holds the reader for ever. http.client
    reads through ``makefile``, whose reads all come down to ``recv_into``.
    """

    def __init__(self, family: int, kind: int, proto: int, deadline: float) -> None:
        super().__init__(family, kind, proto)
        self.deadline = deadline  # a time.monotonic() value

    def time_left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the exchange's deadline has passed")
        return left

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(self.time_left())
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(self.time_left())  # sendall's timeout bounds the whole call
        super().sendall(data, flags)


class _DeadlineConnection(http.client.HTTPConnection):
    """http.client's request writing and answer parsing over a _DeadlineSocket."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port)
        self.deadline = deadline

    def connect(self) -> None:
        self.sock = _connect(self.host, self.port, self.deadline)


def _connect(host: str, port: int, deadline: float) -> _DeadlineSocket:
    """Connect to the first address of ``host`` that answers before ``deadline``."""
    error: OSError = ConnectionRefusedError(f"no address for {host!r}")
    for family, kind, proto, _name, address in socket.getaddrinfo(
            host, port, 0, socket.SOCK_STREAM):
        sock = _DeadlineSocket(family, kind, proto, deadline)
        try:
            sock.settimeout(sock.time_left())
            sock.connect(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does
            return sock
        except OSError as exc:  # TimeoutError included: the deadline is the same for all
            sock.close()
            error = exc
    raise error
