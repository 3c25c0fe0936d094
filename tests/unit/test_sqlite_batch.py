"""A product file's claims and finishes run each batch in one SQLite statement
(``lease.sqlite.batch.OneStatement``), not a step per row: the rows, values and
results are exactly the contract's way (``lease.sqlite.batch.RowAtATime``), and the
number of statements a transaction runs does not grow with its batch."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from lease import worker
from lease.records import Attempt
from lease.sqlite import SQLiteStore
from lease.sqlite import batch as product
from tests.support.queues import T0

# lab events, payloads (with text JSON must escape) and ordered keys
EVENTS = (
    [{"id": f"lab-{i}", "qty": i + 1} for i in range(70)]
    + [{"id": f"pay-{i}", "body": {"note": f"caf\u00e9 \"{i}\"\n\u2603", "n": 2**53 + i}}
       for i in range(40)]
    + [{"id": f"key-{i}", "body": {"i": i}, "key": f"k{i % 3}"} for i in range(12)]
)


def table(path: Path, name: str) -> list:
    con = sqlite3.connect(path)
    try:
        return con.execute(f"SELECT * FROM {name} ORDER BY 1").fetchall()
    finally:
        con.close()


def workload(path: Path) -> list:
    """Claims of many sizes (one past a statement's 64 rows among them) and
    finishes of every kind: done, retried, permanent, stale, evidence only."""
    now = [T0]
    seen = []
    with SQLiteStore(path, create=True, clock=lambda: now[0]) as store:
        store.enqueue_events(EVENTS)
        for round_, limit in enumerate((1, 3, 100, 64, 7, 2, 200)):
            claimed = store.claim_jobs(f"owner-{round_}", 5_000, limit)
            tickets = [job.ticket for job in claimed.leased]
            seen.append([(job.ticket, job.body) for job in claimed.leased])
            outcomes = ("ok", "retry", "ok", "permanent", None, "ok")
            items = [(ticket, outcomes[i % len(outcomes)], 10 * i,
                      Attempt(claimed.now_ms, i, 200 + i % 3, None if i % 4 else "err"))
                     for i, ticket in enumerate(tickets)]
            if tickets:  # a ticket finished twice in one batch: the second is stale
                items.append((tickets[0], "ok", 0, Attempt(claimed.now_ms, 1)))
            seen.append(store.finish_jobs(items))
            now[0] += 6_000  # every lease still held has run out: the next claim takes it back
    return seen


def test_one_statement_and_a_row_at_a_time_leave_the_same_rows(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    assert isinstance(product.BATCH, product.OneStatement)  # this SQLite has what it needs
    fast = workload(tmp_path / "fast.db")
    monkeypatch.setattr(product, "BATCH", product.ROW_AT_A_TIME)
    slow = workload(tmp_path / "slow.db")
    assert fast == slow
    claims = [len(round_) for round_ in fast[::2]]
    assert sum(claims) > 150 and max(claims) > product._CHUNK, claims  # one past a statement
    for name in ("jobs", "attempts", "tallies"):
        assert table(tmp_path / "fast.db", name) == table(tmp_path / "slow.db", name), name


def statements_of(store: SQLiteStore, call) -> list:
    """The SQL statements ``call`` runs on the store's connection: each
    executemany row counts, as it is a step of its own."""
    ran: list = []
    store.connection.set_trace_callback(ran.append)
    try:
        call()
    finally:
        store.connection.set_trace_callback(None)
    return ran


@pytest.mark.parametrize("size", [1, 40])
def test_a_claim_and_its_finish_run_as_many_statements_for_40_jobs_as_for_one(
        tmp_path: Path, size: int):
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        store.enqueue_events([{"id": f"j-{i}", "qty": 1} for i in range(size)])
        claimed = []
        claim = statements_of(store, lambda: claimed.append(store.claim_jobs("o", 5_000, size)))
        leased = claimed[0].leased
        assert len(leased) == size
        finish = statements_of(store, lambda: store.finish_jobs(
            [(job.ticket, "ok", 0, Attempt(T0, 1)) for job in leased]))
        assert store.counts()["done"] == size
    # BEGIN, the pause's probe, the quarantine's probe, the pick, one UPDATE,
    # the owner's row (lease.rules, "the dispatchers at work"), COMMIT
    assert len(claim) == 7, claim
    # BEGIN, the marked rows, one UPDATE, the attempts' high mark, the lines' probe,
    # the minute's row (lease.rules, "the per-minute rollup"), COMMIT
    assert len(finish) == 7, finish


def test_a_row_json_cannot_carry_exactly_is_read_the_contract_way(tmp_path: Path):
    """A REAL (JSON's text of it may round) or a BLOB (JSON has none) in a
    row written by other means: the read falls back, and gives what the
    contract's read gives."""
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        store.enqueue_events([{"id": "real", "qty": 1}, {"id": "blob", "qty": 2},
                              {"id": "plain", "qty": 3}])
        con = store.connection
        con.execute("UPDATE jobs SET deadline = 0.30000000000000004 WHERE id = 'real'")
        con.execute("INSERT INTO bodies (seq, body) SELECT seq, x'00ff' FROM jobs"
                    " WHERE id = 'blob'")
        for ids in (["real", "plain"], ["blob", "plain"], ["plain"]):
            select = (f"SELECT {worker.MARKED}, bodies.body"
                      f" FROM jobs LEFT JOIN bodies USING (seq)"
                      f" WHERE id IN ({', '.join('?' * len(ids))})")
            names = (*worker.MARKED_NAMES, "body")
            fast = product.BATCH.read(con, names, select, ids)
            exact = product.ROW_AT_A_TIME.read(con, names, select, ids)
            assert [tuple(row) for row in fast] == exact
        assert exact == [tuple(row) for row in fast]  # the last: the JSON way itself
        assert type(fast[0]) is list


def test_bodies_are_read_beside_the_json_and_exactly(tmp_path: Path):
    """A claim's pick carries each payload as it is, not escaped inside the
    JSON: NULL, text with quotes and escapes, and a body holding the separator
    (written by other means), which falls back to the contract's read."""
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        store.enqueue_events([{"id": "lab", "qty": 1},
                              {"id": "pay", "body": {"q": "a \"quote\"\n\u2603", "n": [1, 2]}},
                              {"id": "odd", "body": {"x": 1}}])
        con = store.connection
        names = (*worker.MARKED_NAMES, "body")

        def both(ids: list) -> tuple:
            select = (f"SELECT {worker.MARKED}, bodies.body"
                      f" FROM jobs LEFT JOIN bodies USING (seq)"
                      f" WHERE id IN ({', '.join('?' * len(ids))}) ORDER BY seq")
            return ([tuple(row) for row in product.BATCH.read(con, names, select, ids)],
                    product.ROW_AT_A_TIME.read(con, names, select, ids))

        fast, exact = both(["lab", "pay"])
        assert fast == exact and exact[0][-1] is None and '\\"quote\\"' in exact[1][-1]
        ran = statements_of(store, lambda: both(["lab", "pay"]))
        assert len(ran) == 2  # one statement each way: the fast one did not fall back
        con.execute("UPDATE bodies SET body = 'a\x1eb' WHERE seq = (SELECT seq FROM jobs"
                    " WHERE id = 'odd')")
        fast, exact = both(["lab", "pay", "odd"])
        assert fast == exact and exact[2][-1] == "a\x1eb"
        assert len(statements_of(store, lambda: both(["odd"]))) == 3  # fell back, then exact
        for other in ("''", "x'7b7d'"):  # empty text; a BLOB whose bytes are UTF-8
            con.execute(f"UPDATE bodies SET body = {other} WHERE seq = (SELECT seq FROM jobs"
                        f" WHERE id = 'odd')")
            fast, exact = both(["lab", "odd"])
            assert fast == exact and exact[1][-1] in ("", b"{}"), other
            assert type(fast[1][-1]) is type(exact[1][-1]), other


def test_an_update_of_more_rows_than_a_statement_holds_writes_every_one(tmp_path: Path):
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        store.enqueue_events([{"id": f"j-{i}", "qty": 1} for i in range(150)])
        con = store.connection
        seqs = [seq for (seq,) in con.execute("SELECT seq FROM jobs ORDER BY seq")]
        ran = statements_of(store, lambda: product.BATCH.update(
            con, "reason = 'x'", ("owner", "lease_until"),
            [(f"o{seq}", seq * 10, seq) for seq in seqs[:130]]))
        assert len(ran) == 3  # 64 + 64 + 2 rows
        got = con.execute("SELECT seq, owner, lease_until, reason FROM jobs ORDER BY seq")
        assert [tuple(row) for row in got] == (
            [(seq, f"o{seq}", seq * 10, "x") for seq in seqs[:130]]
            + [(seq, None, None, None) for seq in seqs[130:]])


def test_an_older_sqlite_runs_a_row_at_a_time(monkeypatch: pytest.MonkeyPatch):
    assert product._one_statement_works()
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 32, 3))
    assert not product._one_statement_works()


