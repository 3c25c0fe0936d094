"""A circuit breaker per endpoint: the pure rules both drivers call.

Every dispatcher shares an endpoint's breaker because it is store state,
changed by the finishes (``step``) and read by the claims (``claim_room``),
each inside its own transaction:

    closed ──5 failures in a row, or ≥ 70 % of ≥ 20 in a minute──► open
      ▲                                                            │ cool-down
      └───── the probe delivered ◄── half-open (one probe) ◄───────┘ ends
                                      └── the probe failed ──► open, cool-down doubled

- A failure is what says the endpoint itself is down: a transport error, a
  timeout, a 5xx, a 429. A 4xx refusal of one message is about the message,
  and the endpoint that answered it is up: it counts as an answer.
- While open, no delivery of the endpoint is claimed, so **no attempt of any
  delivery is spent**; their time to live still runs (a delivery can still go
  dead by its deadline while its endpoint is down, and says so).
- The cool-down starts at 5 s and doubles at each failed probe, up to 5
  minutes: an endpoint down for hours costs one probe every 5 minutes.
- Half-open lets one probe at a time (a real delivery: nothing is sent that is
  not owed); the answers of sends begun before the circuit opened do not
  close it, the probe's does. Its success closes the circuit, and the endpoint's waiting
  deliveries are due at once, without waiting out their own backoffs.
- A ``Retry-After`` on a 429 or a 503 pauses the whole endpoint (up to an
  hour), not only the delivery that read it.
- An endpoint failing, with no delivery in between, for longer than its
  ``disable_after_ms`` (3 days by default) is disabled; its deliveries are
  neither sent nor lost: they wait, in order, for ``endpoint enable``.

Why these defaults: five in a row is past any single flaky connection and
well under the attempts a 20 s outage would burn (thousands); the rate rule
catches an endpoint that fails most requests without five in a row (a load
balancer with one bad backend of two); 5 s to 5 min follows the backoff of
the jobs themselves, so a breaker never waits much longer than a job would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lease.policy import PRODUCT
from lease.records import Attempt
from lease.worker import MAX_BATCH, check_ticket, marker_matches

__all__ = ["BREAKER", "BREAKER_ACTOR", "Breaker", "CIRCUIT_FIELDS", "Circuit", "CLOSED",
           "OPEN", "HALF_OPEN", "RELEASE_REASONS", "check_release", "claim_room",
           "closed_circuit", "disabled_by", "may_send", "release_decisions", "signal_of",
           "step"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
BREAKER_ACTOR = "breaker"  # the actor of the audit rows the breaker writes
STATES = (CLOSED, OPEN, HALF_OPEN)
DAY_MS = 86_400_000


@dataclass(frozen=True)
class Breaker:
    """The breaker's thresholds (milliseconds)."""

    open_after: int = 5  # failures in a row
    window_ms: int = 60_000  # the failure rate's window
    window_min: int = 20  # attempts in the window before its rate counts
    window_rate: float = 0.7  # the share of failures that opens
    cooldown_ms: int = 5_000
    cooldown_cap_ms: int = 300_000
    pause_cap_ms: int = 3_600_000  # the longest Retry-After honoured for the endpoint


BREAKER = Breaker()
DISABLE_AFTER_MS = 3 * DAY_MS


@dataclass(frozen=True)
class Circuit:
    """An endpoint's breaker as its row keeps it."""

    state: str = CLOSED
    since_ms: int | None = None  # when it came to this state
    why: str | None = None  # the evidence of the last change
    failures: int = 0  # in a row
    window_ms: int | None = None  # the failure rate's window began
    window_failed: int = 0
    window_total: int = 0
    open_until_ms: int | None = None  # the cool-down ends (open)
    cooldown_ms: int = 0  # the last cool-down's length
    paused_until_ms: int | None = None  # a Retry-After's end
    failing_since_ms: int | None = None  # the first failure with no delivery since


CIRCUIT_FIELDS = ("state", "since_ms", "why", "failures", "window_ms", "window_failed",
                  "window_total", "open_until_ms", "cooldown_ms", "paused_until_ms",
                  "failing_since_ms")


def closed_circuit() -> Circuit:
    return Circuit()


