"""The operator's page (asyncworker.ui) through aiohttp's test client, on a SQLite
file and on a real PostgreSQL database: every page, every refusal, the headers,
escaping, the token, the bulk change's dry run and its confirmation, and the
JSON of every page against what the CLI prints for the same queue."""

from __future__ import annotations

import html
import http.client
import json
import re
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlencode

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from asyncworker.ui.bulk import BulkRequest, Member, fingerprint, outcome
from asyncworker.ui.safety import SECURITY_HEADERS, parse_token_line
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.store import Store
from lease.stores import open_store
from tests.support.servers import ReceiverProcess, stop_process

XSS_ID = "<script>alert(1)</script>"
XSS_ATTR = "\"'><img src=x onerror=alert(1)>"
XSS_KEY = XSS_ATTR.replace(" ", "_")  # an ordering key has no space
TOKEN = "s3cret-token-of-the-operators"
ONE_TRY = RetryPolicy(max_attempts=1)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty queue: a SQLite file, or a fresh database on a real server."""
    if request.param == "sqlite":
        name = str(tmp_path / "queue.db")
    else:
        name = request.getfixturevalue("postgres_url")
    open_store(name, create=True).close()
    return name


@pytest.fixture
def sqlite_target(tmp_path: Path) -> str:
    name = str(tmp_path / "queue.db")
    open_store(name, create=True).close()
    return name


@asynccontextmanager
async def page(target: str, **settings: object) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ui_app(target, **settings))) as client:  # type: ignore[arg-type]
        yield client


def fail(store: Store, ids: list[str], outcome_: str, error: str | None = None,
         now_ms: int | None = None) -> None:
    """Claim exactly these (pending) jobs and finish them with ``outcome_``."""
    claimed = store.claim_jobs("worker-1", 10_000, len(ids), now_ms=now_ms)
    assert sorted(job.ticket["id"] for job in claimed.leased) == sorted(ids)
    items = [(job.ticket, outcome_, 0, Attempt(claimed.now_ms, 7, 500 if error is None else None,
                                               error)) for job in claimed.leased]
    store.finish_jobs(items, now_ms=now_ms)


def dead_letters(target: str, n: int, prefix: str = "dead:", error: str = "boom") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(n)]
    with open_store(target) as store:
        store.enqueue_events([{"id": job_id, "body": {"n": 1}} for job_id in ids], ONE_TRY)
        fail(store, ids, "permanent", error)
    return ids


def scenario(target: str) -> dict[str, str]:
    """Dead letters of three reasons, a lease that expired, a stale completion
    refused, a redrive, a cancel, work pending: each figure of the overview."""
    with open_store(target) as store:
        now = store.now_ms()
        past = now - 120_000
        store.enqueue_events([{"id": f"dead:{i}", "body": {"order": i}} for i in range(3)],
                             ONE_TRY, now_ms=past)
        claimed = store.claim_jobs("worker-1", 10_000, 3, now_ms=past + 1)
        tickets = {job.ticket["id"]: job.ticket for job in claimed.leased}
        store.finish_jobs([
            (tickets["dead:0"], "permanent", 0, Attempt(past + 1, 3, 422, None)),
            (tickets["dead:1"], "retry", 0, Attempt(past + 1, 4, None, "TimeoutError")),
            (tickets["dead:2"], "retry", 0, Attempt(past + 1, 5, 503, None)),
        ], now_ms=past + 2)
        # a stale completion: worker-1's lease ran out, worker-2 took the job over
        store.enqueue_events([{"id": "stolen", "qty": 2}], now_ms=past)
        [old] = store.claim_jobs("worker-1", 1000, 1, now_ms=now - 60_000).leased
        [new] = store.claim_jobs("worker-2", 600_000, 1).leased
        assert new.ticket["id"] == "stolen"
        assert store.finish_jobs([(old.ticket, "ok", 0, Attempt(now - 60_000, 9))]) == [False]
        # a lease that expired: its dispatcher went quiet
        store.enqueue_events([{"id": "quiet", "qty": 3}], now_ms=past)
        [quiet] = store.claim_jobs("worker-1", 1000, 1, now_ms=now - 60_000).leased
        assert quiet.ticket["id"] == "quiet"
        store.enqueue_events([{"id": "waiting", "qty": 4}, {"id": "unwanted", "qty": 5}])
        assert store.cancel_jobs(["unwanted"], "not needed", actor="alice") == [True]
        assert store.redrive_jobs(["dead:2"], 60_000, "receiver fixed", actor="bob") == [True]
    return {"stale": "stolen", "expired": "quiet"}


async def csrf_of(client: TestClient) -> str:
    text = await (await client.get("/dead")).text()
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
    assert found, text[:500]
    return found.group(1)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                          text=True, timeout=60)


def cli_json(*args: str) -> dict:
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def statuses(target: str) -> dict[str, tuple[str, str | None]]:
    with open_store(target, read_only=True) as store:
        found = {}
        for status in ("pending", "leased", "done", "dead"):
            for row in store.jobs_with_status(status):
                found[row["id"]] = (row["status"], row["reason"])
        return found


# ------------------------------------------------------------------ pages


PAGES = ["/", "/jobs", "/jobs?status=dead&reason=permanent&id_prefix=dead", "/job?id=dead:0",
         "/job?id=stolen&show=body", "/dead", "/dead?reason=exhausted", "/login"]


async def test_every_page_answers_as_html_and_json(target: str) -> None:
    scenario(target)
    async with page(target, allow_changes=True) as client:
        for path in PAGES:
            answer = await client.get(path)
            assert answer.status == 200, (path, await answer.text())
            assert answer.content_type == "text/html"
            assert "<h1>" in await answer.text()
            if path != "/login":
                sep = "&" if "?" in path else "?"
                as_json = await client.get(path + sep + "format=json")
                assert as_json.status == 200 and as_json.content_type == "application/json"
                await as_json.json()
        css = await client.get("/ui.css")
        assert css.status == 200 and css.content_type == "text/css"


async def test_security_headers_on_every_answer(sqlite_target: str) -> None:
    dead_letters(sqlite_target, 1)
    async with page(sqlite_target, token=TOKEN) as client:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        answers = [await client.get("/", headers=bearer), await client.get("/ui.css"),
                   await client.get("/login"), await client.get("/?format=json"),  # 401
                   await client.get("/nowhere", headers=bearer),  # 404
                   await client.get("/job?id=missing", headers=bearer),  # 404
                   await client.get("/jobs?status=lost", headers=bearer),  # 400
                   await client.post("/dead/apply", headers=bearer),  # 403 read-only
                   await client.get("/", allow_redirects=False)]  # 303 to the login
        assert [a.status for a in answers] == [200, 200, 200, 401, 404, 404, 400, 403, 303]
        for answer in answers:
            for name, value in SECURITY_HEADERS.items():
                assert answer.headers.get(name) == value, (answer.url, name)
        csp = SECURITY_HEADERS["Content-Security-Policy"]
        assert "script-src" not in csp and "frame-ancestors 'none'" in csp
        text = await answers[0].text()
        assert "<script" not in text and " style=" not in text  # nothing inline


async def test_jobs_filter_and_keyset_pagination_keep_the_filters(target: str) -> None:
    dead_letters(target, 7, prefix="tenant/7/")
    dead_letters(target, 3, prefix="tenant/8/")
    with open_store(target) as store:
        store.enqueue_events([{"id": f"tenant/7/p{i}", "body": {}} for i in range(4)])
    async with page(target) as client:
        seen: list[str] = []
        url: str | None = "/jobs?status=dead&id_prefix=tenant/7/&limit=3"
        while url is not None:
            answer = await client.get(url)
            text = await answer.text()
            seen += re.findall(r'class="job" href="[^"]*">([^<]+)</a>', text)
            found = re.search(r'id="next" href="([^"]+)"', text)
            url = None if found is None else found.group(1).replace("&amp;", "&")
            if url is not None:
                assert "status=dead" in url and "id_prefix=tenant/7/" in url, url
        assert seen == [f"tenant/7/{i}" for i in range(7)]
        first = await (await client.get("/jobs?format=json&limit=4&id_prefix=tenant/7/")).json()
        assert [j["id"] for j in first["jobs"]] == [f"tenant/7/{i}" for i in range(4)]
        after = first["next_after_seq"]
        second = await (await client.get(
            f"/jobs?format=json&limit=100&id_prefix=tenant/7/&after={after}")).json()
        assert [j["id"] for j in second["jobs"]] == (
            [f"tenant/7/{i}" for i in range(4, 7)] + [f"tenant/7/p{i}" for i in range(4)])
        assert second["next_after_seq"] is None
        pending = await (await client.get("/jobs?format=json&status=pending")).json()
        assert {j["id"] for j in pending["jobs"]} == {f"tenant/7/p{i}" for i in range(4)}
        for bad in ("status=lost", "reason=bored", "after=-1", "limit=0", "limit=x",
                    "format=xml", "id_prefix=a%20b"):
            answer = await client.get(f"/jobs?{bad}")
            assert answer.status == 400, bad
            assert "\n" not in (await answer.text()).split('id="refused">')[1].split("<")[0]


async def test_a_job_is_its_evidence_record(target: str) -> None:
    scenario(target)
    async with page(target) as client:
        text = await (await client.get("/job?id=dead:2")).text()
        assert "receiver fixed" in text and "bob" in text  # the redrive and its actor
        assert "HTTP 503" in text and "5 ms" in text  # the attempt: status and latency
        assert re.search(r'id="cli">asyncworker inspect \S+ dead:2<', text)
        cancelled = await (await client.get("/job?id=unwanted")).text()
        assert "not needed" in cancelled and "alice" in cancelled
        missing = await client.get("/job?id=nobody")
        assert missing.status == 404
        assert (await client.get("/job?id=")).status == 400


async def test_the_cli_command_shown_hides_the_password(postgres_url: str) -> None:
    open_store(postgres_url, create=True).close()
    dead_letters(postgres_url, 1)
    with_password = postgres_url.replace("://", "://nobody-but:", 1) \
        if "@" not in postgres_url else postgres_url
    async with page(postgres_url) as client:
        text = await (await client.get("/job?id=dead:0")).text()
        command = re.search(r'id="cli">([^<]+)<', text).group(1)  # type: ignore[union-attr]
        assert command.startswith("asyncworker inspect postgresql://")
        password = re.match(r"postgres(?:ql)?://[^:/@]+:([^@]+)@", with_password)
        if password:
            assert password.group(1) not in text


# ------------------------------------------------------------------ escaping


async def test_everything_a_job_carries_comes_back_escaped(sqlite_target: str) -> None:
    with open_store(sqlite_target) as store:
        store.enqueue_events([{"id": XSS_ID, "body": {"html": XSS_ATTR}},
                              {"id": "x" + XSS_ATTR.replace(" ", "_"), "body": {},
                               "key": XSS_KEY}], ONE_TRY)
        fail(store, [XSS_ID, "x" + XSS_ATTR.replace(" ", "_")], "permanent", XSS_ATTR)
        store.redrive_jobs([XSS_ID], 60_000, XSS_ID + XSS_ATTR)
    async with page(sqlite_target, allow_changes=True) as client:
        quoted = XSS_ID.replace("/", "%2F")
        by_key = urlencode({"key": XSS_KEY})
        for path in ("/jobs", "/dead", f"/job?id={quoted}", f"/job?id={quoted}&show=body",
                     "/job?id=x%22'%3E%3Cimg_src=x_onerror=alert(1)%3E", f"/dead?{by_key}",
                     f"/jobs?{by_key}"):
            answer = await client.get(path)
            assert answer.status == 200, path
            text = await answer.text()
            assert "<script>alert" not in text and "<img" not in text, path
            assert "&lt;" in text, path
        body = await (await client.get(f"/job?id={quoted}&show=body")).text()
        assert "&lt;img src=x onerror=alert(1)&gt;" in body  # the body, shown, as text
        hidden = await (await client.get(f"/job?id={quoted}")).text()
        assert "onerror" not in hidden.split('id="row"')[1].split("</table>")[0]
        csrf = await csrf_of(client)
        answer = await client.post("/dead/preview", data={
            "csrf": csrf, "action": "redrive", "note": XSS_ATTR, "id_prefix": "x\"'>"})
        text = await answer.text()
        assert answer.status == 200 and "<img" not in text and "&#34;&#39;&gt;" in text
        answer = await client.post("/dead/preview", data={
            "csrf": csrf, "action": "redrive", "note": "n", "key": XSS_KEY})
        text = await answer.text()
        assert answer.status == 200 and "<img" not in text and "<strong>1</strong>" in text
        assert 'name="key" value="&#34;&#39;&gt;&lt;img_src' in text


# ------------------------------------------------------------------ refusals


async def test_a_cross_site_post_is_refused(sqlite_target: str) -> None:
    ids = dead_letters(sqlite_target, 2)
    async with page(sqlite_target, allow_changes=True) as client:
        csrf = await csrf_of(client)
        form = {"csrf": csrf, "action": "redrive", "note": "n"}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        form["fingerprint"] = dry["fingerprint"]
        for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                        {"Sec-Fetch-Site": "same-site"}, {"Origin": "null"}):
            answer = await client.post("/dead/apply", data=form, headers=headers)
            assert answer.status == 403, headers
            assert "cross-site" in await answer.text()
        own = str(client.make_url("")).rstrip("/")
        # what browsers send for the page's own form: Chromium says Origin: null under
        # Referrer-Policy: no-referrer, and Sec-Fetch-Site: same-origin
        for headers in ({"Origin": "null", "Sec-Fetch-Site": "same-origin"}, {"Origin": own}):
            again = await client.post("/dead/preview", data=form, headers=headers)
            assert again.status == 200, (headers, await again.text())
        same = await client.post("/dead/apply?format=json", data=form, headers={
            "Origin": own, "Sec-Fetch-Site": "same-origin"})
        assert same.status == 200, await same.text()
    assert {statuses(sqlite_target)[i][0] for i in ids} == {"pending"}


async def test_a_change_in_read_only_mode_is_refused(target: str) -> None:
    ids = dead_letters(target, 2)
    async with page(target) as client:
        text = await (await client.get("/dead")).text()
        assert 'id="dry-run"' not in text and "--allow-changes" in text
        for path in ("/dead/preview", "/dead/apply"):
            answer = await client.post(path, data={"csrf": "0" * 64, "action": "redrive",
                                                   "note": "n", "fingerprint": "0"})
            assert answer.status == 403
            assert "read-only" in await answer.text()
    assert {statuses(target)[i] for i in ids} == {("dead", "permanent")}


async def test_a_bulk_change_needs_a_note_and_a_csrf_token(sqlite_target: str) -> None:
    ids = dead_letters(sqlite_target, 2)
    async with page(sqlite_target, allow_changes=True) as client:
        csrf = await csrf_of(client)
        for path in ("/dead/preview", "/dead/apply"):
            for note in ("", "   "):
                answer = await client.post(path, data={"csrf": csrf, "action": "redrive",
                                                       "note": note, "fingerprint": "x"})
                assert answer.status == 400
                assert "a note is required" in await answer.text()
            answer = await client.post(path, data={"action": "redrive", "note": "n"})
            assert answer.status == 403 and "CSRF" in await answer.text()
            answer = await client.post(path, data={"csrf": "0" * 64, "action": "redrive",
                                                   "note": "n"})
            assert answer.status == 403
        for form in ({"action": "delete"}, {"action": "cancel", "reason": "cancelled"},
                     {"action": "redrive", "ttl_ms": "0"}, {"action": "redrive",
                                                             "note": "\x07"}):
            answer = await client.post("/dead/preview", data={"csrf": csrf, "note": "n", **form})
            assert answer.status == 400, form
    assert {statuses(sqlite_target)[i] for i in ids} == {("dead", "permanent")}


async def test_a_stale_dry_run_is_refused_409(target: str) -> None:
    ids = dead_letters(target, 3)
    async with page(target, allow_changes=True) as client:
        csrf = await csrf_of(client)
        form = {"csrf": csrf, "action": "redrive", "note": "retry them"}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        assert dry["count"] == 3 and dry["sample"] == ids
        # meanwhile another operator redrives one and it goes dead again: same ids, new state
        with open_store(target) as store:
            assert store.redrive_jobs([ids[0]], 60_000, "elsewhere") == [True]
            fail(store, [ids[0]], "permanent", "again")
        before = statuses(target)
        answer = await client.post("/dead/apply", data={**form,
                                                        "fingerprint": dry["fingerprint"]})
        assert answer.status == 409
        text = await answer.text()
        assert "changed since the dry run" in text and 'id="confirm"' in text
        assert statuses(target) == before  # nothing changed
        # the 409's own fingerprint is the new set's: confirming it works
        fresh = re.search(r'name="fingerprint" value="([0-9a-f]{64})"', text).group(1)  # type: ignore[union-attr]
        done = await client.post("/dead/apply?format=json", data={**form, "fingerprint": fresh})
        assert done.status == 200
        assert (await done.json())["counts"] == {"redriven": 3}


async def test_a_bulk_redrive_of_everything_a_filter_matches(target: str) -> None:
    wanted = dead_letters(target, 12, prefix="order:")
    other = dead_letters(target, 2, prefix="invoice:")
    async with page(target, allow_changes=True, operator="carol") as client:
        csrf = await csrf_of(client)
        form = {"csrf": csrf, "action": "redrive", "note": "receiver fixed",
                "reason": "permanent", "id_prefix": "order:"}
        answer = await client.post("/dead/preview", data=form)
        text = await answer.text()
        assert answer.status == 200 and re.search(r"<strong>12</strong> dead letters", text)
        assert len(re.findall(r"<li>", text)) == 12
        fp = re.search(r'name="fingerprint" value="([0-9a-f]{64})"', text).group(1)  # type: ignore[union-attr]
        answer = await client.post("/dead/apply", data={**form, "fingerprint": fp})
        text = await answer.text()
        assert answer.status == 200
        assert re.findall(r'class="result">([^<]+)<', text) == ["redriven"] * 12
        assert "12 redriven" in text
    found = statuses(target)
    assert {found[i] for i in wanted} == {("pending", None)}
    assert {found[i] for i in other} == {("dead", "permanent")}
    with open_store(target, read_only=True) as store:
        history = store.job_history("order:3")
    assert history is not None
    assert [(r["note"], r["actor"]) for r in history["redrives"]] == [("receiver fixed", "carol")]


async def test_a_bulk_cancel_and_a_cancelled_redrive(sqlite_target: str) -> None:
    ids = dead_letters(sqlite_target, 3, prefix="batch-")
    async with page(sqlite_target, allow_changes=True) as client:
        csrf = await csrf_of(client)
        form = {"csrf": csrf, "action": "cancel", "note": "given up", "id_prefix": "batch-"}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        done = await (await client.post("/dead/apply?format=json",
                                        data={**form, "fingerprint": dry["fingerprint"]})).json()
        assert [line["result"] for line in done["results"]] == ["cancelled"] * 3
    assert {statuses(sqlite_target)[i] for i in ids} == {("dead", "cancelled")}


def dead_of_two_keys(target: str) -> None:
    """custE: p-1 dead/permanent first in line, e-1..e-3 dead/deadline behind it;
    custF: f-1 dead/permanent, f-2 dead/deadline; u-1, no key, dead/permanent."""
    with open_store(target) as store:
        store.enqueue_events([{"id": "p-1", "body": {"n": 1}, "key": "custE"},
                              {"id": "f-1", "body": {"n": 2}, "key": "custF"},
                              {"id": "u-1", "body": {"n": 3}}], ONE_TRY)
        fail(store, ["p-1", "f-1", "u-1"], "permanent", "HTTP 410")
        late = [{"id": job_id, "qty": 1, "key": key} for job_id, key in (
            ("e-1", "custE"), ("f-2", "custF"), ("e-2", "custE"), ("e-3", "custE"))]
        # enqueued a minute ago with a 1 ms life: the next claim moves them to dead
        store.enqueue_events(late, RetryPolicy(max_attempts=1, ttl_ms=1),
                             now_ms=store.now_ms() - 60_000)
        moved = store.claim_jobs("worker-1", 10_000, 10)
        assert moved.leased == [] and moved.moved["deadline"] == 4


def hidden_inputs(text: str, action: str) -> dict[str, str]:
    """The hidden fields of the page's form posted to ``action``, as the browser posts them."""
    form = re.search(rf'<form method="post" action="{re.escape(action)}">(.*?)</form>', text,
                     re.S)
    assert form, text[:800]
    return {name: html.unescape(value) for name, value in re.findall(
        r'<input type="hidden" name="([a-z_]+)" value="([^"]*)">', form.group(1))}


