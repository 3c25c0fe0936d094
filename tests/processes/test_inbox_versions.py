"""Inbox versions: files written by the old code open migrated forward, every
row kept, in one transaction; a newer file is refused untouched.

The fixtures are real files made by the old code, each from the same eight
deliveries, one group at a time ("old-1" qty 3 token 2, again, again with
token 5; "old-2" qty 4; "old-3" qty 1 token 1; "old-1" qty 9 (a conflict);
"old-1" token 4 (stale); "old-2" again):

- ``tests/data/inbox-v1.db``: ``asyncworker/inbox.py`` as of the commit
  before fb41a34 (tables inbox and effect);
- ``tests/data/inbox-v2.db``: as of fa43266 (refusals counted durably).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from asyncworker import make_app
from asyncworker.receiving.inbox import INBOX_VERSION, Inbox, prune_inbox, read_inbox
from tests.support import DATA
from tests.support.receiving import folder_state, post_event
from tests.support.servers import ReceiverProcess

OLD_ROWS = [("old-1", 3, 3, 5), ("old-2", 4, 2, None), ("old-3", 1, 1, 1)]
# version: (file, conflicts and stale senders it counted)
OLD = {1: ("inbox-v1.db", (0, 0)), 2: ("inbox-v2.db", (1, 1))}


def copy_of(version: int, folder: Path) -> Path:
    path = folder / "inbox.db"
    shutil.copyfile(DATA / OLD[version][0], path)
    return path


def schema(path: Path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {"user_version": con.execute("PRAGMA user_version").fetchone()[0],
                "tables": con.execute("SELECT type, name, sql FROM sqlite_master"
                                      " ORDER BY name").fetchall(),
                "rows": con.execute("SELECT * FROM inbox ORDER BY id").fetchall()}
    finally:
        con.close()


def columns(path: Path, table: str) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return [row[1] for row in con.execute(f"PRAGMA table_info({table})")]
    finally:
        con.close()


@pytest.mark.parametrize("version", OLD)
async def test_an_old_inbox_is_migrated_forward_with_every_row(tmp_path: Path, version: int):
    path = copy_of(version, tmp_path)
    before = schema(path)
    assert [row[:2] + row[3:] for row in before["rows"]] == OLD_ROWS
    conflicts, stale = OLD[version][1]
    inbox = await Inbox.open(path)
    try:
        totals = inbox.totals
        assert (totals.applied, totals.duplicates, totals.stock, totals.conflicts,
                totals.stale, totals.pruned) == (3, 3, 8, conflicts, stale, 0)
        outcomes = await asyncio.gather(
            inbox.deliver("old-1", 3, 6), inbox.deliver("old-2", 5, None),
            inbox.deliver("old-3", 1, 1), inbox.deliver("new", 0, None, "ab" * 32))
        assert [d.outcome for d in outcomes] == ["duplicate", "conflict", "duplicate", "applied"]
    finally:
        await inbox.close()
    after = schema(path)
    assert after["user_version"] == INBOX_VERSION
    assert columns(path, "inbox") == ["id", "qty", "first_seen_ms", "seen", "max_token",
                                      "digest"]
    kept = {row[0]: row for row in after["rows"]}
    for old in before["rows"]:  # every column of every row, the digest added as NULL
        assert kept[old[0]][:3] == old[:3] and kept[old[0]][5] is None
    assert [kept[i][3:5] for i in ("old-1", "old-2", "old-3")] == [(4, 6), (2, None), (2, 1)]
    contents = read_inbox(path)
    assert contents.applied == {"old-1": 3, "old-2": 4, "old-3": 1, "new": "ab" * 32}
    assert (contents.stock, contents.conflicts, contents.stale, contents.seen) == (
        8, conflicts + 1, stale, 9)


@pytest.mark.parametrize("version", OLD)
def test_an_old_inbox_is_read_as_it_is_and_served_migrated(tmp_path: Path, version: int):
    """read_inbox writes nothing, so it reads the old version unmigrated; serve
    migrates it, and its figures are those of the old file."""
    path = copy_of(version, tmp_path)
    original = folder_state(tmp_path)
    contents = read_inbox(path)
    assert (contents.applied, contents.seen, contents.stock) == (
        {"old-1": 3, "old-2": 4, "old-3": 1}, 6, 8)
    assert (contents.conflicts, contents.stale) == OLD[version][1]
    assert folder_state(tmp_path) == original
    with ReceiverProcess(path) as rx:
        stats = rx.stats()
        assert post_event(rx.url, {"id": "old-2", "qty": 4})[1]["status"] == "duplicate"
        assert post_event(rx.url, {"k": 1}, "old-3")[0] == 409
        assert post_event(rx.url, {"k": 1}, "pay")[1]["status"] == "applied"
    assert {k: stats[k] for k in ("applied", "duplicates", "stock", "conflicts",
                                  "stale_senders", "inbox_pruned")} == {
        "applied": 3, "duplicates": 3, "stock": 8, "conflicts": OLD[version][1][0],
        "stale_senders": OLD[version][1][1], "inbox_pruned": 0}
    assert schema(path)["user_version"] == INBOX_VERSION


@pytest.mark.parametrize("version", OLD)
def test_prune_migrates_an_old_inbox_first(tmp_path: Path, version: int):
    path = copy_of(version, tmp_path)
    later = int(time.time() * 1000) + 1
    assert prune_inbox(path, 0, now_ms=later, batch=2) == 3
    contents = read_inbox(path)
    assert (contents.applied, contents.pruned, contents.seen, contents.stock) == ({}, 3, 6, 8)
    assert schema(path)["user_version"] == INBOX_VERSION


async def test_a_migration_that_fails_leaves_the_old_version_whole(tmp_path: Path):
    """The migration is one transaction: made to fail at its last statements
    (a trigger refuses the insert of the refusals row), the file keeps its
    old tables and rows, and says why it cannot be opened."""
    path = copy_of(2, tmp_path)
    con = sqlite3.connect(path)
    con.execute("CREATE TRIGGER refuse BEFORE INSERT ON refusals"
                " BEGIN SELECT RAISE(ABORT, 'refusals are closed'); END")
    con.commit()
    con.close()
    before = schema(path)
    with pytest.raises(ValueError, match=re.escape(f"cannot open inbox file {path}: ")
                       + "refusals are closed"):
        await Inbox.open(path)
    assert schema(path) == before
    assert columns(path, "inbox") == ["id", "qty", "first_seen_ms", "seen", "max_token"]


async def test_an_inbox_newer_than_the_code_is_refused_untouched(tmp_path: Path):
    path = tmp_path / "inbox.db"
    inbox = await Inbox.open(path)
    await inbox.close()
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version = {INBOX_VERSION + 1}")
    con.close()
    before = folder_state(tmp_path)
    message = f"newer than this code's {INBOX_VERSION}"
    for attempt in (lambda: make_app(path), lambda: read_inbox(path),
                    lambda: prune_inbox(path, 0, now_ms=1)):
        with pytest.raises(ValueError, match=re.escape(message)):
            attempt()
    with pytest.raises(ValueError, match=re.escape(message)):
        await Inbox.open(path)
    assert folder_state(tmp_path) == before


async def test_a_new_inbox_is_of_the_current_version(tmp_path: Path):
    inbox = await Inbox.open(tmp_path / "inbox.db")
    await inbox.close()
    assert schema(tmp_path / "inbox.db")["user_version"] == INBOX_VERSION
    assert columns(tmp_path / "inbox.db", "pruned") == ["one", "rows", "seen"]
