"""A real PostgreSQL server on this machine, started from its own binaries:
what the test suite and ``asyncworker bench --store postgres`` run on.

The machine's own server binaries (Debian's ``postgresql`` package, or the
folder ``PG_BINDIR`` names) run on a temporary data directory and a free
loopback port. As root they run as ``nobody``: ``initdb`` refuses root.

- ``PostgresServer``: one server, a context manager: start, stop, start again
  on the same data and port, kill, close (which leaves no process and no file).
  A watchdog (``asyncworker/devtools/postgres_processes.py``) kills the server
  and removes its folder if the owning process dies without closing it
  (SIGKILL, SIGTERM).
- ``ExternalServer``: a server someone else runs, used, never started or stopped.
- ``fresh_database`` / ``drop_database``: an empty database of its own per user.

psycopg is the optional ``postgres`` extra: this module imports it only where
it connects, so importing the module needs nothing beyond the standard library.
The pytest fixtures on top of it live in ``tests/support/postgres_server.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from asyncworker.devtools import postgres_processes
from asyncworker.devtools.postgres_processes import (
    GONE_TIMEOUT_S,
    RELEASED,
    children,
    kill_tree,
)

if TYPE_CHECKING:
    import psycopg

START_TIMEOUT_S = 30.0  # generous: initdb and a start take 1-2 s
STOP_TIMEOUT_S = 30.0  # a fast shutdown with fsync off takes well under a second
UNPRIVILEGED_USER = "nobody"
SERVER_BINARIES = ("initdb", "postgres")
INSTALL_HINT = ("install the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql) "
                "or set PG_BINDIR to the folder that holds initdb and postgres")
SHUTDOWN_SIGNALS = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}
SOCKET_PATH_MAX = 88  # sun_path holds 108 bytes, "/.s.PGSQL.65535" and a NUL included
DATABASE_PREFIX = "test_"  # drop_database drops no other name


class _PortTaken(RuntimeError):
    """Another process took the free port between our probe and the server's bind."""


# --- the binaries ---------------------------------------------------------------------

def _has_server(folder: Path) -> bool:
    return all(os.access(folder / name, os.X_OK) for name in SERVER_BINARIES)


def _version_key(bindir: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin: compared as numbers, so 15 is newer than 9.6
    return tuple(int(part) for part in re.findall(r"\d+", bindir.parent.name))


def _pg_config_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    try:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(done.stdout.strip()) if done.stdout.strip() else None


def find_binaries() -> Path:
    """The folder holding initdb and postgres: PG_BINDIR if set, else what
    ``pg_config --bindir`` says, else the newest ``/usr/lib/postgresql/*/bin``."""
    override = os.environ.get("PG_BINDIR")
    if override:
        if not _has_server(Path(override)):
            raise RuntimeError(f"PG_BINDIR={override} holds no initdb and postgres: "
                               f"{INSTALL_HINT}")
        return Path(override)
    # pg_config can come from libpq-dev alone and name a folder without the server
    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key,
                       reverse=True)
    candidates = [_pg_config_bindir(), *installed]
    for folder in candidates:
        if folder is not None and _has_server(folder):
            return folder
    raise RuntimeError(f"no PostgreSQL server binaries (initdb, postgres) found: {INSTALL_HINT}")


# --- processes ------------------------------------------------------------------------

