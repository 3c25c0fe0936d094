"""The product's limits and retry policy: data, not rules.

The contract (``lease.worker``) keeps the lab's limits to the letter: 60 s
of life, 16 attempts, a backoff capped at 1 s. A service's receiver goes down
for minutes, so the product path passes wider limits (``PRODUCT``) and a
``RetryPolicy`` to the very same validators and rules; nothing here decides
anything on its own.

The defaults ride out an outage of hours, not seconds: 25 attempts (River's
default), a backoff from 1 s doubling to a cap of 1 h, half of each delay
random ("equal jitter", so a delay is never less than half its step and a
run of unlucky draws cannot spend the budget at once), three days to live.
The smallest total wait before a job runs out of attempts is then about
6.5 hours; a 10-minute outage spends 12 of its 25 attempts at most.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from lease.worker import (
    LAB,
    MAX_NOW_MS,
    MAX_QTY,
    Limits,
    Verdict,
    check_event,
    check_int,
    check_jitter,
    check_job_id,
    classify_error,
    retry_delay,
)

__all__ = [
    "PRODUCT",
    "MAX_BODY_BYTES",
    "MAX_NOTE_CHARS",
    "RetryPolicy",
    "retry_delay_ms",
    "DEFAULT_POLICY",
    "LAB_POLICY",
    "Intake",
    "check_product_event",
    "check_ordering_key",
    "check_event_type",
    "check_priority",
    "MIN_PRIORITY",
    "MAX_PRIORITY",
    "check_note",
    "check_actor",
    "canonical_body",
]

DAY_MS = 86_400_000

# Job ids as services write them: UUIDs, "order:123", "tenant/7", a Standard
# Webhooks "msg_..." id. Visible ASCII only: an id travels in a header
# (webhook-id) and in log lines, where a space or a control character would
# split or forge a field.
PRODUCT = Limits(
    job_id=re.compile(r"[\x21-\x7e]{1,255}"),
    job_id_rule="1-255 visible ASCII characters (no space, no control character)",
    min_qty=0,  # 0: a payload event, whose content is its body
    max_qty=MAX_QTY,
    max_attempts=100,
    max_ttl_ms=30 * DAY_MS,
    max_lease_ms=3_600_000,
    max_delay_ms=DAY_MS,
)

MAX_BODY_BYTES = 65_536  # a body's canonical UTF-8 text; webhook services cap near this
MAX_NOTE_CHARS = 500
_NOTE = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_NOTE_CHARS}}}")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a job lives and how its retries are spaced (milliseconds).

    ``jitter`` is the share of each delay that is random: 0 waits the whole
    step, 1 anything from 0 to the step (the lab's full jitter), the default
    0.5 from half the step to the whole.
    """

    max_attempts: int = 25
    backoff_base_ms: int = 1_000
    backoff_cap_ms: int = 3_600_000
    jitter: float = 0.5
    ttl_ms: int = 3 * DAY_MS
    lease_ms: int = 30_000

    def __post_init__(self) -> None:
        check_int("max_attempts", self.max_attempts, 1, PRODUCT.max_attempts)
        check_int("backoff_base_ms", self.backoff_base_ms, 1, PRODUCT.max_delay_ms)
        check_int("backoff_cap_ms", self.backoff_cap_ms, self.backoff_base_ms,
                   PRODUCT.max_delay_ms)
        check_jitter(self.jitter)
        check_int("ttl_ms", self.ttl_ms, 1, PRODUCT.max_ttl_ms)
        check_int("lease_ms", self.lease_ms, 1, PRODUCT.max_lease_ms)

    def ratio(self, random_ratio: float) -> float:
        """The jitter ratio of the retry rule, from a uniform draw in 0..1."""
        return min(1.0, 1 - self.jitter + self.jitter * check_jitter(random_ratio))

    def delay_ms(self, attempt: int, random_ratio: float) -> int:
        """The wait before the next attempt, by the contract's own rule."""
        return retry_delay(attempt, self.backoff_base_ms, self.backoff_cap_ms,
                           self.ratio(random_ratio), limits=PRODUCT)

    def classify(self, error: BaseException, attempt: int,
                 random_ratio: float) -> Verdict | None:
        """classify_error with this policy's backoff."""
        return classify_error(error, attempt, self.ratio(random_ratio),
                              base_ms=self.backoff_base_ms, cap_ms=self.backoff_cap_ms,
                              limits=PRODUCT)

    def judge(self, error: BaseException, attempt: int,
              random_ratio: float) -> Verdict | None:
        """A failed send's (outcome, delay_ms) by this policy, None when it is
        not ours to judge (a bad ACK, an unclassified error). A receiver's
        Retry-After (``error.retry_after_ms``, as the senders set it) is
        honoured up to the backoff cap."""
        verdict = self.classify(error, attempt, random_ratio)
        if verdict is None or verdict[0] != "retry":
            return verdict
        return ("retry", retry_delay_ms(verdict[1], _retry_after_ms(error),
                                        self.backoff_cap_ms))


