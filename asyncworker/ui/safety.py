"""The page's safety: who may look, who may change, and what every answer carries.

Safe by default. Without a token the page binds loopback only (anyone who can
reach a loopback port is already on this host); with one, every request shows
it, as ``Authorization: Bearer TOKEN`` or as the session cookie the login form
sets. Every request names a host this page answers to (``Hosts``: the bound
address's names, and those the operator allows), else it is refused before
anything is read: a page of another site whose name was made to resolve to
this address (DNS rebinding) names its own host, never one of these. A change
is a POST that carries a CSRF token (an HMAC of the session under a key this
process draws at start) and comes from the page itself: a browser's
``Sec-Fetch-Site`` that names another site, or an ``Origin`` that is not one
of the page's own (by ``Hosts``, never by the request's own ``Host``), is
refused before anything else is looked at. Secrets are compared in constant
time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from lease.policy import check_actor

__all__ = ["Access", "Guard", "Hosts", "LOOPBACK_NAMES", "SECURITY_HEADERS", "SESSION_COOKIE",
           "MIN_TOKEN_CHARS", "check_token", "cross_site", "parse_token_line"]

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
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # what a browser on this host calls it
# a Host header's authority: a DNS name or IPv4 address, or an IPv6 literal in brackets
_AUTHORITY = re.compile(r"(?P<name>[a-z0-9](?:[a-z0-9.-]{0,252})|\[[0-9a-f:.]{2,45}\])"
                        r"(?::(?P<port>[0-9]{1,5}))?")


@dataclass(frozen=True)
class Access:
    """The access token, and the operator's name for the audit rows (its label)."""

    token: str = field(repr=False)
    label: str | None = None


def parse_token_line(text: str) -> Access:
    """A token file's first line: ``TOKEN`` or ``LABEL:TOKEN``. ValueError says
    what is wrong and never quotes the secret."""
    line = text.split("\n", 1)[0].rstrip("\r")
    label: str | None = None
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


def _authority(text: str) -> tuple[str, int | None] | None:
    """``name[:port]`` lowercased, as (name, port or None); None when malformed."""
    found = _AUTHORITY.fullmatch(text.strip().lower())
    if found is None:
        return None
    port = found.group("port")
    if port is not None and not 1 <= int(port) <= 65535:
        return None
    return found.group("name"), None if port is None else int(port)


class Hosts:
    """The names this page answers to: each ``NAME`` (at any port) or
    ``NAME:PORT``, an IPv6 address in brackets (``[::1]:8080``). A request's
    ``Host`` must be one of them, and so must a posting page's ``Origin``."""

    def __init__(self, names: Iterable[str]) -> None:
        rules = []
        for name in names:
            rule = _authority(name) if isinstance(name, str) else None
            if rule is None:
                raise ValueError(f"not a host name, an IP address or NAME:PORT: {name!r:.80}")
            rules.append(rule)
        if not rules:
            raise ValueError("no host to answer to")
        self.rules: tuple[tuple[str, int | None], ...] = tuple(dict.fromkeys(rules))

    def __repr__(self) -> str:
        return f"Hosts({list(self.shown())!r})"

    def shown(self) -> Iterator[str]:
        return (name if port is None else f"{name}:{port}" for name, port in self.rules)

    def admits(self, host: str | None, default_port: int) -> bool:
        """A ``Host`` header (or an origin's host) this page answers to."""
        found = None if host is None else _authority(host)
        if found is None:
            return False
        name, port = found
        port = default_port if port is None else port
        return any(name == rule and (want is None or want == port) for rule, want in self.rules)

    def admits_origin(self, origin: str) -> bool:
        """``Origin: scheme://host[:port]`` of a page this process serves."""
        scheme, sep, host = origin.partition("://")
        if not sep or scheme not in ("http", "https"):
            return False
        return self.admits(host, 443 if scheme == "https" else 80)


def cross_site(headers: Mapping[str, str], hosts: Hosts) -> bool:
    """A browser's request sent by another site's page (a form that posts here).

    ``Sec-Fetch-Site`` that names another site decides (no page can set it).
    An ``Origin`` must be one of ``hosts``' (never compared with the request's
    own ``Host``, which a rebound name makes the attacker's); ``Origin: null``
    passes only beside ``Sec-Fetch-Site``: under ``Referrer-Policy: no-referrer``
    Chromium posts this page's own forms so. A client that is not a browser
    sends neither: the CSRF and access tokens stop it instead."""
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return True
    origin = headers.get("Origin")
    if origin is None:
        return False
    if origin == "null":
        return fetch_site is None
    return not hosts.admits_origin(origin)


class Guard:
    """Checks one request's access, session and CSRF token against this
    process's key: a restart ends every session and every form's token."""

    def __init__(self, access: Access | None, key: bytes | None = None) -> None:
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

    def admits(self, authorization: str | None, cookie: str | None) -> bool:
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
