"""Tier 4: the command line, called the way a user calls it (subprocess)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncworker.cli import demo
from asyncworker.cli.output import SHOW_EACH
from asyncworker.cli.running import CRASH_DRILL
from lease import sqlite as store
from lease import worker
from tests.support.commands import cli
from tests.support.queues import T0, job_rows, run_on_a_terminal
from tests.support.servers import HostileServer, ReceiverProcess, ack_for

COMMANDS = ["init", "enqueue", "run", "serve", "stats", "dead", "inspect", "redrive", "cancel",
            "prune", "prune-inbox", "demo", "bench"]


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_everywhere(command):
    out = cli(*command, "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: asyncworker")


def test_init_creates_and_keeps(tmp_path: Path):
    path = tmp_path / "q.db"
    out = cli("init", str(path))
    assert out.returncode == 0 and "created" in out.stdout and path.is_file()
    assert cli("enqueue", str(path), "--id", "a", "--qty", "1").returncode == 0
    out = cli("init", str(path))
    assert out.returncode == 0 and "kept existing" in out.stdout
    assert list(job_rows(path)) == ["a"]


def test_enqueue_single_duplicate_conflict(queue: Path):
    out = cli("enqueue", str(queue), "--id", "snack-7", "--qty", "7", "--max-attempts", "5")
    assert (out.returncode, out.stdout.strip()) == (0, "1 new, 0 duplicate, 0 conflicting")
    out = cli("enqueue", str(queue), "--id", "snack-7", "--qty", "7")
    assert (out.returncode, out.stdout.strip()) == (0, "0 new, 1 duplicate, 0 conflicting")
    out = cli("enqueue", str(queue), "--id", "snack-7", "--qty", "8")
    assert out.returncode == 1 and "qty 7, not qty 8" in out.stderr
    assert job_rows(queue)["snack-7"]["max_attempts"] == 5


def test_enqueue_bulk_from_file_and_stdin(queue: Path, tmp_path: Path):
    cli("enqueue", str(queue), "--id", "b", "--qty", "2")
    lines = tmp_path / "orders.jsonl"
    lines.write_text('{"id": "a", "qty": 1}\n\n{"id": "b", "qty": 3}\n{"id": "c", "qty": 4}\n')
    out = cli("enqueue", str(queue), "--file", str(lines))
    assert out.returncode == 1
    assert out.stdout.strip() == "0 new, 0 duplicate, 1 conflicting"
    assert out.stderr.count("conflict:") == 1 and "line 3: conflict: job 'b'" in out.stderr
    assert sorted(job_rows(queue)) == ["b"]  # a conflict, and nothing of the file
    out = cli("enqueue", str(queue), "--file", str(lines), "--skip-conflicts")
    assert out.returncode == 1
    assert out.stdout.strip() == "2 new, 0 duplicate, 1 conflicting"
    out = cli("enqueue", str(queue), "--file", "-", stdin='{"id": "c", "qty": 4}\n'
                                                          '{"id": "d", "qty": 5}\n')
    assert (out.returncode, out.stdout.strip()) == (0, "1 new, 1 duplicate, 0 conflicting")
    assert sorted(job_rows(queue)) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("lines", ['{"id": "x", "qty": 1}\nnot json\n',
                                   '{"id": "x", "qty": 1}\n{"id": "y", "qty": true}\n',
                                   '{"id": "x", "qty": 1, "z": 0}\n',
                                   '[1, 2]\n'])
def test_enqueue_bulk_is_all_or_nothing_on_bad_lines(queue: Path, lines: str):
    before = queue.read_bytes()
    out = cli("enqueue", str(queue), "--file", "-", stdin=lines)
    assert out.returncode == 2 and "nothing was enqueued" in out.stderr
    assert queue.read_bytes() == before


BAD_USAGE = [
    (["enqueue", "{missing}", "--id", "a", "--qty", "1"], "queue file not found"),
    (["enqueue", "{queue}", "--id", "bad id", "--qty", "1"], "--id"),
    (["enqueue", "{queue}", "--id", "a\n", "--qty", "1"], "--id"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "0"], "--qty"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "1001"], "--qty"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "true"], "--qty"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "1.0"], "--qty"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "1", "--ttl-ms", "0"], "--ttl-ms"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "1", "--max-attempts", "101"],
     "--max-attempts"),
    (["enqueue", "{queue}", "--id", "a"], "goes with one of --qty or --body"),
    (["enqueue", "{queue}"], "either"),
    (["enqueue", "{queue}", "--id", "a", "--qty", "1", "--bogus"], "unrecognized"),
    (["enqueue", "{queue}", "--file", "{missing}"], "file not found"),
    (["run", "{missing}", "--url", "http://127.0.0.1:9/events"], "queue file not found"),
    (["run", "{queue}", "--url", "http://10.0.0.1:9/events"], "loopback"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events#top"], "fragment"),
    (["run", "{queue}", "--url", "gopher://127.0.0.1:9/events"], "https://"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--concurrency", "0"],
     "--concurrency"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--lease-ms", "0"], "--lease-ms"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--owner", "no way"], "--owner"),
    (["run", "{queue}"], "--url"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--batch-size", "0"],
     "--batch-size"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--prefetch", "-1"],
     "--prefetch"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--send-timeout", "4d"],
     "--send-timeout must be 1 ms up to the retry budget, a job's time to live "
     "(259200000 = 3d ms), got 345600000 ms"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--send-timeout", "0"],
     "--send-timeout must be 1 ms up to"),
    (["run", "{queue}", "--url", "http://127.0.0.1:9/events", "--send-timeout", "soon"],
     "--send-timeout"),
    (["stats", "{missing}"], "queue file not found"),
    (["dead", "{queue}", "--reason", "bad reason"], "--reason"),
    (["dead", "{queue}", "--reason", "bogus"], "must be one of deadline, exhausted, permanent"),
    (["redrive", "{queue}", "--reason", "bogus", "--note", "fix"], "must be one of"),
    (["enqueue", "{queue}", "--file", "{tmp}"], "not a file"),
    (["serve", "--inbox", "{tmp}"], "directory"),
    (["serve", "--inbox", "{tmp}/no/such/folder/i.db"], "folder does not exist"),
    (["serve", "--inbox", "{foreign}"], "not an inbox file"),
    (["serve", "--inbox", "{queue}"], "not an inbox file"),
    (["inspect", "{queue}", "bad id!"], "id"),
    (["redrive", "{queue}", "a", "--note", "bad\tnote"], "--note"),
    (["redrive", "{queue}", "--note", "fix"], "either"),
    (["redrive", "{queue}", "a", "--reason", "deadline", "--note", "fix"], "either"),
    (["redrive", "{queue}", "a", "--note", "fix", "--dry-run"], "go with --reason"),
    (["stats", "{foreign}"], "not a queue file"),
    (["bogus"], "invalid choice"),
    (["serve", "--inbox", "{tmp}/i.db", "--host", "0.0.0.0"], "--secret-file"),
    (["serve", "--inbox", "{tmp}/i.db", "--p-drop", "2"], "--p-drop"),
    (["demo", "--jobs", "0"], "--jobs"),
    (["demo", "--keep", "{queue}"], "new or empty folder"),
    (["init", "{tmp}/no/such/folder/q.db"], "folder not found"),
]


@pytest.mark.parametrize(("args", "message"), BAD_USAGE, ids=[" ".join(a) for a, _ in BAD_USAGE])
def test_bad_usage_exits_2_with_one_line_and_changes_nothing(queue, tmp_path, args, message):
    import sqlite3

    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE t (x)")
    con.close()
    con = worker.open_queue(queue)
    worker.enqueue(con, {"id": "a", "qty": 1}, T0, 1000)
    con.close()
    before = queue.read_bytes()
    names = {"queue": str(queue), "missing": str(tmp_path / "missing.db"),
             "foreign": str(foreign), "tmp": str(tmp_path)}
    listing = sorted(p.name for p in tmp_path.iterdir())
    out = cli(*[a.format(**names) for a in args])
    assert out.returncode == 2, out
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert queue.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # nothing created


def test_run_until_idle_stats_dead_inspect_redrive(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"o-{n}", "qty": n + 1}) + "\n" for n in range(20))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    # One job with a deadline in the past: claim quarantines it as dead/deadline.
    con = worker.open_queue(queue, create=False)
    worker.enqueue(con, {"id": "late", "qty": 3}, T0, 1)
    con.close()
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", "--owner", "cli-1",
                  "--concurrency", "4")
        assert out.returncode == 3, out.stderr  # 3: some jobs went dead in this run
        summary = json.loads(out.stdout)
        assert (summary["owner"], summary["ok"], summary["claimed"]) == ("cli-1", 20, 20)
        assert (summary["dead"], summary["quarantined"]) == (1, 1)
        assert summary["dead_by_reason"] == {"deadline": 1, "exhausted": 0, "permanent": 0}
        assert summary["peak_sending"] <= 4 and "peak_in_flight" not in summary
        # plain lines when not a terminal; every death counted, by reason
        assert "summary: done 20  retried 0  dead 1 (deadline:1)" in out.stderr

        out = cli("stats", str(queue), "--json", "--receiver", rx.url)
        snap = json.loads(out.stdout)
        assert snap["by_status"] == {"pending": 0, "leased": 0, "done": 20, "dead": 1}
        assert snap["dead_by_reason"] == {"deadline": 1}
        assert snap["receiver"]["applied"] == 20 and snap["receiver"]["stock"] == 210
        out = cli("stats", str(queue))
        assert out.returncode == 0 and "dead by reason" in out.stdout and "deadline:1" in out.stdout

        out = cli("dead", str(queue), "--reason", "deadline")
        assert out.returncode == 0 and "late" in out.stdout and "1 dead" in out.stderr
        assert "late" not in cli("dead", str(queue), "--reason", "exhausted").stdout

        out = cli("redrive", str(queue), "--reason", "deadline", "--note", "fixed", "--dry-run")
        assert out.returncode == 0 and "would redrive late" in out.stdout
        assert job_rows(queue)["late"]["status"] == "dead"
        out = cli("redrive", str(queue), "--reason", "deadline", "--note", "fixed")
        assert out.returncode == 0 and "1 redriven, 0 refused" in out.stdout
        out = cli("redrive", str(queue), "late", "--note", "again")
        assert out.returncode == 1 and "pending, not dead" in out.stderr

        out = cli("inspect", str(queue), "late", "--json")
        history = json.loads(out.stdout)
        assert history["job"]["status"] == "pending"
        assert [(r["note"], r["token"]) for r in history["redrives"]] == [("fixed", 0)]
        assert cli("inspect", str(queue), "nope").returncode == 1

        out = cli("run", str(queue), "--url", rx.url, "--until-idle", "--batch-size", "1",
                  "--prefetch", "0")
        assert out.returncode == 0 and json.loads(out.stdout)["ok"] == 1  # 0: none went dead
        assert json.loads(out.stdout)["dead"] == 0
    assert job_rows(queue)["late"]["status"] == "done"


@pytest.mark.parametrize(("flags", "ok"), [(["--send-timeout", "3s"], 1), ([], 0)])
def test_run_send_timeout_outlasts_the_lease(queue: Path, flags: list, ok: int):
    """A receiver that answers after three leases: with --send-timeout the one
    request ends in an ACK, its lease extended meanwhile; without it the send
    ends within its lease, a timeout."""
    assert cli("enqueue", str(queue), "--id", "slow", "--qty", "1",
               "--max-attempts", "1").returncode == 0

    def slow(request, sock) -> None:
        time.sleep(0.9)
        ack_for()(request, sock)

    with HostileServer(slow) as server:
        out = cli("run", str(queue), "--url", server.url, "--until-idle", "--lease-ms", "300",
                  *flags)
    summary = json.loads(out.stdout)
    assert (summary["ok"], summary["dead"], len(server.requests)) == (ok, 1 - ok, 1), out.stderr
    assert out.returncode == (0 if ok else 3)
    assert summary["extended"] >= (3 if ok else 0)


def test_run_to_any_path_on_loopback_and_serve_on_that_path(queue: Path, tmp_path: Path):
    """The path is the operator's (/hooks/orders), on the receiver and the dispatcher
    alike; stats finds the receiver's /stats at its root."""
    lines = "".join(json.dumps({"id": f"order:{n}", "body": {"n": n}}) + "\n" for n in range(5))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db", "--path", "/hooks/orders") as rx:
        assert rx.url.endswith("/hooks/orders")
        out = cli("run", str(queue), "--url", rx.url, "--until-idle")
        assert out.returncode == 0, out.stderr
        assert f"url {rx.url} (ack echo-id, unsigned)" in out.stderr  # the banner
        snap = json.loads(cli("stats", str(queue), "--json", "--receiver", rx.url).stdout)
        assert snap["receiver"]["applied"] == 5 and snap["by_status"]["done"] == 5


