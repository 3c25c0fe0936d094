"""Running as a service: ``asyncworker run`` tells a service manager (systemd's
notify protocol, on a fake manager's datagram socket) READY only once the
store answered and the first claim committed, STOPPING on the first SIGTERM,
WATCHDOG while it runs; SIGHUP is refused with a line that says why, and the
process keeps working."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from asyncworker.service import RELOAD_REFUSED, Notifier, watchdog_interval_s
from tests.support.queues import job_rows
from tests.support.servers import ReceiverProcess, stop_process
from tests.support.waiting import wait_until

WAIT_S = 30.0


class FakeManager:
    """The service manager's end: a datagram socket that keeps what it receives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + name[1:].encode() if name.startswith("@") else name)
        self.sock.setblocking(False)
        self.received: list[dict[str, str]] = []

    def drain(self) -> list[dict[str, str]]:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return self.received
            self.received.append(dict(line.split("=", 1)
                                      for line in data.decode().splitlines()))

    def has(self, key: str) -> bool:
        return any(key in one for one in self.drain())

    def first(self, key: str) -> dict[str, str]:
        wait_until(lambda: self.has(key), f"{key} from the service", WAIT_S)
        return next(one for one in self.received if key in one)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager() -> Iterator[FakeManager]:
    fake = FakeManager(f"@asyncworker-notify-{os.getpid()}-{threading.get_ident()}")
    yield fake
    fake.close()


