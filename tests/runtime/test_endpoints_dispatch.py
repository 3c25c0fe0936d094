"""A dispatcher serving a queue's endpoints: one message fanned out to each
endpoint, each delivery sent to its own endpoint with its own secrets and
static headers; a slow endpoint held to its cap while a fast one is served;
an endpoint added while the dispatcher runs; metrics and logs per endpoint.

Real SQLite files in tmp_path, real aiohttp receivers on 127.0.0.1 port 0.
Every wait is for a condition, never for a length of time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from asyncworker import Dispatcher
from lease.endpoints import Endpoint
from lease.http import Destination
from lease.policy import RetryPolicy
from lease.signing import new_secret
from lease.sqlite import SQLiteStore
from tests.support.dispatching import until
from tests.support.tls_servers import Receiver, Seen, receiver

POLICY = RetryPolicy(max_attempts=5, ttl_ms=3_600_000)
LEASE_MS = 60_000  # no lease runs out while a test waits for its condition
SECRETS = {name: new_secret(random=bytes([n]) * 32)
           for n, name in enumerate(("alpha", "beta", "gamma", "slow", "fast"), start=1)}
HOST = "127.0.0.1"


def endpoint(name: str, rx: Receiver, **fields: object) -> Endpoint:
    """An endpoint of ``rx``, signed with its own secret, with a static header
    whose value names it (each receiver checks it got its own)."""
    fields.setdefault("headers", (("Authorization", f"Bearer token-of-{name}"),))
    return Endpoint(name, rx.url, secrets=(SECRETS[name],), **fields)  # type: ignore[arg-type]


def store_of(path: Path) -> SQLiteStore:
    return SQLiteStore(path, create=True)


def add(path: Path, *endpoints: Endpoint) -> None:
    with store_of(path) as store:
        for one in endpoints:
            store.add_endpoint(one)


def enqueue(path: Path, *events: dict) -> None:
    with store_of(path) as store:
        assert store.enqueue_events(list(events), POLICY) == [True] * len(events)


def counts(path: Path) -> dict[str, int]:
    with store_of(path) as store:
        return store.counts()


def statuses_by_endpoint(path: Path) -> dict[str, dict[str, int]]:
    with store_of(path) as store:
        return {row["name"]: {"done": row["done"], "in_flight": row["in_flight"],
                              "ready": row["ready"]}
                for row in store.endpoint_stats()}


def dispatcher(path: Path, **options: object) -> Dispatcher:
    options.setdefault("endpoints", "*")
    options.setdefault("policy", POLICY)
    return Dispatcher(path, "w1", lease_ms=LEASE_MS, **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(d: Dispatcher) -> AsyncIterator[asyncio.Task]:
    """The dispatcher running in a task for the block; stopped and awaited after it."""
    async with d:
        task = asyncio.create_task(d.run())
        try:
            yield task
        finally:
            d.stop()
            await task


def verified(seen: Seen, name: str) -> object:
    """The payload, verified against the endpoint's own secret (Standard
    Webhooks' own library, not ours); raises for any other secret."""
    return Webhook(SECRETS[name]).verify(seen.body, seen.headers)


# ----------------------------------------------------------------- fan-out


async def test_one_message_fans_out_to_three_endpoints_each_signed_with_its_own_secret(
        tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b, \
            receiver(None, host=HOST) as c:
        receivers = {"alpha": a, "beta": b, "gamma": c}
        add(path, *(endpoint(name, rx) for name, rx in receivers.items()))
        enqueue(path, {"id": "order-7", "qty": 7, "type": "order.paid"},
                {"id": "order-8", "body": {"id": "order-8", "total": 12}})
        stats = await _run_idle(dispatcher(path))
        assert stats.ok == 6 and stats.errors == stats.bad_acks == 0
        for name, rx in receivers.items():
            by_id = {seen.headers["webhook-id"]: seen for seen in rx.seen}
            assert sorted(by_id) == ["order-7", "order-8"], name  # the message's id
            for message_id, seen in by_id.items():
                assert json.loads(seen.body)["id"] == message_id  # the body's id, too
                assert seen.headers["authorization"] == f"Bearer token-of-{name}"
                assert verified(seen, name) == json.loads(seen.body)
                others = [other for other in receivers if other != name]
                for other in others:  # signed with its own secret, no other's
                    with pytest.raises(Exception, match="[Ss]ignature"):
                        verified(seen, other)
            # the token is the delivery's own lease's; the ticket's id is the delivery's
            assert all(seen.headers["x-lease-token"].isdigit() for seen in rx.seen)
    assert counts(path)["done"] == 6
    with store_of(path) as store:
        jobs = {row["id"]: row for row in store.list_jobs(limit=10)}
    assert sorted(jobs) == sorted(f"order-{n}@{name}" for n in (7, 8) for name in receivers)


async def _run_idle(d: Dispatcher):
    async with d:
        return await d.run(until_idle=True)


async def test_named_endpoints_are_served_and_no_other(tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a), endpoint("beta", b))
        enqueue(path, {"id": "m-1", "qty": 1})
        d = dispatcher(path, endpoints=["alpha"])
        async with running(d):
            await until(lambda: d.stats.ok == 1)
            assert d.endpoints == ["alpha"]
        assert [seen.headers["webhook-id"] for seen in a.seen] == ["m-1"]
        assert b.seen == []
    assert statuses_by_endpoint(path)["beta"]["ready"] == 1  # waits for a dispatcher of its own


