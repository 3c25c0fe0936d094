"""The charts of the last hour and day, drawn on the server as SVG from the
per-minute rollup: on the overview (the queue) and on an endpoint's page,
with a bar for each period that had deliveries, a <title>, a table of the
same figures, and the page's policy unchanged (no script, no style)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from asyncworker.ui.charts import periods
from lease.endpoints import Endpoint
from lease.records import Attempt
from lease.rules import MINUTE_MS
from lease.stores import open_store


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = (str(tmp_path / "queue.db") if request.param == "sqlite"
            else request.getfixturevalue("postgres_url"))
    with open_store(name, create=True) as store:
        store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/c"))
        store.enqueue_events([{"id": f"m{i}", "body": {"n": i}, "type": "user"}
                              for i in range(3)])
        leased = store.claim_jobs("d1", 60_000, 3, endpoints="*").leased
        now = store.now_ms()
        store.finish_jobs([(leased[0].ticket, "ok", 0, Attempt(now, 40, 200)),
                           (leased[1].ticket, "ok", 0, Attempt(now, 400, 200)),
                           (leased[2].ticket, "retry", 0, Attempt(now, 9, 503))])
    return name


async def test_the_overview_and_the_endpoint_draw_the_minute_that_had_deliveries(target):
    async with TestClient(TestServer(ui_app(target))) as client:  # type: ignore[arg-type]
        for path in ("/", "/endpoint?name=crm"):
            answer = await client.get(path)
            text = await answer.text()
            assert answer.status == 200, text[:600]
            assert "default-src 'none'" in answer.headers["Content-Security-Policy"]
            assert "<script" not in text and "style=" not in text
            hour = text.split('id="', 1)[1]
            svgs = re.findall(r'<svg [^>]*id="([^"]+)"', text)
            assert len(svgs) == 4, svgs  # outcomes and latency, for the hour and the day
            done = re.findall(r'<rect class="bar done"[^>]*data-count="(\d+)"', text)
            retried = re.findall(r'<rect class="bar retried"[^>]*data-count="(\d+)"', text)
            assert done == ["2", "2"] and retried == ["1", "1"]  # one bar in each span
            assert text.count('<polyline class="line p50"') == 2
            assert "<title" in hour and "Deliveries per period, the last hour" in text
            assert re.search(r"<td class=\"n\">2</td><td class=\"n\">1</td>", text)


def test_a_period_sums_its_minutes_and_the_rest_are_empty():
    now = 10 * MINUTE_MS + 5
    rows = [{"minute_ms": 9 * MINUTE_MS, "done": 1, "retried": 0, "dead": 0,
             "buckets": [1] + [0] * 15},
            {"minute_ms": 10 * MINUTE_MS, "done": 2, "retried": 1, "dead": 1,
             "buckets": [0, 2] + [0] * 14},
            {"minute_ms": 0, "done": 5, "retried": 0, "dead": 0, "buckets": [0] * 16}]
    hour = periods(rows, now, 3, 1)
    assert [(p.start_ms, p.total) for p in hour] == [
        (8 * MINUTE_MS, 0), (9 * MINUTE_MS, 1), (10 * MINUTE_MS, 4)]
    [wide] = periods(rows, now, 1, 15)  # 15 minutes ending with the current one
    assert (wide.done, wide.buckets[:2]) == (8, [1, 2])
