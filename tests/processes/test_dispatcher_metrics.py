"""The dispatcher's /metrics and /healthz, scraped over HTTP from real servers.

One scripted scenario on a SQLite file and on PostgreSQL (jobs done, one
retried, one dead permanent, one quarantined by its deadline, one finish
refused as stale because its lease ran out under the send, one bad ACK),
then /metrics parsed as Prometheus text equals ``d.stats`` figure by figure
and the histograms count the sends, claims and finishes. /healthz is 200
while running and 503 after a stop, after a failure, and while the database
server is down. ``asyncworker run --metrics`` as a real process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from asyncworker import Dispatcher, dispatcher_context
from asyncworker.devtools.postgres_server import fresh_database
from asyncworker.metrics import add_metrics_routes, metrics_app
from lease.policy import RetryPolicy
from lease.stores import open_store
from tests.support.dispatching import FakeClock
from tests.support.scenario import LEASE_MS, SENDS, Script, T, run_scenario
from tests.support.servers import ReceiverProcess

# What the scenario comes to, as the dispatcher must count it.
EXPECTED = {"claimed": 10, "ok": 6, "retried": 1, "dead": 2, "quarantined": 1, "stale": 1,
            "bad_acks": 1, "errors": 0, "extended": 0}


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "queue.db")
    return str(request.getfixturevalue("postgres_url"))


async def _get(client: aiohttp.ClientSession, url: object) -> tuple[int, str, str]:
    async with client.get(str(url)) as response:
        return response.status, response.headers["Content-Type"], await response.text()


Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text scrape by (name, labels)."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def one(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def _scrape_both(d: Dispatcher) -> tuple[str, str, tuple[int, dict]]:
    server = TestServer(metrics_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            status, content_type, text = await _get(client, server.make_url("/metrics"))
            assert status == 200
            health_status, _, health = await _get(client, server.make_url("/healthz"))
    finally:
        await server.close()
    return text, content_type, (health_status, json.loads(health))


# ---------------------------------------------------------------- the scenario, scraped


async def test_metrics_equal_the_stats_figure_by_figure(target: str):
    stats, (text, content_type, (health_status, health)) = await run_scenario(
        target, _scrape_both)
    assert {key: getattr(stats, key) for key in EXPECTED} == EXPECTED  # the scenario's figures
    assert stats.dead_by_reason == {"deadline": 1, "exhausted": 0, "permanent": 1}
    assert content_type.startswith("text/plain")
    samples = parse(text)
    counters = {
        "asyncworker_jobs_claimed_total": stats.claimed,
        "asyncworker_jobs_done_total": stats.ok,
        "asyncworker_jobs_retried_total": stats.retried,
        "asyncworker_jobs_quarantined_total": stats.quarantined,
        "asyncworker_stale_completions_refused_total": stats.stale,
        "asyncworker_outcomes_unrecorded_busy_total": stats.unrecorded_busy,
        "asyncworker_bad_acks_total": stats.bad_acks,
        "asyncworker_errors_total": stats.errors,
        "asyncworker_store_busy_retries_total": stats.lock_retries,
        "asyncworker_lease_extensions_total": stats.extended,
        "asyncworker_claim_transactions_leasing_total": stats.claim_batches,
        "asyncworker_jobs_in_flight": stats.in_flight,
        "asyncworker_sends_in_flight": stats.sending,
        "asyncworker_sends_in_flight_peak": stats.peak_sending,
        "asyncworker_jobs_waiting_for_slot": stats.waiting,
        "asyncworker_send_slots": 1,
    }
    assert {name: one(samples, name) for name in counters} == counters
    dead = {reason: one(samples, "asyncworker_jobs_dead_total", reason=reason)
            for reason in ("deadline", "exhausted", "permanent")}
    assert dead == stats.dead_by_reason and sum(dead.values()) == stats.dead
    # every send that ended, by its answer's class: refused 409, flaky's 503; the
    # script's own sends carry no HTTP status
    answers = {klass: one(samples, "asyncworker_send_answers_total", **{"class": klass})
               for klass in ("1xx", "2xx", "3xx", "4xx", "5xx", "none")}
    assert answers == stats.answers
    assert (answers["4xx"], answers["5xx"], sum(answers.values())) == (1, 1, SENDS)
    assert one(samples, "asyncworker_deliveries_released_total") == stats.released == 0
    # the histograms count what happened, in seconds
    histograms = {"send_duration_seconds": SENDS,
                  "claim_transaction_duration_seconds": stats.claim_calls,
                  "finish_transaction_duration_seconds": stats.finish_batches}
    for name, count in histograms.items():
        assert one(samples, f"asyncworker_{name}_count") == count, name
        assert one(samples, f"asyncworker_{name}_bucket", le="+Inf") == count, name
        assert one(samples, f"asyncworker_{name}_bucket", le="60.0") == count, name
        assert 0 < one(samples, f"asyncworker_{name}_sum") < 60 * count, name
    # concurrency 1, batch 1: a claim per job; a finish group holds what up to four
    # claims sent (asyncworker.finisher)
    assert stats.claim_calls > stats.claim_batches == SENDS
    assert SENDS / 4 <= stats.finish_batches < SENDS
    # state: exactly one of the five, after the run: stopped; the last claim's store time
    states = {state: one(samples, "asyncworker_dispatcher_state", state=state)
              for state in ("new", "running", "stopping", "stopped", "failed")}
    assert states == {"new": 0, "running": 0, "stopping": 0, "stopped": 1, "failed": 0}
    assert one(samples, "asyncworker_last_claim_timestamp_seconds") == (T + LEASE_MS + 1) / 1000
    # a registry of its own: nothing of the process's global one
    assert not any(name.startswith(("process_", "python_")) for name, _ in samples)
    assert (health_status, health["state"], health["healthy"]) == (503, "stopped", False)
    assert health["store"]["reachable"] is True  # stopped, not unreachable


async def test_two_dispatchers_in_one_process_keep_their_own_figures(tmp_path: Path):
    first = Dispatcher(tmp_path / "a.db", "a", send=Script(FakeClock(T)), create=True)
    second = Dispatcher(tmp_path / "b.db", "b", send=Script(FakeClock(T)), create=True)
    first.stats.ok, second.stats.ok = 3, 5
    first.metrics.observe_send(0.5)
    texts = [d.metrics.exposition()[0].decode() for d in (first, second)]
    assert [one(parse(t), "asyncworker_jobs_done_total") for t in texts] == [3, 5]
    assert [one(parse(t), "asyncworker_send_duration_seconds_count") for t in texts] == [1, 0]


async def test_openmetrics_is_served_when_asked_for(tmp_path: Path):
    d = Dispatcher(tmp_path / "a.db", "a", send=Script(FakeClock(T)), create=True)
    server = TestServer(metrics_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client, client.get(
                server.make_url("/metrics"),
                headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as answer:
            text = await answer.text()
            assert answer.headers["Content-Type"].startswith("application/openmetrics-text")
    finally:
        await server.close()
    assert text.endswith("# EOF\n") and "asyncworker_jobs_done_total 0" in text


# ---------------------------------------------------------------- /healthz


async def _health_when(client: aiohttp.ClientSession, url: object,
                       condition: Callable[[int, dict], bool],
                       timeout: float = 30.0) -> tuple[int, dict]:
    """Ask until the answer matches (the code under test makes it so); fail, not hang."""
    give_up = time.monotonic() + timeout
    while True:
        async with client.get(str(url)) as response:
            status, answer = response.status, await response.json()
        if condition(status, answer):
            return status, answer
        assert time.monotonic() < give_up, f"health never matched: {status} {answer}"
        await asyncio.sleep(0.02)


def _embedding_app(d: Dispatcher) -> web.Application:
    """An application of the caller's that mounts the routes and owns the dispatcher."""
    app = web.Application()
    add_metrics_routes(app, d)
    app.cleanup_ctx.append(dispatcher_context(d))
    return app


