"""Shared by several test modules."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, stdin: str | None = None, env: dict | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncworker", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})

