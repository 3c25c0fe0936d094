"""The receiver: an aiohttp server whose inbox deduplicates by ID and quantity."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import re
import select
import signal
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncworker import Faults, make_app, send_http
from asyncworker.receiving.inbox import Arrival, Inbox, Kept, decide_group, read_inbox
from asyncworker.receiving.server import Limits, serve
from asyncworker.receiving.server import stats as receiver_stats
from lease import http as sync_http
from lease.worker import Permanent, Retryable
from tests.support.receiving import (
    FIRST_SCHEMA,
    FOREIGN,
    Running,
    folder_state,
    snapshot,
    sqlite_file,
)
from tests.support.servers import ReceiverProcess


def inbox_rows(inbox: Path) -> list[tuple]:
    con = sqlite3.connect(inbox)
    try:
        return con.execute("SELECT id, qty, seen, max_token FROM inbox ORDER BY id").fetchall()
    finally:
        con.close()


def stock(inbox: Path) -> int:
    con = sqlite3.connect(inbox)
    try:
        return con.execute("SELECT stock FROM effect").fetchone()[0]
    finally:
        con.close()


async def test_apply_duplicate_conflict(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert await rx.post({"id": "snack-7", "qty": 7}) == (
            200, {"id": "snack-7", "qty": 7, "status": "applied"})
        assert await rx.post({"id": "snack-7", "qty": 7}) == (
            200, {"id": "snack-7", "qty": 7, "status": "duplicate"})
        status, body = await rx.post({"id": "snack-7", "qty": 8})
        assert status == 409 and "qty 7, not 8" in body["error"]
        stats = await rx.stats()
        assert {k: stats[k] for k in ("process_requests", "applied", "duplicates", "conflicts",
                                      "stock", "inbox_rows", "process_rejected")} == {
            "process_requests": 3, "applied": 1, "duplicates": 1, "conflicts": 1, "stock": 7,
            "inbox_rows": 1, "process_rejected": 0}
    assert inbox_rows(tmp_path / "inbox.db") == [("snack-7", 7, 2, None)]


BAD_REQUESTS = [
    ("malformed json", b'{"id": "a", "qty":', "application/json", {}, 400, "not valid JSON"),
    ("not json", b"hello", "application/json", {}, 400, "not valid JSON"),
    ("empty body", b"", "application/json", {}, 400, "not valid JSON"),
    ("text/plain", b'{"id": "a", "qty": 1}', "text/plain", {}, 400, "content type"),
    ("no content type", b'{"id": "a", "qty": 1}', "", {}, 400, "content type"),
    ("form", b"id=a&qty=1", "application/x-www-form-urlencoded", {}, 400, "content type"),
    ("extra key", {"id": "a", "qty": 1, "x": 1}, "application/json", {}, 400, "exactly the keys"),
    ("missing qty", {"id": "a"}, "application/json", {}, 400, "exactly the keys"),
    ("missing id", {"qty": 1}, "application/json", {}, 400, "exactly the keys"),
    ("id empty", {"id": "", "qty": 1}, "application/json", {}, 400, "event id"),
    ("id 65 chars", {"id": "a" * 65, "qty": 1}, "application/json", {}, 400, "event id"),
    ("id newline", {"id": "a\n", "qty": 1}, "application/json", {}, 400, "event id"),
    ("id non-ascii", {"id": "é", "qty": 1}, "application/json", {}, 400, "event id"),
    ("id number", {"id": 7, "qty": 1}, "application/json", {}, 400, "event id"),
    ("qty 0", {"id": "a", "qty": 0}, "application/json", {}, 400, "event qty"),
    ("qty 1001", {"id": "a", "qty": 1001}, "application/json", {}, 400, "event qty"),
    ("qty true", {"id": "a", "qty": True}, "application/json", {}, 400, "event qty"),
    ("qty float", {"id": "a", "qty": 7.0}, "application/json", {}, 400, "event qty"),
    ("qty exponent", b'{"id": "a", "qty": 1e2}', "application/json", {}, 400, "event qty"),
    ("qty string", {"id": "a", "qty": "7"}, "application/json", {}, 400, "event qty"),
    ("qty NaN", b'{"id": "a", "qty": NaN}', "application/json", {}, 400, "NaN"),
    ("array", b'[{"id": "a", "qty": 1}]', "application/json", {}, 400, "must be a dict"),
    ("null", b"null", "application/json", {}, 400, "must be a dict"),
    ("duplicate keys", b'{"id": "a", "id": "b", "qty": 1}', "application/json", {}, 400,
     "duplicate key"),
    ("over 64 KiB", {"id": "a", "qty": 1, "pad": "x" * 66_000}, "application/json", {}, 413,
     "larger than 65536"),
    ("token letters", {"id": "a", "qty": 1}, "application/json", {"X-Lease-Token": "abc"}, 400,
     "X-Lease-Token"),
    ("token zero", {"id": "a", "qty": 1}, "application/json", {"X-Lease-Token": "0"}, 400,
     "X-Lease-Token"),
    ("token negative", {"id": "a", "qty": 1}, "application/json", {"X-Lease-Token": "-1"}, 400,
     "X-Lease-Token"),
    ("token fraction", {"id": "a", "qty": 1}, "application/json", {"X-Lease-Token": "1.5"}, 400,
     "X-Lease-Token"),
    ("token too big", {"id": "a", "qty": 1}, "application/json",
     {"X-Lease-Token": str(10**15 + 1)}, 400, "X-Lease-Token"),
    ("token of 5000 digits", {"id": "a", "qty": 1}, "application/json",
     {"X-Lease-Token": "9" * 5000}, 400, "X-Lease-Token"),
    ("token unicode digits", {"id": "a", "qty": 1}, "application/json",
     {"X-Lease-Token": "١٢"}, 400, "X-Lease-Token"),
]


async def test_bad_requests_never_touch_the_inbox(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox) as rx:
        assert (await rx.post({"id": "seed", "qty": 2}))[0] == 200
        before = snapshot(inbox)
        for name, body, ctype, headers, status, message in BAD_REQUESTS:
            got_status, got = await rx.post(body, content_type=ctype, headers=headers)
            assert (got_status, message in got.get("error", "")) == (status, True), (name, got)
            assert snapshot(inbox) == before, name
        stats = await rx.stats()
        assert stats["process_rejected"] + stats["process_too_large"] == len(BAD_REQUESTS)
        assert (stats["applied"], stats["inbox_rows"], stats["stock"]) == (1, 1, 2)
    assert len(BAD_REQUESTS) >= 20


async def test_a_stale_sender_is_acknowledged_as_a_duplicate_and_counted(tmp_path: Path):
    """A lower token with the same event is that event again (a superseded
    claim, or the id enqueued again after a prune): a duplicate ACK, no second
    effect, counted as a stale sender; with another event it is a conflict."""
    inbox = tmp_path / "inbox.db"
    async with Running(inbox) as rx:
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=5) is True
        status, answer = await rx.post(json.dumps({"id": "j", "qty": 3}),
                                       headers={"X-Lease-Token": "3"})
        assert (status, answer) == (200, {"id": "j", "qty": 3, "status": "duplicate"})
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=5) is True
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=7) is True
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5) is True  # no token
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=6) is True
        with pytest.raises(Permanent, match="applied with qty 3, not 4"):
            await send_http(rx.url, {"id": "j", "qty": 4}, timeout=5, token=1)
        stats = await rx.stats()
        assert (stats["stale_senders"], stats["applied"], stats["duplicates"],
                stats["conflicts"], stats["stock"]) == (2, 1, 3, 1, 3)
    assert inbox_rows(inbox) == [("j", 3, 4, 7)]  # the highest token kept, never lowered


async def test_group_commit_answers_after_one_commit(tmp_path: Path):
    inbox = await Inbox.open(tmp_path / "grouped.db", max_group=64)
    try:
        results = await asyncio.gather(*(inbox.deliver(f"g-{n % 4}", 1, None) for n in range(12)))
        assert [r.outcome for r in results] == ["applied"] * 4 + ["duplicate"] * 8
        assert inbox.commits == 1 and inbox.totals.stock == 4
    finally:
        await inbox.close()
    single = await Inbox.open(tmp_path / "single.db", max_group=1)
    try:
        await asyncio.gather(*(single.deliver(f"g-{n}", 1, None) for n in range(12)))
        assert single.commits == 12
    finally:
        await single.close()
    # Each answer came only after its COMMIT: the rows are on disk for a new connection.
    assert len(inbox_rows(tmp_path / "grouped.db")) == 4
    assert stock(tmp_path / "grouped.db") == 4


async def test_close_applies_what_was_queued(tmp_path: Path):
    inbox = await Inbox.open(tmp_path / "i.db")
    waiting = [asyncio.ensure_future(inbox.deliver(f"c-{n}", 2, None)) for n in range(5)]
    await asyncio.sleep(0)
    await inbox.close()
    assert [w.result().outcome for w in waiting] == ["applied"] * 5
    assert stock(tmp_path / "i.db") == 10


async def test_metrics_in_prometheus_text(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        await rx.post({"id": "m", "qty": 4})
        await rx.post({"id": "m", "qty": 4})
        async with rx.session.get(rx.base + "/metrics") as answer:
            assert answer.status == 200
            assert answer.content_type == "text/plain"
            text = await answer.text()
    lines = set(text.splitlines())
    assert "receiver_applied_total 1.0" in lines
    assert "receiver_duplicates_total 1.0" in lines
    assert "receiver_stock 4.0" in lines
    assert "# TYPE receiver_process_requests_total counter" in lines


async def test_injected_503_is_before_commit(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox, faults=Faults(p_503=1.0, seed=1)) as rx:
        with pytest.raises(Retryable):
            await send_http(rx.url, {"id": "x", "qty": 1}, timeout=5)
        stats = await rx.stats()
        assert (stats["process_injected_503"], stats["applied"], stats["inbox_rows"]) == (1, 0, 0)
    assert inbox_rows(inbox) == []


def test_faults_are_checked():
    for bad in ({"p_503": 1.5}, {"p_drop": -0.1}, {"latency_ms": -1}, {"p_drop": True}):
        with pytest.raises(ValueError):
            Faults(**bad)


# ----------------------------------------------------------------- as a real process


def test_fifty_concurrent_posts_apply_once(tmp_path: Path):
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        async def fire() -> list:
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(
                    send_http(rx.url, {"id": "same", "qty": 9}, timeout=10, session=session)
                    for _ in range(50)))

        assert asyncio.run(fire()) == [True] * 50
        stats = rx.stats()
        assert (stats["applied"], stats["duplicates"], stats["stock"],
                stats["process_requests"]) == (1, 49, 9, 50)
    assert inbox_rows(tmp_path / "inbox.db") == [("same", 9, 50, None)]


def test_drop_after_commit_then_resend_is_a_duplicate(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox, "--p-drop", "1", "--seed", "3") as rx:
        with pytest.raises(Retryable):
            sync_http.send_http(rx.url, {"id": "snack-7", "qty": 7}, timeout=5, token=1)
        assert rx.stats()["process_dropped_after_commit"] == 1
    assert inbox_rows(inbox) == [("snack-7", 7, 1, 1)]  # committed, though never answered
    with ReceiverProcess(inbox) as rx:  # restarted on the same file
        assert sync_http.send_http(rx.url, {"id": "snack-7", "qty": 7}, timeout=5, token=2)
        stats = rx.stats()
        assert (stats["duplicates"], stats["applied"], stats["stock"], stats["inbox_rows"],
                stats["process_requests"]) == (1, 1, 7, 1, 1)
    assert inbox_rows(inbox) == [("snack-7", 7, 2, 2)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly_and_restart_keeps_everything(tmp_path: Path, signum: int):
    inbox = tmp_path / "inbox.db"
    rx = ReceiverProcess(inbox)
    try:
        for n in range(5):
            assert sync_http.send_http(rx.url, {"id": f"r-{n}", "qty": n + 1}, timeout=5)
    finally:
        code = rx.stop(signum)
    assert code == 0 and "Traceback" not in rx.stderr
    con = sqlite3.connect(inbox)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    with ReceiverProcess(inbox) as again:
        stats = again.stats()
        assert (stats["inbox_rows"], stats["stock"], stats["inbox_seen"]) == (5, 15, 5)
        assert sync_http.send_http(again.url, {"id": "r-0", "qty": 1}, timeout=5)
        assert again.stats()["duplicates"] == 1


def test_serve_refuses_a_non_loopback_host(tmp_path: Path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "asyncworker", "serve", "--inbox",
                          str(tmp_path / "i.db"), "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "loopback" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "i.db").exists()


# A lab event's content is its qty, a payload event's its body's digest (qty 0).
CONTENTS = st.sampled_from([(1, None), (2, None), (0, "d1" * 32), (0, "d2" * 32)])


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.builds(lambda i, content, token: Arrival(i, content[0], token,
                                                                     content[1]),
                                   st.sampled_from(["a", "b", "c"]), CONTENTS,
                                   st.one_of(st.none(), st.integers(1, 4))), max_size=14),
       split=st.integers(0, 14))
def test_a_group_decides_like_requests_one_by_one(requests, split):
    """Grouping never changes an answer: the group's deliveries equal those of
    its two halves applied one after the other, lab and payload events mixed."""
    whole = decide_group({}, requests)
    first = decide_group({}, requests[:split])
    known: dict[str, Kept] = {}
    for d in first:
        if d.outcome in ("applied", "duplicate"):
            known[d.id] = Kept(d.known_qty, d.known_digest, d.max_token)
    assert whole == first + decide_group(known, requests[split:])
    applied = [d.id for d in whole if d.outcome == "applied"]
    assert len(applied) == len(set(applied))  # an id is applied at most once


async def test_grouped_writes_match_the_deliveries(tmp_path: Path):
    inbox = await Inbox.open(tmp_path / "g.db", max_group=64)
    try:
        requests = [("x", 2, 3), ("x", 2, None), ("x", 2, 1), ("y", 5, None), ("x", 3, 4),
                    ("y", 5, 9), ("z", 1, 2)]
        results = await asyncio.gather(*(inbox.deliver(*r) for r in requests))
        assert [r.outcome for r in results] == ["applied", "duplicate", "stale", "applied",
                                                "conflict", "duplicate", "applied"]
        assert inbox.commits == 1
    finally:
        await inbox.close()
    assert inbox_rows(tmp_path / "g.db") == [("x", 2, 2, 3), ("y", 5, 2, 9), ("z", 1, 1, 2)]
    assert stock(tmp_path / "g.db") == 8


def test_final_counters_are_printed_on_the_way_out(tmp_path: Path):
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        for _ in range(3):
            assert sync_http.send_http(rx.url, {"id": "f", "qty": 2}, timeout=5)
        final = rx.final_counters()
    assert (final["process_requests"], final["applied"], final["duplicates"],
            final["stock"]) == (3, 1, 2, 2)


# ----------------------------------------------------------------- the inbox file


@pytest.mark.parametrize("case", FOREIGN)
async def test_what_is_not_an_inbox_is_refused_untouched(tmp_path: Path, case: str, capsys):
    """Refused before anything is opened, created or bound: a ValueError that
    names the file, from every way in, with bytes and folder listing unchanged."""
    build, message = FOREIGN[case]
    folder = tmp_path / "files"
    folder.mkdir()
    path = build(folder)
    before = folder_state(folder)
    for attempt in (lambda: make_app(path), lambda: read_inbox(path)):
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            attempt()
        assert str(path) in str(refused.value) or str(path.parent) in str(refused.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        await Inbox.open(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        await serve(path)
    assert capsys.readouterr().out == ""  # no URL line
    assert folder_state(folder) == before


def test_read_inbox_writes_nothing(tmp_path: Path):
    """Evidence is read without a write: no file made for a missing inbox, no
    -wal or -shm left beside a WAL inbox."""
    with pytest.raises(ValueError, match="inbox file not found"):
        read_inbox(tmp_path / "missing.db")
    assert list(tmp_path.iterdir()) == []

    async def fill() -> None:
        inbox = await Inbox.open(tmp_path / "inbox.db")
        try:
            await asyncio.gather(inbox.deliver("a", 2, 1), inbox.deliver("a", 2, 1),
                                 inbox.deliver("a", 3, 1), inbox.deliver("b", 1, None))
        finally:
            await inbox.close()

    asyncio.run(fill())
    before = folder_state(tmp_path)
    assert sorted(before) == ["inbox.db"]
    contents = read_inbox(tmp_path / "inbox.db")
    assert (contents.applied, contents.seen, contents.stock, contents.conflicts,
            contents.stale) == ({"a": 2, "b": 1}, 3, 3, 1, 0)
    assert folder_state(tmp_path) == before


async def test_read_inbox_sees_a_live_inbox(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert (await rx.post({"id": "live", "qty": 4}))[0] == 200
        assert read_inbox(tmp_path / "inbox.db").applied == {"live": 4}


async def test_a_new_inbox_in_an_empty_file(tmp_path: Path):
    (tmp_path / "inbox.db").touch()
    async with Running(tmp_path / "inbox.db") as rx:
        assert (await rx.post({"id": "e", "qty": 1}))[0] == 200
    assert inbox_rows(tmp_path / "inbox.db") == [("e", 1, 1, None)]


async def test_a_first_version_inbox_is_migrated_forward(tmp_path: Path):
    """Its rows and stock are kept; applied and duplicates come from the rows
    (seen - 1 duplicates each); its past conflicts and stale senders left no
    trace, so they start at 0, and are counted from now on."""
    path = sqlite_file(tmp_path / "old.db", FIRST_SCHEMA + """
        INSERT INTO inbox VALUES ('a', 2, 1, 3, 5), ('b', 4, 1, 1, NULL);
        UPDATE effect SET stock = 6;""", wal=True)
    assert read_inbox(path).conflicts == 0  # readable before the migration, unchanged
    inbox = await Inbox.open(path)
    try:
        totals = inbox.totals
        assert (totals.applied, totals.duplicates, totals.stock, totals.conflicts,
                totals.stale) == (2, 2, 6, 0, 0)
        outcomes = await asyncio.gather(inbox.deliver("a", 3, None), inbox.deliver("a", 2, 1))
        assert [d.outcome for d in outcomes] == ["conflict", "stale"]
    finally:
        await inbox.close()
    assert inbox_rows(path) == [("a", 2, 3, 5), ("b", 4, 1, None)]
    again = await Inbox.open(path)
    try:
        assert (again.totals.conflicts, again.totals.stale, again.totals.stock) == (1, 1, 6)
    finally:
        await again.close()


def test_inbox_figures_read_the_same_after_a_restart(tmp_path: Path):
    """/stats, /metrics and the final line: the inbox's figures are the file's,
    before and after a restart; only the process_* figures start again at 0."""
    inbox = tmp_path / "inbox.db"
    durable = ("applied", "duplicates", "conflicts", "stale_senders", "inbox_rows",
               "inbox_seen", "stock")
    with ReceiverProcess(inbox) as rx:
        for n in range(3):
            assert sync_http.send_http(rx.url, {"id": f"d-{n}", "qty": n + 2}, timeout=5,
                                       token=2)
        assert sync_http.send_http(rx.url, {"id": "d-0", "qty": 2}, timeout=5, token=2)
        with pytest.raises(Permanent):
            sync_http.send_http(rx.url, {"id": "d-0", "qty": 9}, timeout=5)
        assert sync_http.send_http(rx.url, {"id": "d-1", "qty": 3}, timeout=5, token=1)  # stale
        first = rx.final_counters()
    assert {k: first[k] for k in durable} == {
        "applied": 3, "duplicates": 1, "conflicts": 1, "stale_senders": 1, "inbox_rows": 3,
        "inbox_seen": 4, "stock": 9}
    assert first["process_requests"] == 6
    with ReceiverProcess(inbox) as again:
        after = again.stats()
        metrics = _metrics(again.base)
        last = again.final_counters()
    assert {k: after[k] for k in durable} == {k: first[k] for k in durable}
    assert {k: last[k] for k in durable} == {k: first[k] for k in durable}
    assert after["process_requests"] == 0 and after["process_commits"] == 0
    assert {"receiver_applied_total 3.0", "receiver_duplicates_total 1.0",
            "receiver_conflicts_total 1.0", "receiver_stale_senders_total 1.0",
            "receiver_stock 9.0", "receiver_process_requests_total 0.0"} <= metrics


def _metrics(base: str) -> set[str]:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(base + "/metrics", timeout=10) as answer:
        return set(answer.read().decode().splitlines())


async def test_serve_refuses_a_port_in_use_before_creating_the_inbox(tmp_path: Path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="Address already in use") as refused:
            await serve(tmp_path / "inbox.db", port=port)
    assert refused.value.errno == errno.EADDRINUSE
    assert refused.value.filename == f"127.0.0.1:{port}"
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- slow and many clients

HEAD_PART = b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Le"
BODY_PART = (b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"id\": ")


async def _connect(port: int, first: bytes = b"") -> tuple[asyncio.StreamReader,
                                                           asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    await writer.drain()
    return reader, writer


async def _trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One byte every 0.1 s, until the data runs out or the server hangs up."""
    for byte in data:
        await asyncio.sleep(0.1)
        if writer.is_closing():
            return
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except ConnectionError:
            return


