"""The strict async sender on aiohttp; the verdict comes from ``lease.http``."""

from __future__ import annotations

import asyncio
from typing import Optional

import aiohttp

from lease.http import (
    ACK_LIMIT,
    ack_verdict,
    check_timeout,
    check_token,
    check_url,
    request_parts,
)
from lease.worker import BadAck, Retryable, check_event

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
    """POST one event; True only for a verifiable ACK (the table in ``lease.http``).

    ``timeout`` (seconds) bounds the whole exchange, from connecting to the
    last byte read. Redirects are never followed; proxy settings are never
    read (a caller's session must not set ``trust_env``). One request, no
    retries. Without ``session``, a short-lived one is opened and closed.
    """
    check_url(url)
    check_event(event)
    seconds = check_timeout(timeout)
    body, headers = request_parts(event, check_token(token))
    if session is None:
        async with new_session(limit=1) as own:
            return await _exchange(own, url, body, headers, seconds, event["id"])
    if session.trust_env:
        raise ValueError("session must not read proxy settings (trust_env=True)")
    return await _exchange(session, url, body, headers, seconds, event["id"])


async def _exchange(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict,
                    seconds: float, event_id: str) -> bool:
    try:
        # aiohttp's total timeout runs from the wait for a pooled connection to
        # the last byte read: the whole exchange, with no extra task per send.
        status, answer = await _post(session, url, body, headers, seconds)
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise Retryable(f"timed out after {seconds}s") from exc
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise Retryable(f"connection failed: {exc!r:.200}") from exc
    except aiohttp.ClientResponseError as exc:  # a malformed HTTP answer
        raise BadAck(f"malformed answer: {exc!r:.200}") from exc
    return ack_verdict(status, answer, event_id)


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict,
                seconds: float) -> tuple[int, bytes]:
    async with session.post(
        url, data=body, headers=headers, allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=seconds),
    ) as response:
        answer = bytearray()
        while len(answer) <= ACK_LIMIT:  # read one byte past the cap, never more
            chunk = await response.content.read(ACK_LIMIT + 1 - len(answer))
            if not chunk:
                break
            answer += chunk
        return response.status, bytes(answer)

