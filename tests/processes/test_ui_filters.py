"""The jobs' and dead letters' filters by error text, HTTP status and time
range, kept in the URL (the next page's link carries them), a bad one 400
with a clear message, and a bulk change of what they match (the dry run and
its confirmation carry them), over SQLite and PostgreSQL."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from lease.stores import open_store
from tests.support.queues import dead_after_410_and_a_timeout


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Three deliveries dead after a 410 and one after a timeout."""
    return dead_after_410_and_a_timeout(
        str(tmp_path / "queue.db") if request.param == "sqlite"
        else request.getfixturevalue("postgres_url"))


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
        # the bulk form is offered with the filter, and carries it on
        assert 'action="/dead/preview"' in text
        assert '<input type="hidden" name="error" value="410">' in text
        assert listed(await (await client.get("/jobs", params={"http_status": "4xx"})).text()
                      ) == ["gone:0", "gone:1", "gone:2"]
        assert listed(await (await client.get("/jobs", params={"error": "timed out"})).text()
                      ) == ["slow"]
        assert len(listed(await (await client.get("/jobs", params={"from": today})).text())
                   ) == 4
        assert listed(await (await client.get("/jobs", params={"to": today})).text()) == []


@pytest.mark.parametrize("query, words", [
    ({"http_status": "4x"}, "HTTP status must be"), ({"from": "yesterday"}, "from must be"),
    ({"from": "2026-01-02T00:00", "to": "2026-01-01T00:00"}, "must be after"),
    ({"error": "a\tb"}, "error must be")])
async def test_a_bad_filter_is_400_with_a_clear_message(target, query, words):
    async with TestClient(TestServer(ui_app(target))) as client:  # type: ignore[arg-type]
        answer = await client.get("/jobs", params=query)
        assert answer.status == 400 and words in await answer.text()


async def test_a_bulk_redrive_takes_the_error_status_and_time_filters(target):
    today = time.strftime("%Y-%m-%dT00:00", time.gmtime())
    async with TestClient(TestServer(ui_app(target, allow_changes=True))) as client:  # type: ignore[arg-type]
        page = await (await client.get("/dead")).text()
        csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)  # type: ignore[union-attr]
        form = {"csrf": csrf, "action": "redrive", "note": "the receiver is back",
                "http_status": "4xx", "from": today}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        assert (dry["count"], dry["sample"], dry["http_status"]) == (
            3, ["gone:0", "gone:1", "gone:2"], "4xx")
        timed_out = await (await client.post("/dead/preview?format=json", data={
            **form, "http_status": "", "error": "timed out"})).json()
        assert (timed_out["count"], timed_out["sample"]) == (1, ["slow"])
        assert timed_out["fingerprint"] != dry["fingerprint"]
        # the fingerprint of one filter does not confirm another: nothing changes
        wider = await client.post("/dead/apply?format=json", data={
            **form, "http_status": "", "fingerprint": dry["fingerprint"]})
        assert wider.status == 409
        # nor that of another filter matching the same set today (410 or 4xx)
        same_set = await client.post("/dead/apply?format=json", data={
            **form, "http_status": "410", "fingerprint": dry["fingerprint"]})
        assert same_set.status == 409
        with open_store(target, read_only=True) as store:
            assert len(store.jobs_with_status("dead")) == 4
        done = await client.post("/dead/apply?format=json", data={
            **form, "fingerprint": dry["fingerprint"]})
        assert done.status == 200, await done.text()
        assert (await done.json())["counts"] == {"redriven": 3}
    with open_store(target, read_only=True) as store:
        assert [job["id"] for job in store.jobs_with_status("dead")] == ["slow"]
        assert sorted(job["id"] for job in store.jobs_with_status("pending")) == [
            "gone:0", "gone:1", "gone:2"]
