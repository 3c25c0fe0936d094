"""One scripted day, three views of it: the operator's page, the dispatcher's
/metrics and ``asyncworker stats --json`` say the same figures.

The day: a dispatcher whose lease runs out under a slow send has its
completion refused as stale, and the job is taken again and delivered; a receiver
absorbs a duplicate of an order it had already applied, an order the receiver
refuses for good goes dead, and an operator redrives it from the page.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from asyncworker import Dispatcher, make_app, metrics_app
from asyncworker.ui import ui_app
from lease.policy import RetryPolicy
from lease.stores import open_store
from lease.worker import Permanent
from tests.support.dispatching import FakeClock

LEASE_MS = 2_000
POLICY = RetryPolicy(max_attempts=5, ttl_ms=3_600_000, lease_ms=LEASE_MS)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "queue.db")
    return str(request.getfixturevalue("postgres_url"))


def cli_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def scraped(text: str) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_the_page_the_metrics_and_stats_agree_after_a_scripted_day(target: str,
                                                                          tmp_path: Path):
    with open_store(target, create=True) as store:
        # The dispatcher's clock starts a minute in the past, so every lease it
        # takes has already run out by the time the page and stats look.
        start = store.now_ms() - 60_000
        events = [{"id": "order-1", "qty": 1}, {"id": "order-2", "qty": 2},
                  {"id": "slow", "qty": 3}, {"id": "refused", "qty": 4}]
        assert store.enqueue_events(events, POLICY, now_ms=start) == [True] * 4
    clock = FakeClock(start)
    receiver, base = await _start(make_app(str(tmp_path / "inbox.db")))
    try:
        async with aiohttp.ClientSession() as http:
            # order-2 was applied once already (a dispatcher died after the receiver's
            # commit); "refused" exists at the receiver with another quantity: 409
            for event in ({"id": "order-2", "qty": 2}, {"id": "refused", "qty": 9}):
                async with http.post(f"{base}/events", json=event) as answer:
                    assert answer.status == 200
            release = asyncio.Event()

            async def send(event: dict, token: int) -> object:
                if event["id"] == "slow" and token == 1:  # its first lease runs out under it
                    while d.stats.ok + d.stats.dead < 3:  # the others are recorded
                        await asyncio.sleep(0.01)
                    clock.now = start + LEASE_MS + 1
                    await release.wait()
                async with http.post(f"{base}/events", json=event) as answer:
                    if answer.status == 409:
                        raise Permanent("HTTP 409: the receiver holds other content")
                    return (await answer.json()).get("id") == event["id"]

            d = Dispatcher(target, "host-a", send=send, clock=clock, policy=POLICY,
                           concurrency=4, batch_size=4)
            async with d:
                running = asyncio.create_task(d.run())
                for _ in range(2000):  # the slow send cut off and refused as stale ...
                    if d.stats.stale:
                        break
                    await asyncio.sleep(0.01)
                release.set()
                for _ in range(2000):  # ... and its job taken again and delivered
                    if d.stats.ok == 3:
                        break
                    await asyncio.sleep(0.01)
                d.stop()
                await asyncio.wait_for(running, 30)
                metrics_runner, metrics_base = await _start(metrics_app(d))
                try:
                    async with http.get(f"{metrics_base}/metrics") as answer:
                        metrics = scraped(await answer.text())
                finally:
                    await metrics_runner.cleanup()
            async with http.get(f"{base}/stats") as answer:
                receiver_stats = await answer.json()
        assert (d.stats.ok, d.stats.stale, d.stats.dead_by_reason["permanent"]) == (3, 1, 1)

        def metric(name: str, **labels: str) -> float:
            return metrics[(f"asyncworker_{name}", frozenset(labels.items()))]

        before = cli_json("stats", target, "--json")
        async with TestClient(TestServer(ui_app(target, allow_changes=True,
                                                receiver_url=f"{base}/stats"))) as page:
            shown = await (await page.get("/?format=json")).json()
            # the operator redrives the dead order from the page: dry run, then confirm
            dead_page = await (await page.get("/dead")).text()
            csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', dead_page)
            assert csrf is not None
            form = {"csrf": csrf.group(1), "action": "redrive", "reason": "permanent",
                    "note": "receiver fixed"}
            preview = await page.post("/dead/preview", data=form)
            assert preview.status == 200, await preview.text()
            confirm = dict(re.findall(r'name="([a-z_]+)" value="([^"]*)"', await preview.text()))
            done = await page.post("/dead/apply", data=confirm)
            assert done.status == 200, await done.text()
            assert "redriven" in await done.text()
            after_page = await (await page.get("/?format=json")).json()
        after = cli_json("stats", target, "--json")
    finally:
        await receiver.cleanup()

    # the page says what stats says, before and after the redrive
    for key in ("by_status", "dead_by_reason", "expired_leases", "live_leases",
                "stale_finishes", "redrives_last_day", "cancels_last_day"):
        assert shown[key] == before[key], key
        assert after_page[key] == after[key], key
    # ... and what the dispatcher's metrics counted in its run
    assert shown["stale_finishes"] == metric("stale_completions_refused_total") == 1
    assert shown["dead_by_reason"] == {"permanent": 1}
    assert metric("jobs_dead_total", reason="permanent") == 1
    assert shown["by_status"]["done"] == metric("jobs_done_total") == 3
    assert metric("jobs_claimed_total") == 5  # the slow job twice: its lease expired once
    # the receiver: order-2 applied once, its second arrival absorbed as a duplicate
    assert shown["receiver"]["duplicates"] == receiver_stats["duplicates"] == 1
    assert after["redrives_last_day"] == 1 and after["dead_by_reason"] == {}
    assert after["by_status"]["pending"] == 1  # the redriven order waits for its next attempt
