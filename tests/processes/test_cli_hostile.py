"""Tier 4, hostile: every command as a real process against bad files, bad
bytes, bad permissions and closed pipes.

Each case asserts the exit code, exactly one line on stderr (none for a
closed pipe: the reader has gone), no traceback anywhere, and every file in
the folder as it was: the bytes of each, and the folder listing.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from lease import sqlite as store
from lease import worker
from lease.policy import MAX_BODY_BYTES
from tests.support.queues import T0

ROOT = Path(__file__).resolve().parents[2]
Arg = str | bytes


# ------------------------------------------------------------------ the zoo of files


def make_queue(path: Path, jobs: int = 50, dead: int = 5, *, contract: bool = False) -> None:
    """A queue of `jobs` pending jobs j-0.., the first `dead` of them dead/deadline;
    a product file (this version), or with `contract` one of the contract's schema."""
    con = worker.open_queue(path) if contract else store.open_store(path)
    try:
        worker.enqueue_many(con, [{"id": f"j-{n}", "qty": 1} for n in range(jobs)], T0, 60_000)
        con.execute("UPDATE jobs SET status = 'dead', reason = 'deadline' WHERE seq <= ?",
                    (dead,))
    finally:
        con.close()


def _sqlite(path: Path, *statements: str) -> None:
    con = sqlite3.connect(path)
    try:
        for statement in statements:
            con.execute(statement)
        con.commit()
    finally:
        con.close()


def make_mixed(path: Path) -> None:
    """One job in each state a cancel refuses or takes: leased, done, pending, dead."""
    con = store.open_store(path)
    try:
        worker.enqueue_many(con, [{"id": n, "qty": 1} for n in ("leased", "done", "pending",
                                                                 "dead")], T0, 60_000)
        for _ in range(2):
            ticket = worker.claim(con, "zoo", T0, 1000)
            assert ticket is not None
            if ticket["id"] == "done":
                worker.finish(con, ticket, "ok", T0 + 1)
        con.execute("UPDATE jobs SET status = 'dead', reason = 'permanent' WHERE id = 'dead'")
    finally:
        con.close()


BAD_LINES: dict[str, bytes] = {
    "latin1.jsonl": b'{"id": "a", "qty": 1}\n{"id": "caf\xe9", "qty": 1}\n',
    "utf16.jsonl": '{"id": "a", "qty": 1}\n'.encode("utf-16"),
    "nul-line.jsonl": b'{"id": "a", "qty": 1}\n\x00\n',
    "nul-in-id.jsonl": b'{"id": "a\x00", "qty": 1}\n',
    "huge-line.jsonl": b'{"id": "a", "qty": 1}\n' + b" " * (1 << 20) + b"\n",
    "huge-id.jsonl": b'{"id": "' + b"a" * 100_000 + b'", "qty": 1}\n',
    "dup-keys.jsonl": b'{"id": "a", "qty": 1}\n\n{"id": "b", "qty": 1, "qty": 9}\n',
    "nan.jsonl": b'{"id": "a", "qty": NaN}\n',
    "bom-inside.jsonl": b'{"id": "a", "qty": 1}\n\xef\xbb\xbf{"id": "b", "qty": 1}\n',
    "not-json.jsonl": b'{"id": "a", "qty": 1}\nid,qty\n',
    "binary.jsonl": bytes(range(256)) * 4,
    # payload lines: the intake's rule, each named by its line
    "body-list.jsonl": b'{"id": "a", "qty": 1}\n{"id": "b", "body": [1, 2]}\n',
    "body-null.jsonl": b'{"id": "a", "body": null}\n',
    "body-and-qty.jsonl": b'{"id": "a", "body": {}, "qty": 1}\n',
    "body-nan.jsonl": b'{"id": "a", "body": {"x": NaN}}\n',
    "body-dup-keys.jsonl": b'{"id": "a", "body": {"x": {"y": 1, "y": 2}}}\n',
    "body-too-large.jsonl": b'{"id": "big", "body": {"x": "'
                            + b"y" * (MAX_BODY_BYTES - 7) + b'"}}\n',
    "body-deep.jsonl": b'{"id": "a", "body": ' + b'{"x": ' * 30_000 + b"1" + b"}" * 30_001
                       + b"\n",
    "id-space.jsonl": b'{"id": "order 1", "body": {}}\n',
    "id-too-long.jsonl": b'{"id": "' + b"o" * 256 + b'", "body": {}}\n',
    "id-number.jsonl": b'{"id": 7, "body": {}}\n',
}


