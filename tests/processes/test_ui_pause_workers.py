"""The queue paused and resumed from the page, through aiohttp's test client
over a real SQLite file and a real PostgreSQL database: a note and the CSRF
token required, the audit row with the actor, the overview's banner, a claim
leasing nothing while paused, and read-only refusing it; the dispatchers at
work."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from lease.stores import open_store


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = (str(tmp_path / "queue.db") if request.param == "sqlite"
            else request.getfixturevalue("postgres_url"))
    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": "waiting", "body": {"n": 1}}])
    return name


@asynccontextmanager
async def page(target: str, **settings: object) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ui_app(target, **settings))) as client:  # type: ignore[arg-type]
        yield client


async def csrf_of(client: TestClient) -> str:
    text = await (await client.get("/pause")).text()
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
    assert found is not None, text[:600]
    return found.group(1)


async def test_paused_from_the_page_then_resumed_each_audited(target: str):
    async with page(target, allow_changes=True, operator="carol") as client:
        assert 'id="pause-form"' in await (await client.get("/pause")).text()
        answer = await client.post("/pause", data={"csrf": await csrf_of(client),
                                                   "note": "receiver upgrade"})
        text = await answer.text()
        assert answer.status == 200, text[:600]
        assert "paused" in text and 'id="resume-form"' in text
        with open_store(target) as store:
            assert store.claim_jobs("w", 10_000, 10).leased == []
        overview = await (await client.get("/")).text()
        assert 'id="paused-banner"' in overview and "by carol (receiver upgrade)" in overview
        state = await (await client.get("/", params={"format": "json"})).json()
        assert state["paused"]["actor"] == "carol"
        answer = await client.post("/resume", data={"csrf": await csrf_of(client),
                                                    "note": "done"})
        assert answer.status == 200
        assert 'id="paused-banner"' not in await (await client.get("/")).text()
    with open_store(target) as store:
        assert [(row["action"], row["note"], row["actor"]) for row in store.queue_audit()] == [
            ("pause", "receiver upgrade", "carol"), ("resume", "done", "carol")]
        assert [one.ticket["id"] for one in store.claim_jobs("w", 10_000, 10).leased] == [
            "waiting"]


async def test_a_pause_needs_a_note_and_the_csrf_token(target: str):
    async with page(target, allow_changes=True) as client:
        csrf = await csrf_of(client)
        assert (await client.post("/pause", data={"csrf": csrf, "note": " "})).status == 400
        assert (await client.post("/pause", data={"note": "why"})).status == 403
    with open_store(target, read_only=True) as store:
        assert store.paused() is None


async def test_a_read_only_page_shows_the_state_and_refuses_a_pause(target: str):
    with open_store(target) as store:
        store.pause("hold", actor="ops")
    async with page(target) as client:
        text = await (await client.get("/pause")).text()
        assert "<form" not in text.split("<h1>")[1] and "--allow-changes" in text
        assert "Paused since" in text and "by ops (hold)" in text
        assert (await client.post("/resume", data={"note": "go"})).status == 403
    with open_store(target, read_only=True) as store:
        assert store.paused() is not None


async def test_the_dispatchers_at_work_with_their_live_leases(target: str):
    with open_store(target) as store:
        store.register_worker("d1", "host-a", 4242)
        store.claim_jobs("d1", 600_000, 1)
    async with page(target) as client:
        text = await (await client.get("/workers")).text()
        assert "<code>d1</code>" in text and "host-a" in text and "4242" in text
        [row] = await (await client.get("/workers", params={"format": "json"})).json()
        assert (row["owner"], row["live_leases"], row["last_claimed"]) == ("d1", 1, 1)
