"""The PostgreSQL driver's endpoints (``lease.endpoints``): the intake's
fan-out, the claim of deliveries by rotation, the operator's changes and the
reads. The rules are ``lease.endpoints``'s and ``lease.breaker``'s; what is
here is how the rows are locked.

An endpoint's row is the lock of its caps, its bucket and its breaker. Lock
order, everywhere: endpoint rows (by name), then the keys' advisory locks,
then job rows (by seq).

- A claim of deliveries never waits for a lock: the quarantine and the lease
  take job rows SKIP LOCKED, the rotation takes endpoint rows FOR NO KEY
  UPDATE SKIP LOCKED (claims at once serve disjoint endpoints), and the
  clearing of has_work takes FOR UPDATE SKIP LOCKED on rows it holds. A
  transaction that never waits is in no cycle.
- A finish locks endpoint rows (FOR NO KEY UPDATE, by name) only when a
  signal of a delivery still leased by its ticket moves a circuit, before its
  keys and rows.
- An intake locks the rows of the endpoints its events subscribe to FOR KEY
  SHARE (by name, each chunk's before its keys): no claim, finish or other
  intake waits for that; only a removal and an operator's change (FOR
  UPDATE) do, and a claim clearing has_work passes the row over. At its end
  it writes has_work = 1 on those of its endpoints at 0 (FOR NO KEY UPDATE,
  by name): an endpoint in the rotation already is neither written nor
  locked. Such a row is held by no one waiting for a key: not a finish (its
  delivery is leased, so the row's has_work is 1 and the intake leaves it),
  not an operator (the intake's FOR KEY SHARE keeps them out), not a claim
  (it never waits).
- A redrive does as an intake (FOR KEY SHARE on its deliveries' endpoints
  first, has_work at its end); a removal, a recovery and an operator's
  change lock their endpoint's row FOR UPDATE first, then keys, then rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from lease.breaker import (
    BREAKER_ACTOR,
    CIRCUIT_FIELDS,
    Circuit,
    claim_room,
    disabled_by,
    signal_of,
    step,
)
from lease.endpoints import (
    ALL,
    Endpoint,
    EndpointError,
    allowance,
    changed_fields,
    counts_leases,
    delivery_id,
    key_of_line,
    line_key,
    may_be_delivery,
    refill,
    rotation_batch,
    shares,
    turns,
)
from lease.policy import Intake, RetryPolicy
from lease.postgres.reads import by_key, dicts
from lease.postgres.statements import (
    ADD_ENDPOINT,
    AUDIT_ENDPOINT,
    AUTO_DISABLE,
    CIRCUIT_ROW,
    CONTENTS,
    DELIVERIES_OF,
    ENDPOINT_AUDIT,
    ENDPOINT_COLUMNS,
    ENDPOINT_DEAD,
    ENDPOINT_LAST_ERROR,
    ENDPOINT_RETRIED,
    ENDPOINT_STATS,
    ENDPOINTS_FOR_INTAKE,
    ENDPOINTS_OF_IDS,
    HALF_OPEN,
    HAS_WORK,
    IDLE_ENDPOINTS,
    INSERT_NEW,
    LIVE_OF,
    LOCK_CIRCUITS,
    LOCK_KEY_SHARE,
    LOCK_KEYS,
    LOCK_TO_CLEAR,
    MESSAGES,
    NO_WORK,
    ORDERED_READS,
    PROMOTE,
    PUBLIC_COLUMNS,
    RELEASE_WAITING,
    ROTATION,
    SPEND_TOKENS,
    TAKE_DUE,
    UPDATE_ENDPOINT,
    WRITE_CIRCUIT,
    array_text,
    unnest_columns,
)
from lease.records import Attempt, Leased
from lease.rules import CIRCUIT_COLUMNS, WORKER_BEAT_MS, claim_rank, conflict
from lease.worker import Busy, Conflict

# How many batches of endpoints one claim takes from the rotation at most
# (as the SQLite driver): endpoints at their cap or in a backoff cannot make
# a claim read them all.
MAX_BATCHES = 6


# ------------------------------------------------------------------ intake


@dataclass
class Fanout:
    """An intake's endpoints: who subscribes to what, read once; the ones
    its events go to locked FOR KEY SHARE as they come (``lock``), and the
    ones it wrote deliveries to (they join the rotation at its end)."""

    every: list[str]  # the endpoints subscribed to every type
    by_type: dict[str, list[str]]  # the others, by the types they take
    locked: set[str] = field(default_factory=set)
    touched: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, conn: Any) -> Fanout | None:
        """None for a queue without endpoints: today's intake exactly."""
        found = conn.execute(ENDPOINTS_FOR_INTAKE).fetchall()
        if not found:
            return None
        every: list[str] = []
        by_type: dict[str, list[str]] = {}
        for name, types in found:
            for event_type in types:
                (every if event_type == ALL else by_type.setdefault(event_type, [])
                 ).append(name)
        return cls(every, by_type)

    def size(self) -> int:
        """How many endpoints an event may go to at most."""
        return len(self.every) + max(map(len, self.by_type.values()), default=0)

    def subscribers(self, event_type: str | None) -> list[str]:
        """The endpoints an event of this type goes to, by name: one look-up
        an event, however many endpoints (lease.endpoints.subscribes)."""
        if event_type is None:
            return self.every
        return sorted(self.every + self.by_type.get(event_type, []))

    def lock(self, conn: Any, names: set[str]) -> None:
        """These endpoints' rows FOR KEY SHARE, before the chunk's keys; one
        removed since the intake read them is no subscriber any more."""
        new = sorted(names - self.locked)
        if not new:
            return
        kept = {name for (name,) in conn.execute(LOCK_KEY_SHARE, (new,))}
        self.locked |= kept
        gone = set(new) - kept
        if gone:
            self.every = [name for name in self.every if name not in gone]
            self.by_type = {kind: [name for name in names if name not in gone]
                            for kind, names in self.by_type.items()}

    def save(self, conn: Any) -> None:
        """The endpoints that got deliveries join the rotation."""
        has_work(conn, self.touched)


