"""Bad input everywhere: only the documented exceptions come out, and nothing changes.

- every public function of the contract under Hypothesis-drawn arguments
  (wrong types, bool, huge ints, NaN/inf, unicode look-alikes, dict subclasses);
- the receiver under malformed HTTP (truncated bodies, wrong lengths, huge
  headers, a slow client) keeps serving others and commits no bad row;
- the CLI with hostile arguments.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncworker import send_http
from lease import worker
from lease.worker import MAX_NOW_MS, Conflict
from tests.support.queues import T0
from tests.support.servers import ReceiverProcess


class StrSub(str):
    pass


class DictSub(dict):
    pass


LOOKALIKES = ["snack\u20117", "\u0455nack-7", "snack-\uff17", "snack 7", "snack-7\n", "",
              "a" * 65, "snack\u200b7", "SNACK\u0130", StrSub("snack-7")]
IDENTS = st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
                   st.sampled_from(LOOKALIKES), st.text(max_size=70), st.integers(), st.none())
NUMBERS = st.one_of(st.integers(-10**20, 10**20), st.integers(0, 2000), st.booleans(),
                    st.floats(allow_nan=True, allow_infinity=True), st.none(),
                    st.text(max_size=4), st.just(10**400))
NOWS = st.one_of(st.integers(0, MAX_NOW_MS), NUMBERS)
EVENTS = st.one_of(
    st.fixed_dictionaries({"id": IDENTS, "qty": NUMBERS}),
    st.builds(lambda i, q: DictSub(id=i, qty=q), IDENTS, NUMBERS),
    st.fixed_dictionaries({"id": IDENTS, "qty": NUMBERS, "extra": st.integers()}),
    st.fixed_dictionaries({"id": IDENTS}), st.lists(st.integers(), max_size=2), st.none())
TICKETS = st.one_of(
    st.fixed_dictionaries({"id": IDENTS, "qty": NUMBERS, "owner": IDENTS, "token": NUMBERS,
                           "attempt": NUMBERS, "lease_until": NUMBERS}),
    st.builds(lambda d: DictSub(d), st.fixed_dictionaries({"id": IDENTS})), st.none())
OUTCOMES = st.one_of(st.sampled_from(["ok", "retry", "permanent", "OK", "done", ""]),
                     st.builds(StrSub, st.sampled_from(["ok"])), st.integers())

_TEMPLATE: dict[str, Path] = {}


def fresh_queue() -> Path:
    """A copy of a queue with a job in each state (made once, copied per example)."""
    if "path" not in _TEMPLATE:
        folder = Path(tempfile.mkdtemp())
        atexit.register(shutil.rmtree, folder, True)
        con = worker.open_queue(folder / "t.db")
        for job_id, qty in (("p", 1), ("l", 2), ("d", 3), ("x", 4)):
            worker.enqueue(con, {"id": job_id, "qty": qty}, T0, 60_000)
        worker.finish(con, worker.claim(con, "o", T0), "ok", T0 + 1)
        worker.claim(con, "o", T0)
        worker.finish(con, worker.claim(con, "o", T0), "permanent", T0 + 1)
        con.close()
        _TEMPLATE["path"] = folder / "t.db"
    target = Path(tempfile.mkdtemp()) / "q.db"
    shutil.copy(_TEMPLATE["path"], target)
    return target


CALLS = {
    "enqueue": st.tuples(EVENTS, NOWS, NUMBERS, NUMBERS),
    "claim": st.tuples(IDENTS, NOWS, NUMBERS),
    "finish": st.tuples(TICKETS, OUTCOMES, NOWS, NUMBERS),
    "extend": st.tuples(TICKETS, NOWS, NUMBERS),
    "redrive": st.tuples(IDENTS, NOWS, NUMBERS, IDENTS),
    "claim_many": st.tuples(IDENTS, NOWS, NUMBERS, NUMBERS),
    "finish_many": st.tuples(st.lists(st.tuples(TICKETS, OUTCOMES, NUMBERS), max_size=3),
                             NOWS),
    "enqueue_many": st.tuples(st.lists(EVENTS, max_size=3), NOWS, NUMBERS),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("name", sorted(CALLS))
def test_only_documented_exceptions_and_nothing_changes(name, data):
    args = data.draw(CALLS[name])
    path = fresh_queue()
    con = worker.open_queue(path)
    before = path.read_bytes()
    snapshot = repr(args)
    try:
        getattr(worker, name)(con, *args)
    except ValueError:
        assert path.read_bytes() == before, "a refused call changed the file"
    except Conflict:
        assert name == "enqueue"
        assert path.read_bytes() == before
    finally:
        assert not con.in_transaction
        con.close()
        shutil.rmtree(path.parent)
    assert repr(args) == snapshot, "an input was mutated"


@given(args=st.tuples(NUMBERS, NUMBERS, NUMBERS, NUMBERS))
def test_retry_delay_only_value_errors(args):
    try:
        got = worker.retry_delay(*args)
    except ValueError:
        return
    assert type(got) is int and 0 <= got <= 60_000
    assert not any(isinstance(a, bool) for a in args)
    assert not any(isinstance(a, float) and not math.isfinite(a) for a in args)


# ------------------------------------------------------------------ malformed HTTP


def raw(port: int, payload: bytes, *, read: bool = True, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        if not read:
            return b""
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def post(body: bytes, length: int | None = None, extra: str = "") -> bytes:
    length = len(body) if length is None else length
    return (f"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}Connection: close\r\n\r\n").encode() + body


def test_receiver_survives_malformed_http(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        port = int(rx.base.rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Le")  # and then nothing
        answers = {
            "truncated body": raw(port, post(b'{"id": "t1", "qty": 1}', length=100)[:-5]),
            "short length": raw(port, post(b'{"id": "t2", "qty": 1}', length=8)),
            "huge header": raw(port, post(b'{"id": "t3", "qty": 1}',
                                          extra=f"X-Big: {'a' * 100_000}\r\n")),
            "not http": raw(port, b"\x16\x03\x01\x02\x00garbage\r\n\r\n"),
            "bad length": raw(port, post(b'{"id": "t4", "qty": 1}', length=-1)),
            "huge chunked": raw(port, b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                      b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                + b"1000\r\n" + b"x" * 4096 + b"\r\n" + b"1000\r\n"
                                + b"y" * 4096 + b"\r\n0\r\n\r\n"),
        }
        # while the slow client still holds its connection, others are served
        assert asyncio.run(send_http(rx.url, {"id": "good", "qty": 5}, timeout=5)) is True
        slow.close()
        stats = rx.stats()
    for name, answer in answers.items():
        assert not answer.startswith(b"HTTP/1.1 200"), name
    con = sqlite3.connect(inbox)
    try:
        assert con.execute("SELECT id, qty FROM inbox").fetchall() == [("good", 5)]
    finally:
        con.close()
    assert stats["applied"] == 1 and stats["stock"] == 5


# ------------------------------------------------------------------ the CLI


HOSTILE = ["", "-", "--", "0", "-1", "1e3", "0x10", " 5", "５", "1_000", "true", "None",
           "snack\u20117", "a" * 65, "x\ny", "--qty", "\u0000", "9" * 30]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(job_id=st.sampled_from(HOSTILE + ["ok-id"]), qty=st.sampled_from(HOSTILE + ["7"]))
def test_cli_enqueue_with_hostile_arguments(tmp_path: Path, job_id: str, qty: str):
    if "\u0000" in job_id + qty:
        return  # an argv cannot carry a NUL byte
    queue = tmp_path / "q.db"
    if not queue.exists():
        worker.open_queue(queue).close()
    before = queue.read_bytes()
    # --id=VALUE: a value may itself start with '-' ("--" is a valid identifier)
    out = subprocess.run([sys.executable, "-m", "asyncworker", "enqueue", str(queue),
                          f"--id={job_id}", f"--qty={qty}"], capture_output=True, text=True,
                         timeout=60)
    valid = bool(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", job_id)) and bool(
        re.fullmatch(r"[0-9]+", qty)) and 1 <= int(qty) <= 1000
    assert "Traceback" not in out.stderr
    if valid:
        assert out.returncode == 0
    else:
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
        assert queue.read_bytes() == before
