"""How the SQLite driver's transactions read and write the rows of a batch."""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Sequence

from lease.worker import (
    select_tuples,
)


class RowAtATime:
    """How a transaction reads and writes the rows of a batch: the contract's
    way, one SQLite step per row, on any SQLite. OneStatement runs a batch in
    one statement."""

    def read(self, con: sqlite3.Connection, names: tuple[str, ...], select: str,
             params: object) -> list:
        """The rows of ``select``, whose columns are ``names``, as sequences."""
        return select_tuples(con, select, params).fetchall()

    def update(self, con: sqlite3.Connection, fixed: str, names: tuple[str, ...],
               rows: list) -> None:
        """``UPDATE jobs SET fixed, names...`` per row of ``rows``: the values of
        ``names``, then the row's seq. The seqs are distinct."""
        sets = ", ".join([fixed, *(f"{name} = ?" for name in names)])
        con.executemany(f"UPDATE jobs SET {sets} WHERE seq = ?", rows)


ROW_AT_A_TIME = RowAtATime()


class _NotExact(Exception):
    """A REAL in a batch read: JSON's text of it may round, so it is read again
    the contract's way."""


def _no_float(text: str) -> float:
    raise _NotExact(text)


_CHUNK = 64  # rows one UPDATE statement writes: 64 x 9 values stay under any SQLite's limit


class OneStatement(RowAtATime):
    """A claim's and a finish's batch in one SQLite step a statement, not one a row.

    Why: the store's thread hands the GIL back to the event loop at every step
    and must take it again after, and while the loop is busy every take waits
    (CPython's GIL is not fair to the thread that asked). A claim or a finish
    of 25 jobs took about 55 steps a row at a time, and a few this way (what
    that bought is measured, dated, in ``docs/benchmarks-history.md``). A
    read is one row, the batch as JSON (its payloads beside it, unescaped); a
    write is one ``UPDATE ... FROM (VALUES ...)``, or, when most rows set the
    same values, one ``UPDATE ... WHERE seq IN (...)`` for each set of values.
    Same rows, same values: any row JSON cannot carry exactly (a BLOB, a REAL)
    is read the contract's way.
    """

    def read(self, con: sqlite3.Connection, names: tuple[str, ...], select: str,
             params: object) -> list:
        if names[-1] == "body":
            return self._read_with_bodies(con, names, select, params)
        columns = ", ".join(names)
        try:
            (text,) = select_tuples(con, f"SELECT json_group_array(json_array({columns}))"
                                   f" FROM ({select})", params).fetchone()
            rows: list = json.loads(text, parse_float=_no_float)
        except (sqlite3.OperationalError, _NotExact):
            return super().read(con, names, select, params)
        return _in_claim_order(names, rows)

    def _read_with_bodies(self, con: sqlite3.Connection, names: tuple[str, ...], select: str,
                          params: object) -> list:
        """A read whose last column is a payload: the other columns as JSON, the
        bodies beside them as they are, joined by a separator no JSON text holds
        unescaped (U+001E). Inside a JSON array each body would be escaped and
        unescaped again: 48 rows of 4 KB bodies full of quotes cost 101 us a row
        that way and 10 this way, and the store alone with 3.7 KB orders 180-195
        against 146-149 us a job. Both aggregates step through the same rows
        together. A body that is not text, or that holds the separator (written
        by other means), is read the contract's way."""
        columns = ", ".join(names[:-1])
        try:
            text, bodies, odd = select_tuples(
                con, f"SELECT json_group_array(json_array({columns})),"
                     f" group_concat(CASE WHEN body IS NULL THEN 'n' ELSE 'b' || body END,"
                     f" char(30)), total(typeof(body) NOT IN ('text', 'null')) FROM ({select})",
                params).fetchone()
            rows: list = json.loads(text, parse_float=_no_float)
        except (sqlite3.OperationalError, _NotExact):
            return super().read(con, names, select, params)
        parts = [] if bodies is None else bodies.split("\x1e")
        if odd or len(parts) != len(rows):
            return super().read(con, names, select, params)
        for row, part in zip(rows, parts, strict=True):  # "n": NULL, "b" and the body's text
            row.append(None if part == "n" else part[1:])
        return _in_claim_order(names, rows)

    def update(self, con: sqlite3.Connection, fixed: str, names: tuple[str, ...],
               rows: list) -> None:
        alike: dict[tuple, list] = {}
        for row in rows:
            sets = tuple(row[:-1])
            # with the types: 1, 1.0 and True are equal keys, but not the same value
            alike.setdefault((*sets, *map(type, sets)), []).append(row[-1])
        # A statement a group costs more than a VALUES row saves: only when
        # most rows share their values (a claim's fresh jobs, finishes of a burst).
        if len(alike) * 4 <= len(rows):
            for key, seqs in alike.items():
                self._update_alike(con, fixed, names, key[:len(names)], seqs)
            return
        width = len(names) + 1
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start:start + _CHUNK]
            size = _padded(len(chunk))
            values = [value for row in chunk for value in row]
            values += [None] * (width * (size - len(chunk)))  # seq NULL: a row matching none
            con.execute(_values_update(fixed, names, size), values)

    @staticmethod
    def _update_alike(con: sqlite3.Connection, fixed: str, names: tuple[str, ...],
                      values: tuple, seqs: list) -> None:
        """Rows that set the same values (a claim's fresh jobs, the outcomes of
        a finish that share their latency): one ``UPDATE ... WHERE seq IN
        (...)``, which SQLite runs with a quarter less work a row than a join
        with VALUES."""
        for start in range(0, len(seqs), _CHUNK):
            chunk = seqs[start:start + _CHUNK]
            size = _padded(len(chunk))
            con.execute(_alike_update(fixed, names, size),
                        [*values, *chunk, *[None] * (size - len(chunk))])  # NULL: no row


