"""What tracing costs per job: the steps ``asyncworker.tracing`` adds to one
attempt (and to one request at a receiver), timed alone, in microseconds.

    python -m asyncworker.bench.tracing [--jobs 20000] [--rounds 5]

Rows: tracing off, the check ``tracer()`` answering None (the dispatcher
makes it once a claim, a receiver once a request), without opentelemetry-api
(a child process that cannot import it) and with it installed and no
provider set; then, with the SDK's
provider and an in-memory exporter (needs ``opentelemetry-sdk``), an
attempt's span (started with its link, its ``traceparent`` and
``tracestate`` made, current while an empty send is awaited, ended with its
outcome) and a receiver's span (the context read from the headers, started,
noted, ended). Each figure is the least of ``--rounds`` runs of ``--jobs``
(the machine's other load only ever adds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from asyncworker import tracing
from lease.tracing import api

_TICKET = {"id": "order-1@shop", "attempt": 1, "token": 7}


def _least(run: Callable[[int], float], jobs: int, rounds: int) -> float:
    """Microseconds per job: the least of ``rounds`` runs of ``jobs``."""
    return min(run(jobs) for _ in range(rounds)) / jobs * 1e6


_WITHOUT_API = """
import sys
sys.modules["opentelemetry"] = None  # an import of it fails, as if not installed
from asyncworker.bench.tracing import _least, _off
print(_least(_off, int(sys.argv[1]), int(sys.argv[2])))
"""


def _off_without_api(jobs: int, rounds: int) -> float:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_API, str(jobs), str(rounds)],
                          capture_output=True, text=True, check=True)
    return float(done.stdout)


def _off(jobs: int) -> float:
    started = time.perf_counter()
    for _ in range(jobs):
        if tracing.tracer() is not None:
            raise AssertionError("a provider is set: this row measures tracing off")
    return time.perf_counter() - started


async def _nothing() -> object:
    return True


def _attempts(kept: str) -> Callable[[int], float]:
    async def run(jobs: int) -> float:
        started = time.perf_counter()
        for _ in range(jobs):
            traced = tracing.tracer()
            span = tracing.start_attempt(traced, _TICKET, "order-1", kept, "shop",
                                         ("127.0.0.1", 8080), "d1")
            tracing.request_headers(span)
            await tracing.within(span, _nothing())
            tracing.end_attempt(span, "ok", 200, None)
        return time.perf_counter() - started

    return lambda jobs: asyncio.run(run(jobs))


def _receives(headers: dict[str, str]) -> Callable[[int], float]:
    def run(jobs: int) -> float:
        started = time.perf_counter()
        for _ in range(jobs):
            with tracing.receiving(tracing.tracer(), headers, "POST", "/events") as span:
                tracing.noted(span, "order-1", "applied")
                tracing.answered(span, 200)
        return time.perf_counter() - started

    return run


def measure(jobs: int, rounds: int) -> dict[str, Any]:
    otel = api()
    if otel is None:
        raise SystemExit("opentelemetry-api is not installed: tracing is off at no cost")
    rows: dict[str, Any] = {"jobs": jobs, "rounds": rounds,
                            "off_no_api_us": round(_off_without_api(jobs, rounds), 3),
                            "off_api_no_provider_us": round(_least(_off, jobs, rounds), 3)}
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
    except ImportError:
        rows["sdk"] = "not installed"
        return rows
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.trace.set_tracer_provider(provider)
    with provider.get_tracer("bench").start_as_current_span("intake"):
        headers: dict[str, str] = {}
        otel.propagator.inject(headers)
    kept = json.dumps(headers)

    def cleared(run: Callable[[int], float]) -> Callable[[int], float]:
        def once(jobs: int) -> float:
            exporter.clear()  # the exporter's list would grow across rounds
            return run(jobs)
        return once

    rows["sdk_attempt_us"] = round(_least(cleared(_attempts(kept)), jobs, rounds), 2)
    rows["sdk_receive_us"] = round(_least(cleared(_receives(headers)), jobs, rounds), 2)
    provider.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncworker.bench.tracing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.jobs, args.rounds)))


if __name__ == "__main__":
    main()
