"""A real browser on the operator's page: headless Chromium from Debian's package
(``apt-get install chromium``; ``.ci/run`` installs it), driven by Playwright for
Python, against a real ``asyncworker ui QUEUE --allow-changes`` process on
127.0.0.1. It filters the dead letters, runs a dry run, confirms a bulk
redrive and checks the result, page by page and in the queue; it sees the
overview's chart drawn, cancels a pending job from its page, and pauses the
queue from the page (a claim then leases nothing) and resumes it; a
screenshot of each step is saved in the test's tmp_path.

``pytest -m browser`` runs it (CI does). Without Chromium it fails, naming the
package: it is never skipped. With ``ASYNCWORKER_UI_SCREENSHOT=PATH`` the
dead letters' page is also saved there (``docs/operator-ui.png`` for the README).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.stores import open_store

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT_ENV = "ASYNCWORKER_UI_SCREENSHOT"


def dead_letters(target: str, ids: list[str], outcome: str, error: str) -> None:
    with open_store(target) as store:
        store.enqueue_events([{"id": job_id, "body": {"order": job_id}} for job_id in ids],
                             RetryPolicy(max_attempts=1))
        claimed = store.claim_jobs("worker-1", 10_000, len(ids))
        assert len(claimed.leased) == len(ids)
        store.finish_jobs([(job.ticket, outcome, 0, Attempt(claimed.now_ms, 12, None, error))
                           for job in claimed.leased])


@pytest.fixture
def queue(tmp_path: Path) -> str:
    name = str(tmp_path / "queue.db")
    open_store(name, create=True).close()
    dead_letters(name, [f"order:{i}" for i in range(5)], "permanent", "HTTPError: 410 Gone")
    dead_letters(name, [f"order:{i}" for i in range(5, 7)], "retry", "TimeoutError: timed out")
    dead_letters(name, [f"invoice:{i}" for i in range(3)], "permanent", "HTTPError: 400")
    return name


@pytest.fixture
def ui_process(queue: str) -> Iterator[str]:
    """A real ``asyncworker ui`` on a free loopback port: its URL."""
    with _ui(queue, 0) as url:
        yield url


@contextlib.contextmanager
def _ui(queue: str, port: int) -> Iterator[str]:
    """``asyncworker ui QUEUE --allow-changes --port PORT``: its URL; stopped by
    SIGTERM (killed if it hangs) and waited for. Started in the queue's folder,
    so the page (and its screenshot) names it by its short name."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "ui", Path(queue).name,
                             "--allow-changes", "--port", str(port)], cwd=Path(queue).parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/) \(changes allowed\)", line)
        if found is None:
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"asyncworker ui did not start: {line!r} {err}")
        yield found.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _browser_or_fail() -> None:
    if not CHROMIUM.is_file():
        pytest.fail(f"the browser test needs Chromium at {CHROMIUM}: apt-get install chromium "
                    f"(Debian's package; .ci/run installs it)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("the browser test needs Playwright for Python: pip install playwright "
                    "(never `playwright install`: it drives the system Chromium)")


@contextlib.contextmanager
def csp_checked_page(tmp_path: Path) -> Iterator[Page]:
    """A page of a fresh headless Chromium (the system's, 1280 x 900, its
    profile in tmp_path), closed on leaving; and then, nothing on the page
    refused by the Content Security Policy (the console's reports)."""
    _browser_or_fail()
    from playwright.sync_api import sync_playwright

    refused: list[str] = []
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
        try:
            page = context.new_page()
            page.on("console", lambda message: refused.append(message.text)
                    if "Content Security Policy" in message.text else None)
            yield page
        finally:
            context.close()
    assert not refused, refused  # nothing on the page broke the CSP


