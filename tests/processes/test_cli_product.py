"""Tier 4: the command line of the product queue: payloads, the retry policy,
cancel, prune, prune-inbox, the evidence shown, and migration of contract files."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lease import sqlite as store
from lease import worker
from lease.http import send_http
from lease.policy import DEFAULT_POLICY, MAX_BODY_BYTES, RetryPolicy, canonical_body
from lease.records import Attempt
from lease.stores import open_store
from tests.support import DATA
from tests.support.commands import cli
from tests.support.queues import T0, job_rows, rows, run_on_a_terminal
from tests.support.servers import ReceiverProcess


def table(path: Path, name: str) -> list[dict]:
    con = worker.open_queue(path, create=False)
    try:
        return rows(con, name)
    finally:
        con.close()


def _change_counter(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[24:28], "big")


# ------------------------------------------------------------------ migration


def test_init_migrates_a_contract_file_once_and_keeps_every_row(tmp_path: Path):
    path = tmp_path / "old.db"
    con = worker.open_queue(path)  # the contract's schema, version 0
    try:
        worker.enqueue_many(con, [{"id": f"j-{n}", "qty": n + 1} for n in range(4)], T0, 60_000)
        ticket = worker.claim(con, "old", T0, 1000)
        assert ticket is not None and worker.finish(con, ticket, "permanent", T0 + 1)
        assert worker.redrive(con, "j-0", T0 + 2, 60_000, "fixed") is True
        before = {name: rows(con, name) for name in ("jobs", "redrives")}
    finally:
        con.close()
    out = cli("init", str(path))
    assert (out.returncode, out.stdout.strip()) == (
        0, f"migrated queue {path} from schema version 0 to {store.SCHEMA_VERSION}, every row kept")
    con = worker.open_queue(path, create=False)
    try:
        assert store.schema_version(con) == store.SCHEMA_VERSION
        after = rows(con)
        assert [{k: r[k] for k in before["jobs"][0]} for r in after] == before["jobs"]
        assert {(r["body"], r["digest"]) for r in after} == {(None, None)}
        assert [{k: r[k] for k in before["redrives"][0]} for r in rows(con, "redrives")] == (
            before["redrives"])
    finally:
        con.close()
    out = cli("init", str(path))
    version = store.SCHEMA_VERSION
    assert out.stdout.strip() == f"kept existing queue {path} (schema version {version})"


def test_init_creates_a_product_queue(tmp_path: Path):
    out = cli("init", str(tmp_path / "q.db"))
    assert out.stdout.strip().endswith(f"(schema version {store.SCHEMA_VERSION})")
    assert "created" in out.stdout
    con = worker.open_queue(tmp_path / "q.db", create=False)
    try:
        assert store.schema_version(con) == store.SCHEMA_VERSION
    finally:
        con.close()


def test_a_command_that_writes_migrates_and_one_that_looks_does_not(tmp_path: Path):
    path = tmp_path / "old.db"
    worker.open_queue(path).close()
    for args in (["stats", str(path)], ["dead", str(path)],
                 ["cancel", str(path), "--reason", "deadline", "--note", "x", "--dry-run"],
                 ["redrive", str(path), "--reason", "deadline", "--note", "x", "--dry-run"]):
        before = path.read_bytes()
        assert cli(*args).returncode == 0
        assert path.read_bytes() == before, args  # a dry run changes nothing, not even this
    assert cli("enqueue", str(path), "--id", "order:1", "--body", '{"a": 1}').returncode == 0
    assert job_rows(path)["order:1"]["body"] == '{"a":1}'


# ------------------------------------------------------------------ enqueue


def test_enqueue_a_payload_duplicates_by_digest_and_conflicts_by_body(queue: Path):
    body = '{"b": [1, 2.5, null], "a": "caf\\u00e9 \\u2603"}'
    out = cli("enqueue", str(queue), "--id", "tenant/7:order-1", "--body", body)
    assert (out.returncode, out.stdout.strip()) == (0, "1 new, 0 duplicate, 0 conflicting")
    same = '{"a": "café ☃", "b": [1, 2.5, null]}'  # other key order, other spelling
    out = cli("enqueue", str(queue), "--id", "tenant/7:order-1", "--body", same)
    assert (out.returncode, out.stdout.strip()) == (0, "0 new, 1 duplicate, 0 conflicting")
    out = cli("enqueue", str(queue), "--id", "tenant/7:order-1", "--body", '{"a": 2}')
    assert out.returncode == 1 and out.stdout.strip() == "0 new, 0 duplicate, 1 conflicting"
    assert out.stderr.startswith("conflict: job 'tenant/7:order-1' exists with other content")
    row = job_rows(queue)["tenant/7:order-1"]
    text, digest = canonical_body(json.loads(body))
    assert (row["body"], row["digest"], row["qty"]) == (text, digest, 0)
    assert (row["max_attempts"], row["deadline"] - row["available_at"]) == (
        DEFAULT_POLICY.max_attempts, DEFAULT_POLICY.ttl_ms)


def test_enqueue_a_body_at_the_size_cap(queue: Path):
    body = json.dumps({"x": "y" * (MAX_BODY_BYTES - 8)})  # canonical: exactly the cap
    assert len(canonical_body(json.loads(body))[0].encode()) == MAX_BODY_BYTES
    out = cli("enqueue", str(queue), "--id", "big", "--body", body)
    assert out.returncode == 0, out.stderr
    assert len(job_rows(queue)["big"]["body"]) == MAX_BODY_BYTES


def test_enqueue_lines_mix_lab_and_payload_events_and_name_conflicts_by_line(queue: Path,
                                                                            tmp_path: Path):
    cli("enqueue", str(queue), "--id", "order:2", "--body", '{"v": 1}')
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"id": "snack-1", "qty": 3}\n'
                     '{"id": "order:1", "body": {"items": [1, 2]}}\n'
                     "\n"
                     '{"id": "order:2", "body": {"v": 2}}\n'
                     '{"id": "order:1", "body": {"items": [1, 2]}}\n'
                     '{"id": "123e4567-e89b-12d3-a456-426614174000", "body": {}}\n')
    out = cli("enqueue", str(queue), "--file", str(lines), "--max-attempts", "50",
              "--ttl-ms", str(7 * 86_400_000))
    assert (out.returncode, out.stdout.strip()) == (1, "0 new, 0 duplicate, 1 conflicting")
    assert out.stderr.splitlines()[0].startswith("line 4: conflict: job 'order:2'")
    assert sorted(job_rows(queue)) == ["order:2"]  # all or nothing
    out = cli("enqueue", str(queue), "--file", str(lines), "--max-attempts", "50",
              "--ttl-ms", str(7 * 86_400_000), "--skip-conflicts")
    assert out.returncode == 1
    assert out.stdout.strip() == "3 new, 1 duplicate, 1 conflicting"
    assert out.stderr.splitlines()[0].startswith("line 4: conflict: job 'order:2'")
    found = job_rows(queue)
    assert sorted(found) == ["123e4567-e89b-12d3-a456-426614174000", "order:1", "order:2",
                             "snack-1"]
    assert (found["snack-1"]["qty"], found["snack-1"]["body"]) == (3, None)
    assert found["order:1"]["body"] == '{"items":[1,2]}'
    assert found["order:1"]["max_attempts"] == 50
    assert found["order:1"]["deadline"] - found["order:1"]["available_at"] == 7 * 86_400_000

def test_enqueue_lines_keep_their_priorities_and_the_higher_is_claimed_first(
        queue: Path):
    stdin = ('{"id": "plain", "qty": 1}\n{"id": "urgent", "body": {"x": 1}, "priority": 50}\n'
             '{"id": "later", "qty": 1, "priority": -5}\n')
    out = cli("enqueue", str(queue), "--file", "-", stdin=stdin)
    assert (out.returncode, out.stdout.strip()) == (0, "3 new, 0 duplicate, 0 conflicting")
    assert {job_id: row["priority"] for job_id, row in job_rows(queue).items()} == {
        "plain": 0, "urgent": 50, "later": -5}
    shown = cli("inspect", str(queue), "urgent").stdout.splitlines()
    assert [line.split() for line in shown if line.startswith("priority")] == [
        ["priority", "50"]]
    with open_store(str(queue)) as opened:
        claimed = opened.claim_jobs("w", 1000, 10)
    assert [job.ticket["id"] for job in claimed.leased] == ["urgent", "plain", "later"]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_enqueue_file_with_a_conflict_commits_nothing_and_names_each_conflicting_line(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    """d-1, d-2, then d-1 with another body (and once more): nothing enqueued,
    each conflicting line named, exit 1; --skip-conflicts keeps the rest."""
    queue = str(tmp_path / "q.db") if kind == "sqlite" else request.getfixturevalue(
        "postgres_url")
    assert cli("init", queue).returncode == 0
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"id": "d-1", "body": {"v": 1}}\n'
                     '{"id": "d-2", "body": {"v": 2}}\n'
                     '{"id": "d-1", "body": {"v": 3}}\n'
                     '\n'
                     '{"id": "d-1", "body": {"v": 4}}\n')

    def ids() -> list[str]:
        with open_store(queue, read_only=True) as looking:
            return sorted(job["id"] for job in looking.jobs_with_status("pending"))

    out = cli("enqueue", queue, "--file", str(lines))
    assert (out.returncode, out.stdout.strip()) == (1, "0 new, 0 duplicate, 2 conflicting")
    assert out.stderr.splitlines() == [
        line for line in out.stderr.splitlines() if line.startswith(("line ", "nothing"))]
    assert [line.split(": ")[0] for line in out.stderr.splitlines()[:2]] == ["line 3", "line 5"]
    assert "nothing was enqueued: 2 conflicting of 4 events" in out.stderr
    assert ids() == []  # neither d-1 nor d-2
    out = cli("enqueue", queue, "--file", str(lines), "--skip-conflicts")
    assert (out.returncode, out.stdout.strip()) == (1, "2 new, 0 duplicate, 2 conflicting")
    assert out.stderr.count("conflict: job 'd-1'") == 2
    assert ids() == ["d-1", "d-2"]


@pytest.mark.parametrize(("line", "message"), [
    ('{"id": "c", "body": [1]}', "line 3: event body must be a JSON object"),
    ('{"id": "c", "body": {"a": 1, "a": 2}}', "line 3: duplicate key"),
    ('{"id": "c c", "body": {}}', "line 3: event id must be 1-255 visible ASCII"),
    ('{"id": "c", "qty": 0}', "line 3: event qty must be in 1..1000"),
    ('{"id": "c", "body": {}, "qty": 1}', "line 3: event must have the keys id and qty"),
    ('{"id": "c", "qty": 1, "priority": 1.0}', "line 3: event priority must be an int in"),
    ('{"id": "c", "qty": 1, "priority": true}', "line 3: event priority must be an int in"),
    ('{"id": "c", "qty": 1, "priority": 101}', "line 3: event priority must be an int in"),
])
def test_a_bad_line_after_good_ones_is_named_and_nothing_is_enqueued(queue: Path, line: str,
                                                                     message: str):
    before = queue.read_bytes()
    stdin = '{"id": "a", "qty": 1}\n{"id": "b", "body": {"x": 1}}\n' + line + "\n"
    out = cli("enqueue", str(queue), "--file", "-", stdin=stdin)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stderr.strip().endswith("nothing was enqueued")
    assert len(out.stderr.splitlines()) == 1 and queue.read_bytes() == before


def test_enqueue_delay_sets_the_first_moment_and_the_deadline_from_it(queue: Path):
    started = int(time.time() * 1000)
    out = cli("enqueue", str(queue), "--id", "later", "--qty", "1", "--delay-ms", "3600000",
              "--ttl-ms", "60000")
    ended = int(time.time() * 1000)
    assert out.returncode == 0
    row = job_rows(queue)["later"]
    assert started + 3_600_000 <= row["available_at"] <= ended + 3_600_000
    assert row["deadline"] == row["available_at"] + 60_000


# A child's peak RSS counts its parent's pages at the fork (Linux keeps the high-water
# mark across fork and exec): measure a child of a small launcher, not of pytest.
_LAUNCH = """import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, child.stderr.read()[:500])"""


def _peak_rss_kib(args: list[str]) -> int:
    """The peak resident set of one run of the command, from its own rusage (KiB)."""
    out = subprocess.run([sys.executable, "-c", _LAUNCH, sys.executable, "-m", "asyncworker",
                          *args], capture_output=True, text=True, timeout=120)
    code, peak, err = out.stdout.split(" ", 2)
    assert (out.returncode, code) == (0, "0"), (out.stderr, err)
    return int(peak)


def test_enqueue_streams_a_large_file_in_bounded_memory(tmp_path: Path):
    """Memory does not grow with the file: 60,000 lines (10 MB) peak within a few
    MB of 1,000 lines. Holding the events in a list took ~26 MB more for these
    (~107 MB for 200,000 lines; streamed, 200,000 lines peak at ~29 MB)."""
    def peak(lines: int) -> int:
        path, events = tmp_path / f"q{lines}.db", tmp_path / f"e{lines}.jsonl"
        store.open_store(path).close()
        with open(events, "w") as out:
            for n in range(lines):
                event = ({"id": f"o-{n}", "qty": 1} if n % 2 else
                         {"id": f"order:{n}", "body": {"n": n, "text": "x" * 300}})
                out.write(json.dumps(event) + "\n")
        rss = _peak_rss_kib(["enqueue", str(path), "--file", str(events)])
        assert len(job_rows(path)) == lines
        return rss

    small, large = peak(1000), peak(60_000)
    assert large - small < 10 * 1024, (small, large)  # KiB
    assert large < 100 * 1024


def test_enqueue_shows_its_progress_on_a_terminal_only(queue: Path, tmp_path: Path):
    events = tmp_path / "events.jsonl"
    events.write_text("".join(f'{{"id": "p-{n}", "qty": 1}}\n' for n in range(25_000)))
    proc, text = run_on_a_terminal([sys.executable, "-m", "asyncworker", "enqueue", str(queue),
                                    "--file", str(events)])
    assert proc.returncode == 0 and proc.stdout.strip() == "25000 new, 0 duplicate, 0 conflicting"
    assert "\r\x1b[2Kenqueue: 10000 events read" in text and "enqueue: 20000 events" in text
    assert text.endswith("\r\x1b[2K")  # erased at the end: the summary stands alone
    out = cli("enqueue", str(queue), "--file", str(events))  # a pipe: no progress
    assert out.stderr == "" and out.stdout.strip() == "0 new, 25000 duplicate, 0 conflicting"


# ------------------------------------------------------------------ run with a policy


def test_run_takes_the_policy_and_the_evidence_shows_in_dead_and_inspect(queue: Path,
                                                                         tmp_path: Path):
    cli("enqueue", str(queue), "--id", "order:1", "--body", '{"a": 1}', "--ttl-ms", "30000",
        "--max-attempts", "5")
    with ReceiverProcess(tmp_path / "inbox.db", "--p-503", "1") as rx:
        # A backoff longer than the job's life: its first 503 sends it to dead/deadline
        # (the default backoff, 1 s, would have retried it). A lease of an hour is taken.
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", "--backoff-base-ms",
                  "40000", "--backoff-cap-ms", "40000", "--jitter", "0", "--lease-ms", "3600000")
        assert out.returncode == 3, out.stderr
        assert "backoff 40000..40000 ms, jitter 0.0" in out.stderr
        summary = json.loads(out.stdout)
        assert summary["dead_by_reason"]["deadline"] == 1, summary
    found = job_rows(queue)
    assert (found["order:1"]["status"], found["order:1"]["reason"]) == ("dead", "deadline")
    assert found["order:1"]["attempts"] == 1
    out = cli("dead", str(queue))
    header, *lines = out.stdout.splitlines()
    assert header.split()[-1] == "last_error" and len(lines) == 1
    assert "503" in lines[0] and lines[0].startswith("order:1  -    body 7 B  dead    deadline")
    out = cli("inspect", str(queue), "order:1")
    assert out.returncode == 0 and "status        dead (deadline)" in out.stdout
    assert "body          {\"a\":1}" in out.stdout
    assert "attempts: 1\n" in out.stdout and "retry" in out.stdout and "503" in out.stdout
    record = json.loads(cli("inspect", str(queue), "order:1", "--json").stdout)
    [attempt] = record["attempts"]
    assert (attempt["token"], attempt["outcome"], attempt["result"], attempt["reason"]) == (
        1, "retry", "dead", "deadline")
    assert attempt["http_status"] == 503 and attempt["latency_ms"] is not None


# ------------------------------------------------------------------ cancel and redrive


def test_cancel_then_redrive_with_free_text_notes(queue: Path):
    for n in range(3):
        cli("enqueue", str(queue), "--id", f"order:{n}", "--body", f'{{"n": {n}}}')
    out = cli("cancel", str(queue), "order:0", "order:1", "--note", "customer asked: stop ✋")
    assert (out.returncode, out.stdout.splitlines()) == (
        0, ["cancelled order:0", "cancelled order:1", "2 cancelled, 0 refused"])
    out = cli("cancel", str(queue), "--reason", "deadline", "--note", "x", "--dry-run")
    assert out.stdout.strip() == "0 to cancel (dry run, nothing changed)"
    out = cli("dead", str(queue), "--reason", "cancelled")
    assert out.stdout.count("cancelled") == 2
    out = cli("stats", str(queue))
    assert "cancels            2" in out.stdout and "stale finishes     0" in out.stdout
    out = cli("redrive", str(queue), "--reason", "cancelled", "--note", "re-opened: ticket #9",
              "--ttl-ms", str(7 * 86_400_000))
    assert out.returncode == 0 and "2 redriven, 0 refused" in out.stdout
    found = job_rows(queue)
    assert [found[f"order:{n}"]["status"] for n in range(3)] == ["pending"] * 3
    assert found["order:0"]["deadline"] - found["order:0"]["available_at"] == 7 * 86_400_000
    out = cli("inspect", str(queue), "order:0")
    assert "cancels: 1" in out.stdout and "customer asked: stop ✋" in out.stdout
    assert "redrives: 1" in out.stdout and "re-opened: ticket #9" in out.stdout
    record = json.loads(cli("inspect", str(queue), "order:0", "--json").stdout)
    assert [c["was"] for c in record["cancels"]] == ["pending"]


@pytest.fixture(params=["sqlite", "postgresql"])
def any_queue(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty product queue: a file in tmp_path, or a fresh database on a real server."""
    target = (str(tmp_path / "queue.db") if request.param == "sqlite"
              else str(request.getfixturevalue("postgres_url")))
    open_store(target, create=True).close()
    return target


