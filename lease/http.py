"""Destinations, the ACK policies' verdicts, and the synchronous sender on ``http.client``.

Two ways to name where an event goes:

- the lab's URL, a ``str``: ``http://<loopback>[:port]/events`` and nothing
  else (``check_url``), the ``echo-id`` policy, no signature; every other
  string is a ValueError before anything connects;
- a ``Destination`` the operator names: https to any host and path
  (certificate and hostname verified against the system store, or only
  against ``ca_file``), plain http to loopback, and plain http elsewhere
  only with ``insecure_http`` (the body and its signature travel in the
  clear); an ACK policy; secrets to sign every request with.

Both senders (this one and ``asyncworker.sender``) read no proxy settings,
follow no redirect, read at most ``ACK_LIMIT + 1`` bytes of an answer, and
bound the whole exchange (DNS, connect, TLS handshake, request, answer) by
one timeout. ``answer_verdict`` decides what an answer proves, by the
destination's policy, for both.

| what came back                                 | echo-id (default) | status    |
| ---------------------------------------------- | ----------------- | --------- |
| 2xx, JSON object whose ``"id"`` is the sent id | True              | True      |
| 2xx, anything else (or over the cap)           | BadAck            | True      |
| 3xx (redirects are never followed), 1xx        | BadAck            | BadAck    |
| 401, 403 (a wrong secret, missing credentials) | Permanent         | Permanent |
| 410                                            | Permanent         | Permanent |
| 400, 404, 409, 413, 422, every other 4xx       | Permanent         | Retryable |
| 429, 5xx                                       | Retryable (1)     | Retryable (1) |
| timeout (DNS, connect, handshake, answer)      | Retryable         | Retryable |
| refused, reset, closed without an answer       | Retryable         | Retryable |
| DNS failure ("DNS: ...")                       | Retryable         | Retryable |
| TLS certificate not verified, handshake failed | Retryable         | Retryable |
| an answer cut off before its announced end     | Retryable         | Retryable |
| bytes that are not an HTTP answer              | BadAck            | BadAck    |

(1) with the answer's ``Retry-After`` as the exception's ``retry_after_ms``.

Why these rows:

- ``status`` is the webhook convention (Stripe and Svix retry every non-2xx,
  and stop for good only on 410). It is weaker evidence than ``echo-id``:
  a 2xx from a proxy, a load balancer, a maintenance page or a handler that
  answers before it commits looks exactly like a delivery, and the job is
  done. Under ``echo-id`` only a receiver that parsed the event can name
  its id. Use ``status`` for receivers you do not control.
- 401 and 403 are permanent in both: the receiver refused the request's
  credentials (with signing, our own receiver answers 401 to a wrong or
  stale signature), and every retry would be refused the same way until an
  operator changes a secret. The job goes dead with the status in its
  attempt, loudly, and ``redrive`` sends it again once the secret is fixed.
- Under ``status`` a 4xx other than those is retried, within the job's
  budget: a foreign receiver answers 404 while a deploy rolls out and 400
  for a check it will relax; the webhook services retry them too. Under
  ``echo-id`` the receiver is ours and a 4xx is its considered refusal.
- Transport and TLS failures are retried: a certificate renewed, a DNS
  record fixed or a service restarted makes the next attempt work, and the
  budget bounds the attempts. Each says what failed ("TLS: certificate
  verify failed: certificate has expired", "DNS: cannot resolve ...",
  "connection refused by ..."), the same text from both senders, and that
  text is the attempt's evidence.
- A ``Retry-After`` (delta-seconds or an HTTP date) on a 429 or 5xx (a 503
  above all) is the exception's ``retry_after_ms`` under both policies: the
  receiver says when it can take the next request, whichever ACK it gives
  when it does. The dispatcher waits at least that long, up to its policy's
  backoff cap. The lab's ``run_once`` keeps its own delay (``classify_error``
  reads no header).

``http_status`` (an int) is an attribute of the raised exception, set when
an HTTP answer's status line arrived and decided the verdict: the evidence
of the attempt (``getattr(error, "http_status", None)``). A transport
failure has no status, so none is invented.

Two kinds of event travel, both built by ``request_parts``:

- the lab's ``{"id", "qty"}`` (``check_event``: the contract's ids), sent as
  ``{"id": ..., "qty": ...}`` exactly as before;
- a payload event ``{"id", "body"}`` (``check_product_event``: the product's
  ids), its body a JSON object or the canonical text of one (what the store
  hands back), sent as that canonical text's UTF-8 bytes, byte for byte.

Every request carries the job id in a ``webhook-id`` header (the Standard
Webhooks name), ``Content-Type: application/json`` and, with a token, the
``X-Lease-Token`` header. A destination with secrets adds
``webhook-timestamp`` and ``webhook-signature`` (``lease.signing``): one
signature per secret, over the id, the timestamp and the exact body bytes.
A destination's static ``headers`` (an endpoint's ``Authorization``, say)
are added as they are, by both senders; their values are secrets, never
shown in a repr, an error or a log line. With tracing on, the dispatcher adds
the attempt's ``traceparent`` and ``tracestate`` (W3C Trace Context): transport
headers like ``Content-Type``, outside the signature, which Standard Webhooks
defines over the id, the timestamp and the body alone.
"""

