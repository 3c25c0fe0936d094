"""Named destinations: what a Destination accepts, the ACK policies' table for
both senders, Retry-After, signed requests, and failures that say what failed.

The lab's strict URL stays as it was (tests/processes/test_sender.py); these tests are
about what an operator may name on top of it.
"""

from __future__ import annotations

import asyncio
import email.utils
import socket
import threading
import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from asyncworker import Dispatcher, retry_delay_ms
from lease import signing
from lease.http import (
    ACK_LIMIT,
    Destination,
    retry_after_ms,
    status_verdict,
)
from lease.policy import DAY_MS, RetryPolicy
from lease.sqlite import open_store
from lease.worker import BadAck, Permanent, Retryable
from tests.support.dispatching import FakeClock, attempts, enqueue, until
from tests.support.queues import T0, job
from tests.support.servers import HostileServer, ack_for, answer
from tests.support.tls_servers import receiver

LAB_EVENT = {"id": "snack-7", "qty": 7}
EVENT = {"id": "order:7", "body": '{"order":7}'}
KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))
SECRET = signing.new_secret(random=KEY)
OTHER_SECRET = signing.new_secret(random=OTHER_KEY)


# ---------------------------------------------------------------- construction

ACCEPTED = [
    ("https://orders.example:8443/hooks/orders", "orders.example", 8443, "/hooks/orders"),
    ("https://orders.example/hooks?tenant=7&x=%20", "orders.example", 443,
     "/hooks?tenant=7&x=%20"),
    ("https://orders.example", "orders.example", 443, "/"),
    ("https://[2001:db8::1]:9/h", "2001:db8::1", 9, "/h"),
    ("http://127.0.0.2:8080/hooks/orders", "127.0.0.2", 8080, "/hooks/orders"),
    ("http://localhost/x", "localhost", 80, "/x"),
    ("http://[::1]:5/events", "::1", 5, "/events"),
    ("HTTPS://Orders.Example/Hooks", "orders.example", 443, "/Hooks"),
]


@pytest.mark.parametrize(("url", "host", "port", "target"), ACCEPTED)
def test_destinations_accepted(url, host, port, target):
    route = Destination(url).route
    assert (route.host, route.port, route.target) == (host, port, target)
    assert route.tls == url.lower().startswith("https")


REFUSED = [
    ({"url": "http://orders.example/hooks"}, "plain http only to a loopback host"),
    ({"url": "http://10.0.0.1:80/events"}, "use https://, or insecure_http=True"),
    ({"url": "http://0.0.0.0:80/events"}, "plain http only to a loopback host"),
    ({"url": "ftp://127.0.0.1/x"}, "must start with https://"),
    ({"url": "127.0.0.1:8080/events"}, "must start with https://"),
    ({"url": "https://user:pw@orders.example/x"}, "credentials"),
    ({"url": "https://orders.example/x#frag"}, "fragment"),
    ({"url": "https://orders.example/x#"}, "fragment"),
    ({"url": "https:///x"}, "no host"),
    ({"url": "https://orders.example:99999/x"}, "invalid"),
    ({"url": "https://orders.example:0/x"}, "port is invalid"),
    ({"url": "https://[::1/x"}, "invalid"),
    ({"url": "https://orders.example/a b"}, "without spaces"),
    ({"url": "https://orders.example/\n"}, "printable"),
    ({"url": "https://bücher.example/"}, "ASCII"),
    ({"url": "https://orders.example/" + "x" * 2048}, "2048"),
    ({"url": b"https://orders.example/"}, "must be a str"),
    ({"url": None}, "must be a str"),
    ({"url": "https://o.example/", "ack": "2xx"}, "ack must be one of echo-id, status"),
    ({"url": "https://o.example/", "ack": None}, "ack must be one of"),
    ({"url": "http://127.0.0.1/x", "ca_file": "ca.pem"}, "https:// URLs only"),
    ({"url": "https://o.example/", "ca_file": "/nonexistent/ca.pem"},
     "ca_file /nonexistent/ca.pem: cannot load CA certificates: No such file"),
    ({"url": "https://o.example/", "ca_file": "/"}, "cannot load CA certificates"),
    ({"url": "https://o.example/", "ca_file": b"/ca.pem"}, "ca_file must be a path"),
    ({"url": "https://o.example/", "ca_file": 3}, "ca_file must be a path"),
    ({"url": "https://o.example/", "secrets": KEY}, "secrets must be a"),
    ({"url": "https://o.example/", "secrets": (SECRET,)}, "key bytes"),
    ({"url": "https://o.example/", "secrets": (b"short",)}, "key bytes"),
    ({"url": "https://o.example/", "insecure_http": 1}, "insecure_http must be a bool"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED)
def test_bad_destinations_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as caught:
        Destination(**kwargs)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert SECRET not in text and repr(KEY) not in text  # never the secret


def test_a_ca_file_that_is_not_a_certificate(tmp_path: Path):
    for content in (b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\nxx\n"):
        path = tmp_path / "ca.pem"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"ca_file {path}: cannot load CA certificates"):
            Destination("https://o.example/", ca_file=path)


def test_plain_http_elsewhere_only_with_the_risk_named():
    destination = Destination("http://orders.example:8080/hooks", insecure_http=True)
    assert destination.route.tls is False and destination.ssl_context is None


def test_the_repr_counts_secrets_and_shows_none():
    destination = Destination("https://o.example/", secrets=[KEY, OTHER_KEY])
    assert destination.secrets == (KEY, OTHER_KEY)  # a list is kept as a tuple
    assert "<2 secrets>" in repr(destination)
    assert repr(KEY) not in repr(destination) and "\\x00\\x01" not in repr(destination)


def test_destinations_are_values():
    assert Destination("https://o.example/") == Destination("https://o.example/")
    assert hash(Destination("https://o.example/")) == hash(Destination("https://o.example/"))
    assert Destination("https://o.example/") != Destination("https://o.example/", ack="status")
    with pytest.raises(AttributeError):
        Destination("https://o.example/").url = "https://evil.example/"  # type: ignore[misc]


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/hooks", "https://localhost:1/events",
                                 "http://127.0.0.2:1/events?x=1"])