def retry_delay_ms(policy_delay_ms: int, retry_after_ms: int | None, cap_ms: int) -> int:
    """A retry's delay: the policy's, or longer when the receiver asked for
    longer (Retry-After), but never past the policy's backoff cap for that."""
    if retry_after_ms is None:
        return policy_delay_ms
    return max(policy_delay_ms, min(retry_after_ms, cap_ms))


def _retry_after_ms(error: BaseException) -> int | None:
    """The wait the receiver asked for, as the sender put it on its exception."""
    try:
        wait = getattr(error, "retry_after_ms", None)
    except Exception:  # a foreign exception's property: no wait asked for
        return None
    return wait if type(wait) is int and wait >= 0 else None


DEFAULT_POLICY = RetryPolicy()
# The lab's numbers as a policy: what the contract functions do by default.
LAB_POLICY = RetryPolicy(max_attempts=3, backoff_base_ms=100, backoff_cap_ms=1000,
                         jitter=1.0, ttl_ms=60_000, lease_ms=LAB.max_lease_ms)


@dataclass(frozen=True)
class Intake:
    """An event as the store keeps it: qty (0 for a payload event), the body's
    canonical text and its digest (None for a lab {"id", "qty"} event)."""

    id: str
    qty: int
    body: str | None
    digest: str | None
    key: str | None = None  # the ordering key: delivered one at a time, in intake order
    type: str | None = None  # the event type endpoints subscribe to
    priority: int = 0  # claimed first when higher (lease.rules, "priorities")


def canonical_body(body: object) -> tuple[str, str]:
    """(text, sha256 hex) of a JSON object body: sorted keys, no spaces, UTF-8.

    Two bodies that are equal as JSON get the same text and digest, so a
    resent event is a duplicate whatever order its keys came in. Only what
    survives a JSON round trip unchanged is accepted (str keys, no NaN, no
    tuples), so what is delivered is what was enqueued.
    """
    if type(body) is not dict:
        raise ValueError(f"event body must be a JSON object, got {type(body).__name__}")
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"event body is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("event body is nested too deeply") from None
    data = _body_bytes(text)
    if json.loads(text) != body:
        raise ValueError("event body does not survive JSON unchanged (keys must be str)")
    return text, hashlib.sha256(data).hexdigest()


def stored_body(text: str, digest: object) -> bytes:
    """The bytes of a body its intake made canonical, checked by the digest
    the intake gave it: what is sent must be the very bytes whose digest
    deduplicates the job, at intake and at the receiver. The same promise as
    parsing and canonicalizing the text again (``canonical_body``), at a
    fraction of its cost: about 3 us for a 4 KB body against about 200. A
    text and digest both rewritten by other means pass unparsed: the
    receiver then deduplicates by those same bytes."""
    if type(digest) is not str:
        raise ValueError(f"digest must be a str, got {type(digest).__name__}")
    data = _body_bytes(text)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"event body is not the text its intake's digest names "
                         f"({digest!r:.20}): {text!r:.80}")
    return data


