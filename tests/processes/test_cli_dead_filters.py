"""``asyncworker dead``, ``redrive`` and ``cancel`` narrowed by the last
attempt's error and HTTP status and by when the jobs went dead (the page's
filters, by the same rules), on SQLite and PostgreSQL: what a bulk change
picks is exactly what the listing shows, and a narrower without --reason is
a usage error that changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lease.stores import open_store
from tests.support.queues import dead_after_410_and_a_timeout


@pytest.fixture(params=["sqlite", "postgresql"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Three deliveries dead after a 410 and one after a timeout."""
    return dead_after_410_and_a_timeout(
        str(tmp_path / "queue.db") if request.param == "sqlite"
        else request.getfixturevalue("postgres_url"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                          text=True, timeout=60)


def dead_ids(queue: str, *args: str) -> list[str]:
    done = cli("dead", queue, "--json", *args)
    assert done.returncode == 0, done.stderr
    return [row["id"] for row in json.loads(done.stdout)]


def test_dead_lists_by_error_status_and_time(queue: str) -> None:
    assert dead_ids(queue, "--http-status", "4xx") == ["gone:0", "gone:1", "gone:2"]
    assert dead_ids(queue, "--http-status", "410", "--limit", "2") == ["gone:0", "gone:1"]
    assert dead_ids(queue, "--http-status", "503") == []
    assert dead_ids(queue, "--error", "timed out") == ["slow"]
    assert dead_ids(queue, "--since", "1h") == ["gone:0", "gone:1", "gone:2", "slow"]
    assert dead_ids(queue, "--until", "2020-01-01") == []
    assert dead_ids(queue, "--since", "2020-01-01", "--until", "1h") == []


def test_a_bulk_redrive_picks_what_the_filters_match(queue: str) -> None:
    dry = cli("redrive", queue, "--reason", "permanent", "--http-status", "410",
              "--since", "1h", "--note", "gone is back", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "3 to redrive (dry run" in dry.stdout and "slow" not in dry.stdout
    done = cli("redrive", queue, "--reason", "permanent", "--http-status", "410",
               "--note", "gone is back")
    assert done.returncode == 0, done.stderr
    assert dead_ids(queue) == ["slow"]
    cancelled = cli("cancel", queue, "--reason", "permanent", "--error", "timed out",
                    "--note", "not wanted")
    assert cancelled.returncode == 0, cancelled.stderr
    with open_store(queue, read_only=True) as store:
        assert [(job["id"], job["reason"]) for job in store.jobs_with_status("dead")] == [
            ("slow", "cancelled")]
        assert len(store.jobs_with_status("pending")) == 3


@pytest.mark.parametrize("args, words", [
    (("--http-status", "410"), "--http-status goes with --reason"),
    (("--error", "Gone", "--since", "1h"), "--error, --since go with --reason"),
    (("--reason", "permanent", "--http-status", "4x"), "an HTTP status (503) or a class"),
    (("--reason", "permanent", "--since", "yesterday"), "an ISO 8601 time"),
    (("--reason", "permanent", "--error", "a\tb"), "without control characters"),
])
def test_a_bad_narrower_is_a_usage_error_that_changes_nothing(
        queue: str, args: tuple[str, ...], words: str) -> None:
    done = cli("redrive", queue, *args, "--note", "n")
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert len(dead_ids(queue)) == 4
