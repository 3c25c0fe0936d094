"""A queue's URL never needs its password: libpq's own PGPASSFILE (the
~/.pgpass format), PGPASSWORD and service files (PGSERVICEFILE, with
``postgresql:///?service=NAME`` or PGSERVICE) reach the commands, the
dispatcher's pool and its listener included, on a real server that asks for a
password (scram-sha-256)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from asyncworker.devtools.postgres_server import PostgresServer
from tests.support.servers import ReceiverProcess

ROLE, PASSWORD, DATABASE = "app", "s3cret-pw", "appdb"


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """A command with exactly this environment (tests.support.commands adds to ours)."""
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


class PasswordServer:
    """A server of the test's own whose role ``app`` logs in by password only."""

    def __init__(self, server: PostgresServer, folder: Path) -> None:
        self.port = server.port
        self.folder = folder
        with psycopg.connect(server.url, autocommit=True) as con:
            hba = Path(con.execute("SHOW hba_file").fetchone()[0])
            # the first matching line wins: app by password, everyone else as before
            hba.write_text(f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
            con.execute("SELECT pg_reload_conf()")
            con.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
            con.execute(f"CREATE DATABASE {DATABASE} OWNER {ROLE}")
        self.url = f"postgresql://{ROLE}@127.0.0.1:{self.port}/{DATABASE}"  # no password

    def passfile(self, mode: int = 0o600) -> str:
        path = self.folder / "pgpass"
        path.write_text(f"127.0.0.1:{self.port}:{DATABASE}:{ROLE}:{PASSWORD}\n")
        path.chmod(mode)
        return str(path)

    def service_file(self) -> str:
        path = self.folder / "pg_service.conf"
        path.write_text(f"[queue]\nhost=127.0.0.1\nport={self.port}\ndbname={DATABASE}\n"
                        f"user={ROLE}\n")
        return str(path)

    def env(self, **given: str) -> dict[str, str]:
        """libpq's variables as given, no other (a ~/.pgpass of the machine's
        must not make a test pass: HOME is a folder of the test's own)."""
        home = self.folder / "home"
        home.mkdir(exist_ok=True)
        kept = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        return {**kept, "HOME": str(home), **given}


@pytest.fixture
def password_server(make_postgres_server: Callable[..., PostgresServer],
                    tmp_path: Path) -> PasswordServer:
    if os.environ.get("TEST_DATABASE_URL"):
        pytest.skip("needs a server of its own, whose pg_hba.conf it changes")
    return PasswordServer(make_postgres_server(), tmp_path)


def test_without_a_password_the_server_refuses_and_says_so(password_server: PasswordServer):
    out = cli("init", password_server.url, env=password_server.env(), timeout=60)
    assert out.returncode == 1, out.stderr
    assert "no password supplied" in out.stderr and "Traceback" not in out.stderr


def test_pgpassfile_and_pgpassword(password_server: PasswordServer):
    server = password_server
    env = server.env(PGPASSFILE=server.passfile())
    out = cli("init", server.url, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    out = cli("stats", server.url, "--json", env=env, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["jobs"] == 0, out.stderr

    out = cli("stats", server.url, env=server.env(PGPASSWORD=PASSWORD), timeout=60)
    assert out.returncode == 0, out.stderr

    # a password file others may read is ignored by libpq: chmod 600 it
    out = cli("stats", server.url, env=server.env(PGPASSFILE=server.passfile(0o644)),
              timeout=60)
    assert out.returncode == 1 and "password" in out.stderr
    assert PASSWORD not in out.stderr


def test_a_service_file_names_the_queue(password_server: PasswordServer, tmp_path: Path):
    """``postgresql:///?service=queue``: host, port, database and user from the
    service file, the password from the password file; run's pool and listener
    connect the same way."""
    server = password_server
    env = server.env(PGSERVICEFILE=server.service_file(), PGPASSFILE=server.passfile())
    url = "postgresql:///?service=queue"
    assert cli("init", url, env=env, timeout=60).returncode == 0
    out = cli("enqueue", url, "--id", "svc-1", "--body", "{}", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", url, "--url", rx.url, "--until-idle", env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ok"] == 1 and rx.stats()["applied"] == 1
    # PGSERVICE with a URL naming nothing at all: the same queue
    out = cli("stats", "postgresql://", "--json", env={**env, "PGSERVICE": "queue"},
              timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["by_status"]["done"] == 1