def _body_bytes(text: str) -> bytes:
    """A body's UTF-8 bytes, within the size cap."""
    try:
        data = text.encode()
    except UnicodeEncodeError:
        raise ValueError("event body is not UTF-8 text (a lone surrogate)") from None
    if len(data) > MAX_BODY_BYTES:
        raise ValueError(f"event body is {len(data)} bytes, more than {MAX_BODY_BYTES}")
    return data


def check_product_event(event: object) -> Intake:
    """{"id", "qty"} (the lab's event, by the lab's rule: check_event) or
    {"id", "body"} (a JSON object, its id by the product's rule), either with
    an optional "key": the ordering key (1-255 visible ASCII, like an id) of
    jobs delivered one at a time in intake order, an optional "type": the
    event type endpoints subscribe to, and an optional "priority" (an int in
    -100..100, 0 when absent; higher is claimed first). ValueError naming the
    problem."""
    if type(event) is not dict:
        raise ValueError(f"event must be a dict, got {type(event).__name__}")
    keys = set(event)
    key = check_ordering_key(event["key"]) if "key" in keys else None
    kind = check_event_type(event["type"]) if "type" in keys else None
    priority = check_priority(event["priority"]) if "priority" in keys else 0
    keys -= {"key", "type", "priority"}
    if keys == {"id", "qty"}:
        # The lab's event keeps the lab's rule whole, id included: it goes to
        # receivers that check it so (the demo's inbox among them).
        check_event({"id": event["id"], "qty": event["qty"]})
        return Intake(event["id"], event["qty"], None, None, key, kind, priority)
    if keys == {"id", "body"}:
        job_id = check_job_id("event id", event["id"], PRODUCT)
        text, digest = canonical_body(event["body"])
        return Intake(job_id, 0, text, digest, key, kind, priority)
    raise ValueError(
        "event must have the keys id and qty, or id and body (and an optional key, "
        f"type and priority); got {sorted(map(str, event))}")


# An event's priority: a small int, so the claim's index stays narrow and an
# operator can read the levels at a glance; bool is refused (True is no level).
MIN_PRIORITY = -100
MAX_PRIORITY = 100


def check_priority(value: object) -> int:
    """An event's priority: an int (not a bool) in -100..100."""
    if type(value) is not int or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"event priority must be an int in {MIN_PRIORITY}..{MAX_PRIORITY},"
                         f" got {value!r:.40}")
    return value


# An event type as webhook services write them: "invoice.paid", "user/created".
_TYPE = re.compile(r"[A-Za-z0-9_.:/-]{1,100}")


def check_event_type(value: object, name: str = "event type") -> str:
    """An event type: 1-100 letters, digits or ``_ . : / -``."""
    if type(value) is not str or not _TYPE.fullmatch(value):
        raise ValueError(f"{name} must be 1-100 letters, digits or _ . : / -, "
                         f"got {value!r:.80}")
    return value


def check_ordering_key(key: object, name: str = "event key") -> str:
    """An ordering key: what a job id may be (1-255 visible ASCII characters);
    ``name`` is what the error calls it (an event's key, a filter's key)."""
    return check_job_id(name, key, PRODUCT)


def check_note(note: object) -> str:
    """An operator's note: 1-500 characters, no control characters."""
    if type(note) is not str or not _NOTE.fullmatch(note):
        raise ValueError(f"note must be 1-{MAX_NOTE_CHARS} characters without control "
                         f"characters, got {note!r:.80}")
    return note


MAX_ACTOR_CHARS = 100
_ACTOR = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_ACTOR_CHARS}}}")


def check_actor(actor: object) -> str | None:
    """Who made an operator's change, for its audit row: None, or 1-100
    characters without control characters (an operator's name or a token's label)."""
    if actor is not None and (type(actor) is not str or not _ACTOR.fullmatch(actor)):
        raise ValueError(f"actor must be None or 1-{MAX_ACTOR_CHARS} characters without "
                         f"control characters, got {actor!r:.80}")
    return actor


def check_not_before(value: Any, now_ms: int) -> int:
    """A delayed delivery's first moment: a clock value, not before now."""
    return check_int("not_before_ms", value, now_ms, MAX_NOW_MS)
