"""What the commands print: tables, bounded lists of lines, the figures of a
run, a queue's stats and a job's record, each one line per row on stdout or
stderr. Nothing here opens a queue or decides an exit code."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

from asyncworker.operations import one_line, when

if TYPE_CHECKING:
    from asyncworker.dispatcher import DispatcherStats

SHOW_EACH = 20  # per-job lines up to this many jobs (or with --verbose), a count always
AGE_UNITS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1, "": 1}


def duration(value: int) -> str:
    """A duration for --help: 259200000 as '259200000 ms = 3d'."""
    for unit in ("d", "h", "m", "s"):
        if value >= AGE_UNITS[unit] and value % AGE_UNITS[unit] == 0:
            return f"{value} = {value // AGE_UNITS[unit]}{unit}"
    return str(value)


# ------------------------------------------------------------------ lines and tables


def to_stderr(line: str) -> None:
    """A line on stderr; a closed stderr (a reader gone) does not stop the work."""
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except BrokenPipeError:
        pass


def announce(line: str, **fields: Any) -> None:
    """One of run's own lines (banner, metrics URL, stop notices, progress): as it
    is, or with --log-format json one object with its facts as keys."""
    from asyncworker.logs import say

    say(line, "asyncworker.run", **fields)


def print_table(rows: list[tuple], out: TextIO = sys.stdout) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (str(text).ljust(width) for text, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


def print_bounded(lines: list[str], verbose: bool, file: TextIO) -> None:
    """Every line when few or asked for; else the first SHOW_EACH and how many more."""
    shown = lines if verbose or len(lines) <= SHOW_EACH else lines[:SHOW_EACH]
    for line in shown:
        print(line, file=file)
    if len(shown) < len(lines):
        print(f"... and {len(lines) - len(shown)} more (--verbose lists them all)", file=file)


def cell(value: object, width: int = 60) -> str:
    """A table cell: one line, at most `width` characters, '-' for nothing."""
    if value is None:
        return "-"
    text = one_line(str(value))
    return text if len(text) <= width else text[:width - 3] + "..."


def count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


# ------------------------------------------------------------------ run


def progress_line(stats: DispatcherStats, rate: float, paused: str | None = None) -> str:
    reasons = " ".join(f"{reason}:{n}" for reason, n in sorted(stats.dead_by_reason.items())
                       if n)
    return (f"done {stats.ok}  retried {stats.retried}  dead {stats.dead}"
            f"{f' ({reasons})' if reasons else ''}  stale {stats.stale}  "
            f"unrecorded-busy {stats.unrecorded_busy}  "
            f"bad-acks {stats.bad_acks}  errors {stats.errors}  in flight {stats.in_flight}  "
            f"sending {stats.sending}  rate {rate:.0f}/s"
            f"{f'  left leased {stats.left_leased}' if stats.left_leased else ''}"
            f"{f'  {paused}' if paused else ''}")


def show_progress(stats: DispatcherStats, rate: float, *, final: bool = False,
                  paused: str | None = None) -> None:
    """``paused``: the queue's pause in words, when it is paused."""
    line = progress_line(stats, rate, paused)
    from asyncworker.logs import current_format

    if current_format() == "json":  # one object a line, the figures as keys
        announce(("summary: " if final else "") + line, **stats.as_dict(), rate=round(rate, 1),
                 **({"paused": paused} if paused else {}))
    elif sys.stderr.isatty():  # one live line, redrawn in place
        to_stderr("\r\x1b[2K" + line + ("\n" if final else ""))
    else:  # plain log lines for files and pipes
        to_stderr(("summary: " if final else "") + line + "\n")


def say_left_leased(left: list[dict]) -> None:
    """An aborted run's last line: the leases it left to run out, by id/token."""
    if not left:
        announce("aborted: no job left leased", leases_left=left)
        return
    last = max(one["lease_until"] for one in left)
    named = " ".join(f"{one['id']}/{one['token']}" for one in left[:SHOW_EACH])
    more = f" and {len(left) - SHOW_EACH} more" if len(left) > SHOW_EACH else ""
    announce(f"aborted: {count(len(left), 'job')} left leased, to be claimed again once their "
             f"leases run out (the last at {when(last)}): {named}{more}", leases_left=left)


def _to(head: dict) -> str:
    """A delivery's line is its key to one endpoint: named with it."""
    return f" to {head['endpoint']}" if head.get("endpoint") is not None else ""


def say_blocked(blocked: list[dict]) -> None:
    """An idle run's last line: each key blocked by a dead first job, and that job."""
    named = ", ".join(f"{one['key']}{_to(one)} (dead head {one['id']}, {one['reason']}; "
                      f"{one['waiting']} waiting)" for one in blocked[:SHOW_EACH])
    more = f" and {len(blocked) - SHOW_EACH} more" if len(blocked) > SHOW_EACH else ""
    announce(f"idle: {count(len(blocked), 'ordering key')} blocked by a dead job, nothing to "
             f"claim until it is redriven or cancelled: {named}{more}", blocked_heads=blocked)


# ------------------------------------------------------------------ stats, dead, inspect


