"""The SQLite driver's endpoints: the fan-out at intake, the fair claim of
deliveries under each endpoint's cap and bucket, and the operator's changes.
The rules are ``lease.endpoints``'s; this module reads and writes rows."""

from __future__ import annotations

import functools
import json
import sqlite3
from collections import Counter
from collections.abc import Iterable
from typing import Any

from lease.breaker import (
    BREAKER_ACTOR,
    CIRCUIT_FIELDS,
    CLOSED,
    Circuit,
    claim_room,
    closed_circuit,
    disabled_by,
    step,
)
from lease.endpoints import (
    ALL,
    Endpoint,
    EndpointError,
    allowance,
    changed_fields,
    check_endpoint_name,
    delivery_id,
    key_of_line,
    line_key,
    refill,
    rotation_batch,
    round_robin,
    shares,
)
from lease.policy import Intake, RetryPolicy, check_actor, check_note
from lease.records import Attempt
from lease.rules import CIRCUIT_COLUMNS, conflict
from lease.sqlite import batch
from lease.sqlite.statements import (
    AUDIT_ENDPOINT,
    AUTO_DISABLE,
    CIRCUIT_OF,
    CONTENT_OF,
    DELETE_ENDPOINT,
    DUE_EACH,
    DUE_FIRST_EACH,
    ENDPOINT_COLUMNS,
    ENDPOINT_ROW,
    ENDPOINT_ROWS,
    HAS_WORK,
    INSERT_BODY,
    INSERT_DELIVERY,
    INSERT_ENDPOINT,
    LIVE_DELIVERIES,
    MESSAGE_CONTENT,
    PICK_FAIR,
    PICK_FAIR_NAMES,
    RELEASE_WAITING,
    RESET_BUCKET,
    ROTATE_ALL,
    ROTATED_EACH,
    ROTATED_ONE,
    ROTATION,
    ROTATION_NAMES,
    SUBSCRIBERS,
    UPDATE_ENDPOINT,
    WRITE_CIRCUIT,
)
from lease.worker import Conflict, select_rows, select_tuples

# How many batches of endpoints one claim takes from the rotation at most
# (lease.endpoints.rotation_batch doubles each): endpoints at their cap or in
# a backoff cannot make a claim read them all.
MAX_BATCHES = 6

# ------------------------------------------------------------------ intake


class Fanout:
    """One intake transaction's view of the endpoints: who subscribes to what.
    None when the queue has no endpoint: its events are jobs of its own, as
    before endpoints."""

    def __init__(self, rows: list) -> None:
        # by type: an intake of many events to many endpoints costs one
        # look-up an event, not one test per endpoint (lease.endpoints.subscribes)
        self.every: list[str] = []
        self.by_type: dict[str, list[str]] = {}
        for name, types in rows:
            for event_type in json.loads(types):
                (self.every if event_type == ALL else self.by_type.setdefault(
                    event_type, [])).append(name)
        self.touched: set[str] = set()

    @classmethod
    def of(cls, con: sqlite3.Connection | sqlite3.Cursor) -> Fanout | None:
        rows = con.execute(SUBSCRIBERS).fetchall()
        return cls(rows) if rows else None

    def insert(self, con: sqlite3.Connection | sqlite3.Cursor, intake: Intake,
               available_at: int, policy: RetryPolicy,
               trace: str | None = None) -> list[str] | None:
        """A message's deliveries, one per endpoint subscribed to its type:
        their ordering lines (None: the message is a duplicate, untouched).
        Conflict when its id is kept with other content. Each delivery keeps
        the intake's ``trace`` context (lease.tracing), its message's."""
        kept = con.execute(MESSAGE_CONTENT, (intake.id,)).fetchone()
        if kept is not None:
            qty, digest, line, event_type, endpoint = kept
            key = key_of_line(line, endpoint)
            if (qty, digest, key, event_type) != (intake.qty, intake.digest, intake.key,
                                                  intake.type):
                raise conflict(intake, qty, digest, key, event_type)
            return None
        names = sorted(self.every + self.by_type.get(intake.type, [])) \
            if intake.type is not None else self.every
        ids = [delivery_id(intake.id, name) for name in names]
        for job_id in ids:
            if con.execute(CONTENT_OF, (job_id,)).fetchone() is not None:
                raise Conflict(f"job {job_id!r} exists: event {intake.id!r} cannot fan out to "
                               f"an id the queue's own job has")
        lines = []
        for name, job_id in zip(names, ids, strict=True):
            self.touched.add(name)
            line = line_key(intake.key, name)
            con.execute(INSERT_DELIVERY, (
                job_id, intake.qty, policy.max_attempts, available_at,
                available_at + policy.ttl_ms, intake.digest, line, 0 if line is None else 1,
                name, intake.id, intake.type, trace, intake.priority))
            if intake.body is not None:
                con.execute(INSERT_BODY, (intake.body,))
            if line is not None:
                lines.append(line)
        return lines

    def write_work(self, con: sqlite3.Connection | sqlite3.Cursor) -> None:
        """The endpoints that got deliveries join the rotation."""
        has_work(con, self.touched)