def _dead_of_two_keys(target: str) -> None:
    """custE: p-1 dead/permanent first in line, e-1..e-3 dead/deadline behind it;
    custF: f-1 dead/permanent, f-2 dead/deadline; u-1, no key, dead/permanent."""
    with open_store(target) as queue:
        one_try = RetryPolicy(max_attempts=1)
        assert queue.enqueue_events([{"id": "p-1", "qty": 1, "key": "custE"},
                                     {"id": "f-1", "qty": 1, "key": "custF"},
                                     {"id": "u-1", "qty": 1}], one_try) == [True] * 3
        claimed = queue.claim_jobs("w", 60_000, 3)
        assert sorted(job.ticket["id"] for job in claimed.leased) == ["f-1", "p-1", "u-1"]
        seen = Attempt(claimed.now_ms, 3, 422, None)
        assert queue.finish_jobs([(job.ticket, "permanent", 0, seen)
                                  for job in claimed.leased]) == [("dead", "permanent")] * 3
        late = [{"id": job_id, "qty": 1, "key": key}
                for job_id, key in (("e-1", "custE"), ("f-2", "custF"), ("e-2", "custE"),
                                    ("e-3", "custE"))]
        # enqueued a minute ago with a 1 ms life: the next claim moves them to dead
        assert queue.enqueue_events(late, RetryPolicy(max_attempts=1, ttl_ms=1),
                                    now_ms=queue.now_ms() - 60_000) == [True] * 4
        quarantined = queue.claim_jobs("w", 60_000, 10)
        assert quarantined.leased == [] and quarantined.moved["deadline"] == 4


