"""The receiver with secrets: every event signed (Standard Webhooks), verified
before anything else; a refusal is 401 by kind, counted, and touches nothing."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from asyncworker.receiving.server import make_app
from lease import signing
from tests.support.receiving import Running, snapshot

KEY = bytes(range(32))
NEW_KEY = bytes(range(100, 132))
NOW = 1_800_000_000
ORDER = {"order": 7, "note": "café"}
ORDER_BYTES = json.dumps(ORDER).encode()
KINDS = signing.SignatureError.KINDS


def clock() -> float:
    return NOW + 0.75  # verification takes whole seconds: NOW


def signed(body: bytes = ORDER_BYTES, msg_id: str = "order:7", at: int = NOW,
           keys: tuple = (KEY,)) -> dict:
    return {"Content-Type": "application/json",
            **signing.signature_headers(list(keys), msg_id, at, body)}


def receiver(inbox: Path, keys: tuple = (KEY,), **kwargs) -> Running:
    return Running(inbox, secrets=list(keys), clock=clock, **kwargs)


async def post(rx: Running, body: bytes, headers: dict) -> tuple[int, dict]:
    async with rx.session.post(rx.url, data=body, headers=headers) as answer:
        return answer.status, await answer.json(content_type=None)


def refused_counts(stats: dict) -> dict:
    return {kind: stats[f"process_refused_signature_{kind}"] for kind in KINDS}


async def test_a_signed_event_is_applied_and_a_replay_is_a_duplicate(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with receiver(inbox) as rx:
        headers = signed()
        assert await post(rx, ORDER_BYTES, headers) == (
            200, {"id": "order:7", "status": "applied"})
        # the same request, captured and sent again within the window: absorbed
        assert await post(rx, ORDER_BYTES, headers) == (
            200, {"id": "order:7", "status": "duplicate"})
        stats = await rx.stats()
    assert (stats["applied"], stats["duplicates"]) == (1, 1)
    assert refused_counts(stats) == dict.fromkeys(KINDS, 0)


def _without(name: str):
    return lambda h, b: ({k: v for k, v in h.items() if k != name}, b)


REFUSALS = {
    "no signature": (_without("webhook-signature"), "missing"),
    "no timestamp": (_without("webhook-timestamp"), "missing"),
    "no id": (_without("webhook-id"), "missing"),
    "forged": (lambda h, b: ({**h, "webhook-signature": "v1," + "A" * 43 + "="}, b), "mismatch"),
    "truncated": (lambda h, b: ({**h, "webhook-signature": h["webhook-signature"][:-6]}, b),
                  "mismatch"),
    "another secret": (lambda h, b: (signed(keys=(NEW_KEY,)), b), "mismatch"),
    "changed body": (lambda h, b: (h, b.replace(b"7", b"8")), "mismatch"),
    "signed for another id": (lambda h, b: ({**h, "webhook-id": "order:8"}, b), "mismatch"),
    "not base64,version": (lambda h, b: ({**h, "webhook-signature": "garbage"}, b), "malformed"),
    "timestamp not a number": (lambda h, b: ({**h, "webhook-timestamp": "soon"}, b),
                               "malformed"),
    "stale": (lambda h, b: (signed(at=NOW - 301), b), "stale"),
    "future-dated": (lambda h, b: (signed(at=NOW + 301), b), "future"),
}


@pytest.mark.parametrize("case", REFUSALS)
async def test_a_refused_signature_is_401_by_kind_and_touches_nothing(tmp_path: Path,
                                                                      case: str):
    change, kind = REFUSALS[case]
    inbox = tmp_path / "inbox.db"
    async with receiver(inbox) as rx:
        assert (await post(rx, b'{"first": 1}', signed(b'{"first": 1}', "first")))[0] == 200
        before = snapshot(inbox)
        headers, body = change(signed(), ORDER_BYTES)
        status, answer = await post(rx, body, headers)
        assert snapshot(inbox) == before  # not a byte of the inbox changed
        stats = await rx.stats()
        async with rx.session.get(rx.base + "/metrics") as metrics:
            text = await metrics.text()
    assert status == 401
    assert answer["error"].startswith(f"signature {kind}: ")
    assert refused_counts(stats) == {k: int(k == kind) for k in KINDS}
    assert (stats["applied"], stats["process_rejected"]) == (1, 0)
    assert f'receiver_process_refused_signature_total{{kind="{kind}"}} 1.0' in text.splitlines()


async def test_the_tolerance_is_the_window_either_side(tmp_path: Path):
    async with receiver(tmp_path / "inbox.db", tolerance_s=60) as rx:
        for n, at in enumerate((NOW - 60, NOW + 60)):
            body = b'{"n": %d}' % n
            assert (await post(rx, body, signed(body, f"edge-{n}", at)))[0] == 200
        for at in (NOW - 61, NOW + 61):
            assert (await post(rx, ORDER_BYTES, signed(at=at)))[0] == 401


async def test_verified_before_the_body_is_parsed(tmp_path: Path):
    """An unsigned request reaches nothing, not even the JSON parser: its bad
    body is not what it is told, and the rejected count stays 0."""
    async with receiver(tmp_path / "inbox.db") as rx:
        status, answer = await post(rx, b"{not json", {"Content-Type": "text/plain"})
        stats = await rx.stats()
        # signed, the same bad body is a 400 from the parser
        signed_status, _ = await post(rx, b"{not json", signed(b"{not json"))
    assert (status, answer["error"]) == (401, "signature missing: no webhook-id header")
    assert (stats["process_rejected"], stats["process_refused_signature_missing"]) == (0, 1)
    assert signed_status == 400


async def test_a_lab_event_cannot_be_carried_by_a_signature_for_another_id(tmp_path: Path):
    body = json.dumps({"id": "snack-2", "qty": 3}).encode()
    async with receiver(tmp_path / "inbox.db") as rx:
        status, answer = await post(rx, body, signed(body, "snack-1"))  # valid for snack-1
        assert status == 400 and "webhook-id must be the event id 'snack-2'" in answer["error"]
        assert await post(rx, body, signed(body, "snack-2")) == (
            200, {"id": "snack-2", "qty": 3, "status": "applied"})
        stats = await rx.stats()
    assert (stats["applied"], stats["stock"]) == (1, 3)


async def test_rotation_two_secrets_at_once(tmp_path: Path):
    """During a rotation the receiver holds both secrets; a sender signs with
    the old, the new, or both, and every request verifies."""
    async with receiver(tmp_path / "inbox.db", keys=(NEW_KEY, KEY)) as rx:
        for n, keys in enumerate(((KEY,), (NEW_KEY,), (NEW_KEY, KEY))):
            body = b'{"n": %d}' % n
            assert (await post(rx, body, signed(body, f"rot-{n}", keys=keys)))[0] == 200
    async with receiver(tmp_path / "after.db", keys=(NEW_KEY,)) as rx:  # the old one retired
        assert (await post(rx, ORDER_BYTES, signed(keys=(KEY,))))[0] == 401
        assert (await post(rx, ORDER_BYTES, signed(keys=(KEY, NEW_KEY))))[0] == 200


async def test_requests_signed_by_the_standardwebhooks_library_are_accepted(tmp_path: Path):
    secret = signing.new_secret(random=KEY)
    hook = Webhook(secret)
    at = datetime.datetime.fromtimestamp(NOW, datetime.UTC)
    text = '{"order": 9, "note": "naïve"}'
    headers = {"Content-Type": "application/json", "webhook-id": "order:9",
               "webhook-timestamp": str(NOW),
               "webhook-signature": hook.sign("order:9", at, text)}
    async with receiver(tmp_path / "inbox.db", keys=signing.read_secrets(
            _secrets_file(tmp_path, secret))) as rx:
        assert await post(rx, text.encode(), headers) == (
            200, {"id": "order:9", "status": "applied"})


def _secrets_file(tmp_path: Path, *secrets: str) -> Path:
    path = tmp_path / "secrets.txt"
    path.write_text("# the receiver's secrets\n" + "\n".join(secrets) + "\n")
    return path


async def test_stats_and_metrics_need_no_secret_and_name_no_payload(tmp_path: Path):
    async with receiver(tmp_path / "inbox.db") as rx:
        assert (await post(rx, ORDER_BYTES, signed()))[0] == 200
        async with rx.session.get(rx.base + "/stats") as answer:
            stats_text = await answer.text()
            stats_status = answer.status
        async with rx.session.get(rx.base + "/metrics") as answer:
            metrics_text, metrics_status = await answer.text(), answer.status
    assert (stats_status, metrics_status) == (200, 200)
    for text in (stats_text, metrics_text):
        assert "order:7" not in text and "café" not in text and "note" not in text


async def test_the_limits_come_first_and_still_hold(tmp_path: Path):
    big = b'{"pad": "' + b"x" * 70_000 + b'"}'
    async with receiver(tmp_path / "inbox.db") as rx:
        status, _ = await post(rx, big, signed(big))
        stats = await rx.stats()
    assert (status, stats["process_too_large"], stats["applied"]) == (413, 1, 0)


@pytest.mark.parametrize(("options", "message"), [
    ({"secrets": []}, "secrets must be a non-empty"),
    ({"secrets": [b"short"]}, "each secret must be key bytes"),
    ({"secrets": ["whsec_" + "A" * 44]}, "each secret must be key bytes"),  # text, not key bytes
    ({"secrets": [KEY], "tolerance_s": 0}, "tolerance_s must be an int in 1..86400"),
    ({"tolerance_s": 1.5}, "tolerance_s must be an int in 1..86400"),
    ({"path": "/stats"}, "cannot take events"),
    ({"path": "events"}, "must be an absolute URL path"),
    ({"path": "/a?b=1"}, "must be an absolute URL path"),
])
def test_bad_options_are_refused_before_the_inbox_exists(tmp_path: Path, options: dict,
                                                        message: str):
    inbox = tmp_path / "inbox.db"
    with pytest.raises(ValueError, match=message) as refused:
        make_app(inbox, **options)
    assert "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []


async def test_events_at_the_configured_path(tmp_path: Path):
    async with receiver(tmp_path / "inbox.db", path="/hooks/orders") as rx:
        assert rx.url.endswith("/hooks/orders")
        assert (await post(rx, ORDER_BYTES, signed()))[0] == 200
        async with rx.session.post(rx.base + "/events", data=ORDER_BYTES,
                                   headers=signed()) as answer:
            assert answer.status == 404
        assert (await rx.stats())["applied"] == 1