def has_work(con: sqlite3.Connection | sqlite3.Cursor, names: Iterable[str]) -> None:
    con.executemany(HAS_WORK, [(name,) for name in sorted(set(names))])


# ------------------------------------------------------------------ the claim


def pick_deliveries(con: sqlite3.Connection, served: str | tuple[str, ...], now_ms: int,
                    limit: int) -> list[dict[str, Any]]:
    """Inside the claim's transaction: the deliveries to lease, the endpoints
    with work taking turns (the least recently served first), each one's
    within its allowance and its share of the claim
    (a turn: lease.endpoints.rotation_batch). Every endpoint examined goes to
    the back of the rotation, one with nothing left out of it, and a rate
    endpoint's bucket is spent by what it leases. A few statements, whatever
    the number of endpoints: one a batch of the rotation, one a round of
    equal shares, one read of the rows picked, one write of the endpoints."""
    only, names = _served_filter(served)
    sql = ROTATION.format(only=only)
    found: dict[str, list[int]] = {}
    order: list[str] = []
    buckets: dict[str, float] = {}
    probes: set[str] = set()
    leasing: set[str] = set()  # the endpoints with a live lease: they have work
    after: dict[str, Any] = {"served": -1, "name": ""}
    for n in range(MAX_BATCHES):
        batch_size = rotation_batch(limit - sum(map(len, found.values())), n)
        # dicts made straight from tuples: a sqlite3.Row reads a column by a
        # search of its names, and a claim reads a dozen of each endpoint's
        endpoints = [dict(zip(ROTATION_NAMES, row, strict=True)) for row in select_tuples(
            con, sql, {**names, **after, "now": now_ms, "limit": batch_size})]
        _read_circuits(con, [row for row in endpoints if not _plainly_closed(row)])
        if not endpoints:
            break
        after = {"served": endpoints[-1]["served_at"], "name": endpoints[-1]["name"]}
        leasing.update(row["name"] for row in endpoints if row["live"])
        rooms = {row["name"]: _room(row, now_ms, buckets, probes, found) for row in endpoints}
        order += [row["name"] for row in endpoints]
        _fill(con, rooms, found, limit - sum(map(len, found.values())), now_ms)
        if sum(map(len, found.values())) >= limit or len(endpoints) < batch_size:
            break
    picked = round_robin(found, order, limit)
    rows = _picked_rows(con, picked)
    idle = [name for name in order if not found[name] and name not in leasing]
    _rotated(con, order, rows, buckets, probes, idle, now_ms)
    return rows


def _room(row: dict[str, Any], now_ms: int, buckets: dict[str, float], probes: set[str],
          found: dict[str, list[int]]) -> int:
    """One endpoint's allowance for this claim (lease.endpoints.allowance) by
    its live leases, its bucket and its breaker, less its leases run out,
    which go in ``found`` first (the rotation's row counts the first and
    lists the others)."""
    name, live = row["name"], row["live"]
    tokens = None
    if row["rate"] is not None:
        tokens = refill(row["tokens"], row["refilled_ms"], now_ms, row["rate"], row["burst"])
        buckets[name] = tokens
    circuit = _CLOSED if _plainly_closed(row) else circuit_of(row)
    room, probe = claim_room(circuit, live, now_ms)
    if probe:
        probes.add(name)
    room = allowance(row, live, tokens, room)
    found[name] = _in_index_order(row["run_out"])[:room] if room > 0 else []
    return room - len(found[name])


