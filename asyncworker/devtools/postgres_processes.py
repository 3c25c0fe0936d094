"""The processes of a PostgreSQL server the tests started: find them, kill them,
wait until they are gone (Linux: read from /proc).

Standard library only, because it also runs alone, by its path, as the server's
watchdog: ``python postgres_processes.py PID ROOT`` waits on its stdin and, when
the stdin ends without the word ``released`` (the test process died: SIGKILL,
SIGTERM, a crash), kills the server and removes its folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

GONE_TIMEOUT_S = 10.0  # a SIGKILLed process is gone as soon as the kernel tears it down
RELEASED = b"released"  # the owner closed the server itself: the watchdog does nothing


def state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    found = state(pid)
    return found is not None and found[0] not in ("Z", "X")  # a zombie holds nothing


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = state(int(entry.name))
            if stat is not None and stat[1] == pid:
                found.append(int(entry.name))
    return found


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL processes still alive {GONE_TIMEOUT_S:.0f} s after "
                               f"SIGKILL: {[pid for pid in pids if alive(pid)]}")
        time.sleep(0.01)


def kill_tree(postmaster: int) -> None:
    """SIGKILL a postmaster and all its children; return once every one is gone
    (so a new postmaster can take the shared memory back). Stopped first, the
    postmaster cannot fork meanwhile, and the children it cannot reap keep their
    pids: no signal reaches another process that took a pid again."""
    os.kill(postmaster, signal.SIGSTOP)
    found = children(postmaster)
    for child in found:
        with contextlib.suppress(ProcessLookupError):  # it died on its own
            os.kill(child, signal.SIGKILL)
    os.kill(postmaster, signal.SIGKILL)
    wait_gone([postmaster, *found])


def serves(pid: int, root: str) -> bool:
    """Whether pid is still the postmaster whose data lives under root."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return alive(pid) and any(arg.startswith(os.fsencode(root)) for arg in args)


def watch(postmaster: int, root: str) -> None:
    # EOF comes when the owner writes RELEASED and closes, or when it dies, whatever way
    if sys.stdin.buffer.read().startswith(RELEASED):
        return
    if serves(postmaster, root):
        kill_tree(postmaster)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