async def test_the_lab_url_stays_strict(send, url):
    """A str is the lab's URL: what a Destination accepts is not a lab URL."""
    Destination(url)  # a Destination may name it
    with pytest.raises(ValueError, match="url"):
        await send(url, LAB_EVENT, timeout=1)


def test_a_dispatcher_takes_exactly_one_of_url_destination_and_send(queue_path: Path):
    destination = Destination("https://o.example/hooks")
    assert Dispatcher(queue_path, "d1", url="https://o.example/hooks").destination == destination
    assert Dispatcher(queue_path, "d1", destination=destination).destination is destination
    with pytest.raises(ValueError, match="exactly one"):
        Dispatcher(queue_path, "d1", url="https://o.example/hooks", destination=destination)
    with pytest.raises(ValueError, match="plain http only to a loopback host"):
        Dispatcher(queue_path, "d1", url="http://orders.example/hooks")


# ---------------------------------------------------------------- plain http to loopback


async def test_plain_http_to_another_loopback_address_and_any_path(send):
    async with receiver(None, host="127.0.0.2", path="/hooks/orders") as rx:
        assert rx.url.startswith("http://127.0.0.2:")
        assert await send(Destination(rx.url), EVENT, timeout=5) is True
        assert [s.path for s in rx.seen] == ["/hooks/orders"]


async def test_a_dispatcher_url_is_a_destination(queue_path: Path):
    enqueue(queue_path, [{"id": "order:1", "body": {"order": 1}}])
    async with receiver(None, host="127.0.0.2") as rx, Dispatcher(
            queue_path, "d1", url=rx.url, clock=FakeClock(T0)) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 30)
    assert stats.ok == 1 and len(rx.seen) == 1


# ---------------------------------------------------------------- the ACK policies


def http_date(in_s: float) -> str:
    return email.utils.formatdate(time.time() + in_s, usegmt=True)


