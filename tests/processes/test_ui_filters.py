"""The jobs' and dead letters' filters by error text, HTTP status and time
range, kept in the URL (the next page's link carries them), a bad one 400
with a clear message, and the bulk form withheld while one is set (a bulk
change cannot take them), over SQLite and PostgreSQL."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.stores import open_store


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = (str(tmp_path / "queue.db") if request.param == "sqlite"
            else request.getfixturevalue("postgres_url"))
    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": f"gone:{i}", "body": {"n": i}} for i in range(3)]
                             + [{"id": "slow", "body": {"n": 9}}], RetryPolicy(max_attempts=1))
        claimed = store.claim_jobs("d1", 60_000, 4)
        now = claimed.now_ms
        gone = Attempt(now, 5, 410, "HTTPError: 410 Gone")
        slow = Attempt(now, 9000, None, "TimeoutError: timed out")
        store.finish_jobs([(one.ticket, "permanent", 0, slow if one.ticket["id"] == "slow"
                            else gone) for one in claimed.leased])
    return name


def listed(text: str) -> list[str]:
    return re.findall(r'href="/job\?id=([^"&]+)"', text)


async def test_filtered_by_error_status_and_time_with_the_filter_kept_in_the_next_link(target):
    today = time.strftime("%Y-%m-%dT00:00", time.gmtime())
    async with TestClient(TestServer(ui_app(target, allow_changes=True))) as client:  # type: ignore[arg-type]
        text = await (await client.get("/dead", params={"error": "410", "limit": "2"})).text()
        assert listed(text) == ["gone:0", "gone:1"]
        [link] = re.findall(r'<a id="next" href="([^"]+)"', text)
        assert "error=410" in html.unescape(link)
        rest = await (await client.get(html.unescape(link))).text()
        assert listed(rest) == ["gone:2"]
        assert 'id="bulk-narrowed"' in text and 'action="/dead/preview"' not in text
        assert listed(await (await client.get("/jobs", params={"http_status": "4xx"})).text()
                      ) == ["gone:0", "gone:1", "gone:2"]
        assert listed(await (await client.get("/jobs", params={"error": "timed out"})).text()
                      ) == ["slow"]
        assert len(listed(await (await client.get("/jobs", params={"from": today})).text())
                   ) == 4
        assert listed(await (await client.get("/jobs", params={"to": today})).text()) == []
        plain = await (await client.get("/dead")).text()
        assert 'action="/dead/preview"' in plain  # the bulk form, without those filters


@pytest.mark.parametrize("query, words", [
    ({"http_status": "4x"}, "HTTP status must be"), ({"from": "yesterday"}, "from must be"),
    ({"from": "2026-01-02T00:00", "to": "2026-01-01T00:00"}, "must be after"),
    ({"error": "a\tb"}, "error must be")])
async def test_a_bad_filter_is_400_with_a_clear_message(target, query, words):
    async with TestClient(TestServer(ui_app(target))) as client:  # type: ignore[arg-type]
        answer = await client.get("/jobs", params=query)
        assert answer.status == 400 and words in await answer.text()
