"""Delivery over TLS with a throwaway CA (trustme), both senders and the Dispatcher.

A verified delivery names its host by name (localhost) and by address
(127.0.0.2); a certificate that is not to be trusted (another CA, expired,
for another name) delivers nothing: the server's handler never runs, the
error says which, and the Dispatcher's attempt keeps that text. The one
timeout bounds the TLS handshake and every read after it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from asyncworker import Dispatcher
from lease import http as sync_http
from lease import signing
from lease.http import Destination
from lease.worker import Retryable
from tests.support.dispatching import attempts, enqueue, until, wall_ms
from tests.support.tls_servers import Pki, RawServer, not_tls, receiver, silent, tls_trickle

EVENT = {"id": "order:7", "body": '{"lines":[{"qty":2,"sku":"tea"}],"order":7}'}
KEY = bytes(range(32))
SECRET = signing.new_secret(random=KEY)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.2"])
async def test_verified_delivery_by_name_and_by_address(send, pki: Pki, host: str):
    bind = "127.0.0.1" if host == "localhost" else host
    async with receiver(pki.good, host=bind, path="/hooks/orders") as rx:
        url = f"https://{host}:{rx.port}/hooks/orders?tenant=7"
        destination = Destination(url, ca_file=pki.ca_file)
        assert await send(destination, EVENT, timeout=10, token=3) is True
        [seen] = rx.seen
        assert seen.path == "/hooks/orders?tenant=7"
        assert seen.body == EVENT["body"].encode()  # the canonical bytes, as enqueued
        assert seen.headers["webhook-id"] == "order:7"
        assert seen.headers["x-lease-token"] == "3"
        assert "webhook-signature" not in seen.headers  # no secrets, no signature


async def test_the_system_store_does_not_know_a_private_ca(send, pki: Pki):
    async with receiver(pki.good) as rx:
        with pytest.raises(Retryable, match=r"^TLS: certificate verify failed: "):
            await send(Destination(rx.url), EVENT, timeout=10)
        assert rx.seen == []


# (certificate the server shows, CA file the sender trusts, what the error says)
UNTRUSTED = [
    ("good", "wrong_ca_file", "unable to get local issuer certificate"),
    ("expired", "ca_file", "certificate has expired"),
    ("other_name", "ca_file", "IP address mismatch"),
]


@pytest.mark.parametrize(("cert", "ca", "why"), UNTRUSTED, ids=["wrong CA", "expired",
                                                               "hostname mismatch"])
async def test_an_untrusted_certificate_delivers_nothing(send, pki: Pki, cert, ca, why):
    async with receiver(getattr(pki, cert)) as rx:
        destination = Destination(rx.url, ca_file=getattr(pki, ca))
        with pytest.raises(Retryable) as caught:
            await send(destination, EVENT, timeout=10)
        assert str(caught.value).startswith("TLS: certificate verify failed: ")
        assert why in str(caught.value) and f"127.0.0.2:{rx.port}" in str(caught.value)
        assert getattr(caught.value, "http_status", None) is None
        assert rx.seen == []  # the handler never ran: nothing was sent


async def test_a_hostname_mismatch_by_name(send, pki: Pki):
    async with receiver(pki.other_name, host="127.0.0.1") as rx:
        destination = Destination(f"https://localhost:{rx.port}/hooks/orders",
                                  ca_file=pki.ca_file)
        with pytest.raises(Retryable, match="certificate verify failed: Hostname mismatch"):
            await send(destination, EVENT, timeout=10)
        assert rx.seen == []


async def test_tls_to_a_plain_http_server_is_a_handshake_failure(send, pki: Pki):
    with RawServer(not_tls) as server:
        destination = Destination(f"https://127.0.0.2:{server.port}/x", ca_file=pki.ca_file)
        with pytest.raises(Retryable, match=r"^TLS: handshake failed with 127\.0\.0\.2:"):
            await send(destination, EVENT, timeout=10)


async def test_the_timeout_bounds_a_handshake_that_never_comes(send, pki: Pki):
    with RawServer(silent) as server:
        destination = Destination(f"https://127.0.0.2:{server.port}/x", ca_file=pki.ca_file)
        started = time.monotonic()
        with pytest.raises(Retryable, match="timed out after 0.5s"):
            await send(destination, EVENT, timeout=0.5)
        assert time.monotonic() - started < 3
        assert server.accepted == 1


async def test_the_timeout_bounds_a_tls_answer_that_trickles(send, pki: Pki):
    with RawServer(tls_trickle(pki.good)) as server:
        destination = Destination(f"https://127.0.0.2:{server.port}/x", ca_file=pki.ca_file)
        started = time.monotonic()
        with pytest.raises(Retryable, match="timed out after 0.5s"):
            await send(destination, EVENT, timeout=0.5)
        # A byte every 0.1 s for 10 s: only a bound on the whole exchange ends it.
        assert time.monotonic() - started < 3


async def test_the_sync_sender_reads_tls_through_its_deadline_socket(pki: Pki):
    destination = Destination("https://127.0.0.2:1/x", ca_file=pki.ca_file)
    assert destination.ssl_context is not None
    assert destination.ssl_context.sslsocket_class is sync_http._DeadlineSSLSocket
    assert destination.ssl_context.verify_mode.name == "CERT_REQUIRED"
    assert destination.ssl_context.check_hostname is True


# ---------------------------------------------------------------- the Dispatcher


async def test_dispatcher_delivers_signed_over_tls_on_kept_alive_connections(
        queue_path: Path, pki: Pki):
    verified: list[object] = []

    async def verify_then_ack(seen):
        from aiohttp import web

        verified.append(Webhook(SECRET).verify(seen.body, seen.headers))  # raises if forged
        return web.json_response({"id": seen.headers["webhook-id"]})

    n = 12
    enqueue(queue_path, [{"id": f"order:{i}", "body": {"order": i}} for i in range(n)],
            now=wall_ms())
    async with receiver(pki.good, answer=verify_then_ack) as rx:
        destination = Destination(rx.url, ca_file=pki.ca_file, secrets=(KEY,))
        async with Dispatcher(queue_path, "d1", destination=destination, concurrency=2) as d:
            stats = await asyncio.wait_for(d.run(until_idle=True), 30)
        assert stats.ok == n and stats.retried == 0
        assert sorted(verified, key=str) == sorted(({"order": i} for i in range(n)), key=str)
        assert len(rx.seen) == n
        assert rx.connections <= 2  # one session, its connections reused, not one per job
    for i in range(n):
        [attempt] = attempts(queue_path, f"order:{i}")
        assert attempt["outcome"] == "ok" and attempt["error"] is None


@pytest.mark.parametrize(("cert", "ca", "why"), UNTRUSTED, ids=["wrong CA", "expired",
                                                               "hostname mismatch"])
async def test_dispatcher_records_an_untrusted_certificate_in_the_attempt(
        queue_path: Path, pki: Pki, cert, ca, why):
    enqueue(queue_path, [{"id": "order:1", "body": {"order": 1}}], now=wall_ms())
    async with receiver(getattr(pki, cert)) as rx:
        destination = Destination(rx.url, ca_file=getattr(pki, ca))
        async with Dispatcher(queue_path, "d1", destination=destination) as d:
            run = asyncio.create_task(d.run())
            await until(lambda: d.stats.retried == 1)
            d.stop()
            await run
        assert rx.seen == []
    [first] = attempts(queue_path, "order:1")
    assert first["outcome"] == "retry" and first["http_status"] is None
    assert first["error"].startswith("Retryable: TLS: certificate verify failed: ")
    assert why in first["error"]


async def test_a_payload_at_the_size_cap_goes_out_whole_over_tls(send, pki: Pki):
    """The sync sender writes over TLS in a loop of sends, each given the time left."""
    from lease.policy import MAX_BODY_BYTES, canonical_body

    body, _ = canonical_body({"pad": "x" * (MAX_BODY_BYTES - 20)})
    assert MAX_BODY_BYTES - 20 < len(body.encode()) <= MAX_BODY_BYTES
    async with receiver(pki.good) as rx:
        destination = Destination(rx.url, ca_file=pki.ca_file)
        assert await send(destination, {"id": "big:1", "body": body}, timeout=10) is True
        assert rx.seen[0].body == body.encode()


async def test_a_kept_alive_connection_serves_only_its_own_trust_store(pki: Pki):
    from asyncworker import WireClient, send_http

    async with receiver(pki.good) as rx, WireClient() as client:
        trusted = Destination(rx.url, ca_file=pki.ca_file)
        assert await send_http(trusted, EVENT, timeout=10, session=client) is True
        # The same host and port with the system's store: the idle connection,
        # verified under the private CA, must not carry it.
        with pytest.raises(Retryable, match=r"^TLS: certificate verify failed: "):
            await send_http(Destination(rx.url), EVENT, timeout=10, session=client)
        assert len(rx.seen) == 1