def test_a_plain_ok_receiver_is_delivered_under_status_and_a_bad_ack_under_echo_id(
        queue: Path, tmp_path: Path):
    """An ordinary webhook receiver answers 200 "OK" in plain text: under --ack status
    that is a delivery; under echo-id it proves nothing, and the job ends dead."""
    from tests.support.servers import HostileServer, answer

    for n in (1, 2):
        assert cli("enqueue", str(queue), "--id", f"order:{n}", "--body", "{}").returncode == 0
    with HostileServer(answer(200, b"OK", {"Content-Type": "text/plain"})) as server:
        url = f"http://127.0.0.1:{server.port}/webhooks/orders"
        out = cli("run", str(queue), "--url", url, "--until-idle", "--ack", "status")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ok"] == 2
        assert {r.line for r in server.requests} == {"POST /webhooks/orders HTTP/1.1"}

        assert cli("enqueue", str(queue), "--id", "order:3", "--body", "{}", "--max-attempts",
                   "2").returncode == 0
        out = cli("run", str(queue), "--url", url, "--until-idle", "--lease-ms", "300",
                  "--backoff-base-ms", "1", "--backoff-cap-ms", "10")
        assert out.returncode == 3, out.stderr  # a job went dead in this run
        summary = json.loads(out.stdout)
        assert summary["ok"] == 0 and summary["bad_acks"] == 2
        assert summary["dead_by_reason"]["exhausted"] == 1


