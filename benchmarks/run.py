"""Reproduce docs/benchmarks.md: ``python -m benchmarks.run [--quick] [--peers]``.

The same as ``asyncworker bench``; the measurements live in asyncworker/bench.py
so that an installed package can run them too.
"""

from asyncworker.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["bench", *sys.argv[1:]]))