def has_work(conn: Any, names: Iterable[str]) -> None:
    """These endpoints in the rotation (only the ones out of it are written)."""
    names = sorted(set(names))
    if names:
        conn.execute(HAS_WORK, (names,))


def lock_endpoints_of(conn: Any, job_ids: list[str]) -> None:
    """A redrive's first lock: the endpoints of its deliveries, FOR KEY SHARE,
    so no claim takes one out of the rotation before it commits."""
    names = [name for (name,) in conn.execute(ENDPOINTS_OF_IDS, (job_ids,))]
    if names:
        conn.execute(LOCK_KEY_SHARE, (names,))


def fan_out(conn: Any, chunk: list[Intake], available_at: int, policy: RetryPolicy,
            fan: Fanout, trace: str | None = None) -> list:
    """Inside the intake: each event a message, per event True (its
    deliveries written, one per subscribed endpoint, maybe none), False (the
    message is kept with this content) or its Conflict. A delivery id too
    long is a ValueError: the whole intake refused, like any bad event.
    Every delivery keeps the intake's ``trace`` context (lease.tracing)."""
    fan.lock(conn, {name for intake in chunk for name in fan.subscribers(intake.type)})
    plans = []
    for intake in chunk:
        names = fan.subscribers(intake.type)
        plans.append((intake, names, [delivery_id(intake.id, name) for name in names]))
    lines = sorted({line for intake, names, _ in plans for name in names
                    if (line := line_key(intake.key, name)) is not None})
    if lines:
        conn.execute(LOCK_KEYS, (lines,))
    kept = {message: (qty, digest, key_of_line(line, endpoint), kind)
            for message, qty, digest, line, endpoint, kind
            in by_key(conn, MESSAGES, sorted({intake.id for intake in chunk}))}
    taken = {job_id for job_id, *_ in by_key(
        conn, CONTENTS, sorted({d for _, _, ids in plans for d in ids}))}
    results: list = []
    rows: list[tuple] = []
    for intake, names, ids in plans:
        first = kept.get(intake.id)
        if first is not None:
            results.append(judge(intake, *first))
            continue
        clash = next((d for d in ids if d in taken), None)
        if clash is not None:
            results.append(Conflict(f"job {clash!r} exists: event {intake.id!r} cannot fan "
                                    f"out to an id the queue's own job has"))
            continue
        kept[intake.id] = (intake.qty, intake.digest, intake.key, intake.type)
        for name, job_id in zip(names, ids, strict=True):
            rows.append((job_id, intake.qty, intake.body, intake.digest,
                         line_key(intake.key, name), name, intake.id, intake.type,
                         intake.priority))
            fan.touched.add(name)
        results.append(True)
    if rows:
        inserted = conn.execute(INSERT_NEW, (
            policy.max_attempts, available_at, available_at + policy.ttl_ms, trace,
            *unnest_columns(rows))).fetchall()
        if len(inserted) != len(rows):
            # a job of the queue's own written by an intake that began before
            # the first endpoint was added: judged again from the start
            raise Busy("an intake of the same ids committed meanwhile: try again")
        new_lines = sorted({row[4] for row in rows if row[4] is not None})
        if new_lines:
            conn.execute(PROMOTE, {"keys": new_lines})
    return results