def test_sigint_during_run_stops_gracefully(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"s-{n}", "qty": 1}) + "\n" for n in range(300))
    cli("enqueue", str(queue), "--file", "-", stdin=lines)
    with ReceiverProcess(tmp_path / "inbox.db", "--latency-ms", "30") as rx:
        proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "run", str(queue),
                                 "--url", rx.url, "--concurrency", "8"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while rx.stats()["applied"] < 20 and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopping" in err and "Traceback" not in err
    rows = job_rows(queue).values()
    assert not [r for r in rows if r["status"] == "leased"]
    assert json.loads(out)["ok"] == sum(r["status"] == "done" for r in rows) < 300


def test_demo_end_to_end_leaves_nothing_behind(tmp_path: Path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = cli("demo", "--jobs", "80", "--concurrency", "8", env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "consistent: 81 orders" in out.stdout and " BAD " not in out.stdout
    assert "dispatcher-1 exit" in out.stdout and "duplicates absorbed" in out.stdout
    headline = next(line for line in out.stdout.splitlines() if "ACKed before the SIGKILL" in line)
    assert re.search(r"ok  the job ACKed before the SIGKILL +snack-[0-9]{5}: [2-9] arrivals, "
                     r"tokens 1 and [2-9]", headline), headline
    assert list(scratch.iterdir()) == []  # the temporary folder is gone
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                 and str(scratch) in _cmdline(p)]
    assert leftovers == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_demo_keep_keeps_the_files(tmp_path: Path):
    keep = tmp_path / "kept"
    out = cli("demo", "--jobs", "30", "--keep", str(keep))
    assert out.returncode == 0, out.stdout + out.stderr
    assert {"queue.db", "inbox.db", "receiver.log", "dispatcher-1.log"} <= {
        p.name for p in keep.iterdir()}


def _consistent_evidence() -> dict:
    """Three orders; the killed job ``a`` arrived twice; one answer was dropped
    (and resent: the second duplicate)."""
    return {
        "orders": 3, "qty_enqueued": 6, "inbox_rows": 3, "inbox_seen": 5, "stock": 6,
        "receiver": {"process_requests": 5, "applied": 3, "duplicates": 2, "conflicts": 0,
                     "stale_senders": 0, "process_rejected": 0, "process_too_large": 0,
                     "process_timed_out": 0, "process_incomplete": 0,
                     "process_injected_503": 0, "process_unavailable": 0,
                     "process_dropped_after_commit": 1},
        "by_status": {"pending": 0, "leased": 0, "done": 3, "dead": 0}, "dead_by_reason": {},
        "redrives": 1, "max_token": 2, "done_not_in_inbox": [], "in_inbox_not_done": [],
        "qty_mismatches": [], "dispatcher_1_exit": -9, "dispatcher_2_exit": 0,
        "dispatcher_2_redrive_pass_exit": 0, "receiver_exit": 0,
        "leased_when_dispatcher_1_died": 2,
        "killed": {"id": "a", "token": 1, "arrivals": 2, "inbox_token": 2, "status": "done",
                   "done_token": 2, "done_by": "dispatcher-2", "recorded": 0},
        "inbox_max_token": 2, "token_mismatches": [], "inbox_stale": 0, "stale_finishes": 0,
        "connection_failures": 1,
    }


def _changed(**receiver: object) -> dict:
    return {"receiver": {**_consistent_evidence()["receiver"], **receiver}}


def _killed(**killed: object) -> dict:
    return {"killed": {**_consistent_evidence()["killed"], **killed}}


KILLED = "the job ACKed before the SIGKILL"
# Each piece of evidence broken alone, and the one row that must say so.
BROKEN_EVIDENCE = [
    ({"killed": None}, KILLED),  # the drill never named its job
    (_killed(arrivals=1), KILLED),  # the 3 % drops' duplicates alone are no proof
    (_killed(recorded=1), KILLED),  # the ACK it died with was recorded after all
    (_killed(status="leased"), KILLED),
    (_killed(done_by="dispatcher-1"), KILLED),
    (_killed(done_token=1, inbox_token=1), KILLED),  # never sent again
    (_killed(inbox_token=3), KILLED),  # the inbox saw a later send than the one done
    (_changed(process_requests=6), "requests the receiver saw"),
    ({**_changed(applied=2, process_injected_503=1), "inbox_seen": 4},
     "applied (new inbox rows)"),
    ({**_changed(process_dropped_after_commit=2), "connection_failures": 2},
     "duplicates absorbed"),  # a dropped answer that was never sent again
    ({"connection_failures": 2}, "answers dropped after commit"),  # more than were dropped
    ({"connection_failures": 0, "leased_when_dispatcher_1_died": 0},
     "answers dropped after commit"),  # none on record, and none could die unrecorded
    ({"inbox_stale": 1}, "stale senders absorbed"),
    ({**_changed(stale_senders=1, process_requests=6), "inbox_stale": 1,
      "leased_when_dispatcher_1_died": 0}, "stale senders absorbed"),  # no stale finish
    (_changed(conflicts=1, process_requests=6), "conflicts / rejected"),
    ({"inbox_rows": 2}, "inbox rows"),
    ({"inbox_seen": 4}, "inbox arrivals (rows x times seen)"),
    ({"stock": 7}, "stock"),
    ({"by_status": {"pending": 1, "leased": 0, "done": 2, "dead": 0}}, "jobs by status"),
    ({"dead_by_reason": {"deadline": 1}}, "dead by reason (now)"),
    ({"redrives": 0}, "redrives (audit rows)"),
    ({"done_not_in_inbox": ["a"]}, "done but not in the inbox"),
    ({"in_inbox_not_done": ["a"]}, "in the inbox but not done"),
    ({"qty_mismatches": ["a"]}, "quantity mismatches"),
    ({"max_token": 1}, "highest claim token"),
    ({"inbox_max_token": 3}, "highest claim token"),
    ({"token_mismatches": ["b"]}, "done at a token the inbox did not see last"),
    ({"dispatcher_1_exit": 0}, "dispatcher-1 exit"),
    ({"dispatcher_2_exit": 1}, "dispatcher-2 exit"),
    ({"dispatcher_2_redrive_pass_exit": 1}, "redrive pass exit"),
    ({"receiver_exit": 1}, "receiver exit on SIGTERM"),
]


def test_the_consistent_evidence_is_consistent():
    assert [c.label for c in demo.check_evidence(_consistent_evidence()) if not c.ok] == []


def test_every_row_of_the_evidence_can_fail():
    """No row is a constant: each is broken by some piece of evidence below."""
    rows = {c.label.strip() for c in demo.check_evidence(_consistent_evidence())}
    assert rows == {label for _, label in BROKEN_EVIDENCE}


@pytest.mark.parametrize(("change", "label"), BROKEN_EVIDENCE,
                         ids=[f"{n}-{label}" for n, (_, label) in enumerate(BROKEN_EVIDENCE)])
def test_the_demo_exits_non_zero_on_each_broken_piece_of_evidence(
        change, label, monkeypatch, capsys, tmp_path: Path):
    evidence = {**_consistent_evidence(), **change}
    monkeypatch.setattr(demo, "tell_the_story", lambda *args: evidence)
    assert demo.run_demo(keep=str(tmp_path / "kept")) == 1
    shown = capsys.readouterr().out
    assert "INCONSISTENT: 1 piece(s)" in shown
    [bad] = [line for line in shown.splitlines() if line.startswith("  BAD ")]
    assert bad[len("  BAD "):].strip().startswith(label)


def test_the_demo_exits_zero_on_consistent_evidence(monkeypatch, capsys, tmp_path: Path):
    monkeypatch.setattr(demo, "tell_the_story", lambda *args: _consistent_evidence())
    assert demo.run_demo(keep=str(tmp_path / "kept")) == 0
    assert "consistent: 3 orders" in capsys.readouterr().out


def test_the_crash_drill_names_its_job_for_the_evidence(tmp_path: Path):
    log = tmp_path / "dispatcher-1.log"
    log.write_text("run: owner dispatcher-1\n"
                   f"{CRASH_DRILL} snack-00042 token 3, before recording it\n")
    assert demo.last_ack(log) == {"id": "snack-00042", "token": 3}
    log.write_text("run: owner dispatcher-1\n")
    assert demo.last_ack(log) is None


@pytest.mark.timeout(300)  # the receiver and each client on one core of their own
def test_bench_quick_smoke():
    """The benchmark runs end to end and prints its table (figures are not judged)."""
    from asyncworker.bench.measure import placement, split_cpus

    out = cli("bench", "--quick", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| scenario") and len(table) >= 15
    assert any("durable commit" in line for line in table)
    assert any("async vs receiver c256, 50 ms" in line for line in table)
    # the receiver's limit is the cheapest client's: the dispatcher's own, no queue
    assert any("receiver limit, wire client c64 (no queue), 0 ms" in line for line in table)
    assert any("bulk redrive, 2,000 dead jobs" in line for line in table)
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:3] == ["scenario", "jobs/s", "CPU us/job"]
    in_process = next(line for line in table if "async in-process, batch 64" in line)
    assert float(in_process.split("|")[3].replace(",", "")) > 0  # CPU per job, measured
    # the paired CPU table follows, with the wire client beside the dispatcher
    assert any(line.startswith("| case | receiver limit/s") for line in table)
    assert any(line.startswith("| c64, 0 ms |") for line in table)
    # where the rows found each receiver and its clients: apart, in both tables
    halves = split_cpus()
    assert halves is not None
    where = placement(*halves)
    placed = [line for line in out.stdout.splitlines() if line.startswith("machine: ")]
    assert len(placed) == 2 and all(line.endswith(f"receiver: {where}")
                                    or f"; {where}; " in line for line in placed), placed


def test_bench_checks_its_store_before_it_runs():
    out = cli("bench", "--no-pin", "--store", "mysql://nowhere")
    assert out.returncode == 2 and "--store must be a postgresql:// URL" in out.stderr


def test_run_on_a_terminal_draws_one_live_line(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"t-{n}", "qty": 1}) + "\n" for n in range(30))
    cli("enqueue", str(queue), "--file", "-", stdin=lines)
    with ReceiverProcess(tmp_path / "inbox.db", "--latency-ms", "25") as rx:
        proc, text = run_on_a_terminal(
            [sys.executable, "-m", "asyncworker", "run", str(queue), "--url", rx.url,
             "--until-idle", "--concurrency", "1"])
    assert proc.returncode == 0
    assert "\r\x1b[2K" in text  # redrawn in place, not scrolled
    assert text.count("\r\x1b[2K") >= 2 and "done 30" in text
    assert "summary:" not in text  # the plain-log form is for pipes and files