def _states(target: str) -> dict[str, tuple]:
    """Each job's status, reason, token and audit rows (redrives, cancels)."""
    with open_store(target, read_only=True) as queue:
        found = {}
        for status in ("pending", "leased", "done", "dead"):
            for row in queue.jobs_with_status(status):
                history = queue.job_history(row["id"])
                assert history is not None
                found[row["id"]] = (row["status"], row["reason"], row["token"],
                                    [r["note"] for r in history["redrives"]],
                                    [c["note"] for c in history["cancels"]])
        return found


def test_a_bulk_redrive_and_cancel_by_ordering_key_touch_only_that_key(any_queue: str):
    _dead_of_two_keys(any_queue)
    before = _states(any_queue)
    assert len(before) == 7
    out = cli("redrive", any_queue, "--reason", "permanent", "--key", "custE", "--dry-run",
              "--note", "x")
    assert (out.returncode, out.stdout.splitlines()) == (
        0, ["would redrive p-1", "1 to redrive (dry run, nothing changed)"]), out.stderr
    out = cli("redrive", any_queue, "--reason", "deadline", "--key", "custE", "--dry-run",
              "--note", "x")
    assert out.stdout.splitlines() == ["would redrive e-1", "would redrive e-2",
                                       "would redrive e-3",
                                       "3 to redrive (dry run, nothing changed)"]
    out = cli("cancel", any_queue, "--reason", "deadline", "--key", "custF", "--dry-run",
              "--note", "x")
    assert out.stdout.splitlines() == ["would cancel f-2", "1 to cancel (dry run, nothing changed)"]
    out = cli("dead", any_queue, "--key", "custE", "--json")
    assert [(j["id"], j["ordering_key"]) for j in json.loads(out.stdout)] == [
        ("p-1", "custE"), ("e-1", "custE"), ("e-2", "custE"), ("e-3", "custE")]
    assert out.stderr.strip() == "4 dead"
    out = cli("dead", any_queue, "--key", "custF", "--reason", "deadline")
    assert [line.split()[0] for line in out.stdout.splitlines()[1:]] == ["f-2"]
    assert _states(any_queue) == before  # a dry run and a look change nothing

    out = cli("redrive", any_queue, "--reason", "deadline", "--key", "custE", "--note",
              "custE's receiver fixed")
    assert (out.returncode, out.stdout.splitlines()) == (
        0, ["redrove e-1", "redrove e-2", "redrove e-3", "3 redriven, 0 refused"]), out.stderr
    out = cli("cancel", any_queue, "--reason", "deadline", "--key", "custF", "--note",
              "custF closed")
    assert (out.returncode, out.stdout.splitlines()) == (
        0, ["cancelled f-2", "1 cancelled, 0 refused"]), out.stderr
    after = _states(any_queue)
    assert {job_id: after[job_id][:2] for job_id in after} == {
        "p-1": ("dead", "permanent"), "e-1": ("pending", None), "e-2": ("pending", None),
        "e-3": ("pending", None), "f-1": ("dead", "permanent"), "f-2": ("dead", "cancelled"),
        "u-1": ("dead", "permanent")}
    assert {job_id: row[3:] for job_id, row in after.items() if row[3:] != ([], [])} == {
        "e-1": (["custE's receiver fixed"], []), "e-2": (["custE's receiver fixed"], []),
        "e-3": (["custE's receiver fixed"], []), "f-2": ([], ["custF closed"])}
    for job_id in ("p-1", "f-1", "u-1"):
        assert after[job_id] == before[job_id]  # untouched: the same token, no audit row