class AttackersServer:
    """The attacker's own server, on 127.0.0.1 here: one page, until it is closed."""

    PAGE = b"<!doctype html><title>cute cats</title><p>cats</p>"

    def __init__(self) -> None:
        page = self.PAGE

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        # A thread a connection: Chromium may open a connection it never sends on
        # (a preconnect), and a server of one thread would wait on it, so that
        # shutdown() never returned (the test timed out on a loaded machine).
        Handler.timeout = 10  # an idle connection's thread ends after it
        accepted: list[socket.socket] = []
        self.accepted = accepted

        class Server(http.server.ThreadingHTTPServer):
            def get_request(self) -> tuple[socket.socket, Any]:
                connection, address = super().get_request()
                accepted.append(connection)
                return connection, address

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        self.server.shutdown()
        self.server.server_close()
        # Chromium keeps idle connections (and preconnects) to evil.example:PORT;
        # left open, the page's next fetch went to this server, not to the
        # console now on the port (a 200 for /dead, once in a while). The real
        # attacker closes them too, so that the browser connects anew.
        for connection in self.accepted:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=30)


def test_a_site_whose_name_was_rebound_to_the_page_changes_nothing(
        queue: str, tmp_path: Path) -> None:
    """DNS rebinding in a real browser. Chromium resolves evil.example to 127.0.0.1
    (--host-resolver-rules); the attacker's page comes from the attacker's server
    at evil.example:PORT, which then gives the port to ``asyncworker ui`` (as the
    name's address changes in the real attack, the origin staying the same). The
    page's script reads /dead for the CSRF token and posts the dry run and the
    cancel, same-origin for the browser: every request is refused (421), nothing
    read, nothing changed. The operator's own page on that port still works."""
    _browser_or_fail()
    from playwright.sync_api import sync_playwright

    attacker = AttackersServer()
    evil = f"http://evil.example:{attacker.port}"
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.example 127.0.0.1"])
        try:
            page = context.new_page()
            page.goto(f"{evil}/cats")
            assert page.title() == "cute cats"
            attacker.close()
            with _ui(queue, attacker.port) as url:
                seen = page.evaluate("""async () => {
                    const out = {};
                    const dead = await fetch("/dead");
                    const text = await dead.text();
                    out.dead = dead.status;
                    const found = text.match(/name="csrf" value="([0-9a-f]{64})"/);
                    out.csrf = found ? found[1] : null;
                    const form = {action: "cancel", note: "by another site",
                                  csrf: out.csrf || "none"};
                    const dry = await fetch("/dead/preview?format=json",
                                            {method: "POST", body: new URLSearchParams(form)});
                    out.preview = dry.status;
                    if (dry.ok) form.fingerprint = (await dry.json()).fingerprint;
                    const done = await fetch("/dead/apply?format=json",
                                             {method: "POST", body: new URLSearchParams(form)});
                    out.apply = done.status;
                    out.applied = await done.text();
                    return out;
                }""")
                assert seen["csrf"] is None, seen
                assert (seen["dead"], seen["preview"], seen["apply"]) == (421, 421, 421), seen
                own = context.new_page()
                own.goto(url + "dead")
                assert own.locator('input[name="csrf"]').count() >= 1
        finally:
            context.close()
            attacker.close()
    with open_store(queue, read_only=True) as store:
        assert len(store.jobs_with_status("dead")) == 10
        history = store.job_history("order:0")
    assert history is not None and history["cancels"] == []