def test_run_refuses_a_foreign_file_before_anything_runs(tmp_path: Path):
    import sqlite3

    foreign = tmp_path / "app.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (name TEXT)")
    con.commit()
    con.close()
    before = foreign.read_bytes()
    out = cli("run", str(foreign), "--url", "http://127.0.0.1:9/events", "--until-idle")
    assert out.returncode == 2 and "not a queue file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and foreign.read_bytes() == before


# ------------------------------------------------------------------ exit codes, version


def test_every_exit_code_is_documented_in_the_module_the_help_and_the_readme():
    from asyncworker import cli as module

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    helps = [cli("--help").stdout, cli("run", "--help").stdout, cli("stats", "--help").stdout]
    for text in [module.__doc__ or "", readme, *helps]:
        for code, words in [("0", "done"), ("1", "failed"), ("2", "bad usage"),
                            ("3", "went dead")]:
            assert re.search(rf"\b{code}\b[^\n]*{words}", text), (code, text[:200])


def test_version_from_the_package_metadata():
    from importlib import metadata

    out = cli("--version")
    version = metadata.version("lease-dispatcher")
    assert (out.returncode, out.stdout) == (0, f"asyncworker {version}\n")


def test_version_falls_back_when_the_package_is_not_installed(tmp_path: Path):
    import shutil

    root = Path(__file__).resolve().parents[2]
    for package in ("asyncworker", "lease"):  # a source tree with no installed metadata
        shutil.copytree(root / package, tmp_path / package)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from asyncworker.cli import main; "
            "raise SystemExit(main(['--version']))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (
        0, "asyncworker unknown (not installed)\n", "")


