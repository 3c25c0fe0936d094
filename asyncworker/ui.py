"""The operator's web page (being built): ``asyncworker ui QUEUE``."""

from __future__ import annotations

import argparse


def serve_ui(args: argparse.Namespace) -> int:
    raise SystemExit("asyncworker ui: not available in this version yet")