def build_zoo(folder: Path) -> None:
    make_queue(folder / "queue.db")
    make_queue(folder / "contract.db", contract=True)
    make_mixed(folder / "mixed.db")
    make_queue(folder / "newer.db")
    _sqlite(folder / "newer.db", f"PRAGMA user_version = {store.SCHEMA_VERSION + 1}")
    (folder / "dir.db").mkdir()
    (folder / "garbage.db").write_bytes(bytes((n * 37 + 11) % 256 for n in range(8192)))
    _sqlite(folder / "foreign.db", "CREATE TABLE users (name TEXT)",
            "INSERT INTO users VALUES ('ada')")
    make_queue(folder / "big.db", 600)
    data = (folder / "big.db").read_bytes()
    (folder / "truncated.db").write_bytes(data[: len(data) // 2])
    (folder / "big.db").unlink()
    header = bytearray((folder / "queue.db").read_bytes())
    header[:16] = b"NOT A DATABASE!!"
    (folder / "header.db").write_bytes(bytes(header))
    (folder / "empty.db").touch()
    shutil.copy(folder / "queue.db", folder / "wal.db")
    _sqlite(folder / "wal.db", "PRAGMA journal_mode=WAL")
    shutil.copy(folder / "queue.db", folder / "noindex.db")
    _sqlite(folder / "noindex.db", "DROP INDEX jobs_live")
    (folder / "ok.jsonl").write_bytes(b'{"id": "new-1", "qty": 2}\n')
    for name, data in BAD_LINES.items():
        (folder / name).write_bytes(data)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("zoo")
    build_zoo(folder)
    return folder


@pytest.fixture
def work(zoo: Path, tmp_path: Path) -> Path:
    """A fresh copy of the zoo for one case."""
    folder = tmp_path / "w"
    shutil.copytree(zoo, folder)
    assert not (folder / "wal.db-wal").exists()  # a WAL copy with nothing unmerged
    return folder


def state(folder: Path) -> dict[str, object]:
    """Every entry under the folder: a file's bytes, or what else it is."""
    found: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        try:
            found[name] = path.read_bytes() if path.is_file() else (
                "<dir>" if path.is_dir() else "<other>")
        except PermissionError:  # not root: a mode-000 file is not ours to read
            found[name] = "<unreadable>"
    return found


def changes(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def run_cli(args: list[Arg], *, stdin: bytes = b"", stdout: int | None = None,
            stderr: int | None = None, python: str = sys.executable, user: bool = False,
            cwd: Path | None = None, code: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "asyncworker", *args], input=stdin, timeout=60, cwd=cwd,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE if stderr is None else stderr,
        env={**os.environ, "PYTHONPATH": str(code)},
        preexec_fn=_not_root if user else None)


def expand(args: list[Arg], folder: Path, **more: str) -> list[Arg]:
    """{w} and the other names filled in; any other brace (a JSON body) kept as it is."""
    names = {"w": str(folder), **more}

    def fill(text: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: names.get(m.group(1), m.group(0)), text)

    return [fill(a) if isinstance(a, str) else a.replace(b"{w}", os.fsencode(folder))
            for a in args]


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, message: str) -> None:
    err = out.stderr.decode(errors="replace")
    assert out.returncode == code, err
    assert "Traceback" not in err and b"Traceback" not in out.stdout
    assert len(err.strip().splitlines()) == 1, err
    assert message in err, err


# ------------------------------------------------------------------ bad queue files

# Every command that takes a queue, once each: the variants of one command (stats
# --json, redrive of one ID) open the file the same way.
COMMANDS: dict[str, list[Arg]] = {
    "init": ["init", "{f}"],
    "enqueue": ["enqueue", "{f}", "--id", "zz", "--qty", "1"],
    "run": ["run", "{f}", "--url", "http://127.0.0.1:9/events", "--until-idle"],
    "stats": ["stats", "{f}", "--json"],
    "dead": ["dead", "{f}"],
    "inspect": ["inspect", "{f}", "j-1"],
    "redrive": ["redrive", "{f}", "--reason", "deadline", "--note", "fix"],
    "cancel": ["cancel", "{f}", "j-1", "--note", "fix"],
    "prune": ["prune", "{f}", "--older-than", "0"],
}
WRITERS = ["init", "enqueue", "run", "redrive", "cancel", "prune"]

BAD_QUEUES = {
    "missing.db": "queue file not found",
    "dir.db": "not a file",
    "garbage.db": "database",
    "foreign.db": "not a queue file",
    "truncated.db": "malformed",
    "header.db": "database",
    "empty.db": "empty",
}
# init's own work: it creates a missing queue and fills an empty file with one.
NOT_HOSTILE = {("init", "missing.db"), ("init", "empty.db")}
QUEUE_CASES = [(c, f) for f in BAD_QUEUES for c in COMMANDS if (c, f) not in NOT_HOSTILE]


@pytest.mark.parametrize(("command", "name"), QUEUE_CASES,
                         ids=[f"{c}-{f}" for c, f in QUEUE_CASES])
def test_a_bad_queue_file_is_one_line_and_untouched(work: Path, command: str, name: str):
    before = state(work)
    out = run_cli(expand(COMMANDS[command], work, f=str(work / name)))
    assert_one_line_error(out, 2, BAD_QUEUES[name])
    assert changes(before, state(work)) == []


ODD_PATHS: list[tuple[list[Arg], str]] = [
    (["stats", "/dev/null"], "not a file"),
    (["enqueue", "/dev/null", "--id", "a", "--qty", "1"], "not a file"),
    (["stats", "{w}/new\nline.db"], "new\\nline.db"),  # one line, the newline shown
    (["dead", b"{w}/\xff\xfe.db"], "queue file not found"),  # a name that is not UTF-8
    (["init", "{w}/no\nfolder/q.db"], "folder not found"),
    (["enqueue", "{w}/queue.db", "--file", "{w}/missing.jsonl"], "file not found"),
    (["enqueue", "{w}/queue.db", "--file", "{w}/dir.db"], "not a file"),
    (["enqueue", "{w}/missing.db", "--file", "{w}/ok.jsonl"], "queue file not found"),
    (["enqueue", "{w}/queue.db", "--file", "/dev/zero"], "line 1: longer than"),  # endless
    (["enqueue", "{w}/queue.db", "--file", "{w}/queue.db"], "line 1: not UTF-8"),
    (["inspect", "{w}/queue.db", "nope"], "no job 'nope'"),
    (["dead", "{w}/queue.db", "--reason", "bogus"], "--reason"),
    (["redrive", "{w}/queue.db", "--reason", "bogus", "--note", "x"], "--reason"),
    (["redrive", "{w}/queue.db", "--reason", "deadline", "--note", "x\ny"], "--note"),
]


@pytest.mark.parametrize(("args", "message"), ODD_PATHS,
                         ids=[f"{n}-{a[0]}" for n, (a, _) in enumerate(ODD_PATHS)])
def test_odd_paths_and_arguments(work: Path, args: list[Arg], message: str):
    before = state(work)
    out = run_cli(expand(args, work))
    assert_one_line_error(out, 1 if message.startswith("no job") else 2, message)
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ read-only by nature

LOOKING = ["stats", "dead", "inspect"]
DELICATE = ["queue.db", "wal.db", "noindex.db", "contract.db"]


@pytest.mark.parametrize("name", DELICATE)
@pytest.mark.parametrize("command", LOOKING)
def test_commands_that_look_change_nothing(work: Path, command: str, name: str):
    """A WAL copy stays WAL, a dropped index stays dropped, no -journal/-wal/-shm appears."""
    before = state(work)
    out = run_cli(expand(COMMANDS[command], work, f=str(work / name)))
    assert out.returncode == 0, out.stderr
    assert b"Traceback" not in out.stderr
    assert (b'"jobs": 50' if command == "stats" else b"j-1") in out.stdout
    assert changes(before, state(work)) == []


@pytest.mark.parametrize("command", WRITERS)
def test_a_queue_newer_than_this_code_is_refused_untouched(work: Path, command: str):
    before = state(work)
    out = run_cli(expand(COMMANDS[command], work, f=str(work / "newer.db")))
    assert_one_line_error(out, 2, "newer than this code")
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ bad arguments of the
# product's flags: refused before any file is opened

BIG_BODY = '{"x": "' + "y" * (MAX_BODY_BYTES - 7) + '"}'  # canonical: one byte over the cap
BAD_FLAGS: list[tuple[list[Arg], str]] = [
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", "[1, 2]"], "must be a JSON object"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", "null"], "must be a JSON object"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", '{"x": NaN}'], "NaN"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", '{"x": 1, "x": 2}'], "duplicate key"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", '{"x": 1'], "not valid JSON"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", "{} {}"], "not valid JSON"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", BIG_BODY],
     f"{MAX_BODY_BYTES + 1} bytes, more than {MAX_BODY_BYTES}"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", "{}", "--qty", "1"], "one of --qty"),
    (["enqueue", "{w}/queue.db", "--body", "{}"], "--id goes with"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--body", "{}", "--file", "{w}/ok.jsonl"],
     "either"),
    (["enqueue", "{w}/queue.db", "--id", "a b", "--body", "{}"], "visible ASCII"),
    (["enqueue", "{w}/queue.db", "--id", "order:1", "--qty", "1"], "1-64 ASCII letters"),
    (["enqueue", "{w}/queue.db", "--id", "o" * 256, "--body", "{}"], "1-255"),
    (["enqueue", "{w}/queue.db", "--id", "caf\u00e9", "--body", "{}"], "visible ASCII"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--qty", "1", "--ttl-ms", "2592000001"],
     "--ttl-ms"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--qty", "1", "--max-attempts", "0"],
     "--max-attempts"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--qty", "1", "--delay-ms", "86400001"],
     "--delay-ms"),
    (["enqueue", "{w}/queue.db", "--id", "a", "--qty", "1", "--delay-ms", "-1"], "--delay-ms"),
    (["run", "{w}/queue.db", "--url", "http://127.0.0.1:9/events", "--lease-ms", "3600001"],
     "--lease-ms"),
    (["run", "{w}/queue.db", "--url", "http://127.0.0.1:9/events", "--backoff-base-ms",
      "5000", "--backoff-cap-ms", "1000"], "must be at least --backoff-base-ms"),
    (["run", "{w}/queue.db", "--url", "http://127.0.0.1:9/events", "--backoff-cap-ms",
      "86400001"], "--backoff-cap-ms"),
    (["run", "{w}/queue.db", "--url", "http://127.0.0.1:9/events", "--jitter", "1.5"],
     "--jitter"),
    (["run", "{w}/queue.db", "--url", "http://127.0.0.1:9/events", "--jitter", "nan"],
     "--jitter"),
    (["cancel", "{w}/queue.db", "--note", "x"], "either"),
    (["cancel", "{w}/queue.db", "j-1", "--reason", "deadline", "--note", "x"], "either"),
    (["cancel", "{w}/queue.db", "j-1"], "--note"),
    (["cancel", "{w}/queue.db", "j-1", "--note", "x", "--dry-run"], "go with --reason"),
    (["cancel", "{w}/queue.db", "--reason", "cancelled", "--note", "x"], "cancelled already"),
    (["cancel", "{w}/queue.db", "--reason", "bogus", "--note", "x"], "--reason"),
    (["cancel", "{w}/queue.db", "bad id", "--note", "x"], "visible ASCII"),
    (["redrive", "{w}/queue.db", "j-1", "--note", "x", "--ttl-ms", "2592000001"], "--ttl-ms"),
    (["prune", "{w}/queue.db"], "--older-than"),
    (["prune-inbox", "{w}/inbox.db"], "--older-than"),
]
NOTES = ["", "a\nb", "a\rb", "red \x1b[31mtext", "tab\there", "del\x7f", "n" * 501]
BAD_FLAGS += [(["cancel", "{w}/queue.db", "j-1", "--note", note], "--note") for note in NOTES]
BAD_FLAGS += [(["redrive", "{w}/queue.db", "j-1", "--note", note], "--note") for note in NOTES]
AGES = ["", "7 d", "7days", "1w", "-1d", "+5s", "1.5h", "1e3", "0x10", "7D", "d",
        "36501d", "9" * 21, "\u0667d"]