def signal_of(outcome: str | None, attempt: Attempt) -> str | None:
    """What an attempt tells the breaker: "success" (delivered, or a 4xx
    refusal: the endpoint answered), "failure" (the endpoint is down or
    overloaded) or None (evidence only: a bad ACK proves nothing)."""
    if outcome is None:
        return None
    if outcome == "ok":
        return "success"
    status = attempt.http_status
    if status is None or status >= 500 or status == 429:
        return "failure"
    return "success"


def step(circuit: Circuit, signal: str, attempt: Attempt, now_ms: int,
         breaker: Breaker | None = None) -> tuple[Circuit, str | None]:
    """The circuit after one attempt's signal, and the change it made, if
    any: "opened", "reopened", "closed", "paused" (for the log line and the
    audit row)."""
    if signal == "success" and _healthy(circuit):
        # a healthy endpoint's delivery, the common case: nothing moves (what
        # the rules below find too, at the cost of a copy of the circuit)
        return circuit, None
    window_ms, failed, total = circuit.window_ms, circuit.window_failed, circuit.window_total
    # None: the module's BREAKER as it is now, not as it was at import (a test
    # or an embedder may replace it)
    breaker = BREAKER if breaker is None else breaker
    if window_ms is None or now_ms - window_ms >= breaker.window_ms:
        window_ms, failed, total = None, 0, 0
    if signal == "success":
        # The rate's window starts at its first failure: a healthy endpoint's
        # deliveries change nothing, and no finish writes its row.
        if window_ms is not None:
            total += 1
        after = replace(circuit, failures=0, failing_since_ms=None, window_ms=window_ms,
                        window_failed=failed, window_total=total)
        if circuit.state == CLOSED:
            return after, None
        if circuit.state == OPEN:
            # a send that began before it opened: only the probe's answer closes
            return circuit, None
        return replace(after, state=CLOSED, since_ms=now_ms, open_until_ms=None,
                       cooldown_ms=0, why="a delivery went through"), "closed"
    window_ms = now_ms if window_ms is None else window_ms
    failed, total = failed + 1, total + 1
    failures = circuit.failures + 1
    after = replace(circuit, failures=failures, window_ms=window_ms, window_failed=failed,
                    window_total=total,
                    failing_since_ms=circuit.failing_since_ms if circuit.failing_since_ms
                    is not None else now_ms)
    evidence = _evidence(attempt)
    change = None
    pause = _pause(attempt, breaker)
    if pause is not None:
        until = max(now_ms + pause, circuit.paused_until_ms or 0)
        after = replace(after, paused_until_ms=until)
        change = "paused"
    if circuit.state == HALF_OPEN or (circuit.state == OPEN and circuit.open_until_ms is not None
                                      and now_ms >= circuit.open_until_ms):
        cooldown = min(max(circuit.cooldown_ms * 2, breaker.cooldown_ms), breaker.cooldown_cap_ms)
        return replace(after, state=OPEN, since_ms=now_ms, open_until_ms=now_ms + cooldown,
                       cooldown_ms=cooldown, why=f"the probe failed: {evidence}"), "reopened"
    if circuit.state == CLOSED:
        why = None
        if failures >= breaker.open_after:
            why = f"{failures} failures in a row, the last: {evidence}"
        elif total >= breaker.window_min and failed >= breaker.window_rate * total:
            why = (f"{failed} of {total} attempts failed in {breaker.window_ms // 1000} s, "
                   f"the last: {evidence}")
        if why is not None:
            return replace(after, state=OPEN, since_ms=now_ms,
                           open_until_ms=now_ms + breaker.cooldown_ms,
                           cooldown_ms=breaker.cooldown_ms, why=why), "opened"
    return after, change


def _healthy(circuit: Circuit) -> bool:
    """Closed, with no failure on record and no failure rate's window open."""
    return (circuit.state == CLOSED and circuit.failures == 0 and circuit.window_ms is None
            and circuit.window_failed == 0 and circuit.window_total == 0
            and circuit.failing_since_ms is None)


