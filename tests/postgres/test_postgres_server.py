"""The suite's own PostgreSQL server (the launcher
asyncworker/devtools/postgres_server.py, the fixtures in
tests/support/postgres_server.py): it starts, it answers, it survives a crash
with its commits, it honours TEST_DATABASE_URL, and it leaves nothing behind,
whether closed, interrupted or failing to start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from asyncworker.devtools.postgres_server import (
    ExternalServer,
    PostgresServer,
    Server,
    database_of,
    drop_database,
    free_port,
    fresh_database,
    with_database,
)

REPO = Path(__file__).resolve().parents[2]
MakeServer = Callable[..., PostgresServer]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def one(url: str, query: str, *args: object) -> object:
    with psycopg.connect(url, autocommit=True) as con:
        row = con.execute(query, args or None).fetchone()
    assert row is not None, query
    return row[0]


def databases(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as con:
        return {row[0] for row in con.execute("SELECT datname FROM pg_database")}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder the unprivileged server user can reach (pytest's tmp_path is
    root's alone when the tests run as root)."""
    folder = Path(tempfile.mkdtemp(prefix="lease-pg-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_query_runs_in_a_fresh_database(postgres_url: str) -> None:
    assert str(one(postgres_url, "SELECT current_database()")).startswith("test_")
    assert one(postgres_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == 0
    assert int(str(one(postgres_url, "SHOW server_version_num"))) >= 130000
    assert one(postgres_url, "SHOW server_encoding") == "UTF8"


def test_two_fresh_databases_are_independent(postgres_server: Server) -> None:
    first, second = fresh_database(postgres_server.url), fresh_database(postgres_server.url)
    try:
        assert first != second
        with psycopg.connect(first, autocommit=True) as con:
            con.execute("CREATE TABLE jobs (id text PRIMARY KEY)")
            con.execute("INSERT INTO jobs VALUES ('in-first')")
        with psycopg.connect(second, autocommit=True) as con:
            with pytest.raises(psycopg.errors.UndefinedTable):
                con.execute("SELECT * FROM jobs")
            con.execute("CREATE TABLE jobs (id text PRIMARY KEY)")
            assert con.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        assert one(first, "SELECT id FROM jobs") == "in-first"
    finally:
        drop_database(first, admin_url=postgres_server.url)
        drop_database(second, admin_url=postgres_server.url)
    left = databases(postgres_server.url)
    assert database_of(first) not in left and database_of(second) not in left


def test_dropping_ends_the_sessions_on_the_database_first(postgres_server: Server) -> None:
    url = fresh_database(postgres_server.url)
    con = psycopg.connect(url, autocommit=True)
    try:
        assert postgres_server.terminate_backends(database_of(url)) == 1
        with pytest.raises(psycopg.OperationalError):
            con.execute("SELECT 1")
        leftover = psycopg.connect(url, autocommit=True)  # still open when the drop comes
        drop_database(url, admin_url=postgres_server.url)
        with pytest.raises(psycopg.OperationalError):
            leftover.execute("SELECT 1")
        leftover.close()
    finally:
        con.close()
    assert database_of(url) not in databases(postgres_server.url)


def test_only_fresh_databases_are_dropped_and_only_postgres_urls_taken(
        postgres_server: Server) -> None:
    with pytest.raises(ValueError, match="refusing to drop 'postgres'"):
        drop_database(with_database(postgres_server.url, "postgres"))
    with pytest.raises(ValueError, match="not a postgresql:// URL: http://"):
        fresh_database("http://127.0.0.1:5432/postgres")
    assert "postgres" in databases(postgres_server.url)


def test_own_server_settings_and_user(make_postgres_server: MakeServer) -> None:
    server = make_postgres_server()
    assert server.url == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    assert one(server.url, "SHOW fsync") == "off"
    assert one(server.url, "SHOW max_connections") == "200"
    assert one(server.url, "SHOW listen_addresses") == "127.0.0.1"
    assert one(server.url, "SHOW data_directory") == str(server.data)
    assert server.log.stat().st_size > 0
    assert server.startup_s is not None and server.startup_s < 30
    assert server.pid is not None
    uid = os.stat(f"/proc/{server.pid}").st_uid
    assert uid == (65534 if os.geteuid() == 0 else os.geteuid())  # initdb refuses root
    durable = make_postgres_server(fsync=True, settings={"work_mem": "8MB"})
    assert one(durable.url, "SHOW fsync") == "on"
    assert one(durable.url, "SHOW work_mem") == "8MB"
    assert durable.port != server.port


@pytest.mark.parametrize("crash", ["stop-immediate", "kill"])
def test_a_crash_and_a_start_keep_every_commit(make_postgres_server: MakeServer,
                                               crash: str) -> None:
    server = make_postgres_server()
    port, url = server.port, server.url
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("CREATE TABLE jobs (id text PRIMARY KEY)")
        con.execute("INSERT INTO jobs VALUES ('committed')")
    open_txn = psycopg.connect(url)
    open_txn.execute("INSERT INTO jobs VALUES ('never-committed')")
    pids = server.processes()
    if crash == "kill":
        server.kill()
    else:
        server.stop("immediate")
    assert not server.running and server.pid is None
    assert not [pid for pid in pids if alive(pid)]
    with pytest.raises(psycopg.OperationalError):
        open_txn.commit()
    open_txn.close()
    server.start()
    assert (server.port, server.url) == (port, url)
    with psycopg.connect(url) as con:
        assert con.execute("SELECT id FROM jobs").fetchall() == [("committed",)]
    assert "redo" in server.log.read_text() or "recover" in server.log.read_text()


def test_close_leaves_no_process_and_no_folder() -> None:
    server = PostgresServer().start()
    con = psycopg.connect(server.url)  # a backend of its own, open at close
    try:
        pids, root = server.processes(), server.root
        # postmaster, our backend, its helpers; a helper may come and go (an
        # autovacuum worker), so the two that must stay are checked alive
        assert server.pid in pids and con.info.backend_pid in pids and len(pids) >= 3
        assert alive(server.pid) and alive(con.info.backend_pid)
        server.close()
    finally:
        con.close()
        server.close()  # once closed, harmless; after a failed assertion, no server left
    assert not [pid for pid in pids if alive(pid)]
    assert root is not None and not root.exists()
    server.close()  # twice is harmless


def _interrupt(child: subprocess.Popen) -> str:
    """Ctrl-C, again every few seconds until the child has ended (its stderr):
    one interrupt is the case; a later one, if the first was not seen, must
    leave nothing behind either."""
    for _ in range(10):
        child.send_signal(signal.SIGINT)
        try:
            return child.communicate(timeout=5)[1]
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError("the process holding a server did not end on SIGINT in 50 s")


def test_an_interrupt_closes_the_server(scratch: Path) -> None:
    script = textwrap.dedent(f"""
        import json, signal
        # Ctrl-C's own handler, whatever this process inherited: a parent that
        # ignores SIGINT (as a test runner may at that moment) would pass that on
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
        from asyncworker.devtools.postgres_server import PostgresServer
        with PostgresServer(base_dir={str(scratch)!r}) as server:
            print(json.dumps({{"pids": server.processes(), "root": str(server.root)}}),
                  flush=True)
            signal.pause()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None
        started = json.loads(child.stdout.readline())
        # the postmaster; its children may include a backend that is just ending
        assert alive(started["pids"][0])
        stderr = _interrupt(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "KeyboardInterrupt" in stderr
    assert not [pid for pid in started["pids"] if alive(pid)]
    assert not Path(started["root"]).exists() and not list(scratch.iterdir())


def test_a_killed_test_process_leaves_no_server(scratch: Path) -> None:
    script = textwrap.dedent(f"""
        import json, signal
        from asyncworker.devtools.postgres_server import PostgresServer
        server = PostgresServer(base_dir={str(scratch)!r}).start()
        print(json.dumps({{"pids": server.processes(), "root": str(server.root)}}),
              flush=True)
        signal.pause()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, text=True,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        started = json.loads(child.stdout.readline())
    finally:
        child.kill()  # no cleanup of its own runs: the watchdog's turn
        child.communicate()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in started["pids"]) or list(scratch.iterdir()):
        assert time.monotonic() < deadline, ("the server outlived its test process",
                                             started, list(scratch.iterdir()))
        time.sleep(0.02)


def test_a_failed_start_says_why_and_leaves_nothing(scratch: Path) -> None:
    with pytest.raises(RuntimeError, match='invalid value for parameter "max_connections"'):
        PostgresServer(settings={"max_connections": "many"}, base_dir=scratch).start()
    assert not list(scratch.iterdir())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = PostgresServer(port=port, base_dir=scratch)
        with pytest.raises(RuntimeError, match=f"on port {port}:(.|\n)*Address already in use"):
            server.start()
    assert server.proc is None and server.root is None
    assert not list(scratch.iterdir())


def test_missing_binaries_name_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PG_BINDIR", str(empty))
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(RuntimeError) as caught:
        PostgresServer(base_dir=base)
    message = str(caught.value)
    assert "\n" not in message
    assert f"PG_BINDIR={empty} holds no initdb and postgres" in message
    assert "apt-get install postgresql" in message
    assert not list(base.iterdir())


def test_an_unreachable_test_database_url_is_one_clear_line() -> None:
    url = f"postgresql://postgres:sekrit@127.0.0.1:{free_port()}/postgres"
    with pytest.raises(RuntimeError, match="TEST_DATABASE_URL=postgresql://postgres:\\*\\*\\*@"
                                           "127.0.0.1:[0-9]+/postgres cannot be reached") as caught:
        ExternalServer(url)
    assert "sekrit" not in str(caught.value)


CHILD_TEST = '''
import os
import psycopg
from asyncworker.devtools.postgres_server import ExternalServer

def test_on_the_given_server(postgres_server, postgres_url):
    assert isinstance(postgres_server, ExternalServer)
    with psycopg.connect(postgres_url) as con:
        port, name = con.execute("SELECT inet_server_port(), current_database()").fetchone()
    assert port == int(os.environ["EXPECTED_PORT"])
    with open(os.environ["NAME_FILE"], "w") as out:
        out.write(name)
'''


def test_test_database_url_is_honoured(make_postgres_server: MakeServer,
                                       tmp_path: Path) -> None:
    server = make_postgres_server()
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    (tmp_path / "no-bin").mkdir()
    env = {**os.environ, "TEST_DATABASE_URL": server.url, "EXPECTED_PORT": str(server.port),
           "NAME_FILE": str(tmp_path / "name"),
           "PG_BINDIR": str(tmp_path / "no-bin")}  # starting a server of its own would fail
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.postgres_server",
         "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO),
         str(tmp_path / "test_child.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=55)
    assert child.returncode == 0, child.stdout + child.stderr
    name = (tmp_path / "name").read_text()
    assert name.startswith("test_")
    assert name not in databases(server.url)  # made there, dropped after the test
