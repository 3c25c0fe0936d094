"""Both senders deliver payload events, byte for byte, beside the lab's events.

A payload event is ``{"id", "body"}``: the body a JSON object, or its
canonical text as the product store hands it back (``Leased.event``). What
arrives is that canonical text's UTF-8 bytes; the lab's ``{"id", "qty"}``
arrives with the very bytes it always had. Every request names its job in a
``webhook-id`` header, and an error decided by an HTTP answer carries that
answer's status as evidence. Each test runs against a real recording server
on 127.0.0.1 and both senders.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncworker import new_session
from asyncworker import send_http as async_send
from lease import http as sync_http
from lease.policy import MAX_BODY_BYTES, canonical_body
from lease.sqlite import claim_jobs, enqueue_events, open_store
from lease.worker import BadAck, Permanent, Retryable
from tests.support.queues import T0
from tests.support.servers import (
    HostileServer,
    Request,
    ack_for,
    answer,
    close_unanswered,
    free_port,
    garbage,
)

LAB_EVENT = {"id": "snack-7", "qty": 7}
LAB_BYTES = b'{"id": "snack-7", "qty": 7}'  # what the lab's sender has always sent
BODY = {"order": 123, "items": [{"sku": "A-1", "n": 2}], "paid": True, "note": None}
NON_ASCII = {"name": "Zoë", "greeting": "こんにちは", "drink": "☕", "flag": "🇫🇷",
             "quote": "\"\\/\u2028", "zero": "\u0000"}


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


def ack_webhook_id(request: Request, sock) -> None:
    """200 with an ACK naming the request's webhook-id: a payload need not hold its id."""
    ack = json.dumps({"id": request.headers["webhook-id"]}).encode()
    answer(200, ack, {"Content-Type": "application/json"})(request, sock)


async def delivered(send, event: dict, **kwargs) -> tuple[bytes, dict]:
    """(body, headers) of the one request ``event`` made to an ACKing server."""
    with HostileServer(ack_webhook_id) as server:
        assert await send(server.url, event, timeout=5, **kwargs) is True
    assert len(server.requests) == 1
    request = server.requests[0]
    assert request.line == "POST /events HTTP/1.1"
    assert int(request.headers["content-length"]) == len(request.body)
    return request.body, request.headers


@pytest.mark.parametrize("body", [BODY, NON_ASCII, {}], ids=["plain", "non-ascii", "empty"])
@pytest.mark.parametrize("given", ["object", "canonical text"])
async def test_a_payload_arrives_byte_for_byte(send, body, given):
    text, _digest = canonical_body(body)
    event = {"id": "order:123", "body": body if given == "object" else text}
    sent, headers = await delivered(send, event)
    assert sent == text.encode("utf-8")
    assert json.loads(sent) == body
    assert headers["content-type"] == "application/json"
    assert headers["webhook-id"] == "order:123"


async def test_non_ascii_text_travels_as_utf8_not_escaped(send):
    sent, _ = await delivered(send, {"id": "tenant/7", "body": NON_ASCII})
    for value in ("Zoë", "こんにちは", "☕", "🇫🇷", "\u2028"):
        assert value.encode("utf-8") in sent  # the characters themselves, not \u escapes
    assert json.loads(sent.decode("utf-8")) == NON_ASCII