def disabled_by(circuit: Circuit, disable_after_ms: int | None, now_ms: int) -> str | None:
    """Why an endpoint failing this long is disabled, or None."""
    if disable_after_ms is None or circuit.failing_since_ms is None:
        return None
    if now_ms - circuit.failing_since_ms < disable_after_ms:
        return None
    return (f"failing for {(now_ms - circuit.failing_since_ms) // 1000} s with no delivery "
            f"(disable_after_ms {disable_after_ms}): {circuit.why or 'failures'}")


def claim_room(circuit: Circuit, live: int, now_ms: int) -> tuple[int | None, bool]:
    """What the breaker lets one claim lease of its endpoint: None (no limit
    of its own: the cap and the bucket decide), 0, or 1 (the probe); and
    whether that lease makes the circuit half-open."""
    if circuit.paused_until_ms is not None and now_ms < circuit.paused_until_ms:
        return 0, False
    if circuit.state == CLOSED:
        return None, False
    if circuit.state == OPEN and (circuit.open_until_ms is None
                                  or now_ms < circuit.open_until_ms):
        return 0, False
    # the cool-down is over (or a probe is out): one probe at a time
    room = max(0, 1 - live)
    return room, room > 0 and circuit.state == OPEN


def may_send(circuit: Circuit, now_ms: int) -> bool:
    """Whether a delivery claimed earlier may still be sent now, by its
    endpoint's circuit as last known: not while it is open within its
    cool-down, nor while a Retry-After pauses it (``claim_room``'s rule: a
    half-open circuit lets the probe a claim already leased go)."""
    room, _ = claim_room(circuit, 0, now_ms)
    return room != 0


# Why a claimed delivery is given back unsent (``Store.release_jobs``):
# "circuit": its endpoint's circuit opened (or a Retry-After paused it) after
# the claim, so sending it would spend an attempt on an endpoint known to be
# down; counted in the endpoint's attempts saved. "unsent": any other reason
# a dispatcher gives back what it will not send; counted nowhere.
RELEASE_REASONS = ("circuit", "unsent")


def check_release(tickets: object, reason: object) -> list[dict]:
    """The arguments of a release, checked: a list of at most MAX_BATCH
    tickets (each as a claim gave it) and one of RELEASE_REASONS."""
    if type(tickets) is not list or len(tickets) > MAX_BATCH:
        raise ValueError(f"tickets must be a list of at most {MAX_BATCH}")
    for ticket in tickets:
        check_ticket(ticket, PRODUCT)
    if reason not in RELEASE_REASONS:
        raise ValueError(f"reason must be one of {RELEASE_REASONS}, got {reason!r:.40}")
    return tickets


def release_decisions(rows: dict[str, dict], tickets: list[dict],
                      now_ms: int) -> tuple[list[bool], list[dict]]:
    """Pure: per ticket True (its job is given back: pending again, its lease
    cleared, its attempt count as before the claim) or False (stale: the
    ticket no longer holds the job's whole marker, or its lease or deadline
    has passed; nothing changes), and the rows to write, each updated in
    place. ``rows`` are the jobs' marker columns by id (a finish's
    ``MARKED``): a ticket given twice is stale the second time, as two
    releases in sequence would find it.

    The claim counted the attempt (``lease_ticket``: ``attempt`` =
    ``attempts`` + 1); a release takes exactly that back, and keeps the
    token: the next claim raises it, so the released ticket stays stale. The
    job keeps its ``available_at`` (when it became due), so it is due at
    once and keeps its place among its endpoint's due deliveries. No attempt
    row is written: nothing was sent."""
    results: list[bool] = []
    released: list[dict] = []
    for ticket in tickets:
        row = rows.get(ticket["id"])
        if row is None or not marker_matches(row, ticket, now_ms):
            results.append(False)
            continue
        row.update(status="pending", attempts=row["attempts"] - 1, owner=None,
                   lease_until=None)
        results.append(True)
        released.append(row)
    return results, released


def _pause(attempt: Attempt, breaker: Breaker) -> int | None:
    wait = getattr(attempt, "retry_after_ms", None)
    if wait is None or attempt.http_status not in (429, 503):
        return None
    return min(wait, breaker.pause_cap_ms)


def _evidence(attempt: Attempt) -> str:
    if attempt.error:
        return attempt.error[:200]
    return f"HTTP {attempt.http_status}" if attempt.http_status is not None else "no answer"
