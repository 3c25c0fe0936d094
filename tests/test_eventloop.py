"""The event loop a command runs on: uvloop's when installed, asyncio's when
asked for or when uvloop is missing, and a clear refusal of a loop that
cannot be had."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncworker import eventloop

from .servers import ReceiverProcess
from .test_cli import cli


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_asyncio():
    assert eventloop.run(_loop_module(), "uvloop").startswith("uvloop")
    assert eventloop.run(_loop_module()).startswith("uvloop")  # installed with the test extra
    assert eventloop.run(_loop_module(), "asyncio").startswith("asyncio")
    assert [eventloop.loop_in_use(name) for name in eventloop.LOOPS] == [
        "uvloop", "asyncio", "uvloop"]


def test_a_loop_that_is_no_loop_is_refused_and_its_coroutine_closed():
    main = _loop_module()
    with pytest.raises(ValueError, match="loop must be one of auto, asyncio, uvloop"):
        eventloop.run(main, "trio")
    assert main.cr_frame is None  # closed, so no "never awaited" warning at collection
    gc.collect()


def _without_uvloop(code: str) -> subprocess.CompletedProcess:
    """``code`` in a child where importing uvloop fails, as on a machine without it."""
    script = "import sys\nsys.modules['uvloop'] = None\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)


def test_without_uvloop_auto_is_asyncio_and_uvloop_a_clear_error():
    out = _without_uvloop("""
        import asyncio
        from asyncworker import eventloop

        async def module():
            return type(asyncio.get_running_loop()).__module__

        print(eventloop.run(module()))
        try:
            eventloop.run(module(), "uvloop")
        except RuntimeError as exc:
            print(exc)
    """)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith("asyncio")
    assert second == "uvloop is not installed: pip install 'lease-dispatcher[fast]'"


def test_run_without_uvloop_refuses_loop_uvloop_in_one_line(tmp_path: Path):
    queue = tmp_path / "q.db"
    assert cli("init", str(queue)).returncode == 0
    out = _without_uvloop(f"""
        from asyncworker.cli import main
        sys.exit(main(["run", {str(queue)!r}, "--url", "http://127.0.0.1:9/events",
                       "--loop", "uvloop", "--until-idle"]))
    """)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(
        "uvloop is not installed: pip install 'lease-dispatcher[fast]'")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_delivers_on_either_loop(tmp_path: Path, loop: str):
    queue = tmp_path / "q.db"
    lines = "".join(json.dumps({"id": f"o-{n}", "qty": n + 1}) + "\n" for n in range(30))
    assert cli("init", str(queue)).returncode == 0
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db", "--loop", loop) as rx:
        out = cli("run", str(queue), "--url", rx.url, "--until-idle", "--loop", loop,
                  "--concurrency", "8")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ok"] == 30
        assert rx.stats()["applied"] == 30
