"""The operator's page and endpoints, through aiohttp's test client on
127.0.0.1 over a real SQLite queue file: the endpoints' page with each one's
figures, its circuit breaker and never a secret or a header's value, one
endpoint's deliveries, its dead letters and a bulk redrive that acts on its
dead deliveries only, the delivery's endpoint, message and type on the job
rows, a queue without endpoints as it was, an open circuit and an automatic
disable shown with their why, and an endpoint's recovery (dry run, the
confirmation of exactly that set, a changed set refused, the audit rows,
read-only refusing it)."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from asyncworker.ui.bulk import Filter
from asyncworker.ui.pages import job_page
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.signing import new_secret
from lease.stores import open_store

SECRET = new_secret(random=b"k" * 32)
SECRET_BODY = SECRET.removeprefix("whsec_")
BILLING_AUTH = "Bearer billing-header-value-never-shown"
CRM_KEY = "crm-api-key-never-shown"
XSS_NOTE = "\"'><img src=x onerror=alert(1)>"
POLICY = RetryPolicy(max_attempts=3)
# What the store holds for each endpoint after ``deliveries``, as the page shows it.
EXPECTED = {
    "billing": {"ready": 1, "in_flight": 1, "done": 1, "retried": 1, "dead": 1},
    "crm": {"ready": 1, "in_flight": 0, "done": 2, "retried": 1, "dead": 2},
}


@pytest.fixture
def queue(tmp_path: Path) -> str:
    name = str(tmp_path / "queue.db")
    open_store(name, create=True).close()
    return name


@asynccontextmanager
async def page(target: str, **settings: object) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ui_app(target, **settings), host="127.0.0.1")) as client:  # type: ignore[arg-type]
        yield client


def finish(store: object, outcomes: dict[str, tuple[str, int | None, str | None]]) -> None:
    """Claim every ready delivery and finish the ones named: (outcome, HTTP, error)."""
    claimed = store.claim_jobs("worker-1", 600_000, 100, endpoints="*")  # type: ignore[attr-defined]
    tickets = {job.ticket["id"]: job.ticket for job in claimed.leased}
    assert set(outcomes) <= set(tickets), (sorted(outcomes), sorted(tickets))
    store.finish_jobs([(tickets[job_id], outcome, 0, Attempt(claimed.now_ms, 7, status, error))  # type: ignore[attr-defined]
                       for job_id, (outcome, status, error) in outcomes.items()])


def deliveries(target: str) -> None:
    """A job of the queue's own (dead, from before endpoints), two endpoints
    with secrets and header values set, and their deliveries in every state
    (EXPECTED)."""
    with open_store(target) as store:
        store.enqueue_events([{"id": "own:1", "body": {"n": 1}}], RetryPolicy(max_attempts=1))
        claimed = store.claim_jobs("worker-1", 600_000, 1)
        store.finish_jobs([(claimed.leased[0].ticket, "permanent", 0,
                            Attempt(claimed.now_ms, 5, 400, None))])
        store.add_endpoint(Endpoint(
            "billing", "http://127.0.0.1:9/billing?tenant=7", secrets=(SECRET,),
            headers=(("Authorization", BILLING_AUTH),), types=("invoice.paid",),
            max_in_flight=10, rate=100.0, burst=50), note="new customer", actor="alice")
        store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/crm",
                                    headers=(("X-Api-Key", CRM_KEY),)), actor="bob")
        store.update_endpoint("crm", {"max_in_flight": 20}, note=XSS_NOTE, actor="bob")
        events = [{"id": f"m{i}", "type": "invoice.paid", "body": {"invoice": i}}
                  for i in range(1, 5)]
        events.append({"id": "m5", "type": "user.created", "body": {"user": 5}})
        assert store.enqueue_events(events, POLICY) == [True] * 5
        finish(store, {
            "m1@billing": ("permanent", None, "HTTPError: 410 Gone"),
            "m2@billing": ("retry", None, "TimeoutError: timed out"),
            "m3@billing": ("ok", 200, None),
            # m4@billing stays leased: in flight
            "m1@crm": ("permanent", 422, None),
            "m2@crm": ("ok", 200, None),
            "m3@crm": ("ok", 200, None),
            "m4@crm": ("retry", 503, None),
            "m5@crm": ("permanent", None, "HTTPError: 404 Not Found"),
        })


def ids_of(text: str) -> list[str]:
    return [html.unescape(found) for found in re.findall(r'<a class="job" href="[^"]*">([^<]+)</a>',
                                                         text)]


def assert_no_secret(text: str) -> None:
    for secret in (SECRET, SECRET_BODY, BILLING_AUTH, "billing-header-value", CRM_KEY):
        assert secret not in text, secret


async def csrf_of(client: TestClient, path: str = "/dead") -> str:
    text = await (await client.get(path)).text()
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', text)
    assert found, text[:500]
    return found.group(1)


def statuses(target: str) -> dict[str, tuple[str, str | None]]:
    with open_store(target, read_only=True) as store:
        return {row["id"]: (row["status"], row["reason"])
                for status in ("pending", "leased", "done", "dead")
                for row in store.jobs_with_status(status)}


# ------------------------------------------------------------------ the endpoints


async def test_the_endpoints_page_lists_each_with_its_figures_and_no_secret(queue: str) -> None:
    deliveries(queue)
    async with page(queue) as client:
        answer = await client.get("/endpoints")
        assert answer.status == 200
        text = await answer.text()
        assert_no_secret(text)
        assert re.findall(r'<a class="endpoint" href="[^"]*">([^<]+)</a>', text) == [
            "billing", "crm"]
        for name, figures in EXPECTED.items():
            for key, value in figures.items():
                cell = re.search(rf'data-key="{name}\.{key}">(?:<a [^>]*>)?(\d+)<', text)
                assert cell is not None and int(cell.group(1)) == value, (name, key)
        row = text[text.index('id="endpoint-billing"'):text.index('id="endpoint-crm"')]
        assert "http://127.0.0.1:9/billing?tenant=7" in row and "invoice.paid" in row
        assert "10 in flight; 100/s, burst 50" in row and "enabled" in row
        assert "TimeoutError: timed out, at 20" in row  # its latest failed attempt, with when
        crm = text[text.index('id="endpoint-crm"'):]
        assert "HTTPError: 404 Not Found, at 20" in crm  # its latest failed attempt
        assert re.search(r'data-key="crm\.last_success_ms">\d{4}-\d\d-\d\d ', crm)
        # the navigation leads here from every page
        assert 'href="/endpoints">Endpoints</a>' in await (await client.get("/")).text()

        as_json = await (await client.get("/endpoints?format=json")).json()
        with open_store(queue, read_only=True) as store:
            # every field and figure the store gives, the circuit's too, none other
            assert as_json["endpoints"] == store.endpoint_stats()
        assert_no_secret(repr(as_json))
        billing = as_json["endpoints"][0]
        assert (billing["secrets"], billing["headers"]) == (1, ["Authorization"])
        assert billing["circuit"]["state"] == "closed" and billing["disabled_why"] is None
        assert billing["dead_by_reason"] == {"permanent": 1}
        assert as_json["circuits"] == {"endpoints": 2, "closed": 2, "open": 0, "half-open": 0,
                                       "paused": 0, "disabled": 0,
                                       "disabled_automatically": 0}
        assert re.search(r'data-key="billing\.circuit"><span class="circuit closed">closed<',
                         text)

        one = await client.get("/endpoint?name=billing")
        text = await one.text()
        assert one.status == 200
        assert_no_secret(text)
        assert "Authorization (names only" in text and "1 (never shown)" in text
        assert re.search(r'id="deliveries" href="/jobs\?endpoint=billing"', text)
        assert re.search(r'id="dead-letters" href="/dead\?endpoint=billing"', text)
        crm_page = await (await client.get("/endpoint?name=crm")).text()
        audit = crm_page[crm_page.index('id="audit"'):]
        assert re.findall(r"<td>(add|update)</td><td>([^<]*)</td>", audit) == [
            ("add", "-"), ("update", "max_in_flight")]
        assert "<img" not in crm_page and "&#34;&#39;&gt;&lt;img" in crm_page  # the note, escaped
        crm_json = await (await client.get("/endpoint?name=crm&format=json")).json()
        assert [(a["action"], a["fields"], a["actor"]) for a in crm_json["audit"]] == [
            ("add", [], "bob"), ("update", ["max_in_flight"], "bob")]
        assert crm_json["endpoint"]["headers"] == ["X-Api-Key"]

        # every page a delivery shows on: no secret either
        for path in ("/", "/jobs", "/dead", "/jobs?endpoint=billing", "/dead?endpoint=crm",
                     "/job?id=m1@billing&show=body", "/job?id=m1@billing&format=json"):
            shown = await client.get(path)
            assert shown.status == 200, path
            assert_no_secret(await shown.text())

        assert (await client.get("/endpoint?name=nobody")).status == 404
        assert (await client.get("/endpoint?name=bad@name")).status == 400
        assert (await client.get("/jobs?endpoint=<b>")).status == 400


async def test_a_queue_without_endpoints_shows_none_and_how_to_add_one(queue: str) -> None:
    with open_store(queue) as store:
        store.enqueue_events([{"id": "plain:1", "body": {"n": 1}}])
    async with page(queue) as client:
        text = await (await client.get("/endpoints")).text()
        assert 'id="no-endpoints"' in text
        assert f"asyncworker endpoint add {queue} NAME URL" in html.unescape(text)
        assert await (await client.get("/endpoints?format=json")).json() == {"endpoints": []}
        jobs = await (await client.get("/jobs")).text()
        assert ids_of(jobs) == ["plain:1"]
        header = jobs[jobs.index("<thead>"):jobs.index("</thead>")]
        assert "endpoint" not in header and "message" not in header and "type" not in header
        record = await (await client.get("/job?id=plain:1")).text()
        assert 'id="endpoint"' not in record and 'id="message"' not in record


# ------------------------------------------------------------------ deliveries


async def test_an_endpoint_s_deliveries_page_shows_only_its_deliveries(queue: str) -> None:
    deliveries(queue)
    async with page(queue) as client:
        text = await (await client.get("/jobs?endpoint=billing")).text()
        assert ids_of(text) == [f"m{i}@billing" for i in range(1, 5)]
        # each row says its endpoint, its message and its event's type
        header = text[text.index("<thead>"):text.index("</thead>")]
        assert "<th>endpoint</th><th>message</th><th>type</th>" in header
        assert re.findall(r'<td class="message">([^<]+)</td>', text) == ["m1", "m2", "m3", "m4"]
        assert set(re.findall(r'<td class="type">([^<]+)</td>', text)) == {"invoice.paid"}
        assert ids_of(await (await client.get("/jobs?endpoint=crm")).text()) == [
            f"m{i}@crm" for i in range(1, 6)]
        # the existing filters with it, and keyset pagination keeping it
        done = await (await client.get("/jobs?endpoint=crm&status=done")).text()
        assert ids_of(done) == ["m2@crm", "m3@crm"]
        seen: list[str] = []
        url: str | None = "/jobs?endpoint=crm&limit=2"
        while url is not None:
            answer = await client.get(url)
            assert answer.status == 200
            body = await answer.text()
            seen += ids_of(body)
            found = re.search(r'id="next" href="([^"]+)"', body)
            url = html.unescape(found.group(1)) if found else None
            if url is not None:
                assert "endpoint=crm" in url
        assert seen == [f"m{i}@crm" for i in range(1, 6)]
        page_json = await (await client.get("/jobs?endpoint=crm&limit=2&format=json")).json()
        assert [row["id"] for row in page_json["jobs"]] == ["m1@crm", "m2@crm"]
        assert {(row["endpoint"], row["message"], row["event_type"])
                for row in page_json["jobs"]} == {("crm", "m1", "invoice.paid"),
                                                  ("crm", "m2", "invoice.paid")}
        every = await (await client.get("/jobs?format=json&limit=100")).json()
        assert len(every["jobs"]) == 10  # own:1 and the nine deliveries
        # a delivery's record names its endpoint, message and type
        record = await (await client.get("/job?id=m5@crm")).text()
        assert re.search(r'id="endpoint" href="/endpoint\?name=crm">crm<', record)
        assert 'id="message">m5<' in record and 'id="event-type">user.created<' in record


def test_an_endpoint_s_pages_read_its_rows_only_and_skip_none(queue: str) -> None:
    """The store filters by endpoint: a page of one endpoint reads at most one
    row more than it shows (never the other endpoints' rows), and its pages
    list every delivery once, in order."""
    deliveries(queue)
    with open_store(queue, read_only=True) as store:
        everything = [row["id"] for row in store.list_jobs(limit=1000)]
        wanted = [job_id for job_id in everything if job_id.endswith("@crm")]
        read: list[int] = []

        class Counting:
            endpoint_stats = store.endpoint_stats

            def list_jobs(self, **query: object) -> list[dict]:
                rows = store.list_jobs(**query)  # type: ignore[arg-type]
                read.append(len(rows))
                return rows

        for limit in (1, 2, 3, 100):
            found: list[str] = []
            after: int | None = None
            while True:
                rows, after = job_page(Counting(), None,  # type: ignore[arg-type]
                                       Filter(None, None, None, "crm"), after, limit)
                assert len(rows) <= limit
                found += [row["id"] for row in rows]
                assert len(found) <= len(wanted)
                if after is None:
                    break
            assert found == wanted, limit
        assert max(read) <= len(wanted)  # never a row of billing or of the queue's own


# ------------------------------------------------------------------ dead letters


async def test_one_endpoint_s_dead_letters_and_a_redrive_through_them(queue: str) -> None:
    deliveries(queue)
    before = statuses(queue)
    async with page(queue, allow_changes=True, operator="carol") as client:
        text = await (await client.get("/dead?endpoint=crm")).text()
        assert ids_of(text) == ["m1@crm", "m5@crm"]
        by_reason = text[text.index('id="dead-by-reason"'):text.index("</table>")]
        assert re.findall(r">(\w+)</a></th><td class=\"n\">(\d+)<", by_reason) == [
            ("permanent", "2")]
        assert 'name="endpoint" value="crm"' in text  # the bulk form carries it
        whole = await (await client.get("/dead?format=json")).json()
        assert {row["id"] for row in whole["jobs"]} == {"own:1", "m1@billing", "m1@crm",
                                                        "m5@crm"}

        csrf = await csrf_of(client, "/dead?endpoint=crm")
        form = {"csrf": csrf, "action": "redrive", "note": "crm is back", "endpoint": "crm"}
        dry = await client.post("/dead/preview", data=form)
        dry_text = await dry.text()
        assert dry.status == 200
        assert re.search(r"<strong>2</strong> dead letters", dry_text)
        assert 'class="filter-endpoint">crm<' in dry_text
        fp = re.search(r'name="fingerprint" value="([0-9a-f]{64})"', dry_text)
        assert fp is not None
        assert 'name="endpoint" value="crm"' in dry_text
        # the same fingerprint for another endpoint's (or every endpoint's) dead: refused
        for other in ("billing", ""):
            refused = await client.post("/dead/apply", data={
                **form, "endpoint": other, "fingerprint": fp.group(1)})
            assert refused.status == 409, other
        assert statuses(queue) == before
        answer = await client.post("/dead/apply?format=json",
                                   data={**form, "fingerprint": fp.group(1)})
        assert answer.status == 200, await answer.text()
        result = await answer.json()
        assert result["counts"] == {"redriven": 2}
        assert [line["id"] for line in result["results"]] == ["m1@crm", "m5@crm"]
        after_text = await (await client.get("/dead?endpoint=crm")).text()
        assert ids_of(after_text) == []
    after = statuses(queue)
    assert after["m1@crm"] == after["m5@crm"] == ("pending", None)
    # nothing else moved: billing's dead delivery and the queue's own dead job stay
    assert after["m1@billing"] == ("dead", "permanent") and after["own:1"] == (
        "dead", "permanent")
    assert {job_id: state for job_id, state in after.items()
            if job_id not in ("m1@crm", "m5@crm")} == {
        job_id: state for job_id, state in before.items() if job_id not in ("m1@crm", "m5@crm")}
    with open_store(queue, read_only=True) as store:
        history = store.job_history("m5@crm")
    assert history is not None
    assert [(r["note"], r["actor"]) for r in history["redrives"]] == [("crm is back", "carol")]


# ------------------------------------------------------------------ the circuit breaker

REFUSED = "connection refused by 127.0.0.1:9"


def open_circuit(target: str, name: str = "down", **fields: object) -> int:
    """An endpoint whose five deliveries all failed (connection refused): its
    circuit opens, by the store's own rules. The time it opened."""
    with open_store(target) as store:
        store.add_endpoint(Endpoint(name, "http://127.0.0.1:9/down", types=("d",),
                                    **fields), actor="alice")  # type: ignore[arg-type]
        store.enqueue_events([{"id": f"d{i}", "type": "d", "body": {"n": i}}
                              for i in range(8)], RetryPolicy(max_attempts=50))
        claimed = store.claim_jobs("worker-1", 600_000, 5, endpoints=(name,))
        assert len(claimed.leased) == 5
        now = claimed.now_ms + 1
        store.finish_jobs([(job.ticket, "retry", 60_000, Attempt(now, 1, None, REFUSED))
                           for job in claimed.leased], now_ms=now)
        [row] = [row for row in store.endpoints() if row["name"] == name]
        assert row["circuit"]["state"] == "open", row["circuit"]
    return now


async def test_an_open_circuit_is_shown_with_its_why_on_every_endpoint_page(queue: str) -> None:
    deliveries(queue)
    opened = open_circuit(queue)
    async with page(queue) as client:
        listed = await (await client.get("/endpoints")).text()
        row = listed[listed.index('id="endpoint-down"'):]
        row = row[:row.index("</tr>")]
        assert '<span class="circuit open">open</span>' in row
        why = re.search(r'data-key="down\.circuit\.why">([^<]+)<', row)
        assert why is not None
        assert "5 failures in a row" in why.group(1) and REFUSED in why.group(1)
        billing = listed[listed.index('id="endpoint-billing"'):listed.index('id="endpoint-crm"')]
        assert '<span class="circuit closed">closed</span>' in billing
        # the summary: one open of three
        assert re.search(r'data-key="circuits\.open">1<', listed)
        assert re.search(r'data-key="circuits\.endpoints">3<', listed)
        overview = await (await client.get("/")).text()
        assert re.search(r'data-key="circuits\.open">1<', overview)
        assert re.search(r'data-key="circuits\.half-open">0<', overview)
        figures = await (await client.get("/?format=json")).json()
        assert figures["circuits"]["open"] == 1 and figures["circuits"]["closed"] == 2
        assert [row["name"] for row in figures["endpoints"]] == ["billing", "crm", "down"]
        assert_no_secret(repr(figures))

        one = await (await client.get("/endpoint?name=down")).text()
        assert re.search(r'id="circuit-state"><span class="circuit open">open</span>'
                         r'<span class="until"> until \d{4}-', one)
        shown = re.search(r'id="circuit-why">([^<]+)<', one)
        assert shown is not None and REFUSED in shown.group(1)
        assert re.search(r'data-key="circuit\.failures">5<', one)
        # the breaker's audit row: actor breaker, the evidence as its note
        audit = one[one.index('id="audit"'):]
        opened_row = re.search(r"<td>opened</td><td>[^<]*</td><td>([^<]*)</td>"
                               r'<td class="note">([^<]*)</td>', audit)
        assert opened_row is not None and opened_row.group(1) == "breaker"
        assert REFUSED in html.unescape(opened_row.group(2))
        as_json = await (await client.get("/endpoint?name=down&format=json")).json()
        circuit = as_json["endpoint"]["circuit"]
        assert (circuit["state"], circuit["since_ms"], circuit["failures"]) == (
            "open", opened, 5)
        assert set(circuit) == {"state", "since_ms", "why", "failures", "open_until_ms",
                                "paused_until_ms", "failing_since_ms", "attempts_saved"}
        assert [(a["action"], a["actor"]) for a in as_json["audit"]] == [
            ("add", "alice"), ("opened", "breaker")]


async def test_an_automatic_disable_says_so_and_why(queue: str) -> None:
    opened = open_circuit(queue, disable_after_ms=3_600_000)
    with open_store(queue) as store:
        now = opened
        for _ in range(100):  # each probe fails, the cool-down doubles, till it is disabled
            [row] = store.endpoints()
            if not row["enabled"]:
                break
            now = max(now, row["circuit"]["open_until_ms"] or now)
            claimed = store.claim_jobs("worker-1", 600_000, 5, now_ms=now, endpoints=("down",))
            assert len(claimed.leased) == 1  # the probe
            now += 1
            store.finish_jobs([(claimed.leased[0].ticket, "retry", 60_000,
                                Attempt(now, 1, None, REFUSED))], now_ms=now)
        assert row["enabled"] is False and row["disabled_why"]
        store.add_endpoint(Endpoint("paused", "http://127.0.0.1:9/p"), actor="bob")
        store.update_endpoint("paused", {"enabled": False}, note="maintenance", actor="bob")
    async with page(queue) as client:
        listed = await (await client.get("/endpoints")).text()
        down = listed[listed.index('id="endpoint-down"'):]
        assert "disabled automatically: its deliveries wait" in down[:down.index("</tr>")]
        assert "failing for" in down[:down.index("</tr>")]
        other = listed[listed.index('id="endpoint-paused"'):]
        assert "disabled by an operator" in other[:other.index("</tr>")]
        assert re.search(r'data-key="circuits\.disabled">2<', listed)
        assert re.search(r'data-key="circuits\.disabled_automatically">1<', listed)
        one = await (await client.get("/endpoint?name=down")).text()
        disabled = re.search(r'id="disabled">([^<]+)<', one)
        assert disabled is not None
        assert disabled.group(1).startswith("automatically, by the breaker: failing for")
        assert re.findall(r"<td>(disable)</td><td>[^<]*</td><td>(breaker)</td>", one) == [
            ("disable", "breaker")]
        as_json = await (await client.get("/endpoints?format=json")).json()
        assert as_json["circuits"]["disabled_automatically"] == 1


# ------------------------------------------------------------------ recovery

LONG_AGO = "2000-01-01T00:00"


async def dry_run(client: TestClient, **fields: str) -> tuple[int, str, str | None]:
    csrf = await csrf_of(client, "/endpoint?name=crm")
    answer = await client.post("/endpoint/recover/preview", data={
        "csrf": csrf, "endpoint": "crm", "since": LONG_AGO, "note": "crm lost its data",
        **fields})
    text = await answer.text()
    found = re.search(r'name="fingerprint" value="([0-9a-f]{64})"', text)
    return answer.status, text, None if found is None else found.group(1)


async def test_a_recovery_runs_dry_then_sends_exactly_that_set_again(queue: str) -> None:
    deliveries(queue)
    async with page(queue, allow_changes=True, operator="carol") as client:
        one = await (await client.get("/endpoint?name=crm")).text()
        assert 'id="recover-dry-run"' in one
        assert "inbox absorbs what it already applied" in one
        status, text, fingerprint = await dry_run(client)
        assert status == 200 and fingerprint is not None, text[:800]
        assert re.search(r'id="recover-count"><strong>4</strong> deliveries of', text)
        assert re.findall(r'<li><a href="[^"]*">([^<]+)</a></li>', text) == [
            "m1@crm", "m2@crm", "m3@crm", "m5@crm"]  # done and dead, since then
        assert 'name="since_ms" value="946684800000"' in text  # 2000-01-01T00:00Z
        assert "inbox absorbs what it already applied" in text

        # the set changes between the dry run and the confirmation: refused, nothing sent
        with open_store(queue) as store:
            assert store.redrive_jobs(["m1@crm"], 60_000, "by hand", actor="dave") == [True]
        before = statuses(queue)
        form = {"csrf": await csrf_of(client, "/endpoint?name=crm"), "endpoint": "crm",
                "since_ms": "946684800000", "note": "crm lost its data",
                "ttl_ms": "3600000"}
        stale = await client.post("/endpoint/recover/apply",
                                  data={**form, "fingerprint": fingerprint})
        assert stale.status == 409
        stale_text = await stale.text()
        assert 'id="refused"' in stale_text and "nothing was sent" in stale_text
        assert statuses(queue) == before
        # a fingerprint of another endpoint's or time's: refused too
        fresh = re.search(r'name="fingerprint" value="([0-9a-f]{64})"', stale_text)
        assert fresh is not None
        for other in ({"endpoint": "billing"}, {"since_ms": "946684800001"}):
            refused = await client.post("/endpoint/recover/apply",
                                        data={**form, **other, "fingerprint": fresh.group(1)})
            assert refused.status == 409, other
        assert statuses(queue) == before

        done = await client.post("/endpoint/recover/apply?format=json",
                                 data={**form, "fingerprint": fresh.group(1)})
        assert done.status == 200, await done.text()
        result = await done.json()
        assert result["recovered"] == ["m2@crm", "m3@crm", "m5@crm"]
        assert result["missed"] == [] and result["actor"] == "carol"
        assert "ids" not in result
    after = statuses(queue)
    for job_id in ("m2@crm", "m3@crm", "m5@crm"):
        assert after[job_id] == ("pending", None), job_id
    assert {job_id: state for job_id, state in after.items()
            if job_id not in ("m2@crm", "m3@crm", "m5@crm")} == {
        job_id: state for job_id, state in before.items()
        if job_id not in ("m2@crm", "m3@crm", "m5@crm")}
    with open_store(queue, read_only=True) as store:
        for job_id in ("m2@crm", "m5@crm"):
            history = store.job_history(job_id)
            assert history is not None
            assert [(r["note"], r["actor"]) for r in history["redrives"]] == [
                ("crm lost its data", "carol")], job_id
        m1 = store.job_history("m1@crm")
    assert m1 is not None and [(r["note"], r["actor"]) for r in m1["redrives"]] == [
        ("by hand", "dave")]


async def test_a_recovery_s_result_page_and_nothing_to_recover(queue: str) -> None:
    deliveries(queue)
    async with page(queue, allow_changes=True) as client:
        status, text, fingerprint = await dry_run(client, since="2999-01-01T00:00:00")
        assert status == 200 and fingerprint is None  # nothing to confirm
        assert "<strong>0</strong> deliveries" in text and 'id="confirm"' not in text
        assert re.search(r'id="fingerprint">[0-9a-f]{64}<', text)
        status, text, fingerprint = await dry_run(client)
        assert status == 200 and fingerprint is not None
        done = await client.post("/endpoint/recover/apply", data={
            "csrf": await csrf_of(client), "endpoint": "crm", "since_ms": "946684800000",
            "note": "crm lost its data", "fingerprint": fingerprint})
        assert done.status == 200
        page_text = await done.text()
        assert re.findall(r'<td><a href="[^"]*">([^<]+)</a></td><td class="result">', page_text) \
            == ["m1@crm", "m2@crm", "m3@crm", "m5@crm"]
        assert 'id="counts"><span class="count">4 sent again</span>' in page_text


async def test_a_recovery_is_refused_without_its_safety(queue: str) -> None:
    deliveries(queue)
    before = statuses(queue)
    async with page(queue, allow_changes=True, operator="carol") as client:
        _, _, fingerprint = await dry_run(client)
        assert fingerprint is not None
        good = {"csrf": await csrf_of(client), "endpoint": "crm", "since_ms": "946684800000",
                "note": "crm lost its data", "fingerprint": fingerprint}
        for path in ("/endpoint/recover/preview", "/endpoint/recover/apply"):
            for bad, status in (({"note": " "}, 400), ({"csrf": "0" * 64}, 403),
                                ({"endpoint": "nobody"}, 404), ({"endpoint": "a@b"}, 400),
                                ({"since_ms": "", "since": "yesterday"}, 400),
                                ({"since_ms": "", "since": "2024-02-30T00:00"}, 400),
                                ({"ttl_ms": "0"}, 400)):
                answer = await client.post(path, data={**good, **bad})
                assert answer.status == status, (path, bad, await answer.text())
            cross = await client.post(path, data=good,
                                      headers={"Origin": "https://evil.example"})
            assert cross.status == 403, path
    assert statuses(queue) == before
    # read-only: no form, and both posts refused
    async with page(queue) as client:
        one = await (await client.get("/endpoint?name=crm")).text()
        assert 'id="recover-dry-run"' not in one and "Read-only" in one
        csrf = await csrf_of(client, "/endpoint?name=crm") if 'name="csrf"' in one else "x"
        for path in ("/endpoint/recover/preview", "/endpoint/recover/apply"):
            answer = await client.post(path, data={**good, "csrf": csrf})
            assert answer.status == 403, path
            assert "read-only" in await answer.text()
    assert statuses(queue) == before