def _plainly_closed(row: dict[str, Any]) -> bool:
    """Closed and not paused: claim_room reads nothing else of such a circuit,
    so one Circuit stands for them all (most of them; reading and building
    each one's cost more than the rest of the claim's look at its endpoint)."""
    return row["circuit"] == CLOSED and row["paused_until_ms"] is None


_CLOSED = closed_circuit()


def _read_circuits(con: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """The breaker's columns of these endpoints' rows, read into them."""
    if not rows:
        return
    marks = ", ".join("?" * len(rows))
    found = {row[0]: row for row in select_tuples(con, CIRCUIT_OF.format(marks=marks),
                                                   [row["name"] for row in rows])}
    for row in rows:
        # CIRCUIT_OF: name, enabled, disable_after_ms, then the breaker's columns
        row.update(zip(CIRCUIT_COLUMNS, found[row["name"]][3:], strict=True))


def _in_index_order(pairs: str | None) -> list[int]:
    """The seqs of a group_concat of "key seq" pairs, in (key, seq) order: the
    order of the index they were read by (an aggregate's order is SQLite's
    in fact, not by promise)."""
    if pairs is None:
        return []
    keyed = [tuple(map(int, pair.split(" "))) for pair in pairs.split(",")]
    keyed.sort()
    return [seq for _, seq in keyed]


def _fill(con: sqlite3.Connection, rooms: dict[str, int], found: dict[str, list[int]],
          wanted: int, now_ms: int) -> None:
    """Read each endpoint's due deliveries in equal shares of ``wanted``, and
    again from those that had more, until it is filled or none has any left.
    The endpoints still open in a round have all read the same number of rows
    (each got its whole share, or it is out), so a round is one statement:
    every endpoint's share at one offset."""
    read = 0
    while wanted > 0 and rooms:
        share = shares(rooms, wanted)
        if not share:
            break
        got = _due_each(con, list(share), max(share.values()), read, now_ms)
        for name, lim in share.items():
            due = got.get(name, [])[:lim]
            found[name] += due
            wanted -= len(due)
            rooms[name] = 0 if len(due) < lim else rooms[name] - len(due)
        read += max(share.values())
        rooms = {name: room for name, room in rooms.items() if room > 0}


_CHUNK = 64  # names, or rows, one statement takes: 4 x 64 stays under any SQLite's 999 variables


def _due_each(con: sqlite3.Connection, names: list[str], limit: int, offset: int,
              now_ms: int) -> dict[str, list[int]]:
    """Each endpoint's due deliveries, ``limit`` of them after ``offset``, in
    the order they became due; one statement for 64 endpoints."""
    got: dict[str, list[int]] = {}
    for start in range(0, len(names), _CHUNK):
        chunk = names[start:start + _CHUNK]
        size = _padded(len(chunk))
        sql = _due_first_sql(size) if limit == 1 else _due_sql(size)
        for name, seqs in con.execute(sql, [now_ms, limit, offset, *chunk,
                                            *[None] * (size - len(chunk))]):
            if name is None:
                continue
            if seqs is None:
                got[name] = []
            elif limit == 1:
                got[name] = [seqs]  # the one seq itself
            else:
                got[name] = [int(seq) for seq in seqs.split(",")]
    return got


def _picked_rows(con: sqlite3.Connection, picked: list[int]) -> list[dict[str, Any]]:
    """The rows of the deliveries picked, in one step, the higher priority
    first, then in seq order."""
    if not picked:
        return []
    rows = []
    for start in range(0, len(picked), _CHUNK):
        chunk = picked[start:start + _CHUNK]
        size = _padded(len(chunk))
        rows += batch.BATCH.read(con, PICK_FAIR_NAMES, _pick_sql(size),
                                 [*chunk, *[None] * (size - len(chunk))])
    rows.sort(key=batch.claim_order(PICK_FAIR_NAMES))
    return [dict(zip(PICK_FAIR_NAMES, row, strict=True)) for row in rows]


def _rotated(con: sqlite3.Connection, order: list[str], rows: list[dict[str, Any]],
             buckets: dict[str, float], probes: set[str], idle: list[str],
             now_ms: int) -> None:
    """Every endpoint examined to the back of the rotation (ROTATE_ALL); the
    ones with more to write in one more statement (ROTATED_EACH): out of the
    rotation if it has nothing left (``idle``: the ones this claim found
    nothing of, nor a lease), its bucket less one token a lease, its probe's
    circuit half-open."""
    for start in range(0, len(order), _CHUNK):
        names = order[start:start + _CHUNK]
        size = _padded(len(names))
        con.execute(_rotate_sql(size), [now_ms, *names, *[None] * (size - len(names))])
    leased = Counter(row["endpoint"] for row in rows)
    maybe_idle = set(idle)
    values = [(name, buckets[name] - leased[name] if name in buckets and leased[name] else None,
               int(name in probes and leased[name] > 0), int(name in maybe_idle))
              for name in order]
    values = [row for row in values if row[1] is not None or row[2] or row[3]]
    if not UPDATE_FROM:
        con.executemany(ROTATED_ONE, [(now_ms, tokens, probe, idle, name)
                                      for name, tokens, probe, idle in values])
        return
    for start in range(0, len(values), _CHUNK):
        chunk = values[start:start + _CHUNK]
        size = _padded(len(chunk))
        con.execute(_rotated_sql(size), [now_ms, *(value for row in chunk for value in row),
                                         *[None] * (4 * (size - len(chunk)))])


# UPDATE ... FROM is SQLite 3.33's; an older one writes those endpoints a row a step.
UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)