def judge(intake: Intake, qty: int, digest: str | None, key: str | None,
          kind: str | None) -> bool | Conflict:
    """A known id: False for the content it has (its type too), else the
    product's Conflict."""
    if (qty, digest, key, kind) == (intake.qty, intake.digest, intake.key, intake.type):
        return False
    return conflict(intake, qty, digest, key, kind)


# ------------------------------------------------------------------ the claim


@dataclass
class Claim:
    """One claim of deliveries as it goes: its arguments, the endpoints it
    examined in rotation order (locked till it commits), each rate
    endpoint's bucket level now, the endpoints whose lease would be the
    probe, the rows leased so far, and the rounds that leased (each one
    records the claim on its owner's row, statements.WORKER_ROW)."""

    owner: str
    lease_ms: int
    limit: int
    now: int
    order: list[str] = field(default_factory=list)
    buckets: dict[str, float] = field(default_factory=dict)
    probes: set[str] = field(default_factory=set)
    leased: list[tuple] = field(default_factory=list)
    rounds: int = 0


@dataclass
class Rotation:
    """A claim's look at the rotation: its arguments, moved on at each batch,
    and the first batch's cursor (sent in the claim's first round trip)."""

    args: dict[str, Any]
    first: psycopg.Cursor[dict[str, Any]]


def send_rotation(conn: psycopg.Connection, served: str | tuple[str, ...],
                  claim: Claim) -> Rotation:
    """Inside a claim's pipeline, after its quarantine: the first batch of
    the rotation asked for, not waited for, with the setting of the claim's
    ordered reads (it ends with the claim): the claim makes no round trip of
    its own to start."""
    args: dict[str, Any] = {
        "now": claim.now, "all": served == ALL, "names": [] if served == ALL else list(served),
        "limit": rotation_batch(claim.limit), "served": -(2**63), "name": "", "seen": []}
    conn.execute(ORDERED_READS)
    return Rotation(args, conn.cursor(row_factory=dict_row).execute(ROTATION, args))


def claim_deliveries(conn: psycopg.Connection, rotation: Rotation, claim: Claim,
                     judged: Callable[[], None]) -> list[Leased]:
    """Inside a claim, after its quarantine and ``send_rotation``: the
    endpoints with work take turns (the least recently served first), each
    one's deliveries leased within its allowance and its share of the claim
    (the SQLite driver's pick_deliveries, with the rows of the endpoints
    locked); each rate endpoint's bucket spent by what it leased, a probe's
    circuit half-open; the endpoints examined (the rotation sent each to its
    back) with nothing pending or leased out of it. ``judged`` is called once
    the first batch's endpoints are judged, before anything is leased."""
    args = rotation.args
    for n in range(MAX_BATCHES):
        if n:
            args["limit"] = rotation_batch(claim.limit - len(claim.leased), n)
        batch = sorted(rotation.first.fetchall() if n == 0 else dicts(conn, ROTATION, args),
                       key=lambda row: (row["served_at"], row["name"]))
        if not batch:
            break
        args["served"], args["name"] = batch[-1]["served_at"], batch[-1]["name"]
        args["seen"] = args["seen"] + [row["name"] for row in batch]
        claim.order += [row["name"] for row in batch]
        rooms = _rooms(conn, batch, claim)
        if n == 0:
            judged()
        _take(conn, rooms, claim)
        if len(claim.leased) >= claim.limit or len(batch) < args["limit"]:
            break
    _after_lease(conn, claim)
    return [Leased({"id": job_id, "qty": qty, "owner": claim.owner, "token": token,
                    "attempt": attempt, "lease_until": until}, body, digest, endpoint, message,
                   trace)
            for _, job_id, qty, token, attempt, until, body, digest, endpoint, message, trace, _
            in sorted(claim.leased, key=claim_rank)]


