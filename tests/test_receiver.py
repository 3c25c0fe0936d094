"""The receiver: an aiohttp server whose inbox deduplicates by ID and quantity."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncworker import Faults, make_app, send_http
from asyncworker.inbox import Inbox, decide_group
from lease import http as sync_http
from lease.worker import Permanent, Retryable

from .servers import ReceiverProcess


class Running:
    """The receiver app in this process, on 127.0.0.1 port 0."""

    def __init__(self, inbox: Path, **kwargs) -> None:
        self.inbox, self.kwargs = inbox, kwargs

    async def __aenter__(self) -> Running:
        self.app = make_app(self.inbox, **self.kwargs)
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/events"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.runner.cleanup()

    async def post(self, body: object, *, content_type: str = "application/json",
                   headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        hdrs = {"Content-Type": content_type, **(headers or {})}
        if content_type == "":
            hdrs.pop("Content-Type")
        async with self.session.post(self.url, data=data, headers=hdrs) as answer:
            return answer.status, await answer.json(content_type=None)

    async def stats(self) -> dict:
        async with self.session.get(self.base + "/stats") as answer:
            return await answer.json()


def snapshot(inbox: Path) -> tuple[bytes, bytes]:
    wal = inbox.with_name(inbox.name + "-wal")
    return inbox.read_bytes(), wal.read_bytes() if wal.exists() else b""


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
        assert {k: stats[k] for k in ("requests", "applied", "duplicates", "conflicts", "stock",
                                      "inbox_rows", "rejected")} == {
            "requests": 3, "applied": 1, "duplicates": 1, "conflicts": 1, "stock": 7,
            "inbox_rows": 1, "rejected": 0}
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
    ("over 4 KiB", {"id": "a", "qty": 1, "pad": "x" * 5000}, "application/json", {}, 413,
     "larger than 4096"),
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
        assert stats["rejected"] + stats["too_large"] == len(BAD_REQUESTS)
        assert (stats["applied"], stats["inbox_rows"], stats["stock"]) == (1, 1, 2)
    assert len(BAD_REQUESTS) >= 20


async def test_stale_token_is_refused_and_counted(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox) as rx:
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=5) is True
        with pytest.raises(Permanent, match="stale token 3"):
            await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=3)
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=5) is True
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=7) is True
        assert await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5) is True  # no token
        with pytest.raises(Permanent, match="stale token 6"):
            await send_http(rx.url, {"id": "j", "qty": 3}, timeout=5, token=6)
        stats = await rx.stats()
        assert (stats["stale_senders"], stats["applied"], stats["duplicates"], stats["stock"]) \
            == (2, 1, 3, 3)
    assert inbox_rows(inbox) == [("j", 3, 4, 7)]


async def test_group_commit_answers_after_one_commit(tmp_path: Path):
    inbox = await Inbox.open(tmp_path / "grouped.db", max_group=64)
    try:
        results = await asyncio.gather(*(inbox.deliver(f"g-{n % 4}", 1, None) for n in range(12)))
        assert [r.outcome for r in results] == ["applied"] * 4 + ["duplicate"] * 8
        assert inbox.totals.commits == 1 and inbox.totals.stock == 4
    finally:
        await inbox.close()
    single = await Inbox.open(tmp_path / "single.db", max_group=1)
    try:
        await asyncio.gather(*(single.deliver(f"g-{n}", 1, None) for n in range(12)))
        assert single.totals.commits == 12
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
    assert "# TYPE receiver_requests_total counter" in lines


async def test_injected_503_is_before_commit(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox, faults=Faults(p_503=1.0, seed=1)) as rx:
        with pytest.raises(Retryable):
            await send_http(rx.url, {"id": "x", "qty": 1}, timeout=5)
        stats = await rx.stats()
        assert (stats["injected_503"], stats["applied"], stats["inbox_rows"]) == (1, 0, 0)
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
        assert (stats["applied"], stats["duplicates"], stats["stock"], stats["requests"]) == (
            1, 49, 9, 50)
    assert inbox_rows(tmp_path / "inbox.db") == [("same", 9, 50, None)]


def test_drop_after_commit_then_resend_is_a_duplicate(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox, "--p-drop", "1", "--seed", "3") as rx:
        with pytest.raises(Retryable):
            sync_http.send_http(rx.url, {"id": "snack-7", "qty": 7}, timeout=5, token=1)
        assert rx.stats()["dropped_after_commit"] == 1
    assert inbox_rows(inbox) == [("snack-7", 7, 1, 1)]  # committed, though never answered
    with ReceiverProcess(inbox) as rx:  # restarted on the same file
        assert sync_http.send_http(rx.url, {"id": "snack-7", "qty": 7}, timeout=5, token=2)
        stats = rx.stats()
        assert (stats["duplicates"], stats["applied"], stats["stock"], stats["inbox_rows"]) == (
            1, 0, 7, 1)
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


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 2),
                                   st.one_of(st.none(), st.integers(1, 4))), max_size=14),
       split=st.integers(0, 14))
def test_a_group_decides_like_requests_one_by_one(requests, split):
    """Grouping never changes an answer: the group's deliveries equal those of
    its two halves applied one after the other."""
    whole = decide_group({}, requests)
    first = decide_group({}, requests[:split])
    known: dict[str, tuple] = {}
    for d in first:
        if d.outcome in ("applied", "duplicate"):
            qty, seen, _ = known.get(d.id, (d.qty, 0, None))
            known[d.id] = (qty, seen + 1, d.max_token)
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
        assert inbox.totals.commits == 1
    finally:
        await inbox.close()
    assert inbox_rows(tmp_path / "g.db") == [("x", 2, 2, 3), ("y", 5, 2, 9), ("z", 1, 1, 2)]
    assert stock(tmp_path / "g.db") == 8


def test_final_counters_are_printed_on_the_way_out(tmp_path: Path):
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        for _ in range(3):
            assert sync_http.send_http(rx.url, {"id": "f", "qty": 2}, timeout=5)
        final = rx.final_counters()
    assert (final["requests"], final["applied"], final["duplicates"], final["stock"]) == (
        3, 1, 2, 2)