# (name, answer, status-policy verdict, http_status, retry_after_ms about)
STATUS_TABLE = [
    ("200 plain text", answer(200, b"OK"), True, None, None),
    ("204", answer(204), True, None, None),
    ("201 json naming another id", ack_for("not-this-one"), True, None, None),
    ("200 over the cap", answer(200, b"x" * (ACK_LIMIT * 4)), True, None, None),
    ("410", answer(410, b"gone"), Permanent, 410, None),
    ("401", answer(401, b'{"error": "signature mismatch"}'), Permanent, 401, None),
    ("403", answer(403), Permanent, 403, None),
    ("429 Retry-After seconds", answer(429, b"", {"Retry-After": "7"}), Retryable, 429, 7000),
    ("503 Retry-After date", lambda r, s: answer(503, b"", {"Retry-After": http_date(120)})(
        r, s), Retryable, 503, 120_000),
    ("503", answer(503), Retryable, 503, None),
    ("500 Retry-After garbage", answer(500, b"", {"Retry-After": "soon"}), Retryable, 500,
     None),
    ("404", answer(404, b"no route"), Retryable, 404, None),
    ("400", answer(400), Retryable, 400, None),
    ("302", answer(302, b"", {"Location": "/elsewhere"}), BadAck, 302, None),
]


@pytest.mark.parametrize(("name", "behaviour", "expected", "status", "wait_ms"), STATUS_TABLE,
                         ids=[row[0] for row in STATUS_TABLE])
async def test_status_policy_table(send, name, behaviour, expected, status, wait_ms):
    with HostileServer(behaviour) as server:
        destination = Destination(server.url, ack="status")
        if expected is True:
            assert await send(destination, EVENT, timeout=5) is True
        else:
            with pytest.raises(expected) as caught:
                await send(destination, EVENT, timeout=5)
            assert getattr(caught.value, "http_status", None) == status
            got = getattr(caught.value, "retry_after_ms", None)
            if wait_ms is None:
                assert got is None
            else:  # a date has whole seconds, and the test's own time passes
                assert wait_ms - 3000 <= got <= wait_ms, got
                assert f"Retry-After {got} ms" in str(caught.value)
        assert len(server.requests) == 1  # one request, no redirect followed


@pytest.mark.parametrize(("code", "asked", "wait_ms"), [
    (429, "7", 7000), (503, "5", 5000), (500, None, None), (503, "soon", None)])
async def test_echo_id_reads_retry_after_as_status_does(send, code, asked, wait_ms):
    headers = {} if asked is None else {"Retry-After": asked}
    with HostileServer(answer(code, b"", headers)) as server, \
            pytest.raises(Retryable) as caught:
        await send(Destination(server.url), EVENT, timeout=5)
    assert caught.value.http_status == code  # type: ignore[attr-defined]
    assert caught.value.retry_after_ms == wait_ms  # type: ignore[attr-defined]
    assert str(caught.value) == f"receiver answered {code}" + (
        "" if wait_ms is None else f", Retry-After {wait_ms} ms")


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_credential_says_so_under_echo_id_too(send, status):
    with HostileServer(answer(status, b'{"error": "signature mismatch"}')) as server:
        with pytest.raises(Permanent, match=f"receiver refused with {status} "
                                            r"\(a wrong secret") as caught:
            await send(Destination(server.url), EVENT, timeout=5)
        assert caught.value.http_status == status  # type: ignore[attr-defined]


async def test_echo_id_is_unchanged_for_a_plain_200(send):
    with HostileServer(answer(200, b"OK")) as server, pytest.raises(BadAck, match="not JSON"):
        await send(Destination(server.url), EVENT, timeout=5)


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("0", 0), ("7", 7000), (" 7 ", 7000), ("86400", DAY_MS),
    ("86401", DAY_MS), ("9" * 40, DAY_MS), ("-5", None), ("1.5", None), ("soon", None),
    ("", None), ("٣", None),
    ("Sun, 06 Nov 1994 08:49:37 GMT", 0),  # a date past: now
    ("Sun, 06 Nov 1994 08:49:47 GMT", 10_000),
    ("Sunday, 06-Nov-94 08:49:47 GMT", 10_000),  # the obsolete forms, RFC 9110 5.6.7
    ("Sun Nov  6 08:49:47 1994", 10_000),
    ("Mon, 07 Nov 1994 08:49:37 GMT", DAY_MS),
    ("Tue, 08 Nov 1994 08:49:37 GMT", DAY_MS),  # beyond a day: a day
])
def test_retry_after_ms(value, expected):
    now_ms = 784111777_000  # Sun, 06 Nov 1994 08:49:37 GMT
    assert retry_after_ms(value, now_ms) == expected


