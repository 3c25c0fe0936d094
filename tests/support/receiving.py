"""Shared by several test modules."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from asyncworker import make_app
from asyncworker.receiving.server import Listener

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# The schema of the first inbox version, as it made its files.
FIRST_SCHEMA = """
CREATE TABLE inbox (
  id TEXT PRIMARY KEY, qty INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL,
  seen INTEGER NOT NULL, max_token INTEGER);
CREATE TABLE effect (one INTEGER PRIMARY KEY CHECK (one = 1), stock INTEGER NOT NULL);
INSERT INTO effect (one, stock) VALUES (1, 0);
"""


def sqlite_file(path: Path, script: str, *, wal: bool = False) -> Path:
    con = sqlite3.connect(path)
    try:
        if wal:
            con.execute("PRAGMA journal_mode=WAL")
        con.executescript(script)
        con.commit()
    finally:
        con.close()
    return path


def _queue_file(folder: Path) -> Path:
    from lease.worker import open_queue

    open_queue(folder / "queue.db").close()
    return folder / "queue.db"


def _garbage(folder: Path) -> Path:
    (folder / "garbage.db").write_bytes(b"\x00\x01 not a database at all " * 40)
    return folder / "garbage.db"


def _damaged(folder: Path) -> Path:
    (folder / "damaged.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    return folder / "damaged.db"


def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "fifo")
    return folder / "fifo"


def _directory(folder: Path) -> Path:
    (folder / "inbox.db").mkdir()
    return folder / "inbox.db"


class Running:
    """The receiver app in this process, on 127.0.0.1 port 0 (or ``host``);
    over https with ``tls`` (a server context) and ``trust`` (the client's)."""

    def __init__(self, inbox: Path, *, host: str = "127.0.0.1", tls=None, trust=None,
                 **kwargs) -> None:
        self.inbox, self.kwargs, self.host = inbox, kwargs, host
        self.tls, self.trust = tls, trust

    async def __aenter__(self) -> Running:
        self.app = make_app(self.inbox, **self.kwargs)
        self.listener = Listener(self.app, self.host, 0, tls=self.tls)
        await self.listener.start()
        self.url = self.listener.url
        scheme, _, rest = self.url.partition("://")
        self.base = f"{scheme}://{rest.split('/', 1)[0]}"
        self.port = int(self.base.rsplit(":", 1)[1])
        connector = None if self.trust is None else aiohttp.TCPConnector(ssl=self.trust)
        self.session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.listener.close()

    async def post(self, body: object, *, content_type: str = "application/json",
                   headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        hdrs = {"Content-Type": content_type, **(headers or {})}
        if content_type == "":
            hdrs.pop("Content-Type")
        async with self.session.post(self.url, data=data, headers=hdrs) as answer:
            return answer.status, await answer.json(content_type=None)

    async def stats(self) -> dict:
        async with self.session.get(self.base + "/stats") as answer:
            return await answer.json()


def snapshot(inbox: Path) -> tuple[bytes, bytes]:
    wal = inbox.with_name(inbox.name + "-wal")
    return inbox.read_bytes(), wal.read_bytes() if wal.exists() else b""


def folder_state(folder: Path) -> dict[str, bytes]:
    """Every entry of a folder by name, with its bytes: what 'untouched' means."""
    return {entry.name: entry.read_bytes() if entry.is_file() else b"<not a file>"
            for entry in sorted(folder.iterdir())}


FOREIGN = {
    "a queue file": (_queue_file, "holds the tables ['jobs', 'redrives']"),
    "another SQLite file": (lambda f: sqlite_file(f / "other.db", "CREATE TABLE t (x);"),
                            "holds the tables ['t']"),
    "another SQLite file in WAL mode": (
        lambda f: sqlite_file(f / "wal.db", "CREATE TABLE t (x); INSERT INTO t VALUES (1);",
                              wal=True), "holds the tables ['t']"),
    "an inbox with one more table": (
        lambda f: sqlite_file(f / "more.db", FIRST_SCHEMA + "CREATE TABLE extra (x);"),
        "holds the tables ['effect', 'extra', 'inbox']"),
    "an inbox table of other columns": (
        lambda f: sqlite_file(f / "cols.db", "CREATE TABLE inbox (id TEXT, qty INTEGER);"
                                             "CREATE TABLE effect (one, stock);"),
        "table 'inbox' has columns ['id', 'qty']"),
    "a SQLite file with no tables": (
        lambda f: sqlite_file(f / "empty.db", "PRAGMA user_version = 7;"), "no tables"),
    "bytes that are not SQLite": (_garbage, "is not a SQLite database"),
    "a damaged SQLite file": (_damaged, "cannot be read as SQLite"),
    "a directory": (_directory, "is a directory"),
    "a FIFO": (_fifo, "is not a regular file"),
    "a missing folder": (lambda f: f / "missing" / "inbox.db", "folder does not exist"),
}


def post_event(url: str, body: dict, webhook_id: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if webhook_id is not None:
        headers["webhook-id"] = webhook_id
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with _OPENER.open(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, json.loads(refused.read())