def _seqs(store: SQLiteStore, n: int) -> list:
    store.enqueue_events([{"id": f"j-{i}", "qty": 1} for i in range(n)])
    return [seq for (seq,) in store.connection.execute("SELECT seq FROM jobs ORDER BY seq")]


def test_rows_that_set_the_same_values_are_written_by_seq_alone(tmp_path: Path):
    """A claim's fresh jobs all set the same values: one ``WHERE seq IN``
    statement a chunk of 64, not a join with VALUES."""
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        seqs = _seqs(store, 160)
        con = store.connection
        ran = statements_of(store, lambda: product.BATCH.update(
            con, "reason = 'x'", ("owner", "lease_until"),
            [("o", 7, seq) for seq in seqs[:150]]))
        assert len(ran) == 3 and all("WHERE seq IN" in sql for sql in ran), ran
        got = con.execute("SELECT owner, lease_until, reason FROM jobs ORDER BY seq")
        assert [tuple(row) for row in got] == [("o", 7, "x")] * 150 + [(None, None, None)] * 10


def test_each_set_of_values_gets_its_own_statement(tmp_path: Path):
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        seqs = _seqs(store, 40)
        con = store.connection
        rows = [("even" if seq % 2 == 0 else "odd", None, seq) for seq in seqs]
        ran = statements_of(store, lambda: product.BATCH.update(
            con, "reason = 'x'", ("owner", "lease_until"), rows))
        assert len(ran) == 2 and all("WHERE seq IN" in sql for sql in ran), ran
        got = con.execute("SELECT seq, owner, lease_until FROM jobs ORDER BY seq")
        assert [tuple(row) for row in got] == [row[::-1][:1] + row[:2] for row in rows]