BAD_FLAGS += [([command, "{w}/" + name, "--older-than", age], "--older-than")
              for age in AGES for command, name in (("prune", "queue.db"),
                                                    ("prune-inbox", "inbox.db"))]


@pytest.mark.parametrize(("args", "message"), BAD_FLAGS,
                         ids=[f"{n}-{a[0]}" for n, (a, _) in enumerate(BAD_FLAGS)])
def test_bad_flags_of_the_product_are_one_line_and_change_nothing(work: Path,
                                                                  args: list[Arg],
                                                                  message: str):
    before = state(work)
    out = run_cli(expand(args, work))
    assert_one_line_error(out, 2, message)
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ cancel what cannot be


@pytest.mark.parametrize(("ids", "message"), [
    (["leased"], "job 'leased' is leased: only a pending or dead job can be cancelled"),
    (["done"], "job 'done' is done: only a pending or dead job can be cancelled"),
    (["ghost"], "job 'ghost' does not exist"),
])
def test_cancel_of_a_leased_done_or_missing_job_is_refused_untouched(work: Path, ids: list[str],
                                                                    message: str):
    before = state(work)
    out = run_cli(["cancel", str(work / "mixed.db"), *ids, "--note", "operator: stop"])
    assert_one_line_error(out, 1, f"not cancelled: {message}")
    assert out.stdout == b"0 cancelled, 1 refused\n"
    assert changes(before, state(work)) == []


