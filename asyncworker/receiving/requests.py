"""What both receivers (``server`` and ``idempotent``) do to a request before
it is theirs: read the body whole, within its cap and its read time; check its
signature when secrets are given; and answer every refusal the same way, a
JSON ``{"error": ...}``.

| the request                                  | the answer                          |
| -------------------------------------------- | ----------------------------------- |
| a body over ``MAX_BODY_BYTES`` (64 KiB)        | 413, connection closed              |
| a body cut off, or a malformed chunk         | 400, connection closed              |
| a body not received within the read time     | 408, connection closed              |
| with secrets: a bad or no signature (kind)   | 401 ``signature <kind>: ...``         |
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from lease.policy import MAX_BODY_BYTES
from lease.signing import TOLERANCE_S, SignatureError, check_secrets, verify

__all__ = [
    "MAX_TOLERANCE_S",
    "Count",
    "Signatures",
    "check_signature",
    "check_tolerance",
    "error",
    "read_body",
    "signature_refused",
]

MAX_TOLERANCE_S = 86_400  # a day: wider, and a captured request replays for too long

# Told the name of each refusal as it happens ("too_large", "incomplete",
# "timed_out", "refused_signature_<kind>"): the server counts them.
Count = Callable[[str], None]


def _uncounted(name: str) -> None:
    pass


def error(status: int, message: str) -> web.Response:
    """Every refusal's answer: ``{"error": message}`` with its status."""
    return web.json_response({"error": message}, status=status)


def _closing(status: int, message: str) -> web.Response:
    answer = error(status, message)
    answer.force_close()  # what is left of the body is not waited for
    return answer


async def read_body(request: web.Request, timeout: float,
                    count: Count = _uncounted) -> bytes | web.Response:
    """The whole body, or the answer for one too large (413), cut off (400) or
    too slow (408). The cap is read here, not from the app: a sub-application's
    own client_max_size is not the one aiohttp applies."""
    too_large = f"body is larger than {MAX_BODY_BYTES} bytes"
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        count("too_large")
        return _closing(413, too_large)
    try:
        data = await asyncio.wait_for(_read_capped(request.content), timeout)
    except (ConnectionError, HttpProcessingError) as exc:  # gone, or a malformed chunk
        count("incomplete")
        return _closing(400, f"request body is incomplete: {exc}")
    except TimeoutError:
        count("timed_out")
        answer = _closing(408, f"request body not received within {timeout:g} s")
        await answer.prepare(request)
        await answer.write_eof()
        if request.transport is not None:
            request.transport.close()  # a client this slow is not waited for any longer
        return answer
    if len(data) > MAX_BODY_BYTES:
        count("too_large")
        return _closing(413, too_large)
    return data


async def _read_capped(content: StreamReader) -> bytes:
    """The body, or its first MAX_BODY_BYTES + 1 bytes if it is longer."""
    data = b""
    while len(data) <= MAX_BODY_BYTES and not content.at_eof():
        data += await content.read(MAX_BODY_BYTES + 1 - len(data))
    return data


@dataclass(frozen=True)
class Signatures:
    """Who may post: the secrets a request's signature must verify with (any of
    them: two during a rotation), how far its timestamp may be from ``clock()``."""

    secrets: tuple[bytes, ...]
    tolerance_s: int = TOLERANCE_S
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if not isinstance(self.secrets, tuple):
            raise ValueError("secrets must be a tuple of key bytes "
                             "(lease.signing.read_secrets makes one)")
        check_secrets(self.secrets)
        check_tolerance(self.tolerance_s)
        if not callable(self.clock):
            raise ValueError(f"clock must be callable, got {type(self.clock).__name__}")

    @classmethod
    def of(cls, secrets: Sequence[bytes] | None, tolerance_s: int = TOLERANCE_S,
           clock: Callable[[], float] = time.time) -> Signatures | None:
        """The check for these secrets; None (nothing checked) when secrets is None."""
        check_tolerance(tolerance_s)
        if secrets is None:
            return None
        keys = tuple(secrets) if isinstance(secrets, (list, tuple)) else secrets
        return cls(keys, tolerance_s, clock)  # type: ignore[arg-type]  # checked there

    def check(self, headers: Mapping[str, str], body: bytes) -> str:
        """The signed ``webhook-id``, else SignatureError naming the kind."""
        return verify(self.secrets, headers, body, int(self.clock()), self.tolerance_s)


def check_tolerance(tolerance_s: object) -> int:
    if type(tolerance_s) is not int or not 1 <= tolerance_s <= MAX_TOLERANCE_S:
        raise ValueError(f"tolerance_s must be an int in 1..{MAX_TOLERANCE_S} seconds, "
                         f"got {tolerance_s!r}")
    return tolerance_s


def signature_refused(exc: SignatureError) -> web.Response:
    """The 401 for a request whose signature does not verify."""
    return error(401, f"signature {exc.kind}: {exc}")


def check_signature(signatures: Signatures | None, request: web.Request, body: bytes,
                    count: Count = _uncounted) -> web.Response | None:
    """None when no secret is configured or the signature verifies, else the
    401. Before the body is parsed: an unsigned request reaches nothing. The id
    it signs is the ``webhook-id`` the receiver then takes as the event's."""
    if signatures is None:
        return None
    try:
        signatures.check(request.headers, body)
    except SignatureError as exc:
        count(f"refused_signature_{exc.kind}")
        return signature_refused(exc)
    return None
