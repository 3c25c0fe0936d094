"""The PostgreSQL driver's endpoints (``lease.endpoints``): the intake's
fan-out, the claim of deliveries, the operator's changes and the reads.

The rules are ``lease.endpoints``'s; what is here is how the rows are locked.
An endpoint's row is the lock of its caps: a claim locks the rows of the
endpoints with a cap or a rate (FOR UPDATE, in name order) before it counts
their live leases and reads their buckets, so at READ COMMITTED (each
statement a new snapshot) it counts the leases of every claim before it, and
none after it can count before it commits. Lock order, everywhere: endpoint
rows (by name), then the keys' advisory locks, then job rows (by seq); a
claim takes its endpoints' locks before its quarantine locks any row.

An intake into a queue with endpoints locks every endpoint's row (it moves
their next ranks): such intakes run one after another, and a claim of a
limited endpoint waits for the intake in flight to commit (with
``enqueue_in``, for the service's transaction: keep it short).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
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
    claim_window,
    delivery_id,
    fair_pick,
    fair_rank,
    key_of_line,
    line_key,
    refill,
)
from lease.policy import Intake, RetryPolicy
from lease.postgres.reads import dicts
from lease.postgres.statements import (
    ADD_ENDPOINT,
    AUDIT_ENDPOINT,
    AUTO_DISABLE,
    CIRCUITS,
    CONTENTS,
    ENDPOINT_AUDIT,
    ENDPOINT_COLUMNS,
    ENDPOINT_LAST_ERROR,
    ENDPOINT_RETRIED,
    ENDPOINT_STATS,
    ENDPOINTS_FOR_INTAKE,
    ENDPOINTS_OF,
    HALF_OPEN,
    INSERT_NEW,
    LEASE_PICKED,
    LIVE,
    LOCK_CIRCUITS,
    LOCK_KEYS,
    LOCK_LIMITED,
    LOCK_LIMITED_SKIP,
    MESSAGES,
    NEXT_RANKS,
    PROMOTE,
    PUBLIC_COLUMNS,
    RELEASE_WAITING,
    SPEND_TOKENS,
    UNLIMITED,
    UPDATE_ENDPOINT,
    VIRTUAL_TIME,
    WINDOW,
    WRITE_CIRCUIT,
)
from lease.records import Attempt, Leased
from lease.rules import CIRCUIT_COLUMNS, conflict
from lease.worker import Busy, Conflict

MAX_WINDOWS = 4  # windows a claim reads before it settles for fewer than its limit


def columns(rows: list[tuple]) -> list[list]:
    """Rows as columns, for a statement over unnest(...)."""
    return [list(column) for column in zip(*rows, strict=True)]


# ------------------------------------------------------------------ intake


@dataclass
class Fanout:
    """An intake's endpoints (locked for the transaction), their next ranks
    as the intake moves them, and the virtual time, read once."""

    every: list[str]  # the endpoints subscribed to every type
    by_type: dict[str, list[str]]  # the others, by the types they take
    next_rank: dict[str, int]
    virtual_time: int
    touched: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, conn: Any) -> Fanout | None:
        """None for a queue without endpoints: today's intake exactly."""
        found = conn.execute(ENDPOINTS_FOR_INTAKE).fetchall()
        if not found:
            return None
        row = conn.execute(VIRTUAL_TIME).fetchone()
        every: list[str] = []
        by_type: dict[str, list[str]] = {}
        for name, types, _ in found:
            for event_type in types:
                (every if event_type == ALL else by_type.setdefault(event_type, [])
                 ).append(name)
        return cls(every, by_type, {name: rank for name, _, rank in found}, int(row[0]))

    def subscribers(self, event_type: str | None) -> list[str]:
        """The endpoints an event of this type goes to, by name: one look-up
        an event, however many endpoints (lease.endpoints.subscribes)."""
        if event_type is None:
            return self.every
        return sorted(self.every + self.by_type.get(event_type, []))

    def rank(self, name: str) -> int:
        rank = fair_rank(self.next_rank[name], self.virtual_time)
        self.next_rank[name] = rank + 1
        self.touched.add(name)
        return rank

    def save(self, conn: Any) -> None:
        if self.touched:
            names = sorted(self.touched)
            conn.execute(NEXT_RANKS, (names, [self.next_rank[name] for name in names]))


