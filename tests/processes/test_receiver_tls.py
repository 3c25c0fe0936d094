"""The receiver on a network: https with a throwaway CA (trustme), the same
limits as on loopback, and no address beyond loopback without a secret."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import ssl
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from asyncworker.receiving.server import Limits, check_host, serve, server_tls_context
from lease import signing
from tests.support.receiving import Running, snapshot
from tests.support.servers import ReceiverProcess, free_port

KEY = bytes(range(32))
HOSTS = ("localhost", "127.0.0.2", "127.0.0.1")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def write_pair(ca: trustme.CA, where: Path, name: str = "server", **issue) -> tuple[Path, Path]:
    cert = ca.issue_cert(*HOSTS, **issue)
    cert_path, key_path = where / f"{name}.pem", where / f"{name}.key"
    cert_path.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    return cert_path, key_path


@pytest.fixture
def pair(ca: trustme.CA, tmp_path: Path) -> tuple[Path, Path]:
    return write_pair(ca, tmp_path)


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def signed(body: bytes, msg_id: str) -> dict:
    return {"Content-Type": "application/json",
            **signing.signature_headers([KEY], msg_id, int(time.time()), body)}


async def test_https_with_a_trusted_ca_on_127_0_0_2(ca, pair, tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    async with Running(inbox, host="127.0.0.2", tls=server_tls_context(*pair),
                       trust=trusting(ca), secrets=[KEY]) as rx:
        assert rx.url.startswith("https://127.0.0.2:")
        body = b'{"order": 1}'
        async with rx.session.post(rx.url, data=body, headers=signed(body, "o-1")) as answer:
            assert (answer.status, await answer.json()) == (200, {"id": "o-1",
                                                                  "status": "applied"})
        # by name too: the certificate names localhost
        async with rx.session.post(rx.url, data=body, headers=signed(body, "o-1"),
                                   server_hostname="localhost") as answer:
            assert (await answer.json())["status"] == "duplicate"
        assert (await rx.stats())["applied"] == 1


async def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(ca, pair,
                                                                       tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    stranger = ssl.create_default_context()
    trustme.CA().configure_trust(stranger)  # another CA altogether
    async with Running(inbox, host="127.0.0.2", tls=server_tls_context(*pair),
                       trust=stranger, secrets=[KEY]) as rx:
        before = snapshot(inbox)
        body = b'{"order": 1}'
        with pytest.raises(aiohttp.ClientConnectorCertificateError,
                           match="certificate verify failed"):
            await rx.session.post(rx.url, data=body, headers=signed(body, "o-1"))
        # plain http to the https port is not an event either
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):
                await plain.post(rx.url.replace("https:", "http:"), data=body,
                                 headers=signed(body, "o-1"))
        assert snapshot(inbox) == before
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                ssl=trusting(ca))) as friend, friend.get(rx.base + "/stats") as answer:
            stats = await answer.json()
    assert (stats["applied"], stats["process_requests"]) == (0, 0)


async def test_tls_is_1_2_or_later(ca, pair):
    assert server_tls_context(*pair).minimum_version == ssl.TLSVersion.TLSv1_2


async def test_a_silent_client_is_dropped_within_the_read_time_on_tls(ca, pair,
                                                                      tmp_path: Path):
    """The read time bounds the TLS handshake too (asyncio's default is 60 s)."""
    limits = Limits(read_timeout=0.5)
    async with Running(tmp_path / "inbox.db", host="127.0.0.2", tls=server_tls_context(*pair),
                       limits=limits) as rx:
        reader, writer = await asyncio.open_connection("127.0.0.2", rx.port)
        started = time.monotonic()
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on us
        finally:
            writer.close()
        assert time.monotonic() - started < 5


async def test_the_connection_limit_holds_on_tls(ca, pair, tmp_path: Path):
    context = trusting(ca)
    async with Running(tmp_path / "inbox.db", host="127.0.0.2", tls=server_tls_context(*pair),
                       limits=Limits(max_connections=2)) as rx:
        held = [await asyncio.open_connection("127.0.0.2", rx.port, ssl=context,
                                              server_hostname="127.0.0.2") for _ in range(2)]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.2", rx.port, ssl=context,
                                                           server_hostname="127.0.0.2")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        finally:
            for _, w in held:
                w.close()
    assert answer.startswith(b"HTTP/1.1 503 ")


@pytest.mark.parametrize("case", ["no key", "no cert", "cert missing", "key missing",
                                  "cert garbage", "key of another cert", "key encrypted",
                                  "cert is a directory"])
def test_a_bad_certificate_or_key_is_one_line_and_nothing_binds(ca, pair, tmp_path: Path,
                                                                case: str):
    cert, key = pair
    other_cert, other_key = write_pair(ca, tmp_path, "other")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted.key"
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted.write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    tls_cert, tls_key = {
        "no key": (cert, None), "no cert": (None, key),
        "cert missing": (tmp_path / "nope.pem", key), "key missing": (cert, tmp_path / "nope"),
        "cert garbage": (tmp_path / "garbage.pem", key), "key of another cert": (cert, other_key),
        "key encrypted": (cert, encrypted), "cert is a directory": (tmp_path, key),
    }[case]
    inbox, port = tmp_path / "inbox.db", free_port()
    with pytest.raises(ValueError) as refused:
        asyncio.run(serve(inbox, "127.0.0.2", port, secrets=[KEY], tls_cert=tls_cert,
                          tls_key=tls_key))
    message = str(refused.value)
    assert "\n" not in message and "TLS" in message, message
    assert "passphrase" not in message and not inbox.exists()
    _nothing_listens("127.0.0.2", port)


