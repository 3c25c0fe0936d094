"""Tier 4: how ``asyncworker run`` ends, called the way a user calls it
(subprocess): idle with keys blocked behind a dead job, aborted by a second
signal, and the rate its summary reports."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.commands import cli
from tests.support.queues import job_rows
from tests.support.servers import HostileServer, ReceiverProcess, Request, ack_for, answer
from tests.support.waiting import wait_until


def _refuse_a1(request: Request, sock) -> None:
    """422 for the head of custA (a refusal for good: it goes dead), an ACK for the rest."""
    job_id = request.headers["webhook-id"]
    if job_id == "a-1":
        answer(422, b"{}", {"Content-Type": "application/json"})(request, sock)
    else:
        ack_for(job_id)(request, sock)


def test_until_idle_ends_when_all_that_is_left_waits_behind_a_dead_head(queue: Path):
    """Idle: nothing claimable now or later without an operator. custA's head is
    dead (the receiver answered 422), so the two jobs behind it wait for a
    redrive or a cancel: the run ends, exit 3, and names the key and its head."""
    lines = "".join(json.dumps({"id": job_id, "body": {}, **({"key": key} if key else {})})
                    + "\n" for job_id, key in (("a-1", "custA"), ("a-2", "custA"),
                                               ("a-3", "custA"), ("free-1", None)))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with HostileServer(_refuse_a1) as server:
        started = time.monotonic()
        out = cli("run", str(queue), "--url", server.url, "--until-idle", "--poll-ms", "10",
                  timeout=60)
        assert time.monotonic() - started < 30
    assert out.returncode == 3, out.stderr
    summary = json.loads(out.stdout)
    assert summary["blocked_heads"] == [{"key": "custA", "id": "a-1", "reason": "permanent",
                                         "waiting": 2}]
    assert (summary["ok"], summary["dead"]) == (1, 1)
    assert "idle: 1 ordering key blocked by a dead job" in out.stderr
    assert "custA (dead head a-1, permanent; 2 waiting)" in out.stderr
    rows = job_rows(queue)
    assert [rows[i]["status"] for i in ("a-1", "a-2", "a-3", "free-1")] == [
        "dead", "pending", "pending", "done"]

    # --log-format json: the same facts as keys of the line
    out = cli("run", str(queue), "--url", server.url, "--until-idle", "--log-format", "json",
              timeout=60)
    assert out.returncode == 3, out.stderr
    idle = [json.loads(line) for line in out.stderr.splitlines()
            if json.loads(line)["msg"].startswith("idle:")]
    assert [one["blocked_heads"][0]["id"] for one in idle] == ["a-1"]


def test_until_idle_with_nothing_blocked_still_exits_0(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"k-{n}", "body": {}, "key": "custB"}) + "\n"
                    for n in range(3))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["blocked_heads"] == [] and "idle:" not in out.stderr


@contextlib.contextmanager
def _running(queue: Path, url: str, *args: str) -> Iterator[subprocess.Popen]:
    """``asyncworker run QUEUE --url URL ARGS`` as a child process, killed if a test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "run", str(queue), "--url",
                             url, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    with proc:
        try:
            yield proc
        finally:
            proc.kill()


def _wait_for_line(proc: subprocess.Popen, words: str) -> list[str]:
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if words in line:
            return seen
    raise AssertionError(f"no line with {words!r}: {''.join(seen)}")