from __future__ import annotations

import datetime
import email.utils
import functools
import http.client
import ipaddress
import json
import math
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    NamedTuple,
)
from urllib.parse import urlsplit

from lease.clock import wall_clock_ms
from lease.policy import MAX_BODY_BYTES, PRODUCT, check_product_event, stored_body
from lease.signing import check_secrets, signature_headers
from lease.worker import (
    MAX_TOKEN,
    BadAck,
    LeaseError,
    Permanent,
    Retryable,
    check_event,
    check_job_id,
)

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "ACK_LIMIT",
    "ACK_POLICIES",
    "ID_HEADER",
    "TOKEN_HEADER",
    "Destination",
    "Outgoing",
    "PlainHttpRefused",
    "SENDER_HEADERS",
    "ack_verdict",
    "answer_verdict",
    "as_destination",
    "check_static_headers",
    "check_timeout",
    "check_token",
    "check_url",
    "client_context",
    "request_parts",
    "retry_after_ms",
    "send_http",
    "signed_parts",
    "status_verdict",
    "transport_text",
]

ACK_LIMIT = 4096  # bytes of an answer we read; anything longer is not an ACK
ACK_POLICIES = ("echo-id", "status")
TOKEN_HEADER = "X-Lease-Token"
ID_HEADER = "webhook-id"  # the Standard Webhooks name; the signature covers it
EVENTS_PATH = "/events"
MAX_URL_CHARS = 2048
MAX_TIMESTAMP = 2**40  # seconds: far past any real clock, still an int HMAC input


def check_url(url: object) -> tuple[str, int]:
    """(host, port) of an ``http://<loopback>[:port]/events`` URL, else ValueError.

    The lab's URL: loopback is any 127.x.y.z, ::1 or localhost; nothing
    leaves this host. A ``Destination`` is how to name anything else.
    """
    if type(url) is not str:
        raise ValueError(f"url must be a str, got {type(url).__name__}")
    return _check_url_text(url)


@functools.lru_cache(maxsize=64)  # a dispatcher checks the same URL on every send
def _check_url_text(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"url must start with http://, got {url!r:.100}")
    if parts.path != EVENTS_PATH or parts.query or parts.fragment:
        raise ValueError(f"url path must be exactly {EVENTS_PATH}, got {url!r:.100}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry credentials")
    host = parts.hostname or ""
    if not is_loopback(host):
        raise ValueError(f"url host must be loopback (127.0.0.0/8, ::1, localhost), got {host!r}")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"url port is invalid: {url!r:.100}") from exc
    return host, port


def is_loopback(host: str) -> bool:
    """Only this host can reach it: localhost, 127.0.0.0/8, ::1 (bracketed or
    not). A name other than localhost may resolve to anything: not loopback.
    The one check of the senders, the receiver and the page."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------- destinations


class PlainHttpRefused(ValueError):
    """Plain http to a host that is not loopback, not allowed. ``allow`` names
    what allows it where the refusal is read: the argument (``insecure_http``)
    here, a command's flag in the command line, nothing where none does."""

    def __init__(self, host: str, allow: str | None = "insecure_http=True") -> None:
        self.host = host
        way = f"use https://, or {allow} to send in the clear" if allow else "use https://"
        super().__init__(f"plain http only to a loopback host, got {host!r}: {way}")


