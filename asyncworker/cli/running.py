"""``run`` and ``serve``: the dispatcher and the receiver, each in this process
until a signal stops it gracefully (or ``run --until-idle`` finds nothing left)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Coroutine
from contextlib import closing
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncworker.cli.exits import EXIT_DEAD, EXIT_INTERRUPTED, EXIT_OK
from asyncworker.cli.output import (
    announce,
    duration,
    progress_line,
    say_blocked,
    say_left_leased,
    show_progress,
)
from asyncworker.operations import (
    UsageError,
    WorkFailed,
    about,
    open_queue_store,
    paused_words,
    reached,
    read_secret_file,
    served_tls,
    shown,
)
from lease.policy import RetryPolicy
from lease.records import StoreError
from lease.signing import TOLERANCE_S

if TYPE_CHECKING:
    from asyncworker.dispatcher import Dispatcher
    from asyncworker.service import Notifier
    from lease.http import Destination


# ------------------------------------------------------------------ run


def _retry_policy(args: argparse.Namespace) -> RetryPolicy:
    if args.backoff_cap_ms < args.backoff_base_ms:
        raise UsageError(f"--backoff-cap-ms ({args.backoff_cap_ms}) must be at least "
                         f"--backoff-base-ms ({args.backoff_base_ms})")
    return RetryPolicy(backoff_base_ms=args.backoff_base_ms,
                       backoff_cap_ms=args.backoff_cap_ms, jitter=args.jitter,
                       lease_ms=args.lease_ms)


def _destination(args: argparse.Namespace) -> Destination:
    """run's --url and its flags: every fault a usage error, before the queue is opened."""
    secrets = () if args.secret_file is None else read_secret_file(args.secret_file)
    destination = reached(args, "--url", args.url, ack=args.ack or "echo-id", secrets=secrets)
    assert destination is not None  # --url is given
    return destination


def _served(args: argparse.Namespace) -> str | tuple[str, ...]:
    """run without --url: the endpoints it serves ("*": every one, those added
    later too), its flags checked before the queue is opened."""
    if args.url is not None:
        raise UsageError("--endpoint goes without --url: --url sends the queue's own jobs, "
                         "--endpoint the deliveries to that endpoint")
    given = [flag for flag, value in (("--ack", args.ack), ("--ca-file", args.ca_file),
                                      ("--secret-file", args.secret_file),
                                      ("--insecure-plain-http", args.insecure_plain_http))
             if value]
    if given:
        raise UsageError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --url: "
                         f"an endpoint is sent as it says (asyncworker endpoint update changes "
                         f"it)")
    if args.crash_after_acks is not None:
        raise UsageError("--crash-after-acks goes with --url")
    return "*" if args.endpoints is None else tuple(sorted(set(args.endpoints)))


def _check_served(queue: str, served: str | tuple[str, ...]) -> list[str]:
    """The endpoints a run will serve, read from the queue (migrated here, once):
    none at all, or one named that is not there, is a usage error."""
    with closing(open_queue_store(queue)) as store:
        names = [row["name"] for row in store.endpoints()]
    if not names:
        raise UsageError(f"{shown(queue)} has no endpoints: give --url (the receiver of the "
                         f"queue's own jobs), or add one (asyncworker endpoint add)")
    unknown = [] if served == "*" else sorted(set(served) - set(names))
    if unknown:
        raise UsageError(f"no endpoint {', '.join(map(repr, unknown))} in {shown(queue)} "
                         f"(it has {', '.join(names)})")
    return names if served == "*" else list(served)


def _default_owner() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


