"""Signed requests, the Standard Webhooks way (https://www.standardwebhooks.com).

Every signed request carries three headers:

- ``webhook-id``: the job id (the same on every attempt of a job, so a
  receiver can deduplicate by it);
- ``webhook-timestamp``: the signing time, integer seconds since the epoch;
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``,
  one per active secret, space-separated (a receiver accepts the request if
  any of them verifies: that is how a secret is rotated without a gap).

A secret is ``whsec_`` followed by the base64 of the key bytes. A secrets
file holds one secret a line (blank lines and lines starting with ``#``
skipped); its first secret signs first.

What a signature protects: that the body, the id and the timestamp come from
a holder of the secret, unchanged, recently (the tolerance window, 5 minutes
by default, bounds how long a captured request can be replayed; a replay
within it is a duplicate the inbox absorbs by id). What it does not: it does
not hide the body (use TLS), does not stop a holder of the secret, and does
not order or count requests.

Standard library only; both the senders and the receiver call these
functions, nothing else in the project signs or verifies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "ID_HEADER",
    "TIMESTAMP_HEADER",
    "SIGNATURE_HEADER",
    "TOLERANCE_S",
    "SignatureError",
    "check_secrets",
    "parse_secret",
    "read_secrets",
    "sign",
    "signature_headers",
    "verify",
]

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
TOLERANCE_S = 300
SECRET_PREFIX = "whsec_"
MIN_KEY_BYTES = 16  # shorter keys are guessable; the spec's examples use 24 to 64
MAX_KEY_BYTES = 1024
MAX_SIGNATURES = 16  # a header with more is malformed, not a search space

Secret = bytes  # the key bytes of one whsec_ secret


class SignatureError(ValueError):
    """A request whose signature does not verify. ``kind`` says how:
    missing, malformed, mismatch, stale or future."""

    KINDS = ("missing", "malformed", "mismatch", "stale", "future")

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS
        super().__init__(message)
        self.kind = kind


def parse_secret(text: object) -> Secret:
    """The key bytes of a ``whsec_...`` secret; ValueError naming the problem
    (never echoing the secret itself)."""
    if type(text) is not str or not text.startswith(SECRET_PREFIX):
        raise ValueError(f"a secret must be a str starting with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a secret must be whsec_ followed by base64") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a secret's key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, "
                         f"got {len(key)}")
    return key


def read_secrets(path: str | os.PathLike[str]) -> tuple[Secret, ...]:
    """The secrets of a secrets file, in order; ValueError (with the line
    number, never the secret) for a bad line or a file with none."""
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    secrets = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            secrets.append(parse_secret(text))
        except ValueError as exc:
            raise ValueError(f"{os.fsdecode(path)} line {number}: {exc}") from None
    if not secrets:
        raise ValueError(f"{os.fsdecode(path)} holds no secret")
    return tuple(secrets)


def check_secrets(secrets: object) -> tuple[Secret, ...]:
    """Secrets as signing and verifying take them: a non-empty list or tuple
    of key bytes (``parse_secret`` and ``read_secrets`` make them)."""
    if not isinstance(secrets, (list, tuple)) or not secrets:
        raise ValueError("secrets must be a non-empty list of key bytes")
    for key in secrets:
        if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise ValueError("each secret must be key bytes (parse_secret makes them)")
    return tuple(secrets)


def sign(secret: Secret, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature of ``id.timestamp.body``."""
    content = b"%s.%d.%s" % (msg_id.encode(), timestamp, body)
    digest = hmac.new(secret, content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_headers(secrets: Sequence[Secret], msg_id: str, timestamp: int,
                      body: bytes) -> dict[str, str]:
    """The three headers of a signed request, one signature per secret."""
    check_secrets(secrets)
    if type(timestamp) is not int or timestamp < 0:
        raise ValueError(f"timestamp must be an int >= 0, got {timestamp!r}")
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: " ".join(sign(key, msg_id, timestamp, body) for key in secrets),
    }


def verify(secrets: Sequence[Secret], headers: Mapping[str, str], body: bytes, now_s: int,
           tolerance_s: int = TOLERANCE_S) -> str:
    """Check a request's signature; its ``webhook-id`` when it verifies, else
    SignatureError. ``headers`` is case-insensitive in aiohttp and
    http.client; a plain dict must use the lower-case names.

    The timestamp is checked before the signatures: a stale or future
    request is refused without computing an HMAC for it.
    """
    check_secrets(secrets)
    msg_id = _one(headers, ID_HEADER)
    stamp = _one(headers, TIMESTAMP_HEADER)
    signatures = _one(headers, SIGNATURE_HEADER)
    if not stamp.isascii() or not stamp.isdigit() or len(stamp) > 12:
        raise SignatureError("malformed", f"{TIMESTAMP_HEADER} must be integer seconds")
    timestamp = int(stamp)
    if timestamp < now_s - tolerance_s:
        raise SignatureError("stale", f"{TIMESTAMP_HEADER} is {now_s - timestamp} s old, more "
                                      f"than the {tolerance_s} s tolerated")
    if timestamp > now_s + tolerance_s:
        raise SignatureError("future", f"{TIMESTAMP_HEADER} is {timestamp - now_s} s ahead, "
                                       f"more than the {tolerance_s} s tolerated")
    offered = _offered(signatures)
    for key in secrets:
        expected = sign(key, msg_id, timestamp, body)[3:].encode()
        if any(hmac.compare_digest(expected, candidate) for candidate in offered):
            return msg_id
    raise SignatureError("mismatch", "no signature verifies with the configured secrets")


def _one(headers: Mapping[str, str], name: str) -> str:
    getall = getattr(headers, "getall", None)
    values: Iterable[str] = getall(name, []) if getall is not None else (
        [headers[name]] if name in headers else [])
    found = list(values)
    if not found:
        raise SignatureError("missing", f"no {name} header")
    if len(found) > 1:
        raise SignatureError("malformed", f"more than one {name} header")
    return found[0]


def _offered(header: str) -> list[bytes]:
    """The v1 signatures of a webhook-signature header (other versions ignored)."""
    parts = header.split(" ")
    if len(parts) > MAX_SIGNATURES:
        raise SignatureError("malformed", f"more than {MAX_SIGNATURES} signatures")
    offered = []
    for part in parts:
        version, _, value = part.partition(",")
        if not value:
            raise SignatureError("malformed", "a signature must be version,base64")
        if version == "v1":
            offered.append(value.encode())
    if not offered:
        raise SignatureError("malformed", "no v1 signature")
    return offered


def new_secret(nbytes: int = 32, *, random: bytes | None = None) -> str:
    """A fresh ``whsec_`` secret (``random`` for tests that need a fixed one)."""
    key = os.urandom(nbytes) if random is None else random
    return SECRET_PREFIX + base64.b64encode(key).decode()
