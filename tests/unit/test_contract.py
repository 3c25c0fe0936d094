"""Tier 2: the contract of each DB function, on real queue files.

Every invalid input is a ValueError that leaves the file byte-for-byte
unchanged; every success path checks whole rows; every boundary at equality.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from lease import worker
from lease.worker import MAX_NOW_MS, Conflict
from tests.support.queues import T0, add, job, rows


class StrSub(str):
    pass


class DictSub(dict):
    pass


def ident_bads() -> list:
    return ["", "a" * 65, "abc\n", "\nabc", "ab c", "é", "snack\u00e9", "ａｂｃ", "a/b", "a.b",
            StrSub("abc"), 1, None, b"abc", True]


def int_bads(low: int, high: int) -> list:
    return [True, False, float(low), float(high), str(low), None, low - 1, high + 1]


NOW_BADS = int_bads(0, MAX_NOW_MS)
FAULT_BADS = ["after-claim", 1]


def ticket_of(con: sqlite3.Connection, job_id: str) -> dict:
    row = job(con, job_id)
    return {"id": row["id"], "qty": row["qty"], "owner": row["owner"], "token": row["token"],
            "attempt": row["attempts"], "lease_until": row["lease_until"]}


@pytest.fixture
def seeded(con: sqlite3.Connection, queue_path: Path):
    """A queue with one job in each state; returns (con, path, live ticket)."""
    add(con, "p-1", 3)
    add(con, "l-1", 4)
    add(con, "d-1", 5)
    add(con, "x-1", 6, max_attempts=1)
    ticket = worker.claim(con, "owner-a", T0, 1000)  # p-1
    assert ticket is not None and ticket["id"] == "p-1"
    worker.finish(con, ticket, "ok", T0 + 1)
    live = worker.claim(con, "owner-a", T0, 1000)  # l-1
    dead = worker.claim(con, "owner-b", T0, 1000)  # d-1
    assert live and dead
    worker.finish(con, dead, "permanent", T0 + 1)
    return con, queue_path, live


def assert_rejected(path: Path, con: sqlite3.Connection, call) -> None:
    before = path.read_bytes()
    with pytest.raises(ValueError):
        call()
    assert not con.in_transaction
    assert path.read_bytes() == before


# --------------------------------------------------------------------- open_queue


def test_open_queue_settings_and_schema(queue_path: Path):
    con = worker.open_queue(queue_path)
    try:
        assert con.isolation_level is None
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert con.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"jobs", "redrives"} <= names
        assert not con.in_transaction
    finally:
        con.close()


def test_open_queue_keeps_rows_across_reopen(queue_path: Path):
    con = worker.open_queue(queue_path)
    add(con, "keep-1", 9)
    worker.finish(con, worker.claim(con, "o", T0), "permanent", T0 + 1)
    worker.redrive(con, "keep-1", T0 + 2, 1000, "fixed")
    before = (rows(con), rows(con, "redrives"))
    con.close()
    con = worker.open_queue(queue_path)
    try:
        assert (rows(con), rows(con, "redrives")) == before
    finally:
        con.close()


@pytest.mark.parametrize("bad", ["", ":memory:", "file:x.db?mode=memory", 3, None, b"q.db"])
def test_open_queue_rejects_non_files(bad):
    with pytest.raises(ValueError):
        worker.open_queue(bad)


def test_open_queue_closes_on_init_failure(tmp_path: Path, monkeypatch):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a sqlite database at all" * 100)
    before = garbage.read_bytes()
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def spy(*args, **kwargs):
        opened.append(real_connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(worker.sqlite3, "connect", spy)
    with pytest.raises(sqlite3.DatabaseError):
        worker.open_queue(garbage)
    assert garbage.read_bytes() == before
    with pytest.raises(sqlite3.ProgrammingError):  # closed
        opened[0].execute("SELECT 1")


def test_open_queue_refuses_foreign_schema(tmp_path: Path):
    other = tmp_path / "other.db"
    raw = sqlite3.connect(other)
    raw.execute("CREATE TABLE jobs (id TEXT)")
    raw.commit()
    raw.close()
    before = other.read_bytes()
    with pytest.raises(ValueError, match="not a queue file"):
        worker.open_queue(other)
    assert other.read_bytes() == before


def test_open_queue_accepts_tables_made_from_the_spec_text(tmp_path: Path):
    path = tmp_path / "spec.db"
    raw = sqlite3.connect(path)
    raw.executescript(
        """CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token INTEGER NOT NULL,
  available_at INTEGER NOT NULL, deadline INTEGER NOT NULL,
  owner TEXT, lease_until INTEGER, reason TEXT);