def test_cancel_refuses_each_job_on_its_own_line_and_cancels_the_rest(work: Path):
    out = run_cli(["cancel", str(work / "mixed.db"), "leased", "pending", "done", "dead",
                   "pending", "--note", "incident 42: stop these"])
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err
    assert err.splitlines() == [
        "not cancelled: job 'leased' is leased: only a pending or dead job can be cancelled",
        "not cancelled: job 'done' is done: only a pending or dead job can be cancelled",
        "not cancelled: job 'pending' is already cancelled"]
    assert out.stdout.decode().splitlines() == [
        "cancelled pending", "cancelled dead", "2 cancelled, 3 refused"]
    con = sqlite3.connect(work / "mixed.db")
    try:
        assert dict(con.execute("SELECT id, status || '/' || IFNULL(reason, '-') FROM jobs")
                    ) == {"leased": "leased/-", "done": "done/-",
                          "pending": "dead/cancelled", "dead": "dead/cancelled"}
        assert con.execute("SELECT id, was, note FROM cancels ORDER BY seq").fetchall() == [
            ("pending", "pending", "incident 42: stop these"),
            ("dead", "dead/permanent", "incident 42: stop these")]
    finally:
        con.close()


# ------------------------------------------------------------------ prune-inbox, not an inbox

PRUNE_INBOX_CASES = {
    "missing.db": "inbox file not found",
    "dir.db": "not a file",
    "garbage.db": "inbox",
    "foreign.db": "inbox",
    "queue.db": "inbox",
    "truncated.db": "inbox",
    "header.db": "inbox",
}


@pytest.mark.parametrize("name", sorted(PRUNE_INBOX_CASES))
def test_prune_inbox_refuses_what_is_not_an_inbox(work: Path, name: str):
    before = state(work)
    out = run_cli(["prune-inbox", str(work / name), "--older-than", "7d"])
    assert_one_line_error(out, 2, PRUNE_INBOX_CASES[name])
    assert out.stdout == b""
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ bad bytes


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_bad_bytes_in_a_jsonl_file_are_one_line_and_nothing_enqueued(work: Path, name: str):
    before = state(work)
    out = run_cli(["enqueue", str(work / "queue.db"), "--file", str(work / name)])
    assert_one_line_error(out, 2, "nothing was enqueued")
    assert "line " in out.stderr.decode()
    assert changes(before, state(work)) == []


@pytest.mark.parametrize("name", ["latin1.jsonl", "dup-keys.jsonl", "huge-line.jsonl"])
def test_bad_bytes_on_standard_input(work: Path, name: str):
    before = state(work)
    out = run_cli(["enqueue", str(work / "queue.db"), "--file", "-"], stdin=BAD_LINES[name])
    assert_one_line_error(out, 2, "nothing was enqueued")
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ closed pipes