def _rooms(conn: psycopg.Connection, batch: list[dict[str, Any]], claim: Claim) -> dict[str, int]:
    """Each endpoint's allowance for this claim (lease.endpoints.allowance) by
    its bucket, its breaker and, when they count (``counts_leases``), its live
    leases, counted here."""
    now = claim.now
    counted = [row["name"] for row in batch
               if counts_leases(row, claim_room(circuit_of(row), 0, now)[0])]
    live: dict[str, int] = dict(conn.execute(LIVE_OF, {"names": counted, "now": now}).fetchall()
                                ) if counted else {}
    rooms: dict[str, int] = {}
    for row in batch:
        name = row["name"]
        tokens = None
        if row["rate"] is not None:
            tokens = refill(row["tokens"], row["refilled_ms"], now, row["rate"], row["burst"])
            claim.buckets[name] = tokens
        room, probe = claim_room(circuit_of(row), live.get(name, 0), now)
        if probe:
            claim.probes.add(name)
        rooms[name] = allowance(row, live.get(name, 0), tokens, room)
    return rooms


def _take(conn: psycopg.Connection, rooms: dict[str, int], claim: Claim) -> None:
    """Lease each endpoint's first deliveries (its leases run out, then its
    due ones) in equal shares of what the claim still wants, one of each in
    turn, and again of those that had more, until it is filled or none has
    any left (one statement a round, every endpoint's index ranges in it)."""
    wanted = claim.limit - len(claim.leased)
    rooms = {name: room for name, room in rooms.items() if room > 0}
    while wanted > 0 and rooms:
        share = turns(shares(rooms, wanted), wanted)
        names = [name for name, n in share.items() if n]  # in the rotation's order
        leased = conn.execute(TAKE_DUE, {
            "names": names, "lims": [share[name] for name in names], "now": claim.now,
            "owner": claim.owner, "lease_ms": claim.lease_ms, "before": len(claim.leased),
            "beat": WORKER_BEAT_MS}).fetchall()
        claim.rounds += 1
        claim.leased += leased
        wanted -= len(leased)
        got = dict.fromkeys(names, 0)
        for row in leased:
            got[row[8]] += 1
        for name in names:
            rooms[name] = 0 if got[name] < share[name] else rooms[name] - got[name]
        rooms = {name: room for name, room in rooms.items() if room > 0}


def _after_lease(conn: psycopg.Connection, claim: Claim) -> None:
    """Each rate endpoint's bucket spent, each probe's circuit half-open, and
    the endpoints examined with nothing pending or leased out of the
    rotation (passing over the ones it leased from: not idle)."""
    busy = {row[8] for row in claim.leased}
    _spend(conn, claim.buckets, claim.leased, claim.now)
    for name in sorted(claim.probes & busy):
        conn.execute(HALF_OPEN, {"now": claim.now, "name": name})
    idle_names = sorted(name for name in claim.order if name not in busy)
    if idle_names:
        _clear(conn, [name for (name,) in conn.execute(IDLE_ENDPOINTS, (idle_names,))])


def _clear(conn: psycopg.Connection, idle: list[str]) -> None:
    """The idle endpoints out of the rotation (NO_WORK says why no intake's
    delivery is lost by it)."""
    if idle:
        clear = [name for (name,) in conn.execute(LOCK_TO_CLEAR, (idle,))]
        if clear:
            conn.execute(NO_WORK, (clear,))


