"""The records every store hands back and takes, and the one exception family.

The exceptions are defined by the contract (``lease.worker``, which must stand
alone) and re-exported here, so that a caller of any store finds the records
and the errors in one place.
"""

from __future__ import annotations

from typing import NamedTuple

from lease.worker import (
    BadAck,
    Busy,
    Conflict,
    LeaseError,
    NotAQueue,
    Permanent,
    Retryable,
    StoreError,
)

__all__ = [
    "Attempt",
    "BadAck",
    "Busy",
    "Claimed",
    "Conflict",
    "Conflicts",
    "FinishItem",
    "Finished",
    "LeaseError",
    "Leased",
    "MAX_ERROR_CHARS",
    "NotAQueue",
    "ON_CONFLICT",
    "Permanent",
    "Retryable",
    "StoreError",
    "check_on_conflict",
    "judge_intake",
]


MAX_ERROR_CHARS = 500  # an attempt's error text, as kept

# What an intake does when an event conflicts (the same id kept with other
# content): "raise" refuses the whole call with Conflicts, nothing of it
# written; "return" gives each Conflict in the results and writes the rest.
ON_CONFLICT = ("raise", "return")
_NAMED_CONFLICTS = 5  # in a Conflicts' message; all of them are in .conflicts


class Conflicts(Conflict):
    """An intake refused whole: some of its events conflict with the content
    kept for their id, and nothing of the call was written. ``results`` holds
    per event what the intake found (True new, False duplicate, or its
    Conflict); ``conflicts`` the (index, Conflict) of each conflicting one,
    in order. A Conflict itself, so ``except Conflict`` catches it."""

    def __init__(self, results: list) -> None:
        self.results = results
        self.conflicts = [(index, result) for index, result in enumerate(results)
                          if isinstance(result, Conflict)]
        named = "; ".join(f"event {index + 1}: {conflict}"
                          for index, conflict in self.conflicts[:_NAMED_CONFLICTS])
        more = len(self.conflicts) - _NAMED_CONFLICTS
        super().__init__(f"{len(self.conflicts)} of {len(results)} events conflict, nothing "
                         f"was enqueued: {named}{f'; and {more} more' if more > 0 else ''}")


def check_on_conflict(on_conflict: object) -> str:
    if on_conflict not in ON_CONFLICT:
        raise ValueError(f"on_conflict must be one of {ON_CONFLICT}, got {on_conflict!r:.40}")
    return on_conflict  # one of the strings above


def judge_intake(results: list, on_conflict: str) -> list:
    """The intake's results, or (``on_conflict="raise"`` and an event
    conflicts) Conflicts, raised inside the intake's transaction or savepoint
    so that nothing of it is written. Every store's intake ends here."""
    if on_conflict == "raise" and any(isinstance(result, Conflict) for result in results):
        raise Conflicts(results)
    return results


class Attempt(NamedTuple):
    """What one attempt saw, recorded with its finish. ``started_ms`` is the
    store's time of the claim; ``latency_ms`` the send's own duration."""

    started_ms: int
    latency_ms: int | None = None
    http_status: int | None = None
    error: str | None = None
    retry_after_ms: int | None = None  # the answer's Retry-After: its endpoint pauses

    @classmethod
    def of(cls, started_ms: int, latency_ms: int, error: BaseException | None,
           delivered_status: int | None = None) -> Attempt:
        """The evidence of a send that returned (error None: the HTTP status of
        its answer, ``delivered_status``, when it had one) or raised ``error``:
        the HTTP status the sender put on it, its class and message, capped,
        and the wait its answer asked for (``retry_after_ms``)."""
        if error is None:
            return cls(started_ms, latency_ms, delivered_status)
        return cls(started_ms, latency_ms, _http_status(error), _error_text(error),
                   _retry_after(error))


def _http_status(error: BaseException) -> int | None:
    """The HTTP status the sender put on its exception, if it is one."""
    try:
        status = getattr(error, "http_status", None)
    except Exception:  # a foreign exception's property: no status, not a lost finish
        return None
    return status if type(status) is int and 100 <= status <= 999 else None


def _retry_after(error: BaseException) -> int | None:
    """The wait the receiver asked for, as the sender put it on its exception."""
    try:
        wait = getattr(error, "retry_after_ms", None)
    except Exception:  # a foreign exception's property: no wait asked for
        return None
    return wait if type(wait) is int and wait >= 0 else None


def _error_text(error: BaseException) -> str:
    """The exception as evidence: its class and message, capped as it is kept."""
    name = type(error).__name__
    try:
        text = str(error)
    except Exception:  # a broken __str__ must not lose the finish: the class alone
        return name
    return f"{name}: {text}"[:MAX_ERROR_CHARS] if text else name


class Leased(NamedTuple):
    """A claimed job: its ticket (the contract's six keys), its body's
    canonical JSON text and that text's sha256 from the intake (both None
    for a {"id", "qty"} event). A delivery to an endpoint names the
    endpoint and its message's id (the ticket's id is the delivery's own,
    ``lease.endpoints.delivery_id``); a job of the queue's own has None for both.
    ``trace`` is the trace context its intake ran in, when it ran in one."""

    ticket: dict
    body: str | None
    digest: str | None = None
    endpoint: str | None = None
    message: str | None = None
    # the W3C trace context kept at its intake (lease.tracing), or None
    trace: str | None = None

    @property
    def event(self) -> dict:
        """The event as enqueued: {"id", "qty"} or {"id", "body"} (body as
        text), its id the message's: the same for every endpoint and retry."""
        event_id = self.ticket["id"] if self.message is None else self.message
        if self.body is None:
            return {"id": event_id, "qty": self.ticket["qty"]}
        return {"id": event_id, "body": self.body}


class Claimed(NamedTuple):
    """One claim transaction: the jobs leased, the quarantine's moves to dead
    by reason ({"deadline": n, "exhausted": m}), and the store's time it
    judged by (the leases end at ``ticket["lease_until"]`` on that clock)."""

    leased: list[Leased]
    moved: dict[str, int]
    now_ms: int


# (ticket, outcome or None for evidence only, delay_ms, Attempt)
FinishItem = tuple[dict, str | None, int, Attempt]
# per item: (status, reason), False for a stale ticket, ("leased", None) for evidence only
Finished = tuple[str, str | None] | bool