def _padded(n: int) -> int:
    """1, 2, 4 ... 64: seven shapes of each statement to cache, whatever the batch."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _due_sql(size: int) -> str:
    return DUE_EACH.format(names=", ".join(["(?)"] * size))


@functools.lru_cache(maxsize=8)
def _due_first_sql(size: int) -> str:
    return DUE_FIRST_EACH.format(names=", ".join(["(?)"] * size))


@functools.lru_cache(maxsize=8)
def _pick_sql(size: int) -> str:
    return PICK_FAIR.format(marks=", ".join("?" * size))


@functools.lru_cache(maxsize=8)
def _rotate_sql(size: int) -> str:
    return ROTATE_ALL.format(marks=", ".join("?" * size))


@functools.lru_cache(maxsize=8)
def _rotated_sql(size: int) -> str:
    return ROTATED_EACH.format(rows=", ".join(["(?, ?, ?, ?)"] * size))


def _served_filter(served: str | tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """The rotation narrowed to the endpoints a claim serves (none for all)."""
    if served == ALL:
        return "", {}
    names = {f"e{index}": name for index, name in enumerate(served)}
    return f"AND name IN ({', '.join(':' + key for key in names)})", names


# ------------------------------------------------------------------ the breaker


def circuit_of(row: Any) -> Circuit:
    """The breaker's columns of an endpoint's row, as a Circuit."""
    return Circuit(*(row[name] for name in CIRCUIT_COLUMNS))


def judge_circuits(con: sqlite3.Connection, signals: list[tuple[str, str, Attempt]],
                   now_ms: int) -> None:
    """Inside a finish's transaction: each attempt's signal (endpoint,
    "success" or "failure", its evidence), in order, stepped through its
    endpoint's breaker (lease.breaker.step); a circuit changed is written,
    its change audited (actor "breaker", the evidence as the note), and one
    that closed makes its endpoint's waiting deliveries due at once."""
    by_name: dict[str, list[tuple[str, Attempt]]] = {}
    for name, signal, attempt in signals:
        by_name.setdefault(name, []).append((signal, attempt))
    names = sorted(by_name)
    marks = ", ".join("?" * len(names))
    rows = {row["name"]: row for row in select_rows(con, CIRCUIT_OF.format(marks=marks), names)}
    for name in names:
        row = rows.get(name)
        if row is None:  # removed since its claim
            continue
        before = circuit = circuit_of(row)
        for signal, attempt in by_name[name]:
            circuit, change = step(circuit, signal, attempt, now_ms)
            if change is not None:
                _audit(con, name, now_ms, change, [], circuit.why, BREAKER_ACTOR)
            if change == "closed":
                con.execute(RELEASE_WAITING, {"now": now_ms, "name": name})
        if circuit != before:
            con.execute(WRITE_CIRCUIT, (*(getattr(circuit, field) for field in CIRCUIT_FIELDS),
                                        name))
        why = disabled_by(circuit, row["disable_after_ms"], now_ms) if row["enabled"] else None
        if why is not None:
            con.execute(AUTO_DISABLE, (why, name))
            _audit(con, name, now_ms, "disable", ["enabled"], why[:500], BREAKER_ACTOR)