class _Route(NamedTuple):
    tls: bool
    host: str
    port: int
    target: str  # the request target: path and query


@dataclass(frozen=True, repr=False)
class Destination:
    """Where events go, and how their answers are read; checked at construction.

    - ``url``: ``https://host[:port]/any/path[?query]`` (no credentials, no
      fragment), or ``http://`` to a loopback host (127.0.0.0/8, ::1,
      localhost); ``http://`` to any other host only with ``insecure_http``.
    - ``ack``: ``"echo-id"`` (the default: a 2xx JSON object naming the id)
      or ``"status"`` (any 2xx; weaker evidence, see the module's table).
    - ``ca_file``: a PEM file of the CA certificates to trust, and only
      those (https only); by default the system's store. The hostname (or
      IP address) is verified against the certificate either way.
    - ``secrets``: key bytes (``lease.signing.read_secrets``); every request
      is signed with each of them. Empty: unsigned.
    - ``insecure_http``: allow plain http to a host that is not loopback:
      the body, the token and the signature cross the network in the clear.
    - ``headers``: static (name, value) pairs sent with every request (an
      ``Authorization`` a receiver asks for). A value is a secret like a
      signing secret; a name may not be one the sender writes itself
      (``SENDER_HEADERS``); the signature does not cover them.

    Every problem is a one-line ValueError that never shows a secret or a
    header's value; the repr counts the secrets and the headers and shows
    none of them.
    """

    url: str
    ack: str = "echo-id"
    ca_file: str | os.PathLike[str] | None = None
    secrets: tuple[bytes, ...] = ()
    insecure_http: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    route: _Route = field(init=False, compare=False)
    ssl_context: ssl.SSLContext | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.insecure_http) is not bool:
            raise ValueError(f"insecure_http must be a bool, got {self.insecure_http!r:.40}")
        route = _check_route(self.url, self.insecure_http)
        if self.ack not in ACK_POLICIES:
            raise ValueError(f"ack must be one of {', '.join(ACK_POLICIES)}, "
                             f"got {self.ack!r:.40}")
        object.__setattr__(self, "secrets", _check_secrets(self.secrets))
        object.__setattr__(self, "headers", check_static_headers(self.headers))
        context = None
        if route.tls:
            ca_file = _check_ca_path(self.ca_file)
            object.__setattr__(self, "ca_file", ca_file)
            context = _shared_context(ca_file)
        elif self.ca_file is not None:
            raise ValueError("ca_file applies to https:// URLs only")
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "ssl_context", context)

    def __repr__(self) -> str:
        signed = f"<{len(self.secrets)} secrets>" if self.secrets else "()"
        static = f", headers=<{len(self.headers)}>" if self.headers else ""
        return (f"Destination({self.url!r}, ack={self.ack!r}, ca_file={self.ca_file!r}, "
                f"secrets={signed}, insecure_http={self.insecure_http!r}{static})")


# What every sender writes itself: a static header may not replace any of them.
SENDER_HEADERS = frozenset({
    "host", "content-type", "content-length", "transfer-encoding", "connection",
    TOKEN_HEADER.lower(), ID_HEADER, "webhook-timestamp", "webhook-signature",
    "traceparent", "tracestate",  # an attempt's span (W3C Trace Context), when tracing is on
})
MAX_STATIC_HEADERS = 20
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{0,4096}")


def check_static_headers(headers: object) -> tuple[tuple[str, str], ...]:
    """A destination's static headers: (name, value) pairs (or a mapping), each
    name an HTTP token given once (any case) and none of ``SENDER_HEADERS``,
    each value printable ASCII (no line break: it cannot split a request), at
    most 4096 characters. A message never shows a value: it may be a credential."""
    if isinstance(headers, dict):
        headers = tuple(headers.items())
    if not isinstance(headers, (list, tuple)):
        raise ValueError(f"headers must be (name, value) pairs, got {type(headers).__name__}")
    if len(headers) > MAX_STATIC_HEADERS:
        raise ValueError(f"at most {MAX_STATIC_HEADERS} headers")
    seen: set[str] = set()
    checked = []
    for pair in headers:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("each header must be a (name, value) pair")
        name, value = pair
        if type(name) is not str or not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"header name {name!r:.40} is not an HTTP token")
        lowered = name.lower()
        if lowered in SENDER_HEADERS:
            raise ValueError(f"header {name!r} is the sender's own and cannot be set")
        if lowered in seen:
            raise ValueError(f"header {name!r} is given twice")
        if type(value) is not str or not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {name!r}: its value must be printable ASCII, "
                             "at most 4096 characters")
        seen.add(lowered)
        checked.append((name, value))
    return tuple(checked)


