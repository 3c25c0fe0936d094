"""The queue's metrics as a scrape sees them (``asyncworker.queue_metrics``):
figures from the store's ``queue_depth``, read at most once per interval
however many scrape, one read at a time, and per endpoint only when asked.
The read is a coroutine of the test's and the clock is the test's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncworker.queue_metrics import QueueMetrics

DEPTH: dict[str, Any] = {
    "by_status": {"pending": 7, "leased": 2, "done": 40, "dead": 3}, "ready": 5,
    "oldest_ready_age_ms": 2500, "blocked_keys": 1,
    "endpoints": [
        {"name": "billing", "enabled": True, "circuit": "open",
         "by_status": {"pending": 4, "leased": 0, "done": 10, "dead": 1}, "ready": 4,
         "oldest_ready_age_ms": 2500},
        {"name": "crm", "enabled": False, "circuit": "closed",
         "by_status": {"pending": 3, "leased": 2, "done": 30, "dead": 2}, "ready": 1,
         "oldest_ready_age_ms": None},
    ]}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """The store's reads: how many, and a gate that holds each one open."""

    def __init__(self) -> None:
        self.count = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self) -> dict[str, Any]:
        self.count += 1
        await self.gate.wait()
        return DEPTH


def samples(body: bytes) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_the_figures_of_the_queue_and_of_each_endpoint():
    clock, reads = Clock(), Reads()
    body, content_type = await QueueMetrics(reads, clock=clock).exposition()
    assert content_type.startswith("text/plain")
    got = samples(body)
    assert got[("asyncworker_queue_jobs", (("status", "pending"),))] == 7
    assert got[("asyncworker_queue_jobs", (("status", "dead"),))] == 3
    assert got[("asyncworker_queue_ready_jobs", ())] == 5
    assert got[("asyncworker_queue_oldest_ready_age_seconds", ())] == 2.5
    assert got[("asyncworker_queue_blocked_keys", ())] == 1
    assert got[("asyncworker_queue_endpoints", (("state", "open"),))] == 1
    assert got[("asyncworker_queue_endpoints", (("state", "disabled"),))] == 1
    assert got[("asyncworker_queue_endpoints", (("state", "closed"),))] == 0
    assert got[("asyncworker_queue_endpoint_jobs", (("endpoint", "crm"),
                                                    ("status", "leased")))] == 2
    assert got[("asyncworker_queue_endpoint_ready_jobs", (("endpoint", "billing"),))] == 4
    assert got[("asyncworker_queue_endpoint_oldest_ready_age_seconds",
                (("endpoint", "crm"),))] == 0
    assert got[("asyncworker_queue_endpoint_enabled", (("endpoint", "crm"),))] == 0
    assert got[("asyncworker_queue_endpoint_circuit", (("endpoint", "billing"),
                                                       ("state", "open")))] == 1
    assert got[("asyncworker_queue_endpoint_circuit", (("endpoint", "billing"),
                                                       ("state", "closed")))] == 0


async def test_without_the_endpoint_label_only_the_counts_by_state_stay():
    body, _ = await QueueMetrics(Reads(), by_endpoint=False, clock=Clock()).exposition()
    names = {name for name, _ in samples(body)}
    assert "asyncworker_queue_endpoints" in names
    assert not any(name.startswith("asyncworker_queue_endpoint_") for name in names)


async def test_openmetrics_when_the_scraper_asks_for_it():
    body, content_type = await QueueMetrics(Reads(), clock=Clock()).exposition(
        "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


async def test_the_store_is_read_at_most_once_per_interval_however_many_scrape():
    clock, reads = Clock(), Reads()
    metrics = QueueMetrics(reads, interval_s=15, clock=clock)
    for _ in range(5):
        await metrics.exposition()
    assert reads.count == 1
    clock.now += 10
    body, _ = await metrics.exposition()
    assert reads.count == 1
    assert samples(body)[("asyncworker_queue_figures_age_seconds", ())] == 10
    clock.now += 5
    await metrics.exposition()
    assert reads.count == 2


async def test_scrapes_at_once_share_one_read():
    reads = Reads()
    reads.gate.clear()
    metrics = QueueMetrics(reads, interval_s=0, clock=Clock())
    scrapes = [asyncio.create_task(metrics.exposition()) for _ in range(4)]
    while reads.count == 0:
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert reads.count == 1  # the others wait for the read under way
    reads.gate.set()
    await asyncio.gather(*scrapes)
    # interval 0: each waiting scrape reads again once the first is done, one at a time
    assert reads.count == 4


@pytest.mark.parametrize("interval", [-1, 3601, "15", float("nan")])
def test_a_bad_interval_is_refused(interval: Any):
    with pytest.raises(ValueError, match="interval_s"):
        QueueMetrics(Reads(), interval_s=interval)
