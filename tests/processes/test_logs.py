"""Logs an operator can read: one line per retry, dead job, stale finish, lost
lease, bad ACK and failure, with its facts (id, token, owner, attempt,
outcome, status, reason, HTTP status or error, delay) as JSON keys or as
key=value; a timestamp on every text line; never a job's body."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncworker import Dispatcher
from asyncworker.logs import configure
from lease.policy import RetryPolicy
from lease.stores import open_store
from tests.support.dispatching import FakeClock
from tests.support.scenario import BODY_MARK, T, run_scenario
from tests.support.servers import Behaviour, HostileServer, Request, ack_for, answer

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) \S+ ")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Log records of this test only, through the command line's configure(); the
    root logger as it was afterwards."""
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    try:
        yield stream
    finally:
        for handler in root.handlers[:]:
            if getattr(handler, "stream", None) is stream:
                root.removeHandler(handler)
        root.setLevel(level)


def _json_lines(stream: io.StringIO) -> list[dict]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line an object


def _by_message(lines: list[dict], msg: str) -> list[dict]:
    return [line for line in lines if line["msg"] == msg]


async def test_json_lines_carry_the_facts_of_each_event(tmp_path: Path, captured: io.StringIO):
    configure("info", "json", stream=captured)
    await run_scenario(str(tmp_path / "queue.db"))
    lines = _json_lines(captured)
    assert BODY_MARK not in captured.getvalue()  # ok-body's body is in no line
    for line in lines:
        assert set(line) >= {"ts", "level", "logger", "msg"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    [retry] = _by_message(lines, "retry")
    assert {k: retry[k] for k in ("id", "token", "owner", "attempt", "outcome", "status",
                                  "http_status", "level")} == {
        "id": "flaky", "token": 1, "owner": "metrics-1", "attempt": 1, "outcome": "retry",
        "status": "pending", "http_status": 503, "level": "info"}
    assert retry["delay_ms"] == 5 and "503" in retry["error"]  # base 10 ms, draw 0: half
    [dead] = _by_message(lines, "dead")
    assert {k: dead[k] for k in ("id", "owner", "outcome", "status", "reason", "http_status",
                                 "level")} == {
        "id": "refused", "owner": "metrics-1", "outcome": "permanent", "status": "dead",
        "reason": "permanent", "http_status": 409, "level": "warning"}
    assert isinstance(dead["token"], int) and dead["attempt"] == 1
    [stale] = _by_message(lines, "stale finish refused")
    assert {k: stale[k] for k in ("id", "token", "owner", "attempt", "outcome", "status")} == {
        "id": "slow", "token": 1, "owner": "metrics-1", "attempt": 1, "outcome": "ok",
        "status": "stale"}
    [bad] = _by_message(lines, "bad ACK")
    assert {k: bad[k] for k in ("id", "token", "owner", "attempt", "status")} == {
        "id": "badack", "token": 1, "owner": "metrics-1", "attempt": 1, "status": "leased"}
    assert "not an ACK" in bad["error"]
    [quarantined] = _by_message(lines, "quarantined")
    assert (quarantined["dead"], quarantined["reasons"]) == (1, {"deadline": 1})
    assert _by_message(lines, "done") == []  # a job done is not a line at info
    assert Counter(line["msg"] for line in lines if line["logger"] == "asyncworker.dispatcher"
                   ) == {"retry": 1, "dead": 1, "stale finish refused": 1, "bad ACK": 1,
                         "quarantined": 1}


async def test_done_jobs_are_lines_at_debug_and_still_no_body(tmp_path: Path,
                                                              captured: io.StringIO):
    configure("debug", "json", stream=captured)
    await run_scenario(str(tmp_path / "queue.db"))
    done = _by_message(_json_lines(captured), "done")
    assert sorted(line["id"] for line in done) == [
        "badack", "flaky", "ok-0", "ok-1", "ok-body", "slow"]
    assert all(line["status"] == "done" and line["level"] == "debug" for line in done)
    assert BODY_MARK not in captured.getvalue()


async def test_text_lines_have_a_timestamp_and_key_value_facts(tmp_path: Path,
                                                               captured: io.StringIO):
    configure("info", "text", stream=captured)
    await run_scenario(str(tmp_path / "queue.db"))
    lines = captured.getvalue().splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), lines
    [retry] = [line for line in lines if " retry " in line]
    assert retry.split(" ", 3)[1:3] == ["INFO", "asyncworker.dispatcher"]
    for fact in ("id=flaky", "token=1", "owner=metrics-1", "attempt=1", "outcome=retry",
                 "status=pending", "http_status=503", "delay_ms=5",
                 'error="Retryable: receiver answered 503"'):
        assert fact in retry.split(" retry ", 1)[1], (fact, retry)
    [quarantined] = [line for line in lines if " quarantined " in line]
    assert "reasons=deadline:1" in quarantined
    assert BODY_MARK not in captured.getvalue()


