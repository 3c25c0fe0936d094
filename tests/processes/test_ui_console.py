"""The page as a console, through aiohttp's test client over a real SQLite
file and a real PostgreSQL database: the blocked keys with their dead heads,
and an auto-refresh with no script (a ``Refresh`` header) that the operator
turns off and on, never on a page where a note may be being typed."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.stores import open_store

ONE_TRY = RetryPolicy(max_attempts=1)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Key "cart-7" blocked by its dead first job with two behind it; key
    "cart-9" delivered; an unkeyed dead job (no key to block)."""
    name = (str(tmp_path / "queue.db") if request.param == "sqlite"
            else request.getfixturevalue("postgres_url"))
    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": f"c7-{i}", "body": {"n": i}, "key": "cart-7"}
                              for i in range(3)]
                             + [{"id": "c9-0", "body": {"n": 0}, "key": "cart-9"},
                                {"id": "loose", "body": {"n": 0}}], ONE_TRY)
        leased = {job.ticket["id"]: job for job in store.claim_jobs("w", 10_000, 10).leased}
        assert sorted(leased) == ["c7-0", "c9-0", "loose"]
        now = store.now_ms()
        store.finish_jobs([(leased["c7-0"].ticket, "permanent", 0, Attempt(now, 1, 422)),
                           (leased["loose"].ticket, "permanent", 0, Attempt(now, 1, 422)),
                           (leased["c9-0"].ticket, "ok", 0, Attempt(now, 1, 200))])
    return name


@asynccontextmanager
async def page(target: str, **settings: object) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ui_app(target, **settings))) as client:  # type: ignore[arg-type]
        yield client


async def test_the_blocked_keys_with_their_dead_heads_and_how_many_wait(target: str):
    async with page(target) as client:
        text = html.unescape(await (await client.get("/blocked")).text())
        rows = re.findall(r"<tr><td><a [^>]*><code>([^<]+)</code></a></td>\s*<td>([^<]*)</td>"
                          r"\s*<td><a class=\"head\" href=\"([^\"]+)\"><code>([^<]+)</code>"
                          r"</a></td>\s*<td>([^<]+)</td><td class=\"n\">(\d+)</td>", text)
        assert [(key, head, reason, waiting) for key, _, _, head, reason, waiting in rows] == [
            ("cart-7", "c7-0", "permanent", "2")]
        assert rows[0][2] == "/job?id=c7-0"  # its page offers redrive and cancel
        data = await (await client.get("/blocked", params={"format": "json"})).json()
        assert data == {"blocked": [{"key": "cart-7", "endpoint": None, "id": "c7-0",
                                     "reason": "permanent", "waiting": 2}]}
        overview = await (await client.get("/")).text()
        assert 'id="blocked-link" href="/blocked"' in overview
    with open_store(target) as store:
        assert store.cancel_jobs(["c7-0"], "given up") == [True]
    async with page(target) as client:
        assert "no key is blocked" in await (await client.get("/blocked")).text()


async def csrf_of(client: TestClient, path: str = "/") -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"',
                      await (await client.get(path)).text())
    assert found
    return found.group(1)


async def test_pages_refresh_themselves_until_the_operator_turns_it_off(target: str):
    async with page(target) as client:
        for path in ("/", "/jobs", "/endpoints", "/blocked", "/dead", "/job?id=c7-0"):
            answer = await client.get(path)
            assert answer.headers.get("Refresh") == "10", path
            assert "auto-refresh every 10 s" in await answer.text()
        assert "Refresh" not in (await client.get("/", params={"format": "json"})).headers
        csrf = await csrf_of(client)
        off = await client.post("/refresh", data={"csrf": csrf, "to": "off", "next": "/jobs"},
                                allow_redirects=False)
        assert off.status == 303 and off.headers["Location"] == "/jobs"
        answer = await client.get("/jobs")
        assert "Refresh" not in answer.headers and "auto-refresh off" in await answer.text()
        on = await client.post("/refresh", data={"csrf": csrf, "to": "on", "next": "/"},
                               allow_redirects=False)
        assert on.status == 303
        assert (await client.get("/")).headers.get("Refresh") == "10"


async def test_a_page_with_a_change_form_never_reloads_under_a_note(target: str):
    async with page(target, allow_changes=True) as client:
        for path in ("/dead", "/job?id=c7-0"):
            answer = await client.get(path)
            assert "Refresh" not in answer.headers, path
            assert 'id="refresh-state"' not in await answer.text()
        assert (await client.get("/")).headers.get("Refresh") == "10"


async def test_the_refresh_switch_needs_the_csrf_token_and_stays_on_this_site(target: str):
    async with page(target) as client:
        refused = await client.post("/refresh", data={"csrf": "0" * 64, "to": "off"},
                                    allow_redirects=False)
        assert refused.status == 403
        csrf = await csrf_of(client)
        bad = await client.post("/refresh", data={"csrf": csrf, "to": "sometimes"},
                                allow_redirects=False)
        assert bad.status == 400
        away = await client.post("/refresh", data={"csrf": csrf, "to": "off",
                                                   "next": "https://evil.example/"},
                                 allow_redirects=False)
        assert away.status == 303 and away.headers["Location"] == "/"