def _in_claim_order(names: tuple[str, ...], rows: list) -> list:
    """An aggregate keeps its select's order in fact, not by promise: rows
    led by their seq are put in its order, the claim's (the higher priority
    first, then seq) when they carry their priority."""
    if names[0] == "seq":
        rows.sort(key=claim_order(names))
    return rows


def claim_order(names: tuple[str, ...]) -> Callable[[Sequence], tuple[int, int]]:
    """The sort key of rows whose columns are ``names`` (seq first) in a
    claim's order: the higher priority first, then seq; seq alone without
    a priority column."""
    if "priority" not in names:
        return lambda row: (0, row[0])
    at = names.index("priority")
    return lambda row: (-row[at], row[0])


def _padded(n: int) -> int:
    """1, 2, 4 ... 64: seven statements' shapes to cache, whatever the batch."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=64)
def _alike_update(fixed: str, names: tuple[str, ...], size: int) -> str:
    sets = ", ".join([fixed, *(f"{name} = ?" for name in names)])
    return f"UPDATE jobs SET {sets} WHERE seq IN ({', '.join('?' * size)})"


@functools.lru_cache(maxsize=64)
def _values_update(fixed: str, names: tuple[str, ...], size: int) -> str:
    width = len(names) + 1
    sets = ", ".join([fixed, *(f"{name} = v.column{i}" for i, name in enumerate(names, 1))])
    row = "(" + ", ".join("?" * width) + ")"
    return (f"UPDATE jobs SET {sets} FROM (VALUES {', '.join([row] * size)}) AS v"
            f" WHERE jobs.seq = v.column{width}")


def _one_statement_works() -> bool:
    """UPDATE ... FROM is SQLite 3.33's; the JSON functions may be left out of a build."""
    if sqlite3.sqlite_version_info < (3, 33, 0):
        return False
    probe = sqlite3.connect(":memory:")
    try:
        return probe.execute("SELECT json_group_array(json_array(1, 'a'))").fetchone() == (
            '[[1,"a"]]',)
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


# How this product's claims and finishes read and write their rows.
BATCH: RowAtATime = OneStatement() if _one_statement_works() else ROW_AT_A_TIME