def test_a_bulk_redrive_in_a_real_browser(queue: str, ui_process: str, tmp_path: Path) -> None:
    with csp_checked_page(tmp_path) as page:
        page.goto(ui_process)
        assert page.locator('[data-key="by_status.dead"]').inner_text() == "10"
        assert page.locator('[data-key="dead_by_reason.exhausted"]').inner_text() == "2"
        # the stylesheet loaded under the CSP: the header has its band
        assert page.locator("header").evaluate(
            "e => getComputedStyle(e).backgroundColor") == "rgb(244, 246, 249)"
        page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)

        page.click("text=Dead letters")
        page.select_option("#filter-reason", "permanent")
        page.fill("#filter-prefix", "order:")
        page.click("#filter")
        page.wait_for_url(re.compile(r"/dead\?reason=permanent&id_prefix=order"))
        listed = page.locator("a.job").all_inner_texts()
        assert listed == [f"order:{i}" for i in range(5)]
        assert page.locator("td.error").first.inner_text() == "HTTPError: 410 Gone"
        page.fill("#note", "the receiver serves orders again")
        dead_page = tmp_path / "dead-letters.png"
        page.screenshot(path=str(dead_page), full_page=True)

        page.click("#dry-run")
        assert page.locator("#count strong").first.inner_text() == "5"
        assert page.locator("#sample li").all_inner_texts() == listed
        assert re.fullmatch(r"[0-9a-f]{64}", page.locator("#fingerprint").inner_text())
        page.screenshot(path=str(tmp_path / "dry-run.png"), full_page=True)

        page.click("#confirm")
        assert page.locator("h1").inner_text() == "Result: redrive"
        assert page.locator("td.result").all_inner_texts() == ["redriven"] * 5
        assert page.locator("#counts").inner_text() == "5 redriven"
        page.screenshot(path=str(tmp_path / "result.png"), full_page=True)
    with open_store(queue, read_only=True) as store:
        assert {job["id"] for job in store.jobs_with_status("pending")} == set(listed)
        assert {job["id"] for job in store.jobs_with_status("dead")} == {
            "order:5", "order:6", *(f"invoice:{i}" for i in range(3))}
        history = store.job_history("order:0")
    assert history is not None
    assert [r["note"] for r in history["redrives"]] == ["the receiver serves orders again"]
    for shot in ("overview", "dead-letters", "dry-run", "result"):
        assert (tmp_path / f"{shot}.png").stat().st_size > 10_000, shot
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copyfile(dead_page, os.environ[SCREENSHOT_ENV])


def test_the_endpoints_page_in_a_real_browser(tmp_path: Path) -> None:
    """A queue with two endpoints (a secret and header values set): the
    Endpoints page renders their figures under the CSP, shows no secret, and
    one endpoint's link opens its page, then its deliveries, and only its."""
    from lease.endpoints import Endpoint
    from lease.signing import new_secret

    secret = new_secret(random=b"b" * 32)
    header_value = "Bearer header-value-never-shown"
    name = str(tmp_path / "queue.db")
    with open_store(name, create=True) as store:
        store.add_endpoint(Endpoint("billing", "http://127.0.0.1:9/billing", secrets=(secret,),
                                    headers=(("Authorization", header_value),),
                                    types=("invoice.paid",), max_in_flight=4))
        store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/crm"))
        store.enqueue_events([{"id": f"m{i}", "type": "invoice.paid", "body": {"n": i}}
                              for i in range(3)] + [{"id": "u1", "type": "user.created",
                                                     "body": {"n": 9}}])
        claimed = store.claim_jobs("worker-1", 600_000, 100, endpoints="*")
        tickets = {job.ticket["id"]: job.ticket for job in claimed.leased}
        store.finish_jobs([(tickets["m0@billing"], "ok", 0, Attempt(claimed.now_ms, 3, 200)),
                           (tickets["m1@crm"], "permanent", 0,
                            Attempt(claimed.now_ms, 3, None, "HTTPError: 410 Gone"))])
    with _ui(name, 0) as url, csp_checked_page(tmp_path) as page:
        page.goto(url)
        page.click("header nav >> text=Endpoints")
        page.wait_for_url(re.compile(r"/endpoints$"))
        assert page.locator("a.endpoint").all_inner_texts() == ["billing", "crm"]
        figures = {key: page.locator(f'[data-key="{key}"]').inner_text() for key in (
            "billing.ready", "billing.in_flight", "billing.done", "billing.dead",
            "crm.in_flight", "crm.dead")}
        assert figures == {"billing.ready": "0", "billing.in_flight": "2",
                           "billing.done": "1", "billing.dead": "0",
                           "crm.in_flight": "3", "crm.dead": "1"}
        assert page.locator('[data-key="crm.last_error"]').inner_text().startswith(
            "HTTPError: 410 Gone, at ")
        content = page.content()
        assert secret not in content and header_value not in content
        page.screenshot(path=str(tmp_path / "endpoints.png"), full_page=True)

        page.click("a.endpoint >> text=billing")
        page.wait_for_url(re.compile(r"/endpoint\?name=billing$"))
        assert page.locator("#endpoint-name").inner_text() == "billing"
        assert page.locator("#types").inner_text() == "invoice.paid"
        page.click("#deliveries")
        page.wait_for_url(re.compile(r"/jobs\?endpoint=billing$"))
        assert page.locator("a.job").all_inner_texts() == [
            f"m{i}@billing" for i in range(3)]
        assert page.locator("td.message").all_inner_texts() == ["m0", "m1", "m2"]
        page.screenshot(path=str(tmp_path / "deliveries.png"), full_page=True)
    assert (tmp_path / "endpoints.png").stat().st_size > 10_000


