"""Helpers the tests share: servers, child programs, clocks, queues."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
DATA = ROOT / "tests" / "data"  # files written by earlier versions of the code