CREATE TABLE redrives (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL);"""
    )
    raw.close()
    con = worker.open_queue(path)
    try:
        add(con, "a", 1)
        assert worker.claim(con, "o", T0)["id"] == "a"
    finally:
        con.close()


# --------------------------------------------------------------------- enqueue


ENQ_OK = ({"id": "new-1", "qty": 5}, T0, 1000, 3)


def enqueue_bad_cases() -> list:
    cases: list = []
    ev, now, ttl, mx = ENQ_OK
    for bad in ident_bads():
        cases.append(({"id": bad, "qty": 5}, now, ttl, mx))
    for bad in int_bads(1, 1000):
        cases.append(({"id": "new-1", "qty": bad}, now, ttl, mx))
    cases += [
        (DictSub(id="new-1", qty=5), now, ttl, mx),
        ({"id": "new-1"}, now, ttl, mx),
        ({"qty": 5}, now, ttl, mx),
        ({"id": "new-1", "qty": 5, "extra": 1}, now, ttl, mx),
        ([("id", "new-1"), ("qty", 5)], now, ttl, mx),
        (None, now, ttl, mx),
    ]
    cases += [(ev, bad, ttl, mx) for bad in NOW_BADS]
    cases += [(ev, now, bad, mx) for bad in int_bads(1, 60000)]
    cases += [(ev, now, ttl, bad) for bad in int_bads(1, 16)]
    return cases


@pytest.mark.parametrize("args", enqueue_bad_cases())
def test_enqueue_rejects(seeded, args):
    con, path, _ = seeded
    assert_rejected(path, con, lambda: worker.enqueue(con, *args))


def test_enqueue_inserts_whole_row(con):
    event = {"id": "snack-7", "qty": 7}
    assert worker.enqueue(con, event, T0, 5000, 4) is True
    assert event == {"id": "snack-7", "qty": 7}
    assert rows(con) == [{
        "seq": 1, "id": "snack-7", "qty": 7, "status": "pending", "attempts": 0,
        "max_attempts": 4, "token": 0, "available_at": T0, "deadline": T0 + 5000,
        "owner": None, "lease_until": None, "reason": None,
    }]
    assert not con.in_transaction


@pytest.mark.parametrize(
    "args",
    [({"id": "a" * 64, "qty": 1000}, MAX_NOW_MS, 60000, 16), ({"id": "_", "qty": 1}, 0, 1, 1),
     ({"id": "A-z_9", "qty": 500}, 0, 60000, 3)],
)
def test_enqueue_accepts_boundaries(con, args):
    assert worker.enqueue(con, *args) is True
    row = rows(con)[0]
    assert (row["id"], row["qty"], row["deadline"], row["max_attempts"]) == (
        args[0]["id"], args[0]["qty"], args[1] + args[2], args[3])


def test_enqueue_duplicate_keeps_whole_row(seeded):
    con, _, _ = seeded
    before = rows(con)
    assert worker.enqueue(con, {"id": "l-1", "qty": 4}, T0 + 500, 60000, 16) is False
    assert worker.enqueue(con, {"id": "d-1", "qty": 5}, T0 + 500, 1, 1) is False
    assert rows(con) == before


def test_enqueue_conflict_changes_nothing(seeded):
    con, path, _ = seeded
    before = path.read_bytes()
    event = {"id": "l-1", "qty": 5}
    with pytest.raises(Conflict):
        worker.enqueue(con, event, T0, 1000)
    assert event == {"id": "l-1", "qty": 5}
    assert path.read_bytes() == before
    assert not con.in_transaction


# --------------------------------------------------------------------- claim


def claim_bad_cases() -> list:
    cases: list = [(bad, T0, 1000, None) for bad in ident_bads()]
    cases += [("o", bad, 1000, None) for bad in NOW_BADS]
    cases += [("o", T0, bad, None) for bad in int_bads(1, 60000)]
    cases += [("o", T0, 1000, bad) for bad in FAULT_BADS]
    return cases


@pytest.mark.parametrize("args", claim_bad_cases())
def test_claim_rejects(con, queue_path, args):
    add(con, "c-1", 1, ttl=1)  # due for quarantine at T0 + 1: a bad call must not move it
    assert_rejected(queue_path, con, lambda: worker.claim(con, *args))


def test_claim_whole_row_and_ticket(con):
    add(con, "c-1", 2, ttl=5000)
    ticket = worker.claim(con, "owner-1", T0 + 10, 700)
    assert ticket == {"id": "c-1", "qty": 2, "owner": "owner-1", "token": 1, "attempt": 1,
                      "lease_until": T0 + 710}
    assert rows(con) == [{
        "seq": 1, "id": "c-1", "qty": 2, "status": "leased", "attempts": 1, "max_attempts": 3,
        "token": 1, "available_at": T0, "deadline": T0 + 5000, "owner": "owner-1",
        "lease_until": T0 + 710, "reason": None,
    }]


def test_claim_order_is_seq_not_id(con):
    add(con, "z", 1)
    add(con, "a", 1)
    assert worker.claim(con, "o", T0)["id"] == "z"
    assert worker.claim(con, "o", T0)["id"] == "a"
    assert worker.claim(con, "o", T0) is None


def test_claim_lease_capped_at_deadline(con):
    add(con, "c", 1, ttl=300)
    assert worker.claim(con, "o", T0 + 299, 1000)["lease_until"] == T0 + 300


def test_claim_available_at_boundary(con):
    add(con, "r", 1, ttl=60000)
    t = worker.claim(con, "o", T0)
    assert worker.finish(con, t, "retry", T0 + 1, 50) == "pending"
    assert worker.claim(con, "o", T0 + 50) is None  # available_at = T0 + 51
    again = worker.claim(con, "o", T0 + 51)
    assert again["token"] == 2 and again["attempt"] == 2


def test_claim_expired_lease_at_equality(con):
    add(con, "e", 1)
    first = worker.claim(con, "owner-a", T0, 100)
    assert worker.claim(con, "owner-b", T0 + 99) is None  # live
    second = worker.claim(con, "owner-b", T0 + 100)  # lease_until == now: expired
    assert (second["token"], second["attempt"], second["owner"]) == (2, 2, "owner-b")
    assert first["token"] == 1


def test_claim_quarantines_deadline_at_equality(con):
    add(con, "d", 1, ttl=100)
    add(con, "late", 1, ttl=101)
    ticket = worker.claim(con, "o", T0 + 100)
    assert ticket["id"] == "late" and ticket["lease_until"] == T0 + 101
    dead = job(con, "d")
    assert (dead["status"], dead["reason"], dead["owner"], dead["lease_until"]) == (
        "dead", "deadline", None, None)


def test_claim_quarantine_reasons(con):
    add(con, "ex", 1, max_attempts=1, ttl=1000)
    add(con, "both", 1, max_attempts=1, ttl=1000)
    t1 = worker.claim(con, "o", T0, 100)
    t2 = worker.claim(con, "o", T0, 100)
    assert t1 and t2
    before = {r["id"]: r for r in rows(con)}
    assert worker.claim(con, "o", T0 + 100) is None  # ex: leases expired, budget used
    assert job(con, "ex") == {**before["ex"], "status": "dead", "reason": "exhausted",
                              "owner": None, "lease_until": None}
    con.execute("UPDATE jobs SET status='leased', reason=NULL, owner='o', lease_until=? "
                "WHERE id='both'", (T0 + 100,))
    assert worker.claim(con, "o", T0 + 1000) is None
    assert job(con, "both")["reason"] == "deadline"  # deadline wins over exhausted


def test_claim_commits_quarantine_when_nothing_to_hand_out(con, queue_path):
    add(con, "gone", 1, ttl=10)
    calls: list[str] = []
    assert worker.claim(con, "o", T0 + 10, fault=calls.append) is None
    assert calls == []
    other = sqlite3.connect(queue_path)
    try:
        assert other.execute("SELECT status, reason FROM jobs").fetchone() == ("dead", "deadline")
    finally:
        other.close()


def test_claim_never_touches_a_live_lease(con):
    add(con, "live", 1, max_attempts=1, ttl=1000)
    ticket = worker.claim(con, "o", T0, 500)
    before = rows(con)
    assert worker.claim(con, "p", T0 + 499) is None
    assert rows(con) == before
    assert worker.finish(con, ticket, "ok", T0 + 499) == "done"


def test_pending_not_yet_available_is_still_quarantined(con):
    add(con, "w", 1, ttl=1000)
    t = worker.claim(con, "o", T0)
    assert worker.finish(con, t, "retry", T0 + 1, 500) == "pending"  # available_at T0 + 501
    con.execute("UPDATE jobs SET deadline = ? WHERE id = 'w'", (T0 + 300,))
    assert worker.claim(con, "o", T0 + 300) is None
    assert job(con, "w")["status"] == "dead" and job(con, "w")["reason"] == "deadline"


# --------------------------------------------------------------------- finish


def ticket_bads(ticket: dict) -> list:
    bads: list = [DictSub(ticket), {k: v for k, v in ticket.items() if k != "attempt"},
                  {**ticket, "extra": 1}, None, list(ticket.items())]
    for key in ("id", "owner"):
        bads += [{**ticket, key: bad} for bad in ident_bads()]
    for key, (low, high) in {"qty": (1, 1000), "token": (1, 10**15), "attempt": (1, 16),
                             "lease_until": (1, 10**15)}.items():
        bads += [{**ticket, key: bad} for bad in int_bads(low, high)]
    return bads


def test_finish_rejects(seeded):
    con, path, live = seeded
    snapshot = dict(live)
    cases: list = [(bad, "ok", T0 + 1, 0, None) for bad in ticket_bads(live)]
    cases += [(live, bad, T0 + 1, 0, None)
              for bad in ["OK", "done", "", StrSub("ok"), None, 1, "retry\n"]]
    cases += [(live, "ok", bad, 0, None) for bad in NOW_BADS]
    cases += [(live, "retry", T0 + 1, bad, None) for bad in int_bads(0, 60000)]
    cases += [(live, "ok", T0 + 1, 0, bad) for bad in FAULT_BADS]
    assert len(cases) > 60
    for args in cases:
        assert_rejected(path, con, lambda args=args: worker.finish(con, *args))
    assert live == snapshot
    assert worker.finish(con, live, "ok", T0 + 1) == "done"


@pytest.mark.parametrize(
    ("outcome", "delay", "now", "expected"),
    [
        ("ok", 0, T0 + 5, {"status": "done", "reason": None, "available_at": T0 + 5}),
        ("ok", 900, T0 + 5, {"status": "done", "reason": None, "available_at": T0 + 5}),
        ("permanent", 30, T0 + 5, {"status": "dead", "reason": "permanent",
                                   "available_at": T0 + 5}),
        ("retry", 30, T0 + 5, {"status": "pending", "reason": "retry", "available_at": T0 + 35}),
        ("retry", 0, T0 + 5, {"status": "pending", "reason": "retry", "available_at": T0 + 5}),
        # deadline is T0 + 2000: now + delay == deadline is dead
        ("retry", 1995, T0 + 5, {"status": "dead", "reason": "deadline", "available_at": T0 + 5}),
        ("retry", 1994, T0 + 5, {"status": "pending", "reason": "retry",
                                 "available_at": T0 + 1999}),
    ],
)
def test_finish_whole_row(con, outcome, delay, now, expected):
    add(con, "f", 8, ttl=2000)
    ticket = worker.claim(con, "owner-1", T0, 1000)
    before = job(con, "f")
    assert worker.finish(con, ticket, outcome, now, delay) == expected["status"]
    assert job(con, "f") == {**before, **expected, "owner": None, "lease_until": None}
    assert not con.in_transaction


def test_finish_retry_on_last_attempt_is_exhausted(con):
    add(con, "f", 1, max_attempts=2)
    t = worker.claim(con, "o", T0)
    assert worker.finish(con, t, "retry", T0 + 1) == "pending"
    t = worker.claim(con, "o", T0 + 1)
    assert worker.finish(con, t, "retry", T0 + 2) == "dead"
    assert job(con, "f")["reason"] == "exhausted"
    assert job(con, "f")["attempts"] == 2 and job(con, "f")["token"] == 2


def test_finish_stale_markers(seeded):
    con, path, live = seeded
    before = path.read_bytes()
    stale = [{**live, "qty": live["qty"] + 1}, {**live, "owner": "owner-b"},
             {**live, "token": live["token"] + 1}, {**live, "attempt": live["attempt"] + 1},
             {**live, "lease_until": live["lease_until"] + 1},
             {**live, "lease_until": live["lease_until"] - 1},
             {**live, "id": "p-1"}, {**live, "id": "d-1"}, {**live, "id": "missing"}]
    calls: list[str] = []
    for ticket in stale:
        for outcome in ("ok", "retry", "permanent"):
            assert worker.finish(con, ticket, outcome, T0 + 1, 0, fault=calls.append) is False
    # late by 0 ms: now == lease_until
    assert worker.finish(con, live, "ok", live["lease_until"], fault=calls.append) is False
    assert calls == []
    assert path.read_bytes() == before
    assert worker.finish(con, live, "ok", live["lease_until"] - 1) == "done"
    assert worker.finish(con, live, "ok", live["lease_until"] - 1) is False  # not leased now


def test_finish_rejected_at_deadline(con):
    add(con, "f", 1, ttl=1000)
    t = worker.claim(con, "o", T0, 500)
    con.execute("UPDATE jobs SET deadline = ? WHERE id = 'f'", (T0 + 100,))
    assert worker.finish(con, t, "ok", T0 + 100) is False
    assert worker.finish(con, t, "ok", T0 + 99) == "done"


def test_finish_after_reclaim_by_another_owner(con):
    add(con, "f", 1)
    old = worker.claim(con, "owner-a", T0, 100)
    new = worker.claim(con, "owner-b", T0 + 100, 100)
    assert worker.finish(con, old, "ok", T0 + 150) is False
    assert worker.finish(con, {**old, "owner": "owner-b"}, "ok", T0 + 150) is False
    assert worker.finish(con, new, "ok", T0 + 150) == "done"
    assert worker.finish(con, old, "ok", T0 + 50) is False  # a done job is never overwritten
    assert job(con, "f")["status"] == "done" and job(con, "f")["token"] == 2


# --------------------------------------------------------------------- extend


def test_extend_moves_lease_keeps_token(con):
    add(con, "x", 1, ttl=5000)
    t = worker.claim(con, "o", T0, 1000)
    before = job(con, "x")
    t2 = worker.extend(con, t, T0 + 500, 1000)
    assert t2 == {**t, "lease_until": T0 + 1500}
    assert job(con, "x") == {**before, "lease_until": T0 + 1500}
    assert worker.finish(con, t, "ok", T0 + 600) is False  # the old ticket is stale now
    t3 = worker.extend(con, t2, T0 + 1400, 60000)
    assert t3["lease_until"] == T0 + 5000  # capped at the deadline
    assert worker.extend(con, t3, T0 + 4001, 1)["lease_until"] == T0 + 5000  # never backwards
    assert worker.finish(con, t3, "ok", T0 + 4999) == "done"


def test_extend_stale_and_boundaries(seeded):
    con, path, live = seeded
    before = path.read_bytes()
    calls: list[str] = []
    for ticket in ({**live, "token": 9}, {**live, "owner": "zz"}, {**live, "attempt": 2},
                   {**live, "qty": 1}, {**live, "lease_until": live["lease_until"] + 1},
                   {**live, "id": "p-1"}, {**live, "id": "nope"}):
        assert worker.extend(con, ticket, T0 + 1, 1000, fault=calls.append) is False
    assert worker.extend(con, live, live["lease_until"], 1000, fault=calls.append) is False
    assert calls == []
    assert path.read_bytes() == before
    for args in [(bad, T0 + 1, 1000) for bad in ticket_bads(live)] + \
                [(live, bad, 1000) for bad in NOW_BADS] + \
                [(live, T0 + 1, bad) for bad in int_bads(1, 60000)]:
        assert_rejected(path, con, lambda args=args: worker.extend(con, *args))
    assert worker.extend(con, live, live["lease_until"] - 1, 1000, fault=calls.append)
    assert calls == ["after-extend", "after-commit"]


# --------------------------------------------------------------------- redrive


def test_redrive_rejects(seeded):
    con, path, _ = seeded
    cases: list = [(bad, T0, 1000, "fix") for bad in ident_bads()]
    cases += [("d-1", T0, 1000, bad) for bad in ident_bads()]
    cases += [("d-1", bad, 1000, "fix") for bad in NOW_BADS]
    cases += [("d-1", T0, bad, "fix") for bad in int_bads(1, 60000)]
    cases += [("missing", T0, 1000, "fix"), ("l-1", T0, 1000, "fix"),
              ("p-1", T0, 1000, "fix"), ("x-1", T0, 1000, "fix")]
    for args in cases:
        assert_rejected(path, con, lambda args=args: worker.redrive(con, *args))
    assert_rejected(path, con, lambda: worker.redrive(con, "d-1", T0, 1000, "fix", fault="x"))


def test_redrive_whole_rows(seeded):
    con, _, _ = seeded
    before = job(con, "d-1")
    calls: list[str] = []
    assert worker.redrive(con, "d-1", T0 + 50, 900, "fixed-address", fault=calls.append) is True
    assert calls == ["after-audit", "after-redrive", "after-commit"]
    assert job(con, "d-1") == {**before, "status": "pending", "attempts": 0,
                               "available_at": T0 + 50, "deadline": T0 + 950, "owner": None,
                               "lease_until": None, "reason": None}
    assert rows(con, "redrives") == [{"seq": 1, "id": "d-1", "token": before["token"],
                                      "at_ms": T0 + 50, "note": "fixed-address"}]
    ticket = worker.claim(con, "o", T0 + 50)
    assert ticket["id"] == "d-1" and ticket["token"] == before["token"] + 1
    assert ticket["attempt"] == 1


# --------------------------------------------------------------------- fault points


def _prepare(con: sqlite3.Connection, name: str):
    """A queue ready for one call of `name`, and that call taking a fault hook."""
    add(con, "j", 2, ttl=5000)
    add(con, "k", 3, ttl=5000)
    if name == "enqueue":
        return lambda fault: worker.enqueue(con, {"id": "n", "qty": 1}, T0, 1000, fault=fault)
    if name == "claim":
        return lambda fault: worker.claim(con, "o", T0, 1000, fault=fault)
    ticket = worker.claim(con, "o", T0, 1000)
    if name == "finish":
        return lambda fault: worker.finish(con, ticket, "retry", T0 + 1, 10, fault=fault)
    if name == "extend":
        return lambda fault: worker.extend(con, ticket, T0 + 1, 2000, fault=fault)
    worker.finish(con, ticket, "permanent", T0 + 1)
    return lambda fault: worker.redrive(con, "j", T0 + 2, 1000, "fix", fault=fault)


POINTS = {
    "enqueue": ["after-enqueue", "after-commit"],
    "claim": ["after-claim", "after-commit"],
    "finish": ["after-finish", "after-commit"],
    "extend": ["after-extend", "after-commit"],
    "redrive": ["after-audit", "after-redrive", "after-commit"],
}


class Boom(Exception):
    pass


@pytest.mark.parametrize(("name", "point"), [(n, p) for n, ps in POINTS.items() for p in ps])
def test_fault_points(tmp_path: Path, name: str, point: str):
    # Reference: the same call with no fault, on its own file.
    ref = worker.open_queue(tmp_path / "ref.db")
    _prepare(ref, name)(None)
    after = (rows(ref), rows(ref, "redrives"))
    ref.close()

    con = worker.open_queue(tmp_path / "q.db")
    call = _prepare(con, name)
    before = (rows(con), rows(con, "redrives"))
    error = Boom(point)
    seen: list[str] = []

    def fault(where: str) -> None:
        seen.append(where)
        if where == point:
            raise error

    with pytest.raises(Boom) as raised:
        call(fault)
    assert raised.value is error  # the original exception, not a wrapper
    assert seen == POINTS[name][: POINTS[name].index(point) + 1]
    assert not con.in_transaction
    state = (rows(con), rows(con, "redrives"))
    assert state == (after if point == "after-commit" else before)
    con.close()


def test_keyboard_interrupt_in_hook_rolls_back(con):
    add(con, "j", 1)
    before = rows(con)

    def fault(where: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        worker.claim(con, "o", T0, fault=fault)
    assert rows(con) == before and not con.in_transaction


def test_open_transaction_is_refused_and_kept(con):
    add(con, "j", 1)
    con.execute("BEGIN")
    with pytest.raises(ValueError):
        worker.claim(con, "o", T0)
    assert con.in_transaction  # the caller's transaction is theirs to end
    con.execute("ROLLBACK")


def test_functions_never_close_the_connection(seeded):
    con, _, live = seeded
    worker.claim(con, "o", T0 + 5000)
    worker.finish(con, live, "ok", T0 + 1)
    with pytest.raises(ValueError):
        worker.claim(con, "", T0)
    assert con.execute("SELECT 1").fetchone()[0] == 1


def test_open_queue_needs_no_write_lock_when_complete(queue_path: Path):
    worker.open_queue(queue_path).close()
    holder = sqlite3.connect(queue_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process is writing
    try:
        con = worker.open_queue(queue_path)
        assert con.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
        con.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


@pytest.mark.parametrize(("statement", "index"), [
    (worker.PICK, "jobs_live"), (worker.QUARANTINE[0][1], "jobs_live_deadline"),
    (worker.QUARANTINE[1][1], "jobs_leased_until"),
    (worker.QUARANTINE[2][1], "jobs_pending_spent"),
])
def test_claim_reads_only_candidates_through_an_index(con, statement, index):
    plan = " ".join(str(r[3]) for r in con.execute(
        "EXPLAIN QUERY PLAN " + statement, {"now": T0, "limit": 1}))
    assert f"USING INDEX {index}" in plan


def test_quarantine_of_rows_written_by_other_means(con):
    """A pending row whose budget is already spent (only SQL from outside makes one)
    is quarantined as exhausted; a missed deadline still wins over the budget."""
    add(con, "spent", 1, max_attempts=2)
    add(con, "both", 1, max_attempts=2, ttl=10)
    con.execute("UPDATE jobs SET attempts = 2")
    assert worker.claim(con, "o", T0 + 10) is None
    assert [(r["id"], r["status"], r["reason"]) for r in rows(con)] == [
        ("spent", "dead", "exhausted"), ("both", "dead", "deadline")]


def test_the_returned_connection_is_left_as_sqlite3_makes_it(con):
    """Callers read it with plain tuples: no row factory is imposed on them."""
    add(con, "t", 4)
    assert con.row_factory is None
    assert con.execute("SELECT id, qty, status FROM jobs").fetchone() == ("t", 4, "pending")
    ticket = worker.claim(con, "o", T0)
    assert con.execute("SELECT status, owner FROM jobs").fetchall() == [("leased", "o")]
    assert worker.finish(con, ticket, "ok", T0 + 1) == "done"
    assert con.row_factory is None