def _spend(conn: psycopg.Connection, buckets: dict[str, float], leased: list,
           now: int) -> None:
    """Each rate endpoint's bucket: its level now, less one token a lease."""
    spent: dict[str, int] = {}
    for row in leased:
        spent[row[8]] = spent.get(row[8], 0) + 1
    rows = sorted((name, buckets[name] - k, now) for name, k in spent.items()
                  if name in buckets)
    if rows:
        conn.execute(SPEND_TOKENS, unnest_columns(rows))


# ------------------------------------------------------------------ the breaker


_CIRCUIT_OF = itemgetter(*CIRCUIT_COLUMNS)


def circuit_of(row: Any) -> Circuit:
    """The breaker's columns of an endpoint's row, as a Circuit."""
    return Circuit(*_CIRCUIT_OF(row))


def read_deliveries(conn: psycopg.Connection, items: list) -> psycopg.Cursor[Any] | None:
    """Inside a finish, its first read (sent, not waited for): each delivery
    among the items, with its marker and its endpoint's breaker (not locked).
    Only the ids that may be a delivery's are looked for: a queue's own jobs
    (most have no '@' in their ids) cost the finish no read."""
    ids = sorted({ticket["id"] for ticket, outcome, _, _ in items
                  if outcome is not None and may_be_delivery(ticket["id"])})
    return conn.execute(DELIVERIES_OF, (array_text(ids),)) if ids else None


