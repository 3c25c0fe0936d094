"""What the conformance suite compares: a queue as the store interface shows it.

Nothing here knows a store's tables. A queue is dumped through the interface
alone (every job's whole row and history, the dead letters, the snapshot),
so two stores' queues compare "row for row" whatever their engine.

A seq is the store's order, not a count: a PostgreSQL identity spends its
values in a transaction that rolls back, and a SQLite rowid may be taken
again after a delete. So seqs are compared as ranks (a job's place in the
queue, an audit row's place among all of its kind), and ``done_after`` (an
attempts row's seq, whose only meaning is where the delivering attempt sits in
the history) as the history's order itself.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from lease.policy import RetryPolicy
from lease.records import Attempt, Claimed
from lease.store import Store

STATUSES = ("pending", "leased", "done", "dead")


def body_event(job_id: str, **body: object) -> dict:
    return {"id": job_id, "body": body}


def job_rows(store: Store) -> list[dict[str, Any]]:
    """Every job's whole row, in the store's order, with its seq as a rank (1, 2, ...)."""
    found = sorted((row for status in STATUSES for row in store.jobs_with_status(status)),
                   key=lambda row: row["seq"])
    return [_ranked(row, rank) for rank, row in enumerate(found, 1)]


def _ranked(row: dict[str, Any], rank: int) -> dict[str, Any]:
    out = {**row, "seq": rank}
    out.pop("done_after", None)
    return out


def job(store: Store, job_id: str) -> dict[str, Any]:
    """One job's whole row (seq as the store gives it)."""
    history = store.job_history(job_id)
    assert history is not None, f"no job {job_id!r}"
    return history["job"]


def history(store: Store, job_id: str) -> dict[str, Any]:
    found = store.job_history(job_id)
    assert found is not None, f"no job {job_id!r}"
    return found


def dump(store: Store, now_ms: int) -> dict[str, Any]:
    """The whole queue through the interface: comparable across stores."""
    rows = job_rows(store)
    histories = {}
    audit_seqs: dict[str, list[int]] = {"redrives": [], "cancels": []}
    for row in rows:
        found = history(store, row["id"])
        histories[row["id"]] = found
        for kind, seqs in audit_seqs.items():
            seqs.extend(audit["seq"] for audit in found[kind])
    ranks = {kind: {seq: rank for rank, seq in enumerate(sorted(seqs), 1)}
             for kind, seqs in audit_seqs.items()}
    by_rank = {row["id"]: row["seq"] for row in rows}
    jobs = []
    for row in rows:
        found = histories[row["id"]]
        jobs.append({
            "job": row,
            "attempts": found["attempts"],
            **{kind: [{**audit, "seq": ranks[kind][audit["seq"]]} for audit in found[kind]]
               for kind in audit_seqs},
        })
    dead = [{**_ranked(row, by_rank[row["id"]])} for row in store.dead_jobs()]
    return {
        "jobs": jobs,
        "dead_jobs": dead,
        "counts": store.counts(),
        "is_drained": store.is_drained(),
        "is_idle": store.is_idle(),
        "blocked_heads": store.blocked_heads(),
        "stale_finishes": store.stale_finishes(),
        "snapshot": store.snapshot(now_ms),
    }


def plain(result: object) -> object:
    """A store's answer in a form that compares with ==: an exception as its
    class and words, a Claimed as its tuple, lists and tuples element-wise."""
    if isinstance(result, BaseException):
        return (type(result).__name__, str(result))
    if isinstance(result, Claimed):
        return ([tuple(job) for job in result.leased], result.moved, result.now_ms)
    if isinstance(result, list):
        return [plain(item) for item in result]
    if isinstance(result, tuple):
        return tuple(plain(item) for item in result)
    return result


def tickets_of(claimed: Claimed) -> list[dict]:
    return [job.ticket for job in claimed.leased]


def claim_one(store: Store, owner: str, now_ms: int, lease_ms: int = 30_000) -> dict:
    [leased] = store.claim_jobs(owner, lease_ms, now_ms=now_ms).leased
    return leased.ticket


def maybe_claim(store: Store, owner: str, now_ms: int,
                lease_ms: int = 30_000) -> dict | None:
    leased = store.claim_jobs(owner, lease_ms, now_ms=now_ms).leased
    return leased[0].ticket if leased else None


class Boom(Exception):
    """A fault hook's own exception: it must come out as it went in."""


def fault_at(point: str, seen: list | None = None):
    """A fault hook that raises Boom at ``point`` (and records every point it passes)."""

    def fault(where: str) -> None:
        if seen is not None:
            seen.append(where)
        if where == point:
            raise Boom(where)

    return fault


# ----------------------------------------------------------------- programs
#
# A program is a list of steps, each a tuple whose first item names the call.
# ``play`` runs one on a store, with its own clock value and the tickets it
# was handed (a step names a ticket by its index, modulo how many there are),
# and returns every answer, so two stores given the same program can be
# compared answer for answer and then row for row.