def _nothing_listens(host: str, port: int) -> None:
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect((host, port))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "receiver.internal"])
def test_a_host_beyond_loopback_is_refused_without_a_secret(tmp_path: Path, host: str):
    inbox, port = tmp_path / "inbox.db", free_port()
    with pytest.raises(ValueError, match=f"^host {host} is not loopback: serving on a network "
                                         r"needs a secret \(--secret-file\)"):
        asyncio.run(serve(inbox, host, port))
    assert not inbox.exists()
    _nothing_listens("127.0.0.1", port)  # 0.0.0.0 would have taken loopback too
    assert check_host(host, [KEY]) == host  # with a secret, it may


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_secret(host: str):
    assert check_host(host, None) == host


SERVE = textwrap.dedent("""
    import asyncio, json, sys
    from asyncworker.receiving.server import serve
    from lease.signing import read_secrets
    spec = json.loads(sys.argv[1])
    asyncio.run(serve(spec["inbox"], spec["host"], 0, secrets=read_secrets(spec["secrets"]),
                      tls_cert=spec["cert"], tls_key=spec["key"], path="/hooks"))
""")


def test_serve_as_a_process_over_https_with_a_secret(ca, pair, tmp_path: Path):
    """The whole of serve: the https URL on its first line, a signed event over a
    verified connection, an unsigned one refused, the final figures on SIGTERM."""
    secrets = tmp_path / "secrets.txt"
    secrets.write_text(signing.new_secret(random=KEY) + "\n")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    spec = {"inbox": str(tmp_path / "inbox.db"), "host": "127.0.0.2", "secrets": str(secrets),
            "cert": str(pair[0]), "key": str(pair[1])}
    with ReceiverProcess(tmp_path / "inbox.db", json.dumps(spec), cafile=ca_file,
                         command=[sys.executable, "-c", SERVE]) as rx:
        assert rx.url == f"https://127.0.0.2:{rx.port}/hooks"
        context = ssl.create_default_context(cafile=str(ca_file))
        body = b'{"order": 5}'
        assert _post(rx.url, body, signed(body, "o-5"), context) == 200
        assert _post(rx.url, body, {"Content-Type": "application/json"}, context) == 401
        for hostile in (b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01garbage"):
            with socket.create_connection(("127.0.0.2", rx.port), timeout=10) as sock:
                sock.sendall(hostile)  # plain http, a broken handshake: dropped, not logged
                sock.shutdown(socket.SHUT_WR)
                assert sock.recv(100) == b""
        stranger = ssl.create_default_context()
        with pytest.raises(OSError, match="certificate verify failed"):
            _post(rx.url, body, signed(body, "o-6"), stranger)
        assert rx.stats()["applied"] == 1
        final = rx.final_counters()
    assert (final["applied"], final["process_refused_signature_missing"]) == (1, 1)
    assert rx.stderr == "receiver stopped\n"  # no handshake failure logged


def _post(url: str, body: bytes, headers: dict, context: ssl.SSLContext) -> int:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(urllib.request.Request(url, body, headers), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_an_expired_certificate_is_refused_by_a_verifying_client(ca, tmp_path: Path):
    """Serving an expired certificate is the operator's mistake; the sender's
    verification catches it (the delivery side records it), nothing arrives."""
    expired = write_pair(ca, tmp_path, "expired", not_after=datetime.datetime.now(
        datetime.UTC) - datetime.timedelta(days=1))

    async def attempt() -> tuple[str, dict]:
        async with Running(tmp_path / "inbox.db", host="127.0.0.2",
                           tls=server_tls_context(*expired), trust=trusting(ca)) as rx:
            with pytest.raises(aiohttp.ClientConnectorCertificateError) as refused:
                await rx.session.post(rx.url, data=b"{}", headers=signed(b"{}", "x"))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as blind, \
                    blind.get(rx.base + "/stats") as answer:  # the figures, unverified
                return str(refused.value), await answer.json()

    message, stats = asyncio.run(attempt())
    assert "certificate has expired" in message and stats["process_requests"] == 0


async def test_the_project_senders_deliver_signed_over_https(ca, pair, tmp_path: Path):
    """Both senders, with a Destination (pinned CA, a secret), into the receiver
    on 127.0.0.2: delivered and verified; a wrong secret is a permanent 401."""
    from asyncworker import sender
    from lease import http
    from lease.worker import Permanent

    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    async with Running(tmp_path / "inbox.db", host="127.0.0.2", tls=server_tls_context(*pair),
                       trust=trusting(ca), secrets=[KEY], path="/hooks") as rx:
        good = http.Destination(rx.url, ca_file=ca_file, secrets=(KEY,))
        event = {"id": "job-1", "body": {"order": 1}}
        assert await asyncio.to_thread(http.send_http, good, event, timeout=10, token=3)
        assert await sender.send_http(good, {"id": "job-2", "qty": 3}, timeout=10, token=4)
        wrong = http.Destination(rx.url, ca_file=ca_file, secrets=(bytes(range(1, 33)),))
        with pytest.raises(Permanent) as refused:
            await asyncio.to_thread(http.send_http, wrong, event, timeout=10)
        stats = await rx.stats()
    assert refused.value.http_status == 401  # type: ignore[attr-defined]
    assert (stats["applied"], stats["stock"], stats["process_refused_signature_mismatch"]) == (
        2, 3, 1)