def test_equal_values_of_other_types_are_not_written_as_one(tmp_path: Path):
    """1, 1.0 and True are equal in Python; each row keeps its own type."""
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        seqs = _seqs(store, 12)
        con = store.connection
        given = (1, 1.0, True)
        ran = statements_of(store, lambda: product.BATCH.update(
            con, "owner = 'x'", ("reason",),
            [(given[i % 3], seq) for i, seq in enumerate(seqs)]))
        assert len(ran) == 3 and all("WHERE seq IN" in sql for sql in ran), ran
        got = con.execute("SELECT reason FROM jobs ORDER BY seq")  # TEXT: 1 -> '1', 1.0 -> '1.0'
        assert [text for (text,) in got] == ["1", "1.0", "1"] * 4


def test_rows_of_many_values_are_joined_with_values(tmp_path: Path):
    with SQLiteStore(tmp_path / "q.db", create=True, clock=lambda: T0) as store:
        seqs = _seqs(store, 40)
        con = store.connection
        # 11 sets of values among 40 rows: more than a quarter, so a join
        rows = [("o", seq % 11, seq) for seq in seqs]
        ran = statements_of(store, lambda: product.BATCH.update(
            con, "reason = 'x'", ("owner", "lease_until"), rows))
        assert len(ran) == 1 and "FROM (VALUES" in ran[0], ran
        got = con.execute("SELECT owner, lease_until FROM jobs ORDER BY seq")
        assert [tuple(row) for row in got] == [row[:2] for row in rows]
