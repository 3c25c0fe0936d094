"""The strict async sender on aiohttp; the request and the verdict come from
``lease.http`` (``request_parts``, ``ack_verdict``), so both senders put the
same bytes and headers on the wire and read an answer the same way."""

from __future__ import annotations

import asyncio
from typing import Optional

import aiohttp

from lease.http import (
    ACK_LIMIT,
    Outgoing,
    ack_verdict,
    check_timeout,
    check_token,
    check_url,
    request_parts,
)
from lease.worker import BadAck, Retryable

__all__ = ["send_http", "new_session"]


def new_session(limit: int = 100) -> aiohttp.ClientSession:
    """A session for long-running use: no proxy settings read, ``limit`` connections."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit), trust_env=False, auto_decompress=False
    )


async def send_http(
    url: str,
    event: dict,
    *,
    timeout: float,
    token: Optional[int] = None,
    session: Optional[aiohttp.ClientSession] = None,
) -> bool:
    """POST one event, lab or payload; True only for a verifiable ACK (the
    table in ``lease.http``, which also says when an error has ``http_status``).

    ``timeout`` (seconds) bounds the whole exchange, from connecting to the
    last byte read. Redirects are never followed; proxy settings are never
    read (a caller's session must not set ``trust_env``). One request, no
    retries. Without ``session``, a short-lived one is opened and closed.
    """
    check_url(url)
    seconds = check_timeout(timeout)
    outgoing = request_parts(event, check_token(token))
    if session is None:
        async with new_session(limit=1) as own:
            return await _exchange(own, url, outgoing, seconds)
    if session.trust_env:
        raise ValueError("session must not read proxy settings (trust_env=True)")
    return await _exchange(session, url, outgoing, seconds)


async def _exchange(session: aiohttp.ClientSession, url: str, outgoing: Outgoing,
                    seconds: float) -> bool:
    try:
        # aiohttp's total timeout runs from the wait for a pooled connection to
        # the last byte read: the whole exchange, with no extra task per send.
        status, answer = await _post(session, url, outgoing, seconds)
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise Retryable(f"timed out after {seconds}s") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise Retryable(f"connection failed: {exc!r:.200}") from exc
    except aiohttp.ClientResponseError as exc:  # a malformed HTTP answer
        raise BadAck(f"malformed answer: {exc!r:.200}") from exc
    return ack_verdict(status, answer, outgoing.event_id)


async def _post(session: aiohttp.ClientSession, url: str, outgoing: Outgoing,
                seconds: float) -> tuple[int, bytes]:
    async with session.post(
        url, data=outgoing.body, headers=outgoing.headers, allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=seconds),
    ) as response:
        answer = bytearray()
        while len(answer) <= ACK_LIMIT:  # read one byte past the cap, never more
            chunk = await response.content.read(ACK_LIMIT + 1 - len(answer))
            if not chunk:
                break
            answer += chunk
        return response.status, bytes(answer)

