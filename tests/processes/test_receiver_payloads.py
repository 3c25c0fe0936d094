"""Payload events at the receiver: any JSON object, named by its webhook-id,
deduplicated by that id and the sha256 of its canonical body."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from asyncworker.receiving.inbox import read_inbox
from lease.policy import MAX_BODY_BYTES, canonical_body
from tests.support.receiving import Running, snapshot
from tests.support.servers import ReceiverProcess

ORDER = {"order": 123, "lines": [{"sku": "tea", "qty": 2}, {"sku": "cup", "qty": 1}],
         "note": "ünïcode ok", "paid": True, "total": 12.5}


def digest(body: dict) -> str:
    return canonical_body(body)[1]


def raw_rows(inbox: Path) -> list[tuple]:
    con = sqlite3.connect(inbox)
    try:
        return con.execute("SELECT id, qty, digest, seen, max_token FROM inbox"
                           " ORDER BY id").fetchall()
    finally:
        con.close()


async def post(rx: Running, body: object, webhook_id: str | None = None, *,
               token: int | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if webhook_id is not None:
        headers["webhook-id"] = webhook_id
    if token is not None:
        headers["X-Lease-Token"] = str(token)
    async with rx.session.post(rx.url, data=data, headers=headers) as answer:
        return answer.status, await answer.json(content_type=None)


async def test_a_payload_is_applied_then_a_duplicate_with_the_echo_id_ack(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert await post(rx, ORDER, "order:123") == (
            200, {"id": "order:123", "status": "applied"})
        assert await post(rx, ORDER, "order:123") == (
            200, {"id": "order:123", "status": "duplicate"})
        stats = await rx.stats()
    assert (stats["applied"], stats["duplicates"], stats["stock"], stats["inbox_rows"]) == (
        1, 1, 0, 1)
    assert raw_rows(tmp_path / "inbox.db") == [("order:123", 0, digest(ORDER), 2, None)]


async def test_the_same_body_with_its_keys_reordered_is_a_duplicate(tmp_path: Path):
    """Compared by the canonical digest, not by the bytes: key order and
    spacing do not make another event."""
    reordered = b'{ "total": 12.5, "paid": true, "note": "\\u00fcn\\u00efcode ok",\n' \
                b'  "lines": [{"qty": 2, "sku": "tea"}, {"qty": 1, "sku": "cup"}],' \
                b' "order": 123 }'
    assert json.loads(reordered) == ORDER
    async with Running(tmp_path / "inbox.db") as rx:
        assert (await post(rx, ORDER, "tenant/7"))[1]["status"] == "applied"
        assert await post(rx, reordered, "tenant/7") == (
            200, {"id": "tenant/7", "status": "duplicate"})
    assert raw_rows(tmp_path / "inbox.db") == [("tenant/7", 0, digest(ORDER), 2, None)]


async def test_another_body_for_the_same_id_is_409_and_nothing_is_applied(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    other = {**ORDER, "total": 13}
    list_order = {**ORDER, "lines": list(reversed(ORDER["lines"]))}  # a list's order counts
    async with Running(inbox) as rx:
        assert (await post(rx, ORDER, "evt_1"))[0] == 200
        assert (await post(rx, {"id": "lab-1", "qty": 4}))[0] == 200
        rows = raw_rows(inbox)
        for body, event_id, known in ((other, "evt_1", "the body of sha256"),
                                      (list_order, "evt_1", "the body of sha256"),
                                      ({"id": "evt_1", "qty": 4}, "evt_1", "the body of"),
                                      ({"x": 1}, "lab-1", "qty 4")):
            status, answer = await post(rx, body, event_id)
            assert status == 409, (body, answer)
            assert answer["error"].startswith(f"{event_id!r} was applied with {known}")
        stats = await rx.stats()
        assert raw_rows(inbox) == rows  # no row changed: not even its seen count
    assert (stats["conflicts"], stats["applied"], stats["duplicates"], stats["stock"]) == (
        4, 2, 0, 4)


async def test_a_lab_event_is_unchanged_and_a_matching_webhook_id_is_welcome(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert await post(rx, {"id": "snack-1", "qty": 5}, "snack-1") == (
            200, {"id": "snack-1", "qty": 5, "status": "applied"})
        assert await post(rx, {"id": "snack-1", "qty": 5}) == (
            200, {"id": "snack-1", "qty": 5, "status": "duplicate"})
        assert (await rx.stats())["stock"] == 5
    assert raw_rows(tmp_path / "inbox.db") == [("snack-1", 5, None, 2, None)]


BAD_IDS = [
    ("no webhook-id", {"order": 1}, None, "payload event, sent with a webhook-id"),
    ("an empty webhook-id", {"order": 1}, "", "webhook-id must be 1-255 visible ASCII"),
    ("a space in it", {"order": 1}, "a b", "webhook-id must be 1-255"),
    ("256 characters", {"order": 1}, "w" * 256, "webhook-id must be 1-255"),
    ("a tab in it", {"order": 1}, "a\tb", "webhook-id must be 1-255"),
    ("a lab event named otherwise", {"id": "a", "qty": 1}, "b",
     "webhook-id must be the event id 'a'"),
    ("a lab event, bad qty, named", {"id": "a", "qty": 0}, "a", "event qty"),
    ("a list", [1, 2], "list-1", "event body must be a JSON object, got list"),
    ("a string", "text", "str-1", "event body must be a JSON object, got str"),
    ("over 64 KiB once canonical", b'{"a": [' + b",".join([b"1E5"] * 12_000) + b"]}", "f",
     "event body is 108007 bytes, more than 65536"),
    ("a list, unnamed", [1, 2], None, "event must be a dict (a JSON object), got list"),
]


@pytest.mark.parametrize("case", BAD_IDS, ids=[case[0] for case in BAD_IDS])
async def test_a_missing_or_bad_webhook_id_is_400_and_changes_nothing(tmp_path: Path, case):
    _, body, webhook_id, message = case
    inbox = tmp_path / "inbox.db"
    async with Running(inbox) as rx:
        assert (await post(rx, {"id": "seed", "qty": 1}))[0] == 200
        before = snapshot(inbox)
        status, answer = await post(rx, body, webhook_id)
        assert (status, message in answer["error"]) == (400, True), answer
        assert snapshot(inbox) == before
        assert (await rx.stats())["process_rejected"] == 1


async def test_two_webhook_ids_are_400(tmp_path: Path):
    headers = [("Content-Type", "application/json"), ("webhook-id", "a"), ("webhook-id", "a")]
    async with Running(tmp_path / "inbox.db") as rx:
        response = await rx.session.post(rx.url, data=b'{"order": 1}', headers=headers)
        status, answer = response.status, await response.json()
        response.release()
    assert (status, answer) == (400, {"error": "webhook-id must be sent once, got 2"})
    assert raw_rows(tmp_path / "inbox.db") == []


def body_of_exactly(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes, in canonical form: {"pad":"xx...x"}."""
    data = b'{"pad":"' + b"x" * (size - 10) + b'"}'
    assert len(data) == size and json.dumps(json.loads(data), separators=(",", ":")) == \
        data.decode()
    return data