def stats_rows(snap: dict) -> list[tuple]:
    age = snap["oldest_unfinished_age_ms"]
    rows: list[tuple] = [("jobs", snap["jobs"])]
    rows += [(f"  {status}", n) for status, n in snap["by_status"].items()]
    rows += [("oldest unfinished", "-" if age is None else f"{age} ms"),
             ("expired leases", snap["expired_leases"]),
             ("attempts", " ".join(f"{k}:{v}" for k, v in snap["attempts"].items()) or "-"),
             ("dead by reason", " ".join(f"{k}:{v}" for k, v in snap["dead_by_reason"].items())
              or "-"),
             ("redrives", f"{snap['redrives']} ({snap['redriven_jobs']} jobs)")]
    # What only a product file records: absent on a contract file, not shown as 0.
    for key, label in (("cancels", "cancels"), ("attempts_recorded", "attempts recorded"),
                       ("stale_finishes", "stale finishes"),
                       ("blocked_keys", "blocked keys"),
                       ("blocked_jobs", "jobs behind them")):
        if key in snap:
            rows.append((label, snap[key]))
    if "queues" in snap:  # the named queues of its database, or beside its file
        rows.append(("queues", ", ".join(snap["queues"])))
    for key, value in snap.get("receiver", {}).items():
        rows.append((f"receiver {key}", value))
    return rows


def event_cell(job: dict) -> object:
    """A payload job (qty 0, a body) shows its body's size where a lab job shows its qty."""
    body = job.get("body")
    return job["qty"] if body is None else f"body {len(body.encode())} B"


def print_history(history: dict) -> None:
    """The job as name/value lines, then a table per kind of record."""
    job = history["job"]
    rows: list[tuple] = [
        ("id", job["id"]),
        *delivery_rows(job),
        *((("key", cell(job["ordering_key"])),) if "ordering_key" in job else ()),
        ("event", event_cell(job)),
        *((("priority", job["priority"]),) if "priority" in job else ()),
        ("status", job["status"] if job["reason"] is None else f"{job['status']} "
                                                              f"({job['reason']})"),
        ("attempts", f"{job['attempts']} of {job['max_attempts']}"),
        ("token", job["token"]),
        ("available at", when(job["available_at"])),
        ("deadline", when(job["deadline"])),
        ("owner", cell(job["owner"])),
        ("lease until", when(job["lease_until"])),
    ]
    if job.get("body") is not None:
        rows.append(("body", cell(job["body"], 100)))
        rows.append(("body sha256", job["digest"]))
    print_table(rows)
    if "attempts" not in history:
        print("\nattempts: not recorded in this file's version (a command that writes "
              "migrates it)")
    else:
        _print_records("attempts", history["attempts"], (
            ("token", "token"), ("attempt", "attempt"), ("owner", "owner"),
            ("started", lambda a: when(a["started_ms"])), ("outcome", "outcome"),
            ("result", lambda a: a["result"] if a["reason"] is None
             else f"{a['result']}/{a['reason']}"),
            ("http or error", _seen),
            ("latency", lambda a: "-" if a["latency_ms"] is None else f"{a['latency_ms']} ms")))
    _print_records("redrives", history["redrives"], (
        ("token", "token"), ("at", lambda r: when(r["at_ms"])), ("note", "note"),
        *_actor_column(history["redrives"])))
    if "cancels" in history:
        _print_records("cancels", history["cancels"], (
            ("token", "token"), ("at", lambda r: when(r["at_ms"])), ("was", "was"),
            ("note", "note"), *_actor_column(history["cancels"])))


def event_type(job: dict) -> str | None:
    """A job's event type, where its file records one."""
    return job.get("type", job.get("event_type"))


def delivery_rows(job: dict) -> tuple:
    """A delivery's endpoint and message, and any job's event type: rows of its record."""
    rows: tuple = ()
    if job.get("endpoint") is not None:
        rows += (("endpoint", job["endpoint"]), ("message", cell(job.get("message"))))
    if event_type(job) is not None:
        rows += (("type", event_type(job)),)
    return rows


def _actor_column(records: list[dict]) -> tuple:
    """Who made each audit row (the page's operator; '-' for a command), where recorded."""
    return (("actor", "actor"),) if records and "actor" in records[0] else ()


def _seen(attempt: dict) -> str:
    """What an attempt saw: its error, else its HTTP status."""
    if attempt["error"] is not None:
        return attempt["error"]
    return "-" if attempt["http_status"] is None else f"HTTP {attempt['http_status']}"


def _print_records(title: str, records: list[dict], columns: tuple) -> None:
    print(f"\n{title}: {len(records) or 'none'}")
    if records:
        print_table([tuple(name for name, _ in columns)] + [
            tuple(cell(get(r) if callable(get) else r[get], 80) for _, get in columns)
            for r in records])


# ------------------------------------------------------------------ redrive, cancel


def print_outcome(done: list[str], refused: list[str], verbose: bool, past: str) -> None:
    """A bulk change's lines: each job changed on stdout, each refused on stderr
    (bounded unless ``verbose``), then the counts."""
    print_bounded(done, verbose, sys.stdout)
    sys.stdout.flush()
    print_bounded(refused, verbose, sys.stderr)
    sys.stderr.flush()
    print(f"{len(done)} {past}, {len(refused)} refused")
