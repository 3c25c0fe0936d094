"""The receiver's own limit: requests/s from a plain concurrent client, on loopback.

    python -m benchmarks.receiver [--requests N] [--concurrency C]

Starts the receiver as its own process twice on fresh inboxes, once with
grouped commits and once with one commit per request, and prints both rates
and their ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncworker.sender import new_session, send_http


def start_receiver(inbox: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "asyncworker", "serve", "--inbox", str(inbox),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


async def fire(url: str, requests: int, concurrency: int) -> float:
    """Send `requests` distinct events with `concurrency` in flight; return requests/s."""
    gate = asyncio.Semaphore(concurrency)
    async with new_session(limit=concurrency) as session:
        async def one(n: int) -> bool:
            async with gate:
                return await send_http(url, {"id": f"b-{n}", "qty": 1}, timeout=30,
                                       session=session)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(n) for n in range(requests)))
        elapsed = time.perf_counter() - started
    assert all(results)
    return requests / elapsed


def measure(group: int, requests: int, concurrency: int, latency_ms: int = 0) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_receiver(Path(tmp) / "inbox.db", "--group", str(group),
                                   "--latency-ms", str(latency_ms))
        try:
            return asyncio.run(fire(url, requests, concurrency))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    grouped = measure(64, args.requests, args.concurrency)
    single = measure(1, args.requests, args.concurrency)
    print(f"receiver, {args.requests} requests, concurrency {args.concurrency}")
    print(f"  grouped commits (up to 64): {grouped:8.0f} requests/s")
    print(f"  one commit per request:     {single:8.0f} requests/s")
    print(f"  ratio grouped/single:       {grouped / single:8.2f}")


if __name__ == "__main__":
    main()