def test_a_file_name_that_is_not_utf8_is_printed_escaped(tmp_path: Path):
    name = os.fsencode(tmp_path) + b"/caf\xe9.db"
    out = subprocess.run([sys.executable, "-m", "asyncworker", "init", name],
                         capture_output=True, timeout=60)
    assert out.returncode == 0 and out.stderr == b""
    assert b"caf\\udce9.db (schema version" in out.stdout and os.path.isfile(name)


# ------------------------------------------------------------------ JSON lines input


def test_a_utf8_bom_and_crlf_lines_are_accepted(queue: Path, tmp_path: Path):
    lines = tmp_path / "orders.jsonl"
    lines.write_bytes(b'\xef\xbb\xbf{"id": "a", "qty": 1}\r\n{"id": "b", "qty": 2}\r\n')
    out = cli("enqueue", str(queue), "--file", str(lines))
    assert (out.returncode, out.stdout.strip()) == (0, "2 new, 0 duplicate, 0 conflicting")
    assert {k: r["qty"] for k, r in job_rows(queue).items()} == {"a": 1, "b": 2}


@pytest.mark.parametrize(("data", "message"), [
    (b'{"id": "a", "qty": 1}\n{"id": "b\xff", "qty": 1}\n', "line 2: not UTF-8 (byte 0xff"),
    (b'{"id": "a", "qty": 1, "qty": 2}\n', "line 1: duplicate key"),
    (b'{"id": "a", "qty": NaN}\n', "line 1: NaN is not valid JSON"),
])
def test_bad_bytes_name_their_line(queue: Path, tmp_path: Path, data: bytes, message: str):
    lines = tmp_path / "orders.jsonl"
    lines.write_bytes(data)
    before = queue.read_bytes()
    out = cli("enqueue", str(queue), "--file", str(lines))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1 and queue.read_bytes() == before


