"""Tier 4: every command that names a queue, on a real PostgreSQL server, called
the way a user calls it (subprocess), and the same figures as on a SQLite file.

Each test has a fresh empty database (``postgres_url``, tests/support/postgres_server.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest

from asyncworker.devtools.postgres_server import free_port
from lease.stores import open_store
from tests.support.commands import cli
from tests.support.servers import ReceiverProcess


def one_line_error(out: subprocess.CompletedProcess, code: int, message: str) -> str:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in out.stderr, out.stderr
    return out.stderr


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def sql(url: str, *statements: str) -> list:
    """Run statements on the database (autocommit); the last one's rows, if any."""
    with psycopg.connect(url, autocommit=True) as con:
        found: list = []
        for statement in statements:
            cursor = con.execute(statement)
            found = cursor.fetchall() if cursor.description else []
        return found


def schemas(url: str) -> list[str]:
    return [name for (name,) in sql(url, "SELECT nspname FROM pg_namespace WHERE nspname "
                                         "NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
                                         " ORDER BY nspname")]


# Every command that takes a queue, once each, with what it needs beyond the queue.
COMMANDS: dict[str, list[str]] = {
    "enqueue": ["enqueue", "{q}", "--id", "zz", "--qty", "1"],
    "run": ["run", "{q}", "--url", "http://127.0.0.1:9/events", "--until-idle"],
    "stats": ["stats", "{q}", "--json"],
    "dead": ["dead", "{q}"],
    "inspect": ["inspect", "{q}", "j-1"],
    "redrive": ["redrive", "{q}", "--reason", "deadline", "--note", "fix"],
    "cancel": ["cancel", "{q}", "j-1", "--note", "fix"],
    "prune": ["prune", "{q}", "--older-than", "0"],
}


def command(name: str, queue: str) -> list[str]:
    return [queue if arg == "{q}" else arg for arg in COMMANDS[name]]


# ------------------------------------------------------------------ init


def test_init_creates_the_queue_then_keeps_it_and_says_its_version(postgres_url: str):
    with open_store(postgres_url, create=True) as probe:  # the version this code writes
        version = probe.schema_version()
    sql(postgres_url, "DROP SCHEMA lease CASCADE")
    assert schemas(postgres_url) == ["public"]
    out = cli("init", postgres_url)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (
        0, f"created queue {postgres_url} (schema version {version})", "")
    assert "lease" in schemas(postgres_url)
    assert cli("enqueue", postgres_url, "--id", "a", "--qty", "1").returncode == 0
    out = cli("init", postgres_url)
    assert (out.returncode, out.stdout.strip()) == (
        0, f"kept existing queue {postgres_url} (schema version {version})")
    assert sql(postgres_url, "SELECT id FROM lease.jobs") == [("a",)]


def test_a_database_with_foreign_tables_but_no_queue_is_refused_untouched(postgres_url: str):
    sql(postgres_url, "CREATE TABLE users (name TEXT)", "INSERT INTO users VALUES ('ada')")
    for name in COMMANDS:
        out = cli(*command(name, postgres_url))
        err = one_line_error(out, 2, "no queue")
        assert f"asyncworker init {postgres_url}" in err  # it says what makes one
    assert schemas(postgres_url) == ["public"]  # nothing created, not even the schema
    assert sql(postgres_url, "SELECT name FROM users") == [("ada",)]
    out = cli("init", postgres_url)  # the queue lives in its own schema, beside theirs
    assert out.returncode == 0 and out.stdout.startswith("created queue")
    assert sql(postgres_url, "SELECT name FROM users") == [("ada",)]


def test_a_foreign_table_where_the_queue_would_live_is_refused_untouched(postgres_url: str):
    sql(postgres_url, "CREATE SCHEMA lease", "CREATE TABLE lease.jobs (x INT)",
        "INSERT INTO lease.jobs VALUES (7)")
    for args in (["init", postgres_url], command("stats", postgres_url),
                 command("enqueue", postgres_url)):
        one_line_error(cli(*args), 2, "error:")
    assert sql(postgres_url, "SELECT * FROM lease.jobs") == [(7,)]
    assert [t for (t,) in sql(postgres_url, "SELECT tablename FROM pg_tables WHERE "
                                            "schemaname = 'lease'")] == ["jobs"]


