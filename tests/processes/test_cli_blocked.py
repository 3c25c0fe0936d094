"""``stats`` names the blocked keys: each ordering key whose first job is
dead, with that job, why, and how many wait behind it; in the table and in
``--json``; and nothing of it when no key is blocked. A real SQLite file and
real ``asyncworker`` processes."""

from __future__ import annotations

import json
from pathlib import Path

from lease.policy import RetryPolicy
from lease.records import Attempt
from lease.stores import open_store
from tests.support.commands import cli


def blocked_queue(path: Path) -> str:
    name = str(path)
    with open_store(name, create=True) as store:
        store.enqueue_events([{"id": f"{key}-{i}", "body": {"n": i}, "key": key}
                              for key in ("cart-1", "cart-2") for i in range(1 + (key == "cart-2"))]
                             + [{"id": "free", "body": {"n": 0}}], RetryPolicy(max_attempts=1))
        leased = {job.ticket["id"]: job for job in store.claim_jobs("w", 10_000, 10).leased}
        now = store.now_ms()
        store.finish_jobs([(leased["cart-1-0"].ticket, "ok", 0, Attempt(now, 1, 200)),
                           (leased["cart-2-0"].ticket, "permanent", 0, Attempt(now, 1, 422)),
                           (leased["free"].ticket, "permanent", 0, Attempt(now, 1, 422))])
    return name


def test_stats_names_each_blocked_key_with_its_dead_head(tmp_path: Path):
    queue = blocked_queue(tmp_path / "q.db")
    done = cli("stats", queue)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("blocked key "))
    assert lines[header].split() == ["blocked", "key", "endpoint", "dead", "first", "job",
                                     "reason", "waiting"]
    assert lines[header + 1].split() == ["cart-2", "-", "cart-2-0", "permanent", "1"]
    as_json = json.loads(cli("stats", queue, "--json").stdout)
    assert as_json["blocked_heads"] == [{"key": "cart-2", "endpoint": None, "id": "cart-2-0",
                                         "reason": "permanent", "waiting": 1}]


def test_stats_says_nothing_of_blocked_keys_when_none_is(tmp_path: Path):
    queue = blocked_queue(tmp_path / "q.db")
    with open_store(queue) as store:
        assert store.cancel_jobs(["cart-2-0"], "given up") == [True]
    done = cli("stats", queue)
    assert done.returncode == 0 and "blocked key " not in done.stdout
    assert "blocked_heads" not in json.loads(cli("stats", queue, "--json").stdout)
