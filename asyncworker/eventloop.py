"""The event loop a command runs on: uvloop's when it is installed, asyncio's
own otherwise; and the garbage collector's settings of a command's process.

uvloop (the ``fast`` extra) runs the same coroutines with less CPU per
callback, for the dispatcher and for a plain aiohttp client alike, so it
moves the figures, not the dispatcher's ratio to the client (measured:
docs/benchmarks.md). Nothing here requires it: ``auto`` falls
back to asyncio, and ``asyncio`` is always asyncio's.

``tune_gc`` is what ``asyncworker run`` and ``serve`` do to the collector
before their loop starts, and what an embedding service may do in its own
process (a library must not do it behind a service's back).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LOOPS", "YOUNG_THRESHOLD", "loop_in_use", "run", "tune_gc"]

T = TypeVar("T")
LOOPS = ("auto", "asyncio", "uvloop")
# Allocations between two collections of the youngest generation (CPython's own: 700).
YOUNG_THRESHOLD = 10_000


def _uvloop() -> Any:
    """The uvloop module, or None when it is not installed."""
    try:
        return importlib.import_module("uvloop")
    except ImportError:
        return None


def loop_in_use(loop: str = "auto") -> str:
    """Which loop ``run(..., loop)`` runs on: "asyncio" or "uvloop"."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "asyncio":
        return "asyncio"
    if _uvloop() is not None:
        return "uvloop"
    if loop == "uvloop":
        raise RuntimeError("uvloop is not installed: pip install 'lease-dispatcher[fast]'")
    return "asyncio"


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``loop`` names (auto: uvloop when installed)."""
    try:
        chosen = loop_in_use(loop)
    except (ValueError, RuntimeError):
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    if chosen == "uvloop":
        return _uvloop().run(main)
    return asyncio.run(main)


def tune_gc(young: int = YOUNG_THRESHOLD) -> None:
    """The collector's settings for a long-running dispatcher or receiver.

    Why: the dispatcher starts a claimed batch's sends together, so some
    thousand objects are young at once; at CPython's threshold of 700 that
    ran a collection of the youngest generation every 16 jobs, and every
    full one walked the tens of thousands of objects that importing aiohttp
    and the rest made (what that cost a job, and what this saves, measured:
    docs/benchmarks.md).

    So: one collection now, then ``gc.freeze()``, which leaves what exists
    (modules, classes, settings: the program itself) out of every later
    collection, and a threshold of ``young`` for the youngest generation.
    Cycles are still collected, ``young`` allocations later at most.
    """
    if type(young) is not int or young < 1:
        raise ValueError(f"young must be an int of at least 1, got {young!r}")
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