def lock_circuits(conn: psycopg.Connection, items: list, now: int,
                  found: psycopg.Cursor[Any] | None,
                  ) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Inside a finish, before its keys and rows are locked: the endpoint of
    each delivery among the items (by id, from ``read_deliveries``), and the
    rows of the endpoints whose breaker the items' signals may change, locked
    in name order. A healthy endpoint's successes change nothing: its row is
    not locked."""
    rows = found.fetchall() if found is not None else []
    endpoints_of: dict[str, str] = {job_id: name for job_id, name, *_ in rows}
    if not endpoints_of:
        return {}, {}
    # a ticket whose job is leased to it no longer (by this read) finishes
    # stale: its signal moves nothing, and locks nothing
    leased = {(job_id, token, owner) for job_id, _, status, token, owner, *_ in rows
              if status == "leased"}
    live = [item for item in items if (item[0]["id"], item[0]["token"], item[0]["owner"])
            in leased]
    signals = _signals(live, None, endpoints_of)
    # an endpoint removed since its delivery was claimed has no breaker: no
    # row; each endpoint's row read once, however many of its deliveries
    circuits: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row[5] is not None and row[5] not in circuits:
            circuits[row[5]] = dict(zip(CIRCUIT_ROW, row[5:], strict=True))
    moving = []
    for name in sorted({name for name, _, _ in signals}):
        row = circuits.get(name)
        if row is None:
            continue
        mine = [signal for signal in signals if signal[0] == name]
        if row["circuit"] != "closed" or _stepped(row, mine, now) != circuit_of(row):
            moving.append(name)
    if not moving:
        return endpoints_of, {}
    return endpoints_of, {row["name"]: row for row in dicts(conn, LOCK_CIRCUITS, (moving,))}


def _signals(items: list, results: list | None,
             endpoints_of: dict[str, str]) -> list[tuple[str, str, Attempt]]:
    """What each delivery's attempt tells its endpoint's breaker (not a stale
    finish's: a sender whose lease ran out speaks of a time the breaker has
    moved past)."""
    signals = []
    for n, (ticket, outcome, _, seen) in enumerate(items):
        endpoint = endpoints_of.get(ticket["id"])
        if endpoint is None or (results is not None and results[n] is False):
            continue
        signal = signal_of(outcome, seen)
        if signal is not None:
            signals.append((endpoint, signal, seen))
    return signals


def _stepped(row: dict[str, Any], signals: list[tuple[str, str, Attempt]],
             now: int) -> Circuit:
    """The circuit of a row after these signals (unwritten)."""
    circuit = circuit_of(row)
    for _, signal, attempt in signals:
        circuit, _ = step(circuit, signal, attempt, now)
    return circuit


def judge_circuits(conn: psycopg.Connection, items: list, results: list,
                   endpoints_of: dict[str, str], rows: dict[str, dict[str, Any]],
                   now: int) -> None:
    """Inside the finish, its rows written: each locked endpoint's circuit
    stepped through its signals in order (lease.breaker.step); a change
    audited (actor "breaker", the evidence as the note), a circuit that
    closed making its endpoint's waiting deliveries due at once, an endpoint
    failing too long disabled."""
    signals = _signals(items, results, endpoints_of)
    for name, row in sorted(rows.items()):
        before = circuit_of(row)
        circuit = before
        for _, signal, attempt in (s for s in signals if s[0] == name):
            circuit, change = step(circuit, signal, attempt, now)
            if change is not None:
                audit(conn, name, now, change, [], circuit.why, BREAKER_ACTOR)
            if change == "closed":
                conn.execute(RELEASE_WAITING, {"now": now, "name": name})
        if circuit != before:
            conn.execute(WRITE_CIRCUIT, {"name": name, **{
                column: getattr(circuit, field)
                for column, field in zip(CIRCUIT_COLUMNS, CIRCUIT_FIELDS, strict=True)}})
        why = disabled_by(circuit, row["disable_after_ms"], now) if row["enabled"] else None
        if why is not None:
            conn.execute(AUTO_DISABLE, (why, name))
            audit(conn, name, now, "disable", ["enabled"], why[:500], BREAKER_ACTOR)


# ------------------------------------------------------------------ the operator


def endpoint_of(row: dict[str, Any], changes: dict[str, Any] | None = None) -> Endpoint:
    """The Endpoint a row holds, secrets and all (checked again: it was when
    written), with ``changes`` (checked by Endpoint.changed's rules): built
    once, so an endpoint whose CA file is gone can be given another one."""
    fields = {
        "url": row["url"], "ack": row["ack"], "ca_file": row["ca_file"],
        "secrets": tuple(row["secrets"]),
        "headers": tuple(tuple(pair) for pair in row["headers"]), "types": tuple(row["types"]),
        "max_in_flight": row["max_in_flight"], "rate": row["rate"], "burst": row["burst"],
        "insecure_http": row["insecure_http"], "enabled": row["enabled"],
        "disable_after_ms": row["disable_after_ms"]}
    if changes:
        return Endpoint(row["name"], **{**fields, **changed_fields(changes)})
    try:
        return Endpoint(row["name"], **fields)
    except ValueError as exc:  # a CA file gone since: say which endpoint
        raise EndpointError(f"endpoint {row['name']!r}: {exc}") from None


def _fields(endpoint: Endpoint) -> dict[str, Any]:
    return {"name": endpoint.name, "url": endpoint.url, "ack": endpoint.ack,
            "ca_file": endpoint.ca_file, "secrets": Jsonb(list(endpoint.secrets)),
            "headers": Jsonb([list(pair) for pair in endpoint.headers]),
            "types": Jsonb(list(endpoint.types)), "max_in_flight": endpoint.max_in_flight,
            "rate": endpoint.rate, "burst": endpoint.burst,
            "insecure_http": endpoint.insecure_http, "enabled": endpoint.enabled,
            "disable_after_ms": endpoint.disable_after_ms}


def audit(conn: psycopg.Connection, name: str, now: int, action: str, fields: Iterable[str],
          note: str | None, actor: str | None) -> None:
    conn.execute(AUDIT_ENDPOINT, (name, now, action, Jsonb(list(fields)), note, actor))


def add(conn: psycopg.Connection, endpoint: Endpoint, now: int, note: str | None,
        actor: str | None) -> None:
    if conn.execute(ADD_ENDPOINT, {**_fields(endpoint), "tokens": _full(endpoint), "now": now}
                    ).rowcount != 1:
        raise EndpointError(f"endpoint {endpoint.name!r} exists")
    audit(conn, endpoint.name, now, "add", [], note, actor)


def locked(conn: psycopg.Connection, name: str) -> dict[str, Any]:
    rows = dicts(conn, f"SELECT {ENDPOINT_COLUMNS}, tokens, refilled_ms FROM lease.endpoints"
                       " WHERE name = %s FOR UPDATE", (name,))
    if not rows:
        raise EndpointError(f"no endpoint named {name!r}")
    return rows[0]


def update(conn: psycopg.Connection, name: str, changes: dict[str, Any], now: int,
           note: str | None, actor: str | None) -> Endpoint:
    row = locked(conn, name)
    new = endpoint_of(row, changes)  # its checks never echo a secret or a header's value
    tokens, refilled = row["tokens"], row["refilled_ms"]
    if (new.rate, new.burst) != (row["rate"], row["burst"]):
        tokens, refilled = _full(new), now  # a new rate starts with a full bucket
    conn.execute(UPDATE_ENDPOINT, {**_fields(new), "tokens": tokens, "refilled_ms": refilled,
                                   "now": now})
    action = "update"
    if set(changes) == {"enabled"}:
        action = "enable" if new.enabled else "disable"
    audit(conn, name, now, action, sorted(changes), note, actor)
    return new


def _full(endpoint: Endpoint) -> float:
    return float(endpoint.burst or 0)


def public(row: dict[str, Any]) -> dict[str, Any]:
    """A read's endpoint: Endpoint.public()'s fields, from PUBLIC_COLUMNS,
    and its breaker's circuit."""
    shown = {name: value for name, value in row.items()
             if name not in CIRCUIT_COLUMNS and name != "saved"}
    return {**shown, "headers": list(row["headers"]), "types": list(row["types"]),
            "circuit": {"state": row["circuit"], "since_ms": row["circuit_since_ms"],
                        "why": row["circuit_why"], "failures": row["failures"],
                        "open_until_ms": row["open_until_ms"],
                        "paused_until_ms": row["paused_until_ms"],
                        "failing_since_ms": row["failing_since_ms"],
                        "attempts_saved": row["saved"]}}


def read_endpoints(conn: psycopg.Connection) -> list[dict[str, Any]]:
    return [public(row) for row in dicts(
        conn, f"SELECT {PUBLIC_COLUMNS} FROM lease.endpoints ORDER BY name")]


def read_configs(conn: psycopg.Connection, names: tuple[str, ...] | None) -> list[Endpoint]:
    rows = dicts(conn, f"SELECT {ENDPOINT_COLUMNS} FROM lease.endpoints"
                       " WHERE %(names)s::text[] IS NULL OR name = ANY(%(names)s::text[])"
                       " ORDER BY name", {"names": None if names is None else list(names)})
    unknown = set(names or ()) - {row["name"] for row in rows}
    if unknown:
        raise EndpointError(f"no endpoint named {', '.join(sorted(unknown))}")
    return [endpoint_of(row) for row in rows]


def read_stats(conn: psycopg.Connection) -> list[dict[str, Any]]:
    retried: dict[str, int] = dict(conn.execute(ENDPOINT_RETRIED).fetchall())
    errors = {endpoint: {"error": error, "http_status": status, "at_ms": at}
              for endpoint, error, status, at in conn.execute(ENDPOINT_LAST_ERROR)}
    counts = {row["name"]: row for row in dicts(conn, ENDPOINT_STATS)}
    dead: dict[str, dict[str, int]] = {}
    for name, reason, n in conn.execute(ENDPOINT_DEAD):
        dead.setdefault(name, {})[reason] = n
    return [{**endpoint, "ready": counts[endpoint["name"]]["ready"],
             "in_flight": counts[endpoint["name"]]["in_flight"],
             "done": counts[endpoint["name"]]["done"],
             "dead": counts[endpoint["name"]]["dead"],
             "retried": retried.get(endpoint["name"], 0),
             "last_error": errors.get(endpoint["name"]),
             "last_success_ms": counts[endpoint["name"]]["last_success_ms"],
             "dead_by_reason": dead.get(endpoint["name"], {})}
            for endpoint in read_endpoints(conn)]


def read_audit(conn: psycopg.Connection, name: str | None) -> list[dict[str, Any]]:
    return [{**row, "fields": list(row["fields"])}
            for row in dicts(conn, ENDPOINT_AUDIT, {"name": name})]
