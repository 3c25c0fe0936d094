"""Retention: prune_inbox deletes the rows first seen before a window, in
batches, safely beside a running receiver; a pruned id is applied again."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from asyncworker.receiving.inbox import Inbox, prune_inbox, read_inbox
from tests.support.receiving import FOREIGN, Running, folder_state, post_event, snapshot
from tests.support.servers import ReceiverProcess


def first_seen(inbox: Path) -> dict[str, int]:
    con = sqlite3.connect(inbox)
    try:
        return dict(con.execute("SELECT id, first_seen_ms FROM inbox").fetchall())
    finally:
        con.close()


def now_ms() -> int:
    return int(time.time() * 1000)


def after(moment_ms: int) -> int:
    """The wall clock once it has passed ``moment_ms`` (a millisecond or so)."""
    while (now := now_ms()) <= moment_ms:
        time.sleep(0.001)
    return now


def test_prune_removes_only_old_rows_and_a_resend_after_the_prune_is_applied_again(
        tmp_path: Path):
    """While serve runs on the file. The trade-off, shown: a lab event resent
    after its row was pruned adds to the stock a second time."""
    inbox = tmp_path / "inbox.db"
    with ReceiverProcess(inbox) as rx:
        for n in range(3):
            assert post_event(rx.url, {"n": n}, f"old:{n}")[1]["status"] == "applied"
        assert post_event(rx.url, {"id": "old-lab", "qty": 5})[1]["status"] == "applied"
        assert post_event(rx.url, {"n": 0}, "old:0")[1]["status"] == "duplicate"
        old_ms = max(first_seen(inbox).values())
        after(old_ms)
        assert post_event(rx.url, {"n": "new"}, "new:0")[1]["status"] == "applied"
        assert post_event(rx.url, {"id": "new-lab", "qty": 2})[1]["status"] == "applied"
        now = now_ms()
        assert prune_inbox(inbox, now - (old_ms + 1), now_ms=now) == 4
        assert sorted(first_seen(inbox)) == ["new-lab", "new:0"]
        pruned = rx.stats()  # a prune by another process shows at once
        assert {k: pruned[k] for k in ("applied", "duplicates", "inbox_rows", "inbox_pruned",
                                       "stock")} == {
            "applied": 6, "duplicates": 1, "inbox_rows": 2, "inbox_pruned": 4, "stock": 7}
        assert post_event(rx.url, {"n": 0}, "old:0") == (200, {"id": "old:0", "status": "applied"})
        assert post_event(rx.url, {"id": "old-lab", "qty": 5})[1]["status"] == "applied"
        assert post_event(rx.url, {"n": "new"}, "new:0")[1]["status"] == "duplicate"
        final = rx.final_counters()
    assert {k: final[k] for k in ("applied", "duplicates", "inbox_rows", "inbox_pruned",
                                  "stock")} == {
        "applied": 8, "duplicates": 2, "inbox_rows": 4, "inbox_pruned": 4, "stock": 12}
    contents = read_inbox(inbox)
    assert (len(contents.applied), contents.pruned, contents.seen) == (4, 4, 10)
    with ReceiverProcess(inbox) as again:  # the same figures from the file after a restart
        assert {k: again.stats()[k] for k in final if not k.startswith("process_")} == {
            k: v for k, v in final.items() if not k.startswith("process_")}


@pytest.mark.parametrize(("rows", "batch"), [(25, 10), (20, 10), (7, 1), (3, 10_000)])
async def test_prune_deletes_in_batches_until_none_is_left(tmp_path: Path, rows: int,
                                                           batch: int):
    path = tmp_path / "inbox.db"
    inbox = await Inbox.open(path)
    try:
        await asyncio.gather(*(inbox.deliver(f"b-{n}", 1, None) for n in range(rows)))
    finally:
        await inbox.close()
    later = after(max(first_seen(path).values()))
    assert prune_inbox(path, 0, now_ms=later, batch=batch) == rows
    assert prune_inbox(path, 0, now_ms=later, batch=batch) == 0
    contents = read_inbox(path)
    assert (contents.applied, contents.pruned, contents.seen, contents.stock) == (
        {}, rows, rows, rows)


async def test_a_window_longer_than_the_rows_age_prunes_nothing(tmp_path: Path):
    async with Running(tmp_path / "inbox.db") as rx:
        assert (await rx.post({"id": "young", "qty": 1}))[0] == 200
    before = snapshot(tmp_path / "inbox.db")
    now = after(max(first_seen(tmp_path / "inbox.db").values()))
    for window in (60_000, 10**14):
        assert prune_inbox(tmp_path / "inbox.db", window, now_ms=now) == 0
    assert snapshot(tmp_path / "inbox.db") == before


async def test_a_prune_beside_a_busy_receiver_loses_nothing(tmp_path: Path):
    """300 posts in flight while prune deletes batch after batch: every post_event
    is answered, and the figures add up (rows left + rows pruned)."""
    async with Running(tmp_path / "inbox.db") as rx:
        posts = asyncio.gather(*(rx.post({"id": f"p-{n}", "qty": 1}) for n in range(300)))
        pruned = prunes = 0
        while not posts.done() or not prunes:
            pruned += await asyncio.to_thread(prune_inbox, rx.inbox, 0, now_ms=now_ms(),
                                              batch=10)
            prunes += 1
        answers = await posts
        assert sorted(status for status, _ in answers) == [200] * 300
        assert {body["status"] for _, body in answers} == {"applied"}
        stats = await rx.stats()
    assert (stats["applied"], stats["duplicates"], stats["stock"]) == (300, 0, 300)
    assert stats["inbox_rows"] + stats["inbox_pruned"] == 300
    assert stats["inbox_pruned"] == pruned


def test_prune_waits_for_a_busy_file_and_then_names_it(tmp_path: Path):
    inbox = tmp_path / "inbox.db"
    asyncio.run(_fill(inbox, 3))
    later = after(max(first_seen(inbox).values()))
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        con = sqlite3.connect(inbox, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        locked.set()
        release.wait(30)
        con.execute("ROLLBACK")
        con.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        threading.Timer(0.3, release.set).start()
        assert prune_inbox(inbox, 0, now_ms=later, batch=1) == 3  # waited, then pruned
    finally:
        release.set()
        holder.join()
    asyncio.run(_fill(inbox, 2))
    locked.clear()
    release.clear()
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        began = time.monotonic()
        with pytest.raises(sqlite3.OperationalError,
                           match=re.escape(f"cannot prune inbox file {inbox}: ")
                           + "database is locked"):
            prune_inbox(inbox, 0, now_ms=after(max(first_seen(inbox).values())))
        assert 4 < time.monotonic() - began < 30  # its busy timeout (5 s), not forever
    finally:
        release.set()
        holder.join()
    assert len(read_inbox(inbox).applied) == 2


async def _fill(path: Path, rows: int) -> None:
    inbox = await Inbox.open(path)
    try:
        await asyncio.gather(*(inbox.deliver(f"f-{n}-{time.time_ns()}", 1, None)
                               for n in range(rows)))
    finally:
        await inbox.close()


@pytest.mark.parametrize("case", FOREIGN)
def test_prune_refuses_what_is_not_an_inbox_untouched(tmp_path: Path, case: str):
    build, message = FOREIGN[case]
    folder = tmp_path / "files"
    folder.mkdir()
    path = build(folder)
    before = folder_state(folder)
    with pytest.raises(ValueError, match=re.escape(message)):
        prune_inbox(path, 0, now_ms=now_ms())
    assert folder_state(folder) == before


def test_prune_of_a_missing_file_creates_nothing_and_of_an_empty_one_changes_nothing(
        tmp_path: Path):
    with pytest.raises(ValueError, match="inbox file not found: "):
        prune_inbox(tmp_path / "missing.db", 0, now_ms=now_ms())
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty.db").touch()
    assert prune_inbox(tmp_path / "empty.db", 0, now_ms=now_ms()) == 0
    assert folder_state(tmp_path) == {"empty.db": b""}


@pytest.mark.parametrize(("args", "message"), [
    ((-1,), "older_than_ms must be in 0.."),
    ((True,), "older_than_ms must be an int, got bool"),
    ((1.5,), "older_than_ms must be an int, got float"),
    ((0, {"now_ms": -1}), "now_ms must be in 0.."),
    ((0, {"now_ms": "1"}), "now_ms must be an int"),
    ((0, {"batch": 0}), "batch must be in 1..100000"),
    ((0, {"batch": 100_001}), "batch must be in 1..100000"),
    ((0, {"batch": None}), "batch must be an int, got NoneType"),
])
async def test_prune_arguments_are_checked_before_the_file_is_touched(tmp_path: Path, args,
                                                                      message):
    path = tmp_path / "inbox.db"
    await _fill(path, 1)
    before = folder_state(tmp_path)
    older_than, *rest = args
    keywords = {"now_ms": now_ms(), **(rest[0] if rest else {})}
    with pytest.raises(ValueError, match=re.escape(message)):
        prune_inbox(path, older_than, **keywords)
    assert folder_state(tmp_path) == before