@pytest.mark.parametrize(("args", "message"), [
    (["redrive", "{q}", "p-1", "--key", "custE", "--note", "x"], "--key goes with --reason"),
    (["redrive", "{q}", "--key", "custE", "--note", "x"], "--key goes with --reason"),
    (["redrive", "{q}", "--key", "custE", "--note", "x", "--dry-run"],
     "--key goes with --reason"),
    (["cancel", "{q}", "f-1", "--key", "custF", "--note", "x"], "--key goes with --reason"),
    (["cancel", "{q}", "--key", "custF", "--note", "x"], "--key goes with --reason"),
    (["redrive", "{q}", "--reason", "permanent", "--key", "cust E", "--note", "x"], "--key"),
    (["cancel", "{q}", "--reason", "permanent", "--key", "", "--note", "x"], "--key"),
    (["dead", "{q}", "--key", "x" * 256], "--key"),
])
def test_a_key_with_a_job_id_or_without_a_reason_is_a_usage_error(queue: Path, args: list,
                                                                  message: str):
    _dead_of_two_keys(str(queue))
    before = queue.read_bytes()
    out = cli(*[arg.format(q=queue) for arg in args])
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert queue.read_bytes() == before


def test_a_key_filter_on_a_file_from_before_keys_finds_nothing_and_migrates_nothing(
        tmp_path: Path):
    import shutil

    queue = tmp_path / "old.db"
    shutil.copy(DATA / "queue-v0.db", queue)
    before = queue.read_bytes()
    assert json.loads(cli("dead", str(queue), "--json").stdout)  # it has dead jobs
    out = cli("dead", str(queue), "--key", "custE", "--json")
    assert (out.returncode, json.loads(out.stdout), out.stderr.strip()) == (0, [], "0 dead")
    out = cli("redrive", str(queue), "--reason", "permanent", "--key", "custE", "--dry-run",
              "--note", "x")
    assert (out.returncode, out.stdout.strip()) == (0, "0 to redrive (dry run, nothing changed)")
    assert queue.read_bytes() == before  # read only: not even migrated


