"""An event enqueued again after its job was pruned, or by a second queue,
meets the receiver with a lower claim token than the one it saw: the same id
and body is a duplicate, acknowledged and absorbed; never a dead job.

End to end, the way an operator does it: ``asyncworker`` commands as child
processes, a real ``serve`` receiver, a SQLite file and the test PostgreSQL
server. Within one job's life a stale sender is still fenced: its send is a
duplicate at the inbox, its finish refused by the queue.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncworker.receiving.inbox import read_inbox
from lease import worker
from lease.http import send_http
from lease.policy import canonical_body
from lease.stores import open_store
from tests.support.commands import cli
from tests.support.queues import T0
from tests.support.servers import ReceiverProcess

BODY = {"order": 42, "total": "9.90"}
EVENT_ID = "order:42"
NOWHERE = "http://127.0.0.1:9/events"  # nothing listens: every send fails, retryable


@pytest.fixture(params=["sqlite", "postgres"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        path = str(tmp_path / "queue.db")
        assert cli("init", path).returncode == 0
        return path
    url = request.getfixturevalue("postgres_url")
    assert cli("init", url).returncode == 0
    return url


def ok(*args: str) -> str:
    out = cli(*args)
    assert out.returncode == 0, (args, out.returncode, out.stdout, out.stderr)
    return out.stdout


def enqueue(queue: str) -> str:
    return ok("enqueue", queue, "--id", EVENT_ID, "--body", json.dumps(BODY),
              "--max-attempts", "3").strip()


def run(queue: str, url: str) -> tuple[int, str]:
    out = cli("run", queue, "--url", url, "--until-idle", "--backoff-base-ms", "1",
              "--backoff-cap-ms", "1", "--lease-ms", "5000")
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stdout + out.stderr


def job(queue: str) -> dict:
    with open_store(queue, read_only=True) as store:
        found = store.job_history(EVENT_ID)
    assert found is not None
    return {key: found["job"][key] for key in ("status", "reason", "token")}


def deliver_at_token_4(queue: str, url: str) -> None:
    """Three failed attempts (dead, exhausted), a redrive, then the fourth
    claim delivers: the receiver has seen token 4 for the id."""
    assert enqueue(queue) == "1 new, 0 duplicate, 0 conflicting"
    code, said = run(queue, NOWHERE)
    assert code == 3, said
    assert job(queue) == {"status": "dead", "reason": "exhausted", "token": 3}
    ok("redrive", queue, EVENT_ID, "--note", "receiver back")
    assert run(queue, url)[0] == 0
    assert job(queue) == {"status": "done", "reason": None, "token": 4}


def applied_once(inbox: Path) -> None:
    contents = read_inbox(inbox)
    assert contents.applied == {EVENT_ID: canonical_body(BODY)[1]}
    assert contents.conflicts == 0


def test_an_id_enqueued_again_after_prune_is_a_duplicate_at_the_receiver(
        queue: str, tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        deliver_at_token_4(queue, rx.url)
        assert ok("prune", queue, "--older-than", "0").startswith("1 done jobs pruned")
        assert enqueue(queue) == "1 new, 0 duplicate, 0 conflicting"  # new again
        code, said = run(queue, rx.url)
        assert code == 0, said  # was: 409 stale token 1, dead/permanent, exit 3
        assert job(queue) == {"status": "done", "reason": None, "token": 1}
        stats = rx.stats()
    assert (stats["applied"], stats["duplicates"], stats["stale_senders"],
            stats["conflicts"]) == (1, 0, 1, 0)
    applied_once(inbox)


def test_two_queues_sharing_one_inbox_deliver_the_same_event_once(
        tmp_path: Path, postgres_url: str):
    """The same event from a SQLite file (delivered at token 4) and from a
    PostgreSQL queue (token 1): both done, applied once."""
    first, second = str(tmp_path / "queue.db"), postgres_url
    for queue in (first, second):
        assert cli("init", queue).returncode == 0
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        deliver_at_token_4(first, rx.url)
        assert enqueue(second) == "1 new, 0 duplicate, 0 conflicting"
        code, said = run(second, rx.url)
        assert code == 0, said
        assert job(second) == {"status": "done", "reason": None, "token": 1}
        stats = rx.stats()
    assert (stats["applied"], stats["stale_senders"], stats["conflicts"]) == (1, 1, 0)
    applied_once(inbox)


def test_within_one_jobs_life_a_stale_sender_is_absorbed_and_its_finish_refused(
        tmp_path: Path):
    """The first dispatcher's lease ran out and the job was claimed again
    (token 2) and delivered; the first one's send arrives late (token 1): the
    inbox absorbs it as a duplicate and counts a stale sender, and the queue
    refuses its finish. One effect, one outcome: the newer one."""
    con = worker.open_queue(tmp_path / "queue.db")
    try:
        assert worker.enqueue(con, {"id": "snack-7", "qty": 7}, T0, 60_000) is True
        first = worker.claim(con, "one", T0, lease_ms=1000)
        second = worker.claim(con, "two", T0 + 1000, lease_ms=1000)
        assert first is not None and second is not None
        assert (first["token"], second["token"]) == (1, 2)
        with ReceiverProcess(tmp_path / "inbox.db") as rx:
            event = {"id": "snack-7", "qty": 7}
            assert send_http(rx.url, event, timeout=5, token=2) is True
            assert send_http(rx.url, event, timeout=5, token=1) is True  # late, absorbed
            stats = rx.stats()
        assert worker.finish(con, first, "ok", T0 + 1100) is False  # fenced by the queue
        assert worker.finish(con, second, "ok", T0 + 1100) == "done"
    finally:
        con.close()
    assert (stats["applied"], stats["duplicates"], stats["stale_senders"], stats["stock"]) == (
        1, 0, 1, 7)