# ------------------------------------------------------------------ the operator


def add_endpoint(con: sqlite3.Connection, endpoint: Endpoint, now_ms: int,
                 note: str | None, actor: str | None) -> None:
    """Inside a write transaction: a new endpoint, its bucket full, audited."""
    _check_audit(endpoint, note, actor)
    if con.execute(ENDPOINT_ROW, (endpoint.name,)).fetchone() is not None:
        raise EndpointError(f"endpoint {endpoint.name!r} exists")
    con.execute(INSERT_ENDPOINT, (*_endpoint_values(endpoint), _full(endpoint), now_ms,
                                  now_ms, now_ms))
    _audit(con, endpoint.name, now_ms, "add", [], note, actor)


def update_endpoint(con: sqlite3.Connection, name: str, changes: dict[str, Any], now_ms: int,
                    note: str | None, actor: str | None) -> Endpoint:
    """Inside a write transaction: the endpoint changed, checked whole, audited
    by the names of the fields changed; a new rate starts with a full bucket."""
    if type(changes) is not dict or not changes:
        raise ValueError("changes must be a non-empty dict of an endpoint's fields")
    row = endpoint_row(con, name)
    # built once, with the changes: an endpoint whose CA file is gone can be
    # given another one
    after = _configured(row, changes)
    _check_audit(after, note, actor)
    values = _endpoint_values(after)
    con.execute(UPDATE_ENDPOINT, (*values[1:], int(after.enabled), now_ms, name))
    if (after.rate, after.burst) != (row["rate"], row["burst"]):
        con.execute(RESET_BUCKET, (_full(after), now_ms, name))
    action = "update"
    if set(changes) == {"enabled"}:
        action = "enable" if after.enabled else "disable"
    _audit(con, name, now_ms, action, sorted(changes), note, actor)
    return after


def live_deliveries(con: sqlite3.Connection, name: str) -> list[tuple[str, str]]:
    """(id, status) of an endpoint's deliveries still to be sent."""
    return con.execute(LIVE_DELIVERIES, (name,)).fetchall()


def refuse_removal(name: str, live: list[tuple[str, str]], cancel_live: bool) -> list[str]:
    """Pure: the ids a removal cancels, or EndpointError when it cannot be."""
    leased = sum(1 for _, status in live if status == "leased")
    if live and not cancel_live:
        raise EndpointError(
            f"endpoint {name!r} has {len(live)} deliveries still to send ({leased} leased): "
            f"cancel them with the removal (cancel_live, --cancel-deliveries), or remove it "
            f"once they are delivered")
    if leased:
        raise EndpointError(f"endpoint {name!r} has {leased} deliveries on the wire now "
                            f"(leased): remove it once their leases end")
    return [job_id for job_id, _ in live]


def remove_endpoint(con: sqlite3.Connection, name: str, now_ms: int, note: str | None,
                    actor: str | None) -> None:
    """Inside a write transaction, its live deliveries cancelled already."""
    endpoint_row(con, name)
    con.execute(DELETE_ENDPOINT, (name,))
    _audit(con, name, now_ms, "remove", [], note, actor)


def endpoint_configs(con: sqlite3.Connection, names: Iterable[str] | None) -> list[Endpoint]:
    """The endpoints as the dispatcher needs them, secrets included."""
    rows = [dict(zip(ENDPOINT_COLUMNS, row, strict=True))
            for row in con.execute(ENDPOINT_ROWS)]
    if names is not None:
        wanted = {check_endpoint_name(name) for name in names}
        unknown = wanted - {row["name"] for row in rows}
        if unknown:
            raise EndpointError(f"no endpoint named {', '.join(sorted(unknown))}")
        rows = [row for row in rows if row["name"] in wanted]
    return [_configured(row) for row in rows]