def test_file_from_a_shell_pipe(queue: Path):
    """`--file <(...)`: bash hands over /dev/fd/63, a pipe, not a regular file."""
    script = '"$0" -m asyncworker enqueue "$1" --file <(printf "%s\\n" "$2" "$3")'
    out = subprocess.run(["bash", "-c", script, sys.executable, str(queue),
                          '{"id": "p-1", "qty": 1}', '{"id": "p-2", "qty": 2}'],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "2 new, 0 duplicate, 0 conflicting")
    assert sorted(job_rows(queue)) == ["p-1", "p-2"]


def test_file_from_a_fifo(queue: Path, tmp_path: Path):
    import threading

    fifo = tmp_path / "orders.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as pipe:  # blocks until the command opens the other end
            pipe.write(b"".join(b'{"id": "f-%d", "qty": 1}\n' % n for n in range(500)))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    out = cli("enqueue", str(queue), "--file", str(fifo), timeout=60)
    writer.join(timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "500 new, 0 duplicate, 0 conflicting")
    assert len(job_rows(queue)) == 500


# ------------------------------------------------------------------ bulk redrive


def _dead_queue(path: Path, jobs: int) -> None:
    """`jobs` dead/deadline jobs, written in one executemany (not via the CLI)."""
    store.open_store(path).close()
    con = sqlite3.connect(path)
    try:
        con.executemany(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
            " deadline, reason) VALUES (?, 1, 'dead', 3, 3, 3, ?, ?, 'deadline')",
            ((f"d-{n}", T0, T0 + 1) for n in range(jobs)))
        con.commit()
    finally:
        con.close()


