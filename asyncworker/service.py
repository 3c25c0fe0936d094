"""Telling a service manager how the process is doing: systemd's notify
protocol (``sd_notify``), the standard library alone.

systemd starts a ``Type=notify`` unit with ``NOTIFY_SOCKET`` naming a
datagram socket (a path, or an abstract name written with a leading ``@``);
each datagram is newline-separated ``KEY=VALUE`` lines: ``READY=1`` (the
unit is up: ``systemctl start`` returns, units ordered after it start),
``STATUS=...`` (a line ``systemctl status`` shows), ``STOPPING=1`` (a stop
has begun), ``WATCHDOG=1`` (alive, every half of ``WATCHDOG_USEC``). Without
``NOTIFY_SOCKET`` every call does nothing, so a process started by hand or by
another manager behaves as before.

A notification that cannot be sent (the manager gone, its queue full) is
logged once and never stops the work: the manager's own timeouts judge a
service that stays silent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping

__all__ = ["RELOAD_REFUSED", "Notifier", "refuse_reload", "refuse_reload_in_process",
           "watchdog_interval_s"]

log = logging.getLogger("asyncworker.service")


def _address(name: str) -> str | bytes:
    """``@name`` is an abstract socket (no file): a leading NUL byte for the kernel."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    """Datagrams to the manager's socket; ``Notifier(None)`` sends nothing."""

    def __init__(self, socket_name: str | None) -> None:
        self.socket_name = socket_name or None
        self._sock: socket.socket | None = None
        self._failed = False
        self.ready_sent = False
        self.stopping_sent = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.socket_name is not None

    def send(self, **state: str) -> bool:
        """One datagram of ``KEY=VALUE`` lines; True when it was sent."""
        if self.socket_name is None:
            return False
        # a value is one line: a newline would start another key
        text = "\n".join(f"{key}={' '.join(str(value).split())}" for key, value in state.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # on the event loop: never wait for the manager
            self._sock.sendto(text.encode(), _address(self.socket_name))
        except OSError as exc:
            if not self._failed:  # once: a manager gone would otherwise fill the log
                log.warning("cannot notify the service manager: %s", exc.strerror or exc,
                            extra={"notify_socket": self.socket_name})
            self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        """Once: the service is up."""
        if not self.ready_sent:
            self.ready_sent = self.send(READY="1", STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self, status: str) -> None:
        """A stop has begun; said again only to update the status."""
        if self.stopping_sent:
            self.send(STATUS=status)
        else:
            self.stopping_sent = self.send(STOPPING="1", STATUS=status)

    def watchdog(self) -> None:
        self.send(WATCHDOG="1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1: half of ``WATCHDOG_USEC``, as sd_watchdog_enabled
    advises; None without it, or when ``WATCHDOG_PID`` names another process."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid is not None and pid != str(os.getpid()):
        return None
    return int(usec) / 2_000_000


RELOAD_REFUSED = ("SIGHUP ignored: there is no log file to reopen (the logs go to stderr, "
                  "which the service manager keeps) and the options are read only at start: "
                  "restart the service to change them")


def _refused(*_: object) -> None:
    log.warning(RELOAD_REFUSED, extra={"signal": "SIGHUP"})


def refuse_reload(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """SIGHUP, by convention "reload", would end the process by default: say
    instead, once per signal, why it changes nothing. Returns the undo."""

    def refused() -> None:
        _refused()

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    loop.add_signal_handler(signal.SIGHUP, refused)
    return undo


def refuse_reload_in_process() -> None:
    """The same for a command whose event loop is not ours to reach (the
    operator's page): a Python-level handler, run in the main thread."""
    signal.signal(signal.SIGHUP, _refused)