async def test_a_body_at_the_size_cap_is_delivered(send):
    frame = len(canonical_body({"pad": ""})[0])
    body = {"pad": "é" * ((MAX_BODY_BYTES - frame) // 2)}  # two bytes each in UTF-8
    text, _ = canonical_body(body)
    assert len(text.encode()) == MAX_BODY_BYTES
    for event in ({"id": "big", "body": body}, {"id": "big", "body": text}):
        sent, _ = await delivered(send, event)
        assert sent == text.encode()


async def test_a_stored_payload_is_delivered_as_the_store_keeps_it(send, tmp_path):
    """The product queue's Leased.event, as a dispatcher would send it."""
    events = [{"id": "9b2f6c1e-0d7a-4b8e-a1c3-5f4e2d1c0b9a", "body": NON_ASCII},
              {"id": "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", "body": {"b": 1, "a": [2, 1]}}]
    con = open_store(tmp_path / "queue.db")
    try:
        assert enqueue_events(con, events, T0) == [True, True]
        leased, _moved = claim_jobs(con, "sender", T0, 30_000, limit=2)
    finally:
        con.close()
    assert len(leased) == 2
    for job, event in zip(sorted(leased, key=lambda j: j.ticket["id"]),
                          sorted(events, key=lambda e: e["id"]), strict=True):
        assert type(job.event["body"]) is str
        assert job.digest == canonical_body(event["body"])[1]  # the intake's digest
        sent, headers = await delivered(send, job.event, token=job.ticket["token"])
        assert sent == canonical_body(event["body"])[0].encode()
        assert json.loads(sent) == event["body"]
        assert headers["webhook-id"] == event["id"]
        assert headers["x-lease-token"] == str(job.ticket["token"])
        # checked by its digest instead of made canonical again: the same request
        again, again_headers = await delivered(send, job.event, token=job.ticket["token"],
                                               digest=job.digest)
        assert again == sent
        assert {**again_headers, "host": None} == {**headers, "host": None}  # another port


STORED = '{"a":1}'
STORED_DIGEST = canonical_body({"a": 1})[1]
BAD_STORED = {  # (event, digest): a stored payload's text and the digest it was given
    "text changed after its intake": ({"id": "a", "body": '{"a":2}'}, STORED_DIGEST),
    "text made non-canonical": ({"id": "a", "body": '{"a": 1}'}, STORED_DIGEST),
    "digest not a str": ({"id": "a", "body": STORED}, STORED_DIGEST.encode()),
    "a lone surrogate": ({"id": "a", "body": '{"x":"\ud800"}'}, STORED_DIGEST),
    "text over the cap": ({"id": "a", "body": '{"p":"' + "x" * MAX_BODY_BYTES + '"}'},
                          STORED_DIGEST),
    "a bad id": ({"id": "a b", "body": STORED}, STORED_DIGEST),
}


@pytest.mark.parametrize(("event", "digest"), BAD_STORED.values(), ids=BAD_STORED.keys())
async def test_a_stored_payload_that_is_not_its_digests_text_is_refused_unsent(
        send, event, digest):
    with HostileServer(ack_for()) as server:
        with pytest.raises(ValueError) as caught:
            await send(server.url, event, timeout=5, digest=digest)
        assert server.requests == []
    message = str(caught.value)
    assert message and "\n" not in message and len(message) < 300


async def test_a_digest_checks_only_a_stored_text_not_an_object_or_a_lab_event(send):
    """An object is made canonical as always, a lab event keeps its bytes: the
    digest is for the text a store hands back."""
    sent, _ = await delivered(send, {"id": "a", "body": {"a": 1}}, digest="not it")
    assert sent == STORED.encode()
    sent, _ = await delivered(send, LAB_EVENT, digest="not it")
    assert sent == LAB_BYTES


async def test_the_lab_event_keeps_its_bytes_and_gains_webhook_id(send):
    sent, headers = await delivered(send, LAB_EVENT, token=12)
    assert sent == LAB_BYTES
    assert headers["webhook-id"] == "snack-7"
    assert headers["x-lease-token"] == "12"
    assert headers["content-type"] == "application/json"


async def test_both_senders_put_the_same_request_on_the_wire():
    """One builder (request_parts): the same body and headers from either sender."""
    seen = []
    for sender in ("sync", "async"):
        with HostileServer(ack_webhook_id) as server:
            for event in (LAB_EVENT, {"id": "order:1", "body": NON_ASCII}):
                if sender == "sync":
                    assert await asyncio.to_thread(
                        sync_http.send_http, server.url, event, timeout=5, token=3)
                else:
                    assert await async_send(server.url, event, timeout=5, token=3)
        seen.append([(r.body, {k: r.headers[k] for k in
                               ("content-type", "content-length", "webhook-id", "x-lease-token")})
                     for r in server.requests])
    assert seen[0] == seen[1]


async def test_the_ack_must_name_the_payload_id(send):
    with HostileServer(ack_for("order:124")) as server:
        with pytest.raises(BadAck, match="order:124"):
            await send(server.url, {"id": "order:123", "body": BODY}, timeout=5)
        assert len(server.requests) == 1


async def test_a_payload_event_is_not_mutated(send):
    body = {"z": 1, "a": {"y": [3, 2]}}
    event = {"id": "order:9", "body": body}
    await delivered(send, event)
    assert event == {"id": "order:9", "body": {"z": 1, "a": {"y": [3, 2]}}}
    assert list(body) == ["z", "a"]  # not even reordered


def nested(depth: int) -> dict:
    body: dict = {}
    for _ in range(depth):
        body = {"n": body}
    return body


BAD_EVENTS = {
    "id with a space": {"id": "order 1", "body": {}},
    "id with a newline": {"id": "order:1\n", "body": {}},
    "id not ascii": {"id": "ordré", "body": {}},
    "empty id": {"id": "", "body": {}},
    "id of 256 characters": {"id": "x" * 256, "body": {}},
    "id not a str": {"id": 7, "body": {}},
    "body a list": {"id": "a", "body": [1]},
    "body None": {"id": "a", "body": None},
    "body bytes": {"id": "a", "body": b"{}"},
    "body with a tuple": {"id": "a", "body": {"t": (1, 2)}},
    "body with an int key": {"id": "a", "body": {1: "x"}},
    "body with NaN": {"id": "a", "body": {"x": float("nan")}},
    "body with a lone surrogate": {"id": "a", "body": {"x": "\ud800"}},
    "body over the cap": {"id": "a", "body": {"pad": "x" * MAX_BODY_BYTES}},
    "body nested too deeply": {"id": "a", "body": nested(100_000)},
    "text not JSON": {"id": "a", "body": "{nope"},
    "text empty": {"id": "a", "body": ""},
    "text of a list": {"id": "a", "body": "[1]"},
    "text of a string": {"id": "a", "body": '"x"'},
    "text with spaces": {"id": "a", "body": '{"a": 1}'},
    "text with keys unsorted": {"id": "a", "body": '{"b":1,"a":2}'},
    "text with a duplicate key": {"id": "a", "body": '{"a":1,"a":2}'},
    "text with NaN": {"id": "a", "body": '{"a":NaN}'},
    "text with a lone surrogate": {"id": "a", "body": '{"x":"\ud800"}'},
    "text with an escaped lone surrogate": {"id": "a", "body": '{"x":"\\ud800"}'},
    "text ascii-escaped": {"id": "a", "body": '{"a":"\\u00e9"}'},
    "text with a trailing newline": {"id": "a", "body": '{"a":1}\n'},
    "text over the cap": {"id": "a", "body": '{"p":"' + "x" * MAX_BODY_BYTES + '"}'},
    "text nested too deeply": {"id": "a", "body": '{"n":' * 100_000 + "{}" + "}" * 100_000},
    "text with an int over the digit limit": {"id": "a", "body": '{"a":' + "9" * 5000 + "}"},
    "both qty and body": {"id": "a", "qty": 1, "body": {}},
    "id only": {"id": "a"},
    "lab id with a colon": {"id": "order:1", "qty": 1},  # the lab's rule for the lab's shape
    "lab qty 0": {"id": "a", "qty": 0},
    "not a dict": [("id", "a"), ("body", {})],
}


@pytest.mark.parametrize("event", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
async def test_a_bad_event_is_refused_before_any_connection(send, event):
    with HostileServer(ack_for()) as server:
        with pytest.raises(ValueError) as caught:
            await send(server.url, event, timeout=5)
        assert server.requests == []
    message = str(caught.value)
    assert message and "\n" not in message and len(message) < 300  # one line, readable


ANSWERED = [
    ("503", answer(503, b'{"id": "snack-7"}'), Retryable, 503),
    ("429", answer(429, b""), Retryable, 429),
    ("404", answer(404, b""), Permanent, 404),
    ("409", answer(409, b'{"error": "conflict"}'), Permanent, 409),
    ("302", answer(302, b"", {"Location": "/events"}), BadAck, 302),
    ("200, wrong id", ack_for("snack-8"), BadAck, 200),
    ("201, not json", answer(201, b"yes"), BadAck, 201),
]


@pytest.mark.parametrize("event", [LAB_EVENT, {"id": "snack-7", "body": BODY}],
                         ids=["lab", "payload"])
@pytest.mark.parametrize(("name", "behaviour", "expected", "status"), ANSWERED,
                         ids=[a[0] for a in ANSWERED])
async def test_an_answered_error_carries_its_status(send, event, name, behaviour, expected,
                                                    status):
    with HostileServer(behaviour) as server, pytest.raises(expected) as caught:
        await send(server.url, event, timeout=5)
    assert len(server.requests) == 1
    assert caught.value.http_status == status
    assert type(caught.value.http_status) is int


async def test_a_transport_error_carries_no_status(send):
    with pytest.raises(Retryable) as refused:
        await send(f"http://127.0.0.1:{free_port()}/events", LAB_EVENT, timeout=5)
    for behaviour, expected in ((close_unanswered, Retryable), (garbage, BadAck)):
        with HostileServer(behaviour) as server, pytest.raises(expected) as caught:
            await send(server.url, LAB_EVENT, timeout=5)
        assert getattr(caught.value, "http_status", None) is None
    assert getattr(refused.value, "http_status", None) is None


def test_ack_verdict_sets_the_status_it_decided_on():
    """The pure rule: the same evidence whichever sender read the answer."""
    for status, kind in ((500, Retryable), (422, Permanent), (101, BadAck), (307, BadAck)):
        with pytest.raises(kind) as caught:
            sync_http.ack_verdict(status, b"", "a")
        assert caught.value.http_status == status
    with pytest.raises(BadAck) as oversized:
        sync_http.ack_verdict(200, b" " * (sync_http.ACK_LIMIT + 1), "a")
    assert oversized.value.http_status == 200
    assert sync_http.ack_verdict(204, b'{"id": "a"}', "a") is True


async def via_aiohttp(url, event, **kwargs):
    async with new_session() as session:
        return await async_send(url, event, session=session, **kwargs)
