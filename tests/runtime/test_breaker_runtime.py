"""The runtime side of the breaker: an endpoint that is down costs a few
attempts and a few log lines, the others keep being delivered, a Retry-After
pauses its endpoint, and the metrics and /status tell which endpoints are
open, half-open, paused or disabled.

Real SQLite files in tmp_path, real aiohttp receivers on 127.0.0.1 port 0.
Where the breaker's cool-downs matter the dispatcher's clock is injected
(the store judges every claim and finish by it) and the test moves it on;
every wait is for a condition, never for a length of time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from asyncworker import Dispatcher
from asyncworker.metrics import start_metrics_server
from lease.breaker import BREAKER
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.sqlite import SQLiteStore
from tests.support.dispatching import until
from tests.support.tls_servers import Seen, receiver

POLICY = RetryPolicy(max_attempts=50, ttl_ms=3_600_000)
LEASE_MS = 60_000
HOST = "127.0.0.1"


class Switch:
    """A receiver's behaviour: down (503, counted) or up (the echo-id ACK,
    each delivery's id counted where it was applied)."""

    def __init__(self, down: bool = True, status: int = 503,
                 retry_after: str | None = None) -> None:
        self.down = down
        self.status = status
        self.retry_after = retry_after
        self.refused = 0  # requests answered while down
        self.applied: dict[str, int] = {}  # id -> times applied

    async def answer(self, seen: Seen) -> web.StreamResponse:
        if self.down:
            self.refused += 1
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            return web.Response(status=self.status, text="down", headers=headers)
        event_id = seen.headers["webhook-id"]
        self.applied[event_id] = self.applied.get(event_id, 0) + 1
        return web.json_response({"id": event_id})


class Clock:
    """The store's time for the dispatcher: the wall clock plus what the test added."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return int(time.time() * 1000) + self.offset_ms


class Lines(logging.Handler):
    """Every record at info and above of the dispatcher's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def said(self, text: str) -> list[str]:
        return [r.getMessage() for r in self.records if text in r.getMessage()]


@contextlib.contextmanager
def lines() -> AsyncIterator[Lines]:  # type: ignore[misc]
    handler = Lines()
    logger = logging.getLogger("asyncworker")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def setup(path: Path, endpoints: dict[str, str], messages: int) -> None:
    with SQLiteStore(path, create=True) as store:
        for name, url in endpoints.items():
            store.add_endpoint(Endpoint(name, url))
        events = [{"id": f"m-{n}", "qty": n % 7 + 1} for n in range(messages)]
        for start in range(0, messages, 1000):
            chunk = events[start:start + 1000]
            assert store.enqueue_events(chunk, POLICY) == [True] * len(chunk)


def circuit(path: Path, name: str) -> dict:
    with SQLiteStore(path) as store:
        [row] = [row for row in store.endpoints() if row["name"] == name]
        return row["circuit"]


def audit(path: Path, name: str) -> list[str]:
    with SQLiteStore(path) as store:
        return [row["action"] for row in store.endpoint_audit(name) if row["actor"] == "breaker"]


def attempts_of(path: Path, name: str) -> int:
    """Attempts rows of the endpoint's deliveries: every attempt that did not deliver."""
    with contextlib.closing(sqlite3.connect(path)) as con:
        return con.execute("SELECT COUNT(*) FROM attempts a JOIN jobs j ON j.id = a.id"
                           " WHERE j.endpoint = ?", (name,)).fetchone()[0]


def statuses(path: Path) -> dict[str, dict[str, int]]:
    with SQLiteStore(path) as store:
        return {row["name"]: {key: row[key] for key in ("ready", "in_flight", "done", "dead")}
                for row in store.endpoint_stats()}


@contextlib.asynccontextmanager
async def running(d: Dispatcher) -> AsyncIterator[asyncio.Task]:
    async with d:
        task = asyncio.create_task(d.run())
        try:
            yield task
        finally:
            d.stop()
            await task


def dispatcher(path: Path, **options: object) -> Dispatcher:
    options.setdefault("endpoints", "*")
    options.setdefault("policy", POLICY)
    options.setdefault("refresh_s", 0.05)
    return Dispatcher(path, "w1", lease_ms=LEASE_MS, **options)  # type: ignore[arg-type]


# ----------------------------------------------------------------- an outage


