"""Endpoints as data: where a queue's messages go, and the rules of the claim
that keep one endpoint from slowing another. Both drivers call these; neither
writes a rule of its own.

A queue with no endpoints works as it always did: each event is one job, sent
to the ``--url`` its dispatcher was started with. Once a queue has endpoints,
an event is a *message*: at intake it fans out to one *delivery* per endpoint
subscribed to its type (``*`` subscribes to every type), in the intake's one
transaction. A delivery is a job like any other (its own lease, fencing
token, attempt budget, evidence, dead letter, redrive and cancel); its id is
``delivery_id(message, endpoint)`` and the receiver sees the message's id.

The claim enforces, across every dispatcher and host, because it is all
store state judged inside the claim's transaction:

- a cap on an endpoint's sends in flight (its live leases);
- a token bucket per endpoint (``rate`` requests a second, ``burst`` at
  once), refilled by the store's clock at each claim;
- fairness by rotation, with equal weights: the endpoints that have work
  take turns, the least recently served first; each endpoint a claim serves
  gets an equal share of it, one delivery of each in turn. So an endpoint
  with a million deliveries waiting does not starve one with ten, an
  endpoint at its cap, paused, open or disabled does not hold back the
  others (it is passed over, its backlog never read), and one that was
  blocked for a day gets its turn and no more when it comes back. Equal
  weights because endpoints are usually customers, each owed the same
  share; a cap or a rate is the knob for one that should get less.
  Within an endpoint, deliveries go in the order they became due.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Any

from lease.breaker import DAY_MS, DISABLE_AFTER_MS
from lease.http import ACK_POLICIES, Destination, check_static_headers
from lease.policy import PRODUCT, check_event_type
from lease.signing import parse_secret
from lease.worker import check_identifier, check_int, check_job_id

__all__ = [
    "ALL",
    "Endpoint",
    "EndpointError",
    "allowance",
    "check_endpoint_name",
    "counts_leases",
    "check_event_type",
    "check_served",
    "delivery_id",
    "round_robin",
    "rotation_batch",
    "SPREAD",
    "TURN",
    "shares",
    "turns",
    "refill",
    "subscribes",
]

ALL = "*"  # every type (an endpoint's subscription), every endpoint (a claim's)
MAX_TYPES = 100
MAX_IN_FLIGHT = 100_000
MAX_RATE = 1_000_000.0  # requests a second
MAX_BURST = 1_000_000



class EndpointError(ValueError):
    """An endpoint that cannot be: a bad field, a name taken or unknown, a
    removal refused while deliveries are live."""


def check_endpoint_name(name: object) -> str:
    """1-64 ASCII letters, digits, '_' or '-' (it ends every delivery id)."""
    return check_identifier("endpoint name", name)


def check_types(types: object) -> tuple[str, ...]:
    """An endpoint's subscriptions: ``("*",)`` or distinct event types."""
    if isinstance(types, str) or not isinstance(types, (list, tuple)) or not types:
        raise ValueError("types must be a non-empty list of event types or ['*']")
    if len(types) > MAX_TYPES:
        raise ValueError(f"types may name at most {MAX_TYPES} event types")
    if ALL in types:
        if len(types) != 1:
            raise ValueError("types: '*' subscribes to every type and stands alone")
        return (ALL,)
    checked = tuple(check_event_type(value, "each type") for value in types)
    if len(set(checked)) != len(checked):
        raise ValueError("types must be distinct")
    return checked


def check_headers(headers: object) -> tuple[tuple[str, str], ...]:
    """Static headers sent with every request: (name, value) pairs; a value
    is a secret like a signing secret (an ``Authorization`` a customer asked
    for). The destinations' own rule (lease.http.check_static_headers)."""
    return check_static_headers(headers)


def _check_secret_texts(secrets: object) -> tuple[str, ...]:
    if isinstance(secrets, str) or not isinstance(secrets, (list, tuple)):
        raise ValueError("secrets must be a list of whsec_ secrets")
    if len(secrets) > 10:
        raise ValueError("at most 10 secrets at once (rotation needs two)")
    for text in secrets:
        parse_secret(text)  # ValueError that never shows the secret
    return tuple(secrets)


