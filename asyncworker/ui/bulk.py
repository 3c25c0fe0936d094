"""Bulk redrive and cancel of everything a filter matches: the pure parts.

The operator names a filter (a reason, an id prefix, an ordering key, an
endpoint) and a note; the dry run lists the dead letters it matches and a fingerprint of the
filter and that set; the confirmation carries the filter and the fingerprint
back and is refused when the set it matches now is another one (a job
redriven, retried, gone dead since), or the filter is. What is confirmed is
exactly what the dry run showed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from asyncworker.operations import DEAD_REASONS
from lease.endpoints import check_endpoint_name
from lease.policy import DEFAULT_POLICY, PRODUCT, check_note, check_ordering_key
from lease.rules import check_error_filter, status_range
from lease.worker import check_job_id

__all__ = ["ACTIONS", "BadRequest", "BulkRequest", "Filter", "Member", "MAX_BULK", "SAMPLE",
           "fingerprint", "outcome", "parse_bulk", "parse_filter"]

ACTIONS = ("redrive", "cancel")
MAX_BULK = 100_000  # the most jobs one confirmation changes: narrow the filter beyond it
SAMPLE = 20  # ids a dry run shows
MAX_PREFIX_CHARS = 255


class Member(NamedTuple):
    """A matched dead letter as the fingerprint sees it: a redrive, a new
    attempt or another reason changes one of these."""

    id: str
    token: int
    reason: str | None


@dataclass(frozen=True)
class BulkRequest:
    action: str
    reason: str | None
    id_prefix: str | None
    note: str
    ttl_ms: int = DEFAULT_POLICY.ttl_ms
    key: str | None = None  # one ordering key's dead letters only
    endpoint: str | None = None  # one endpoint's dead deliveries only
    # The last attempt's error (a substring) and HTTP status ("503", "5xx"),
    # and when they went dead (from <= it < to): as typed, and in ms.
    error: str | None = None
    http_status: str | None = None
    from_text: str | None = None
    to_text: str | None = None
    from_ms: int | None = None
    to_ms: int | None = None

    def store_filters(self) -> dict[str, Any]:
        """The filter as Store.list_jobs takes it."""
        return {"reason": self.reason, "id_prefix": self.id_prefix, "key": self.key,
                "endpoint": self.endpoint, "error": self.error,
                "http_status": self.http_status, "from_ms": self.from_ms, "to_ms": self.to_ms}

    @property
    def past(self) -> str:
        return "redriven" if self.action == "redrive" else "cancelled"


class BadRequest(ValueError):
    """A form or query the page cannot act on: 400, with this one line."""


class Filter(NamedTuple):
    """Which jobs a page lists and a bulk change matches: None is any."""

    reason: str | None
    id_prefix: str | None
    key: str | None
    endpoint: str | None = None  # one endpoint's deliveries (ids ending "@NAME")
    # A substring of the last attempt's error, its HTTP status ("404" or
    # "4xx"), and a time range of available_at (as given, UTC
    # "YYYY-MM-DDTHH:MM[:SS]", and in ms): a dead job's is when it went dead.
    error: str | None = None
    http_status: str | None = None
    from_text: str | None = None
    to_text: str | None = None
    from_ms: int | None = None
    to_ms: int | None = None

    def query(self) -> dict[str, str | None]:
        """The filter as the URL keeps it (the pages' links carry it on)."""
        return {"reason": self.reason, "id_prefix": self.id_prefix, "key": self.key,
                "endpoint": self.endpoint, "error": self.error, "http_status": self.http_status,
                "from": self.from_text, "to": self.to_text}


def parse_filter(query: Mapping[str, str]) -> Filter:
    """The jobs' filter: reason, id prefix, ordering key and endpoint, each None
    if not given."""
    reason = query.get("reason") or None
    if reason is not None and reason not in DEAD_REASONS:
        raise BadRequest(f"reason must be one of {', '.join(DEAD_REASONS)}, got {reason!r:.40}")
    prefix = query.get("id_prefix") or None
    if prefix is not None and (len(prefix) > MAX_PREFIX_CHARS
                               or re.search(r"[\x00-\x20\x7f-\U0010ffff]", prefix)):
        raise BadRequest(f"id prefix must be 1-{MAX_PREFIX_CHARS} visible ASCII characters")
    key = query.get("key") or None
    if key is not None:
        try:
            check_ordering_key(key, "key")
        except ValueError:
            raise BadRequest(f"key must be an ordering key: {PRODUCT.job_id_rule}") from None
    endpoint = query.get("endpoint") or None
    if endpoint is not None:
        try:
            check_endpoint_name(endpoint)
        except ValueError:
            raise BadRequest("endpoint must be an endpoint's name: 1-64 ASCII letters, "
                             "digits, '_' or '-'") from None
    error = query.get("error") or None
    if error is not None:
        try:
            check_error_filter(error)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    status = query.get("http_status") or None
    if status is not None:
        try:
            status_range(status)
        except ValueError:
            raise BadRequest(f"HTTP status must be a status (404) or a class (4xx), "
                             f"got {status!r:.20}") from None
    from_text, to_text = query.get("from") or None, query.get("to") or None
    from_ms, to_ms = _moment(from_text, "from"), _moment(to_text, "to")
    if from_ms is not None and to_ms is not None and to_ms <= from_ms:
        raise BadRequest("the time range's end (to) must be after its start (from)")
    return Filter(reason, prefix, key, endpoint, error, status, from_text, to_text,
                  from_ms, to_ms)


def _moment(text: str | None, name: str) -> int | None:
    """A time range's end, UTC "YYYY-MM-DDTHH:MM[:SS]" (a datetime-local
    input's value), in ms; BadRequest names the field."""
    if text is None:
        return None
    for layout in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"):
        try:
            moment = datetime.strptime(text, layout).replace(tzinfo=UTC)
        except ValueError:
            continue
        return int(moment.timestamp() * 1000)
    raise BadRequest(f"{name} must be a UTC time YYYY-MM-DDTHH:MM[:SS], got {text!r:.30}")


def parse_bulk(form: Mapping[str, str]) -> BulkRequest:
    """A bulk form, checked whole: BadRequest names the first thing wrong."""
    action = form.get("action", "")
    if action not in ACTIONS:
        raise BadRequest(f"action must be one of {', '.join(ACTIONS)}, got {action!r:.40}")
    found = parse_filter(form)
    reason, prefix, key, endpoint = found.reason, found.id_prefix, found.key, found.endpoint
    if action == "cancel" and reason == "cancelled":
        raise BadRequest("reason cancelled: those jobs are cancelled already")
    return BulkRequest(action, reason, prefix, parse_note(form), parse_ttl(form), key,
                       endpoint, found.error, found.http_status, found.from_text,
                       found.to_text, found.from_ms, found.to_ms)


def parse_note(form: Mapping[str, str],
               why: str = "say why, for the audit rows") -> str:
    """A change's note: required (each job changed gets an audit row with it)."""
    note = form.get("note", "").strip()
    if not note:
        raise BadRequest(f"a note is required: {why}")
    try:
        check_note(note)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return note


def parse_ttl(form: Mapping[str, str]) -> int:
    """A redriven job's time to live (ms), the policy's default when not given."""
    ttl_text = form.get("ttl_ms") or str(DEFAULT_POLICY.ttl_ms)
    if not re.fullmatch(r"[0-9]{1,15}", ttl_text) or not (
            1 <= int(ttl_text) <= PRODUCT.max_ttl_ms):
        raise BadRequest(f"ttl_ms must be an integer in 1..{PRODUCT.max_ttl_ms}")
    return int(ttl_text)


@dataclass(frozen=True)
class JobChange:
    """One job redriven or cancelled from its own page."""

    action: str
    job_id: str
    note: str
    ttl_ms: int = DEFAULT_POLICY.ttl_ms


# What a job's status lets its page do: a dead job is redriven or cancelled, a
# pending one cancelled (it will not be sent); a leased one is being sent (its
# dispatcher's finish decides), a done one is history.
JOB_ACTIONS = {"dead": ("redrive", "cancel"), "pending": ("cancel",)}


def job_actions(status: str) -> tuple[str, ...]:
    return JOB_ACTIONS.get(status, ())


def parse_job_change(action: str, form: Mapping[str, str]) -> JobChange:
    """A job page's change form, checked whole: BadRequest names the first thing wrong."""
    if action not in ACTIONS:
        raise BadRequest(f"action must be one of {', '.join(ACTIONS)}, got {action!r:.40}")
    job_id = form.get("id", "")
    try:
        check_job_id("id", job_id, PRODUCT)
    except ValueError:
        raise BadRequest(f"id must be {PRODUCT.job_id_rule}") from None
    return JobChange(action, job_id, parse_note(form), parse_ttl(form))


def fingerprint(request: BulkRequest, members: Sequence[Member]) -> str:
    """sha256 of the action, the filter and the sorted (id, token, reason) of
    every job matched: equal only for the same filter matching the same set in
    the same state. (No field of the filter holds a NUL or a newline.) The
    endpoint, error, HTTP status and time range are part of it only when
    named, so a fingerprint of a filter without them is what it always was."""
    digest = hashlib.sha256()
    narrower = "".join(f"\0{name}={value}" for name, value in (
        ("endpoint", request.endpoint), ("error", request.error),
        ("http_status", request.http_status),
        ("from", request.from_ms),
        ("to", request.to_ms)) if value is not None)
    digest.update(f"{request.action}\0{request.reason or ''}\0{request.id_prefix or ''}"
                  f"\0{request.key or ''}{narrower}\n".encode())
    for member in sorted(members):
        digest.update(f"{member.id}\0{member.token}\0{member.reason or ''}\n".encode())
    return digest.hexdigest()


def outcome(action: str, answer: object) -> tuple[str, str]:
    """A job's line on the result page: (what happened, the store's words).
    A redrive refused because the job is not dead any more says so: someone
    (a dispatcher, another operator) moved it between the check and the change."""
    if answer is True:
        return ("redriven" if action == "redrive" else "cancelled"), ""
    text = str(answer)
    if action == "redrive" and text.endswith(", not dead"):
        return "no longer dead", text
    if text.endswith("does not exist"):
        return "no longer exists", text
    return ("not redriven" if action == "redrive" else "not cancelled"), text