async def test_ten_thousand_deliveries_through_a_20_s_outage_cost_few_attempts_and_few_lines(
        tmp_path: Path):
    """The endpoint is down for 20 s of the store's time (the injected clock,
    moved on by the test): the breaker opens after its threshold, the claims
    send nothing but one probe per cool-down, the log says each change once
    and sums the failures in a line per 10 s; back up, everything is
    delivered, once each, nothing dead."""
    path = tmp_path / "queue.db"
    messages = 10_000
    switch = Switch(down=True)
    clock = Clock()
    async with receiver(None, host=HOST, answer=switch.answer) as rx:
        setup(path, {"down": rx.url}, messages)
        d = dispatcher(path, clock=clock, concurrency=16, batch_size=64)
        with lines() as said:
            async with running(d):
                await until(lambda: circuit(path, "down")["state"] == "open")
                opened_ms = clock()
                in_flight_at_open = switch.refused
                # 20 s of outage, in steps of half a second of the store's time
                while clock() - opened_ms < 20_000:
                    clock.offset_ms += 500
                    await asyncio.sleep(0.01)
                    if switch.refused > in_flight_at_open + 5:
                        break  # (never: asserted below)
                down_requests = switch.refused
                switch.down = False
                # the next probe: its cool-down waited out on the store's clock
                open_until = circuit(path, "down")["open_until_ms"]
                if open_until is not None and open_until > clock():
                    clock.offset_ms += open_until - clock() + 1
                await until(lambda: statuses(path)["down"]["done"] == messages, timeout=120)
                outage_lines = [r for r in said.records]
        assert statuses(path)["down"] == {"ready": 0, "in_flight": 0, "done": messages,
                                          "dead": 0}
        assert len(switch.applied) == messages and set(switch.applied.values()) == {1}
        failed = attempts_of(path, "down")
        assert failed == down_requests  # every request while down is one attempts row
        # the sends in flight when it opened, then one probe per cool-down: 5 s, 10 s
        # (20 s of outage), none of the other 9,9xx deliveries attempted
        probes = audit(path, "down").count("reopened")
        assert 1 <= probes <= 3
        assert failed <= 16 + 32 + probes, (failed, probes)
        assert failed - in_flight_at_open <= probes
        assert audit(path, "down")[0] == "opened" and audit(path, "down")[-1] == "closed"
        assert circuit(path, "down")["attempts_saved"] > messages - 100
        messages_said = [r.getMessage() for r in outage_lines]
        assert len(outage_lines) <= 50, messages_said
        assert len(said.said("circuit opened:")) == 1
        assert len(said.said("circuit opened again")) == probes
        assert len(said.said("circuit closed")) == 1
        summaries = said.said("failed in the last")
        assert 1 <= len(summaries) <= 4, summaries
        # each retry logged alone is one of the first failures before the threshold
        assert len(said.said("retry")) <= BREAKER.open_after
        print("\n".join(messages_said))
        print(f"\noutage: {len(outage_lines)} log lines, {failed} failed attempts "
              f"({in_flight_at_open} in flight when it opened, {probes} failed probes), "
              f"{circuit(path, 'down')['attempts_saved']} attempts saved")


async def test_one_endpoint_down_the_other_two_keep_being_delivered(tmp_path: Path):
    path = tmp_path / "queue.db"
    messages = 300
    ups = [Switch(down=False), Switch(down=False)]
    down = Switch(down=True)
    async with receiver(None, host=HOST, answer=ups[0].answer) as a, \
            receiver(None, host=HOST, answer=ups[1].answer) as b, \
            receiver(None, host=HOST, answer=down.answer) as c:
        setup(path, {"a": a.url, "b": b.url, "c": c.url}, messages)
        d = dispatcher(path, concurrency=8, batch_size=16)
        async with running(d):
            await until(lambda: all(statuses(path)[name]["done"] == messages
                                    for name in ("a", "b")), timeout=60)
            assert circuit(path, "c")["state"] in ("open", "half-open")
            assert d.circuits()["endpoints"]["c"]["condition"] in ("open", "half-open")
        assert statuses(path)["c"]["done"] == 0 and statuses(path)["c"]["dead"] == 0
        # c's attempts: the ones in flight when it opened, and a probe per cool-down
        assert down.refused == attempts_of(path, "c") <= 8 + 16 + 2
        for switch in ups:
            assert len(switch.applied) == messages and set(switch.applied.values()) == {1}


async def test_a_retry_after_reaches_the_store_and_pauses_the_endpoint(tmp_path: Path):
    path = tmp_path / "queue.db"
    busy = Switch(down=True, status=429, retry_after="30")
    async with receiver(None, host=HOST, answer=busy.answer) as rx:
        setup(path, {"busy": rx.url}, 20)
        d = dispatcher(path, concurrency=1, batch_size=1, prefetch=0)
        with lines() as said:
            async with running(d):
                await until(lambda: "paused" in audit(path, "busy"))
                await until(lambda: bool(said.said("paused by a Retry-After")))
                await until(lambda: d.circuits()["endpoints"]["busy"]["condition"] == "paused")
            now_ms = int(time.time() * 1000)
            paused_until = circuit(path, "busy")["paused_until_ms"]
            assert now_ms + 20_000 < paused_until <= now_ms + 30_000
            assert busy.refused == attempts_of(path, "busy") == 1  # paused: nothing more sent
        [line] = said.said("paused by a Retry-After")
        assert "no delivery sent for 29 s" in line or "no delivery sent for 30 s" in line


