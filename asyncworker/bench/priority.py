"""The claim's cost with priorities, on SQLite: a queue of ``--ready``
ready jobs (its own, or deliveries over ``--endpoints`` endpoints), all at
priority 0, then the same with priorities drawn from ``--priorities``
("uniform": -100..100, or a list to draw from, "0,0,0,5,10"), claimed
``--claims`` times ``--limit`` at a time (each claim's jobs finished done).

    python -m asyncworker.bench.priority [--ready 100000] [--limit 64]
        [--claims 300] [--rounds 2] [--endpoints 0] [--priorities uniform]

Printed per round: each queue's median and p95 claim latency, the ratio of
the medians (mixed / all 0), and the SQLite VM steps of the first claim in
each (the same count says the claim reads the same rows, whatever the
priorities and the backlog: its cost is its batch's)."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

from lease.endpoints import Endpoint
from lease.records import Attempt
from lease.sqlite import SQLiteStore

INTAKE_CHUNK = 10_000
STEP_TICK = 100  # VM instructions between two calls of the progress handler


def _fill(store: SQLiteStore, ready: int, endpoints: int, levels: list[int] | None) -> None:
    rng = random.Random(7)
    for name in range(endpoints):
        store.add_endpoint(Endpoint(f"e{name}", "http://127.0.0.1:9/hook", types=(f"t{name}",)))
    for start in range(0, ready, INTAKE_CHUNK):
        events: list[dict[str, Any]] = []
        for n in range(start, min(ready, start + INTAKE_CHUNK)):
            event: dict[str, Any] = {"id": f"j{n}", "body": {"n": n}}
            if endpoints:
                event["type"] = f"t{n % endpoints}"
            if levels is not None:
                event["priority"] = rng.choice(levels)
            events.append(event)
        store.enqueue_events(events)


def _claim(store: SQLiteStore, limit: int, served: str | None, steps: list[int]) -> float:
    """One claim's seconds (and its SQLite VM steps added to ``steps[0]``);
    its jobs finished done after the clock stopped."""

    def tick() -> int:
        steps[0] += STEP_TICK
        return 0

    store.connection.set_progress_handler(tick, STEP_TICK)
    started = time.perf_counter()
    try:
        claimed = store.claim_jobs("bench", 30_000, limit, endpoints=served)
    finally:
        took = time.perf_counter() - started
        store.connection.set_progress_handler(None, 0)
    store.finish_jobs([(leased.ticket, "ok", 0, Attempt(claimed.now_ms, 1, 200))
                       for leased in claimed.leased])
    return took


def measure(args: argparse.Namespace, levels: list[int] | None) -> dict[str, Any]:
    served = "*" if args.endpoints else None
    with tempfile.TemporaryDirectory() as folder, \
            SQLiteStore(os.path.join(folder, "queue.db"), create=True) as store:
        _fill(store, args.ready, args.endpoints, levels)
        first = [0]
        _claim(store, args.limit, served, first)
        ignored = [0]  # the progress handler itself costs; every claim pays it alike
        times = sorted(_claim(store, args.limit, served, ignored) for _ in range(args.claims))
        return {"median_us": round(statistics.median(times) * 1e6),
                "p95_us": round(times[int(len(times) * 0.95)] * 1e6), "vm_steps": first[0]}


def _levels(text: str) -> list[int]:
    return list(range(-100, 101)) if text == "uniform" else [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncworker.bench.priority",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready", type=int, default=100_000)
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--endpoints", type=int, default=0,
                        help="0: the queue's own jobs; N: deliveries over N endpoints")
    parser.add_argument("--priorities", type=_levels, default="uniform")
    args = parser.parse_args(argv)
    for round_ in range(1, args.rounds + 1):
        zero, mixed = measure(args, None), measure(args, args.priorities)
        print(f"round {round_}: all 0 {zero}, mixed {mixed},"
              f" ratio {mixed['median_us'] / zero['median_us']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