@pytest.mark.parametrize(("policy", "asked", "cap", "expected"), [
    (1000, None, 60_000, 1000),  # nothing asked: the policy's
    (1000, 0, 60_000, 1000),  # asked for less: the policy's
    (1000, 5000, 60_000, 5000),  # asked for more: as asked
    (1000, 120_000, 60_000, 60_000),  # asked for more than the cap: the cap
    (90_000, 120_000, 60_000, 90_000),  # the policy's own delay is never cut
])
def test_retry_delay_ms(policy, asked, cap, expected):
    assert retry_delay_ms(policy, asked, cap) == expected


def test_status_verdict_has_no_exceptions_beyond_its_table():
    assert all(status_verdict(code, b"", None, 0) is True for code in range(200, 300))
    for code in list(range(100, 200)) + list(range(300, 400)) + [600, 999]:
        with pytest.raises(BadAck):
            status_verdict(code, b"", None, 0)


@pytest.mark.parametrize("ack", ["echo-id", "status"])
@pytest.mark.parametrize("code", [429, 503])
@pytest.mark.parametrize(("asked", "expected_ms"), [
    ("120", 60_000), ("5", 5_000), (None, None), ("0", None)])
async def test_the_dispatcher_waits_as_asked_up_to_its_cap(queue_path: Path, asked,
                                                          expected_ms, code, ack):
    """Under either ACK policy: the receiver says when it can take the next request."""
    policy = RetryPolicy(backoff_base_ms=1000, backoff_cap_ms=60_000, jitter=0)
    expected_ms = expected_ms or policy.delay_ms(1, 0.0)
    headers = {} if asked is None else {"Retry-After": asked}
    enqueue(queue_path, [{"id": "order:1", "body": {"order": 1}}], policy)
    with HostileServer(answer(code, b"", headers)) as server:
        destination = Destination(server.url, ack=ack)
        async with Dispatcher(queue_path, "d1", destination=destination, policy=policy,
                              clock=FakeClock(T0)) as d:
            run = asyncio.create_task(d.run())
            await until(lambda: d.stats.retried == 1)
            d.stop()
            await run
    [first] = attempts(queue_path, "order:1")
    assert first["outcome"] == "retry" and first["http_status"] == code
    store = open_store(queue_path)
    try:
        assert job(store, "order:1")["available_at"] == T0 + expected_ms
    finally:
        store.close()


# ---------------------------------------------------------------- signing


async def test_signed_requests_verify_with_the_standardwebhooks_library(send):
    async with receiver(None) as rx:
        now = int(time.time())
        destination = Destination(rx.url, secrets=(KEY, OTHER_KEY))
        assert await send(destination, EVENT, timeout=5, token=9, timestamp=now - 30) is True
        assert await send(destination, LAB_EVENT, timeout=5) is True  # the wall clock
        first, second = rx.seen
    assert first.headers["webhook-id"] == "order:7"
    assert first.headers["webhook-timestamp"] == str(now - 30)  # the injected clock
    assert first.headers["x-lease-token"] == "9"  # the claim token, as ever
    assert len(first.headers["webhook-signature"].split(" ")) == 2  # one per secret
    for secret in (SECRET, OTHER_SECRET):  # each secret alone verifies: rotation
        assert Webhook(secret).verify(first.body, first.headers) == {"order": 7}
        assert Webhook(secret).verify(second.body, second.headers) == LAB_EVENT
    assert abs(int(second.headers["webhook-timestamp"]) - time.time()) < 60


async def test_a_signature_covers_the_body_that_was_sent(send):
    from standardwebhooks.webhooks import WebhookVerificationError

    async with receiver(None) as rx:
        await send(Destination(rx.url, secrets=(KEY,)), EVENT, timeout=5)
        [seen] = rx.seen
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(seen.body.replace(b"7", b"8"), seen.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER_SECRET).verify(seen.body, seen.headers)


@pytest.mark.parametrize("timestamp", [-1, 1.5, "1", True, 2**41])
async def test_a_bad_timestamp_is_refused_before_sending(send, timestamp):
    async with receiver(None) as rx:
        with pytest.raises(ValueError, match="timestamp"):
            await send(Destination(rx.url, secrets=(KEY,)), EVENT, timeout=5,
                       timestamp=timestamp)
        assert rx.seen == []


