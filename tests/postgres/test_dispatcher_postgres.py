"""The asyncio runtime on a real PostgreSQL server: many hosts, one queue.

Dispatchers share one database, each with a pool of connections; leases are
judged by the server's clock, so hosts whose own clocks are minutes apart
share jobs correctly; an idle dispatcher wakes on the server's NOTIFY.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from aiohttp import web

from asyncworker import Dispatcher, make_app
from lease.policy import RetryPolicy
from lease.stores import open_store

POLICY = RetryPolicy(max_attempts=5, ttl_ms=600_000, lease_ms=10_000)
ROOT = Path(__file__).resolve().parents[2]


def enqueue(url: str, events: list[dict]) -> None:
    with open_store(url, create=True) as store:
        assert store.enqueue_events(events, POLICY) == [True] * len(events)


async def test_two_dispatchers_share_a_queue_and_every_order_is_applied_once(
        postgres_url: str, tmp_path: Path):
    orders = [{"id": f"order-{n}", "body": {"n": n, "sku": "tea"}} for n in range(200)]
    enqueue(postgres_url, orders)
    runner = web.AppRunner(make_app(str(tmp_path / "inbox.db")))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/events"
        async with Dispatcher(postgres_url, "host-a", url=url, concurrency=16, threads=3,
                              policy=POLICY) as a, \
                Dispatcher(postgres_url, "host-b", url=url, concurrency=16, threads=3,
                           policy=POLICY) as b:
            first, second = await asyncio.wait_for(asyncio.gather(
                a.run(until_idle=True), b.run(until_idle=True)), 60)
    finally:
        await runner.cleanup()
    assert first.ok + second.ok == 200 and first.claimed + second.claimed == 200
    assert first.ok > 0 and second.ok > 0  # both took part
    assert (first.stale, second.stale, first.errors, second.errors) == (0, 0, 0, 0)
    with open_store(postgres_url, read_only=True) as store:
        assert store.counts() == {"pending": 0, "leased": 0, "done": 200, "dead": 0}
        done = store.jobs_with_status("done")
    assert {row["done_by"] for row in done} == {"host-a", "host-b"}


async def test_an_idle_dispatcher_wakes_on_the_servers_notify(postgres_url: str):
    """A poll of 30 s, and the job is sent within seconds of its enqueue: the
    NOTIFY of the intake's transaction woke the dispatcher, not its poll."""
    with open_store(postgres_url, create=True):
        pass
    sent: asyncio.Future = asyncio.get_running_loop().create_future()

    async def send(event: dict, token: int) -> bool:
        if not sent.done():
            sent.set_result(time.monotonic())
        return True

    async with Dispatcher(postgres_url, "idle", send=send, poll_interval=30) as d:
        running = asyncio.create_task(d.run())
        await asyncio.sleep(0.5)  # the dispatcher is idle, waiting out its poll
        enqueued = time.monotonic()
        await d.queue.enqueue_events([{"id": "wake", "qty": 1}], None, POLICY)
        woke = await asyncio.wait_for(sent, 20)
        d.stop()
        await running
    assert woke - enqueued < 10  # far less than the 30 s poll


# A dispatcher process whose host clock is skewed: time.time() is off by SKEW_S.
_SKEWED_HOST = textwrap.dedent("""
    import asyncio, json, os, sys, time
    skew = float(sys.argv[3])
    real = time.time
    time.time = lambda: real() + skew  # this host's wall clock is wrong by minutes
    from asyncworker import Dispatcher
    from lease.policy import RetryPolicy
    log = open(sys.argv[4], "a")

    async def send(event, token):
        log.write(json.dumps([event["id"], token, sys.argv[2]]) + "\\n")
        log.flush()
        await asyncio.sleep(0.2)
        return True

    async def main():
        policy = RetryPolicy(max_attempts=5, ttl_ms=600_000, lease_ms=5_000)
        async with Dispatcher(sys.argv[1], sys.argv[2], send=send, policy=policy,
                              concurrency=4, threads=2) as d:
            stats = await d.run(until_idle=True)
        print(json.dumps(stats.as_dict()))

    asyncio.run(main())
""")


def test_hosts_whose_clocks_differ_by_minutes_share_jobs_on_the_server_clock(
        postgres_url: str, tmp_path: Path):
    """Two dispatcher processes, one host clock 5 minutes fast and one 5 minutes
    slow: both take part, and every job is sent once and done once. Judged by
    the hosts' clocks, the slow one would see no job due for 5 minutes and the
    fast one would take every lease of the slow one as long expired."""
    enqueue(postgres_url, [{"id": f"job-{n}", "qty": 1} for n in range(120)])
    log = tmp_path / "sends.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hosts = [subprocess.Popen(
        [sys.executable, "-c", _SKEWED_HOST, postgres_url, owner, skew, str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for owner, skew in (("fast", "300"), ("slow", "-300"))]
    try:
        outputs = [host.communicate(timeout=90) for host in hosts]
    finally:
        for host in hosts:
            host.kill()
            host.wait()
    for host, (_, err) in zip(hosts, outputs, strict=True):
        assert host.returncode == 0, err
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    sends = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(job for job, _, _ in sends) == sorted(f"job-{n}" for n in range(120))
    assert sum(s["ok"] for s in stats) == 120 and sum(s["stale"] for s in stats) == 0
    assert all(s["ok"] > 0 for s in stats), stats  # 120 sends of 0.2 s, 4 at a time: both
    with open_store(postgres_url, read_only=True) as store:
        assert store.counts()["done"] == 120


def test_a_clock_of_its_own_minutes_fast_would_steal_a_live_lease(postgres_url: str):
    """Why the default is the server's clock: a store judging by a host clock 5
    minutes fast takes a lease that is live on the server as expired."""
    enqueue(postgres_url, [{"id": "a", "qty": 1}])
    with open_store(postgres_url) as honest:
        assert len(honest.claim_jobs("host-a", 60_000, 1).leased) == 1
        with open_store(postgres_url) as also_honest:
            assert also_honest.claim_jobs("host-c", 60_000, 1).leased == []
        fast = open_store(postgres_url,
                          clock=lambda: honest.now_ms() + 300_000)
        try:
            stolen = fast.claim_jobs("host-b", 60_000, 1).leased
        finally:
            fast.close()
    assert [job.ticket["id"] for job in stolen] == ["a"]
