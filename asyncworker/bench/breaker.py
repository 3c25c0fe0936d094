"""``asyncworker bench --endpoints``, the breaker's part: the circuit breaker
kept in the store (``lease.breaker``), measured with the real dispatcher
against a receiver of the benchmark's that goes down and comes back.

1. **outage**: 10,000 deliveries to one endpoint, the endpoint down for 20 s
   (its port closed: connections refused) after a fifth of them arrived, then
   back. The attempts that reached nothing (the endpoint's retried attempts,
   ``endpoint_stats``) against 1 % of the deliveries plus the probes; the
   dispatcher's log records (INFO and up, the level ``run`` shows) from the
   outage's start to the last delivery; the last delivery done against the
   endpoint's return plus 2 s and the cool-down the circuit was in when it
   came back; nothing dead; every delivery applied once at the receiver (it
   dedupes by ``webhook-id``).
2. **neighbours**: three endpoints, every message fanned out to each; one of
   them down (refused) for ``down_s`` (60 s with ``--full-size``, 15 s by
   default) after a warm-up, in a run beside one where nothing goes down:
   the two healthy endpoints' deliveries a second over the same window of
   each run.
3. **shared**: three dispatcher processes, one endpoint answering 503 (no
   ``Retry-After``, after 0.2 s, so two requests at once would overlap) for
   ``down_s``: the requests the receiver sees while the circuit is open, the
   most of them at once, and the probes the breaker audited.

The receiver (``receiver_main``) serves each endpoint on a port of its own,
so one can refuse connections while the others answer, and records every
request: arrival and answer (wall clock, which the store's clock is on this
host), ``webhook-id``, the status it answered, whether it was down. The
breaker's own view comes from the store: ``endpoint_audit`` (opened,
reopened, closed, with their times) and ``endpoint_stats``. ``judge`` turns
the figures into (target, figure, met) lines; it is pure, and the tests feed
it figures that fail each target.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncworker.bench.endpoints import _endpoint, _open, run_dispatchers

__all__ = ["BREAKER_TARGETS", "breaker_cooldowns", "judge_breaker", "print_breaker_table",
           "run_breaker_scenarios"]

OUTAGE_N = 10_000
OUTAGE_S = 20.0
FULL_NEIGHBOUR_DOWN_S = 60.0
DEFAULT_NEIGHBOUR_DOWN_S = 15.0
SHARED_DOWN_S = 20.0
TARGET_WASTE = 0.01  # attempts reaching nothing <= 1 % of the deliveries (+ the probes)
TARGET_LOG_LINES = 50
TARGET_RECOVERY_S = 2.0  # the last delivery done within 2 s + one cool-down of the return
TARGET_NEIGHBOUR_RATIO = 0.9
CHILD_TIMEOUT_S = 1800
BREAKER_TARGETS = {
    "waste": f"{{n:,}} deliveries, the endpoint down {{down_s:g}} s: attempts reaching "
             f"nothing <= {TARGET_WASTE:.0%} of the deliveries + the probes",
    "logs": f"... log records (INFO and up) from the outage <= {TARGET_LOG_LINES}",
    "recovery": f"... the last delivery done within {TARGET_RECOVERY_S:g} s + one cool-down "
                "of the endpoint's return",
    "dead": "... nothing dead",
    "once": "... every delivery applied once at the receiver",
    "neighbours": f"3 endpoints, one down {{down_s:g}} s: the other two's rate / without "
                  f"the outage >= {TARGET_NEIGHBOUR_RATIO}",
    "shared": "{processes} dispatcher processes share one breaker: while open, no request "
              "but one probe at a time",
}


# ----------------------------------------------------------------- the receiver


def receiver_main(params: dict) -> None:
    """Endpoints on ports of their own (``endpoints``: name -> {"outage":
    {"after": requests answered 200 before it goes down, or "at_s": seconds
    after its first request, "down_s", "mode": "refuse" | "503",
    "answer_s": how long a 503 takes}}); each 200 applies its ``webhook-id``
    once. A control port answers GET /stats. Prints {"control": url,
    "endpoints": {name: url}} as one line, then serves until terminated."""
    import asyncio

    from aiohttp import web

    specs: dict[str, dict] = params["endpoints"]
    state: dict[str, dict[str, Any]] = {
        name: {"requests": [], "applied": {}, "duplicates": 0, "down": False,
               "down_at": None, "up_at": None, "first": None, "answered": 0}
        for name in specs}
    runners: dict[str, Any] = {}
    ports: dict[str, int] = {}

    def app_for(name: str) -> web.Application:
        seen = state[name]

        async def answer(request: web.Request) -> web.Response:
            arrived = time.time()
            if seen["first"] is None:
                seen["first"] = arrived
                at_s = (specs[name].get("outage") or {}).get("at_s")
                if at_s is not None:
                    asyncio.get_running_loop().call_later(
                        at_s, lambda: asyncio.ensure_future(go_down(name)))
            await request.read()
            hook = request.headers.get("webhook-id", "")
            if seen["down"]:
                await asyncio.sleep(specs[name]["outage"].get("answer_s", 0.0))
                seen["requests"].append((arrived, time.time(), hook, 503))
                return web.Response(status=503, text="down")
            if hook in seen["applied"]:
                seen["duplicates"] += 1
            else:
                seen["applied"][hook] = time.time()
            seen["requests"].append((arrived, time.time(), hook, 200))
            seen["answered"] += 1
            after = (specs[name].get("outage") or {}).get("after")
            if after is not None and seen["answered"] == after:
                asyncio.ensure_future(go_down(name))
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/hook", answer)
        return app

    async def start(name: str) -> None:
        runner = web.AppRunner(app_for(name), access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", ports.get(name, 0), reuse_address=True)
        await site.start()
        ports[name] = runner.addresses[0][1]
        runners[name] = runner

    async def go_down(name: str) -> None:
        seen, outage = state[name], specs[name]["outage"]
        if seen["down_at"] is not None:
            return
        seen["down"], seen["down_at"] = True, time.time()
        if outage["mode"] == "refuse":  # the port closed, its connections too
            await runners.pop(name).cleanup()
        await asyncio.sleep(outage["down_s"])
        if outage["mode"] == "refuse":
            await start(name)
        seen["down"], seen["up_at"] = False, time.time()

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({name: {**seen, "applied": len(seen["applied"]),
                                         "last_applied": max(seen["applied"].values(),
                                                             default=None)}
                                  for name, seen in state.items()})

    async def main() -> None:
        for name in specs:
            await start(name)
        control = web.Application()
        control.router.add_get("/stats", stats)
        runner = web.AppRunner(control, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(json.dumps({"control": f"http://127.0.0.1:{runner.addresses[0][1]}",
                          "endpoints": {name: f"http://127.0.0.1:{port}/hook"
                                        for name, port in ports.items()}}), flush=True)
        await asyncio.Event().wait()

    from asyncworker import eventloop

    eventloop.run(main())


class _Receiver:
    def __init__(self, endpoints: dict[str, dict]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncworker.bench.breaker", "receiver",
             json.dumps({"endpoints": endpoints})], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("{"):
            self.close()
            raise RuntimeError("the receiver did not start")
        started = json.loads(line)
        self.control: str = started["control"]
        self.urls: dict[str, str] = started["endpoints"]

    def stats(self) -> dict:
        from urllib.request import urlopen

        with urlopen(f"{self.control}/stats", timeout=30) as answer:
            return dict(json.loads(answer.read()))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# ----------------------------------------------------------------- the dispatcher


class _Records(logging.Handler):
    """The log records of the dispatcher's process: (time, logger, message)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.created, record.name, record.getMessage()))