def _check_route(url: object, insecure_http: bool) -> _Route:
    if type(url) is not str:
        raise ValueError(f"url must be a str, got {type(url).__name__}")
    if not url.isascii() or not url.isprintable() or " " in url or len(url) > MAX_URL_CHARS:
        raise ValueError(f"url must be printable ASCII without spaces (percent-encode it), "
                         f"at most {MAX_URL_CHARS} characters: {url!r:.100}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"url is invalid ({exc}): {url!r:.100}") from None
    if parts.scheme not in ("https", "http"):
        raise ValueError(f"url must start with https:// (or http:// to loopback), "
                         f"got {url!r:.100}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry credentials")
    if "#" in url:
        raise ValueError(f"url must not have a fragment: {url!r:.100}")
    host = parts.hostname or ""
    if not host:
        raise ValueError(f"url has no host: {url!r:.100}")
    if port == 0:
        raise ValueError(f"url port is invalid: {url!r:.100}")
    tls = parts.scheme == "https"
    if not tls and not insecure_http and not is_loopback(host):
        raise PlainHttpRefused(host)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Route(tls, host, port or (443 if tls else 80), target)


def _check_secrets(secrets: object) -> tuple[bytes, ...]:
    """No secrets (unsigned), or secrets as ``lease.signing`` checks them."""
    if isinstance(secrets, (list, tuple)) and not secrets:
        return ()
    return check_secrets(secrets)


def _check_ca_path(ca_file: object) -> str | None:
    if ca_file is None:
        return None
    if not isinstance(ca_file, (str, os.PathLike)) or isinstance(os.fspath(ca_file), bytes):
        raise ValueError(f"ca_file must be a path, got {type(ca_file).__name__}")
    return os.fsdecode(ca_file)


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """A client context: TLS 1.2 or later, certificate and hostname verified,
    against ``ca_file`` alone when given (else the system's store)."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except OSError as exc:  # ssl.SSLError included: not a PEM certificate
        why = getattr(exc, "reason", None) or exc.strerror or exc
        raise ValueError(f"ca_file {ca_file}: cannot load CA certificates: {why}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.sslsocket_class = _DeadlineSSLSocket  # the sync sender's bound on every read
    return context


def _shared_context(ca_file: str | None) -> ssl.SSLContext:
    """``client_context``, made once per CA file as it is now (its path, inode,
    size and modification time) and shared by the destinations that name it:
    loading a trust store takes tens of milliseconds, and a dispatcher serving
    endpoints reads them (each with its destination) every few seconds. A
    file replaced or rewritten is loaded afresh; the system's store once."""
    if ca_file is None:
        return _context_of(None, None)
    try:
        found = os.stat(ca_file)
    except OSError:
        return client_context(ca_file)  # the error it names
    return _context_of(ca_file, (found.st_ino, found.st_size, found.st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _context_of(ca_file: str | None, version: tuple[int, int, int] | None) -> ssl.SSLContext:
    return client_context(ca_file)


def as_destination(target: object) -> Destination:
    """A Destination as it is, or the lab's strict URL (``check_url``) as one."""
    if isinstance(target, Destination):
        return target
    check_url(target)
    assert isinstance(target, str)
    return _lab_destination(target)


@functools.lru_cache(maxsize=64)
def _lab_destination(url: str) -> Destination:
    return Destination(url)


# --------------------------------------------------------------- the request


def check_timeout(timeout: object) -> float:
    """A timeout in seconds: an int or float, finite, greater than 0."""
    if type(timeout) not in (int, float):
        raise ValueError(f"timeout must be an int or float, got {type(timeout).__name__}")
    assert isinstance(timeout, (int, float))
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be finite and > 0, got {timeout!r}")
    return float(timeout)


def check_token(token: object) -> int | None:
    if token is None:
        return None
    if type(token) is not int or not 1 <= token <= MAX_TOKEN:
        raise ValueError(f"token must be None or an int in 1..{MAX_TOKEN}, got {token!r:.40}")
    return token


def _check_timestamp(timestamp: object) -> int | None:
    if timestamp is None:
        return None
    if type(timestamp) is not int or not 0 <= timestamp <= MAX_TIMESTAMP:
        raise ValueError(f"timestamp must be None or int seconds in 0..{MAX_TIMESTAMP}, "
                         f"got {timestamp!r:.40}")
    return timestamp


class Outgoing(NamedTuple):
    """What both senders put on the wire for one event."""

    event_id: str  # the id an ACK must name
    body: bytes
    headers: dict[str, str]


def request_parts(event: object, token: int | None, digest: str | None = None) -> Outgoing:
    """The checked event's request body and headers, for both senders.

    ValueError, before anything is sent, for an event that is neither a lab
    event nor a payload event (see the module's docstring). ``digest``: a
    stored payload's digest from its intake, which checks its text for a
    fraction of the cost of making it canonical again (``stored_body``).
    """
    event_id, body = _event_body(event, digest)
    headers = {"Content-Type": "application/json", ID_HEADER: event_id}
    if token is not None:
        headers[TOKEN_HEADER] = str(token)
    return Outgoing(event_id, body, headers)


def signed_parts(destination: Destination, event: object, token: object,
                 timestamp: object, digest: str | None = None) -> Outgoing:
    """``request_parts``, signed with the destination's secrets (if any) at
    ``timestamp`` (int seconds; None: the wall clock). Every argument is
    checked, signed or not, before anything is sent."""
    outgoing = request_parts(event, check_token(token), digest)
    stamp = _check_timestamp(timestamp)
    if destination.headers:  # names checked apart from the sender's own: none replaced
        outgoing.headers.update(destination.headers)
    if destination.secrets:
        stamp = int(time.time()) if stamp is None else stamp
        outgoing.headers.update(signature_headers(
            destination.secrets, outgoing.event_id, stamp, outgoing.body))
    return outgoing


def _event_body(event: object, digest: str | None = None) -> tuple[str, bytes]:
    if type(event) is dict and event.keys() == {"id", "qty"}:
        check_event(event)  # the lab's event keeps the lab's rule and its bytes
        return event["id"], json.dumps({"id": event["id"], "qty": event["qty"]}).encode()
    if (digest is not None and type(event) is dict and event.keys() == {"id", "body"}
            and type(event["body"]) is str):
        return check_job_id("event id", event["id"], PRODUCT), stored_body(event["body"], digest)
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


# --------------------------------------------------------------- verdicts


def answer_verdict(destination: Destination, status: int, body: bytes, event_id: str,
                   retry_after: str | None, now_ms: int) -> Literal[True]:
    """What an answer proves under the destination's ACK policy (the table)."""
    if destination.ack == "status":
        return status_verdict(status, body, retry_after, now_ms)
    return ack_verdict(status, body, event_id, retry_after, now_ms)


def ack_verdict(status: int, body: bytes, event_id: str, retry_after: str | None = None,
                now_ms: int = 0) -> Literal[True]:
    """Decide what an HTTP answer proves. ``body`` holds at most ACK_LIMIT + 1 bytes.

    Every error raised carries ``http_status``, the status that decided it;
    a 429 or 5xx also ``retry_after_ms`` (``retry_after`` is the answer's
    Retry-After header; ``now_ms`` the wall clock, for one given as a date).
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
        raise _unavailable(status, retry_after, now_ms)
    if 400 <= status < 500:
        raise _answered(Permanent, status, _refusal(status, body))
    raise _answered(BadAck, status, f"receiver answered {status}; redirects are not followed")


def status_verdict(status: int, body: bytes, retry_after: str | None,
                   now_ms: int) -> Literal[True]:
    """The ``status`` policy: any 2xx is delivered, whatever its body (read and
    discarded up to the cap). ``retry_after`` is the answer's Retry-After
    header; ``now_ms`` the wall clock, for one given as an HTTP date."""
    if 200 <= status < 300:
        return True
    if status in (401, 403, 410):
        raise _answered(Permanent, status, _refusal(status, body))
    if status == 429 or 500 <= status < 600:
        raise _unavailable(status, retry_after, now_ms)
    if 400 <= status < 500:
        raise _answered(Retryable, status, f"receiver answered {status}, retried within the "
                                           f"job's budget: {body[:200]!r}")
    raise _answered(BadAck, status, f"receiver answered {status}; redirects are not followed")


def _unavailable(status: int, retry_after: str | None, now_ms: int) -> LeaseError:
    """A 429 or 5xx, under either policy: Retryable, with the answer's
    Retry-After as ``retry_after_ms`` (None when it gave none)."""
    wait_ms = retry_after_ms(retry_after, now_ms)
    said = "" if wait_ms is None else f", Retry-After {wait_ms} ms"
    error = _answered(Retryable, status, f"receiver answered {status}{said}")
    error.retry_after_ms = wait_ms  # type: ignore[attr-defined]  # documented in the table
    return error


def _refusal(status: int, body: bytes) -> str:
    hint = " (a wrong secret, or credentials it wants?)" if status in (401, 403) else ""
    return f"receiver refused with {status}{hint}: {body[:200]!r}"


def retry_after_ms(value: str | None, now_ms: int) -> int | None:
    """A Retry-After header as milliseconds from ``now_ms`` (delta-seconds or
    an HTTP date, RFC 9110 10.2.3), 0 for a date past, at most a day (the
    product's longest delay); None when absent or not one of the two."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        seconds = int(text) if len(text) <= 12 else PRODUCT.max_delay_ms  # no huge ints
        return min(seconds * 1000, PRODUCT.max_delay_ms)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": an HTTP date is always GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0, min(round(when.timestamp() * 1000) - now_ms, PRODUCT.max_delay_ms))


def _answered(kind: type[LeaseError], status: int, message: str) -> LeaseError:
    """``kind(message)`` with the answer's status as evidence of the attempt."""
    error = kind(message)
    error.http_status = status  # type: ignore[attr-defined]  # documented in the table
    return error


def transport_text(exc: BaseException, host: str, port: int) -> str | None:
    """What a failure to reach ``host:port`` was, in the words both senders use,
    or None when it is none of these (a refusal, DNS, TLS)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or str(exc)
        return f"TLS: certificate verify failed: {why} ({host}:{port})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: handshake failed with {host}:{port}: {exc.reason or exc}"
    if isinstance(exc, socket.gaierror):
        return f"DNS: cannot resolve {host!r}: {exc.strerror}"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused by {host}:{port}"
    return None


# --------------------------------------------------------------- the sync sender


def send_http(url: str | Destination, event: dict, *, timeout: float,
              token: int | None = None, timestamp: int | None = None,
              digest: str | None = None) -> bool:
    """POST one event, lab or payload; True only for what the destination's
    ACK policy takes as delivered (see the module's table).

    ``url`` is the lab's strict URL (a str) or a ``Destination``.
    ``timeout`` bounds the whole exchange, from resolving the host to the
    last byte of the answer, whatever the server's pacing: every connect,
    handshake, send and receive is given only the time left before one
    absolute deadline. ``timestamp`` (int seconds, default the wall clock)
    is when a signed request says it was signed. ``digest``: a stored
    payload's digest from its intake (``request_parts``). One request per
    call; this function never retries. http.client reads no proxy settings.
    """
    destination = as_destination(url)
    seconds = check_timeout(timeout)
    outgoing = signed_parts(destination, event, token, timestamp, digest)
    deadline = time.monotonic() + seconds
    conn = _DeadlineConnection(destination, deadline)
    try:
        conn.request("POST", destination.route.target, body=outgoing.body,
                     headers=outgoing.headers)
        response = conn.getresponse()
        with response:  # closes the socket now, even with the answer unread past the cap
            answer = response.read(ACK_LIMIT + 1)
    except (OSError, http.client.HTTPException) as exc:
        late = time.monotonic() >= deadline
        raise _transport_error(exc, seconds, late, conn) from exc
    finally:
        conn.close()
    if response.length and len(answer) <= ACK_LIMIT:  # fewer bytes than announced
        raise Retryable("connection closed in the middle of the answer")
    return answer_verdict(destination, response.status, answer, outgoing.event_id,
                          response.getheader("Retry-After"), wall_clock_ms())


def _transport_error(exc: BaseException, seconds: float, late: bool,
                     conn: _DeadlineConnection) -> Exception:
    """What a failed exchange means. Past the deadline it is a timeout, whatever
    the socket said on the way; before the connection stood, it says what failed."""
    if isinstance(exc, _ResolveTimeout):
        return Retryable(f"DNS: resolving {conn.host!r} timed out after {seconds}s")
    if late or isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return Retryable(f"timed out after {seconds}s")
    text = None if conn.established else transport_text(exc, conn.host, conn.port)
    if text is not None:
        return Retryable(text)
    if isinstance(exc, (OSError, http.client.IncompleteRead)):
        return Retryable(f"connection failed: {exc!r:.200}")
    return BadAck(f"malformed answer: {exc!r:.200}")


class _Deadline:
    """The time left before one absolute deadline (a time.monotonic() value)."""

    deadline: float

    def time_left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the exchange's deadline has passed")
        return left


class _DeadlineSocket(_Deadline, socket.socket):
    """A socket whose every send and receive waits only for the time left.

    A socket timeout alone restarts with each call, so a server that sends one
    byte just inside it, over and over, holds the reader for ever. http.client
    reads through ``makefile``, whose reads all come down to ``recv_into``.
    """

    def __init__(self, family: int, kind: int, proto: int, deadline: float) -> None:
        super().__init__(family, kind, proto)
        self.deadline = deadline

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(self.time_left())
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(self.time_left())  # sendall's timeout bounds the whole call
        super().sendall(data, flags)


class _DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    """The same bound over TLS: made by ``SSLContext.wrap_socket`` (the
    context's ``sslsocket_class``), its deadline set before the handshake."""

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None,
                  flags: int = 0) -> int:
        self.settimeout(self.time_left())
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        # SSLSocket.sendall gives each of its sends the whole timeout: loop
        # here, each send given only the time left.
        with memoryview(data) as view, view.cast("B") as octets:
            sent = 0
            while sent < len(octets):
                self.settimeout(self.time_left())
                sent += self.send(octets[sent:], flags)


class _DeadlineConnection(http.client.HTTPConnection):
    """http.client's request writing and answer parsing over a deadline socket,
    TLS-wrapped for an https destination."""

    def __init__(self, destination: Destination, deadline: float) -> None:
        route = destination.route
        super().__init__(route.host, route.port)
        if route.tls:
            self.default_port = 443  # the Host header names the port only when it is not
        self.context = destination.ssl_context
        self.deadline = deadline
        self.established = False  # connected (and the TLS handshake done)

    def connect(self) -> None:
        sock: socket.socket = _connect(self.host, self.port, self.deadline)
        if self.context is not None:
            sock = _handshake(sock, self.context, self.host, self.deadline)
        self.sock = sock
        self.established = True


def _connect(host: str, port: int, deadline: float) -> _DeadlineSocket:
    """Connect to the first address of ``host`` that answers before ``deadline``."""
    error: OSError = ConnectionRefusedError(f"no address for {host!r}")
    for family, kind, proto, _name, address in _resolve(host, port, deadline):
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


class _ResolveTimeout(TimeoutError):
    """The resolver did not answer before the deadline."""


_AddrInfo = Sequence[tuple[Any, ...]]  # getaddrinfo's 5-tuples


def _resolve(host: str, port: int, deadline: float) -> _AddrInfo:
    """getaddrinfo within the deadline. An address is resolved at once; a
    name asks the system's resolver, which has no timeout of its own (an
    unanswering DNS server holds it for its retries): the lookup runs on a
    daemon thread, abandoned at the deadline."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    found: list = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except Exception as exc:  # handed to the sender's thread, raised there
            found.append(exc)

    thread = threading.Thread(target=lookup, name=f"resolve {host}", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not found:
        raise _ResolveTimeout(f"resolving {host!r} took longer than the timeout")
    if isinstance(found[0], Exception):
        raise found[0]
    return found[0]


def _handshake(sock: socket.socket, context: ssl.SSLContext, host: str,
               deadline: float) -> _DeadlineSSLSocket:
    """The TLS handshake, within the deadline (one timeout over the whole of
    it), the certificate and ``host`` verified by the context."""
    try:
        tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    assert isinstance(tls, _DeadlineSSLSocket)  # client_context made the context
    try:
        tls.deadline = deadline
        tls.settimeout(tls.time_left())
        tls.do_handshake()
    except BaseException:
        tls.close()
        raise
    return tls