# ------------------------------------------------------------------ the same figures


EVENTS = [{"id": f"o-{n}", "qty": n + 1} for n in range(6)] + [
    {"id": f"order:{n}", "body": {"n": n, "text": "caf\u00e9"}} for n in range(6)]


def _story(queue: str, tmp: Path, label: str) -> dict[str, object]:
    """The same operator's day on one queue; every command's output, times masked."""
    seen: dict[str, object] = {}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        out = cli(*args, stdin=stdin)
        stdout = out.stdout
        if args[0] == "stats" and out.returncode == 0:  # the dispatchers' moments and pids
            shown = json.loads(stdout)
            shown["workers"] = _masked(shown.get("workers", []))
            stdout = json.dumps(shown, sort_keys=True)
        seen[" ".join(args[:1] + args[2:])] = (out.returncode, stdout, out.stderr)
        return out

    lines = "".join(json.dumps(e) + "\n" for e in EVENTS)
    lines += json.dumps(EVENTS[0]) + "\n" + json.dumps({"id": "order:1", "body": {}}) + "\n"
    assert run("enqueue", queue, "--file", "-", stdin=lines).returncode == 1  # one conflict:
    assert json.loads(cli("stats", queue, "--json").stdout)["jobs"] == 0  # nothing enqueued
    assert run("enqueue", queue, "--file", "-", "--skip-conflicts",
               stdin=lines).returncode == 1  # the rest enqueued, the conflict named
    # past its deadline before anyone can claim it: the first claim moves it to dead
    run("enqueue", queue, "--id", "late", "--qty", "3", "--ttl-ms", "1")
    time.sleep(0.002)  # a deadline 1 ms after that intake is behind every clock from now on
    run("cancel", queue, "o-1", "order:2", "--note", "customer asked: stop")
    run("redrive", queue, "o-1", "--note", "re-opened")
    with ReceiverProcess(tmp / f"inbox-{label}.db") as rx:
        # its banner names the queue and the receiver's port: only its summary is compared
        out = cli("run", queue, "--url", rx.url, "--until-idle", "--owner", "same",
                  "--concurrency", "1", "--batch-size", "1")
    assert out.returncode == 3, out.stderr  # "late" went dead in this run
    summary = json.loads(out.stdout)
    seen["run summary"] = {k: summary[k] for k in ("ok", "dead", "dead_by_reason", "stale")}
    for args in (["stats", queue, "--json"], ["dead", queue], ["dead", queue, "--reason",
                                                                "cancelled"],
                 ["redrive", queue, "--reason", "deadline", "--note", "x", "--dry-run"],
                 ["cancel", queue, "o-0", "late", "ghost", "--note", "late"],
                 ["inspect", queue, "nope"]):
        run(*args)
    seen["inspect o-1"] = _masked(json.loads(cli("inspect", queue, "o-1", "--json").stdout))
    seen["inspect order:0"] = _masked(json.loads(cli("inspect", queue, "order:0",
                                                     "--json").stdout))
    out = cli("prune", queue, "--older-than", "0")
    seen["prune"] = (out.returncode, out.stdout.split(" (")[0])
    seen["stats after prune"] = json.loads(cli("stats", queue, "--json").stdout)
    return seen


TIMES = {"available_at", "deadline", "lease_until", "at_ms", "started_ms", "ended_ms",
         "latency_ms", "done_started_ms", "done_latency_ms", "done_after", "seq",
         "last_claim_ms", "pid"}


def _masked(record: object) -> object:
    """A record with its moments and row numbers replaced by whether they are set."""
    if isinstance(record, dict):
        return {k: (v is not None) if k in TIMES else _masked(v) for k, v in record.items()}
    if isinstance(record, list):
        return [_masked(v) for v in record]
    return record