def _capture() -> tuple[_Records, Callable[[], None]]:
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("asyncworker", "lease")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)

    def release() -> None:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(records)
            logger.setLevel(level)

    return records, release


def _dispatch(target: str, concurrency: int, done: Callable[[], bool],
              limit_s: float) -> None:
    """One dispatcher serving every endpoint until ``done()`` (polled every
    100 ms) or ``limit_s``, then a graceful stop."""
    import asyncio

    from asyncworker import eventloop
    from asyncworker.dispatcher import Dispatcher

    async def main() -> None:
        async with Dispatcher(target, "bench", endpoints="*", concurrency=concurrency,
                              lease_ms=60_000, poll_interval=0.01) as dispatcher:
            running = asyncio.create_task(dispatcher.run())
            began = time.monotonic()
            while not running.done() and time.monotonic() - began < limit_s:
                await asyncio.sleep(0.1)
                if done():
                    break
            dispatcher.stop()
            await running

    eventloop.run(main())


def breaker_cooldowns(audit: list[dict]) -> list[tuple[int, str, int]]:
    """(at_ms, action, cool-down ms) of the breaker's opened and reopened
    rows, by lease.breaker's rule (5 s, doubled at each failed probe, capped),
    and (at_ms, "closed", 0) for each close."""
    from lease.breaker import BREAKER

    found: list[tuple[int, str, int]] = []
    cooldown = 0
    for row in audit:
        if row.get("actor") != "breaker":
            continue
        if row["action"] == "opened":
            cooldown = BREAKER.cooldown_ms
        elif row["action"] == "reopened":
            cooldown = min(max(cooldown * 2, BREAKER.cooldown_ms), BREAKER.cooldown_cap_ms)
        elif row["action"] == "closed":
            found.append((row["at_ms"], "closed", 0))
            continue
        else:
            continue
        found.append((row["at_ms"], row["action"], cooldown))
    return found