def test_stats_of_a_contract_file_shows_no_figures_it_cannot_have(tmp_path: Path):
    path = tmp_path / "old.db"
    worker.open_queue(path).close()
    out = cli("stats", str(path))
    assert out.returncode == 0 and "cancels" not in out.stdout
    assert "stale finishes" not in out.stdout
    out = cli("inspect", str(path), "nope")
    assert out.returncode == 1


# ------------------------------------------------------------------ prune


def _done_jobs(path: Path, old: int, recent: int) -> None:
    """`old` done jobs finished at T0 (1970) with an attempt each, `recent` done now,
    and a pending, a dead and a cancelled job finished at T0 too."""
    now = int(time.time() * 1000)
    con = sqlite3.connect(path)
    try:
        con.executemany(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
            " deadline, reason) VALUES (?, 1, ?, 1, 3, 1, ?, ?, ?)",
            [(f"old-{n}", "done", T0, T0 + 1, None) for n in range(old)]
            + [(f"new-{n}", "done", now, now + 1, None) for n in range(recent)]
            + [("live", "pending", T0, now + 10**9, None), ("dead", "dead", T0, T0, "exhausted"),
               ("gone", "dead", T0, T0, "cancelled")])
        con.executemany(
            "INSERT INTO attempts (id, token, attempt, owner, started_ms, ended_ms, outcome,"
            " result) VALUES (?, 1, 1, 'w', ?, ?, 'ok', 'done')",
            [(f"old-{n}", T0, T0) for n in range(old)])
        con.commit()
    finally:
        con.close()