def test_every_command_says_the_same_on_both_stores(postgres_url: str, tmp_path: Path):
    """The same input and commands on a SQLite file and on PostgreSQL: the same
    exit codes, the same lines, the same stats --json, dead listings and histories."""
    path = tmp_path / "queue.db"
    assert cli("init", str(path)).returncode == 0
    assert cli("init", postgres_url).returncode == 0
    on_sqlite = _story(str(path), tmp_path, "sqlite")
    on_postgres = _story(postgres_url, tmp_path, "postgres")

    def named(seen: dict, queue: str) -> dict:
        text = json.dumps(seen, sort_keys=True, indent=1).replace(json.dumps(queue)[1:-1], "Q")
        return json.loads(text)

    sqlite_view, postgres_view = named(on_sqlite, str(path)), named(on_postgres, postgres_url)
    assert sqlite_view.keys() == postgres_view.keys()
    for key in sqlite_view:
        assert sqlite_view[key] == postgres_view[key], key
    # and the figures are the story's, not two equal mistakes
    code, stdout, _ = on_postgres["stats --json"]  # type: ignore[misc]
    snap = json.loads(stdout)
    assert snap["by_status"] == {"pending": 0, "leased": 0, "done": 11, "dead": 2}
    assert snap["dead_by_reason"] == {"cancelled": 1, "deadline": 1}
    assert (code, snap["cancels"], snap["redrives"], snap["attempts_recorded"]) == (0, 2, 1, 11)
    assert on_postgres["run summary"] == {"ok": 11, "dead": 1, "stale": 0, "dead_by_reason": {
        "deadline": 1, "exhausted": 0, "permanent": 0}}
    assert on_postgres["stats after prune"]["jobs"] == 2  # type: ignore[index]


# ------------------------------------------------------------------ read only, for real


def test_the_commands_that_look_need_no_right_to_write(postgres_url: str):
    """stats, dead, inspect and the dry runs work for a role that may only SELECT:
    they write nothing, not even a migration's bookkeeping; a writer is refused."""
    assert cli("init", postgres_url).returncode == 0
    assert cli("enqueue", postgres_url, "--id", "j-1", "--qty", "1").returncode == 0
    role = f"cli_reader_{os.getpid()}"  # roles are the server's, not the database's
    sql(postgres_url, f"CREATE ROLE {role} LOGIN", f"GRANT USAGE ON SCHEMA lease TO {role}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA lease TO {role}")
    try:
        reader = urlunsplit(urlsplit(postgres_url)._replace(
            netloc=f"{role}@" + urlsplit(postgres_url).netloc.rpartition("@")[2]))
        for args in (["stats", reader, "--json"], ["dead", reader], ["inspect", reader, "j-1"],
                     ["redrive", reader, "--reason", "deadline", "--note", "x", "--dry-run"],
                     ["cancel", reader, "--reason", "deadline", "--note", "x", "--dry-run"]):
            out = cli(*args)
            assert out.returncode == 0, (args, out.stderr)
        assert '"jobs": 1' in cli("stats", reader, "--json").stdout
        one_line_error(cli("cancel", reader, "j-1", "--note", "x"), 1, "permission denied")
        assert sql(postgres_url, "SELECT status FROM lease.jobs") == [("pending",)]
    finally:
        sql(postgres_url, f"DROP OWNED BY {role}", f"DROP ROLE {role}")


# ------------------------------------------------------------------ a server that refuses


