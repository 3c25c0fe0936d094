"""One job redriven or cancelled from its own page, through aiohttp's test
client over a real SQLite file and a real PostgreSQL database: the forms its
status allows, a note required, the audit row with the actor, a pending job
cancelled before it is sent, a job whose status moved refused (409) with the
store's words, and read-only refusing it."""

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
    name = (str(tmp_path / "queue.db") if request.param == "sqlite"
            else request.getfixturevalue("postgres_url"))
    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": "dead-1", "body": {"n": 1}},
                              {"id": "waiting", "body": {"n": 2}}], ONE_TRY)
        [dead] = store.claim_jobs("worker-1", 10_000, 1).leased
        assert dead.ticket["id"] == "dead-1"
        store.finish_jobs([(dead.ticket, "permanent", 0, Attempt(store.now_ms(), 3, 422))])
    return name


@asynccontextmanager
async def page(target: str, **settings: object) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ui_app(target, **settings))) as client:  # type: ignore[arg-type]
        yield client


async def job_page(client: TestClient, job_id: str) -> tuple[str, str | None]:
    text = await (await client.get("/job", params={"id": job_id})).text()
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
    return text, None if found is None else found.group(1)


def status_of(target: str, job_id: str) -> tuple[str, str | None, int]:
    with open_store(target, read_only=True) as store:
        history = store.job_history(job_id)
    assert history is not None
    row = history["job"]
    return row["status"], row["reason"], len(history["redrives"]) + len(history["cancels"])


async def test_a_dead_job_offers_redrive_and_cancel_a_pending_one_cancel(target: str):
    async with page(target, allow_changes=True) as client:
        dead, _ = await job_page(client, "dead-1")
        assert 'id="redrive-form"' in dead and 'id="cancel-form"' in dead
        waiting, _ = await job_page(client, "waiting")
        assert 'id="cancel-form"' in waiting and 'id="redrive-form"' not in waiting
    async with page(target) as client:  # read-only: no form, and it says how
        text, _ = await job_page(client, "dead-1")
        assert "<form" not in text.split('id="actions"')[1].split("</section>")[0]
        assert "--allow-changes" in text


async def test_a_dead_job_redriven_from_its_page_with_its_note_and_actor(target: str):
    async with page(target, allow_changes=True, operator="carol") as client:
        _, csrf = await job_page(client, "dead-1")
        answer = await client.post("/job/redrive", data={
            "csrf": csrf, "id": "dead-1", "note": "receiver fixed", "ttl_ms": "600000"})
        text = await answer.text()
        assert answer.status == 200, text[:600]
        assert "redriven" in text and 'id="redrive-form"' not in text  # pending now
    assert status_of(target, "dead-1")[:2] == ("pending", None)
    with open_store(target, read_only=True) as store:
        history = store.job_history("dead-1")
    assert history is not None
    [row] = history["redrives"]
    assert (row["note"], row["actor"]) == ("receiver fixed", "carol")
    # the fresh budget is the time to live given
    assert history["job"]["deadline"] - row["at_ms"] == 600_000


async def test_a_pending_job_cancelled_before_it_is_sent(target: str):
    async with page(target, allow_changes=True) as client:
        _, csrf = await job_page(client, "waiting")
        answer = await client.post("/job/cancel", data={"csrf": csrf, "id": "waiting",
                                                        "note": "order withdrawn"})
        assert answer.status == 200
        assert "cancelled" in await answer.text()
    assert status_of(target, "waiting") == ("dead", "cancelled", 1)
    with open_store(target) as store:  # and no claim takes it
        assert store.claim_jobs("worker-2", 10_000, 10).leased == []


async def test_a_job_whose_status_moved_is_refused_409_with_the_stores_words(target: str):
    async with page(target, allow_changes=True) as client:
        _, csrf = await job_page(client, "waiting")  # the page showed a pending job
        with open_store(target) as store:  # meanwhile a dispatcher delivered it
            [leased] = store.claim_jobs("worker-1", 10_000, 1).leased
            store.finish_jobs([(leased.ticket, "ok", 0, Attempt(store.now_ms(), 2, 200))])
        answer = await client.post("/job/redrive", data={"csrf": csrf, "id": "waiting",
                                                         "note": "send again"})
        text = html.unescape(await answer.text())
        assert answer.status == 409
        assert "no longer dead" in text or "not redriven" in text
    assert status_of(target, "waiting") == ("done", None, 0)


@pytest.mark.parametrize(("form", "words"), [
    ({"id": "dead-1"}, "a note is required"),
    ({"id": "dead-1", "note": "   "}, "a note is required"),
    ({"id": "", "note": "n"}, "id must be"),
    ({"id": "dead-1", "note": "n", "ttl_ms": "0"}, "ttl_ms must be"),
])
async def test_a_bad_form_is_refused_400_and_changes_nothing(target: str, form: dict,
                                                             words: str):
    async with page(target, allow_changes=True) as client:
        _, csrf = await job_page(client, "dead-1")
        answer = await client.post("/job/redrive", data={"csrf": csrf, **form})
        assert answer.status == 400
        assert words in html.unescape(await answer.text())
    assert status_of(target, "dead-1") == ("dead", "permanent", 0)


async def test_no_change_without_the_csrf_token_or_in_read_only_mode(target: str):
    async with page(target, allow_changes=True) as client:
        answer = await client.post("/job/cancel", data={"csrf": "0" * 64, "id": "waiting",
                                                        "note": "n"})
        assert answer.status == 403
    async with page(target) as client:
        answer = await client.post("/job/cancel", data={"csrf": "0" * 64, "id": "waiting",
                                                        "note": "n"})
        assert answer.status == 403
    assert status_of(target, "waiting") == ("pending", None, 0)


async def test_a_job_page_shows_its_priority(target: str) -> None:
    with open_store(target) as store:
        store.enqueue_events([{"id": "urgent", "body": {"n": 1}, "priority": 7}])
    async with page(target) as client:
        text = await (await client.get("/job", params={"id": "urgent"})).text()
    assert '<td id="priority">7</td>' in text
