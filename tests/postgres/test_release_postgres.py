"""Two dispatchers on one PostgreSQL queue, their endpoint going down: what
they had claimed and not sent goes back to the store (``Store.release_jobs``
under the server's locks, beside the finishes that open the circuit), none
of it lost or left leased, no attempt spent on it."""

from __future__ import annotations

import asyncio

from aiohttp import web

from asyncworker import Dispatcher
from lease.breaker import BREAKER
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.stores import open_store
from tests.support.dispatching import until

POLICY = RetryPolicy(max_attempts=50, ttl_ms=3_600_000, lease_ms=60_000)
CONCURRENCY = 8


async def test_two_dispatchers_give_back_what_they_had_not_sent_when_it_goes_down(
        postgres_url: str):
    answered: dict[str, int] = {"ok": 0, "refused": 0}

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if answered["ok"] >= 300:  # down from its 301st request on
            answered["refused"] += 1
            return web.Response(status=503, text="down")
        answered["ok"] += 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/hook", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        with open_store(postgres_url, create=True) as store:
            store.add_endpoint(Endpoint("down", url, ack="status"))
            store.enqueue_events([{"id": f"m-{n}", "qty": 1} for n in range(2000)], POLICY)
        dispatchers = [Dispatcher(postgres_url, f"host-{k}", endpoints="*", policy=POLICY,
                                  concurrency=CONCURRENCY, batch_size=16, threads=2,
                                  refresh_s=0.05) for k in "ab"]
        async with dispatchers[0] as a, dispatchers[1] as b:
            tasks = [asyncio.create_task(d.run()) for d in (a, b)]
            try:
                await until(lambda: a.circuits()["endpoints"]["down"]["state"] == "open",
                            timeout=60)
                # every claimed delivery answered, or given back (none left leased)
                await until(lambda: a.stats.in_flight == b.stats.in_flight == 0
                            and answered["refused"] > 0
                            and sum(d.stats.claimed for d in (a, b)) == answered["ok"]
                            + answered["refused"] + sum(d.stats.released for d in (a, b)),
                            timeout=60)
                released = a.stats.released + b.stats.released
                with open_store(postgres_url, read_only=True) as store:
                    [row] = store.endpoints()
                    pending = store.jobs_with_status("pending")
                    assert store.counts()["dead"] == 0
            finally:
                for d in (a, b):
                    d.stop()
                await asyncio.gather(*tasks)
    finally:
        await runner.cleanup()
    assert row["circuit"]["state"] in ("open", "half-open")
    # on the wire while down: what both had in flight at their first failure, what
    # one sent again after a read of the circuits that came before the store had the
    # failures that open it (up to the threshold), and a probe
    assert answered["refused"] <= 2 * CONCURRENCY + BREAKER.open_after + 1, answered
    assert released > 0 and row["circuit"]["attempts_saved"] >= released
    # nothing lost: 2,000 delivered or waiting, the released ones with no attempt spent
    assert answered["ok"] + len(pending) == 2000
    assert sum(1 for job in pending if job["attempts"] == 0) >= released