# ----------------------------------------------------------------- caps


async def test_a_slow_endpoint_holds_at_most_its_cap_while_a_fast_one_is_served(
        tmp_path: Path):
    path = tmp_path / "queue.db"
    gate = asyncio.Event()
    open_now = 0
    most_open = 0

    async def slow_answer(seen: Seen):
        nonlocal open_now, most_open
        open_now += 1
        most_open = max(most_open, open_now)
        try:
            await gate.wait()
        finally:
            open_now -= 1
        return await _echo(seen)

    async with receiver(None, host=HOST, answer=slow_answer) as slow, \
            receiver(None, host=HOST) as fast:
        add(path, endpoint("slow", slow, max_in_flight=2, types=("report",)),
            endpoint("fast", fast, types=("ping",)))
        # the slow endpoint's messages first: a claim in intake order alone would
        # fill every slot with them
        enqueue(path, *({"id": f"r-{n}", "qty": 1, "type": "report"} for n in range(20)),
                *({"id": f"p-{n}", "qty": 1, "type": "ping"} for n in range(30)))
        d = dispatcher(path, concurrency=8)
        async with running(d):
            try:
                # every fast delivery completes while the slow endpoint holds its two
                await until(lambda: len(fast.seen) == 30 and d.stats.ok == 30)
                await until(lambda: open_now >= 2)
                assert most_open == 2
                assert statuses_by_endpoint(path)["slow"]["in_flight"] == 2
            finally:
                gate.set()  # failed or not: the sends held open end, and the run with them
            await until(lambda: d.stats.ok == 50)
        assert most_open == 2 and len(slow.seen) == 20
        assert d.stats.peak_sending <= 8


async def _echo(seen: Seen):
    from aiohttp import web

    return web.json_response({"id": seen.headers["webhook-id"]})


# ----------------------------------------------------------------- changes while running


async def test_an_endpoint_added_while_the_dispatcher_runs_gets_its_deliveries(
        tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a))
        # a refresh interval far past the test: the new endpoint is read when a
        # claim hands back a delivery of it
        d = dispatcher(path, refresh_s=3600)
        async with running(d):
            enqueue(path, {"id": "m-1", "qty": 1})
            await until(lambda: d.stats.ok == 1)
            assert d.endpoints == ["alpha"]
            add(path, endpoint("beta", b))
            enqueue(path, {"id": "m-2", "qty": 2})
            await until(lambda: d.stats.ok == 3)
            assert d.endpoints == ["alpha", "beta"]
        assert [seen.headers["webhook-id"] for seen in b.seen] == ["m-2"]
        [seen] = b.seen
        assert seen.headers["authorization"] == "Bearer token-of-beta"
        assert verified(seen, "beta") == {"id": "m-2", "qty": 2}
        assert d.stats.unknown_endpoint == 0


async def test_a_changed_header_and_secret_are_used_after_the_next_refresh(tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a:
        add(path, endpoint("alpha", a))
        d = dispatcher(path, refresh_s=0.05)
        async with running(d):
            enqueue(path, {"id": "m-1", "qty": 1})
            await until(lambda: d.stats.ok == 1)
            with store_of(path) as store:
                store.update_endpoint("alpha", {
                    "headers": (("Authorization", "Bearer rotated"),),
                    "secrets": (SECRETS["beta"],)})
            loads = d._routes.loads  # type: ignore[union-attr]
            await until(lambda: d._routes.loads > loads)  # type: ignore[union-attr]
            enqueue(path, {"id": "m-2", "qty": 1})
            await until(lambda: d.stats.ok == 2)
        first, second = a.seen
        assert first.headers["authorization"] == "Bearer token-of-alpha"
        assert second.headers["authorization"] == "Bearer rotated"
        assert verified(second, "beta") == {"id": "m-2", "qty": 1}


class HidingStore(SQLiteStore):
    """A store whose endpoint table hides one endpoint: its deliveries are
    claimed, but the dispatcher can never find where they go (as when it
    was removed between the claim and the read)."""

    hidden = "beta"
    reads = 0

    def endpoint_configs(self, names=None):
        HidingStore.reads += 1
        return [one for one in super().endpoint_configs(names) if one.name != self.hidden]


async def test_a_delivery_of_an_unknown_endpoint_is_left_leased_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a), endpoint("beta", b))
        enqueue(path, {"id": "m-1", "qty": 1}, {"id": "m-2", "qty": 1})
        HidingStore.reads = 0
        d = Dispatcher(lambda: HidingStore(path), "w1", endpoints="*", lease_ms=LEASE_MS,
                       policy=POLICY, refresh_s=3600)
        with caplog.at_level(logging.WARNING, logger="asyncworker.dispatcher"):
            async with running(d):
                await until(lambda: d.stats.ok == 2 and d.stats.unknown_endpoint == 2)
        assert HidingStore.reads >= 2  # read at the start, and again for the unknown one
        assert b.seen == [] and len(a.seen) == 2
        assert d.stats.in_flight == 0 and d.stats.errors == 0
        told = [r for r in caplog.records if "unknown endpoint" in r.getMessage()]
        assert len(told) == 1 and told[0].endpoint == "beta"  # type: ignore[attr-defined]
    assert statuses_by_endpoint(path)["beta"]["in_flight"] == 2  # their leases run out