def fan_out(conn: Any, chunk: list[Intake], available_at: int, policy: RetryPolicy,
            fan: Fanout) -> list:
    """Inside the intake: each event a message, per event True (its
    deliveries written, one per subscribed endpoint, maybe none), False (the
    message is kept with this content) or its Conflict. A delivery id too
    long is a ValueError: the whole intake refused, like any bad event."""
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
            in conn.execute(MESSAGES, (sorted({intake.id for intake in chunk}),))}
    taken = {job_id for job_id, *_ in conn.execute(
        CONTENTS, (sorted({d for _, _, ids in plans for d in ids}),))}
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
                         fan.rank(name)))
        results.append(True)
    if rows:
        inserted = conn.execute(INSERT_NEW, (
            policy.max_attempts, available_at, available_at + policy.ttl_ms,
            *columns(rows))).fetchall()
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


def pick_deliveries(conn: psycopg.Connection, served: str | tuple[str, ...], limit: int,
                    now: int) -> tuple[list[int], dict[str, dict[str, Any]]]:
    """Inside a claim, before it locks any job's row: the seqs of up to
    ``limit`` ready deliveries to the served endpoints, picked fairly within
    each endpoint's allowance, and the endpoints judged (the limited ones
    locked till the claim commits). No row the quarantine moves is ready
    (the readiness asks attempts < max_attempts and deadline > now), so
    picking first picks what picking after it would."""
    args: dict[str, Any] = {
        "now": now, "all": served == ALL, "names": [] if served == ALL else list(served),
        "window": claim_window(limit), "rank": -(2**63), "seq": 0}
    judged: dict[str, dict[str, Any]] = {}
    allowances: dict[str, int] = {}
    picked: list[int] = []
    for _ in range(MAX_WINDOWS):
        rows = conn.execute(WINDOW, args).fetchall()
        # judged a slice at a time (as the SQLite driver does): with many
        # endpoints in line, a claim locks about as many as it leases
        for start in range(0, len(rows), limit):
            part = rows[start:start + limit]
            new = sorted({endpoint for _, endpoint, _ in part} - set(judged))
            if new:
                found = _judge_endpoints(conn, new, now, wait=not judged)
                judged.update(found)
                allowances.update({name: found[name]["allowance"] if name in found else 0
                                   for name in new})
            picked += fair_pick(((seq, endpoint) for seq, endpoint, _ in part), allowances,
                                limit - len(picked))
            if len(picked) == limit:
                break
        if len(picked) == limit or len(rows) < args["window"]:
            break
        args["seq"], args["rank"] = rows[-1][0], rows[-1][2]
    return picked, judged


def lease_deliveries(conn: psycopg.Connection, picked: list[int],
                     judged: dict[str, dict[str, Any]], owner: str, lease_ms: int,
                     now: int) -> list[Leased]:
    """The picked deliveries leased (those another claim took meanwhile
    skipped), in fair order; each rate endpoint's bucket spent by what it
    leased."""
    if not picked:
        return []
    leased = conn.execute(LEASE_PICKED, {"seqs": picked, "now": now, "owner": owner,
                                         "lease_ms": lease_ms}).fetchall()
    _spend(conn, judged, leased, now)
    for name in sorted({row[8] for row in leased if judged[row[8]]["probe"]}):
        conn.execute(HALF_OPEN, {"now": now, "name": name})
    order = {seq: n for n, seq in enumerate(picked)}
    return [Leased({"id": job_id, "qty": qty, "owner": owner, "token": token,
                    "attempt": attempt, "lease_until": until}, body, digest, endpoint, message)
            for _, job_id, qty, token, attempt, until, body, digest, endpoint, message
            in sorted(leased, key=lambda row: order[row[0]])]


