"""Tier 4, across "hosts": the receiver on 127.0.0.2 over https with a secret, the
dispatcher pointed at it by URL, a CA file and the same secret, each a real
process of the command line.

The story of issue 12: payload jobs, the first dispatcher SIGKILLed right after
an ACK (before it records it), a second one finishing. Every job is applied
exactly once, with its own body, every request the receiver saw verified (its
refused-signature counters 0), and the crash's resends absorbed as
duplicates. Then what goes wrong between hosts, as an operator reads it: a
wrong secret is a 401 (dead as permanent, the status in every attempt), a
wrong CA a TLS failure (retried, "certificate verify failed" in every attempt,
the receiver's handler never reached).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from asyncworker.operations import receiver_stats
from lease.policy import canonical_body
from lease.signing import new_secret

ROOT = Path(__file__).resolve().parents[2]
JOBS = 120
CRASH_AFTER = 30


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


class Pki:
    """A throwaway CA, the receiver's certificate for 127.0.0.2 signed by it, another
    CA that signed nothing here, and two secrets files."""

    def __init__(self, folder: Path) -> None:
        ca = trustme.CA()
        leaf = ca.issue_cert("localhost", "127.0.0.2", "127.0.0.1")
        self.ca, self.other_ca = folder / "ca.pem", folder / "other-ca.pem"
        self.cert, self.key = folder / "cert.pem", folder / "key.pem"
        self.secrets, self.wrong_secrets = folder / "secrets", folder / "wrong-secrets"
        ca.cert_pem.write_to_path(str(self.ca))
        trustme.CA().cert_pem.write_to_path(str(self.other_ca))
        self.cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(self.key))
        self.secrets.write_text(f"# the orders hook\n{new_secret()}\n")
        self.wrong_secrets.write_text(f"{new_secret()}\n")
        for path in (self.key, self.secrets, self.wrong_secrets):
            path.chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


class TlsReceiver:
    """``asyncworker serve`` on 127.0.0.2 with TLS and a secret, as its own process."""

    def __init__(self, inbox: Path, pki: Pki) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncworker", "serve", "--inbox", str(inbox),
             "--host", "127.0.0.2", "--path", "/hooks", "--tls-cert", str(pki.cert),
             "--tls-key", str(pki.key), "--secret-file", str(pki.secrets)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        self.pki = pki
        if not self.url.startswith("https://127.0.0.2:") or not self.url.endswith("/hooks"):
            self.stop()
            raise AssertionError(f"receiver did not start: {self.url!r} {self.stderr}")
        self.stderr = ""

    def stats(self, queue: Path) -> dict:
        """The receiver's figures as an operator gets them: `stats --receiver` over https."""
        out = cli("stats", str(queue), "--json", "--receiver", self.url,
                  "--ca-file", str(self.pki.ca))
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout)["receiver"])

    def figures(self) -> dict:
        """The same figures without the queue (a SIGKILLed dispatcher may have left
        it a journal to roll back, which `stats` names and does not repair)."""
        return receiver_stats(self.url, str(self.pki.ca))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, self.stderr = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()


@pytest.fixture
def receiver(tmp_path: Path, pki: Pki) -> Iterator[TlsReceiver]:
    rx = TlsReceiver(tmp_path / "inbox.db", pki)
    try:
        yield rx
    finally:
        rx.stop()
    assert "Traceback" not in rx.stderr, rx.stderr


def order_body(n: int) -> dict:
    return {"order": n, "sku": f"SKU-{n % 7}", "note": "caf\u00e9 \u2615", "lines": [n, n * 2]}


def enqueue_orders(queue: Path, *flags: str) -> None:
    lines = Path(str(queue) + ".jsonl")
    lines.write_text("".join(json.dumps({"id": f"order:{n}", "body": order_body(n)}) + "\n"
                             for n in range(JOBS)))
    assert cli("init", str(queue)).returncode == 0
    out = cli("enqueue", str(queue), "--file", str(lines), *flags)
    assert out.returncode == 0 and out.stdout.strip() == f"{JOBS} new, 0 duplicate, 0 conflicting"


def run(queue: Path, receiver: TlsReceiver, *flags: str) -> subprocess.CompletedProcess:
    return cli("run", str(queue), "--url", receiver.url, "--until-idle", "--lease-ms", "2000",
               "--backoff-base-ms", "1", "--backoff-cap-ms", "20", *flags, timeout=50)


def refused_signatures(figures: dict) -> dict:
    found = {k: v for k, v in figures.items() if "signature" in k}
    assert found, figures  # the receiver counts them: a check that can fail
    return found


