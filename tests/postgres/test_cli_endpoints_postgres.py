"""Tier 4: ``asyncworker endpoint ...`` and ``stats`` of a queue's endpoints on
a real PostgreSQL server, called as a user calls them (subprocess): the same
exit codes, lines and JSON as on a SQLite file, and no secret in any of them.
The commands' own rules are tests/processes/test_cli_endpoints.py's."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tests.support.commands import cli

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
TOKEN = "Bearer tok-do-not-echo-4242"
URL = "http://127.0.0.1:9/hooks"


def masked(record: object) -> object:
    """A record with its moments replaced by whether they are set."""
    if isinstance(record, dict):
        return {k: (v is not None) if k.endswith("_ms") else masked(v)
                for k, v in record.items()}
    if isinstance(record, list):
        return [masked(v) for v in record]
    return record


def story(queue: str, keys: Path) -> list[tuple[int, object, str]]:
    """The operator's story of two endpoints, on one queue: each command's exit
    code, its output (JSON masked, the queue's name as Q) and its error line."""
    steps = [
        ["endpoint", "add", queue, "acme", URL, "--secret-file", str(keys / "secrets"),
         "--header-file", str(keys / "headers"), "--type", "invoice.paid",
         "--max-in-flight", "4", "--rate", "2.5", "--note", "new customer",
         "--actor", "ops-ann"],
        ["endpoint", "add", queue, "beta", URL, "--disabled"],
        ["endpoint", "update", queue, "acme", "--clear-rate", "--max-in-flight", "8",
         "--type", "*", "--note", "raised the cap", "--actor", "ops-bob"],
        ["enqueue", queue, "--id", "m-1", "--body", "{}", "--type", "invoice.paid"],
        ["endpoint", "list", queue],
        ["endpoint", "show", queue, "acme", "--json"],
        ["stats", queue, "--json"],
        ["endpoint", "remove", queue, "beta"],
        ["endpoint", "remove", queue, "beta", "--cancel-deliveries", "--note", "trial over"],
        ["endpoint", "list", queue, "--json"],
    ]
    seen: list[tuple[int, object, str]] = []
    for argv in steps:
        out = cli(*argv)
        for text in (out.stdout, out.stderr):
            assert SECRET not in text and "tok-do-not-echo" not in text
        stdout = out.stdout.replace(queue, "Q")
        shown = masked(json.loads(stdout)) if "--json" in argv and out.returncode == 0 \
            else stdout
        seen.append((out.returncode, shown, out.stderr.replace(queue, "Q")))
    return seen


def test_the_endpoint_commands_say_the_same_on_both_stores(postgres_url: str,
                                                            tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    for name, text in (("secrets", f"{SECRET}\n"), ("headers", f"Authorization: {TOKEN}\n")):
        (keys / name).write_text(text)
        (keys / name).chmod(0o600)
    path = str(tmp_path / "q.db")
    assert cli("init", path).returncode == 0
    assert cli("init", postgres_url).returncode == 0
    on_sqlite, on_postgres = story(path, keys), story(postgres_url, keys)
    for step, (sqlite_seen, postgres_seen) in enumerate(zip(on_sqlite, on_postgres,
                                                            strict=True)):
        assert sqlite_seen == postgres_seen, step
    # and what they say is the story's, not two equal mistakes
    assert [code for code, _, _ in on_postgres] == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    shown = on_postgres[5][1]
    assert isinstance(shown, dict)
    assert (shown["max_in_flight"], shown["rate"], shown["types"], shown["secrets"],
            shown["headers"], shown["ready"]) == (8, None, ["*"], 1, ["Authorization"], 1)
    assert [(a["action"], a["fields"], a["actor"]) for a in shown["audit"]] == [
        ("add", [], "ops-ann"), ("update", ["max_in_flight", "rate", "types"], "ops-bob")]
    stats = on_postgres[6][1]
    assert isinstance(stats, dict)
    assert [(e["name"], e["enabled"], e["ready"], e["circuit"]["state"])
            for e in stats["endpoints"]] == [("acme", True, 1, "closed"),
                                             ("beta", False, 1, "closed")]
    assert "endpoint 'beta' has 1 delivery pending; nothing removed" in on_postgres[7][2]
    assert on_postgres[8][1] == "removed endpoint beta from Q, 1 pending delivery cancelled\n"
    assert [e["name"] for e in on_postgres[9][1]] == ["acme"]  # type: ignore[union-attr]