async def test_a_failed_finish_is_one_line_with_its_jobs_and_error(tmp_path: Path,
                                                                   captured: io.StringIO):
    queue = tmp_path / "queue.db"
    with open_store(queue, create=True) as store:
        store.enqueue_events([{"id": f"job-{i}", "qty": 1} for i in range(3)], RetryPolicy(),
                             now_ms=T)
    clock = FakeClock(T)

    async def send(event: dict, token: int) -> bool:
        clock.now = T - 1  # the clock stepped back: every finish is refused
        return True

    configure("info", "text", stream=captured)
    async with Dispatcher(queue, "d1", send=send, clock=clock, concurrency=3,
                          batch_size=3) as d:
        running = asyncio.create_task(d.run())
        while d.stats.errors < 3 or d.stats.in_flight:
            await asyncio.sleep(0.01)
        d.stop()
        await asyncio.wait_for(running, 20)
    failed = [line for line in captured.getvalue().splitlines() if "finish failed" in line]
    assert failed and all(TEXT_LINE.match(line) and " ERROR " in line for line in failed)
    assert sorted(re.findall(r"job-\d", " ".join(failed))) == ["job-0", "job-1", "job-2"]
    assert all("owner=d1" in line and 'exc="ValueError: clock went backwards' in line
               for line in failed)
    assert "Traceback" not in captured.getvalue()  # below debug: the one-line summary only


def test_json_keeps_the_traceback_inside_its_one_line(captured: io.StringIO):
    configure("warning", "json", stream=captured)
    log = logging.getLogger("asyncworker.test")
    try:
        raise ValueError("two\nlines")
    except ValueError:
        log.exception("it failed\nhere", extra={"id": "j-1", "token": 7, "level": "not mine"})
    log.info("below the level")
    [line] = _json_lines(captured)
    assert (line["msg"], line["id"], line["token"], line["level"]) == (
        "it failed\nhere", "j-1", 7, "error")
    assert line["exc"].startswith("Traceback") and "ValueError: two\nlines" in line["exc"]


def test_text_quotes_values_and_keeps_one_line(captured: io.StringIO):
    configure("info", "text", stream=captured)
    logging.getLogger("asyncworker.test").warning(
        "a message\nover lines", extra={"error": 'said "no" = refused', "empty": "",
                                        "n": 3, "none": None})
    [line] = captured.getvalue().splitlines()
    assert TEXT_LINE.match(line)
    assert line.endswith('a message over lines error="said \\"no\\" = refused" empty="" n=3 '
                         'none=null')


# ---------------------------------------------------------------- the command line


def _job_of(request: Request) -> str:
    """The job's id: the header every request carries (a body event's body is its own)."""
    return {k.lower(): v for k, v in request.headers.items()}["webhook-id"]