def test_an_open_circuit_and_a_recovery_in_a_real_browser(tmp_path: Path) -> None:
    """An endpoint whose five deliveries failed (connection refused): its page
    shows the circuit open and why; a recovery of what it finished goes
    through the dry run (the count, the fingerprint) and the confirmation,
    under the CSP, and the queue holds those deliveries pending again."""
    from lease.endpoints import Endpoint

    refused_by = "connection refused by 127.0.0.1:9"
    name = str(tmp_path / "queue.db")
    with open_store(name, create=True) as store:
        store.add_endpoint(Endpoint("shop", "http://127.0.0.1:9/shop", types=("order",)))
        store.enqueue_events([{"id": f"o{i}", "type": "order", "body": {"n": i}}
                              for i in range(8)], RetryPolicy(max_attempts=50))
        claimed = store.claim_jobs("worker-1", 600_000, 8, endpoints="*")
        tickets = {job.ticket["id"]: job.ticket for job in claimed.leased}
        now = claimed.now_ms + 1
        # three delivered, then five refused in a row: the circuit opens
        store.finish_jobs([(tickets[f"o{i}@shop"], "ok", 0, Attempt(now, 3, 200))
                           for i in range(3)], now_ms=now)
        store.finish_jobs([(tickets[f"o{i}@shop"], "retry", 60_000,
                            Attempt(now + 1, 3, None, refused_by)) for i in range(3, 8)],
                          now_ms=now + 1)
        [row] = store.endpoints()
        assert row["circuit"]["state"] == "open"
    with _ui(name, 0) as url, csp_checked_page(tmp_path) as page:
        page.goto(url + "endpoints")
        assert page.locator('[data-key="circuits.open"]').inner_text() == "1"
        assert page.locator('[data-key="shop.circuit"] .circuit').inner_text() == "open"
        page.click("a.endpoint >> text=shop")
        page.wait_for_url(re.compile(r"/endpoint\?name=shop$"))
        assert page.locator("#circuit-state .circuit").inner_text() == "open"
        why = page.locator("#circuit-why").inner_text()
        assert "5 failures in a row" in why and refused_by in why
        page.screenshot(path=str(tmp_path / "circuit.png"), full_page=True)

        # since: prefilled with when it began failing; from long ago, every finished one
        assert page.locator("#recover-since").input_value()
        page.fill("#recover-since", "2000-01-01T00:00:00")
        page.fill("#recover-note", "the shop restored a backup")
        page.click("#recover-dry-run")
        page.wait_for_url(re.compile(r"/endpoint/recover/preview$"))
        assert page.locator("#recover-count strong").first.inner_text() == "3"
        assert page.locator("#sample li").all_inner_texts() == [
            f"o{i}@shop" for i in range(3)]
        assert re.fullmatch(r"[0-9a-f]{64}", page.locator("#fingerprint").inner_text())
        page.screenshot(path=str(tmp_path / "recover-dry-run.png"), full_page=True)

        page.click("#confirm")
        page.wait_for_url(re.compile(r"/endpoint/recover/apply$"))
        assert page.locator("#counts").inner_text() == "3 sent again"
        assert page.locator("td.result").all_inner_texts() == ["sent again"] * 3
        page.screenshot(path=str(tmp_path / "recovered.png"), full_page=True)
    with open_store(name, read_only=True) as store:
        pending = {job["id"] for job in store.jobs_with_status("pending")}
        history = store.job_history("o0@shop")
    assert {f"o{i}@shop" for i in range(8)} == pending
    assert history is not None
    assert [r["note"] for r in history["redrives"]] == ["the shop restored a backup"]
    assert (tmp_path / "circuit.png").stat().st_size > 10_000