def test_a_second_signal_aborts_exits_130_and_names_the_leases_left(queue: Path,
                                                                   tmp_path: Path):
    """The first SIGTERM drains; the second aborts: the sends in flight are cut
    off and their jobs stay leased. An interrupted run exits 130 (not 0) and its
    summary names each lease it left to run out."""
    lines = "".join(json.dumps({"id": f"s-{n}", "qty": 1}) + "\n" for n in range(40))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db", "--latency-ms", "60000") as rx, \
            _running(queue, rx.url, "--concurrency", "16") as proc:
        _wait_for_line(proc, "run: owner")  # the signals are handled from here
        wait_until(lambda: sum(r["status"] == "leased" for r in job_rows(queue).values())
                   >= 16, "16 sends in flight", 60)
        proc.send_signal(signal.SIGTERM)
        _wait_for_line(proc, "stopping")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    summary = json.loads(out)
    leased = {(r["id"], r["token"]) for r in job_rows(queue).values() if r["status"] == "leased"}
    assert len(leased) >= 16 and summary["in_flight"] == 0
    assert {(one["id"], one["token"]) for one in summary["leases_left"]} == leased
    assert summary["left_leased"] == len(leased)
    assert f"aborted: {len(leased)} jobs left leased" in err and "Traceback" not in err
    assert re.search(rf"left leased {len(leased)}\b", err)
    for job_id, token in sorted(leased)[:20]:
        assert f"{job_id}/{token}" in err


def test_the_summary_says_the_runs_real_rate(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"r-{n}", "qty": 1}) + "\n" for n in range(300))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", timeout=60)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["ok"] == 300 and summary["seconds"] > 0
    assert abs(summary["rate"] - 300 / summary["seconds"]) <= 0.1 + 0.01 * summary["rate"]
    found = re.search(r"summary: .* rate ([0-9]+)/s", out.stderr)
    # the line shows the rate to the unit, the JSON to a tenth: 3792.54 reads 3793 and 3792.5
    assert found and abs(int(found.group(1)) - summary["rate"]) <= 0.55, out.stderr
    assert int(found.group(1)) > 0


def test_plain_http_refused_names_the_flag_not_the_argument(queue: Path):
    """The command line says what the command line allows: its flag, where it
    has one, never the Python argument."""
    for args in (["run", str(queue), "--url"], ["stats", str(queue), "--receiver"],
                 ["ui", str(queue), "--port", "0", "--receiver"]):
        out = cli(*args, "http://orders.example/hooks", timeout=30)
        assert out.returncode == 2 and "plain http only to a loopback host" in out.stderr
        assert "insecure_http" not in out.stderr, out.stderr
        assert "or --insecure-plain-http to send in the clear" in out.stderr, out.stderr


def test_inspect_and_dead_show_the_ordering_key_and_the_actor(queue: Path):
    """What the JSON has, the text shows: a job's ordering key, who made each
    audit row; dead lists the key as a column and gives JSON too."""
    from lease.records import Attempt
    from lease.stores import open_store
    from tests.support.queues import T0

    with open_store(queue) as store:
        store.enqueue_events([{"id": "a-1", "body": {}, "key": "custA"},
                              {"id": "a-2", "body": {}, "key": "custA"}], now_ms=T0)
        for n, actor in enumerate(("alice", None)):
            ticket = store.claim_jobs("w", 1000, 1, now_ms=T0 + 10 * n).leased[0].ticket
            store.finish_jobs([(ticket, "permanent", 0, Attempt(T0, 3, 422, None))],
                              now_ms=T0 + 10 * n + 1)
            if actor:
                assert store.redrive_jobs(["a-1"], 60_000, "try again", actor=actor,
                                          now_ms=T0 + 5) == [True]
    out = cli("inspect", str(queue), "a-1")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^key +custA$", out.stdout, re.M), out.stdout
    redrives = out.stdout.split("redrives: 1\n")[1]
    assert re.search(r"^token +at +note +actor$", redrives, re.M)
    assert re.search(r"try again +alice$", redrives, re.M), redrives

    out = cli("dead", str(queue))
    header, row = out.stdout.splitlines()
    assert header.split()[:3] == ["id", "key", "qty"] and row.split()[:2] == ["a-1", "custA"]
    assert row.split()[-2:] == ["HTTP", "422"]
    out = cli("dead", str(queue), "--json")
    assert out.returncode == 0, out.stderr
    [dead] = json.loads(out.stdout)
    assert (dead["id"], dead["ordering_key"], dead["last_error"]) == ("a-1", "custA", "HTTP 422")