def _script() -> Behaviour:
    """retry-me: 503 once, then an ACK; refuse-me: 409; wrong-ack: an ACK of another id."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()  # the server answers each connection on a thread of its own

    def act(request: Request, sock: socket.socket) -> None:
        job = _job_of(request)
        with lock:
            seen[job] += 1
            first = seen[job] == 1
        if job == "refuse-me":
            answer(409, b"no such customer")(request, sock)
        elif job == "wrong-ack":
            ack_for("someone-else")(request, sock)
        elif job == "retry-me" and first:
            answer(503, b"busy")(request, sock)
        else:
            ack_for(job)(request, sock)

    return act


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                          text=True, timeout=60)


def _queue(tmp_path: Path) -> Path:
    queue = tmp_path / "queue.db"
    with open_store(queue, create=True) as store:
        store.enqueue_events([{"id": "retry-me", "qty": 1}, {"id": "refuse-me", "qty": 2},
                              {"id": "fine", "body": {"card": BODY_MARK}}],
                             RetryPolicy(max_attempts=3))
        store.enqueue_events([{"id": "wrong-ack", "qty": 3}], RetryPolicy(max_attempts=1))
    return queue


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_run_logs_each_event_once_with_its_facts(tmp_path: Path, fmt: str):
    queue = _queue(tmp_path)
    with HostileServer(_script()) as server:
        out = _cli("run", str(queue), "--url", server.url, "--until-idle", "--owner", "cli-1",
                   "--lease-ms", "300", "--backoff-base-ms", "10", "--backoff-cap-ms", "10",
                   "--log-format", fmt)
    assert out.returncode == 3, out.stderr  # refuse-me and wrong-ack went dead
    assert BODY_MARK not in out.stderr + out.stdout
    summary = json.loads(out.stdout)
    assert (summary["ok"], summary["retried"], summary["bad_acks"]) == (2, 1, 1)
    if fmt == "text":
        lines = out.stderr.splitlines()
        logged = [line for line in lines if " asyncworker.dispatcher " in line]
        assert logged and all(TEXT_LINE.match(line) for line in logged), logged
        [retry] = [line for line in logged if " retry " in line]
        assert all(f in retry for f in ("id=retry-me", "owner=cli-1", "http_status=503",
                                        "delay_ms=", "token=1", "attempt=1"))
        assert any(line.startswith("run: owner cli-1") for line in lines)  # the banner as ever
        return
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # every line an object
    facts = {(line["msg"], line.get("id")): line for line in lines
             if line["logger"] == "asyncworker.dispatcher"}
    retry = facts[("retry", "retry-me")]
    assert (retry["owner"], retry["http_status"], retry["outcome"], retry["token"]) == (
        "cli-1", 503, "retry", 1)
    dead = facts[("dead", "refuse-me")]
    assert (dead["http_status"], dead["reason"], dead["status"]) == (409, "permanent", "dead")
    bad = facts[("bad ACK", "wrong-ack")]
    assert bad["owner"] == "cli-1" and bad["status"] == "leased" and bad["error"]
    quarantined = facts[("quarantined", None)]  # wrong-ack: out of attempts, lease run out
    assert quarantined["reasons"] == {"exhausted": 1}
    runs = [line for line in lines if line["logger"] == "asyncworker.run"]
    assert runs[0]["msg"].startswith("run: owner cli-1") and runs[0]["owner"] == "cli-1"
    assert runs[-1]["msg"].startswith("summary: ") and runs[-1]["ok"] == 2


def test_every_command_takes_the_log_flags_and_refuses_bad_ones(tmp_path: Path):
    queue = _queue(tmp_path)
    out = _cli("stats", str(queue), "--log-level", "debug", "--log-format", "json")
    assert out.returncode == 0 and out.stderr == ""
    out = _cli("stats", str(queue), "--log-level", "loud")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "invalid choice: 'loud'" in out.stderr
    out = _cli("run", "--help")
    assert out.returncode == 0 and "--log-format {text,json}" in out.stdout
    assert "default info for run" in " ".join(out.stdout.split())


def test_unprintable_characters_are_escaped_in_both_formats(captured: io.StringIO):
    configure("info", "text", stream=captured)
    hostile = "red \x1b[31malert\x1b[0m \ud800 caf\u00e9"
    logging.getLogger("asyncworker.test").warning(hostile, extra={"error": hostile})
    [line] = captured.getvalue().splitlines()
    assert "\x1b" not in line and "\ud800" not in line and "caf\u00e9" in line
    assert "\\x1b[31malert" in line and '\\u001b[31malert' in line  # message, then the field
    configure("info", "json", stream=captured)
    logging.getLogger("asyncworker.test").warning(hostile, extra={"error": hostile})
    last = captured.getvalue().splitlines()[-1]
    assert last.isascii() and json.loads(last)["error"] == hostile


def test_with_json_logs_an_error_and_serves_last_line_are_json_objects(tmp_path: Path):
    """--log-format json: a command's error line and serve's "receiver stopped"
    are objects like every other line; the text format is unchanged."""
    from tests.support.commands import cli
    from tests.support.servers import ReceiverProcess

    missing = str(tmp_path / "missing.db")
    out = cli("stats", missing, "--log-format", "json")
    assert out.returncode == 2
    [line] = out.stderr.splitlines()
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["exit_code"]) == ("error", "asyncworker.stats",
                                                                     2)
    assert entry["msg"] == f"error: queue file not found: {missing}"
    assert cli("stats", missing).stderr == (
        f"asyncworker stats: error: queue file not found: {missing}\n")

    rx = ReceiverProcess(tmp_path / "inbox.db", "--log-format", "json")
    assert rx.stop() == 0
    stopped = json.loads(rx.stderr.splitlines()[-1])
    assert (stopped["msg"], stopped["level"], stopped["logger"]) == (
        "receiver stopped", "info", "asyncworker.receiver")
    rx = ReceiverProcess(tmp_path / "inbox.db")
    assert rx.stop() == 0 and rx.stderr == "receiver stopped\n"