def test_a_wrong_password_and_an_unreachable_port_are_one_line_without_the_password(
        make_postgres_server):
    """A server that asks for a password: the wrong one is exit 1, one line, and
    neither it nor the right one appears anywhere; the right one works."""
    server = make_postgres_server()
    right, wrong = "correct-horse-9f3b", "wrong-battery-77aa"
    sql(server.url, f"ALTER ROLE postgres PASSWORD '{right}'")
    hba = server.data / "pg_hba.conf"
    hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
    sql(server.url, "SELECT pg_reload_conf()")
    good = with_password(server.url, right)
    bad = with_password(server.url, wrong)
    in_query = f"{server.url}?password={wrong}"
    unreachable = with_password(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
                                wrong)
    for url, message in ((bad, "password authentication failed"),
                         (in_query, "password authentication failed"),
                         (unreachable, "refused")):
        for args in (["init", url], command("stats", url), command("enqueue", url),
                     command("run", url), ["demo", "--store", url]):
            started = time.monotonic()
            out = cli(*args)
            err = one_line_error(out, 1, message)
            assert wrong not in err + out.stdout and right not in err + out.stdout
            assert "127.0.0.1" in err  # the server is named, its password is not
            assert time.monotonic() - started < 30  # generous: a refusal is not a timeout
    out = cli("init", good)
    assert out.returncode == 0 and right not in out.stdout + out.stderr
    assert out.stdout.startswith(f"created queue {server.url} (schema version ")


def test_a_url_that_does_not_parse_is_a_usage_error():
    out = cli("stats", "postgresql://postgres:hunter22@[::1/x")
    err = one_line_error(out, 2, "error:")
    assert "hunter22" not in err


# ------------------------------------------------------------------ the demo


def _processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_the_demo_tells_its_story_on_a_postgresql_queue(postgres_url: str, tmp_path: Path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = cli("demo", "--jobs", "60", "--concurrency", "8", "--store", postgres_url,
              env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "consistent: 61 orders" in out.stdout and " BAD " not in out.stdout
    assert "read from the queue database" in out.stdout
    assert f"the demo's jobs stay in {postgres_url}" in out.stdout
    assert list(scratch.iterdir()) == []  # its folder is gone
    assert _processes_naming(urlsplit(postgres_url).path) == []  # its dispatchers too
    # the evidence is in the database, for anyone to look at
    snap = json.loads(cli("stats", postgres_url, "--json").stdout)
    assert snap["by_status"]["done"] == 61 and snap["redrives"] >= 1
    # a second run would mix with the first one's jobs: refused, nothing started
    out = cli("demo", "--jobs", "10", "--store", postgres_url, env={"TMPDIR": str(scratch)})
    one_line_error(out, 2, "holds 61 job(s)")
    assert out.stdout == "" and list(scratch.iterdir()) == []


def test_the_demo_store_must_be_a_database():
    one_line_error(cli("demo", "--store", "queue.db"), 2, "--store needs a postgresql:// URL")


# ------------------------------------------------------------------ run, stopped


def test_run_on_postgresql_stops_gracefully_on_sigterm(postgres_url: str, tmp_path: Path):
    assert cli("init", postgres_url).returncode == 0
    lines = "".join(json.dumps({"id": f"s-{n}", "qty": 1}) + "\n" for n in range(200))
    assert cli("enqueue", postgres_url, "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db", "--latency-ms", "20") as rx:
        proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "run", postgres_url,
                                 "--url", rx.url, "--concurrency", "4"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ})
        try:
            deadline = time.monotonic() + 60
            while rx.stats()["applied"] < 10 and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"queue {postgres_url}," in err and "Traceback" not in err
    counts = dict(sql(postgres_url, "SELECT status, COUNT(*) FROM lease.jobs GROUP BY status"))
    assert "leased" not in counts
    assert json.loads(out)["ok"] == counts.get("done", 0) < 200


@pytest.mark.parametrize("scheme", ["postgres://"])
def test_the_short_scheme_names_the_same_queue(postgres_url: str, scheme: str):
    short = scheme + postgres_url.split("://", 1)[1]
    assert cli("init", short).returncode == 0
    assert cli("enqueue", short, "--id", "a", "--qty", "2").returncode == 0
    assert json.loads(cli("stats", postgres_url, "--json").stdout)["jobs"] == 1
