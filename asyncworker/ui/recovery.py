"""An endpoint's recovery from the page: the pure parts and the store's calls.

After an outage the receiver may have lost what it acknowledged, or the
deliveries went dead while it was down. The operator names a time ("since"),
a time to live and a note; the dry run lists the endpoint's deliveries
finished (done or dead) since then, with a fingerprint of that set; the
confirmation carries the fingerprint back and sends again exactly the ids
the dry run showed (``Store.recover_endpoint(..., ids=...)``), or is refused
(409, nothing sent) when the set is another one by then. The receiver's
inbox absorbs a delivery it already applied (the same id).

The dry run and the confirmation are the command line's own
(``asyncworker.operations.recover_preview`` and ``recover_confirmed``), so a
dry run's fingerprint means the same set on either; this module only reads
the page's form and maps their refusals to the page's answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from asyncworker.operations import (
    FINGERPRINT_RE,
    EndpointNotFound,
    EndpointRefused,
    RecoveryChanged,
    UsageError,
    recover_confirmed,
    recover_preview,
)
from asyncworker.ui.bulk import BadRequest, parse_note, parse_ttl
from lease.endpoints import check_endpoint_name
from lease.policy import DEFAULT_POLICY
from lease.store import Store
from lease.worker import MAX_NOW_MS

__all__ = ["NoSuchEndpoint", "Recovery", "confirm", "parse_recovery", "parse_since", "preview"]

# A moment as a date-time input sends it (UTC, as every time the page shows):
# 2024-05-01T12:30, with seconds and milliseconds optional, a trailing Z allowed.
SINCE_RE = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d)(?::(\d\d)(?:\.(\d{1,3})\d*)?)?Z?")


class NoSuchEndpoint(LookupError):
    """The endpoint named is not (or no longer) in the queue: 404."""


@dataclass(frozen=True)
class Recovery:
    endpoint: str
    since_ms: int
    note: str
    ttl_ms: int = DEFAULT_POLICY.ttl_ms


def parse_since(text: str) -> int:
    """A date-time (UTC) as milliseconds; BadRequest if it is none."""
    found = SINCE_RE.fullmatch(text.strip())
    if found is None:
        raise BadRequest("since must be a date and time (UTC), as 2024-05-01T12:30")
    year, month, day, hour, minute, second, millis = found.groups()
    try:
        moment = datetime(int(year), int(month), int(day), int(hour), int(minute),
                          int(second or 0), tzinfo=UTC)
    except ValueError:
        raise BadRequest(f"since: no such date and time: {text.strip()!r:.40}") from None
    ms = int(moment.timestamp()) * 1000 + int((millis or "0").ljust(3, "0"))
    if not 0 <= ms <= MAX_NOW_MS:
        raise BadRequest("since must be a date and time after 1970")
    return ms


def parse_recovery(form: Mapping[str, str]) -> Recovery:
    """A recovery's form, checked whole: the endpoint, ``since_ms`` (as the
    dry run's page carries it) or ``since`` (a date-time, UTC), a note
    (required: each delivery sent again gets an audit row), ``ttl_ms``."""
    name = form.get("endpoint", "")
    try:
        check_endpoint_name(name)
    except ValueError:
        raise BadRequest("endpoint must be an endpoint's name: 1-64 ASCII letters, digits, "
                         "'_' or '-'") from None
    since_text = form.get("since_ms") or ""
    if since_text:
        if not (since_text.isascii() and since_text.isdigit() and len(since_text) <= 15
                and int(since_text) <= MAX_NOW_MS):
            raise BadRequest("since_ms must be a moment in milliseconds")
        since_ms = int(since_text)
    elif form.get("since"):
        since_ms = parse_since(form["since"])
    else:
        raise BadRequest("since is required: the deliveries finished since then are sent again")
    note = parse_note(form, "each delivery sent again gets an audit row")
    return Recovery(name, since_ms, note, parse_ttl(form))


def preview(store: Store, recovery: Recovery) -> dict[str, Any]:
    """The dry run, nothing changed (``operations.recover_preview``), with the
    form's time to live and note for the confirmation to carry."""
    if getattr(store, "recover_endpoint", None) is None:
        raise NoSuchEndpoint(recovery.endpoint)  # a store that keeps no endpoints
    try:
        dry = recover_preview(store, recovery.endpoint, recovery.since_ms)
    except EndpointNotFound:
        raise NoSuchEndpoint(recovery.endpoint) from None
    except UsageError as exc:
        raise BadRequest(str(exc)) from None
    return {**dry, "ttl_ms": recovery.ttl_ms, "note": recovery.note}


def confirm(store: Store, recovery: Recovery, fingerprint: str, actor: str | None
            ) -> tuple[dict[str, Any], bool]:
    """The confirmation (``operations.recover_confirmed``): only when the set
    recoverable now has ``fingerprint`` are exactly its ids sent again. The
    result (the preview with ``recovered`` and ``missed``: those that left the
    set between the check and the change) and True; or the preview of now and
    False (nothing sent): a fingerprint that is no dry run's is a set changed."""
    if getattr(store, "recover_endpoint", None) is None:
        raise NoSuchEndpoint(recovery.endpoint)
    given = fingerprint.strip().lower()
    if not FINGERPRINT_RE.fullmatch(given):
        return preview(store, recovery), False
    try:
        done = recover_confirmed(store, recovery.endpoint, recovery.since_ms, recovery.ttl_ms,
                                 recovery.note, given, actor=actor)
    except RecoveryChanged as changed:
        return {**changed.now, "ttl_ms": recovery.ttl_ms, "note": recovery.note}, False
    except (EndpointNotFound, EndpointRefused) as exc:
        raise NoSuchEndpoint(f"{recovery.endpoint}: {exc}") from None
    except UsageError as exc:
        raise BadRequest(str(exc)) from None
    return {**done, "ttl_ms": recovery.ttl_ms, "note": recovery.note}, True