async def test_metrics_and_status_name_the_endpoints_that_are_not_closed(tmp_path: Path):
    path = tmp_path / "queue.db"
    up, down = Switch(down=False), Switch(down=True)
    async with receiver(None, host=HOST, answer=up.answer) as a, \
            receiver(None, host=HOST, answer=down.answer) as b:
        setup(path, {"up": a.url, "down": b.url}, 50)
        for label in (True, False):
            d = dispatcher(path, concurrency=4, batch_size=8, endpoint_label=label)
            runner, url = await start_metrics_server(d, HOST, 0)
            try:
                async with running(d), aiohttp.ClientSession() as session:
                    await until(lambda d=d: d.circuits()["endpoints"].get("down", {}).get(
                        "condition") == "open")
                    async with session.get(f"{url}/status") as answer:
                        assert answer.status == 200
                        status = await answer.json()
                    async with session.get(f"{url}/healthz") as answer:
                        assert answer.status == 200  # the dispatcher is fine
                    async with session.get(f"{url}/metrics") as answer:
                        text = await answer.text()
            finally:
                await runner.cleanup()
            assert status["endpoints"]["open"] == ["down"]
            assert status["closed"] == 1 and status["degraded"] is True
            assert status["circuits"]["down"]["why"].startswith("5 failures in a row")
            assert 'asyncworker_endpoints_by_circuit{state="open"} 1.0' in text
            assert 'asyncworker_endpoints_by_circuit{state="closed"} 1.0' in text
            if label:
                assert ('asyncworker_endpoint_circuit{endpoint="down",state="open"} 1.0'
                        in text)
                assert 'asyncworker_endpoint_attempts_saved_total{endpoint="down"}' in text
            else:
                assert 'endpoint="' not in text
                assert "asyncworker_endpoint_attempts_saved_total " in text


async def test_a_dispatcher_started_during_an_outage_says_so_once(tmp_path: Path):
    path = tmp_path / "queue.db"
    down = Switch(down=True)
    async with receiver(None, host=HOST, answer=down.answer) as rx:
        setup(path, {"down": rx.url}, 30)
        async with running(dispatcher(path, concurrency=2, batch_size=2)):
            await until(lambda: circuit(path, "down")["state"] == "open")
        with lines() as said:
            d = dispatcher(path, concurrency=2, batch_size=2)
            async with running(d):
                await until(lambda: d.circuits()["as_of_ms"] is not None)
                await until(lambda: len(d.circuits()) > 0 and d._routes is not None
                            and d._routes.watches >= 3)
        found = said.said("found open")
        assert len(found) == 1 and "failures in a row" in found[0]
        assert not said.said("circuit opened")  # the change before its start is not told again


class GoesDown(Switch):
    """Up for its first ``after`` deliveries, then down (503)."""

    def __init__(self, after: int) -> None:
        super().__init__(down=False)
        self.after = after

    async def answer(self, seen: Seen) -> web.StreamResponse:
        if not self.down and len(self.applied) >= self.after:
            self.down = True
        return await super().answer(seen)


async def test_deliveries_waiting_in_line_when_the_circuit_opens_are_released_not_sent(
        tmp_path: Path):
    """Claimed deliveries not yet on the wire when the dispatcher's own
    failures open the circuit are given back to the store, unsent and with
    no attempt spent: the endpoint sees the sends that were in flight when
    the first failure was judged, and nothing more but the probes."""
    path = tmp_path / "queue.db"
    concurrency, prefetch = 8, 16
    switch = GoesDown(after=200)
    async with receiver(None, host=HOST, answer=switch.answer) as rx:
        setup(path, {"down": rx.url}, 1000)
        d = dispatcher(path, concurrency=concurrency, batch_size=16, prefetch=prefetch)
        async with running(d):
            await until(lambda: circuit(path, "down")["state"] == "open")
            # every claimed delivery delivered, refused, or given back (none left leased)
            await until(lambda: d.stats.in_flight == 0 and len(switch.applied) + switch.refused
                        + d.stats.released == d.stats.claimed)
            refused, released, claimed = switch.refused, d.stats.released, d.stats.claimed
            delivered = len(switch.applied)
            saved = circuit(path, "down")["attempts_saved"]
            pending_unspent = [row for row in SQLiteStore(path).jobs_with_status("pending")
                               if row["attempts"] == 0]
        probes = audit(path, "down").count("reopened")
    assert delivered + refused + released == claimed, (delivered, refused, released, claimed)
    # on the wire: only those in flight when the first failure was judged (and the probes)
    assert refused <= concurrency + probes, (refused, released)
    assert released >= 1, (refused, released)
    assert saved >= released
    assert len(pending_unspent) >= released  # released: their attempt not spent
    print(f"\nreleased {released}, refused {refused} while down, {probes} failed probes")
