"""A child process for the real-process tests: it opens the queue file itself.

    python tests/support/child.py race PATH OWNER ROUNDS  # claim once a round, with a pipe
    python tests/support/child.py crash SPEC_JSON    # one call, os._exit(73) at one fault point
    python tests/support/child.py dispatch SPEC_JSON     # run_file against a receiver URL
    python tests/support/child.py dispatcher SPEC_JSON   # the async Dispatcher, a receiver
    python tests/support/child.py churn SPEC_JSON   # every write function in a loop, until killed
"""

from __future__ import annotations

import json
import os
import signal
import sys

from lease import http, worker


def race(path: str, owner: str, rounds: int) -> None:
    """Each round: wait for 'go' on stdin, claim once, print the ticket (or null)."""
    con = worker.open_queue(path)
    try:
        for _ in range(rounds):
            if sys.stdin.readline().strip() != "go":
                return
            ticket = worker.claim(con, owner, int(os.environ["RACE_NOW"]), 60000)
            print(json.dumps(ticket), flush=True)
    finally:
        con.close()


def crash(spec: dict) -> None:
    """Call worker.<op>(con, *args, fault=...) and die for real at spec['point']."""

    def fault(point: str) -> None:
        if point == spec["point"]:
            if spec.get("how") == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(73)  # no finally, no close, no rollback: a real crash

    con = worker.open_queue(spec["path"])
    getattr(worker, spec["op"])(con, *spec["args"], fault=fault)
    os._exit(0)  # the point was never reached: the parent sees 0, not 73


def dispatch(spec: dict) -> None:
    """run_file with the strict sender; with die_after_ack, exit right after the ACK."""

    def send(event: dict) -> bool:
        acked = http.send_http(spec["url"], event, timeout=5)
        if spec.get("die_after_ack"):
            os._exit(73)  # the receiver committed and answered; we never record it
        return acked

    clock = iter(spec["clock"]).__next__
    print(json.dumps(worker.run_file(spec["path"], spec["owner"], clock, send, 0.5,
                                     spec["lease_ms"])), flush=True)


def dispatcher(spec: dict) -> None:
    """The async Dispatcher until idle (or a signal); with die_after_acks=N, os._exit(73)
    right after the N-th ACK, before that job's finish. Prints its stats as JSON."""
    import asyncio

    from asyncworker import Dispatcher, run_until_signalled, send_http

    acks = 0

    async def send(event: dict, token: int) -> object:
        nonlocal acks
        acked = await send_http(spec["url"], event, timeout=5, token=token)
        acks += 1
        if acks == spec.get("die_after_acks"):
            os._exit(73)
        return acked

    async def go() -> dict:
        async with Dispatcher(spec["path"], spec["owner"], send=send,
                              concurrency=spec.get("concurrency", 8),
                              lease_ms=spec.get("lease_ms", 2000)) as d:
            print("ready", flush=True)
            stats = await run_until_signalled(d, until_idle=spec.get("until_idle", True))
            return stats.as_dict()

    print(json.dumps(asyncio.run(go())), flush=True)


def churn(spec: dict) -> None:
    """Every write function, single and batched, in a seeded random loop, until the
    parent kills this process at a random moment. Clock: real milliseconds."""
    import random
    import time

    rng = random.Random(spec["seed"])
    con = worker.open_queue(spec["path"])
    ids = spec["ids"]
    clock = lambda: int(time.time() * 1000)  # noqa: E731

    def send(event: dict) -> object:
        roll = rng.random()
        if roll < 0.2:
            raise worker.Retryable("busy")
        if roll < 0.25:
            raise worker.Permanent("no")
        return True

    print("churning", flush=True)
    while True:
        step = rng.random()
        try:
            if step < 0.3:
                worker.run_once(con, f"churn-{spec['seed']}", clock, send, rng.random(), 40)
            elif step < 0.55:
                tickets = worker.claim_many(con, "churn", clock(), 40, rng.randint(1, 8))
                items = [(t, rng.choice(["ok", "retry", "permanent"]), rng.randint(0, 20))
                         for t in tickets]
                worker.finish_many(con, items, clock())
            elif step < 0.7:
                dead = [r[0] for r in con.execute("SELECT id FROM jobs WHERE status = 'dead'")]
                if dead:
                    worker.redrive(con, rng.choice(dead), clock(), spec["ttl"], "churn")
            elif step < 0.8:
                picks = rng.sample(ids, 5)
                worker.enqueue_many(con, [{"id": i, "qty": spec["qty"]} for i in picks],
                                    clock(), spec["ttl"])
            else:
                ticket = worker.claim(con, "churn-x", clock(), 40)
                if ticket:
                    worker.extend(con, ticket, clock(), 80)
        except ValueError:  # a redrive that lost a race with nothing: not a fault
            pass


if __name__ == "__main__":
    if sys.argv[1] == "race":
        race(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "crash":
        crash(json.loads(sys.argv[2]))
    elif sys.argv[1] == "dispatch":
        dispatch(json.loads(sys.argv[2]))
    elif sys.argv[1] == "dispatcher":
        dispatcher(json.loads(sys.argv[2]))
    elif sys.argv[1] == "churn":
        churn(json.loads(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