def _server_user() -> dict[str, Any]:
    """Popen's arguments that run the server as nobody when we are root, else as us."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(UNPRIVILEGED_USER)
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        uid = gid = 65534
    return {"user": uid, "group": gid, "extra_groups": []}


def _server_env() -> dict[str, str]:
    # the caller's PGDATA, PGPORT, PGHOST... must not steer this server
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env.update(LC_ALL="C", LANG="C", TZ="UTC")
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# --- the server -----------------------------------------------------------------------

_open_servers: set[PostgresServer] = set()


class PostgresServer:
    """A PostgreSQL server on 127.0.0.1, its data in a temporary folder.

    ``fsync=False`` suits the suite (a crash of the server process keeps every
    commit; only a crash of the machine would not); a benchmark passes
    ``fsync=True``. ``settings`` adds or overrides server settings.
    """

    def __init__(self, *, fsync: bool = False, settings: Mapping[str, str] | None = None,
                 port: int | None = None, base_dir: os.PathLike | None = None) -> None:
        self.bindir = find_binaries()  # before anything exists: a missing server creates nothing
        self.fsync = fsync
        self.settings = dict(settings or {})
        self.port = port or 0
        self._fixed_port = port is not None
        self.base_dir = base_dir
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # kills the server if this process dies without closing it (postgres_processes)
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None  # initdb and the first start, measured

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def data(self) -> Path:
        return self._folder() / "data"

    @property
    def log(self) -> Path:
        return self._folder() / "server.log"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs."""
        return self.proc.pid if self.running and self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _folder(self) -> Path:
        if self.root is None:
            raise RuntimeError("this PostgreSQL server has no data: start() it first")
        return self.root

    def processes(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, ...)."""
        return [] if self.pid is None else [self.pid, *children(self.pid)]

    # -- lifecycle

    def start(self) -> PostgresServer:
        """initdb on the first call, then start and wait until it answers.
        Again after stop() or kill(): the same data, the same port."""
        if self.running:
            raise RuntimeError(f"PostgreSQL is already running on port {self.port}")
        first = self.root is None
        began = time.monotonic()
        try:
            if first:
                self._initdb()
            self._launch(pick_port=first and not self._fixed_port)
        except BaseException:
            (self.close if first else self.kill)()  # a failed first start leaves nothing
            raise
        if first:
            self.startup_s = time.monotonic() - began
        return self

    def stop(self, mode: str = "fast") -> None:
        """Shut down: ``fast`` (rolls back sessions, checkpoints) or ``immediate``
        (no checkpoint: the next start replays the WAL, as after a crash)."""
        if mode not in SHUTDOWN_SIGNALS:
            raise ValueError(f"stop mode must be one of {sorted(SHUTDOWN_SIGNALS)}, not {mode!r}")
        if not self.running or self.proc is None:
            self.proc = None  # never started, stopped already, or died on its own
            self._release_watchdog()
            return
        self.proc.send_signal(SHUTDOWN_SIGNALS[mode])
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"PostgreSQL did not stop ({mode}) within {STOP_TIMEOUT_S:.0f} s: "
                               f"killed\n{_tail(self._log_text())}") from None
        self.proc = None  # the postmaster exits only after all its children
        self._release_watchdog()

    def kill(self) -> None:
        """SIGKILL the postmaster and every child, as a crash would, and wait
        until all are gone (so start() can take the shared memory back)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
        self._release_watchdog()

    def close(self) -> None:
        """Stop (killed if that fails or is interrupted) and remove the data folder."""
        try:
            try:
                self.stop("fast")
            finally:
                self.kill()
        finally:
            _open_servers.discard(self)
            root, self.root = self.root, None
            if root is not None:
                shutil.rmtree(root)

    def terminate_backends(self, dbname: str) -> int:
        return terminate_backends(self.url, dbname)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the steps

    def _initdb(self) -> None:
        user = _server_user()
        self.root = Path(tempfile.mkdtemp(prefix="lease-pg-", dir=self.base_dir))  # 0700
        _open_servers.add(self)
        if user:
            os.chown(self.root, user["user"], user["group"])
        done = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
             "--no-sync", "-E", "UTF8", "--locale=C"],
            capture_output=True, text=True, env=_server_env(), cwd=self.root,
            timeout=START_TIMEOUT_S * 4, **user)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {done.returncode}) in {self.root}:\n"
                               f"{_tail(done.stderr + done.stdout)}")

    def _launch(self, pick_port: bool) -> None:
        for attempt in range(5 if pick_port else 1):
            if pick_port:
                self.port = free_port()
            log_from = self.log.stat().st_size if self.log.exists() else 0
            self.proc = self._spawn()
            try:
                self._wait_ready(log_from)
                return
            except _PortTaken:
                self.kill()
                if attempt == 4 or not pick_port:
                    raise

    def _options(self) -> dict[str, str]:
        root = str(self._folder())
        return {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            # psql -h <root> reaches it too; a path too long for a socket disables that
            "unix_socket_directories": root if len(root) <= SOCKET_PATH_MAX else "",
            "max_connections": "200",
            "fsync": "on" if self.fsync else "off",
            "logging_collector": "off",  # our stderr goes to server.log
            **self.settings,
        }

    def _spawn(self) -> subprocess.Popen[bytes]:
        args = [str(self.bindir / "postgres"), "-D", str(self.data)]
        for name, value in self._options().items():
            args += ["-c", f"{name}={value}"]
        with open(self.log, "ab") as log:
            # a session of its own: a terminal's Ctrl-C reaches the tests, whose
            # cleanup then stops the server in order
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=self.root, env=_server_env(),
                                    start_new_session=True, **_server_user())
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", postgres_processes.__file__, str(proc.pid),
                 str(self.root)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)  # holds none of our pipes
        except BaseException:
            kill_tree(proc.pid)
            proc.wait()
            raise
        return proc

    def _release_watchdog(self) -> None:
        """The server is gone by our hand: its watchdog ends without doing anything."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None or watchdog.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError):
            watchdog.stdin.write(RELEASED)
        with contextlib.suppress(BrokenPipeError):
            watchdog.stdin.close()
        watchdog.wait(timeout=GONE_TIMEOUT_S)

    def _wait_ready(self, log_from: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                text = self._log_text(log_from)
                taken = "Address already in use" in text
                raise (_PortTaken if taken else RuntimeError)(
                    f"PostgreSQL exited (code {self.proc.returncode}) while starting on port "
                    f"{self.port}:\n{_tail(text)}")
            # pg_ctl's signal: "ready" comes only after our sockets are bound, so
            # nothing else listening on the port is ever taken for this server
            if self._status() == "ready":
                answer = self._probe()
                if answer == str(self.data):
                    return
                if answer is not None:
                    raise _PortTaken(f"port {self.port} answers for another server ({answer})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not accept connections on port {self.port} "
                                   f"within {START_TIMEOUT_S:.0f} s:\n"
                                   f"{_tail(self._log_text(log_from))}")
            time.sleep(0.05)

    def _status(self) -> str | None:
        """The postmaster's own status line in postmaster.pid (starting, ready, ...)."""
        assert self.proc is not None
        try:
            lines = (self.data / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        if len(lines) < 8 or lines[0].strip() != str(self.proc.pid):
            return None  # not written yet, or left by the run before a kill
        return lines[7].strip()

    def _probe(self) -> str | None:
        """The data directory of the server answering on our port; None if none answers."""
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=5, autocommit=True) as con:
                row = con.execute("SHOW data_directory").fetchone()
        except psycopg.Error:
            return None
        return None if row is None else str(row[0])

    def _log_text(self, offset: int = 0) -> str:
        try:
            with open(self.log, "rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError as error:
            return f"(no server log: {error})"


@atexit.register
def _close_open_servers() -> None:
    # the last resort: a test run that ends without closing a server leaves no process
    for server in list(_open_servers):
        with contextlib.suppress(Exception):
            server.close()


class ExternalServer:
    """A server given by its URL (the suite's TEST_DATABASE_URL): used, never
    started or stopped."""

    def __init__(self, url: str) -> None:
        parts = _split(url)
        self.url = url
        self.port = parts.port or 5432
        import psycopg

        try:
            _admin(url).close()
        except psycopg.Error as error:
            raise RuntimeError(f"TEST_DATABASE_URL={redacted(url)} cannot be reached: "
                               f"{str(error).strip()}") from None

    def terminate_backends(self, dbname: str) -> int:
        return terminate_backends(self.url, dbname)


Server = PostgresServer | ExternalServer


# --- databases ------------------------------------------------------------------------

def _split(url: str) -> Any:
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.netloc:
        raise ValueError(f"not a postgresql:// URL: {redacted(url)}")
    return parts


def redacted(url: str) -> str:
    """The URL with its password, if any, hidden: safe in an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}"))


def with_database(url: str, dbname: str) -> str:
    """The same server and role, another database."""
    return urlunsplit(_split(url)._replace(path="/" + quote(dbname, safe="")))


def database_of(url: str) -> str:
    name = unquote(_split(url).path.lstrip("/"))
    if not name:
        raise ValueError(f"the URL names no database: {redacted(url)}")
    return name


def _admin(url: str) -> psycopg.Connection:
    import psycopg

    # CREATE and DROP DATABASE refuse to run inside a transaction block
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


_serial = itertools.count(1)


def fresh_database(url: str) -> str:
    """Create an empty database on the server of ``url``; the URL of it.
    From template0: nothing a template1 holds leaks in; UTF8 and C everywhere."""
    name = f"{DATABASE_PREFIX}{next(_serial)}_{secrets.token_hex(4)}"  # unique across runs
    fresh = with_database(url, name)
    from psycopg import sql

    with _admin(url) as con:
        con.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8' "
                            "LC_COLLATE 'C' LC_CTYPE 'C'").format(sql.Identifier(name)))
    return fresh


def drop_database(url: str, admin_url: str | None = None) -> None:
    """Drop the database fresh_database made, its sessions ended first.
    ``admin_url`` is where to run the DROP (default: the server's ``postgres``)."""
    name = database_of(url)
    if not name.startswith(DATABASE_PREFIX):
        raise ValueError(f"refusing to drop {name!r}: only the {DATABASE_PREFIX}* databases "
                         f"fresh_database makes")
    admin = admin_url or with_database(url, "postgres")
    if database_of(admin) == name:
        raise ValueError(f"cannot drop {name!r} from a session on it: give another admin_url")
    terminate_backends(admin, name)
    from psycopg import sql

    with _admin(admin) as con:
        # FORCE (PostgreSQL 13+) also ends a session that connected after the terminate
        force = " WITH (FORCE)" if con.info.server_version >= 130000 else ""
        con.execute(sql.SQL("DROP DATABASE IF EXISTS {}" + force).format(sql.Identifier(name)))


def terminate_backends(url: str, dbname: str) -> int:
    """End every session on ``dbname`` (ours excepted) and wait until they are
    gone; how many there were."""
    with _admin(url) as con:
        pids = [row[0] for row in con.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,))]
        for pid in pids:
            con.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while con.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)",
                          (pids,)).fetchone():
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessions on {dbname!r} still open {GONE_TIMEOUT_S:.0f} s "
                                   f"after pg_terminate_backend")
            time.sleep(0.01)
    return len(pids)
