"""Standard Webhooks signatures: our signing and verifying, and interop with
the standardwebhooks library both ways."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from lease import signing
from lease.signing import SignatureError

KEY = bytes(range(32))
SECRET = signing.new_secret(random=KEY)
OTHER = signing.new_secret(random=bytes(range(1, 33)))
BODY = '{"order":7,"note":"café"}'.encode()
NOW = 1_800_000_000


def signed(body: bytes = BODY, msg_id: str = "order:7", at: int = NOW,
           secrets: tuple = (KEY,)) -> dict:
    return signing.signature_headers(list(secrets), msg_id, at, body)


def test_a_signed_request_verifies_and_names_its_id():
    assert signing.verify([KEY], signed(), BODY, NOW) == "order:7"


@pytest.mark.parametrize(("change", "kind"), [
    (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-signature"}, b), "missing"),
    (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), "missing"),
    (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-timestamp"}, b), "missing"),
    (lambda h, b: ({**h, "webhook-signature": "v1," + "A" * 44}, b), "mismatch"),  # forged
    (lambda h, b: ({**h, "webhook-signature": h["webhook-signature"][:-4]}, b), "mismatch"),
    (lambda h, b: ({**h, "webhook-signature": "garbage"}, b), "malformed"),
    (lambda h, b: ({**h, "webhook-signature": "v2,abc"}, b), "malformed"),
    (lambda h, b: ({**h, "webhook-signature": " ".join(["v1,x"] * 17)}, b), "malformed"),
    (lambda h, b: ({**h, "webhook-timestamp": "12ab"}, b), "malformed"),
    (lambda h, b: ({**h, "webhook-timestamp": "-5"}, b), "malformed"),
    (lambda h, b: (h, b.replace(b"7", b"8")), "mismatch"),  # a valid signature, changed body
    (lambda h, b: ({**h, "webhook-id": "order:8"}, b), "mismatch"),
])
def test_what_does_not_verify_says_how(change, kind):
    headers, body = change(signed(), BODY)
    with pytest.raises(SignatureError) as refused:
        signing.verify([KEY], headers, body, NOW)
    assert refused.value.kind == kind


def test_the_tolerance_window_both_ways():
    assert signing.verify([KEY], signed(at=NOW - 300), BODY, NOW)
    assert signing.verify([KEY], signed(at=NOW + 300), BODY, NOW)
    for at, kind in ((NOW - 301, "stale"), (NOW + 301, "future")):
        with pytest.raises(SignatureError) as refused:
            signing.verify([KEY], signed(at=at), BODY, NOW)
        assert refused.value.kind == kind
    with pytest.raises(SignatureError, match="61 s old, more than the 60 s"):
        signing.verify([KEY], signed(at=NOW - 61), BODY, NOW, tolerance_s=60)


def test_rotation_with_two_secrets():
    old, new = KEY, signing.parse_secret(OTHER)
    both = signed(secrets=(new, old))  # the sender signs with both during a rotation
    assert signing.verify([old], both, BODY, NOW)  # a receiver not yet rotated
    assert signing.verify([new], both, BODY, NOW)  # a receiver already rotated
    assert signing.verify([new, old], signed(secrets=(old,)), BODY, NOW)  # both sides
    with pytest.raises(SignatureError):
        signing.verify([new], signed(secrets=(old,)), BODY, NOW)


def test_two_headers_of_one_name_are_malformed():
    from multidict import CIMultiDict

    headers = CIMultiDict(signed())
    headers.add("webhook-id", "other")
    with pytest.raises(SignatureError) as refused:
        signing.verify([KEY], headers, BODY, NOW)
    assert refused.value.kind == "malformed"


@pytest.mark.parametrize(("text", "message"), [
    ("abc", "starting with 'whsec_'"),
    ("whsec_!!!", "base64"),
    ("whsec_" + "QUJD", "16..1024 bytes"),
    (None, "starting with"),
])
def test_bad_secrets_are_refused_without_echoing_them(text, message):
    with pytest.raises(ValueError, match=message) as refused:
        signing.parse_secret(text)
    assert "!!!" not in str(refused.value)


def test_a_secrets_file(tmp_path: Path):
    path = tmp_path / "secrets"
    path.write_text(f"# rotated 2026-11\n{SECRET}\n\n{OTHER}\n")
    assert signing.read_secrets(path) == (KEY, signing.parse_secret(OTHER))
    path.write_text(f"{SECRET}\nwhsec_nope!\n")
    with pytest.raises(ValueError, match="line 2") as refused:
        signing.read_secrets(path)
    assert "nope" not in str(refused.value)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no secret"):
        signing.read_secrets(path)


# ----------------------------------------------------------------- interop


def test_what_we_sign_verifies_with_the_standardwebhooks_library():
    now = int(time.time())
    headers = signing.signature_headers([KEY], "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", now, BODY)
    assert Webhook(SECRET).verify(BODY, headers) == {"order": 7, "note": "café"}


def test_what_the_standardwebhooks_library_signs_verifies_with_us():
    now = int(time.time())
    text = BODY.decode()
    signature = Webhook(SECRET).sign("order:7", datetime.datetime.fromtimestamp(
        now, tz=datetime.UTC), text)
    headers = {"webhook-id": "order:7", "webhook-timestamp": str(now),
               "webhook-signature": signature}
    assert signing.verify([KEY], headers, BODY, now) == "order:7"
    assert signing.sign(KEY, "order:7", now, BODY) == signature


def test_the_library_refuses_what_we_refuse():
    from standardwebhooks.webhooks import WebhookVerificationError

    now = int(time.time())
    headers = signing.signature_headers([KEY], "order:7", now, BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER).verify(BODY, headers)
    with pytest.raises(SignatureError):
        signing.verify([signing.parse_secret(OTHER)], headers, BODY, now)