async def test_a_bulk_change_by_ordering_key_previews_and_applies_only_that_key(
        target: str) -> None:
    dead_of_two_keys(target)
    before = statuses(target)
    async with page(target, allow_changes=True, operator="erin") as client:
        text = await (await client.get("/dead?key=custE")).text()
        assert re.findall(r'class="job" href="[^"]*">([^<]+)</a>', text) == [
            "p-1", "e-1", "e-2", "e-3"]
        assert 'id="filter-key" value="custE"' in text
        listed = await (await client.get("/dead?key=custE&reason=deadline&format=json")).json()
        assert [j["id"] for j in listed["jobs"]] == ["e-1", "e-2", "e-3"]
        one = await (await client.get("/dead?key=custE&limit=2")).text()
        found = re.search(r'id="next" href="([^"]+)"', one)
        assert found and "key=custE" in found.group(1), one[-800:]
        rest = await (await client.get(found.group(1).replace("&amp;", "&"))).text()
        assert re.findall(r'class="job" href="[^"]*">([^<]+)</a>', rest) == ["e-2", "e-3"]
        jobs = await (await client.get("/jobs?key=custF&format=json")).json()
        assert [j["id"] for j in jobs["jobs"]] == ["f-1", "f-2"]

        # the dead page's own bulk form, with its filter, as a browser posts it
        form = {**hidden_inputs(text, "/dead/preview"), "action": "redrive",
                "note": "custE's receiver fixed"}
        assert form["key"] == "custE"
        answer = await client.post("/dead/preview", data=form)
        preview = await answer.text()
        assert answer.status == 200, preview
        assert re.search(r"<strong>4</strong> dead letters match .*key <strong>custE</strong>",
                         preview)
        assert re.findall(r"<li><a [^>]*>([^<]+)</a></li>", preview) == [
            "p-1", "e-1", "e-2", "e-3"]
        confirm = hidden_inputs(preview, "/dead/apply")
        assert confirm["key"] == "custE"
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        assert (dry["key"], dry["count"], dry["fingerprint"]) == (
            "custE", 4, confirm["fingerprint"])
        assert statuses(target) == before  # the dry run changed nothing

        # the preview's fingerprint confirms custE's set only: another key's is refused
        other = await client.post("/dead/apply", data={**confirm, "key": "custF"})
        assert other.status == 409 and "changed since the dry run" in await other.text()
        everything = await client.post("/dead/apply", data={**confirm, "key": ""})
        assert everything.status == 409
        assert statuses(target) == before

        answer = await client.post("/dead/apply", data=confirm)
        result = await answer.text()
        assert answer.status == 200, result
        assert re.findall(r'class="result">([^<]+)<', result) == ["redriven"] * 4

        # a cancel by key and reason, through the JSON answers
        text = await (await client.get("/dead?key=custF&reason=deadline")).text()
        form = {**hidden_inputs(text, "/dead/preview"), "action": "cancel", "note": "closed"}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        assert (dry["count"], dry["sample"]) == (1, ["f-2"])
        done = await (await client.post("/dead/apply?format=json",
                                        data={**form, "fingerprint": dry["fingerprint"]})).json()
        assert [(line["id"], line["result"]) for line in done["results"]] == [
            ("f-2", "cancelled")]

        for bad in ("/dead?key=a%20b", "/dead?key=" + "x" * 256, "/jobs?key=caf%C3%A9"):
            assert (await client.get(bad)).status == 400, bad
        bad_form = await client.post("/dead/preview", data={**form, "key": "a b"})
        assert bad_form.status == 400 and "key" in await bad_form.text()
    after = statuses(target)
    assert after == {**before, "p-1": ("pending", None), "e-1": ("pending", None),
                     "e-2": ("pending", None), "e-3": ("pending", None),
                     "f-2": ("dead", "cancelled")}
    with open_store(target, read_only=True) as store:
        history = store.job_history("e-2")
        untouched = store.job_history("f-1")
    assert history is not None and untouched is not None
    assert [(r["note"], r["actor"]) for r in history["redrives"]] == [
        ("custE's receiver fixed", "erin")]
    assert untouched["redrives"] == [] and untouched["cancels"] == []


