"""The async sender: over a ``WireClient`` (``asyncworker.wire``, the
dispatcher's and the default) or over a caller's aiohttp session. The
destination, the request and the verdict come from ``lease.http``
(``as_destination``, ``signed_parts``, ``answer_verdict``,
``transport_text``), so every sender puts the same bytes and headers on the
wire, reads an answer the same way and names a failure in the same words."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
from yarl import URL

from asyncworker.wire import WireClient
from lease.clock import wall_clock_ms
from lease.http import (
    ACK_LIMIT,
    Destination,
    Outgoing,
    answer_verdict,
    as_destination,
    check_timeout,
    signed_parts,
    transport_text,
)
from lease.worker import BadAck, Retryable

__all__ = ["Destination", "WireClient", "deliver", "send_http", "new_session"]


def new_session(limit: int = 100, *,
                ssl_context: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """A session for long-running use: no proxy settings read, ``limit``
    connections kept alive for reuse, TLS by ``ssl_context`` (a
    ``Destination``'s; each request names its own context as well)."""
    connector = aiohttp.TCPConnector(limit=limit, ssl=ssl_context or True)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)


async def send_http(url: str | Destination, event: dict, *, timeout: float,
                    **options: Any) -> bool:
    """POST one event, lab or payload; True only for what the destination's
    ACK policy takes as delivered (the table in ``lease.http``, which also
    says when an error has ``http_status`` and ``retry_after_ms``).

    ``url`` is the lab's strict URL (a str) or a ``Destination``.
    ``timeout`` (seconds) bounds the whole exchange, from the wait for a
    connection (DNS, connect, TLS handshake) to the last byte read.
    Redirects are never followed; proxy settings are never read (a caller's
    session must not set ``trust_env``). ``timestamp`` (int seconds, default
    the wall clock) is when a signed request says it was signed.
    ``digest``: a stored payload's digest from its intake, which checks its
    text for a fraction of the cost of making it canonical again
    (``lease.http.request_parts``). One request, no retries. ``session``: a
    ``WireClient`` whose connections are kept alive, or a caller's aiohttp
    session; without one, a short-lived ``WireClient`` is opened and closed.
    ``options`` are ``deliver``'s (token, session, timestamp, digest).
    """
    await deliver(url, event, timeout=timeout, **options)
    return True


async def deliver(
    url: str | Destination,
    event: dict,
    *,
    timeout: float,
    token: int | None = None,
    session: WireClient | aiohttp.ClientSession | None = None,
    timestamp: int | None = None,
    digest: str | None = None,
    trace_headers: Mapping[str, str] | None = None,
) -> int:
    """``send_http`` answering the HTTP status of the answer taken as delivered
    (an attempt's evidence); anything else is raised as ``send_http`` raises it.
    ``trace_headers``: the attempt's ``traceparent`` and ``tracestate``
    (``asyncworker.tracing``), transport headers the signature does not cover."""
    destination = as_destination(url)
    seconds = check_timeout(timeout)
    outgoing = signed_parts(destination, event, token, timestamp, digest)
    if trace_headers:
        outgoing.headers.update(trace_headers)
    if session is None:
        async with WireClient(limit=1) as own:
            return await _wire_exchange(own, destination, outgoing, seconds)
    if isinstance(session, WireClient):
        return await _wire_exchange(session, destination, outgoing, seconds)
    if session.trust_env:
        raise ValueError("session must not read proxy settings (trust_env=True)")
    return await _exchange(session, destination, outgoing, seconds)


async def _wire_exchange(client: WireClient, destination: Destination,
                         outgoing: Outgoing, seconds: float) -> int:
    status, answer, retry_after = await client.post(destination, outgoing, seconds)
    answer_verdict(destination, status, answer, outgoing.event_id, retry_after,
                   wall_clock_ms())
    return status


async def _exchange(session: aiohttp.ClientSession, destination: Destination,
                    outgoing: Outgoing, seconds: float) -> int:
    route = destination.route
    try:
        # aiohttp's total timeout runs from the wait for a pooled connection to
        # the last byte read: the whole exchange, with no extra task per send.
        status, answer, retry_after = await _post(session, destination, outgoing, seconds)
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise Retryable(f"timed out after {seconds}s") from exc
    except aiohttp.ClientConnectorError as exc:  # DNS, refused, TLS: before any byte sent
        text = transport_text(exc.os_error, route.host, route.port)
        raise Retryable(text or f"connection failed: {exc!r:.200}") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise Retryable(f"connection failed: {exc!r:.200}") from exc
    except aiohttp.ClientResponseError as exc:  # a malformed HTTP answer
        raise BadAck(f"malformed answer: {exc!r:.200}") from exc
    answer_verdict(destination, status, answer, outgoing.event_id, retry_after,
                   wall_clock_ms())
    return status


@functools.lru_cache(maxsize=256)
def _url(url: str) -> URL:
    """A destination's URL parsed once, not per request (it is checked already)."""
    return URL(url, encoded=True)


@functools.lru_cache(maxsize=256)
def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    """One (immutable) timeout per length, not one per request."""
    return aiohttp.ClientTimeout(total=seconds)


async def _post(session: aiohttp.ClientSession, destination: Destination, outgoing: Outgoing,
                seconds: float) -> tuple[int, bytes, str | None]:
    context = destination.ssl_context
    async with session.post(
        _url(destination.url), data=outgoing.body, headers=outgoing.headers,
        allow_redirects=False, timeout=_timeout(seconds),
        ssl=True if context is None else context,
    ) as response:
        content = response.content
        answer = b""
        # Read one byte past the cap, never more; an answer read whole (the
        # usual one) needs no further read to find its end.
        while len(answer) <= ACK_LIMIT and not content.at_eof():
            chunk = await content.read(ACK_LIMIT + 1 - len(answer))
            if not chunk:
                break
            answer += chunk
        return response.status, answer, response.headers.get("Retry-After")
