"""docs/examples/orders_service.py, run as the README shows it: a real process,
the same order event posted twice (signed by the standardwebhooks library),
one order row."""

from __future__ import annotations

import datetime
import json
import sqlite3
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trustme
from standardwebhooks import Webhook

from lease import signing
from tests.support.servers import ReceiverProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "orders_service.py"
SECRET = signing.new_secret(random=bytes(range(40, 72)))


def post(url: str, text: str, event_id: str, secret: str = SECRET,
         context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    now = datetime.datetime.now(datetime.UTC)
    headers = {"Content-Type": "application/json", "webhook-id": event_id,
               "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": Webhook(secret).sign(event_id, now, text)}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    request = urllib.request.Request(url, text.encode(), headers)
    try:
        with opener.open(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def orders(db: Path) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT id, item, qty FROM orders ORDER BY id").fetchall()
    finally:
        con.close()


def service(db: Path, *args: str, cafile: Path | None = None) -> ReceiverProcess:
    return ReceiverProcess(db, str(db), *args, "--port", "0", cafile=cafile,
                           command=[sys.executable, str(EXAMPLE)])


@pytest.fixture
def secrets_file(tmp_path: Path) -> Path:
    path = tmp_path / "secrets.txt"
    path.write_text(SECRET + "\n")
    return path


def test_the_same_order_twice_places_one(tmp_path: Path, secrets_file: Path):
    db = tmp_path / "orders.db"
    with service(db, "--secret-file", str(secrets_file)) as shop:
        assert shop.url.endswith("/hooks/orders")
        order = '{"item": "tea", "qty": 2}'
        assert post(shop.url, order, "job-7") == (200, {"id": "job-7", "status": "applied"})
        assert post(shop.url, order, "job-7") == (200, {"id": "job-7", "status": "duplicate"})
        assert post(shop.url, '{"item": "tea", "qty": 0}', "job-8")[0] == 422
        other = signing.new_secret(random=bytes(range(32)))
        assert post(shop.url, '{"item": "cake", "qty": 1}', "job-9", secret=other)[0] == 401
        assert shop.stop() == 0, shop.stderr
    assert "Traceback" not in shop.stderr
    assert orders(db) == [("job-7", "tea", 2)]


def test_over_https(tmp_path: Path, secrets_file: Path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.2")
    cert_path, key_path, ca_path = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    cert_path.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    db = tmp_path / "orders.db"
    with service(db, "--secret-file", str(secrets_file), "--host", "127.0.0.2",
                 "--tls-cert", str(cert_path), "--tls-key", str(key_path),
                 cafile=ca_path) as shop:
        assert shop.url.startswith("https://127.0.0.2:")
        context = ssl.create_default_context(cafile=str(ca_path))
        assert post(shop.url, '{"item": "tea", "qty": 1}', "job-1", context=context)[0] == 200
    assert orders(db) == [("job-1", "tea", 1)]


def test_a_bad_secrets_file_is_one_line(tmp_path: Path):
    bad = tmp_path / "secrets.txt"
    bad.write_text("whsec_not-base64!\n")
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "orders.db"),
                           "--secret-file", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "line 1" in done.stderr, done.stderr
    assert "not-base64" not in done.stderr  # the secret is never echoed
    assert not (tmp_path / "orders.db").exists()