def test_prune_deletes_old_done_jobs_in_batches_and_nothing_else(queue: Path):
    _done_jobs(queue, 25_000, 3)
    before = _change_counter(queue)
    out = cli("prune", str(queue), "--older-than", "7d")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("25000 done jobs pruned (finished before ")
    assert _change_counter(queue) - before == 3  # 10,000 per transaction
    assert sorted(n for n in job_rows(queue) if not n.startswith("new-")) == [
        "dead", "gone", "live"]
    assert len(job_rows(queue)) == 6 and table(queue, "attempts") == []
    out = cli("prune", str(queue), "--older-than", "7d")
    assert out.stdout.startswith("0 done jobs pruned")
    # an id whose job was pruned is new again
    out = cli("enqueue", str(queue), "--id", "old-1", "--qty", "5")
    assert out.stdout.strip() == "1 new, 0 duplicate, 0 conflicting"


@pytest.mark.parametrize(("age", "pruned"), [("0", 3), ("90s", 0), ("30m", 0), ("12h", 0),
                                             ("36500d", 0), ("600000", 0)])
def test_prune_ages(queue: Path, age: str, pruned: int):
    _done_jobs(queue, 0, 3)  # finished just now
    out = cli("prune", str(queue), "--older-than", age)
    assert out.returncode == 0 and out.stdout.startswith(f"{pruned} done jobs pruned")