class Child:
    """A command as a child process, its stderr lines kept as they come."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncworker", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def line_with(self, words: str) -> str:
        wait_until(lambda: any(words in line for line in self.lines) or
                   self.proc.poll() is not None, f"a line with {words!r}", WAIT_S)
        found = [line for line in self.lines if words in line]
        assert found, "".join(self.lines)
        return found[0]

    def ended(self) -> tuple[int, str]:
        """Its exit code and stdout, once it ends of its own (a signal already sent)."""
        out, _ = self.proc.communicate(timeout=WAIT_S)
        self.reader.join(WAIT_S)
        return self.proc.returncode, out

    def stop(self) -> tuple[int, str]:
        out, _ = stop_process(self.proc)
        self.reader.join(WAIT_S)
        return self.proc.returncode, out


@contextmanager
def running(args: list[str], env: dict[str, str]) -> Iterator[Child]:
    child = Child(args, env)
    try:
        yield child
    finally:
        child.proc.kill()
        child.proc.wait()


def _busy_retries(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(r"^asyncworker_store_busy_retries_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_ready_only_after_the_first_claim_and_stopping_on_sigterm(
        queue: Path, tmp_path: Path, manager: FakeManager):
    from lease.stores import open_store

    with open_store(queue) as store:
        store.enqueue_events([{"id": "first", "body": {}}])
    locker = sqlite3.connect(queue, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # the queue's write lock: no claim can commit
    env = {"NOTIFY_SOCKET": manager.name, "WATCHDOG_USEC": "100000"}
    with ReceiverProcess(tmp_path / "inbox.db") as rx, \
            running(["run", str(queue), "--url", rx.url, "--metrics", "127.0.0.1:0",
                     "--poll-ms", "10"], env) as child:
        metrics = child.line_with("metrics: ").split()[1]
        child.line_with("run: owner")
        # it is up and tries to claim: every claim finds the store busy
        wait_until(lambda: _busy_retries(metrics) > 0, "a claim that found the store busy",
                   WAIT_S)
        assert not manager.has("READY"), manager.received
        assert manager.has("WATCHDOG")  # alive all the same
        locker.execute("ROLLBACK")

        ready = manager.first("READY")
        # the claim committed before READY was sent: the job is out of pending
        assert job_rows(queue)["first"]["status"] in ("leased", "done")
        assert ready["READY"] == "1" and "first claim made" in ready["STATUS"]
        assert not manager.has("STOPPING")
        wait_until(lambda: sum("WATCHDOG" in one for one in manager.drain()) >= 3,
                   "WATCHDOG=1 again and again, every half of WATCHDOG_USEC", WAIT_S)

        child.proc.send_signal(signal.SIGTERM)
        stopping = manager.first("STOPPING")
        assert stopping["STATUS"].startswith("stopping: no new claims")
        code, out = child.ended()
    locker.close()
    assert code == 0, "".join(child.lines)
    assert json.loads(out)["ok"] == 1
    statuses = [one.get("STATUS", "") for one in manager.drain()]
    assert statuses[-1].startswith("stopped: done 1")
    assert [one.get("READY") for one in manager.received].count("1") == 1


def test_sighup_is_refused_with_a_reason_and_the_work_goes_on(
        queue: Path, tmp_path: Path, manager: FakeManager):
    from lease.stores import open_store

    with ReceiverProcess(tmp_path / "inbox.db") as rx, \
            running(["run", str(queue), "--url", rx.url, "--poll-ms", "10"],
                    {"NOTIFY_SOCKET": manager.name}) as child:
        manager.first("READY")
        child.proc.send_signal(signal.SIGHUP)
        line = child.line_with("SIGHUP ignored")
        assert "no log file to reopen" in line and "restart the service" in line
        assert child.proc.poll() is None  # still running, and still dispatching:
        with open_store(queue) as store:
            store.enqueue_events([{"id": "after-hup", "body": {}}])
        wait_until(lambda: job_rows(queue)["after-hup"]["status"] == "done",
                   "the job enqueued after SIGHUP, done", WAIT_S)
        code, out = child.stop()
        assert code == 0 and json.loads(out)["ok"] == 1

        # serve refuses it too, and keeps answering
        rx.proc.send_signal(signal.SIGHUP)
        assert rx.stats()["applied"] == 1
        assert rx.stop() == 0
        assert RELOAD_REFUSED in rx.stderr


def test_the_operators_page_refuses_sighup_too(queue: Path, tmp_path: Path):
    """ui, configured by a file (its port and a name it answers to), keeps
    serving after SIGHUP and says why it changed nothing."""
    import http.client

    config = tmp_path / "ui.toml"
    config.write_text("[ui]\nport = 0\nallowed-host = [\"ops.internal\"]\n")
    with running(["ui", str(queue), "--config", str(config)], {}) as child:
        assert child.proc.stdout is not None
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", child.proc.stdout.readline())
        assert found, "".join(child.lines)

        def status_as(host: str) -> int:
            connection = http.client.HTTPConnection("127.0.0.1", int(found.group(1)),
                                                    timeout=10)
            try:
                connection.request("GET", "/?format=json", headers={"Host": host})
                return connection.getresponse().status
            finally:
                connection.close()

        child.proc.send_signal(signal.SIGHUP)
        assert RELOAD_REFUSED in child.line_with("SIGHUP ignored")
        assert status_as("ops.internal") == 200  # the name from the file, still served
        assert status_as("elsewhere.example") == 421
        code, _ = child.stop()
    assert code == 0


def test_without_a_manager_nothing_is_sent_and_run_behaves_as_before():
    assert Notifier.from_environment({}).enabled is False
    assert Notifier(None).send(READY="1") is False
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000"}) == 1.5
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000",
                                "WATCHDOG_PID": str(os.getpid())}) == 1.5


def test_a_socket_path_and_a_manager_gone(caplog: pytest.LogCaptureFixture):
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # sun_path is short
        path = os.path.join(folder, "notify")
        fake = FakeManager(path)
        notifier = Notifier(path)
        notifier.ready("up\nand running")  # a value is one line
        notifier.ready("again")  # once only
        notifier.stopping("stopping")
        notifier.stopping("still stopping")
        assert fake.drain() == [{"READY": "1", "STATUS": "up and running"},
                                {"STOPPING": "1", "STATUS": "stopping"},
                                {"STATUS": "still stopping"}]
        fake.close()
        os.unlink(path)  # the manager is gone: logged once, never raised
        assert notifier.send(STATUS="x") is False and notifier.send(STATUS="y") is False
        notifier.close()
    warnings = [r for r in caplog.records if "cannot notify" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("command", ["serve", "ui", "metrics"])
def test_the_servers_say_ready_once_they_listen_and_stopping_on_sigterm(
        command: str, queue: Path, tmp_path: Path, manager: FakeManager):
    """serve, ui and metrics are up when their port listens (and their inbox or
    queue is open): READY then, with the URL; STOPPING on SIGTERM; exit 0."""
    args = (["serve", "--inbox", str(tmp_path / "inbox.db"), "--port", "0"]
            if command == "serve" else [command, str(queue), "--port", "0"])
    with running(args, {"NOTIFY_SOCKET": manager.name}) as child:
        assert child.proc.stdout is not None
        found = re.search(r"(http://127\.0\.0\.1:\d+)(/\S*)?", child.proc.stdout.readline())
        assert found, "".join(child.lines)
        ready = manager.first("READY")
        assert ready["READY"] == "1" and found.group(1) in ready["STATUS"]
        with urllib.request.urlopen(found.group(0) if command != "serve"
                                    else found.group(1) + "/stats", timeout=10) as answer:
            assert answer.status == 200  # it answers as soon as it said it was ready
        assert not manager.has("STOPPING")
        child.proc.send_signal(signal.SIGTERM)
        assert manager.first("STOPPING")["STOPPING"] == "1"
        code, _ = child.ended()
    assert code == 0, "".join(child.lines)