async def _to_the_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """Everything the server sends until it closes the connection."""
    try:
        return await reader.read()
    except ConnectionError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "gave up waiting"
        await asyncio.sleep(0.01)


async def test_slow_clients_are_cut_off_while_others_are_served(tmp_path: Path):
    """Half-open and trickling clients hold a connection for the read time, no
    longer: a stalled body gets 408, a stalled head is closed; a normal POST
    is answered meanwhile, and nothing of theirs reaches the inbox."""
    limits = Limits(read_timeout=0.5, max_connections=200)
    async with Running(tmp_path / "inbox.db", limits=limits) as rx:
        heads = [await _connect(rx.port, HEAD_PART) for _ in range(40)]
        bodies = [await _connect(rx.port, BODY_PART) for _ in range(40)]
        trickling_head, trickling_body = await _connect(rx.port), await _connect(rx.port, BODY_PART)
        feeders = [asyncio.ensure_future(_trickle(trickling_head[1], HEAD_PART)),
                   asyncio.ensure_future(_trickle(trickling_body[1], b"1" * 60))]
        heads.append(trickling_head)
        bodies.append(trickling_body)
        assert await asyncio.wait_for(rx.post({"id": "served", "qty": 1}), 5) == (
            200, {"id": "served", "qty": 1, "status": "applied"})
        heads_got, bodies_got = await asyncio.wait_for(asyncio.gather(
            asyncio.gather(*(_to_the_end(*client) for client in heads)),
            asyncio.gather(*(_to_the_end(*client) for client in bodies))), 10)
        await asyncio.gather(*feeders)
        assert heads_got == [b""] * 41  # closed unanswered: there is no request to answer
        assert all(got.startswith(b"HTTP/1.1 408 ") and b"not received within 0.5 s" in got
                   for got in bodies_got), bodies_got
        await rx.session.close()
        await _until(lambda: receiver_stats(rx.app)["process_open_connections"] == 0)
        figures = receiver_stats(rx.app)
        assert (figures["process_timed_out"], figures["process_requests"]) == (41, 42)
    assert inbox_rows(tmp_path / "inbox.db") == [("served", 1, 1, None)]