def inspect(queue: Path, job_id: str) -> dict:
    out = cli("inspect", str(queue), job_id, "--json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_across_hosts_a_crash_and_a_second_dispatcher_apply_each_order_once(
        tmp_path: Path, pki: Pki, receiver: TlsReceiver):
    queue = tmp_path / "queue.db"
    enqueue_orders(queue)
    trust = ("--ca-file", str(pki.ca), "--secret-file", str(pki.secrets))

    first = run(queue, receiver, *trust, "--concurrency", "8", "--owner", "first",
                "--crash-after-acks", str(CRASH_AFTER))
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert "signed with 1 secret" in first.stderr  # its banner: never the secret itself
    secret = pki.secrets.read_text().splitlines()[1]
    assert secret not in first.stderr + first.stdout
    half = receiver.figures()
    assert CRASH_AFTER <= half["applied"] < JOBS

    second = run(queue, receiver, *trust, "--concurrency", "8", "--owner", "second")
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["dead"] == 0 and summary["ok"] >= JOBS - half["applied"]

    figures = receiver.stats(queue)
    assert figures["applied"] == JOBS  # each order applied once
    assert figures["duplicates"] >= 1  # the crash's ACKed, unrecorded send came again
    assert figures["conflicts"] == 0 and figures["process_rejected"] == 0
    assert set(refused_signatures(figures).values()) == {0}  # every request verified
    # every request the receiver saw, applied or absorbed (or cut off by the kill)
    assert figures["process_requests"] == (figures["applied"] + figures["duplicates"]
                                           + figures["process_incomplete"])

    con = sqlite3.connect(f"file:{tmp_path / 'inbox.db'}?mode=ro", uri=True)
    try:
        digests = dict(con.execute("SELECT id, digest FROM inbox"))
    finally:
        con.close()
    assert digests == {f"order:{n}": canonical_body(order_body(n))[1] for n in range(JOBS)}
    by_status = json.loads(cli("stats", str(queue), "--json").stdout)["by_status"]
    assert by_status["done"] == sum(by_status.values()) == JOBS


def test_a_wrong_secret_is_a_401_and_the_jobs_die_permanent(tmp_path: Path, pki: Pki,
                                                             receiver: TlsReceiver):
    queue = tmp_path / "queue.db"
    enqueue_orders(queue)
    out = run(queue, receiver, "--ca-file", str(pki.ca), "--secret-file",
              str(pki.wrong_secrets), "--concurrency", "8")
    assert out.returncode == 3, out.stderr  # some went dead in this run
    summary = json.loads(out.stdout)
    assert summary["dead_by_reason"].get("permanent") == JOBS
    history = inspect(queue, "order:7")
    [attempt] = history["attempts"]
    assert attempt["http_status"] == 401 and attempt["reason"] == "permanent"
    figures = receiver.stats(queue)
    assert figures["applied"] == 0 and figures["inbox_rows"] == 0  # nothing touched
    assert sum(refused_signatures(figures).values()) == JOBS  # each refusal counted


def test_a_wrong_ca_retries_and_every_attempt_says_certificate_verify_failed(
        tmp_path: Path, pki: Pki, receiver: TlsReceiver):
    queue = tmp_path / "queue.db"
    enqueue_orders(queue, "--max-attempts", "2")
    out = run(queue, receiver, "--ca-file", str(pki.other_ca), "--secret-file",
              str(pki.secrets), "--concurrency", "8")
    assert out.returncode == 3, out.stderr
    summary = json.loads(out.stdout)
    assert summary["dead_by_reason"].get("exhausted") == JOBS and summary["retried"] >= JOBS
    attempts = inspect(queue, "order:7")["attempts"]
    assert len(attempts) == 2  # retried: a certificate can be fixed, the budget bounds it
    assert all("certificate verify failed" in (a["error"] or "") for a in attempts), attempts
    dead = cli("dead", str(queue), "--limit", "3")
    assert "certificate verify failed" in dead.stdout
    figures = receiver.stats(queue)
    assert figures["process_requests"] == 0 and figures["applied"] == 0  # no handler ran


def test_the_orders_service_example_places_each_order_once_through_a_crash(tmp_path: Path,
                                                                            pki: Pki):
    """The README's own service (docs/examples/orders_service.py, the idempotent
    library) over TLS on 127.0.0.2, the dispatchers of the command line pointed at it."""
    queue, orders = tmp_path / "queue.db", tmp_path / "orders.db"
    lines = Path(str(queue) + ".jsonl")
    lines.write_text("".join(json.dumps({"id": f"order:{n}", "body": {"item": f"tea-{n}",
                                                                        "qty": n % 3 + 1}})
                             + "\n" for n in range(JOBS)))
    assert cli("init", str(queue)).returncode == 0
    assert cli("enqueue", str(queue), "--file", str(lines)).returncode == 0
    service = subprocess.Popen(
        [sys.executable, str(ROOT / "docs" / "examples" / "orders_service.py"), str(orders),
         "--secret-file", str(pki.secrets), "--host", "127.0.0.2", "--port", "0",
         "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert service.stdout is not None
        url = service.stdout.readline().strip()
        assert url.startswith("https://127.0.0.2:") and url.endswith("/hooks/orders"), url
        trust = ("--url", url, "--until-idle", "--lease-ms", "2000", "--ca-file", str(pki.ca),
                 "--secret-file", str(pki.secrets), "--concurrency", "8")
        first = cli("run", str(queue), *trust, "--crash-after-acks", str(CRASH_AFTER))
        assert first.returncode == -signal.SIGKILL, first.stderr
        second = cli("run", str(queue), *trust, timeout=50)
        assert second.returncode == 0, second.stderr
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            _, err = service.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
            _, err = service.communicate()
    assert service.returncode == 0 and "Traceback" not in err, err
    con = sqlite3.connect(f"file:{orders}?mode=ro", uri=True)
    try:
        placed = con.execute("SELECT id, item, qty FROM orders ORDER BY id").fetchall()
        received = con.execute("SELECT COUNT(*) FROM received_events").fetchone()[0]
    finally:
        con.close()
    assert placed == sorted((f"order:{n}", f"tea-{n}", n % 3 + 1) for n in range(JOBS))
    assert received == JOBS
    by_status = json.loads(cli("stats", str(queue), "--json").stdout)["by_status"]
    assert by_status["done"] == JOBS