# ----------------------------------------------------------------- metrics and logs


async def test_per_delivery_metrics_carry_the_endpoint_label_unless_dropped(tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a), endpoint("beta", b, types=("x",)))
        enqueue(path, {"id": "m-1", "qty": 1}, {"id": "m-2", "qty": 1, "type": "x"})
        labelled = dispatcher(path)
        await _run_idle(labelled)
        text = labelled.metrics.exposition()[0].decode()
        assert 'asyncworker_jobs_done_total{endpoint="alpha"} 2.0' in text
        assert 'asyncworker_jobs_done_total{endpoint="beta"} 1.0' in text
        assert 'asyncworker_jobs_claimed_total{endpoint="beta"} 1.0' in text
        assert 'asyncworker_send_duration_seconds_count{endpoint="alpha"} 2.0' in text
        # the claim's quarantine names no endpoint: its deaths have endpoint=""
        assert 'asyncworker_jobs_dead_total{endpoint="",reason="deadline"} 0.0' in text
        assert "asyncworker_deliveries_unknown_endpoint_total 0.0" in text
        assert "asyncworker_lease_extensions_total 0.0" in text  # not a per-delivery figure

        enqueue(path, {"id": "m-3", "qty": 1})
        plain = dispatcher(path, endpoint_label=False)
        await _run_idle(plain)
        text = plain.metrics.exposition()[0].decode()
        assert "asyncworker_jobs_done_total 1.0" in text
        assert "asyncworker_send_duration_seconds_count 1.0" in text
        assert 'endpoint="' not in text


