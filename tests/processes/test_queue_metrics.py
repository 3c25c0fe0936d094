"""The queue's metrics where an operator scrapes them, over a real SQLite
queue file: the page's ``/metrics`` (behind its token like every page) and
``asyncworker metrics QUEUE``, a real child process that reads a queue a
dispatcher keeps changing, answers only to its own names, and stops on
SIGTERM."""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from asyncworker.ui import ui_app
from lease.endpoints import Endpoint
from lease.records import Attempt
from lease.stores import open_store
from tests.support.commands import cli
from tests.support.servers import stop_process

TOKEN = "a-token-long-enough-for-the-page"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.fixture
def queue(tmp_path: Path) -> str:
    name = str(tmp_path / "queue.db")
    with open_store(name, create=True) as store:
        store.add_endpoint(Endpoint("billing", "http://127.0.0.1:9/b", types=("invoice",)))
        store.add_endpoint(Endpoint("crm", "http://127.0.0.1:9/c"))
        store.enqueue_events([{"id": f"m{i}", "body": {"n": i}, "type": "invoice"}
                              for i in range(3)])
        leased = store.claim_jobs("w", 60_000, 1, endpoints=("crm",)).leased
        store.finish_jobs([(one.ticket, "ok", 0, Attempt(store.now_ms(), 1, 200))
                           for one in leased])
    return name


async def test_the_page_serves_the_queues_metrics_behind_its_token(queue: str):
    app = ui_app(queue, token=TOKEN)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        refused = await client.get("/metrics", headers={"Accept": "text/plain"})
        assert refused.status == 401
        answer = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status == 200
        got = samples(await answer.text())
    assert got[("asyncworker_queue_jobs", (("status", "pending"),))] == 5
    assert got[("asyncworker_queue_jobs", (("status", "done"),))] == 1
    assert got[("asyncworker_queue_endpoint_jobs", (("endpoint", "billing"),
                                                    ("status", "pending")))] == 3
    assert got[("asyncworker_queue_endpoint_ready_jobs", (("endpoint", "crm"),))] == 2
    assert got[("asyncworker_queue_endpoints", (("state", "closed"),))] == 2


class Exporter:
    """A real ``asyncworker metrics QUEUE ARGS --port 0``: its port, from the
    first line it prints."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "metrics", *args,
                                      "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        if found is None:
            _, err = stop_process(self.proc)
            pytest.fail(f"asyncworker metrics did not start: {line!r} {err}")
        self.port = int(found.group(1))

    def get(self, host: str | None = None) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.putrequest("GET", "/metrics", skip_host=True)
            connection.putheader("Host", host or f"127.0.0.1:{self.port}")
            connection.endheaders()
            answer = connection.getresponse()
            return answer.status, answer.read().decode()
        finally:
            connection.close()


def test_the_exporter_reads_what_a_writer_changes_and_stops_on_sigterm(queue: str):
    exporter = Exporter(queue, "--interval", "0", "--no-endpoint-label")
    try:
        status, text = exporter.get()
        assert status == 200
        got = samples(text)
        assert got[("asyncworker_queue_jobs", (("status", "pending"),))] == 5
        assert not any(name.startswith("asyncworker_queue_endpoint_") for name, _ in got)
        with open_store(queue) as store:  # a writer after the exporter started
            store.update_endpoint("billing", {"enabled": False})
            store.enqueue_events([{"id": "late", "body": {"n": 9}, "type": "other"}])
        got = samples(exporter.get()[1])
        assert got[("asyncworker_queue_jobs", (("status", "pending"),))] == 6
        assert got[("asyncworker_queue_endpoints", (("state", "disabled"),))] == 1
        # a name rebound to this address reads nothing
        status, text = exporter.get(host=f"evil.example:{exporter.port}")
        assert status == 421 and "asyncworker_queue" not in text
    finally:
        stop_process(exporter.proc, signal.SIGTERM)
    assert exporter.proc.returncode == 0


def test_the_exporter_refuses_bad_input_before_it_binds(tmp_path: Path, queue: str):
    missing = cli("metrics", str(tmp_path / "nope.db"), "--port", "0", timeout=60)
    assert missing.returncode == 2 and "nope.db" in missing.stderr
    bad = cli("metrics", queue, "--interval", "-1", timeout=60)
    assert bad.returncode == 2 and "--interval" in bad.stderr