def test_the_results_wording_and_the_fingerprint() -> None:
    assert outcome("redrive", True) == ("redriven", "")
    assert outcome("redrive", ValueError("job 'a' is pending, not dead"))[0] == "no longer dead"
    assert outcome("cancel", True) == ("cancelled", "")
    assert outcome("cancel", ValueError("job 'a' is leased: only ..."))[0] == "not cancelled"
    assert outcome("redrive", ValueError("job 'a' does not exist"))[0] == "no longer exists"
    bulk = BulkRequest("redrive", "permanent", None, "n")
    one = [Member("a", 1, "permanent"), Member("b", 2, "permanent")]
    assert fingerprint(bulk, one) == fingerprint(bulk, one[::-1])
    assert fingerprint(bulk, one) != fingerprint(bulk, [one[0], Member("b", 3, "permanent")])
    assert fingerprint(bulk, one) != fingerprint(bulk, one[:1])
    cancel = BulkRequest("cancel", "permanent", None, "n")
    assert fingerprint(bulk, one) != fingerprint(cancel, one)
    keyed = BulkRequest("redrive", "permanent", None, "n", key="custE")
    assert fingerprint(keyed, one) != fingerprint(bulk, one)  # the filter's key is in it
    assert fingerprint(keyed, one) != fingerprint(
        BulkRequest("redrive", "permanent", None, "n", key="custF"), one)