def test_a_chart_a_cancel_and_a_pause_in_a_real_browser(tmp_path: Path) -> None:
    """The console in a real browser: the overview's chart of the last hour
    drawn with bars for the minute that had deliveries (under the CSP), a
    pending job cancelled from its page, and the queue paused from the page:
    a dispatcher's claim then leases nothing, until it is resumed."""
    queue = str(tmp_path / "queue.db")
    with open_store(queue, create=True) as store:
        store.enqueue_events([{"id": f"sent:{i}", "body": {"n": i}} for i in range(3)])
        claimed = store.claim_jobs("worker-1", 10_000, 3)
        store.finish_jobs([(job.ticket, "ok", 0, Attempt(claimed.now_ms, 30, 200))
                           for job in claimed.leased])
    dead_letters(queue, ["gone:0", "gone:1"], "permanent", "HTTPError: 410 Gone")
    with open_store(queue) as store:
        store.enqueue_events([{"id": "waiting", "body": {"n": 7}},
                              {"id": "later", "body": {"n": 8}}])
    with _ui(queue, 0) as url, csp_checked_page(tmp_path) as page:
        page.goto(url)
        hour = page.locator("svg#the-queue-hour-outcomes")
        assert "the last hour" in hour.locator("title").first.text_content()
        done = hour.locator("rect.bar.done")
        dead = hour.locator("rect.bar.dead")
        assert (done.count(), dead.count()) == (1, 1)  # one minute had deliveries
        assert (done.get_attribute("data-count"), dead.get_attribute("data-count")) == (
            "3", "2")
        box = done.bounding_box()
        assert box is not None and box["height"] > 10  # drawn, not only in the markup
        assert page.locator("svg#the-queue-hour-latency polyline.line.p50").count() == 1
        dot = page.locator("svg#the-queue-hour-latency circle.point.p50").bounding_box()
        assert dot is not None and dot["width"] > 2  # its one minute drawn as a dot
        page.screenshot(path=str(tmp_path / "chart.png"), full_page=True)

        page.goto(f"{url}job?id=waiting")
        page.fill("#cancel-note", "the customer withdrew it")
        page.click("#cancel-button")
        assert page.locator("#change-result strong").inner_text() == "cancelled"
        page.screenshot(path=str(tmp_path / "cancelled.png"), full_page=True)

        page.click("nav >> text=Pause")
        page.fill("#pause-note", "the receiver is being upgraded")
        page.click("#pause-button")
        page.wait_for_selector("#resume-form")
        assert page.locator("#paused-state").inner_text().startswith("Paused since")
        with open_store(queue) as store:
            assert store.claim_jobs("worker-2", 10_000, 10).leased == []
        page.goto(url)
        assert "the receiver is being upgraded" in page.locator("#paused-banner").inner_text()
        page.screenshot(path=str(tmp_path / "paused.png"), full_page=True)

        page.click("nav >> text=Pause")
        page.fill("#resume-note", "upgraded")
        page.click("#resume-button")
        page.wait_for_selector("#pause-form")
    with open_store(queue) as store:
        history = store.job_history("waiting")
        assert history is not None and history["job"]["reason"] == "cancelled"
        assert [row["note"] for row in history["cancels"]] == ["the customer withdrew it"]
        assert [row["action"] for row in store.queue_audit()] == ["pause", "resume"]
        assert [job.ticket["id"] for job in store.claim_jobs("worker-2", 10_000, 10).leased] == [
            "later"]