async def test_a_body_of_64_kib_is_taken_and_one_byte_more_is_413(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox) as rx:
        exact = body_of_exactly(MAX_BODY_BYTES)
        assert await post(rx, exact, "big-1") == (200, {"id": "big-1", "status": "applied"})
        before = snapshot(inbox)
        status, answer = await post(rx, body_of_exactly(MAX_BODY_BYTES + 1), "big-2")
        assert (status, answer) == (413, {"error": "body is larger than 65536 bytes"})
        assert snapshot(inbox) == before
        stats = await rx.stats()
    assert stats["process_too_large"] == 1
    assert read_inbox(inbox).applied == {"big-1": hashlib.sha256(exact).hexdigest()}


async def test_a_stale_sender_of_a_payload_is_a_duplicate_as_for_a_lab_event(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert (await post(rx, ORDER, "fenced", token=5))[1]["status"] == "applied"
        assert await post(rx, ORDER, "fenced", token=3) == (
            200, {"id": "fenced", "status": "duplicate"})
        status, answer = await post(rx, {"other": 1}, "fenced", token=4)
        assert status == 409 and "was applied with the body of sha256" in answer["error"]
        assert (await post(rx, ORDER, "fenced", token=7))[1]["status"] == "duplicate"
        assert (await post(rx, ORDER, "fenced"))[1]["status"] == "duplicate"  # no token
        stats = await rx.stats()
    assert (stats["stale_senders"], stats["conflicts"], stats["duplicates"]) == (1, 1, 2)
    assert raw_rows(tmp_path / "inbox.db") == [("fenced", 0, digest(ORDER), 3, 7)]


async def test_stats_count_payloads_with_the_others_and_show_no_payload_data(tmp_path: Path):
    secret = {"card": "4111-SECRET-1111", "customer": "Ada"}
    async with Running(tmp_path / "inbox.db") as rx:
        await post(rx, secret, "pay-1")
        await post(rx, secret, "pay-1")
        await post(rx, {"id": "lab", "qty": 3})
        await post(rx, {"card": "other"}, "pay-1")
        stats = await rx.stats()
        async with rx.session.get(rx.base + "/metrics") as answer:
            metrics = await answer.text()
    assert {k: stats[k] for k in ("applied", "duplicates", "conflicts", "stock",
                                  "inbox_rows")} == {
        "applied": 2, "duplicates": 1, "conflicts": 1, "stock": 3, "inbox_rows": 2}
    assert {"receiver_applied_total 2.0", "receiver_duplicates_total 1.0"} <= set(
        metrics.splitlines())
    for shown in (json.dumps(stats), metrics):
        assert "SECRET" not in shown and "Ada" not in shown and "pay-1" not in shown


def test_a_payload_is_applied_once_under_50_concurrent_posts(tmp_path: Path):
    """As a real process: 50 posts of one payload at once, in any key order,
    apply it exactly once; the other 49 are duplicates."""
    bodies = [json.dumps(ORDER, sort_keys=n % 2 == 0, indent=n % 3 or None).encode()
              for n in range(50)]

    async def fire(url: str) -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            async def one(body: bytes) -> tuple[int, dict]:
                async with session.post(url, data=body, headers={
                        "Content-Type": "application/json", "webhook-id": "same"}) as answer:
                    return answer.status, await answer.json()
            return await asyncio.gather(*(one(body) for body in bodies))

    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        answers = asyncio.run(fire(rx.url))
        stats = rx.stats()
    assert sorted(status for status, _ in answers) == [200] * 50
    assert sorted(answer["status"] for _, answer in answers) == ["applied"] + ["duplicate"] * 49
    assert {answer["id"] for _, answer in answers} == {"same"}
    assert (stats["applied"], stats["duplicates"], stats["stock"],
            stats["process_requests"]) == (1, 49, 0, 50)
    assert raw_rows(tmp_path / "inbox.db") == [("same", 0, digest(ORDER), 50, None)]


def test_both_senders_deliver_a_payload_and_read_its_ack(tmp_path: Path):
    """The project's senders against the receiver as a process: the payload
    goes out as its canonical text with its webhook-id, the echo-id ACK is
    accepted, a resend is a duplicate (True again), another body is refused."""
    from asyncworker import send_http as async_send
    from lease import http as sync_http
    from lease.worker import Permanent

    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        assert sync_http.send_http(rx.url, {"id": "order:9", "body": ORDER}, timeout=5,
                                   token=1) is True
        assert asyncio.run(async_send(rx.url, {"id": "order:9", "body": canonical_body(ORDER)[0]},
                                      timeout=5, token=2)) is True
        with pytest.raises(Permanent, match="409") as refused:
            sync_http.send_http(rx.url, {"id": "order:9", "body": {"other": 1}}, timeout=5)
        stats = rx.stats()
    assert getattr(refused.value, "http_status", None) == 409
    assert (stats["applied"], stats["duplicates"], stats["conflicts"]) == (1, 1, 1)
    assert raw_rows(tmp_path / "inbox.db") == [("order:9", 0, digest(ORDER), 2, 2)]