# ------------------------------------------------------------------ the token


async def test_a_configured_token_is_required(sqlite_target: str) -> None:
    dead_letters(sqlite_target, 1)
    async with page(sqlite_target, token=TOKEN, allow_changes=True, operator="dana") as client:
        redirect = await client.get("/dead?reason=permanent", allow_redirects=False)
        assert redirect.status == 303
        assert redirect.headers["Location"].startswith("/login?next=")
        assert (await client.get("/?format=json")).status == 401
        for wrong in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer ", f"Basic {TOKEN}"):
            answer = await client.get("/?format=json", headers={"Authorization": wrong})
            assert answer.status == 401, wrong
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        ok = await client.get("/?format=json", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status == 200
        wrong = await client.post("/login", data={"token": "nope", "next": "/dead"},
                                  allow_redirects=False)
        assert wrong.status == 401 and "not the access token" in await wrong.text()
        assert not client.session.cookie_jar.filter_cookies(client.make_url("/"))
        right = await client.post("/login", data={"token": TOKEN, "next": "/dead"},
                                  allow_redirects=False)
        assert right.status == 303 and right.headers["Location"] == "/dead"
        cookie = right.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        assert (await client.get("/dead")).status == 200  # the cookie is the session now
        csrf = await csrf_of(client)
        form = {"csrf": csrf, "action": "redrive", "note": "by the page"}
        dry = await (await client.post("/dead/preview?format=json", data=form)).json()
        done = await client.post("/dead/apply?format=json",
                                 data={**form, "fingerprint": dry["fingerprint"]})
        assert done.status == 200
        off_site = await client.post("/login", data={"token": TOKEN, "next": "//evil.example"},
                                     allow_redirects=False)
        assert off_site.headers["Location"] == "/"
    with open_store(sqlite_target, read_only=True) as store:
        history = store.job_history("dead:0")
    assert history is not None and history["redrives"][0]["actor"] == "dana"


def test_the_token_file_line() -> None:
    assert parse_token_line(f"{TOKEN}\nmore") .token == TOKEN
    access = parse_token_line(f"erin:{TOKEN}\r\n")
    assert (access.label, access.token) == ("erin", TOKEN)
    for bad in ("", "short", f"{TOKEN} spaced", f":{TOKEN}", f"label\x07:{TOKEN}"):
        with pytest.raises(ValueError) as refused:
            parse_token_line(bad)
        assert TOKEN not in str(refused.value)
    assert TOKEN not in repr(access)


# ------------------------------------------------------------------ JSON equals the CLI


async def test_the_json_pages_equal_the_cli(target: str) -> None:
    scenario(target)
    async with page(target) as client:
        overview = await (await client.get("/?format=json")).json()
        history = await (await client.get("/job?id=stolen&show=body&format=json")).json()
        hidden = await (await client.get("/job?id=stolen&format=json")).json()
        dead = await (await client.get("/dead?format=json")).json()
        bodies = [await (await client.get(f"/job?id=dead:0{show}&format=json")).json()
                  for show in ("&show=body", "")]
    stats = cli_json("stats", target, "--json")
    for age in ("oldest_unfinished_age_ms", "oldest_ready_age_ms"):  # read a moment apart
        assert 0 <= stats.pop(age) - overview.pop(age) < 60_000
    assert overview == stats
    assert history == cli_json("inspect", target, "stolen", "--json")
    assert hidden == history  # a lab event has no body to hide
    body_shown, body_hidden = bodies
    assert body_shown == cli_json("inspect", target, "dead:0", "--json")
    assert body_shown["job"]["body"] == '{"order":0}'
    assert body_hidden["job"]["body"] is None and body_hidden["job"]["body_bytes"] == 11
    assert {**body_hidden["job"], "body": body_shown["job"]["body"], "body_bytes": 0} == {
        **body_shown["job"], "body_bytes": 0}
    listed = cli("dead", target)
    assert listed.returncode == 0 and listed.stderr.strip() == f"{len(dead['jobs'])} dead"
    table = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert table == [job["id"] for job in dead["jobs"]]
    assert dead["dead_by_reason"] == stats["dead_by_reason"]


async def test_the_overview_after_a_scripted_day(target: str) -> None:
    """A lease expired, a stale completion refused, a redrive, a cancel: the page's
    figures are the ones stats --json prints."""
    scenario(target)
    async with page(target) as client:
        text = await (await client.get("/")).text()
    stats = cli_json("stats", target, "--json")
    shown = dict(re.findall(r'data-key="([a-z_.]+)">([^<]*)<', text))
    assert shown["expired_leases"] == "1" == str(stats["expired_leases"])
    assert shown["live_leases"] == "1" == str(stats["live_leases"])
    assert shown["stale_finishes"] == "1" == str(stats["stale_finishes"])
    assert shown["redrives_last_day"] == "1" == str(stats["redrives_last_day"])
    assert shown["cancels_last_day"] == "1" == str(stats["cancels_last_day"])
    for status, n in stats["by_status"].items():
        assert shown[f"by_status.{status}"] == str(n)
    for reason, n in stats["dead_by_reason"].items():
        assert shown[f"dead_by_reason.{reason}"] == str(n)
    assert stats["dead_by_reason"] == {"cancelled": 1, "exhausted": 1, "permanent": 1}
    assert shown["jobs"] == str(stats["jobs"]) == "7"


async def test_a_read_only_page_sees_what_is_written_after_it_started(sqlite_target: str
                                                                      ) -> None:
    async with page(sqlite_target) as client:
        assert (await (await client.get("/?format=json")).json())["jobs"] == 0
        dead_letters(sqlite_target, 2)  # a dispatcher's work, after the page opened the file
        assert (await (await client.get("/?format=json")).json())["by_status"]["dead"] == 2


# ------------------------------------------------------------------ the receiver


async def test_the_receiver_figures_or_unavailable(sqlite_target: str, tmp_path: Path) -> None:
    with ReceiverProcess(tmp_path / "inbox.db") as receiver:
        for _ in range(2):  # applied once, then a duplicate absorbed
            request = urllib.request.Request(receiver.url, data=b'{"id": "r-1", "qty": 1}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200
        async with page(sqlite_target, receiver_url=receiver.url) as client:
            text = await (await client.get("/")).text()
            figures = await (await client.get("/?format=json")).json()
        shown = dict(re.findall(r'data-key="([a-z_.]+)">([^<]*)<', text))
        assert (shown["receiver.applied"], shown["receiver.duplicates"]) == ("1", "1")
        assert shown["receiver.refused_by_signature"] == "0"
        assert figures["receiver"] == receiver.stats()
        url = receiver.url
    async with page(sqlite_target, receiver_url=url) as client:  # it is gone now
        answer = await client.get("/")
        assert answer.status == 200
        assert "The receiver's figures are unavailable" in await answer.text()
        assert "receiver_error" in await (await client.get("/?format=json")).json()


# ------------------------------------------------------------------ mounted, and the command


async def test_mounted_in_another_app_under_a_prefix(sqlite_target: str) -> None:
    dead_letters(sqlite_target, 1)
    service = web.Application()
    service.add_subapp("/ops", ui_app(sqlite_target, allow_changes=True))
    async with TestClient(TestServer(service)) as client:
        text = await (await client.get("/ops/dead")).text()
        assert 'href="/ops/job?id=dead:0"' in text and 'action="/ops/dead/preview"' in text
        assert 'href="/ops/ui.css"' in text
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', text).group(1)  # type: ignore[union-attr]
        answer = await client.post("/ops/dead/preview?format=json",
                                   data={"csrf": csrf, "action": "redrive", "note": "n"})
        assert (await answer.json())["count"] == 1


def test_the_command_refuses_before_it_binds(sqlite_target: str, tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    good = tmp_path / "token"
    good.write_text(f"ops:{TOKEN}\n")
    good.chmod(0o600)
    cases = [
        (["ui", sqlite_target, "--host", "0.0.0.0"], "not a loopback address"),
        (["ui", sqlite_target, "--token-file", str(short)], "shorter than 16"),
        (["ui", sqlite_target, "--token-file", str(tmp_path / "none")], "file not found"),
        (["ui", str(tmp_path / "none.db")], "queue file not found"),
        (["ui", sqlite_target, "--receiver", "ftp://x"], "--receiver"),
        (["ui", sqlite_target, "--receiver", "http://orders.example/events"],
         "--insecure-plain-http"),
        (["ui", sqlite_target, "--ca-file", str(good)], "--ca-file goes with --receiver"),
        (["ui", sqlite_target, "--receiver", "http://127.0.0.1:9/events", "--ca-file",
          str(good)], "--ca-file goes with an https:// --receiver"),
        (["ui", sqlite_target, "--receiver", "https://127.0.0.1:9/events", "--ca-file",
          str(good)], "cannot load CA certificates"),
        (["ui", sqlite_target, "--tls-cert", str(good)], "--tls-cert and --tls-key go together"),
        (["ui", sqlite_target, "--tls-cert", str(good), "--tls-key", str(good)],
         "holds no PEM certificate"),
        (["ui", sqlite_target, "--host", "0.0.0.0", "--token-file", str(good)], "in the clear"),
        (["ui", sqlite_target, "--allowed-host", "ops example"], "--allowed-host"),
        (["ui", sqlite_target, "--allowed-host", "https://ops.example"], "--allowed-host"),
    ]
    for args, words in cases:
        done = cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert TOKEN not in done.stderr and "Traceback" not in done.stderr


def test_the_command_serves_until_sigterm(sqlite_target: str, tmp_path: Path) -> None:
    dead_letters(sqlite_target, 1)
    token = tmp_path / "token"
    token.write_text(f"ops:{TOKEN}\n")
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "ui", sqlite_target, "--port",
                             "0", "--token-file", str(token)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/) \(read-only\)", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
        request = urllib.request.Request(found.group(1) + "?format=json",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as answer:
            assert json.loads(answer.read())["by_status"]["dead"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


async def test_a_dead_head_shows_its_blocked_key_and_the_jobs_behind_it(target: str) -> None:
    with open_store(target) as store:
        store.enqueue_events([{"id": f"ann-{n}", "qty": 1, "key": "ann"} for n in range(3)],
                             ONE_TRY)
        fail(store, ["ann-0"], "permanent", "HTTP 410")
    async with page(target) as client:
        text = await (await client.get("/")).text()
        figures = await (await client.get("/?format=json")).json()
        behind = await (await client.get("/job?id=ann-1")).text()
    shown = dict(re.findall(r'data-key="([a-z_.]+)">([^<]*)<', text))
    assert (shown["blocked_keys"], shown["blocked_jobs"]) == ("1", "2")
    assert (figures["blocked_keys"], figures["blocked_jobs"]) == (1, 2)
    assert '<code id="ordering-key">ann</code> (waiting behind an earlier job of its key)' in behind


# ------------------------------------------------------------------ the hosts it answers to


class UiProcess:
    """A real ``asyncworker ui QUEUE ARGS --port 0``: its URL (the first line it
    prints); stopped by SIGTERM, its stderr kept."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "ui", *args,
                                      "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline()
        found = re.search(r"(https?)://(\S+):(\d+)/ \(", self.line)
        if found is None:
            self.stop()
            pytest.fail(f"asyncworker ui did not start: {self.line!r} {self.stderr}")
        self.scheme, self.port = found.group(1), int(found.group(3))
        self.stderr = ""

    def request(self, method: str, path: str, host: str | None, *,
                form: dict | None = None, headers: dict | None = None,
                tls: ssl.SSLContext | None = None) -> tuple[int, str]:
        """One request to 127.0.0.1 naming ``host`` as its Host (None: no Host at all)."""
        connection: http.client.HTTPConnection
        if self.scheme == "https":
            connection = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10,
                                                     context=tls)
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            body = None if form is None else urlencode(form).encode()
            sent = {**({} if host is None else {"Host": host}), **(headers or {})}
            if body is not None:
                sent.update({"Content-Type": "application/x-www-form-urlencoded",
                             "Content-Length": str(len(body))})
            for name, value in sent.items():
                connection.putheader(name, value)
            connection.endheaders(body)
            answer = connection.getresponse()
            return answer.status, answer.read().decode()
        finally:
            connection.close()

    def stop(self) -> int:
        _, self.stderr = stop_process(self.proc)
        return self.proc.returncode

    def __enter__(self) -> UiProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def csrf_in(text: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
    assert found, text[:500]
    return found.group(1)


def test_a_page_of_another_site_on_a_rebound_name_changes_nothing(sqlite_target: str) -> None:
    """DNS rebinding: evil.example made to resolve to 127.0.0.1. Its page's requests
    reach the port with Host and Origin evil.example:PORT, Sec-Fetch-Site
    same-origin (for the browser it is evil.example's own page): each one is
    refused before anything is read, the CSRF token never shown."""
    ids = dead_letters(sqlite_target, 10)
    with UiProcess(sqlite_target, "--allow-changes") as ui:
        own = f"127.0.0.1:{ui.port}"
        status, text = ui.request("GET", "/dead", own)
        assert status == 200
        csrf = csrf_in(text)
        form = {"csrf": csrf, "action": "cancel", "note": "by another site"}
        evil = f"evil.example:{ui.port}"
        browser = {"Origin": f"http://{evil}", "Sec-Fetch-Site": "same-origin"}
        for host in (evil, "evil.example", f"127.0.0.1:{ui.port + 1}", f"localhost.:{ui.port}",
                     f"127.0.0.1:{ui.port}.evil.example", "", "@", f"127.0.0.1:{ui.port}:1"):
            status, text = ui.request("GET", "/dead", host)
            assert status in (400, 421), (host, status)
            assert csrf not in text and "dead:0" not in text, host
            status, text = ui.request("GET", "/ui.css", host)
            assert status in (400, 421), (host, status)
        assert ui.request("GET", "/", None)[0] == 400  # no Host at all
        status, text = ui.request("POST", "/dead/preview?format=json", evil, form=form,
                                  headers=browser)
        assert status == 421 and "evil.example" in text and "count" not in text
        # the fingerprint of the very set, as the attacker could not even learn it
        _, dry = ui.request("POST", "/dead/preview?format=json", own, form=form)
        form["fingerprint"] = json.loads(dry)["fingerprint"]
        status, text = ui.request("POST", "/dead/apply?format=json", evil, form=form,
                                  headers=browser)
        assert status == 421 and "cancelled" not in text
        assert {statuses(sqlite_target)[i][0] for i in ids} == {"dead"}
        # an Origin is compared with the page's own names, not with the request's Host
        status, _ = ui.request("POST", "/dead/apply?format=json", own, form=form,
                               headers={"Origin": f"http://{evil}"})
        assert status == 403
        assert {statuses(sqlite_target)[i] for i in ids} == {("dead", "permanent")}
        for name in (own, f"localhost:{ui.port}", f"[::1]:{ui.port}", f"LOCALHOST:{ui.port}"):
            assert ui.request("GET", "/?format=json", name)[0] == 200, name
        status, text = ui.request("POST", "/dead/apply?format=json", own, form=form, headers={
            "Origin": f"http://localhost:{ui.port}", "Sec-Fetch-Site": "same-origin"})
        assert status == 200 and json.loads(text)["counts"] == {"cancelled": 10}


@pytest.mark.parametrize("mode", ["read-only", "changes", "token"])
async def test_a_foreign_host_is_refused_in_every_mode(sqlite_target: str, mode: str) -> None:
    dead_letters(sqlite_target, 1)
    settings: dict[str, object] = {"allow_changes": mode != "read-only"}
    bearer = {}
    if mode == "token":
        settings["token"] = TOKEN
        bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with page(sqlite_target, **settings) as client:
        for path in ("/", "/dead", "/jobs", "/job?id=dead:0", "/login", "/ui.css"):
            answer = await client.get(path, headers={"Host": "evil.example", **bearer},
                                      allow_redirects=False)
            assert answer.status == 421, (path, answer.status)
            assert "csrf" not in await answer.text()
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
        for path in ("/dead/preview", "/dead/apply", "/login", "/logout"):
            answer = await client.post(path, data={"token": TOKEN}, headers={
                "Host": "evil.example", **bearer}, allow_redirects=False)
            assert answer.status == 421, (path, answer.status)
            assert "Set-Cookie" not in answer.headers
        assert (await client.get("/?format=json", headers=bearer)).status == 200


async def test_the_names_it_answers_to_are_the_ones_allowed(sqlite_target: str) -> None:
    dead_letters(sqlite_target, 1)
    async with page(sqlite_target, allow_changes=True,
                    allowed_hosts=["ops.example", "127.0.0.1:1"]) as client:
        assert (await client.get("/")).status == 421  # 127.0.0.1 at the test's port: not listed
        text = await (await client.get("/dead", headers={"Host": "ops.example:8443"})).text()
        form = {"csrf": csrf_in(text), "action": "redrive", "note": "n"}
        host = {"Host": "ops.example"}
        for origin in ("http://ops.example", "https://ops.example", "http://ops.example:8443"):
            answer = await client.post("/dead/preview?format=json", data=form,
                                       headers={**host, "Origin": origin})
            assert answer.status == 200, origin
        for origin in ("http://evil.example", "http://127.0.0.1:2", "http://ops.example/x",
                       "ftp://ops.example", "ops.example"):
            answer = await client.post("/dead/preview?format=json", data=form,
                                       headers={**host, "Origin": origin})
            assert answer.status == 403, origin
    for bad in (["ops example"], ["ops.example:99999"], [], ["http://ops.example"]):
        with pytest.raises(ValueError):
            ui_app(sqlite_target, allowed_hosts=bad)


# ------------------------------------------------------------------ TLS, and the secret's file


def private_token(tmp_path: Path, mode: int = 0o600) -> Path:
    token = tmp_path / f"token-{mode:o}"
    token.write_text(f"ops:{TOKEN}\n")
    token.chmod(mode)
    return token


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    """A private CA's file, and a certificate it issued for 127.0.0.1 with its key."""
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    leaf.private_key_and_cert_chain_pem.write_to_path(str(files["cert"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    files["key"].chmod(0o600)
    return {name: str(path) for name, path in files.items()}


def test_the_page_over_https_and_a_receiver_behind_a_private_ca(
        sqlite_target: str, tmp_path: Path, pki: dict[str, str]) -> None:
    """ui serves https with --tls-cert/--tls-key, and reaches a receiver whose
    certificate a private CA issued with --ca-file, as run does."""
    dead_letters(sqlite_target, 1)
    tls = ssl.create_default_context(cafile=pki["ca"])
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with ReceiverProcess(tmp_path / "inbox.db", "--tls-cert", pki["cert"], "--tls-key",
                         pki["key"], cafile=pki["ca"]) as receiver:
        assert receiver.url.startswith("https://127.0.0.1:")
        with UiProcess(sqlite_target, "--token-file", str(private_token(tmp_path)),
                       "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                       "--receiver", receiver.url, "--ca-file", pki["ca"]) as ui:
            assert ui.scheme == "https", ui.line
            status, text = ui.request("GET", "/?format=json", f"127.0.0.1:{ui.port}",
                                      headers=bearer, tls=tls)
            assert status == 200, text
            figures = json.loads(text)
            assert "receiver_error" not in figures, figures
            stats = receiver.stats()
            assert {key: figures["receiver"][key] for key in ("applied", "duplicates")} == {
                key: stats[key] for key in ("applied", "duplicates")}
        assert ui.stop() == 0 and ui.stderr == "", ui.stderr
        # without --ca-file the system's store is asked, and it does not know this CA
        with UiProcess(sqlite_target, "--receiver", receiver.url) as ui:
            status, text = ui.request("GET", "/?format=json", f"127.0.0.1:{ui.port}")
            assert "CERTIFICATE_VERIFY_FAILED" in json.loads(text)["receiver_error"]


def test_a_token_never_crosses_a_network_in_the_clear_unasked(sqlite_target: str,
                                                              tmp_path: Path) -> None:
    token = str(private_token(tmp_path))
    refused = cli("ui", sqlite_target, "--host", "0.0.0.0", "--token-file", token)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "in the clear" in refused.stderr and "--tls-cert" in refused.stderr
    with UiProcess(sqlite_target, "--host", "0.0.0.0", "--token-file", token,
                   "--insecure-plain-http", "--allowed-host", "ops.example") as ui:
        assert ui.line.startswith("asyncworker ui: ") and "http://0.0.0.0:" in ui.line
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        for host in (f"127.0.0.1:{ui.port}", "ops.example", f"ops.example:{ui.port}"):
            assert ui.request("GET", "/?format=json", host, headers=bearer)[0] == 200, host
        assert ui.request("GET", "/?format=json", "evil.example", headers=bearer)[0] == 421


def test_a_token_file_others_may_read_warns_and_one_all_may_write_is_refused(
        sqlite_target: str, tmp_path: Path) -> None:
    with UiProcess(sqlite_target, "--token-file", str(private_token(tmp_path))) as ui:
        pass
    assert ui.stderr == ""
    for mode in (0o640, 0o644, 0o660):
        token = private_token(tmp_path, mode)
        with UiProcess(sqlite_target, "--token-file", str(token)) as ui:
            pass
        [line] = ui.stderr.splitlines()
        assert "WARNING" in line and str(token) in line and f"mode 0{mode:o}" in line, line
        assert "chmod 600" in line and TOKEN not in line
    for mode in (0o666, 0o602, 0o777):
        done = cli("ui", sqlite_target, "--token-file", str(private_token(tmp_path, mode)))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "writable by every user" in done.stderr and TOKEN not in done.stderr