async def test_log_records_name_the_endpoint_of_a_delivery(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "queue.db"
    answered = 0

    async def busy_once(seen: Seen):
        nonlocal answered
        answered += 1
        if answered == 1:
            from aiohttp import web

            return web.json_response({"error": "busy"}, status=503,
                                     headers={"Retry-After": "0"})
        return await _echo(seen)

    async with receiver(None, host=HOST, answer=busy_once) as a:
        add(path, endpoint("alpha", a))
        enqueue(path, {"id": "m-1", "qty": 1})
        quick = RetryPolicy(max_attempts=5, ttl_ms=3_600_000, backoff_base_ms=1,
                            backoff_cap_ms=1)
        d = dispatcher(path, policy=quick)
        with caplog.at_level(logging.INFO, logger="asyncworker.dispatcher"):
            async with running(d):
                await until(lambda: d.stats.ok == 1)
    [retry] = [r for r in caplog.records if r.getMessage() == "retry"]
    assert retry.endpoint == "alpha" and retry.id == "m-1@alpha"  # type: ignore[attr-defined]
    assert retry.http_status == 503  # type: ignore[attr-defined]
    assert "token-of-alpha" not in caplog.text  # a header's value is never logged


# ----------------------------------------------------------------- static headers


async def test_static_headers_go_with_every_request_of_each_sender(send):
    destination = Destination("http://127.0.0.1:1/x", headers=(("Authorization", "Bearer s3"),
                                                                ("X-Tenant", "t-7")))
    async with receiver(None, host=HOST) as rx:
        destination = Destination(rx.url, headers=destination.headers)
        assert await send(destination, {"id": "e-1", "qty": 1}, timeout=5) is True
        [seen] = rx.seen
    assert seen.headers["authorization"] == "Bearer s3" and seen.headers["x-tenant"] == "t-7"
    assert seen.headers["webhook-id"] == "e-1"


def test_static_header_values_are_secrets_never_shown():
    destination = Destination("https://orders.example/h",
                              headers={"Authorization": "Bearer top-secret"})
    assert "top-secret" not in repr(destination) and "headers=<1>" in repr(destination)
    assert "top-secret" not in repr(Endpoint("e", "https://orders.example/h",
                                             headers=(("Authorization", "Bearer top-secret"),)))
    with pytest.raises(ValueError) as refused:
        Destination("https://orders.example/h", headers=(("X-Key", "top-secret\r\nX: y"),))
    assert "top-secret" not in str(refused.value)


@pytest.mark.parametrize(("headers", "message"), [
    ((("webhook-id", "x"),), "the sender's own"),
    ((("Content-Type", "text/plain"),), "the sender's own"),
    ((("X-Lease-Token", "1"),), "the sender's own"),
    ((("X-A", "1"), ("x-a", "2")), "given twice"),
    ((("Bad Name", "1"),), "not an HTTP token"),
    ((("X-A", "\x00"),), "printable ASCII"),
    ((("X-A",),), r"\(name, value\) pair"),
    ("X-A: 1", r"\(name, value\) pairs"),
])
def test_static_headers_are_checked(headers, message):
    with pytest.raises(ValueError, match=message):
        Destination("https://orders.example/h", headers=headers)


def test_a_destination_without_headers_is_as_it_was():
    plain = Destination("https://orders.example/h")
    assert plain.headers == () and "headers" not in repr(plain)
    assert Endpoint("e", "https://orders.example/h").destination == plain


def test_destinations_share_a_trust_store_loaded_once_until_its_file_changes(tmp_path: Path):
    """Loading a trust store takes tens of milliseconds, and a dispatcher reads
    its endpoints (each with its destination) every few seconds."""
    import os

    import trustme

    assert Destination("https://a.example/x").ssl_context is \
        Destination("https://b.example/y").ssl_context
    ca_file = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    first = Destination("https://a.example/x", ca_file=ca_file).ssl_context
    assert Destination("https://b.example/y", ca_file=ca_file).ssl_context is first
    assert first is not Destination("https://a.example/x").ssl_context
    trustme.CA().cert_pem.write_to_path(str(ca_file))  # another CA, rewritten in place
    os.utime(ca_file, ns=(1, 1))  # whatever the clock's granularity: another time
    renewed = Destination("https://a.example/x", ca_file=ca_file).ssl_context
    assert renewed is not first


async def test_until_idle_ends_when_only_a_disabled_endpoint_or_another_dispatchers_work_is_left(
        tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a), endpoint("beta", b, enabled=False))
        enqueue(path, {"id": "m-1", "qty": 1})
        stats = await _run_idle(dispatcher(path))  # beta's delivery waits for an operator
        assert stats.ok == 1 and len(a.seen) == 1 and b.seen == []
        with store_of(path) as store:
            store.update_endpoint("beta", {"enabled": True})
        stats = await _run_idle(dispatcher(path, endpoints=["alpha"]))  # beta: not its own
        assert stats.claimed == 0
        stats = await _run_idle(dispatcher(path, endpoints=["beta"]))
        assert stats.ok == 1 and [seen.headers["webhook-id"] for seen in b.seen] == ["m-1"]


async def test_an_endpoint_that_cannot_be_built_stops_none_of_the_others(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """Its CA file gone: it is logged once, the others are served, and the
    endpoints are still read (one added later is served)."""
    import trustme

    path = tmp_path / "queue.db"
    ca_file = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a),
            Endpoint("gamma", "https://127.0.0.1:9/x", ca_file=str(ca_file), types=("none",)))
        ca_file.unlink()
        enqueue(path, {"id": "m-1", "qty": 1})
        d = dispatcher(path, refresh_s=0.05)
        with caplog.at_level(logging.WARNING, logger="asyncworker.dispatcher"):
            async with running(d):
                await until(lambda: d.stats.ok == 1)
                assert d.endpoints == ["alpha"]
                add(path, endpoint("beta", b))
                await until(lambda: d.endpoints == ["alpha", "beta"])
        told = [r for r in caplog.records if r.getMessage().startswith("endpoint cannot be")]
        assert [r.endpoint for r in told] == ["gamma"]  # type: ignore[attr-defined]


async def test_a_named_endpoint_removed_while_running_is_dropped(tmp_path: Path):
    path = tmp_path / "queue.db"
    async with receiver(None, host=HOST) as a, receiver(None, host=HOST) as b:
        add(path, endpoint("alpha", a), endpoint("beta", b))
        d = dispatcher(path, endpoints=["alpha", "beta"], refresh_s=0.05)
        async with running(d):
            assert d.endpoints == ["alpha", "beta"]
            with store_of(path) as store:
                store.remove_endpoint("beta")
            await until(lambda: d.endpoints == ["alpha"])
            enqueue(path, {"id": "m-1", "qty": 1})
            await until(lambda: d.stats.ok == 1)
        assert len(a.seen) == 1 and b.seen == []
