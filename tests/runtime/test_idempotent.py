"""asyncworker.receiving.idempotent: the user's effect and the record of the event's id
in one transaction on the user's own SQLite file, answered after COMMIT."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from asyncworker.receiving.idempotent import TABLE, Event, Reject, add_receiver, receiver_app
from lease import signing

KEY = bytes(range(32))
ORDERS = "CREATE TABLE orders (id TEXT PRIMARY KEY, item TEXT NOT NULL, qty INTEGER NOT NULL)"


def place_order(con: sqlite3.Connection, event: Event) -> None:
    con.execute("INSERT INTO orders VALUES (?, ?, ?)",
                (event.id, event.body["item"], event.body["qty"]))


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    """The user's own file: their tables, their data, their journal mode."""
    path = tmp_path / "shop.db"
    con = sqlite3.connect(path)
    con.executescript(f"""
        PRAGMA journal_mode=WAL;
        PRAGMA user_version=41;
        {ORDERS};
        CREATE TABLE customers (name TEXT);
        CREATE INDEX customers_name ON customers (name);
        INSERT INTO customers VALUES ('ada');
    """)
    con.close()
    return path


class Served:
    """An aiohttp app in this process on 127.0.0.1 port 0, and a client."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    async def __aenter__(self) -> Served:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.runner.cleanup()

    async def post(self, body: object, event_id: str = "order-1", path: str = "/events",
                   headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", "webhook-id": event_id, **(headers or {})}
        async with self.session.post(self.base + path, data=data, headers=hdrs) as answer:
            return answer.status, await answer.json(content_type=None)


def query(path: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def counting(effect: Callable) -> tuple[Callable, list]:
    calls: list[str] = []

    def wrapped(con: sqlite3.Connection, event: Event) -> None:
        calls.append(event.id)
        effect(con, event)

    return wrapped, calls


async def test_once_then_duplicate_then_conflict(shop: Path):
    effect, calls = counting(place_order)
    async with Served(receiver_app(shop, effect)) as rx:
        order = {"item": "tea", "qty": 2}
        assert await rx.post(order) == (200, {"id": "order-1", "status": "applied"})
        # the same body, keys in another order: the same event
        assert await rx.post(b'{"qty": 2, "item": "tea"}') == (
            200, {"id": "order-1", "status": "duplicate"})
        status, answer = await rx.post({"item": "tea", "qty": 3})
        assert status == 409 and "another body" in answer["error"]
    assert calls == ["order-1"]
    assert query(shop, "SELECT * FROM orders") == [("order-1", "tea", 2)]
    assert query(shop, f"SELECT id FROM {TABLE}") == [("order-1",)]


async def test_concurrent_duplicates_apply_exactly_once(shop: Path):
    """Sixty copies at once, through two receivers on the same file (two
    connections, as two processes would have): one order, one effect call."""
    effect, calls = counting(place_order)
    one, other = receiver_app(shop, effect), receiver_app(shop, effect)
    async with Served(one) as a, Served(other) as b:
        answers = await asyncio.gather(*(
            (a if n % 2 else b).post({"item": "tea", "qty": 2}) for n in range(60)))
    statuses = sorted(answer["status"] for _, answer in answers)
    assert statuses == ["applied"] + ["duplicate"] * 59
    assert calls == ["order-1"]
    assert query(shop, "SELECT count(*) FROM orders") == [(1,)]


async def test_the_effect_raising_rolls_everything_back(shop: Path):
    def half_then_fail(con: sqlite3.Connection, event: Event) -> None:
        place_order(con, event)  # written, then...
        con.execute("UPDATE customers SET name = 'eve'")
        raise KeyError("no such warehouse")

    async with Served(receiver_app(shop, half_then_fail)) as rx:
        status, answer = await rx.post({"item": "tea", "qty": 2})
    assert status == 500 and "KeyError" in answer["error"] and "nothing" in answer["error"]
    assert "warehouse" not in answer["error"]  # the effect's message stays in the log
    assert query(shop, "SELECT * FROM orders") == []
    assert query(shop, f"SELECT * FROM {TABLE}") == []
    assert query(shop, "SELECT name FROM customers") == [("ada",)]
    async with Served(receiver_app(shop, place_order)) as rx:  # the sender's retry
        assert (await rx.post({"item": "tea", "qty": 2}))[1]["status"] == "applied"
    assert query(shop, "SELECT count(*) FROM orders") == [(1,)]


@pytest.mark.parametrize("escape", [
    lambda con: con.commit(),
    lambda con: con.execute("COMMIT"),
    lambda con: con.execute("ROLLBACK"),
    lambda con: con.executescript("SELECT 1"),  # which commits first
    lambda con: con.execute(f"DELETE FROM {TABLE}"),
    lambda con: con.execute(f"INSERT INTO {TABLE} VALUES ('order-9', 'x', 0)"),
    lambda con: con.execute(f"DROP TABLE {TABLE}"),
])
async def test_the_effect_cannot_end_the_transaction_or_write_the_record(shop: Path, escape):
    def sneaky(con: sqlite3.Connection, event: Event) -> None:
        place_order(con, event)
        escape(con)

    async with Served(receiver_app(shop, sneaky)) as rx:
        status, answer = await rx.post({"item": "tea", "qty": 2})
    assert status == 500, answer
    assert query(shop, "SELECT * FROM orders") == []
    assert query(shop, f"SELECT * FROM {TABLE}") == []


async def test_a_rejected_event_is_422_and_nothing_is_committed(shop: Path):
    def picky(con: sqlite3.Connection, event: Event) -> None:
        place_order(con, event)
        raise Reject("we do not sell coffee")

    async with Served(receiver_app(shop, picky)) as rx:
        assert await rx.post({"item": "coffee", "qty": 1}) == (
            422, {"error": "we do not sell coffee"})
    assert query(shop, "SELECT * FROM orders") == []
    assert query(shop, f"SELECT * FROM {TABLE}") == []


def _schema(path: Path) -> list[tuple]:
    return query(path, f"SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE "
                       f"'{TABLE}%' AND name NOT LIKE 'sqlite_autoindex_{TABLE}%' ORDER BY name")


async def test_its_table_beside_the_users_and_nothing_else_changed(shop: Path):
    before = (_schema(shop), query(shop, "SELECT * FROM customers"),
              query(shop, "PRAGMA journal_mode"), query(shop, "PRAGMA user_version"))
    async with Served(receiver_app(shop, place_order)) as rx:
        assert (await rx.post({"item": "tea", "qty": 2}))[0] == 200
    after = (_schema(shop), query(shop, "SELECT * FROM customers"),
             query(shop, "PRAGMA journal_mode"), query(shop, "PRAGMA user_version"))
    assert after == before
    assert query(shop, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name") == [
        ("customers",), ("orders",), (TABLE,)]
    assert [row[1] for row in query(shop, f"PRAGMA table_info({TABLE})")] == [
        "id", "digest", "first_seen_ms"]


@pytest.mark.parametrize("case", ["their own received_events", "not sqlite", "a directory",
                                  "no such directory"])
def test_a_file_it_cannot_use_is_refused_untouched(tmp_path: Path, case: str):
    path = tmp_path / "theirs.db"
    if case == "their own received_events":
        con = sqlite3.connect(path)
        con.execute(f"CREATE TABLE {TABLE} (who TEXT, at INTEGER)")
        con.execute(f"INSERT INTO {TABLE} VALUES ('bob', 1)")
        con.commit()
        con.close()
    elif case == "not sqlite":
        path.write_bytes(b"ledger of 1987\n" * 100)
    elif case == "a directory":
        path.mkdir()
    else:
        path = tmp_path / "missing" / "shop.db"
    before = sorted((p.name, p.read_bytes() if p.is_file() else None)
                    for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as refused:
        receiver_app(path, place_order)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)
    after = sorted((p.name, p.read_bytes() if p.is_file() else None)
                   for p in tmp_path.rglob("*"))
    assert after == before


async def test_a_missing_file_is_created_with_only_its_table(tmp_path: Path):
    path = tmp_path / "new.db"
    async with Served(receiver_app(path, lambda con, event: None)) as rx:
        assert (await rx.post({"n": 1}, "n-1"))[0] == 200
    assert query(path, "SELECT name FROM sqlite_master WHERE type = 'table'") == [(TABLE,)]


def signed(body: bytes, event_id: str, keys: tuple = (KEY,)) -> dict:
    return signing.signature_headers(list(keys), event_id, int(time.time()), body)


async def test_with_secrets_unsigned_is_401_and_touches_nothing(shop: Path):
    effect, calls = counting(place_order)
    body = b'{"item": "tea", "qty": 2}'
    async with Served(receiver_app(shop, effect, secrets=[KEY])) as rx:
        before = shop.read_bytes(), Path(f"{shop}-wal").read_bytes()
        assert (await rx.post(body))[0] == 401
        status, answer = await rx.post(body, headers=signed(body, "order-1",
                                                           keys=(bytes(range(1, 33)),)))
        assert (status, answer["error"].split(":")[0]) == (401, "signature mismatch")
        stale = {**signed(body, "order-1"), "webhook-timestamp": str(int(time.time()) - 900)}
        assert (await rx.post(body, headers=stale))[0] == 401
        assert (shop.read_bytes(), Path(f"{shop}-wal").read_bytes()) == before
        assert (await rx.post(body, headers=signed(body, "order-1")))[1]["status"] == "applied"
        # signed for order-1, sent as order-2: the signature covers the id
        status, _ = await rx.post(body, "order-2", headers={**signed(body, "order-1"),
                                                             "webhook-id": "order-2"})
        assert status == 401
    assert calls == ["order-1"]


async def test_a_request_signed_by_the_standardwebhooks_library(shop: Path):
    import datetime

    from standardwebhooks import Webhook

    text = '{"item": "tea", "qty": 2}'
    now = datetime.datetime.now(datetime.UTC)
    headers = {"webhook-id": "order-1", "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": Webhook(signing.new_secret(random=KEY)).sign(
                   "order-1", now, text)}
    async with Served(receiver_app(shop, place_order, secrets=[KEY])) as rx:
        assert (await rx.post(text.encode(), headers=headers))[1]["status"] == "applied"


async def test_beside_the_users_routes_at_their_path_with_the_size_cap(shop: Path):
    """add_receiver on the user's own app (whose client_max_size is aiohttp's
    1 MiB): the library's 64 KiB cap holds all the same."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    add_receiver(app, "/hooks/orders", shop, place_order)
    async with Served(app) as rx:
        async with rx.session.get(rx.base + "/") as answer:
            assert await answer.text() == "hello"
        assert (await rx.post({"item": "tea", "qty": 2}, path="/hooks/orders"))[0] == 200
        big = json.dumps({"item": "x" * 70_000, "qty": 1}).encode()
        assert (await rx.post(big, "order-2", path="/hooks/orders"))[0] == 413
    assert query(shop, "SELECT id FROM orders") == [("order-1",)]