CLOSED_STDOUT: list[list[Arg]] = [
    ["--version"],
    ["init", "{w}/queue.db"],
    ["inspect", "{w}/mixed.db", "done"],
    ["cancel", "{w}/queue.db", "--reason", "deadline", "--note", "x", "--dry-run"],
    ["prune", "{w}/queue.db", "--older-than", "0"],  # no done job: nothing to prune
    ["stats", "{w}/queue.db"],
    ["stats", "{w}/queue.db", "--json"],
    ["dead", "{w}/queue.db"],
    ["inspect", "{w}/queue.db", "j-1"],
    ["redrive", "{w}/queue.db", "--reason", "deadline", "--note", "x", "--dry-run"],
    ["enqueue", "{w}/queue.db", "--id", "j-9", "--qty", "1"],  # a duplicate: no change
]


@pytest.fixture
def closed_pipe() -> Iterator[int]:
    """The write end of a pipe whose reader has already gone (``| head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        yield write
    finally:
        os.close(write)


@pytest.mark.parametrize("args", CLOSED_STDOUT,
                         ids=[f"{n}-{a[0]}" for n, a in enumerate(CLOSED_STDOUT)])
def test_a_reader_that_left_gets_a_quiet_exit(work: Path, closed_pipe: int, args: list[Arg]):
    before = state(work)
    out = run_cli(expand(args, work), stdout=closed_pipe)
    assert (out.returncode, out.stderr) == (1, b"")  # the Python docs' recipe: quiet, 1
    assert changes(before, state(work)) == []


def test_a_long_listing_into_head(work: Path):
    """`dead queue.db | head -3` with more output than a pipe holds."""
    make_queue(work / "many.db", 3000, 3000)
    before = state(work)
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "dead", str(work / "many.db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert head[0].startswith(b"id ") and head[2].startswith(b"j-1 ")
    assert (proc.returncode, err) == (1, b"")
    assert changes(before, state(work)) == []


@pytest.mark.parametrize("args", [["--help"], ["stats", "--help"]])
def test_help_into_a_closed_pipe(closed_pipe: int, args: list[Arg]):
    out = run_cli(args, stdout=closed_pipe)
    assert (out.returncode, out.stderr) == (0, b"")  # argparse ignores a failed help write


def test_an_error_with_stderr_closed_too(work: Path, closed_pipe: int):
    out = run_cli(["stats", str(work / "missing.db")], stdout=closed_pipe, stderr=closed_pipe)
    assert out.returncode == 2


# ------------------------------------------------------------------ serve


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


SERVE_CASES = {
    "dir.db": "directory",
    "no/such/folder/inbox.db": "folder does not exist",
    "garbage.db": "inbox",
    "foreign.db": "inbox",
    "queue.db": "inbox",
    "truncated.db": "inbox",
}


@pytest.mark.parametrize("name", sorted(SERVE_CASES))
def test_serve_refuses_what_is_not_an_inbox(work: Path, name: str):
    before = state(work)
    out = run_cli(["serve", "--inbox", str(work / name)])
    assert_one_line_error(out, 2, SERVE_CASES[name])
    assert out.stdout == b""  # no URL: nothing listened
    assert changes(before, state(work)) == []


def test_serve_on_a_port_in_use(work: Path, busy_port: int):
    before = state(work)
    out = run_cli(["serve", "--inbox", str(work / "inbox.db"), "--port", str(busy_port)])
    assert_one_line_error(out, 2, str(busy_port))
    assert out.stdout == b""
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ read-only, unprivileged


def _not_root() -> None:
    os.setgid(65534)
    os.setuid(65534)  # as root, file modes do not bind; "nobody" is bound by them


@pytest.fixture(scope="module")
def readable_code() -> Iterator[Path]:
    """The product's packages copied where "nobody" can read them: the checkout
    may live in a folder only root may enter (a clone in a mode-700 folder)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        for package in ("lease", "asyncworker"):
            shutil.copytree(ROOT / package, folder / package,
                            ignore=shutil.ignore_patterns("__pycache__"))
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield folder
    finally:
        shutil.rmtree(folder)


class Locked(NamedTuple):
    folder: Path
    python: str
    as_root: bool
    code: Path  # where the commands' packages are read from

    def as_nobody(self) -> dict:
        """run_cli's options for a command run as "nobody" (when the tests run as root)."""
        return {"python": self.python, "user": self.as_root, "cwd": Path("/"), "code": self.code}


@pytest.fixture
def locked(zoo: Path, readable_code: Path) -> Iterator[Locked]:
    """A read-only copy of the zoo's queues in a read-only folder that "nobody" can
    enter (/tmp, not root's pytest folder), and a python that "nobody" can run."""
    as_root = os.geteuid() == 0
    # nobody cannot enter root's home, where this interpreter may live; the
    # commands that write and look need the standard library only.
    python = shutil.which("python3", path="/usr/bin:/bin") if as_root else sys.executable
    assert python, "a python3 that an unprivileged user can run"
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        for name in ("queue.db", "wal.db", "noindex.db", "contract.db", "mixed.db",
                     "ok.jsonl"):
            shutil.copy(zoo / name, folder / name)
            (folder / name).chmod(0o444)
        shutil.copy(zoo / "ok.jsonl", folder / "secret.jsonl")
        (folder / "secret.jsonl").chmod(0o000)
        folder.chmod(0o555)  # no journal can be created beside them either
        yield Locked(folder, python, as_root, readable_code if as_root else ROOT)
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