async def test_connections_past_the_limit_are_answered_503(tmp_path: Path):
    limits = Limits(read_timeout=5, max_connections=8)
    async with Running(tmp_path / "inbox.db", limits=limits) as rx:
        idle = [await _connect(rx.port) for _ in range(8)]
        await _until(lambda: receiver_stats(rx.app)["process_open_connections"] == 8)
        refused = await asyncio.wait_for(_to_the_end(*await _connect(rx.port)), 5)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"too many connections" in refused
        for _, writer in idle:
            writer.close()
        await _until(lambda: receiver_stats(rx.app)["process_open_connections"] == 0)
        assert (await rx.post({"id": "after", "qty": 2}))[0] == 200  # room again
        assert receiver_stats(rx.app)["process_refused_connections"] == 1


async def test_a_burst_of_connections_is_queued_while_the_loop_is_busy(tmp_path: Path):
    """300 clients connect at once while the receiver's loop is busy: each
    handshake completes, queued for accept. With a backlog below the burst
    the kernel drops the SYNs past it, and those clients wait a second to
    try again (seen as a 1 s p99 at concurrency 256)."""
    async with Running(tmp_path / "inbox.db", limits=Limits(max_connections=1024)) as rx:
        clients = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(300)]
        try:
            for client in clients:  # the loop runs none of its callbacks meanwhile
                client.setblocking(False)
                assert client.connect_ex(("127.0.0.1", rx.port)) in (0, errno.EINPROGRESS)
            connected = _connected(clients, within_s=0.5)  # a SYN retried waits 1 s
            # the kernel caps a backlog at somaxconn (4096 by default since Linux 5.4)
            somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
            assert connected == min(len(clients), somaxconn + 1)
        finally:
            for client in clients:
                client.close()
        await _until(lambda: receiver_stats(rx.app)["process_open_connections"] == 0)
        assert (await rx.post({"id": "after", "qty": 1}))[0] == 200


def _connected(clients: list[socket.socket], within_s: float) -> int:
    """How many of the connecting sockets finished their handshake within the
    time (waited for without the event loop: this blocks it)."""
    poller = select.poll()
    for client in clients:
        poller.register(client, select.POLLOUT)
    done: set[int] = set()
    deadline = time.monotonic() + within_s
    while len(done) < len(clients) and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            done.add(fd)
    return sum(1 for client in clients if client.fileno() in done
               and client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)


def test_limits_are_checked():
    for bad in ({"read_timeout": 0}, {"read_timeout": -1}, {"read_timeout": True},
                {"read_timeout": float("nan")}, {"max_connections": 0},
                {"max_connections": 2.0}, {"max_connections": True}):
        with pytest.raises(ValueError):
            Limits(**bad)
