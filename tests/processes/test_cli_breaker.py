"""Tier 4: an endpoint's circuit breaker and its recovery on the command line,
each a real ``asyncworker`` child process on a real queue file: ``endpoint
recover`` (a dry run with a count and a fingerprint, then exactly that set
sent again with its audit rows, or refused when the set changed), the
circuit in ``endpoint show``, ``endpoint list`` and ``stats`` (an open one
with its why, an automatic disable named as one), ``--disable-after`` and
``run --no-endpoint-label``. The breaker is made to open through the store's
own API (failed attempts finished as a dispatcher finishes them)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.stores import open_store
from tests.support.commands import cli
from tests.support.waiting import wait_until

URL = "http://127.0.0.1:9/hooks"
HOUR = 3_600_000
POLICY = RetryPolicy(max_attempts=50, ttl_ms=30 * 86_400_000)
REFUSED = "connection refused"


def ok(*args: object) -> str:
    out = cli(*map(str, args))
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def refused(code: int, *args: object) -> str:
    """A refusal: its exit code, one line on stderr (returned), nothing on stdout."""
    out = cli(*map(str, args))
    assert out.returncode == code, (args, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert out.stdout == ""
    return lines[0]


@pytest.fixture
def q(tmp_path: Path) -> Path:
    path = tmp_path / "q.db"
    ok("init", path)
    return path


def state(path: Path) -> tuple:
    """Everything a recovery may change: the jobs, their redrives, the endpoints."""
    with open_store(path, read_only=True) as store:
        jobs = store.list_jobs(limit=1000)
        return (jobs, [store.job_history(job["id"])["redrives"] for job in jobs],
                store.endpoints(), store.endpoint_audit())


def redrive_rows(path: Path) -> list[tuple[str, str, str | None]]:
    """Every redrive audit row of the queue: (job id, note, actor)."""
    with open_store(path, read_only=True) as store:
        return [(job["id"], row["note"], row["actor"])
                for job in store.list_jobs(limit=1000)
                for row in store.job_history(job["id"])["redrives"]]


def rows_of(path: Path) -> dict[str, dict]:
    with open_store(path, read_only=True) as store:
        return {job["id"]: job for job in store.list_jobs(limit=1000)}


def finished(path: Path, *, n: int = 6, done: int = 3, dead: int = 1,
             at: int | None = None) -> list[str]:
    """Endpoints acme (the one recovered) and other, n messages each to both;
    acme's first ``done`` delivered and the next ``dead`` refused for good, at
    ``at`` (the store's clock by default), the rest pending; other's first
    delivered too. The ids finished of acme."""
    with open_store(path) as store:
        store.add_endpoint(Endpoint("acme", URL))
        store.add_endpoint(Endpoint("other", URL))
        now = store.now_ms() if at is None else at
        store.enqueue_events([{"id": f"m{i}", "body": {"n": i}} for i in range(n)], POLICY,
                             now_ms=now - 10)
        leased = sorted(store.claim_jobs("w1", 30_000, done + dead, now_ms=now - 5,
                                         endpoints=("acme",)).leased,
                        key=lambda job: job.ticket["id"]) if done + dead else []
        assert len(leased) == done + dead
        store.finish_jobs([(job.ticket, "ok", 0, Attempt(now - 4, 3, 200))
                           for job in leased[:done]], now_ms=now)
        store.finish_jobs([(job.ticket, "permanent", 0, Attempt(now - 4, 3, 410, "HTTP 410"))
                           for job in leased[done:done + dead]], now_ms=now)
        [first] = [job for job in store.claim_jobs("w1", 30_000, 100, now_ms=now - 5,
                                                    endpoints=("other",)).leased
                   if job.ticket["id"] == "m0@other"]
        store.finish_jobs([(first.ticket, "ok", 0, Attempt(now - 4, 3, 200))], now_ms=now)
        return [job.ticket["id"] for job in leased[:done + dead]]


def open_circuit(path: Path, *, disable_after_ms: int | None = HOUR) -> None:
    """Endpoint down, its circuit opened by 5 failures in a row (connection refused)."""
    with open_store(path) as store:
        store.add_endpoint(Endpoint("down", URL, disable_after_ms=disable_after_ms))
        store.add_endpoint(Endpoint("up", URL))
        store.enqueue_events([{"id": f"d{i}", "body": {"n": i}} for i in range(8)], POLICY)
        leased = store.claim_jobs("w1", 30_000, 5, endpoints=("down",)).leased
        assert len(leased) == 5
        now = store.now_ms()
        store.finish_jobs([(job.ticket, "retry", 60_000, Attempt(now, 3, None, REFUSED))
                           for job in leased])


def the_fingerprint(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("fingerprint: ")]
    found = line.split(": ", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{64}", found)
    return found


def the_command(out: str) -> list[str]:
    """The confirming command the dry run printed, as its words."""
    [line] = [line.strip() for line in out.splitlines()
              if line.strip().startswith("asyncworker endpoint recover ")]
    return shlex.split(line)[1:]


# ----------------------------------------------------------------- recover


def test_recover_dry_run_then_its_command_sends_exactly_that_set_with_audit_rows(q: Path):
    ids = finished(q)
    before = state(q)
    out = ok("endpoint", "recover", q, "acme", "--since", "1h", "--note", "receiver lost a day",
             "--actor", "ops-ann")
    assert state(q) == before  # a dry run changes nothing
    assert f"{len(ids)} deliveries finished (done or dead) since" in out
    assert "dry run, nothing sent" in out
    for job_id in ids:
        assert f"  {job_id}" in out.splitlines()
    assert "m0@other" not in out and "m5@acme" not in out  # another endpoint's, a pending one
    assert "inbox absorbs" in out
    command = the_command(out)
    assert command[command.index("--confirm") + 1] == the_fingerprint(out)
    assert command[command.index("--actor") + 1] == "ops-ann"

    done = cli(*command)  # the very command the dry run printed
    assert done.returncode == 0, done.stderr
    assert f"recovered {len(ids)} deliveries of endpoint acme" in done.stdout
    rows = rows_of(q)
    for job_id in ids:
        assert (rows[job_id]["status"], rows[job_id]["attempts"]) == ("pending", 0)
    assert rows["m0@other"]["status"] == "done"  # another endpoint's: untouched
    assert sorted(redrive_rows(q)) == sorted((job_id, "receiver lost a day", "ops-ann")
                                             for job_id in ids)
    with open_store(q, read_only=True) as store:
        history = store.job_history("m0@acme")
    assert [a["result"] for a in history["attempts"]] == ["done"]  # its delivery kept

    # the same confirmation again: that set is pending now, not finished; nothing more sent
    after = state(q)
    line = refused(1, *command)
    assert "not the set the dry run showed" in line and "nothing sent" in line
    assert state(q) == after
    assert len(redrive_rows(q)) == len(ids)


def test_a_set_that_changed_since_the_dry_run_is_refused_and_nothing_is_sent(q: Path):
    finished(q)
    out = ok("endpoint", "recover", q, "acme", "--since", "1h", "--note", "replay")
    command = the_command(out)
    with open_store(q) as store:  # one more of acme's finishes after the dry run
        [job] = [job for job in store.claim_jobs("w2", 30_000, 100, endpoints=("acme",)).leased
                 if job.ticket["id"] == "m4@acme"]
        store.finish_jobs([(job.ticket, "ok", 0, Attempt(store.now_ms(), 3, 200))])
    before = state(q)
    line = refused(1, *command)
    assert "not the set the dry run showed (5 now" in line and "run the dry run again" in line
    assert state(q) == before and redrive_rows(q) == []

    again = ok("endpoint", "recover", q, "acme", "--since", "1h", "--note", "replay")
    assert the_fingerprint(again) != the_fingerprint(out)
    assert cli(*the_command(again)).returncode == 0
    assert len(redrive_rows(q)) == 5


def test_since_takes_an_iso_time_or_an_age_and_only_what_finished_since(q: Path):
    with open_store(q) as store:
        now = store.now_ms()
    early = finished(q, n=4, done=2, dead=0, at=now - 3 * HOUR)  # m0, m1 of acme: 3 h ago
    with open_store(q) as store:
        late = store.claim_jobs("w1", 30_000, 100, endpoints=("acme",)).leased
        store.finish_jobs([(job.ticket, "ok", 0, Attempt(store.now_ms(), 3, 200))
                           for job in late])
    late_ids = sorted(job.ticket["id"] for job in late)
    assert len(late_ids) == 2 and not set(late_ids) & set(early)
    from datetime import UTC, datetime

    two_hours_ago = datetime.fromtimestamp((now - 2 * HOUR) / 1000, tz=UTC)
    for since in ("2h", "120m", two_hours_ago.isoformat(),
                  two_hours_ago.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                  two_hours_ago.replace(tzinfo=None).isoformat(sep=" ")):
        out = ok("endpoint", "recover", q, "acme", "--since", since, "--note", "n")
        assert "2 deliveries finished" in out, (since, out)
        assert [job_id for job_id in late_ids + early if f"  {job_id}" in out] == late_ids
    out = ok("endpoint", "recover", q, "acme", "--since", "4h", "--note", "n", "--json")
    found = json.loads(out)
    assert sorted(found["ids"]) == sorted(early + late_ids) and found["count"] == 4
    assert redrive_rows(q) == []


@pytest.mark.parametrize(("argv", "words"), [
    (["--since", "yesterday"], "an ISO 8601 time"),
    (["--since", "1700000000"], "an ISO 8601 time"),
    (["--since", "2026-13-45"], "an ISO 8601 time"),
    (["--since", "1h", "--confirm", "abc"], "64 hexadecimal digits"),
    (["--since", "1h", "--note", ""], "note"),
    (["--since", "1h", "--ttl", "soon"], "--ttl"),
    (["--since", "1h", "--ttl", "0"], "time to live"),
])
def test_recover_refuses_bad_input_in_one_line(q: Path, argv: list[str], words: str):
    finished(q)
    before = state(q)
    if "--note" not in argv:
        argv = [*argv, "--note", "n"]
    line = refused(2, "endpoint", "recover", q, "acme", *argv)
    assert words in line, line
    assert state(q) == before


def test_recover_needs_a_note_and_a_known_endpoint(q: Path):
    finished(q)
    assert "needs a note" in refused(2, "endpoint", "recover", q, "acme", "--since", "1h")
    assert "no endpoint 'nope'" in refused(1, "endpoint", "recover", q, "nope", "--since",
                                           "1h", "--note", "n")


def test_recover_with_nothing_finished_says_so_and_prints_no_command(q: Path):
    finished(q, done=0, dead=0)
    out = ok("endpoint", "recover", q, "acme", "--since", "1h", "--note", "n")
    assert "0 deliveries finished" in out and "--confirm" not in out


# ----------------------------------------------------------------- the circuit


def test_show_list_and_stats_show_an_open_circuit_with_its_why(q: Path):
    open_circuit(q)
    why = "5 failures in a row, the last: connection refused"
    show = ok("endpoint", "show", q, "down")
    fields = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip()
              for line in show.split("\n\naudit")[0].splitlines()}
    assert fields["circuit"] == "open" and fields["circuit why"] == why
    assert fields["failures in a row"] == "5" and fields["attempts saved"] == "0"
    assert fields["probe after"] != "-" and fields["circuit since"] != "-"
    assert fields["disable after"].startswith("1h")
    assert re.search(r"opened\s+-\s+5 failures in a row.*breaker", show)  # its audit row
    record = json.loads(ok("endpoint", "show", q, "down", "--json"))
    assert record["circuit"]["state"] == "open" and record["circuit"]["why"] == why

    table = ok("endpoint", "list", q).splitlines()
    assert table[0].split()[:3] == ["name", "enabled", "circuit"]
    rows = {line.split()[0]: line.split() for line in table[1:-1]}
    assert rows["down"][1:3] == ["yes", "open"] and rows["up"][1:3] == ["yes", "closed"]

    stats = ok("stats", q)
    header = next(line for line in stats.splitlines() if line.startswith("endpoint "))
    assert header.split()[:3] == ["endpoint", "enabled", "circuit"]
    assert any(line.split()[:3] == ["down", "yes", "open"] for line in stats.splitlines())
    [line] = [line for line in stats.splitlines() if line.startswith("down: circuit open")]
    assert why in line and "5 failures in a row;" in line and "attempts saved" in line
    assert not any(line.startswith("up: ") for line in stats.splitlines())
    snap = json.loads(ok("stats", q, "--json"))
    down = next(row for row in snap["endpoints"] if row["name"] == "down")
    assert down["circuit"]["state"] == "open" and down["circuit"]["why"] == why
    assert down["circuit"]["failures"] == 5 and down["disable_after_ms"] == HOUR
    assert down["disabled_why"] is None


def test_an_endpoint_the_breaker_disabled_is_shown_as_such(q: Path):
    with open_store(q) as store:
        now = store.now_ms() - HOUR  # its failures an hour ago, by the store's clock
        store.add_endpoint(Endpoint("down", URL, disable_after_ms=60_000), now_ms=now)
        store.enqueue_events([{"id": f"d{i}", "body": {}} for i in range(8)], POLICY,
                             now_ms=now)
        while next(row for row in store.endpoints() if row["name"] == "down")["enabled"]:
            circuit = store.endpoints()[0]["circuit"]
            now = max(now, circuit["open_until_ms"] or now) + 1
            leased = store.claim_jobs("w1", 30_000, 5, now_ms=now, endpoints="*").leased
            assert leased, circuit
            store.finish_jobs([(job.ticket, "retry", 1000, Attempt(now, 3, None, REFUSED))
                               for job in leased], now_ms=now + 1)
            assert now < store.now_ms()
    show = ok("endpoint", "show", q, "down")
    assert re.search(r"^enabled\s+no, by the breaker: failing for \d+ s", show, re.M), show
    assert re.search(r"^disabled why\s+by the breaker: failing for", show, re.M)
    assert ok("endpoint", "list", q).splitlines()[1].split()[:3] == ["down", "no", "(breaker)"]
    stats = ok("stats", q)
    assert re.search(r"^down: disabled by the breaker: failing for .*endpoint enable$", stats,
                     re.M), stats
    ok("endpoint", "enable", q, "down", "--note", "fixed their DNS")
    assert "by the breaker" not in ok("endpoint", "show", q, "down")


# ----------------------------------------------------------------- --disable-after


def test_disable_after_is_set_changed_and_shown(q: Path):
    out = ok("endpoint", "add", q, "acme", URL, "--disable-after", "12h")
    assert out.strip().endswith("; enabled; disabled by the breaker after failing 12h)")
    assert "breaker" not in ok("endpoint", "add", q, "beta", URL)
    with open_store(q, read_only=True) as store:
        after = {row["name"]: row["disable_after_ms"] for row in store.endpoints()}
    assert after == {"acme": 12 * HOUR, "beta": 3 * 24 * HOUR}
    ok("endpoint", "update", q, "acme", "--disable-after", "never", "--note", "ours", "--actor",
       "ops")
    ok("endpoint", "update", q, "beta", "--disable-after", "90m")
    with open_store(q, read_only=True) as store:
        after = {row["name"]: row["disable_after_ms"] for row in store.endpoints()}
        audit = store.endpoint_audit("acme")[-1]
    assert after == {"acme": None, "beta": 90 * 60_000}
    assert (audit["action"], audit["fields"], audit["note"], audit["actor"]) == (
        "update", ["disable_after_ms"], "ours", "ops")
    assert re.search(r"^disable after\s+never", ok("endpoint", "show", q, "acme"), re.M)
    assert re.search(r"^disable after\s+90m", ok("endpoint", "show", q, "beta"), re.M)


@pytest.mark.parametrize("bad", ["0", "30s", "59999", "366d", "soon", "", "-1h", "Never"])
def test_disable_after_refuses_bad_input_in_one_line(q: Path, bad: str):
    ok("endpoint", "add", q, "acme", URL)
    with open_store(q, read_only=True) as store:
        before = (store.endpoints(), store.endpoint_audit())
    for argv in (["add", q, "beta", URL], ["update", q, "acme"]):
        line = refused(2, "endpoint", *argv, f"--disable-after={bad}")
        assert "--disable-after" in line and "1m..365d" in line and "never" in line, line
    with open_store(q, read_only=True) as store:
        assert (store.endpoints(), store.endpoint_audit()) == before


# ----------------------------------------------------------------- run


def test_run_no_endpoint_label_goes_without_url(q: Path):
    line = refused(2, "run", q, "--url", "http://127.0.0.1:9/x", "--no-endpoint-label")
    assert "--no-endpoint-label goes without --url" in line


def test_run_no_endpoint_label_drops_the_label_from_the_metrics(q: Path, tmp_path: Path):
    """Recovered deliveries sent again: the receiver's inbox absorbs them (duplicates,
    nothing applied twice), and the run's metrics carry no endpoint label."""
    from tests.support.servers import ReceiverProcess

    with ReceiverProcess(tmp_path / "inbox.db") as receiver:
        ok("endpoint", "add", q, "acme", receiver.url)
        for n in range(3):
            ok("enqueue", q, "--id", f"m-{n}", "--body", json.dumps({"n": n}))
        assert cli("run", str(q), "--until-idle").returncode == 0
        assert receiver.stats()["applied"] == 3
        out = ok("endpoint", "recover", q, "acme", "--since", "1h", "--note", "lost")
        assert "3 deliveries finished" in out
        ok(*the_command(out))
        run = subprocess.Popen([sys.executable, "-m", "asyncworker", "run", str(q),
                                "--no-endpoint-label", "--metrics", "127.0.0.1:0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert run.stderr is not None
            url = ""
            while not url:
                line = run.stderr.readline()
                assert line, "run ended before it served its metrics"
                found = re.search(r"metrics: (\S+/metrics)", line)
                url = found.group(1) if found else ""
            wait_until(lambda: rows_of(q)["m-2@acme"]["status"] == "done"
                       and all(row["status"] == "done" for row in rows_of(q).values()),
                       "the recovered deliveries done again", 60)
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url, timeout=10) as answer:
                metrics = answer.read().decode()
        finally:
            run.send_signal(signal.SIGTERM)
            run.communicate(timeout=60)
        stats = receiver.stats()
    assert stats["applied"] == 3 and stats["duplicates"] == 3  # absorbed, not applied twice
    assert "asyncworker_jobs_done_total 3" in metrics or re.search(
        r"^\w*jobs_done_total 3(\.0)?$", metrics, re.M), metrics
    assert 'endpoint="' not in metrics
