"""The event loop a command runs on: uvloop's when it is installed, asyncio's
own otherwise.

uvloop (the ``fast`` extra) runs the same coroutines with less CPU per
callback: on the CPU benchmark about 12% less per job for the dispatcher
and as much for a plain aiohttp client, so it moves the figures, not the
dispatcher's ratio to the client. Nothing here requires it: ``auto`` falls
back to asyncio, and ``asyncio`` is always asyncio's.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Coroutine, TypeVar

__all__ = ["LOOPS", "loop_in_use", "run"]

T = TypeVar("T")
LOOPS = ("auto", "asyncio", "uvloop")


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