async def _ok(event: dict, token: int) -> bool:
    return True


async def test_healthz_is_200_while_running_and_503_after_stop(tmp_path: Path):
    d = Dispatcher(tmp_path / "q.db", "svc", send=_ok, poll_interval=0.01, create=True)
    server = TestServer(_embedding_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            url = server.make_url("/healthz")
            status, answer = await _health_when(
                client, url, lambda _, a: a["last_claim_ms"] is not None)
            assert (status, answer["state"], answer["healthy"]) == (200, "running", True)
            assert answer["store"]["reachable"] and answer["store"]["error"] is None
            assert 0 <= answer["last_claim_age_s"] < 30  # an idle one claims every poll
            async with client.get(server.make_url("/metrics")) as scraped:
                samples = parse(await scraped.text())
            assert one(samples, "asyncworker_dispatcher_state", state="running") == 1
            assert abs(one(samples, "asyncworker_last_claim_timestamp_seconds")
                       - time.time()) < 60  # the store's clock, unix seconds
            d.stop()
            status, answer = await _health_when(client, url,
                                                lambda _, a: a["state"] == "stopped")
            assert (status, answer["healthy"]) == (503, False)
    finally:
        await server.close()


async def test_healthz_is_503_after_a_failure(tmp_path: Path):
    d = Dispatcher(tmp_path / "q.db", "svc", send=_ok, clock=lambda: -1, create=True)
    server = TestServer(_embedding_app(d), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            status, answer = await _health_when(client, server.make_url("/healthz"),
                                                lambda _, a: a["state"] == "failed")
            scraped = await (await client.get(server.make_url("/metrics"))).text()
    finally:
        with pytest.raises(ValueError, match="clock value"):
            await server.close()  # the run's error, raised again at cleanup
    assert (status, answer["state"], answer["healthy"]) == (503, "failed", False)
    assert answer["failure"].startswith("ValueError") and answer["store"]["reachable"]
    assert one(parse(scraped), "asyncworker_dispatcher_state", state="failed") == 1


async def test_healthz_is_503_while_the_database_server_is_down(
        make_postgres_server: Callable[..., Any]):
    server = make_postgres_server()
    url = fresh_database(server.url)
    with open_store(url, create=True):
        pass
    d = Dispatcher(url, "svc", send=_ok, poll_interval=0.05, threads=2)
    web_server = TestServer(_embedding_app(d), host="127.0.0.1")
    await web_server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            health = web_server.make_url("/healthz")
            status, answer = await _health_when(
                client, health, lambda s, a: s == 200 and a["last_claim_ms"] is not None)
            assert answer["store"]["reachable"] is True
            await asyncio.to_thread(server.stop)
            status, down = await _health_when(client, health,
                                              lambda _, a: not a["store"]["reachable"])
            assert (status, down["healthy"]) == (503, False)
            assert down["store"]["error"] and "\n" not in down["store"]["error"]
            assert "password" not in down["store"]["error"].lower()
            await asyncio.to_thread(server.start)  # the same port: the pool reconnects
            status, back = await _health_when(client, health, lambda s, _: s == 200, 60)
            assert back["state"] == "running" and back["store"]["reachable"]
    finally:
        await web_server.close()
    assert d.state == "stopped" and d.stats.errors == 0


# ---------------------------------------------------------------- run --metrics, a process


def _enqueue_cli(queue: Path, n: int) -> None:
    with open_store(queue, create=True) as store:
        events = [{"id": f"job-{i}", "qty": 1} for i in range(n)]
        assert store.enqueue_events(events, RetryPolicy()) == [True] * n


def _read_until(proc: subprocess.Popen, pattern: str, seen: list[str]) -> re.Match:
    """stderr lines until one matches; fails with what was seen if it never does."""
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        if not line:
            pytest.fail(f"the process ended without {pattern!r}: {''.join(seen)}")
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found


async def test_run_with_metrics_serves_them_while_it_runs(tmp_path: Path):
    queue = tmp_path / "queue.db"
    _enqueue_cli(queue, 30)
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncworker", "run", str(queue), "--url", rx.url,
             "--metrics", "127.0.0.1:0", "--owner", "scraped"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: list[str] = []
        try:
            base = _read_until(proc, r"^metrics: (http://127\.0\.0\.1:\d+)/metrics", seen)[1]
            _read_until(proc, r"^run: owner scraped", seen)  # signals handled from here
            async with aiohttp.ClientSession() as client:
                give_up = time.monotonic() + 30
                while True:
                    status, content_type, text = await _get(client, base + "/metrics")
                    assert status == 200 and content_type.startswith("text/plain")
                    if one(parse(text), "asyncworker_jobs_done_total") == 30:
                        break
                    assert time.monotonic() < give_up, text
                    await asyncio.sleep(0.05)
                async with client.get(base + "/healthz") as answer:
                    assert answer.status == 200 and (await answer.json())["healthy"]
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, "".join(seen) + err
    assert json.loads(out)["ok"] == 30 and "Traceback" not in err


@pytest.mark.parametrize("value, message", [
    ("127.0.0.1:x", "the port must be 0..65535"),
    ("127.0.0.1:70000", "the port must be 0..65535"),
    ("::1:9100", "an IPv6 address goes in brackets"),
    ("", "the port must be 0..65535"),
])
def test_a_bad_metrics_address_is_one_line_and_nothing_runs(tmp_path: Path, value: str,
                                                           message: str):
    queue = tmp_path / "queue.db"
    _enqueue_cli(queue, 1)
    before = queue.read_bytes()
    out = subprocess.run([sys.executable, "-m", "asyncworker", "run", str(queue), "--url",
                          "http://127.0.0.1:9/events", "--metrics", value],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert queue.read_bytes() == before


def test_a_metrics_port_taken_is_exit_2_and_nothing_is_claimed(tmp_path: Path):
    queue = tmp_path / "queue.db"
    _enqueue_cli(queue, 3)
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "asyncworker", "run", str(queue), "--url",
                              "http://127.0.0.1:9/events", "--metrics", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"--metrics 127.0.0.1:{port}: cannot serve there" in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    with open_store(queue, read_only=True) as store:
        assert store.counts() == {"pending": 3, "leased": 0, "done": 0, "dead": 0}

