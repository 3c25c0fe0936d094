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
from tests.support.commands import cli
from tests.support.servers import ReceiverProcess


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


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)


def test_tune_gc_leaves_the_program_out_and_still_collects_cycles():
    """In a child: this process's collector is the test runner's."""
    out = _child("""
        import gc, json, weakref
        from asyncworker.eventloop import YOUNG_THRESHOLD, tune_gc

        before = gc.get_threshold()
        tune_gc()
        after, frozen = gc.get_threshold(), gc.get_freeze_count()

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        young = [[] for _ in range(YOUNG_THRESHOLD + 10)]  # a collection comes due by itself
        print(json.dumps({"before": before, "after": after, "frozen": frozen,
                          "collected": gone() is None}))
    """)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["after"] == [eventloop.YOUNG_THRESHOLD, *seen["before"][1:]]
    assert seen["before"][0] < eventloop.YOUNG_THRESHOLD
    assert seen["frozen"] > 1000  # the program itself: modules, classes, functions
    assert seen["collected"] is True


@pytest.mark.parametrize("young", [0, -5, 1.5, "7000", True])
def test_tune_gc_refuses_a_threshold_that_is_no_count(young: object):
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="young must be an int of at least 1"):
        eventloop.tune_gc(young)  # type: ignore[arg-type]
    assert gc.get_threshold() == before


@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_and_serve_tune_the_collector_before_their_loop_starts(tmp_path: Path,
                                                                   command: str):
    queue = tmp_path / "q.db"
    assert cli("init", str(queue)).returncode == 0
    argv = ([str(queue), "--url", "http://127.0.0.1:9/events", "--until-idle"]
            if command == "run" else ["--inbox", str(tmp_path / "inbox.db")])
    out = _child(f"""
        from asyncworker import eventloop
        from asyncworker.cli import main

        def tuned(*args):
            print("tuned", flush=True)

        def run(main, loop):  # the loop never starts: the command stops as on Ctrl-C
            main.close()
            print("loop", flush=True)
            raise KeyboardInterrupt

        eventloop.tune_gc, eventloop.run = tuned, run
        print("exit", main([{command!r}, *{argv!r}]))
    """)
    assert out.stdout.splitlines() == ["tuned", "loop", "exit 130"], (out.stdout, out.stderr)