READ_ONLY_CASES: list[tuple[list[Arg], int, str]] = [
    (["enqueue", "{w}/queue.db", "--id", "zz", "--qty", "1"], 1, "readonly"),
    (["enqueue", "{w}/queue.db", "--file", "{w}/ok.jsonl"], 1, "readonly"),
    (["enqueue", "{w}/queue.db", "--file", "{w}/secret.jsonl"], 2, "ermission denied"),
    (["redrive", "{w}/queue.db", "j-1", "--note", "fix"], 1, "readonly"),
    (["redrive", "{w}/queue.db", "--reason", "deadline", "--note", "fix"], 1, "readonly"),
    (["init", "{w}/new.db"], 1, "unable to open"),  # a folder it cannot write in
    (["init", "{w}/contract.db"], 1, "readonly"),  # its migration cannot be written
    (["enqueue", "{w}/contract.db", "--id", "zz", "--body", "{}"], 1, "readonly"),
    (["cancel", "{w}/queue.db", "j-9", "--note", "fix"], 1, "readonly"),
    (["cancel", "{w}/queue.db", "--reason", "deadline", "--note", "fix"], 1, "readonly"),
    (["prune", "{w}/mixed.db", "--older-than", "0"], 1, "readonly"),  # one done job
]


@pytest.mark.parametrize(("args", "code", "message"), READ_ONLY_CASES,
                         ids=[f"{a[0]}-{a[-1]}" for a, _, _ in READ_ONLY_CASES])
def test_a_read_only_queue_is_one_line_and_untouched(locked, args, code, message):
    folder = locked.folder
    before = state(folder)
    out = run_cli(expand(args, folder), **locked.as_nobody())
    assert_one_line_error(out, code, message)
    assert changes(before, state(folder)) == []


# init on a WAL copy or a missing index repairs it (its work): only on a whole queue
LOOKS = [(c, f) for c in LOOKING for f in DELICATE] + [("init", "queue.db")]


@pytest.mark.parametrize(("command", "name"), LOOKS, ids=[f"{c}-{f}" for c, f in LOOKS])
def test_a_read_only_queue_can_still_be_looked_at(locked, command: str, name: str):
    folder = locked.folder
    before = state(folder)
    args = COMMANDS[command]
    out = run_cli(expand(args, folder, f=str(folder / name)), **locked.as_nobody())
    assert out.returncode == 0, out.stderr
    assert b"Traceback" not in out.stderr
    assert changes(before, state(folder)) == []


# ------------------------------------------------------------------ busy files, odd peers


def test_a_queue_locked_by_another_writer_is_one_line(work: Path):
    before = state(work)
    holder = sqlite3.connect(work / "queue.db", isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")  # a writer mid-commit: no one may read or write
        for args in (["enqueue", "{w}/queue.db", "--id", "zz", "--qty", "1"],
                     ["redrive", "{w}/queue.db", "j-1", "--note", "fix"],
                     ["cancel", "{w}/queue.db", "j-9", "--note", "fix"],
                     ["prune", "{w}/queue.db", "--older-than", "0"],
                     ["init", "{w}/queue.db"],
                     ["stats", "{w}/queue.db"]):
            out = run_cli(expand(args, work))
            assert_one_line_error(out, 1, "database is locked")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert changes(before, state(work)) == []


def test_stats_from_a_server_that_is_not_a_receiver(work: Path):
    import http.server
    import threading

    class NotAReceiver(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>hello</html>" if self.path == "/stats" else b"[]"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotAReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/events"
        out = run_cli(["stats", str(work / "queue.db"), "--receiver", url])
        assert_one_line_error(out, 1, "answered no stats")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_run_with_its_stderr_closed_still_does_its_work_and_reports(work: Path,
                                                                     closed_pipe: int):
    """The zoo's jobs are past their deadline: the first claim quarantines them all."""
    out = run_cli(["run", str(work / "queue.db"), "--url", "http://127.0.0.1:9/events",
                   "--until-idle"], stderr=closed_pipe)
    summary = json.loads(out.stdout)
    assert out.returncode == 3  # some went dead in this run
    assert (summary["dead"], summary["dead_by_reason"]["deadline"]) == (45, 45)


# ------------------------------------------------------------------ across hosts: secrets,
# certificates, URLs and addresses, each refused before a queue or an inbox is opened

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
NOT_A_WEBHOOK_SECRET = "sk_live_do-not-echo-me-4242"


def build_keys(folder: Path) -> None:
    """Secrets files good and bad, a CA, a certificate with its key, a key of
    another certificate, an encrypted key, and files that are not what they say."""
    folder.mkdir()
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    (folder / "cert.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(folder / "key.pem"))
    trustme.CA().issue_cert("other").private_key_pem.write_to_path(str(folder / "other-key.pem"))
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), None)
    (folder / "encrypted-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pass-77-word")))
    (folder / "garbage.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n")
    files = {
        "secrets": f"# orders\n{SECRET}\n",
        "not-whsec": f"# the payment provider's key, by mistake\n{NOT_A_WEBHOOK_SECRET}\n",
        "bad-base64": "whsec_!!not*base64!!\n",
        "short": "whsec_" + base64.b64encode(b"k" * 8).decode() + "\n",
        "comments-only": "# nothing yet\n\n",
        "empty": "",
        "big": "#" * 100 + "\n" + "# padding\n" * 8000,
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "binary").write_bytes(b"\xff\xfe" + SECRET.encode("utf-16-le"))


