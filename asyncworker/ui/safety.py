"""The page's safety: who may look, who may change, and what every answer carries.

Safe by default. Without a token the page binds loopback only (anyone who can
reach a loopback port is already on this host); with one, every request shows
it, as ``Authorization: Bearer TOKEN`` or as the session cookie the login form
sets. A change is a POST that carries a CSRF token (an HMAC of the session
under a key this process draws at start) and comes from the page itself: a
browser's ``Sec-Fetch-Site`` or ``Origin`` that names another site is refused
before anything else is looked at. Secrets are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass, field
from typing import Mapping, Optional

from lease.policy import check_actor

__all__ = ["Access", "Guard", "SECURITY_HEADERS", "SESSION_COOKIE", "MIN_TOKEN_CHARS",
           "check_token", "cross_site", "is_loopback", "parse_token_line"]

# No inline script or style anywhere: only the page's own stylesheet and images.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
SESSION_COOKIE = "asyncworker_ui"
MIN_TOKEN_CHARS = 16  # a token short enough to guess protects nothing
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no space to lose when pasted


@dataclass(frozen=True)
class Access:
    """The access token, and the operator's name for the audit rows (its label)."""

    token: str = field(repr=False)
    label: Optional[str] = None


def parse_token_line(text: str) -> Access:
    """A token file's first line: ``TOKEN`` or ``LABEL:TOKEN``. ValueError says
    what is wrong and never quotes the secret."""
    line = text.split("\n", 1)[0].rstrip("\r")
    label: Optional[str] = None
    if ":" in line:
        label, line = line.split(":", 1)
        try:
            check_actor(label)
        except ValueError:
            raise ValueError("the label before ':' must be 1-100 characters without "
                             "control characters") from None
    return Access(check_token(line), label)


def check_token(token: object) -> str:
    """An access token: at least MIN_TOKEN_CHARS visible ASCII characters."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("no token: it must be visible ASCII characters, no spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token is shorter than {MIN_TOKEN_CHARS} characters")
    return token


def is_loopback(host: str) -> bool:
    """Only this host can reach it: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def cross_site(headers: Mapping[str, str], own_origin: str) -> bool:
    """A browser's request sent by another site's page (a form that posts here).

    ``Sec-Fetch-Site`` decides when the browser sends it (no page can set it).
    Only without it is ``Origin`` read: under ``Referrer-Policy: no-referrer``
    Chromium posts this page's own forms with ``Origin: null``. A client that
    is not a browser sends neither: the CSRF and access tokens stop it instead."""
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site not in ("same-origin", "none")
    origin = headers.get("Origin")
    return origin is not None and origin != own_origin


class Guard:
    """Checks one request's access, session and CSRF token against this
    process's key: a restart ends every session and every form's token."""

    def __init__(self, access: Optional[Access], key: Optional[bytes] = None) -> None:
        self.access = access
        self._key = key if key is not None else secrets.token_bytes(32)

    @property
    def required(self) -> bool:
        return self.access is not None

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self._key, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()

    def session(self) -> str:
        """The login cookie's value: proof of the token, not the token itself."""
        return self._mac("session", self.access.token if self.access else "")

    def token_matches(self, offered: str) -> bool:
        if self.access is None:
            return True
        return hmac.compare_digest(offered.encode(), self.access.token.encode())

    def admits(self, authorization: Optional[str], cookie: Optional[str]) -> bool:
        """The request shows the token (Bearer) or a session of it (the cookie)."""
        if self.access is None:
            return True
        if authorization is not None:
            scheme, _, offered = authorization.partition(" ")
            return scheme.lower() == "bearer" and self.token_matches(offered.strip())
        return cookie is not None and hmac.compare_digest(cookie.encode(),
                                                          self.session().encode())

    def csrf(self) -> str:
        """The token every change form carries, tied to the session."""
        return self._mac("csrf", self.session())

    def csrf_matches(self, offered: object) -> bool:
        return isinstance(offered, str) and hmac.compare_digest(offered.encode(),
                                                                self.csrf().encode())