# ------------------------------------------------------------------ prune-inbox


def test_prune_inbox_removes_old_rows_and_its_help_states_the_trade_off(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        for n in range(3):
            assert send_http(rx.url, {"id": f"e-{n}", "qty": 1}, timeout=10) is True
    out = cli("prune-inbox", str(inbox), "--older-than", "1h")
    assert (out.returncode, out.stdout.split(" (")[0]) == (0, "0 inbox rows pruned")
    out = cli("prune-inbox", str(inbox), "--older-than", "0")
    assert (out.returncode, out.stdout.split(" (")[0]) == (0, "3 inbox rows pruned")
    text = " ".join(cli("prune-inbox", "--help").stdout.split())
    assert "a pruned row is a duplicate no longer absorbed" in text.lower()
    assert "longer than the senders' whole retry budget" in text


def test_an_enqueue_refused_halfway_leaves_a_contract_file_as_it_was(tmp_path: Path):
    import shutil

    queue = tmp_path / "old.db"
    shutil.copy(DATA / "queue-v0.db", queue)
    before = queue.read_bytes()
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"id": "fine", "body": {"a": 1}}\n{"id": "bad"}\n')
    out = subprocess.run([sys.executable, "-m", "asyncworker", "enqueue", str(queue),
                          "--file", str(lines)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "line 2" in out.stderr, out.stderr
    assert queue.read_bytes() == before  # not even migrated


# ------------------------------------------------------------------ the outbox, keys


def test_init_shared_puts_the_queue_beside_a_services_tables(tmp_path: Path):
    path = tmp_path / "shop.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, customer TEXT)")
    con.commit()
    con.close()
    refused = cli("init", str(path))  # a file of the service's: never by accident
    assert refused.returncode == 2 and "other tables" in refused.stderr
    out = cli("init", "--shared", str(path))
    assert out.returncode == 0 and "created queue" in out.stdout, out.stderr
    events = tmp_path / "events.jsonl"
    events.write_text('{"id": "o-1:placed", "body": {"state": "placed"}}\n'
                      '{"id": "o-1:paid", "body": {"state": "paid"}}\n'
                      '{"id": "o-2:placed", "body": {"state": "placed"}, "key": "bob"}\n')
    added = cli("enqueue", str(path), "--file", str(events), "--key", "ann")
    assert added.returncode == 0, added.stderr  # no flag needed: the file says it is shared
    keys = {row["id"]: row["ordering_key"] for row in table(path, "jobs")}
    assert keys == {"o-1:placed": "ann", "o-1:paid": "ann", "o-2:placed": "bob"}
    con = sqlite3.connect(path)  # the service's own table is as it was
    assert con.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    con.close()


def test_a_bad_key_is_a_usage_error_and_nothing_is_enqueued(queue: Path):
    out = cli("enqueue", str(queue), "--id", "a", "--qty", "1", "--key", "has space")
    assert out.returncode == 2 and "key" in out.stderr and "\n" not in out.stderr.strip()
    assert table(queue, "jobs") == []
    assert cli("init", "--shared", "postgresql://nobody@127.0.0.1:1/db").returncode == 2


def test_stats_shows_the_keys_a_dead_job_blocks(queue: Path):
    con = store.open_store(queue)
    try:
        store.enqueue_events(con, [{"id": f"e{n}", "qty": 1, "key": "ann"} for n in range(3)],
                             T0, DEFAULT_POLICY)
        [job] = store.claim_jobs(con, "w", T0, 1000, 1)[0]
        seen = Attempt(T0, 1, 410, "gone")
        assert store.finish_jobs(con, [(job.ticket, "permanent", 0, seen)], T0 + 1) == [
            ("dead", "permanent")]
    finally:
        con.close()
    snap = json.loads(cli("stats", str(queue), "--json").stdout)
    assert (snap["blocked_keys"], snap["blocked_jobs"]) == (1, 2)
    text = cli("stats", str(queue)).stdout
    assert re.search(r"^blocked keys +1$", text, re.M)
    assert re.search(r"^jobs behind them +2$", text, re.M)