@pytest.fixture(scope="module")
def keys_zoo(zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keys") / "k"
    build_keys(folder)
    return folder


@pytest.fixture
def armed(work: Path, keys_zoo: Path) -> Path:
    """A fresh copy of the zoo with the keys in {w}/k."""
    shutil.copytree(keys_zoo, work / "k")
    return work


RUN = ["run", "{w}/queue.db", "--until-idle"]
HTTPS = "https://127.0.0.1:9/hooks"
SERVE = ["serve", "--inbox", "{w}/new-inbox.db"]
TLS = ["--tls-cert", "{w}/k/cert.pem", "--tls-key", "{w}/k/key.pem"]
HOST_FLAGS: list[tuple[list[Arg], str]] = [
    # run --secret-file
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/missing"], "--secret-file: file not found"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k"], "--secret-file: not a file"),
    (RUN + ["--url", HTTPS, "--secret-file", "/dev/zero"], "--secret-file: not a file"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/not-whsec"], "not-whsec line 2: "),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/bad-base64"], "line 1: "),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/short"], "bytes"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/comments-only"], "holds no secret"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/empty"], "holds no secret"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/binary"], "not UTF-8"),
    (RUN + ["--url", HTTPS, "--secret-file", "{w}/k/big"], "larger than"),
    # run --ca-file, --url, --ack
    (RUN + ["--url", HTTPS, "--ca-file", "{w}/k/garbage.pem"], "cannot load CA certificates"),
    (RUN + ["--url", HTTPS, "--ca-file", "{w}/k/key.pem"], "cannot load CA certificates"),
    (RUN + ["--url", HTTPS, "--ca-file", "{w}/k/missing.pem"], "--ca-file: file not found"),
    (RUN + ["--url", HTTPS, "--ca-file", "/dev/zero"], "--ca-file: not a file"),
    (RUN + ["--url", "http://127.0.0.1:9/hooks", "--ca-file", "{w}/k/ca.pem"],
     "--ca-file goes with an https"),
    (RUN + ["--url", "http://orders.example/hooks"], "--insecure-plain-http"),
    (RUN + ["--url", "http://10.1.2.3:8080/hooks"], "--insecure-plain-http"),
    (RUN + ["--url", "ftp://orders.example/hooks"], "--url"),
    (RUN + ["--url", "https://orders.example/hooks#frag"], "--url"),
    (RUN + ["--url", "https://user:pw@orders.example/hooks"], "credentials"),
    (RUN + ["--url", "https://orders.example:99999/hooks"], "--url"),
    (RUN + ["--url", HTTPS, "--ack", "bogus"], "--ack"),
    # the destination is checked before the queue: the URL's fault, not the missing file
    (["run", "{w}/missing.db", "--url", "http://orders.example/hooks"], "--insecure-plain-http"),
    (["run", "{w}/missing.db", "--url", HTTPS, "--secret-file", "{w}/k/empty"],
     "holds no secret"),
    # serve
    (SERVE + ["--tls-cert", "{w}/k/cert.pem"], "--tls-cert and --tls-key go together"),
    (SERVE + ["--tls-key", "{w}/k/key.pem"], "--tls-cert and --tls-key go together"),
    (SERVE + ["--tls-cert", "{w}/k/garbage.pem", "--tls-key", "{w}/k/key.pem"],
     "--tls-cert: {w}/k/garbage.pem holds no PEM certificate"),
    (SERVE + ["--tls-cert", "{w}/k/key.pem", "--tls-key", "{w}/k/key.pem"],
     "--tls-cert: {w}/k/key.pem holds no PEM certificate"),
    (SERVE + ["--tls-cert", "{w}/k/cert.pem", "--tls-key", "{w}/k/garbage.pem"],
     "--tls-key: {w}/k/garbage.pem holds no PEM private key"),
    (SERVE + ["--tls-cert", "{w}/k/cert.pem", "--tls-key", "{w}/k/other-key.pem"],
     "is not the key of --tls-cert"),
    (SERVE + ["--tls-cert", "{w}/k/cert.pem", "--tls-key", "{w}/k/encrypted-key.pem"],
     "encrypted-key.pem is encrypted (a passphrase)"),
    (SERVE + ["--tls-cert", "{w}/k/cert.pem", "--tls-key", "{w}/k/missing.pem"],
     "--tls-key: file not found"),
    (SERVE + ["--tls-cert", "/dev/zero", "--tls-key", "{w}/k/key.pem"], "--tls-cert: not a file"),
    (SERVE + ["--host", "0.0.0.0"], "--secret-file"),
    (SERVE + ["--host", "0.0.0.0", *TLS], "--secret-file"),
    (SERVE + ["--host", "::"], "--secret-file"),
    (SERVE + ["--signature-tolerance-s", "60"], "--signature-tolerance-s goes with"),
    (SERVE + ["--secret-file", "{w}/k/secrets", "--signature-tolerance-s", "0"],
     "--signature-tolerance-s: must be in 1..86400"),
    (SERVE + ["--secret-file", "{w}/k/not-whsec"], "not-whsec line 2: "),
    (SERVE + ["--secret-file", "{w}/k/missing"], "--secret-file: file not found"),
    (SERVE + ["--path", "hooks"], "path must be an absolute URL path"),
    (SERVE + ["--path", "/stats"], "cannot take events"),
    # stats --receiver
    (["stats", "{w}/queue.db", "--receiver", "http://orders.example/hooks"], "--receiver"),
    (["stats", "{w}/queue.db", "--ca-file", "{w}/k/ca.pem"], "go with --receiver"),
    (["stats", "{w}/queue.db", "--insecure-plain-http"], "go with --receiver"),
    (["stats", "{w}/queue.db", "--receiver", HTTPS, "--ca-file", "{w}/k/garbage.pem"],
     "cannot load CA certificates"),
    (["stats", "{w}/missing.db", "--receiver", "http://orders.example/hooks"], "--receiver"),
]