def run(args: argparse.Namespace) -> int:
    policy = _retry_policy(args)
    if args.url is not None and not args.endpoint_label:
        raise UsageError("--no-endpoint-label goes without --url: it drops the endpoint label "
                         "of the deliveries' metrics")
    if args.url is None:  # the deliveries to the queue's endpoints
        served = _served(args)
        send_timeout_ms = _send_timeout_ms(args, policy)
        names = _check_served(args.queue, served)  # missing or foreign: exit 2; migrated once
        target: dict[str, Any] = {"endpoints": served}
        sends_to = (f"endpoints {', '.join(names)}"
                    f"{' (and any added while it runs)' if served == '*' else ''}")
    else:
        if args.endpoints is not None:
            _served(args)  # the error that says why
        destination = _destination(args)
        # missing or foreign: exit 2 before anything runs; a file is migrated here, once
        open_queue_store(args.queue).close()
        send_timeout_ms = _send_timeout_ms(args, policy)
        target = {"destination": destination}
        if args.crash_after_acks is not None:
            target = {"send": _crashing_sender(destination, send_timeout_ms or args.lease_ms,
                                               args.crash_after_acks)}
        keys = len(destination.secrets)  # how many, never which
        signed = f"signed with {keys} secret{'s' if keys > 1 else ''}" if keys else "unsigned"
        sends_to = f"url {args.url} (ack {destination.ack}, {signed})"
    from asyncworker.dispatcher import Dispatcher

    owner = args.owner or _default_owner()
    try:
        dispatcher = Dispatcher(args.queue, owner, **target, concurrency=args.concurrency,
                                lease_ms=args.lease_ms, send_timeout_ms=send_timeout_ms,
                                poll_interval=args.poll_ms / 1000, batch_size=args.batch_size,
                                prefetch=args.prefetch, policy=policy,
                                endpoint_label=args.endpoint_label)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    banner = (f"run: owner {owner}, queue {shown(args.queue)}, {sends_to}, concurrency "
              f"{args.concurrency}, lease {args.lease_ms} ms, backoff "
              f"{policy.backoff_base_ms}..{policy.backoff_cap_ms} ms, jitter {policy.jitter}")
    from asyncworker import eventloop

    loop = _usable_loop(args.loop)
    eventloop.tune_gc()  # this process is the dispatcher's own
    try:
        end = eventloop.run(_dispatch(dispatcher, args.until_idle, banner, args.metrics), loop)
    except StoreError as exc:  # the queue failed under the run: its summary is not printed
        raise WorkFailed(about(args.queue, exc)) from None
    stats = dispatcher.stats
    summary = {"owner": owner, **stats.as_dict(), "seconds": round(end.seconds, 3),
               "rate": round(end.rate, 1)}
    if dispatcher.aborted:
        summary["leases_left"] = dispatcher.left_leased
    if end.blocked is not None:
        summary["blocked_heads"] = end.blocked
    print(json.dumps(summary))
    if dispatcher.aborted:  # interrupted: what it left runs out by its leases
        return EXIT_INTERRUPTED
    return EXIT_DEAD if stats.dead or end.blocked else EXIT_OK


def _send_timeout_ms(args: argparse.Namespace, policy: RetryPolicy) -> int | None:
    """--send-timeout, within the retry budget; None: each send bounded by its lease."""
    if args.send_timeout is None:
        return None
    if not 1 <= args.send_timeout <= policy.ttl_ms:
        raise UsageError(f"--send-timeout must be 1 ms up to the retry budget, a job's time "
                         f"to live ({duration(policy.ttl_ms)} ms), got {args.send_timeout} ms")
    return args.send_timeout


def _usable_loop(loop: str) -> str:
    """--loop, checked before anything starts: uvloop asked for and missing is a usage error."""
    from asyncworker.eventloop import loop_in_use

    try:
        return loop_in_use(loop)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None


CRASH_DRILL = "crash drill: SIGKILL right after the ACK of"  # then: ID token N