IDS = [f"j{n}" for n in range(6)] + ["order:7"]
OWNERS = ["host-a", "host-b"]


class Player:
    """Runs steps on one store; ``now`` and ``tickets`` carry over between steps."""

    def __init__(self, store: Store, now: int) -> None:
        self.store = store
        self.now = now
        self.tickets: list[dict] = []

    def play(self, steps: list[tuple]) -> list:
        return [plain(self.step(step)) for step in steps]

    def ticket(self, index: int) -> dict | None:
        return self.tickets[index % len(self.tickets)] if self.tickets else None

    def step(self, step: tuple) -> object:
        name, *args = step
        store, now = self.store, self.now
        if name == "advance":
            self.now += args[0]
            return self.now
        if name == "enqueue":
            events, ttl, max_attempts, later = args
            return store.enqueue_events(
                events, RetryPolicy(max_attempts=max_attempts, ttl_ms=ttl), now_ms=now,
                not_before_ms=now + later if later else None)
        if name == "claim":
            owner, lease, limit = args
            claimed = store.claim_jobs(owner, lease, limit, now_ms=now)
            self.tickets.extend(tickets_of(claimed))
            return claimed
        if name == "finish":
            items = []
            for index, outcome, delay, variant in args[0]:
                ticket = self.ticket(index)
                if ticket is not None:
                    items.append((stale_variant(ticket, variant), outcome, delay,
                                  evidence(now, outcome, delay)))
            return store.finish_jobs(items, now_ms=now)
        if name == "extend":
            index, lease = args
            ticket = self.ticket(index)
            if ticket is None:
                return None
            renewed = store.extend_lease(ticket, lease, now_ms=now)
            if isinstance(renewed, dict):
                self.tickets.append(renewed)
            return renewed
        if name == "redrive":
            return store.redrive_jobs(args[0], args[1], "redriven by the operator", now_ms=now)
        if name == "cancel":
            return store.cancel_jobs(args[0], "withdrawn", now_ms=now)
        if name == "prune":
            return store.prune_done(max(0, now - args[0]), args[1])
        raise AssertionError(f"no step {name!r}")


def stale_variant(ticket: dict, variant: int) -> dict:
    """The ticket itself (0), or one that differs in one part of its marker."""
    if variant == 1:
        return {**ticket, "token": ticket["token"] + 1}
    if variant == 2:
        return {**ticket, "owner": "host-z"}
    return ticket


def evidence(now: int, outcome: str | None, delay: int) -> Attempt:
    """What an attempt saw, varied by what it decided."""
    if outcome == "retry":
        return Attempt(now, delay % 7, 503, f"receiver answered 503 after {delay} ms")
    if outcome is None:
        return Attempt(now, 3, 200, "BadAck: the answer is not JSON")
    return Attempt(now, delay % 5, 200 if outcome == "ok" else 410)


def _events() -> st.SearchStrategy[list]:
    one = st.one_of(
        st.builds(lambda i, q: {"id": i, "qty": q}, st.sampled_from(IDS[:6]), st.integers(1, 2)),
        st.builds(lambda i, v: {"id": i, "body": {"v": v}}, st.sampled_from(IDS),
                  st.integers(1, 2)))
    return st.lists(one, min_size=1, max_size=5)


def steps() -> st.SearchStrategy[tuple]:
    """One step of a program: every call of the interface that changes a queue."""
    ids = st.lists(st.sampled_from(IDS), max_size=4)
    finishes = st.lists(st.tuples(st.integers(0, 30),
                                  st.sampled_from(["ok", "retry", "permanent", None]),
                                  st.sampled_from([0, 30, 400, 5000]),
                                  st.sampled_from([0, 0, 1, 2])),  # the ticket, or stale
                        min_size=1, max_size=4)
    return st.one_of(
        st.tuples(st.just("enqueue"), _events(), st.sampled_from([100, 1000, 60_000]),
                  st.sampled_from([1, 2, 5]), st.sampled_from([0, 0, 50])),
        st.tuples(st.just("claim"), st.sampled_from(OWNERS), st.sampled_from([50, 500, 5000]),
                  st.integers(1, 4)),
        st.tuples(st.just("finish"), finishes),
        st.tuples(st.just("extend"), st.integers(0, 30), st.sampled_from([10, 1000])),
        st.tuples(st.just("advance"), st.sampled_from([1, 10, 50, 100, 500, 2000])),
        st.tuples(st.just("redrive"), ids, st.sampled_from([100, 60_000])),
        st.tuples(st.just("cancel"), ids),
        st.tuples(st.just("prune"), st.sampled_from([0, 100, 10_000]), st.integers(1, 3)),
    )


def programs(max_size: int = 25) -> st.SearchStrategy[list]:
    return st.lists(steps(), max_size=max_size)