def _judge_endpoints(conn: psycopg.Connection, names: list[str], now: int,
                     wait: bool) -> dict[str, dict[str, Any]]:
    """These endpoints' rows, the limited ones locked, with their allowance
    (and the bucket's level at ``now``, and whether a lease is the breaker's
    probe). ``wait`` False: a limited endpoint another claim holds is left
    out (no allowance in this claim)."""
    limited = dicts(conn, LOCK_LIMITED if wait else LOCK_LIMITED_SKIP, (names,))
    locked = {row["name"] for row in limited}
    rows = limited + [row for row in dicts(conn, UNLIMITED, (names,))
                      if row["name"] not in locked]
    capped = sorted(row["name"] for row in limited
                    if row["max_in_flight"] is not None or row["circuit"] != "closed")
    live: dict[str, int] = dict(conn.execute(LIVE, (capped, now)).fetchall()) if capped else {}
    found = {}
    for row in rows:
        tokens = None if row["rate"] is None else refill(
            row["tokens"], row["refilled_ms"], now, row["rate"], row["burst"])
        row["level"] = tokens
        room, row["probe"] = claim_room(circuit_of(row), live.get(row["name"], 0), now)
        row["allowance"] = allowance(row, live.get(row["name"], 0), tokens, room)
        found[row["name"]] = row
    return found


def _spend(conn: psycopg.Connection, judged: dict[str, dict[str, Any]], leased: list,
           now: int) -> None:
    """Each rate endpoint's bucket: its level now, less one token a lease."""
    spent: dict[str, int] = {}
    for row in leased:
        spent[row[8]] = spent.get(row[8], 0) + 1
    buckets = sorted((name, judged[name]["level"] - k, now) for name, k in spent.items()
                     if judged[name]["level"] is not None)
    if buckets:
        conn.execute(SPEND_TOKENS, columns(buckets))


# ------------------------------------------------------------------ the breaker


def circuit_of(row: Any) -> Circuit:
    """The breaker's columns of an endpoint's row, as a Circuit."""
    return Circuit(*(row[name] for name in CIRCUIT_COLUMNS))


def lock_circuits(conn: psycopg.Connection, items: list,
                  now: int) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Inside a finish, before its keys and rows are locked: the endpoint of
    each delivery among the items (by id), and the rows of the endpoints
    whose breaker the items' signals may change, locked in name order. A
    healthy endpoint's successes change nothing: its row is not locked."""
    ids = sorted({ticket["id"] for ticket, outcome, _, _ in items if outcome is not None})
    endpoints_of: dict[str, str] = \
        dict(conn.execute(ENDPOINTS_OF, (ids,)).fetchall()) if ids else {}
    if not endpoints_of:
        return {}, {}
    signals = _signals(items, None, endpoints_of)
    moving = []
    for row in dicts(conn, CIRCUITS, (sorted({name for name, _, _ in signals}),)):
        mine = [signal for signal in signals if signal[0] == row["name"]]
        if row["circuit"] != "closed" or _stepped(row, mine, now) != circuit_of(row):
            moving.append(row["name"])
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
    return [{**endpoint, "ready": counts[endpoint["name"]]["ready"],
             "in_flight": counts[endpoint["name"]]["in_flight"],
             "done": counts[endpoint["name"]]["done"],
             "dead": counts[endpoint["name"]]["dead"],
             "retried": retried.get(endpoint["name"], 0),
             "last_error": errors.get(endpoint["name"]),
             "last_success_ms": counts[endpoint["name"]]["last_success_ms"]}
            for endpoint in read_endpoints(conn)]


def read_audit(conn: psycopg.Connection, name: str | None) -> list[dict[str, Any]]:
    return [{**row, "fields": list(row["fields"])}
            for row in dicts(conn, ENDPOINT_AUDIT, {"name": name})]