def public_endpoints(con: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every endpoint as a read may show it: no secret, no header value."""
    return [public_row(dict(zip(ENDPOINT_COLUMNS, row, strict=True)))
            for row in con.execute(ENDPOINT_ROWS)]


def public_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"], "url": row["url"], "ack": row["ack"], "ca_file": row["ca_file"],
        "secrets": len(json.loads(row["secrets"])),
        "headers": [header for header, _ in json.loads(row["headers"])],
        "types": json.loads(row["types"]), "max_in_flight": row["max_in_flight"],
        "rate": row["rate"], "burst": row["burst"],
        "insecure_http": bool(row["insecure_http"]), "enabled": bool(row["enabled"]),
        "disable_after_ms": row["disable_after_ms"], "disabled_why": row["disabled_why"],
        "created_ms": row["created_ms"], "updated_ms": row["updated_ms"],
        "circuit": {"state": row["circuit"], "since_ms": row["circuit_since_ms"],
                    "why": row["circuit_why"], "failures": row["failures"],
                    "open_until_ms": row["open_until_ms"],
                    "paused_until_ms": row["paused_until_ms"],
                    "failing_since_ms": row["failing_since_ms"],
                    "attempts_saved": row["saved"]},
    }


def endpoint_row(con: sqlite3.Connection, name: str) -> dict[str, Any]:
    check_endpoint_name(name)
    row = con.execute(ENDPOINT_ROW, (name,)).fetchone()
    if row is None:
        raise EndpointError(f"no endpoint named {name!r}")
    return dict(zip(ENDPOINT_COLUMNS, row, strict=True))


def _configured(row: dict[str, Any], changes: dict[str, Any] | None = None) -> Endpoint:
    """The endpoint of a row (with ``changes``, checked by Endpoint.changed's rules)."""
    fields = {
        "url": row["url"], "ack": row["ack"], "ca_file": row["ca_file"],
        "secrets": tuple(json.loads(row["secrets"])),
        "headers": tuple(tuple(pair) for pair in json.loads(row["headers"])),
        "types": tuple(json.loads(row["types"])), "max_in_flight": row["max_in_flight"],
        "rate": row["rate"], "burst": row["burst"], "insecure_http": bool(row["insecure_http"]),
        "enabled": bool(row["enabled"]), "disable_after_ms": row["disable_after_ms"],
    }
    if changes:
        fields.update(changed_fields(changes))
        return Endpoint(row["name"], **fields)
    try:
        return Endpoint(row["name"], **fields)
    except ValueError as exc:  # a CA file gone since: say which endpoint
        raise EndpointError(f"endpoint {row['name']!r}: {exc}") from None


def _endpoint_values(endpoint: Endpoint) -> tuple:
    """The endpoint's columns in INSERT_ENDPOINT's order, up to ``enabled``."""
    return (endpoint.name, endpoint.url, endpoint.ack, endpoint.ca_file,
            json.dumps(list(endpoint.secrets)), json.dumps([list(p) for p in endpoint.headers]),
            json.dumps(list(endpoint.types)), endpoint.max_in_flight, endpoint.rate,
            endpoint.burst, int(endpoint.insecure_http), int(endpoint.enabled),
            endpoint.disable_after_ms)


def _full(endpoint: Endpoint) -> float:
    return float(endpoint.burst or 0)


def _check_audit(endpoint: Endpoint, note: str | None, actor: str | None) -> None:
    if not isinstance(endpoint, Endpoint):
        raise ValueError(f"endpoint must be an Endpoint, got {type(endpoint).__name__}")
    if note is not None:
        check_note(note)
    check_actor(actor)


def _audit(con: sqlite3.Connection, name: str, now_ms: int, action: str, fields: list[str],
           note: str | None, actor: str | None) -> None:
    con.execute(AUDIT_ENDPOINT, (name, now_ms, action, json.dumps(fields), note, actor))
