"""Tier 4: ``asyncworker endpoint ...``, ``enqueue --type``, ``stats`` per
endpoint and ``run`` of a queue's endpoints, each a real child process on a
real queue file. What is checked: every action's line and its audit row, no
secret or header value in anything printed, each bad input one line with its
exit code and the queue exactly as it was, the removal refused with live
deliveries (and how many, and the way out), and messages fanned out by type."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lease.stores import open_store
from tests.support.commands import cli
from tests.support.waiting import wait_until

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
ROTATED = "whsec_" + base64.b64encode(b"r" * 32).decode()
TOKEN = "Bearer tok-do-not-echo-4242"
SECRET_WORDS = (SECRET, ROTATED, TOKEN, "tok-do-not-echo", SECRET[6:20], ROTATED[6:20])
URL = "http://127.0.0.1:9/hooks"


def ok(*args: object) -> str:
    out = cli(*map(str, args))
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    no_secret(out.stdout + out.stderr)
    return out.stdout


def no_secret(text: str) -> None:
    for word in SECRET_WORDS:
        assert word not in text


def refused(code: int, *args: object) -> str:
    """A refusal: its exit code, one line on stderr (returned), nothing on stdout."""
    out = cli(*map(str, args))
    assert out.returncode == code, (args, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert out.stdout == ""
    no_secret(out.stderr)
    return lines[0]


def private(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def q(tmp_path: Path) -> Path:
    path = tmp_path / "q.db"
    ok("init", path)
    return path


@pytest.fixture
def files(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    folder.mkdir()
    private(folder / "secrets", f"# acme's, rotating\n{SECRET}\n{ROTATED}\n")
    private(folder / "headers", f"Authorization: {TOKEN}\nX-Tenant: acme\n")
    return folder


def state(path: Path) -> tuple:
    """Everything an endpoint command may change: endpoints, their audit, the jobs."""
    with open_store(path, read_only=True) as store:
        return (store.endpoints(), store.endpoint_audit(),
                store.list_jobs(limit=1000), store.endpoint_stats())


def endpoints(path: Path) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(ok("endpoint", "list", path, "--json"))}


# ------------------------------------------------------------------ the actions


def test_add_list_show_update_disable_enable_remove(q: Path, files: Path):
    line = ok("endpoint", "add", q, "acme", URL, "--secret-file", files / "secrets",
              "--header-file", files / "headers", "--type", "invoice.paid", "--type",
              "user/created", "--max-in-flight", "4", "--rate", "2.5", "--note",
              "new customer", "--actor", "ops-ann")
    assert line.strip() == (f"added endpoint acme to {q}: {URL} (types invoice.paid, "
                            f"user/created; signed with 2 secrets; at most 4 in flight, "
                            f"2.5/s (burst 3); enabled)")
    ok("endpoint", "add", q, "beta", "http://localhost:9/b", "--disabled")

    found = endpoints(q)
    assert sorted(found) == ["acme", "beta"]
    assert {k: found["acme"][k] for k in ("url", "secrets", "headers", "types",
                                          "max_in_flight", "rate", "burst", "enabled")} == {
        "url": URL, "secrets": 2, "headers": ["Authorization", "X-Tenant"],
        "types": ["invoice.paid", "user/created"], "max_in_flight": 4, "rate": 2.5,
        "burst": 3, "enabled": True}
    assert (found["beta"]["types"], found["beta"]["enabled"]) == (["*"], False)

    table = ok("endpoint", "list", q).splitlines()
    assert table[0].split() == ["name", "enabled", "url", "types", "limits", "signed", "headers"]
    assert table[1].startswith("acme ") and "Authorization,X-Tenant" in table[1]
    assert table[2].startswith("beta ") and " no " in table[2] and "unsigned" in table[2]
    assert table[-1] == "2 endpoints"

    shown = json.loads(ok("endpoint", "show", q, "acme", "--json"))
    assert {k: shown[k] for k in ("name", "ready", "in_flight", "done", "retried", "dead",
                                  "last_error", "last_success_ms")} == {
        "name": "acme", "ready": 0, "in_flight": 0, "done": 0, "retried": 0, "dead": 0,
        "last_error": None, "last_success_ms": None}
    assert [(a["action"], a["note"], a["actor"]) for a in shown["audit"]] == [
        ("add", "new customer", "ops-ann")]

    ok("endpoint", "update", q, "acme", "--clear-rate", "--max-in-flight", "8", "--type", "*",
       "--note", "raised the cap", "--actor", "ops-bob")
    ok("endpoint", "update", q, "acme", "--secret-file", files / "secrets", "--clear-headers")
    ok("endpoint", "disable", q, "acme", "--note", "their endpoint is down")
    ok("endpoint", "enable", q, "acme", "--actor", "ops-ann")
    acme = endpoints(q)["acme"]
    assert (acme["rate"], acme["burst"], acme["max_in_flight"], acme["types"],
            acme["headers"], acme["enabled"]) == (None, None, 8, ["*"], [], True)

    text = ok("endpoint", "show", q, "acme")
    assert "limits        at most 8 in flight" in text and "signed        signed with 2" in text
    audit = json.loads(ok("endpoint", "show", q, "acme", "--json"))["audit"]
    assert [(a["action"], a["fields"], a["note"], a["actor"]) for a in audit] == [
        ("add", [], "new customer", "ops-ann"),
        ("update", ["max_in_flight", "rate", "types"], "raised the cap", "ops-bob"),
        ("update", ["headers", "secrets"], None, None),
        ("disable", ["enabled"], "their endpoint is down", None),
        ("enable", ["enabled"], None, "ops-ann")]
    assert "raised the cap" in text and "ops-bob" in text

    assert ok("endpoint", "remove", q, "beta", "--note", "trial over").strip() == (
        f"removed endpoint beta from {q}")
    assert sorted(endpoints(q)) == ["acme"]


def test_a_secret_or_a_header_value_is_never_printed_nor_in_the_audit(q: Path, files: Path):
    ok("endpoint", "add", q, "acme", URL, "--secret-file", files / "secrets",
       "--header-file", files / "headers")
    ok("endpoint", "update", q, "acme", "--header-file", files / "headers")
    printed = "".join(cli(*map(str, args)).stdout for args in (
        ("endpoint", "list", q), ("endpoint", "list", q, "--json"),
        ("endpoint", "show", q, "acme"), ("endpoint", "show", q, "acme", "--json"),
        ("stats", q), ("stats", q, "--json")))
    assert "acme" in printed and "Authorization" in printed
    no_secret(printed)
    with open_store(q, read_only=True) as store:
        no_secret(json.dumps(store.endpoint_audit()))


def test_a_secrets_file_others_may_read_is_used_with_one_warning(q: Path, files: Path):
    (files / "secrets").chmod(0o644)
    out = cli("endpoint", "add", str(q), "acme", URL, "--secret-file", str(files / "secrets"))
    assert out.returncode == 0
    warnings = [line for line in out.stderr.splitlines() if "open to other users" in line]
    assert len(warnings) == 1 and "--secret-file" in warnings[0]
    (files / "headers").chmod(0o640)
    out = cli("endpoint", "update", str(q), "acme", "--header-file", str(files / "headers"))
    assert out.returncode == 0 and "--header-file" in out.stderr and "chmod 600" in out.stderr


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("argv", "code", "words"), [
    # usage: a field, a file, a flag (exit 2)
    (["add", "{q}", "acme", "http://example.com/h"], 2,
     "URL: plain http only to a loopback host, got 'example.com': use https://, or "
     "--insecure-plain-http to send in the clear"),
    (["add", "{q}", "acme", "https://example.com/h", "--burst", "3"], 2,
     "--burst goes with --rate"),
    (["add", "{q}", "acme", URL, "--ca-file", "{k}/secrets"], 2,
     "--ca-file goes with an https:// URL"),
    (["add", "{q}", "acme", "https://example.com/h", "--ca-file", "{k}/missing"], 2,
     "--ca-file: file not found"),
    (["add", "{q}", "acme", URL, "--type", "*", "--type", "a.b"], 2, "stands alone"),
    (["add", "{q}", "acme", URL, "--secret-file", "{k}/everyone"], 2,
     "writable by every user"),
    (["add", "{q}", "acme", URL, "--secret-file", "{k}/headers"], 2, "headers line 1: "),
    (["add", "{q}", "acme", URL, "--header-file", "{k}/bad-headers"], 2,
     "--header-file: {k}/bad-headers line 2: header 'Content-Type' is the sender's own"),
    (["add", "{q}", "acme", URL, "--header-file", "{k}/missing"], 2,
     "--header-file: file not found"),
    (["add", "{q}", "bad name", URL], 2, "an endpoint's name is 1-64 ASCII letters"),
    (["add", "{q}/nope.db", "acme", URL], 2, "queue file not found"),
    (["add", "{q}", "acme", URL, "--note", ""], 2, "note must be 1-500 characters"),
    (["update", "{q}", "acme"], 2, "nothing to change"),
    (["update", "{q}", "acme", "--rate", "1", "--clear-rate"], 2, "--clear-rate goes without"),
    (["update", "{q}", "taken", "--url", "http://example.com/h"], 2, "--insecure-plain-http"),
    (["update", "{q}", "taken", "--burst", "2"], 2, "--burst goes with --rate"),
    (["update", "{q}", "taken", "--secure-only", "--insecure-plain-http"], 2, "opposite"),
    (["update", "{q}", "taken", "--type", "a", "--type", "a"], 2, "types must be distinct"),
    (["update", "{q}", "taken", "--secret-file", "{k}/secrets", "--clear-secrets"], 2,
     "--clear-secrets goes without a new value"),
    (["remove", "{q}", "acme", "--cancel-deliveries"], 2,
     "--cancel-deliveries needs --note"),
    # the work refused (exit 1)
    (["add", "{q}", "taken", URL], 1, "endpoint 'taken' exists already"),
    (["update", "{q}", "ghost", "--max-in-flight", "2"], 1, "no endpoint 'ghost' in"),
    (["disable", "{q}", "ghost"], 1, "no endpoint 'ghost' in"),
    (["enable", "{q}", "ghost"], 1, "no endpoint 'ghost' in"),
    (["remove", "{q}", "ghost"], 1, "no endpoint 'ghost' in"),
    (["show", "{q}", "ghost"], 1, "no endpoint 'ghost' in"),
])
def test_each_bad_input_is_one_line_and_leaves_the_queue_as_it_was(
        q: Path, files: Path, argv: list[str], code: int, words: str):
    private(files / "everyone", f"{SECRET}\n", 0o666)
    private(files / "bad-headers", f"X-Ok: fine\nContent-Type: {TOKEN}\n")
    ok("endpoint", "add", q, "taken", URL, "--secret-file", files / "secrets")
    ok("enqueue", q, "--id", "m-1", "--body", "{}")
    before = state(q)
    fill = {"q": str(q), "k": str(files)}
    line = refused(code, "endpoint", *(arg.format(**fill) for arg in argv))
    assert line.startswith(f"asyncworker endpoint {argv[0]}: ")
    assert words.format(**fill) in line
    assert state(q) == before


def test_a_secret_is_not_taken_from_the_command_line(q: Path):
    """No option takes a secret's value (``ps`` shows every argument): given
    one, it is read as a path (--secret abbreviates --secret-file), and refused."""
    out = cli("endpoint", "add", str(q), "acme", URL, "--secret", SECRET)
    assert out.returncode == 2 and "--secret-file: file not found" in out.stderr
    assert endpoints(q) == {}


# ------------------------------------------------------------------ fan-out by type


def test_enqueue_type_fans_out_to_the_endpoints_subscribed(q: Path, tmp_path: Path):
    ok("endpoint", "add", q, "all", URL)
    ok("endpoint", "add", q, "paid", URL, "--type", "invoice.paid")
    ok("endpoint", "add", q, "users", URL, "--type", "user/created", "--type", "user/deleted")
    ok("enqueue", q, "--id", "m-1", "--body", '{"n": 1}', "--type", "invoice.paid")
    ok("enqueue", q, "--id", "m-2", "--body", '{"n": 2}')  # no type: '*' only
    lines = tmp_path / "events.jsonl"
    lines.write_text("\n".join(json.dumps(event) for event in (
        {"id": "m-3", "body": {"n": 3}, "type": "user/deleted"},
        {"id": "m-4", "body": {"n": 4}},  # --type below gives it one
        {"id": "m-5", "qty": 5, "type": "invoice.paid", "key": "cust-1"},
    )) + "\n")
    assert ok("enqueue", q, "--file", lines, "--type", "user/created").strip() == (
        "3 new, 0 duplicate, 0 conflicting")
    with open_store(q, read_only=True) as store:
        jobs = store.list_jobs(limit=100)
    assert sorted((job["message"], job["endpoint"], job.get("type", job.get("event_type")))
                  for job in jobs) == [
        ("m-1", "all", "invoice.paid"), ("m-1", "paid", "invoice.paid"),
        ("m-2", "all", None),
        ("m-3", "all", "user/deleted"), ("m-3", "users", "user/deleted"),
        ("m-4", "all", "user/created"), ("m-4", "users", "user/created"),
        ("m-5", "all", "invoice.paid"), ("m-5", "paid", "invoice.paid")]
    assert {job["id"] for job in jobs if job["message"] == "m-5"} == {"m-5@all", "m-5@paid"}
    # the same message again is a duplicate; with another type, a conflict
    assert ok("enqueue", q, "--id", "m-1", "--body", '{"n": 1}', "--type",
              "invoice.paid").strip() == "0 new, 1 duplicate, 0 conflicting"
    out = cli("enqueue", str(q), "--id", "m-1", "--body", '{"n": 1}', "--type", "other")
    assert out.returncode == 1 and "conflict" in out.stderr


def test_a_bad_type_in_a_file_names_its_line_and_enqueues_nothing(q: Path, tmp_path: Path):
    ok("endpoint", "add", q, "all", URL)
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"id": "a", "body": {}, "type": "ok.type"}\n'
                     '{"id": "b", "body": {}, "type": "not a type"}\n')
    line = refused(2, "enqueue", q, "--file", lines)
    assert "line 2: event type must be 1-100 letters" in line and "nothing was enqueued" in line
    assert json.loads(ok("stats", q, "--json"))["jobs"] == 0


# ------------------------------------------------------------------ remove, stats


def test_remove_is_refused_with_live_deliveries_and_cancels_them_when_asked(q: Path):
    ok("endpoint", "add", q, "acme", URL)
    ok("endpoint", "add", q, "other", URL)
    for n in range(3):
        ok("enqueue", q, "--id", f"m-{n}", "--body", "{}")
    before = state(q)
    line = refused(1, "endpoint", "remove", q, "acme")
    assert "endpoint 'acme' has 3 deliveries pending; nothing removed" in line
    assert "--cancel-deliveries --note NOTE cancels them with the removal" in line
    assert state(q) == before

    assert ok("endpoint", "remove", q, "acme", "--cancel-deliveries", "--note",
              "customer left", "--actor", "ops-ann").strip() == (
        f"removed endpoint acme from {q}, 3 pending deliveries cancelled")
    assert sorted(endpoints(q)) == ["other"]
    history = json.loads(ok("inspect", q, "m-1@acme", "--json"))
    assert history["job"]["status"] == "dead" and history["job"]["reason"] == "cancelled"
    assert [(c["note"], c.get("actor")) for c in history["cancels"]] == [
        ("customer left", "ops-ann")]
    with open_store(q, read_only=True) as store:
        assert [(a["endpoint"], a["action"], a["note"], a["actor"])
                for a in store.endpoint_audit() if a["action"] == "remove"] == [
            ("acme", "remove", "customer left", "ops-ann")]
        assert {job["status"] for job in store.list_jobs(limit=100)
                if job["endpoint"] == "other"} == {"pending"}


def test_remove_is_refused_while_a_delivery_is_leased(q: Path):
    ok("endpoint", "add", q, "acme", URL)
    ok("enqueue", q, "--id", "m-1", "--body", "{}")
    ok("enqueue", q, "--id", "m-2", "--body", "{}")
    with open_store(q) as store:
        claimed = store.claim_jobs("someone", 60_000, 1, endpoints="*")
        assert len(claimed.leased) == 1
    before = state(q)
    for extra in ([], ["--cancel-deliveries", "--note", "gone"]):
        line = refused(1, "endpoint", "remove", q, "acme", *extra)
        assert "1 delivery in flight" in line and "Disable it" in line
    assert state(q) == before


def test_stats_shows_each_endpoints_figures(q: Path):
    assert "endpoints" not in json.loads(ok("stats", q, "--json"))  # none yet: as before
    assert "endpoint" not in ok("stats", q)
    ok("endpoint", "add", q, "acme", URL)
    ok("endpoint", "add", q, "beta", URL, "--type", "x", "--disabled")
    ok("enqueue", q, "--id", "m-1", "--body", "{}")
    ok("enqueue", q, "--id", "m-2", "--body", "{}", "--type", "x")
    snap = json.loads(ok("stats", q, "--json"))
    assert [{k: e[k] for k in ("name", "enabled", "ready", "in_flight", "done", "retried",
                                "dead", "last_error", "last_success_ms")}
            for e in snap["endpoints"]] == [
        {"name": "acme", "enabled": True, "ready": 2, "in_flight": 0, "done": 0, "retried": 0,
         "dead": 0, "last_error": None, "last_success_ms": None},
        {"name": "beta", "enabled": False, "ready": 1, "in_flight": 0, "done": 0,
         "retried": 0, "dead": 0, "last_error": None, "last_success_ms": None}]
    table = ok("stats", q).split("\n\n")[1].splitlines()
    assert table[0].split() == ["endpoint", "enabled", "ready", "in", "flight", "done",
                                "retried", "dead", "last", "success", "last", "error"]
    assert table[1].split() == ["acme", "yes", "2", "0", "0", "0", "0", "-", "-"]
    assert table[2].split() == ["beta", "no", "1", "0", "0", "0", "0", "-", "-"]


# ------------------------------------------------------------------ run


@pytest.mark.parametrize(("argv", "words"), [
    (["--url", URL, "--endpoint", "acme"], "--endpoint goes without --url"),
    ([], "has no endpoints: give --url"),
    (["--endpoint", "acme"], "has no endpoints: give --url"),
    (["--secret-file", "{q}"], "--secret-file goes with --url"),
    (["--ack", "status", "--insecure-plain-http"], "--ack, --insecure-plain-http go with --url"),
    (["--crash-after-acks", "1"], "--crash-after-acks goes with --url"),
])
def test_run_refuses_what_does_not_name_one_target(q: Path, argv: list[str], words: str):
    before = state(q)
    line = refused(2, "run", q, "--until-idle", *(a.format(q=q) for a in argv))
    assert line.startswith("asyncworker run: ") and words in line
    assert state(q) == before


def test_run_refuses_an_endpoint_the_queue_does_not_have(q: Path):
    ok("endpoint", "add", q, "acme", URL)
    line = refused(2, "run", q, "--until-idle", "--endpoint", "acme", "--endpoint", "ghost")
    assert f"no endpoint 'ghost' in {q} (it has acme)" in line


def figures_of(path: Path) -> dict[str, dict]:
    with open_store(path, read_only=True) as store:
        return {row["name"]: row for row in store.endpoint_stats()}


def test_run_serves_every_endpoint_or_the_ones_named(q: Path, tmp_path: Path):
    """Two receivers, one signing: run --endpoint sends one endpoint's
    deliveries alone; run without it the rest; each receiver gets what its
    endpoint subscribed to, signed with the endpoint's own secret."""
    from tests.support.servers import ReceiverProcess

    keys = private(tmp_path / "secrets", f"{SECRET}\n")
    with ReceiverProcess(tmp_path / "a.db", "--secret-file", str(keys)) as signed, \
            ReceiverProcess(tmp_path / "b.db") as plain:
        ok("endpoint", "add", q, "acme", signed.url, "--secret-file", keys, "--type", "paid")
        ok("endpoint", "add", q, "beta", plain.url)
        for n in range(6):
            ok("enqueue", q, "--id", f"m-{n}", "--body", json.dumps({"n": n}),
               *(("--type", "paid") if n % 2 else ()))
        # --until-idle waits for the whole queue: this run is stopped once its part is done
        run = subprocess.Popen([sys.executable, "-m", "asyncworker", "run", str(q),
                                "--endpoint", "acme"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: figures_of(q)["acme"]["done"] == 3, "acme's 3 deliveries done",
                       60)
        finally:
            run.send_signal(signal.SIGTERM)
            stdout, stderr = run.communicate(timeout=60)
        assert run.returncode == 0, stderr
        assert "endpoints acme," in stderr and json.loads(stdout)["dead"] == 0
        figures = figures_of(q)
        assert (figures["acme"]["done"], figures["acme"]["ready"]) == (3, 0)
        assert (figures["beta"]["done"], figures["beta"]["ready"]) == (0, 6)
        assert signed.stats()["applied"] == 3 and plain.stats()["applied"] == 0

        out = cli("run", str(q), "--until-idle", timeout=120)
        assert out.returncode == 0, out.stderr
        assert "endpoints acme, beta (and any added while it runs)" in out.stderr
        figures = figures_of(q)
        assert (figures["beta"]["done"], figures["beta"]["ready"]) == (6, 0)
        assert figures["beta"]["last_success_ms"] is not None
        assert plain.stats()["applied"] == 6 and signed.stats()["applied"] == 3
    no_secret(out.stdout + out.stderr)


def test_dead_and_inspect_name_a_deliverys_endpoint_message_and_type(q: Path):
    ok("endpoint", "add", q, "acme", URL)
    ok("enqueue", q, "--id", "m-1", "--body", "{}", "--type", "invoice.paid", "--key", "c-1")
    ok("cancel", q, "m-1@acme", "--note", "not wanted")
    table = ok("dead", q).splitlines()
    assert table[0].split()[:3] == ["id", "endpoint", "key"]
    assert table[1].split()[:3] == ["m-1@acme", "acme", "c-1"]
    record = ok("inspect", q, "m-1@acme")
    for name, value in (("endpoint", "acme"), ("message", "m-1"), ("type", "invoice.paid"),
                        ("key", "c-1")):
        assert any(line.split() == [name, value] for line in record.splitlines()), record