@pytest.mark.parametrize(("args", "message"), HOST_FLAGS,
                         ids=[f"{n}-{a[0]}" for n, (a, _) in enumerate(HOST_FLAGS)])
def test_bad_flags_across_hosts_are_one_line_and_change_nothing(armed: Path, args: list[Arg],
                                                                message: str):
    before = state(armed)
    out = run_cli(expand(args, armed))
    assert_one_line_error(out, 2, message.replace("{w}", str(armed)))
    assert out.stdout == b""  # no URL printed: nothing listened, nothing ran
    assert changes(before, state(armed)) == []
    for secret in (SECRET, NOT_A_WEBHOOK_SECRET, "pass-77-word"):  # never echoed
        assert secret.encode() not in out.stderr


UNREADABLE_SECRETS: list[list[Arg]] = [
    ["run", "{w}/queue.db", "--url", HTTPS, "--secret-file", "{w}/secret.jsonl"],
    ["serve", "--inbox", "{w}/inbox.db", "--secret-file", "{w}/secret.jsonl"],
    ["serve", "--inbox", "{w}/inbox.db", "--tls-cert", "{w}/secret.jsonl", "--tls-key",
     "{w}/secret.jsonl"],
    ["run", "{w}/queue.db", "--url", HTTPS, "--ca-file", "{w}/secret.jsonl"],
]


@pytest.mark.parametrize("args", UNREADABLE_SECRETS, ids=[a[-2] for a in UNREADABLE_SECRETS])
def test_a_secret_or_key_file_it_may_not_read_is_one_line(locked, args: list[Arg]):
    """As an unprivileged user, with a python that has no aiohttp: the files are
    checked before the receiver or the dispatcher is even imported."""
    folder = locked.folder
    before = state(folder)
    out = run_cli(expand(args, folder), **locked.as_nobody())
    assert_one_line_error(out, 2, "ermission denied")
    assert changes(before, state(folder)) == []


@pytest.mark.parametrize("flag", ["--secret-file", "--ca-file"])
def test_a_fifo_named_as_a_secret_or_ca_file_is_refused_without_waiting(work: Path, flag: str):
    """Opening a FIFO to read waits for a writer that never comes: refused unopened."""
    os.mkfifo(work / "fifo")
    before = state(work)
    out = run_cli(["run", str(work / "queue.db"), "--url", HTTPS, flag, str(work / "fifo")])
    assert_one_line_error(out, 2, f"{flag}: not a file")
    assert changes(before, state(work)) == []


# ------------------------------------------------------------------ a secret's file mode

SECRET_USERS: list[list[Arg]] = [
    ["run", "{w}/empty.db", "--until-idle", "--url", HTTPS, "--secret-file", "{w}/k/secrets"],
    ["serve", "--inbox", "{w}/new-inbox.db", "--port", "0", "--secret-file", "{w}/k/secrets"],
]


@pytest.mark.parametrize("mode", [0o666, 0o602, 0o777], ids=oct)
@pytest.mark.parametrize("args", SECRET_USERS, ids=["run", "serve"])
def test_a_secret_file_every_user_may_write_is_refused(armed: Path, args: list[Arg],
                                                      mode: int):
    """Anyone could have put their own secret in it: refused before anything
    runs, in one line that names the file and its mode."""
    assert run_cli(["init", str(armed / "empty.db")]).returncode == 0
    (armed / "k" / "secrets").chmod(mode)
    before = state(armed)
    out = run_cli(expand(args, armed))
    assert_one_line_error(out, 2, f"{armed}/k/secrets is writable by every user "
                                  f"(mode 0{mode:o})")
    assert out.stdout == b"" and SECRET.encode() not in out.stderr
    assert changes(before, state(armed)) == []


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604, 0o660], ids=oct)
@pytest.mark.parametrize("args", SECRET_USERS, ids=["run", "serve"])
def test_a_secret_file_others_may_read_is_used_with_one_warning(armed: Path, args: list[Arg],
                                                                mode: int):
    assert run_cli(["init", str(armed / "empty.db")]).returncode == 0
    (armed / "k" / "secrets").chmod(mode)
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", *expand(args, armed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        if args[0] == "serve":
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith(b"http://127.0.0.1:")  # it serves
            proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    warned = [line for line in err.decode().splitlines() if "WARNING" in line]
    if mode == 0o600:
        assert warned == []
        return
    [line] = warned
    assert f"--secret-file: {armed}/k/secrets is open to other users (mode 0{mode:o})" in line
    assert SECRET not in err.decode()
