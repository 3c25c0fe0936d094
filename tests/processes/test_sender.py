"""The strict senders, sync and async, against real loopback servers.

Every row of the verdict table runs against both senders: one verdict
function decides for both, and this table proves they agree.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from asyncworker import new_session
from asyncworker import send_http as async_send
from lease import http as sync_http
from lease.worker import BadAck, Permanent, Retryable
from tests.support.servers import (
    HostileServer,
    ReceiverProcess,
    ack_for,
    answer,
    close_unanswered,
    free_port,
    garbage,
    hang,
    trickle,
)

EVENT = {"id": "snack-7", "qty": 7}


@pytest.fixture(params=["sync", "async", "aiohttp"])
def send(request):
    """send(url, event, timeout=..., token=...) awaitable, whichever sender is under test:
    the sync one, the async one on its own client, the async one on a caller's aiohttp
    session."""
    if request.param == "async":
        return async_send
    if request.param == "aiohttp":
        return via_aiohttp

    async def via_thread(url, event, **kwargs):
        return await asyncio.to_thread(sync_http.send_http, url, event, **kwargs)

    return via_thread


# (name, server behaviour, verdict, the http_status the error carries)
VERDICTS = [
    ("ack", ack_for(), True, None),
    ("ack with extra fields", ack_for(status="duplicate", qty=7), True, None),
    ("201 ack", lambda r, s: answer(201, json.dumps({"id": "snack-7"}).encode())(r, s), True,
     None),
    ("wrong id", ack_for("snack-8"), BadAck, 200),
    ("id of another type", ack_for(7), BadAck, 200),
    ("missing id", answer(200, b'{"ok": true}'), BadAck, 200),
    ("not json", answer(200, b"yes"), BadAck, 200),
    ("empty body", answer(200, b""), BadAck, 200),
    ("json array", answer(200, b'["snack-7"]'), BadAck, 200),
    ("bytes not utf-8", answer(200, b'{"id": "\xff"}'), BadAck, 200),
    ("oversized ack", answer(200, json.dumps({"id": "snack-7", "pad": "x" * 5000}).encode()),
     BadAck, 200),
    ("redirect 302", answer(302, b"", {"Location": "/events"}), BadAck, 302),
    ("redirect 307", answer(307, b"", {"Location": "/events"}), BadAck, 307),
    ("400", answer(400, b'{"error": "bad"}'), Permanent, 400),
    ("404", answer(404, b""), Permanent, 404),
    ("409", answer(409, b'{"error": "conflict"}'), Permanent, 409),
    ("413", answer(413, b""), Permanent, 413),
    ("422", answer(422, b""), Permanent, 422),
    ("429", answer(429, b""), Retryable, 429),
    ("500", answer(500, b""), Retryable, 500),
    ("503", answer(503, b'{"id": "snack-7"}'), Retryable, 503),
    ("closed without an answer", close_unanswered, Retryable, None),
    ("not http", garbage, BadAck, None),
]


@pytest.mark.parametrize(("name", "behaviour", "expected", "status"), VERDICTS,
                         ids=[v[0] for v in VERDICTS])
async def test_verdict_table(send, name, behaviour, expected, status):
    with HostileServer(behaviour) as server:
        if expected is True:
            assert await send(server.url, EVENT, timeout=5) is True
        else:
            with pytest.raises(expected) as caught:
                await send(server.url, EVENT, timeout=5)
            # The evidence of the attempt: the status that decided, none without an answer.
            assert getattr(caught.value, "http_status", None) == status
        assert len(server.requests) == 1  # one request, no retry, no redirect followed
        request = server.requests[0]
        assert request.line.startswith("POST /events ")
        assert request.body == b'{"id": "snack-7", "qty": 7}'  # the lab's bytes, as ever
        assert request.headers["content-type"] == "application/json"
        assert request.headers["webhook-id"] == "snack-7"
        assert "x-lease-token" not in request.headers


async def test_token_travels_in_a_header(send):
    with HostileServer(ack_for()) as server:
        assert await send(server.url, EVENT, timeout=5, token=12) is True
        assert server.requests[0].headers["x-lease-token"] == "12"
        assert json.loads(server.requests[0].body) == EVENT


async def test_refused_connection_is_retryable(send):
    with pytest.raises(Retryable):
        await send(f"http://127.0.0.1:{free_port()}/events", EVENT, timeout=5)


@pytest.mark.parametrize("behaviour", [hang, trickle], ids=["hang", "trickle"])
async def test_timeout_bounds_the_whole_exchange(send, behaviour):
    with HostileServer(behaviour) as server:
        started = time.monotonic()
        with pytest.raises(Retryable, match="timed out"):
            await send(server.url, EVENT, timeout=0.5)
        # A trickling server sends a byte every 0.1 s for 10 s: per-read
        # timeouts would never fire; only a bound on the whole exchange does.
        assert time.monotonic() - started < 3


BAD_URLS = [
    "https://127.0.0.1:8080/events", "http://0.0.0.0:8080/events", "http://10.0.0.1/events",
    "http://example.com/events", "http://127.0.0.1:8080/eventsx", "http://127.0.0.1:8080/events/x",
    "http://127.0.0.1:8080/", "127.0.0.1:8080/events", "//127.0.0.1:8080/events",
    "http://127.0.0.1:8080/events?x=1", "http://user:pw@127.0.0.1:8080/events",
    "http://127.0.0.1:99999/events", "http://[::ffff:127.0.0.1]:80/events", "", None, b"x",
]


@pytest.mark.parametrize("url", BAD_URLS)
async def test_bad_url_refused_before_any_connection(send, url):
    with pytest.raises(ValueError):
        await send(url, EVENT, timeout=1)


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/events", "http://127.9.8.7:1/events",
                                 "http://localhost:1/events", "http://[::1]:1/events"])
def test_loopback_urls_accepted(url):
    assert sync_http.check_url(url)[1] == 1


@pytest.mark.parametrize("kwargs", [
    {"event": {"id": "a", "qty": 0}}, {"event": {"id": "a", "qty": True}},
    {"event": {"id": "a"}}, {"event": {"id": "a\n", "qty": 1}},
    {"timeout": 0}, {"timeout": -1}, {"timeout": float("inf")}, {"timeout": True},
    {"timeout": "1"}, {"token": 0}, {"token": True}, {"token": "3"}, {"token": 10**15 + 1},
])
async def test_bad_arguments_refused_before_any_connection(send, kwargs):
    with HostileServer(ack_for()) as server:
        call = {"event": EVENT, "timeout": 1, "token": None, **kwargs}
        with pytest.raises(ValueError):
            await send(server.url, call["event"], timeout=call["timeout"], token=call["token"])
        assert server.requests == []


async def test_event_is_not_mutated(send):
    event = {"id": "snack-7", "qty": 7}
    with HostileServer(ack_for()) as server:
        assert await send(server.url, event, timeout=5, token=3) is True
    assert event == {"id": "snack-7", "qty": 7}


async def test_proxy_settings_are_ignored(send, monkeypatch, tmp_path):
    with HostileServer(ack_for()) as proxy, ReceiverProcess(tmp_path / "inbox.db") as receiver:
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert await send(receiver.url, EVENT, timeout=5) is True
        assert proxy.requests == []
        assert receiver.stats()["applied"] == 1


async def test_async_sender_with_a_callers_session():
    with HostileServer(ack_for()) as server:
        async with new_session() as session:
            for n in range(3):
                assert await async_send(server.url, {"id": f"s-{n}", "qty": 1}, timeout=5,
                                        session=session) is True
        assert len(server.requests) == 3
        async with aiohttp.ClientSession(trust_env=True) as careless:
            with pytest.raises(ValueError, match="trust_env"):
                await async_send(server.url, EVENT, timeout=5, session=careless)
        assert len(server.requests) == 3


async def via_aiohttp(url, event, **kwargs):
    async with new_session() as session:
        return await async_send(url, event, session=session, **kwargs)