@dataclass(frozen=True, repr=False)
class Endpoint:
    """One destination of a queue's messages, checked at construction.

    ``secrets`` are ``whsec_`` texts (each request signed with every one of
    them: rotation without a gap) and ``headers`` (name, value) pairs sent
    with every request; both are secrets: the repr, ``public()`` and every
    read of a store leave them out. ``types`` is what it subscribes to
    (``("*",)``: every type). ``max_in_flight`` caps its live leases across
    every dispatcher; ``rate`` (requests a second) with ``burst`` caps how
    fast it is sent to; None: no cap. ``enabled`` False: its deliveries are
    kept, and wait."""

    name: str
    url: str
    ack: str = "echo-id"
    ca_file: str | None = None
    secrets: tuple[str, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    types: tuple[str, ...] = (ALL,)
    max_in_flight: int | None = None
    rate: float | None = None
    burst: int | None = None
    insecure_http: bool = False
    enabled: bool = True
    disable_after_ms: int | None = DISABLE_AFTER_MS
    destination: Destination = field(init=False, compare=False)

    def __post_init__(self) -> None:
        check_endpoint_name(self.name)
        set_ = object.__setattr__
        set_(self, "secrets", _check_secret_texts(self.secrets))
        set_(self, "headers", check_headers(self.headers))
        set_(self, "types", check_types(self.types))
        if self.ack not in ACK_POLICIES:
            raise ValueError(f"ack must be one of {', '.join(ACK_POLICIES)}, got {self.ack!r:.40}")
        if self.max_in_flight is not None:
            check_int("max_in_flight", self.max_in_flight, 1, MAX_IN_FLIGHT)
        if self.rate is not None:
            if type(self.rate) not in (int, float) or not 0 < self.rate <= MAX_RATE \
                    or not math.isfinite(self.rate):
                raise ValueError(f"rate must be a number of requests a second in "
                                 f"(0, {MAX_RATE:g}], got {self.rate!r:.40}")
            set_(self, "rate", float(self.rate))
            if self.burst is None:
                set_(self, "burst", max(1, math.ceil(self.rate)))
        if self.burst is not None:
            if self.rate is None:
                raise ValueError("burst needs a rate")
            check_int("burst", self.burst, 1, MAX_BURST)
        if type(self.enabled) is not bool:
            raise ValueError(f"enabled must be a bool, got {self.enabled!r:.40}")
        if self.disable_after_ms is not None:
            check_int("disable_after_ms", self.disable_after_ms, 60_000, 365 * DAY_MS)
        # the destination checks of every sender: https verified, plain http
        # to loopback, elsewhere only with insecure_http spelled out
        set_(self, "destination", Destination(
            self.url, ack=self.ack, ca_file=self.ca_file,
            secrets=tuple(parse_secret(text) for text in self.secrets),
            insecure_http=self.insecure_http, headers=self.headers))

    def __repr__(self) -> str:
        return (f"Endpoint({self.name!r}, {self.url!r}, secrets=<{len(self.secrets)}>, "
                f"headers=<{len(self.headers)}>, types={self.types!r}, "
                f"max_in_flight={self.max_in_flight!r}, rate={self.rate!r}, "
                f"enabled={self.enabled!r})")

    def changed(self, **changes: Any) -> Endpoint:
        """This endpoint with ``changes`` (field names), checked again whole."""
        return replace(self, **changed_fields(changes))

    def public(self) -> dict[str, Any]:
        """What a read may show: no secret, no header value (their names only)."""
        return {
            "name": self.name, "url": self.url, "ack": self.ack, "ca_file": self.ca_file,
            "secrets": len(self.secrets), "headers": [name for name, _ in self.headers],
            "types": list(self.types), "max_in_flight": self.max_in_flight,
            "rate": self.rate, "burst": self.burst, "insecure_http": self.insecure_http,
            "enabled": self.enabled, "disable_after_ms": self.disable_after_ms,
        }


def changed_fields(changes: dict[str, Any]) -> dict[str, Any]:
    """An update's fields, checked by name: a new rate without a burst gets
    the burst of that rate, and no rate takes its burst with it."""
    unknown = set(changes) - set(EDITABLE)
    if unknown:
        raise ValueError(f"cannot change {', '.join(sorted(unknown))} of an endpoint "
                         f"(these can: {', '.join(EDITABLE)})")
    changes = dict(changes)
    if "rate" in changes and "burst" not in changes:
        changes["burst"] = None  # none with no rate, recomputed from a new one
    return changes


EDITABLE = ("url", "ack", "ca_file", "secrets", "headers", "types", "max_in_flight",
            "rate", "burst", "insecure_http", "enabled", "disable_after_ms")


# ------------------------------------------------------------------ intake


def subscribes(types: Sequence[str], event_type: str | None) -> bool:
    """Whether an endpoint subscribed to ``types`` gets an event of that type;
    an event without a type goes to the endpoints that take every type."""
    return ALL in types or (event_type is not None and event_type in types)


def delivery_id(message_id: str, endpoint: str) -> str:
    """A delivery's job id: the message's id, '@', the endpoint's name (which
    has no '@', so the pair is read back unambiguously). ValueError when the
    two together pass the product's 255 characters."""
    text = f"{message_id}@{endpoint}"
    if len(text) > 255:
        raise ValueError(f"event id {message_id[:40]!r}... is too long to fan out to endpoint "
                         f"{endpoint!r}: the id, '@' and the endpoint's name must fit in 255 "
                         f"characters")
    return text


def may_be_delivery(job_id: str) -> bool:
    """Whether a job id may be a delivery's: every delivery's holds the '@'
    of ``delivery_id``, so an id without one is the queue's own job (one
    with one may be either: a job of its own may be named "a@b")."""
    return "@" in job_id


def line_key(key: str | None, endpoint: str) -> str | None:
    """The ordering line of a delivery: its key per endpoint. A space never
    appears in a key of its own, so a line of deliveries never meets a line
    of the queue's own jobs."""
    return None if key is None else f"{key} {endpoint}"


def key_of_line(line: str | None, endpoint: str | None) -> str | None:
    """The event's own key, back from its delivery's line."""
    if line is None or endpoint is None:
        return line
    return line.rsplit(" ", 1)[0]


# ------------------------------------------------------------------ the claim


def check_served(endpoints: object) -> str | tuple[str, ...] | None:
    """What a claim takes: None (the queue's own jobs, as before endpoints),
    ``"*"`` (deliveries to every endpoint) or endpoint names."""
    if endpoints is None or endpoints == ALL:
        return endpoints
    if isinstance(endpoints, str) or not isinstance(endpoints, (list, tuple)) or not endpoints:
        raise ValueError("endpoints must be None, '*' or a non-empty list of endpoint names")
    return tuple(sorted({check_endpoint_name(name) for name in endpoints}))


def refill(tokens: float, refilled_ms: int, now_ms: int, rate: float, burst: int) -> float:
    """A token bucket's level at ``now_ms``: what it held, plus ``rate`` a
    second since it was last filled, never above ``burst``. A clock that went
    back adds nothing."""
    return min(float(burst), tokens + max(0, now_ms - refilled_ms) * rate / 1000.0)


def allowance(endpoint: Mapping[str, Any], live: int, tokens: float | None,
              breaker_room: int | None = None) -> int:
    """How many deliveries of an endpoint one claim may lease: none while it
    is disabled; under its cap (less its live leases), within its bucket, and
    within what its circuit breaker lets (``lease.breaker.claim_room``)."""
    if not endpoint["enabled"]:
        return 0
    if breaker_room is not None and breaker_room <= 0:
        return 0
    room = MAX_IN_FLIGHT if endpoint["max_in_flight"] is None \
        else max(0, endpoint["max_in_flight"] - live)
    if tokens is not None:
        room = min(room, int(tokens))
    return room if breaker_room is None else min(room, breaker_room)


def counts_leases(endpoint: Mapping[str, Any], breaker_room: int | None) -> bool:
    """Whether an endpoint's allowance depends on its live leases
    (``allowance``): under a cap, or while its breaker lets a probe out
    (``breaker_room`` 1 with none live). An endpoint with neither leases
    as much whatever it has in flight, so a claim need not read its leases:
    the ones run out are taken with its due deliveries."""
    return endpoint["max_in_flight"] is not None or (
        breaker_room is not None and breaker_room > 0)


def shares(rooms: dict[str, int], limit: int) -> dict[str, int]:
    """How many deliveries to read of each endpoint a claim serves, in turn:
    an equal share of ``limit`` (rounded up), never more than its room."""
    open_ = [name for name, room in rooms.items() if room > 0]
    if not open_:
        return {}
    share = -(-limit // len(open_))
    return {name: min(rooms[name], share) for name in open_}


def turns(share: dict[str, int], limit: int) -> dict[str, int]:
    """How many of each endpoint's ``share`` ``round_robin`` keeps when each
    has its share to give (one of each in turn, in the shares' order, up to
    ``limit``): what a claim that leases the rows as it reads them takes of
    each endpoint, the endpoints that fall short of it left to a next round."""
    counts = dict.fromkeys(share, 0)
    left, layer = limit, 0
    while left > 0:
        open_ = [name for name, n in share.items() if n > layer]
        if not open_:
            break
        # whole layers at once, as many as every open endpoint fills
        depth = min(min(share[name] for name in open_) - layer, left // len(open_))
        if depth == 0:  # the last layer, cut short by the limit
            for name in open_[:left]:
                counts[name] += 1
            break
        for name in open_:
            counts[name] += depth
        left -= depth * len(open_)
        layer += depth
    return counts


def round_robin(found: dict[str, list[Any]], order: list[str], limit: int) -> list[Any]:
    """The rows one claim leases: one of each endpoint in turn, in rotation
    ``order``, again and again, up to ``limit``."""
    queues = [found[name] for name in order if found.get(name)]
    if len(queues) == 1:
        return list(queues[0][:limit])
    # layer by layer: the first of each in turn, then the second of each ...
    return [item for layer in zip_longest(*queues, fillvalue=_GAP) for item in layer
            if item is not _GAP][:limit]


_GAP = object()  # where a shorter queue has run out


MAX_RECOVER = 100_000  # deliveries one recovery sends again, in one transaction


def check_recover_ids(ids: object) -> list[str]:
    """A recovery's confirmed ids (the ones its dry run showed)."""
    if type(ids) is not list or len(ids) > MAX_RECOVER:
        raise ValueError(f"ids must be a list of at most {MAX_RECOVER} delivery ids")
    for job_id in ids:
        check_job_id("delivery id", job_id, PRODUCT)
    return ids


# A claim serves its endpoints in turns of about TURN deliveries each, and
# spreads a small claim over up to SPREAD of them. Turns of one delivery
# (a claim of 64 over 64 endpoints) write 64 endpoints' index ranges and
# rows in one commit; turns of 8 write 8, which on a queue of 10,000
# endpoints with 1,000,000 waiting cut the claim's time by 40 %, and over a
# rotation every endpoint gets the same turns either way.
TURN = 8
SPREAD = 8


def rotation_batch(wanted: int, batch: int = 0) -> int:
    """How many endpoints a claim takes from the rotation for its ``batch``-th
    look (0 the first), with ``wanted`` deliveries still to find: a turn of
    about TURN each (SPREAD endpoints at least), twice as many for each
    further look, so that endpoints at their cap at the front of the
    rotation do not leave a claim empty; never more than ``wanted``, so each
    endpoint examined is owed one delivery at least and none loses its turn
    to the claim's limit."""
    return max(1, min(wanted, max(SPREAD, -(-wanted // TURN)) << batch))