def _crashing_sender(destination: Destination, timeout_ms: int, after: int) -> Any:
    """The default send to the destination (its TLS, ACK policy and signatures),
    plus a failure drill: SIGKILL itself right after an ACK."""
    import signal

    from asyncworker.sender import send_http

    acks = 0

    async def send(event: dict, token: int) -> object:
        nonlocal acks
        acked = await send_http(destination, event, timeout=timeout_ms / 1000, token=token)
        acks += 1
        if acks >= after:
            # Which job, for the evidence: the receiver committed it, the queue never hears.
            sys.stderr.write(f"{CRASH_DRILL} {event['id']} token {token}, before recording "
                             "it\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return acked

    return send


class RunEnd(NamedTuple):
    """How a run ended: its length and rate (jobs done a second), and, for a run
    that ended idle (--until-idle, no signal), the keys blocked by a dead first
    job (``Store.blocked_heads``; None when not asked)."""

    seconds: float
    rate: float
    blocked: list[dict] | None


async def _dispatch(dispatcher: Dispatcher, until_idle: bool, banner: str,
                    metrics: tuple[str, int] | None = None) -> RunEnd:
    import asyncio

    from asyncworker.dispatcher import run_until_signalled
    from asyncworker.service import Notifier, refuse_reload

    notifier = Notifier.from_environment()
    allow_reload = refuse_reload(asyncio.get_running_loop())
    # Bound before the queue is opened: a port taken is exit 2 with nothing claimed.
    served = None if metrics is None else await _serve_metrics(dispatcher, *metrics)
    signalled: list[str] = []
    started = time.monotonic()

    def on_stop(line: str) -> None:
        signalled.append(line)
        announce(line)
        notifier.stopping(line)

    try:
        async with dispatcher:
            progress = asyncio.create_task(_progress(dispatcher, notifier), name="progress")
            telling = asyncio.create_task(_tell_manager(dispatcher, notifier), name="notify")
            blocked = None
            try:
                await run_until_signalled(
                    dispatcher, until_idle=until_idle, on_stop=on_stop,
                    # printed once a signal means a graceful stop: a supervisor may wait for it
                    on_ready=lambda: announce(banner, owner=dispatcher.owner))
                if until_idle and not signalled:  # idle: is anything blocked?
                    blocked = _heads(await dispatcher.queue.call(
                        lambda store: store.blocked_heads()))
            finally:
                progress.cancel()
                telling.cancel()
                seconds = time.monotonic() - started
                rate = dispatcher.stats.ok / seconds if seconds > 0 else 0.0
                show_progress(dispatcher.stats, rate, final=True)
                notifier.stopping("stopped: " + progress_line(dispatcher.stats, rate))
            if dispatcher.aborted:
                say_left_leased(dispatcher.left_leased)
            if blocked:
                say_blocked(blocked)
            return RunEnd(seconds, rate, blocked)
    finally:
        allow_reload()
        notifier.close()
        if served is not None:
            await served.cleanup()


async def _tell_manager(dispatcher: Dispatcher, notifier: Notifier) -> None:
    """READY once the first claim committed (the store answers, the work has
    begun: a unit ordered after this one finds it dispatching), and WATCHDOG
    every half of the manager's interval while the loop runs."""
    import asyncio

    from asyncworker.service import watchdog_interval_s

    if not notifier.enabled:
        return

    async def ready() -> None:
        await dispatcher.first_claim.wait()
        notifier.ready(f"dispatching: owner {dispatcher.owner}, first claim made")

    telling = asyncio.create_task(ready(), name="ready")
    interval = watchdog_interval_s()
    try:
        while interval is not None:
            notifier.watchdog()
            await asyncio.sleep(interval)
        await telling
    finally:
        telling.cancel()


def _heads(blocked: list[dict]) -> list[dict]:
    """The blocked heads as a run names them: a delivery's with its endpoint, a
    job of the queue's own as it always was (no endpoint key)."""
    return [head if head.get("endpoint") is not None
            else {k: v for k, v in head.items() if k != "endpoint"} for head in blocked]


async def _serve_metrics(dispatcher: Dispatcher, host: str, port: int) -> Any:
    """/metrics and /healthz on this loop while the dispatcher runs; the URL on stderr."""
    from asyncworker.metrics import start_metrics_server

    try:
        runner, url = await start_metrics_server(dispatcher, host, port)
    except OSError as exc:  # taken, not this host's address, or a name that does not resolve
        raise UsageError(f"--metrics {host}:{port}: cannot serve there: "
                         f"{exc.strerror or exc}") from None
    announce(f"metrics: {url}/metrics and /healthz", metrics_url=f"{url}/metrics",
             health_url=f"{url}/healthz")
    return runner


async def _progress(dispatcher: Dispatcher, notifier: Notifier) -> None:
    """The progress line on stderr, and as the service's status when it has a
    manager; it says so while the queue is paused (the dispatcher keeps
    polling, and leases nothing: ``run --until-idle`` waits for the resume)."""
    import asyncio

    stats = dispatcher.stats
    interval = 0.5 if sys.stderr.isatty() else 2.0
    last_ok, last_time = stats.ok, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        rate = (stats.ok - last_ok) / (now - last_time)
        paused = await _paused(dispatcher)
        show_progress(stats, rate, paused=paused)
        if notifier.ready_sent and not notifier.stopping_sent:
            notifier.status(progress_line(stats, rate, paused))
        last_ok, last_time = stats.ok, now


async def _paused(dispatcher: Dispatcher) -> str | None:
    """The queue's pause in words, or None (running, or the store did not
    answer this time: the line says nothing rather than something stale)."""
    try:
        state = await dispatcher.queue.run(lambda store: store.paused())
    except StoreError:
        return None
    return None if state is None else paused_words(state)


# ------------------------------------------------------------------ serve


def serve(args: argparse.Namespace) -> int:
    # The flags' files first, before aiohttp is even imported; serve checks the
    # rest (the host with the secrets, the path, the inbox) before it binds.
    served_tls(args)
    secrets = None if args.secret_file is None else read_secret_file(args.secret_file)
    if args.signature_tolerance_s is not None and secrets is None:
        raise UsageError("--signature-tolerance-s goes with --secret-file")
    from asyncworker import eventloop
    from asyncworker.receiving import server as receiver

    faults = receiver.Faults(latency_ms=args.latency_ms, p_503=args.p_503, p_drop=args.p_drop,
                    seed=args.seed)
    loop = _usable_loop(args.loop)
    eventloop.tune_gc()  # this process is the receiver's own
    try:
        eventloop.run(_refusing_reload(receiver.serve(
            args.inbox, args.host, args.port, faults=faults, max_group=args.group,
            secrets=secrets, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tolerance_s=args.signature_tolerance_s or TOLERANCE_S, path=args.path)), loop)
    except BrokenPipeError:
        raise
    # The receiver refuses before it binds or prints its URL: a foreign or damaged
    # inbox, a network address without a secret, a bad path (ValueError, or
    # SQLite's own error), or a port it cannot bind (OSError).
    except ValueError as exc:  # the receiver's message names the file or the flag
        raise UsageError(str(exc)) from None
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"--inbox {args.inbox}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{args.host} port {args.port}: {exc.strerror or exc}") from None
    return EXIT_OK


async def _refusing_reload(serving: Coroutine[Any, Any, None]) -> None:
    """The receiver, with SIGHUP said to change nothing instead of ending it."""
    import asyncio

    from asyncworker.service import refuse_reload

    allow_reload = refuse_reload(asyncio.get_running_loop())
    try:
        await serving
    finally:
        allow_reload()