def _change_counter(path: Path) -> int:
    """The header's file change counter: one step per committed write transaction
    (in rollback-journal mode)."""
    return int.from_bytes(path.read_bytes()[24:28], "big")


def test_bulk_redrive_writes_many_jobs_per_transaction(tmp_path: Path):
    jobs = 20_000
    path = tmp_path / "queue.db"
    _dead_queue(path, jobs)
    before = _change_counter(path)
    started = time.monotonic()
    out = cli("redrive", str(path), "--reason", "deadline", "--note", "replay")
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert _change_counter(path) - before == -(-jobs // worker.MAX_BATCH)  # 2, not 20,000
    assert elapsed < 30  # generous: one transaction per job took 58 s for these here
    lines = out.stdout.splitlines()
    assert lines[-1] == f"{jobs} redriven, 0 refused"
    assert len(lines) == SHOW_EACH + 2 and "--verbose" in lines[-2]  # bounded
    con = worker.open_queue(path, create=False)
    try:
        assert con.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM redrives").fetchone() == (
            jobs, jobs)
        assert con.execute("SELECT COUNT(*) FROM jobs WHERE status = 'pending'"
                           " AND attempts = 0 AND reason IS NULL").fetchone()[0] == jobs
    finally:
        con.close()


def test_bulk_redrive_lists_each_job_when_asked(tmp_path: Path):
    path = tmp_path / "queue.db"
    _dead_queue(path, 30)
    out = cli("redrive", str(path), "--reason", "deadline", "--note", "x", "--dry-run")
    assert out.stdout.splitlines()[-1] == "30 to redrive (dry run, nothing changed)"
    assert out.stdout.count("would redrive") == SHOW_EACH
    out = cli("redrive", str(path), "--reason", "deadline", "--note", "x", "--verbose")
    assert out.returncode == 0 and out.stdout.count("redrove d-") == 30


def test_a_job_named_double_dash(queue: Path):
    """"--" is a valid identifier; argparse 3.11 turned it into an empty list."""
    out = cli("enqueue", str(queue), "--id=--", "--qty=7")
    assert (out.returncode, out.stdout.strip()) == (0, "1 new, 0 duplicate, 0 conflicting")
    out = cli("inspect", str(queue), "--json", "--", "--")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["job"]["id"] == "--"
