"""``asyncworker pause`` and ``resume``: the note required, the audit row with
the actor, ``stats`` and ``stats --json`` naming the pause, a repeat changing
nothing; ``stats`` listing the dispatchers at work."""

from __future__ import annotations

import json
from pathlib import Path

from lease.sqlite import SQLiteStore
from tests.support.commands import cli


def test_paused_and_resumed_from_the_command_line(tmp_path: Path):
    queue = str(tmp_path / "q.db")
    assert cli("init", queue).returncode == 0
    out = cli("pause", queue, "--note", "receiver upgrade", "--actor", "ops")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("paused since ") and "by ops (receiver upgrade)" in out.stdout
    again = cli("pause", queue, "--note", "twice")
    assert again.returncode == 0 and again.stdout.startswith("already paused since")
    stats = cli("stats", queue)
    assert "paused since" in stats.stdout and "by ops (receiver upgrade)" in stats.stdout
    shown = json.loads(cli("stats", queue, "--json").stdout)
    assert (shown["paused"]["actor"], shown["paused"]["note"]) == ("ops", "receiver upgrade")
    assert cli("resume", queue, "--note", "done").stdout.startswith("resumed")
    assert "paused" not in json.loads(cli("stats", queue, "--json").stdout)
    assert cli("resume", queue, "--note", "done").stdout.startswith("not paused")
    with SQLiteStore(queue, read_only=True) as store:
        assert [(row["action"], row["actor"]) for row in store.queue_audit()] == [
            ("pause", "ops"), ("resume", None)]


def test_stats_lists_the_dispatchers_at_work(tmp_path: Path):
    queue = str(tmp_path / "q.db")
    assert cli("init", queue).returncode == 0
    assert "workers" not in json.loads(cli("stats", queue, "--json").stdout)
    with SQLiteStore(queue) as store:
        store.register_worker("d1", "host-a", 4242)
        store.claim_jobs("d1", 30_000, 1)
    [row] = json.loads(cli("stats", queue, "--json").stdout)["workers"]
    assert (row["owner"], row["host"], row["pid"]) == ("d1", "host-a", 4242)
    text = cli("stats", queue).stdout
    assert "dispatcher" in text and "host-a" in text and "4242" in text


def test_a_pause_without_a_note_is_a_usage_error(tmp_path: Path):
    queue = str(tmp_path / "q.db")
    assert cli("init", queue).returncode == 0
    out = cli("pause", queue)
    assert out.returncode == 2 and "--note" in out.stderr