async def test_the_dispatcher_signs_at_its_own_clock(queue_path: Path):
    enqueue(queue_path, [{"id": "order:1", "body": {"order": 1}}])

    async with receiver(None) as rx:
        destination = Destination(rx.url, secrets=(KEY,))
        async with Dispatcher(queue_path, "d1", destination=destination,
                              clock=FakeClock(T0 + 999)) as d:
            await asyncio.wait_for(d.run(until_idle=True), 30)
        [seen] = rx.seen
    assert seen.headers["webhook-timestamp"] == str((T0 + 999) // 1000)
    assert signing.verify([KEY], seen.headers, seen.body, (T0 + 999) // 1000) == "order:1"


# ---------------------------------------------------------------- failures named


async def test_a_dns_failure_is_named_and_fast(send):
    """A name under .invalid (RFC 6761) never resolves: no request leaves the machine."""
    started = time.monotonic()
    with pytest.raises(Retryable, match=r"^DNS: cannot resolve 'orders\.invalid': ") as caught:
        await send(Destination("https://orders.invalid/hooks"), EVENT, timeout=10)
    assert time.monotonic() - started < 5  # the resolver said no; the timeout did not fire
    assert getattr(caught.value, "http_status", None) is None


async def test_the_insecure_flag_lets_plain_http_leave_loopback(send):
    with pytest.raises(ValueError, match="insecure_http=True"):
        Destination("http://orders.invalid/hooks")
    # With the flag, the sender goes as far as the name (and no farther: .invalid).
    with pytest.raises(Retryable, match="^DNS: cannot resolve 'orders.invalid'"):
        await send(Destination("http://orders.invalid/hooks", insecure_http=True), EVENT,
                   timeout=10)


async def test_a_resolver_that_hangs_is_bounded_by_the_timeout(send, monkeypatch):
    """No DNS server can be made to hang from here, so this one test stands
    the system resolver in for one that does not answer."""
    release = threading.Event()
    real = socket.getaddrinfo

    def unanswered(host, *args, **kwargs):
        if host.rstrip(".") == "slow.invalid":
            release.wait(10)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", unanswered)
    started = time.monotonic()
    try:
        with pytest.raises(Retryable, match="timed out after 0.5s"):
            await send(Destination("https://slow.invalid/hooks"), EVENT, timeout=0.5)
        assert time.monotonic() - started < 3
    finally:
        release.set()


async def test_a_refused_connection_is_named(send):
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]  # bound, not listening: a refusal
        with pytest.raises(Retryable, match=rf"^connection refused by 127\.0\.0\.2:{port}$"):
            await send(Destination(f"http://127.0.0.2:{port}/hooks"), EVENT, timeout=5)


def _refusing_url() -> tuple[str, socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))  # bound, not listening: every connect is refused
    return f"http://127.0.0.2:{sock.getsockname()[1]}/hooks", sock


@pytest.mark.parametrize("failure", ["dns", "refused", "401"])
async def test_the_attempt_says_what_failed(queue_path: Path, failure: str):
    """What an operator reads in the job's history (inspect) for each failure."""
    enqueue(queue_path, [{"id": "order:1", "body": {"order": 1}}])
    with HostileServer(answer(401, b'{"error": "signature mismatch"}')) as server:
        refusing, held = _refusing_url()
        url = {"dns": "https://orders.invalid/hooks", "refused": refusing,
               "401": server.url}[failure]
        try:
            async with Dispatcher(queue_path, "d1", destination=Destination(url),
                                  clock=FakeClock(T0)) as d:
                run = asyncio.create_task(d.run())
                await until(lambda: d.stats.retried + d.stats.dead == 1)
                d.stop()
                await run
        finally:
            held.close()
    [first] = attempts(queue_path, "order:1")
    if failure == "401":
        assert (first["outcome"], first["result"], first["reason"]) == (
            "permanent", "dead", "permanent")
        assert first["http_status"] == 401
        assert first["error"].startswith("Permanent: receiver refused with 401 (a wrong secret")
        assert "signature mismatch" in first["error"]
        return
    assert (first["outcome"], first["result"], first["http_status"]) == (
        "retry", "pending", None)
    expected = {"dns": "Retryable: DNS: cannot resolve 'orders.invalid': ",
                "refused": f"Retryable: connection refused by {refusing[7:-6]}"}
    assert first["error"].startswith(expected[failure]), first["error"]