@pytest.mark.parametrize(("body", "headers", "message"), [
    (b"{not json", {}, "JSON"),
    (b"[1, 2]", {}, "must be a JSON object"),
    (b'{"a": 1, "a": 2}', {}, "duplicate"),
    (b'{"item": "tea", "qty": 2}', {"webhook-id": ""}, "webhook-id must be"),
    (b'{"item": "tea", "qty": 2}', {"Content-Type": "text/plain"}, "content type"),
])
async def test_bad_requests_are_400_and_touch_nothing(shop: Path, body, headers, message):
    effect, calls = counting(place_order)
    async with Served(receiver_app(shop, effect)) as rx:
        status, answer = await rx.post(body, headers=headers)
    assert status == 400 and message in answer["error"], answer
    assert calls == [] and query(shop, f"SELECT * FROM {TABLE}") == []


async def test_a_file_locked_by_another_writer_is_503_and_retried(shop: Path):
    async with Served(receiver_app(shop, place_order)) as rx:
        blocker = sqlite3.connect(shop, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            started = time.monotonic()
            status, answer = await rx.post({"item": "tea", "qty": 2})
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert (status, time.monotonic() - started < 30) == (503, True)
        assert "nothing was committed" in answer["error"]
        assert (await rx.post({"item": "tea", "qty": 2}))[1]["status"] == "applied"


@pytest.mark.parametrize(("options", "message"), [
    ({"secrets": []}, "secrets must be"),
    ({"tolerance_s": 0}, "tolerance_s must be"),
    ({"read_timeout": 0}, "read_timeout must be"),
])
def test_bad_options_are_refused_and_create_nothing(tmp_path: Path, options, message):
    with pytest.raises(ValueError, match=message):
        receiver_app(tmp_path / "new.db", place_order, **options)
    with pytest.raises(ValueError, match="effect must be callable"):
        receiver_app(tmp_path / "new.db", "place_order")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