def _spread(times: list[float]) -> list[tuple[float, int]]:
    """How many of ``times`` fell in each 0.05 s from the first (seconds)."""
    buckets = Counter(round(at // 0.05 * 0.05, 2) for at in times)
    return sorted(buckets.items())


def _cooldown_at(changes: list[tuple[int, str, int]], at_ms: float) -> int | None:
    """The cool-down of the last opening before ``at_ms``, or None."""
    before = [c for c in changes if c[0] <= at_ms and c[1] != "closed"]
    return before[-1][2] if before else None


# ----------------------------------------------------------------- scenarios


def scenario_outage(target: Callable[[str], str], n: int = OUTAGE_N, down_s: float = OUTAGE_S,
                    concurrency: int = 16, mode: str = "refuse") -> dict:
    """Target 1: ``n`` deliveries to one endpoint whose receiver goes down
    (``mode``: "refuse" its connections, or answer "503") for ``down_s`` once
    a fifth of them were answered; one dispatcher (``concurrency``, its
    default 16, and so its default line of claimed jobs) until every one is
    done or dead. Its log records (INFO and up) captured in its process."""
    url = target("outage")
    receiver = _Receiver({"down": {"outage": {"after": n // 5, "down_s": down_s,
                                              "mode": mode}}})
    try:
        store = _open(url)
        store.add_endpoint(_endpoint("down", url=receiver.urls["down"], ack="status"))
        store.enqueue_events({"id": f"m-{i}", "qty": 1} for i in range(n))
        finished: list[float] = []

        def done() -> bool:
            row = store.endpoint_stats()[0]
            if row["done"] + row["dead"] >= n:
                finished.append(time.time())
                return True
            return False

        records, release = _capture()
        began = time.time()
        try:
            _dispatch(url, concurrency, done, limit_s=down_s + 600)
        finally:
            release()
        stats = store.endpoint_stats()[0]
        audit = store.endpoint_audit("down")
        store.close()
        seen = receiver.stats()["down"]
    finally:
        receiver.close()
    changes = breaker_cooldowns(audit)
    down_at, up_at = seen["down_at"], seen["up_at"]
    end = finished[0] if finished else time.time()
    outage_records = [r for r in records.seen if down_at is not None and r[0] >= down_at]
    probes = sum(1 for c in changes if c[1] in ("reopened", "closed"))
    return {"n": n, "down_s": down_s, "mode": mode, "concurrency": concurrency,
            "seconds": round(end - began, 2),
            "retried": stats["retried"], "done": stats["done"], "dead": stats["dead"],
            "probes": probes, "failed_probes": sum(1 for c in changes if c[1] == "reopened"),
            "changes": [(round((at - down_at * 1000) / 1000, 2) if down_at else None, action,
                         cooldown) for at, action, cooldown in changes],
            "log_lines": len(outage_records),
            # when the records came, in seconds after the outage began
            "log_at": _spread([r[0] - down_at for r in outage_records]) if down_at else [],
            "log_kinds": Counter(f"{name}: {msg}" for _, name, msg in outage_records)
            .most_common(6),
            "requests_down": sum(1 for r in seen["requests"] if r[3] == 503),
            "applied": seen["applied"], "duplicates": seen["duplicates"],
            "recovered_s": round(end - up_at, 2) if up_at else None,
            "cooldown_at_return_ms": _cooldown_at(changes, up_at * 1000) if up_at else None,
            "down_at_s": round(down_at - began, 2) if down_at else None,
            "finished": bool(finished)}


def scenario_neighbours(target: Callable[[str], str], down_s: float = DEFAULT_NEIGHBOUR_DOWN_S,
                        warm_s: float = 3.0, pairs: int = 1, concurrency: int = 64,
                        per_s: int = 2500) -> dict:
    """Three endpoints taking every message; ``pairs`` alternating runs,
    without an outage and with "down" refusing connections from ``warm_s``
    after its first request for ``down_s``; the healthy two's requests
    answered 200 whose arrival is in that window, a second (the run without
    the outage: the same window, nothing going down)."""
    n = int(per_s * (warm_s + down_s + 5))
    rates: dict[str, list[float]] = {"absent": [], "present": []}
    backlog_left: list[int] = []
    for k in range(pairs):
        for case in ("absent", "present"):
            outage = {"at_s": warm_s, "down_s": down_s, "mode": "refuse"}
            receiver = _Receiver({"a": {}, "b": {},
                                  "down": {"outage": outage} if case == "present" else {}})
            try:
                url = target(f"{case}-{k}")
                store = _open(url)
                for name in ("a", "b", "down"):
                    store.add_endpoint(_endpoint(name, url=receiver.urls[name], ack="status"))
                for start in range(0, n, 50_000):
                    store.enqueue_events({"id": f"m-{i}", "qty": 1}
                                         for i in range(start, min(n, start + 50_000)))
                window: list[float] = []

                def over(receiver: Any = receiver, window: list[float] = window) -> bool:
                    first = receiver.stats()["down"]["first"]
                    if first is None:
                        return False
                    window[:] = [first + warm_s, first + warm_s + down_s]
                    return time.time() > window[1] + 0.5

                _dispatch(url, concurrency, over, limit_s=warm_s + down_s + 600)
                left = {row["name"]: row["ready"] for row in store.endpoint_stats()}
                store.close()
                seen = receiver.stats()
            finally:
                receiver.close()
            start_s, end_s = window
            healthy = sum(1 for name in ("a", "b") for r in seen[name]["requests"]
                          if r[3] == 200 and start_s <= r[0] < end_s)
            rates[case].append(healthy / (end_s - start_s))
            backlog_left.append(min(left["a"], left["b"]))
    # a run whose backlog ran out before the window has no rate there to compare:
    # no ratio (0.0: not met), and backlog_left says why
    ratios = [present / absent if absent else 0.0
              for absent, present in zip(rates["absent"], rates["present"], strict=True)]
    return {"down_s": down_s, "warm_s": warm_s, "messages": n, "concurrency": concurrency,
            "absent": [round(x) for x in rates["absent"]],
            "present": [round(x) for x in rates["present"]],
            "ratio": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios],
            "backlog_left": min(backlog_left)}


def scenario_shared(target: Callable[[str], str], down_s: float = SHARED_DOWN_S,
                    processes: int = 3, concurrency: int = 16, warm: int = 500,
                    answer_s: float = 0.2) -> dict:
    """``processes`` dispatcher processes on one endpoint whose receiver
    answers 503 (after ``answer_s``) for ``down_s`` once ``warm`` requests
    were answered; the dispatchers run until the circuit had time to close
    after it came back. The receiver's requests while the circuit was open
    (after the breaker's first "opened" row, before its "closed"), the most
    of them at once, and the probes (the reopened and closed rows)."""
    from lease.breaker import BREAKER
    from lease.endpoints import delivery_id

    url = target("shared")
    receiver = _Receiver({"down": {"outage": {"after": warm, "down_s": down_s, "mode": "503",
                                              "answer_s": answer_s}}})
    # the longest the circuit may stay open past the return: cool-downs of 5,
    # 10, 20 ... s summing past down_s, the last of them
    cooldown, total = BREAKER.cooldown_ms / 1000, 0.0
    while total < down_s:
        total += cooldown
        cooldown *= 2
    seconds = 3.0 + down_s + cooldown / 2 + 5.0
    try:
        store = _open(url)
        store.add_endpoint(_endpoint("down", url=receiver.urls["down"], ack="status"))
        rate = 400
        store.enqueue_events({"id": f"m-{i}", "qty": 1} for i in range(int(rate * seconds)))
        run_dispatchers(url, processes, seconds, concurrency)
        audit = store.endpoint_audit("down")
        histories = {}
        seen = receiver.stats()["down"]
        changes = breaker_cooldowns(audit)
        opened = [c[0] / 1000 for c in changes if c[1] == "opened"]
        closed = [c[0] / 1000 for c in changes if c[1] == "closed"]
        start = opened[0] if opened else None
        end = closed[-1] if closed else time.time()
        while_open = [r for r in seen["requests"] if start is not None and start <= r[0] < end]
        for r in while_open:  # webhook-id is the message's id
            histories[r[2]] = store.job_history(delivery_id(r[2], "down"))
        store.close()
    finally:
        receiver.close()
    # a request claimed before the circuit opened (in flight or in a
    # dispatcher's line when it opened), or a probe claimed while it was open
    claimed_before = 0
    probes_seen = []
    for r in while_open:
        attempts = (histories.get(r[2]) or {}).get("attempts", [])
        begun = [a["started_ms"] for a in attempts if a.get("started_ms") is not None
                 and a["started_ms"] <= r[0] * 1000 + 5]
        if begun and start is not None and max(begun) < start * 1000:
            claimed_before += 1
        else:
            probes_seen.append((r[0], r[1]))
    down_at = seen["down_at"]
    return {"processes": processes, "concurrency": concurrency, "down_s": down_s,
            "seconds": seconds,
            "requests_down": sum(1 for r in seen["requests"] if r[3] == 503),
            "before_open": sum(1 for r in seen["requests"] if r[3] == 503 and start is not None
                               and r[0] < start),
            "while_open": len(while_open), "claimed_before_open": claimed_before,
            "most_at_once": _most_at_once([(r[0], r[1]) for r in while_open]),
            "probes_at_once": _most_at_once(probes_seen),
            "probes": sum(1 for c in changes if c[1] in ("reopened", "closed")),
            "changes": [(round(at / 1000 - down_at, 2) if down_at else None, action, cooldown)
                        for at, action, cooldown in changes],
            "opened_after_s": round(start - down_at, 2) if start and down_at else None,
            # a few of the requests while open: when they came and when their
            # attempts were claimed, in seconds after the opening
            "sample": [(round(r[0] - start, 3), [
                round(a["started_ms"] / 1000 - start, 3) for a in
                (histories.get(r[2]) or {}).get("attempts", []) if a.get("started_ms")])
                for r in while_open[:: max(1, len(while_open) // 8)]] if start else []}


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of the (start, end) intervals overlapping at once."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda x: (x[0], x[1]))
    most = live = 0
    for _, step in events:
        live += step
        most = max(most, live)
    return most


SCENARIOS: dict[str, Callable[..., dict]] = {
    "outage": scenario_outage,
    "neighbours": scenario_neighbours,
    "shared": scenario_shared,
}


# ----------------------------------------------------------------- judging


def judge_breaker(results: dict[str, dict]) -> list[tuple[str, str, str, bool]]:
    """(key, target, figure, met) for each breaker target whose figures
    ``results`` holds; ``met`` is computed from the figures alone."""
    found: list[tuple[str, str, str, bool]] = []
    out = results.get("outage")
    if out is not None:
        allowed = out["n"] * TARGET_WASTE + out["probes"]
        found.append(("waste", BREAKER_TARGETS["waste"].format(n=out["n"],
                                                               down_s=out["down_s"]),
                      f"{out['retried']} attempts retried (limit {allowed:g}: "
                      f"{out['probes']} probes); breaker: "
                      + ", ".join(f"{a} at {t} s" for t, a, _ in out["changes"]),
                      out["retried"] <= allowed))
        found.append(("logs", BREAKER_TARGETS["logs"], f"{out['log_lines']} records",
                      out["log_lines"] <= TARGET_LOG_LINES))
        cooldown = out["cooldown_at_return_ms"]
        recovered = out["recovered_s"]
        if recovered is None or cooldown is None or not out["finished"]:
            found.append(("recovery", BREAKER_TARGETS["recovery"],
                          "the run did not finish" if not out["finished"] else
                          "no return or no opening seen", False))
        else:
            limit = TARGET_RECOVERY_S + cooldown / 1000
            found.append(("recovery", BREAKER_TARGETS["recovery"],
                          f"{recovered:.2f} s after the return (limit {limit:g} s: the "
                          f"cool-down then {cooldown / 1000:g} s)", recovered <= limit))
        found.append(("dead", BREAKER_TARGETS["dead"], f"{out['dead']} dead", out["dead"] == 0))
        found.append(("once", BREAKER_TARGETS["once"],
                      f"{out['applied']:,} of {out['n']:,} applied, {out['duplicates']} "
                      f"sent again after a 200", out["applied"] == out["n"]
                      and out["duplicates"] == 0))
    near = results.get("neighbours")
    if near is not None:
        found.append(("neighbours", BREAKER_TARGETS["neighbours"].format(down_s=near["down_s"]),
                      f"{'/'.join(map(str, near['present']))} vs "
                      f"{'/'.join(map(str, near['absent']))} deliveries/s; "
                      f"x{near['ratio']:.2f} (pairs {near['ratios']}); backlog left at the "
                      f"window's end {near['backlog_left']:,}",
                      near["ratio"] >= TARGET_NEIGHBOUR_RATIO and near["backlog_left"] > 0))
    shared = results.get("shared")
    if shared is not None:
        extra = shared["while_open"] - shared["probes"]
        found.append(("shared", BREAKER_TARGETS["shared"].format(processes=shared["processes"]),
                      f"{shared['while_open']} requests while open, {shared['probes']} probes "
                      f"audited; {shared['claimed_before_open']} of them claimed before it "
                      f"opened (in flight or in line), the other "
                      f"{shared['while_open'] - shared['claimed_before_open']} claimed while "
                      f"open, at most {shared['probes_at_once']} of those at once (of all, "
                      f"{shared['most_at_once']}); {shared['before_open']} answered 503 "
                      f"before it opened ({shared['opened_after_s']} s after the outage began)",
                      shared["most_at_once"] <= 1 and extra <= 0))
    return found


def print_breaker_table(results: dict[str, dict], out: Any) -> None:
    out.write("breaker targets:\n")
    o = results.get("outage")
    if o is not None:
        out.write(f"  outage: {o['n']:,} deliveries, down at {o['down_at_s']} s for "
                  f"{o['down_s']:g} s ({o['mode']}); {o['seconds']} s in all; log records "
                  f"from the outage by kind: {o['log_kinds']}\n")
    for _, target, figure, met in judge_breaker(results):
        out.write(f"  {'met    ' if met else 'not met'}  {target}: {figure}\n")
    out.flush()


def run_child(name: str, params: dict) -> dict:
    """One scenario in a fresh process, on a SQLite file of its own."""
    out = subprocess.run([sys.executable, "-m", "asyncworker.bench.breaker", name,
                          json.dumps(params)], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"scenario {name} {params} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def child_main(name: str, params_json: str) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    from asyncworker import eventloop

    eventloop.tune_gc()
    folder = Path(tempfile.mkdtemp(prefix="asyncworker-bench-"))
    try:
        result = SCENARIOS[name](lambda label: str(folder / f"{label}.db"),
                                 **json.loads(params_json))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result))


def run_breaker_scenarios(*, full: bool = False, quick: bool = False,
                          only: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Each scenario in a fresh child process, on SQLite."""
    plan = {
        "outage": {"n": 1000 if quick else OUTAGE_N, "down_s": 6.0 if quick else OUTAGE_S},
        "neighbours": {"down_s": 4.0 if quick else FULL_NEIGHBOUR_DOWN_S if full
                       else DEFAULT_NEIGHBOUR_DOWN_S, "warm_s": 1.0 if quick else 3.0,
                       **({"per_s": 1500} if quick else {})},
        "shared": {"down_s": 6.0 if quick else SHARED_DOWN_S},
    }
    results = {}
    for name, params in plan.items():
        if only is not None and name not in only:
            continue
        results[name] = run_child(name, params)
        print(f"  measured: breaker {name}", file=sys.stderr, flush=True)
    return results


def run_main(params_json: str) -> None:
    """The breaker's scenarios alone, judged: ``python -m asyncworker.bench.breaker run
    '{"full": true, "only": ["neighbours"]}'`` (``run_breaker_scenarios``'s arguments)."""
    params = json.loads(params_json)
    if "only" in params:
        params["only"] = tuple(params["only"])
    results = run_breaker_scenarios(**params)
    print_breaker_table(results, sys.stdout)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver_main(json.loads(sys.argv[2]))
    elif sys.argv[1] == "run":
        run_main(sys.argv[2] if len(sys.argv) > 2 else "{}")
    else:
        child_main(sys.argv[1], sys.argv[2])
