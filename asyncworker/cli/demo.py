"""``asyncworker demo``: the crash-after-ACK story, with evidence, in one command.

1. A receiver process starts on loopback, dropping a few connections after
   its COMMIT (the answer never arrives: the sender must retry).
2. Two dispatcher processes start on an empty queue.
3. A few hundred snack orders arrive (one of them expires before anyone can
   send it) and both dispatchers compete for them. The first kills itself
   with SIGKILL right after an ACK, before it can record it: the receiver
   has applied that order, the queue still shows it leased.
4. The second dispatcher waits out the dead one's leases, recovers its work,
   and sends those orders again; the inbox absorbs the duplicates. It is
   stopped with SIGTERM once the queue has drained.
5. The operator redrives the expired order (with an audit row) and the
   second dispatcher delivers it.
6. The evidence is read from the four places that hold it (the queue file,
   the inbox file, the receiver's counters, dispatcher-1's last words: which
   job it was ACKed for) and checked against each other. Every row is
   computed from what was observed; the first names the job ACKed just before
   the SIGKILL and its two arrivals at the inbox.

With ``store`` (``asyncworker demo --store postgresql://...``) the queue is
that PostgreSQL database's instead of a new file: the same story, the
dispatchers sharing it as hosts would. Every step speaks to the queue through
``lease.store``, so the story and its checks are the same on both stores. The
database's queue must hold no job (the CLI checks), so the demo's figures are
the demo's own; its jobs stay there afterwards.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncworker.cli.running import CRASH_DRILL
from asyncworker.operations import receiver_stats, shown
from asyncworker.receiving.inbox import read_arrivals, read_inbox
from lease.policy import RetryPolicy
from lease.records import StoreError
from lease.store import Store
from lease.stores import open_store

LEASE_MS = 1500


@dataclass
class Check:
    label: str
    value: Any
    ok: bool
    expected: str


def run_demo(*, jobs: int = 300, concurrency: int = 16, keep: str | None = None,
             store: str | None = None) -> int:
    """The story on a new queue file in the demo's folder, or on ``store`` (a
    postgresql:// URL whose queue holds no job)."""
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="asyncworker-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    children: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        evidence = tell_the_story(folder, jobs, concurrency, children, store)
    except (OSError, RuntimeError, ValueError, StoreError, subprocess.SubprocessError) as exc:
        print(f"demo failed before its evidence was complete: {exc!r}")
        return 1
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    if judge(evidence, time.monotonic() - started):
        return 1
    if keep:
        print(f"files kept in {folder}")
    if store:
        print(f"the demo's jobs stay in {shown(store)}")
    return 0


def judge(evidence: dict, took: float) -> int:
    """Print the evidence's checks and the verdict: 0 when consistent, 1 when
    any piece contradicts another (the demo's exit status)."""
    checks = check_evidence(evidence)
    print_evidence(checks)
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"\nINCONSISTENT: {len(failed)} piece(s) of evidence disagree ({took:.1f} s)")
        return 1
    print(f"\nconsistent: {evidence['orders']} orders, each applied exactly once, "
          f"{evidence['receiver']['duplicates']} duplicate sends absorbed ({took:.1f} s)")
    return 0


def _say(text: str) -> None:
    print(text, flush=True)


def _spawn(children: list, args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as stderr:  # the child keeps its own copy of the descriptor
        child = subprocess.Popen([sys.executable, "-m", "asyncworker", *args],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    children.append(child)
    return child


def tell_the_story(folder: Path, jobs: int, concurrency: int, children: list,
                   store: str | None = None) -> dict:
    queue, inbox = store or str(folder / "queue.db"), folder / "inbox.db"
    with closing(open_store(queue, create=True)) as looking:
        return _story(looking, queue, inbox, folder, jobs, concurrency, children)


def _story(looking: Store, queue: str, inbox: Path, folder: Path, jobs: int,
           concurrency: int, children: list) -> dict:
    """The story, told by processes on ``queue``; the demo itself looks at it (and
    enqueues, and redrives) through ``looking``, one store kept open throughout."""

    receiver = _spawn(children, ["serve", "--inbox", str(inbox), "--p-drop", "0.03",
                                 "--seed", "11", "--latency-ms", "2"], folder / "receiver.log")
    assert receiver.stdout is not None
    url = receiver.stdout.readline().strip()
    if not url.startswith("http://"):
        raise RuntimeError(f"the receiver did not start (see {folder / 'receiver.log'})")
    _say(f"1. receiver on {url}, dropping 3% of answers after its COMMIT")

    # Both dispatchers look for work every 5 ms, so dispatcher-1 claims its
    # share as soon as the orders arrive; K is small against that share.
    crash_after = max(1, min(concurrency // 4, jobs // 20))
    run = ["run", queue, "--url", url, "--concurrency", str(concurrency),
           "--lease-ms", str(LEASE_MS), "--poll-ms", "5"]
    logs = [folder / "dispatcher-1.log", folder / "dispatcher-2.log"]
    first = _spawn(children, [*run, "--owner", "dispatcher-1", "--crash-after-acks",
                              str(crash_after)], logs[0])
    second = _spawn(children, [*run, "--owner", "dispatcher-2"], logs[1])
    _wait_for(lambda: all("run: owner" in log.read_text() for log in logs), "dispatchers")
    _say(f"2. two dispatchers wait on an empty queue; dispatcher-1 will die by SIGKILL "
         f"right after ACK #{crash_after}")

    orders = _enqueue_orders(looking, jobs)
    _say(f"3. {len(orders)} snack orders enqueued (one with a 1 ms deadline); "
         f"both dispatchers compete for them")
    _wait_for(lambda: first.poll() is not None or _unfinished(looking) == 0, "dispatcher-1")
    if first.poll() is None:  # it never got its ACK: the evidence will say so
        first.send_signal(signal.SIGTERM)
    first_exit = first.wait(timeout=60)
    leased_at_death = looking.counts()["leased"]
    killed = last_ack(logs[0])
    _say(f"   dispatcher-1 exit {first_exit}; {leased_at_death} jobs leased at that moment")

    _wait_for(lambda: _unfinished(looking) == 0, "the queue to drain")
    second.send_signal(signal.SIGTERM)
    second_out, _ = second.communicate(timeout=120)
    second_stats = json.loads(second_out.strip().splitlines()[-1])
    _say(f"4. dispatcher-2 waited out the dead leases and recovered the work: ok "
         f"{second_stats['ok']}, retried {second_stats['retried']}; stopped by SIGTERM, "
         f"exit {second.returncode}")

    redriven = _redrive_expired(looking)
    third = _spawn(children, [*run, "--owner", "dispatcher-2", "--until-idle"],
                   folder / "dispatcher-2b.log")
    third_out, _ = third.communicate(timeout=120)
    _say(f"5. operator redrove {redriven} expired order(s); dispatcher-2 delivered "
         f"{json.loads(third_out.strip().splitlines()[-1])['ok']}")

    received = receiver_stats(url)
    receiver.send_signal(signal.SIGTERM)
    receiver_exit = receiver.wait(timeout=30)
    where = "database" if looking.kind == "postgresql" else "file"
    _say(f"6. evidence, read from the queue {where}, the inbox file, the receiver and "
         f"dispatcher-1's last words:\n")
    return gather_evidence(looking, inbox, orders, received, {
        "dispatcher_1_exit": first_exit, "dispatcher_2_exit": second.returncode,
        "dispatcher_2_redrive_pass_exit": third.returncode, "receiver_exit": receiver_exit,
        "leased_when_dispatcher_1_died": leased_at_death}, killed)


_LAST_ACK = re.compile(re.escape(CRASH_DRILL) + r" (\S+) token ([0-9]+),")


def last_ack(log: Path) -> dict | None:
    """The job dispatcher-1 was ACKed for just before its SIGKILL, as its crash
    drill named it on stderr: {"id", "token"}, or None if it never said so."""
    found = _LAST_ACK.search(log.read_text(errors="replace"))
    return None if found is None else {"id": found.group(1), "token": int(found.group(2))}


def _wait_for(condition: Any, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.02)


def _unfinished(store: Store) -> int:
    counts = store.counts()
    return counts["pending"] + counts["leased"]


def _enqueue_orders(store: Store, jobs: int) -> dict[str, int]:
    rng = random.Random(7)
    orders = {f"snack-{n:05d}": rng.randint(1, 20) for n in range(jobs)}
    orders["snack-late"] = 5
    now = store.now_ms()
    # All at once, in one transaction: both dispatchers see every order together.
    store.enqueue_events([{"id": i, "qty": q} for i, q in orders.items() if i != "snack-late"],
                         RetryPolicy(ttl_ms=60_000, max_attempts=5), now_ms=now)
    # Its deadline is the moment it was enqueued: the first claim moves it to dead.
    store.enqueue_events([{"id": "snack-late", "qty": orders["snack-late"]}],
                         RetryPolicy(ttl_ms=1, max_attempts=5), now_ms=now - 1)
    return orders


def _redrive_expired(store: Store) -> int:
    expired = [job["id"] for job in store.dead_jobs("deadline")]
    if expired:
        store.redrive_jobs(expired, 60_000, "demo-redrive")
    return len(expired)


def gather_evidence(store: Store, inbox: Path, orders: dict[str, int], received: dict,
                    exits: dict, killed: dict | None = None) -> dict:
    snap = store.snapshot()
    finished = store.jobs_with_status("done")
    done = {job["id"]: job["qty"] for job in finished}
    tokens = {job["id"]: job["token"] for job in finished}
    max_token = max(tokens.values(), default=0)
    contents = read_inbox(inbox)
    applied, stock, seen = contents.applied, contents.stock, contents.seen
    arrivals = read_arrivals(inbox)
    errors = [attempt["error"] or "" for job_id in orders
              for attempt in (store.job_history(job_id) or {}).get("attempts", [])]
    return {
        "killed": _killed_job(store, killed, arrivals),
        "inbox_max_token": max((token or 0 for _, token in arrivals.values()), default=0),
        # done at one token, last seen by the inbox at another: a send unaccounted for
        "token_mismatches": sorted(i for i in tokens if arrivals.get(i, (0, None))[1]
                                   != tokens[i]),
        "inbox_stale": contents.stale,
        "stale_finishes": snap["stale_finishes"],
        # a dropped answer is the one cause of a failed connection while the receiver runs
        "connection_failures": sum(e.startswith("Retryable: connection failed") for e in errors),
        "orders": len(orders),
        "qty_enqueued": sum(orders.values()),
        "receiver": received,
        "inbox_rows": len(applied),
        "inbox_seen": seen,
        "stock": stock,
        "by_status": snap["by_status"],
        "dead_by_reason": snap["dead_by_reason"],
        "redrives": snap["redrives"],
        "max_token": max_token,
        "done_not_in_inbox": sorted(set(done) - set(applied)),
        "in_inbox_not_done": sorted(set(applied) - set(done)),
        "qty_mismatches": sorted(i for i in set(done) & set(applied) if done[i] != applied[i]),
        **exits,
    }


def _killed_job(store: Store, killed: dict | None,
                arrivals: dict[str, tuple[int, int | None]]) -> dict | None:
    """The job ACKed to dispatcher-1 just before its SIGKILL, as three places saw
    it: the drill's words, the inbox's arrivals, the queue's row and attempts."""
    if killed is None:
        return None
    history = store.job_history(killed["id"]) or {"job": {}, "attempts": []}
    seen, inbox_token = arrivals.get(killed["id"], (0, None))
    return {**killed, "arrivals": seen, "inbox_token": inbox_token,
            "status": history["job"].get("status"), "done_token": history["job"].get("token"),
            "done_by": history["job"].get("done_by"),
            # the ACK dispatcher-1 died with is on no record of the queue
            "recorded": sum(a["token"] == killed["token"] for a in history["attempts"])}


def _killed_check(e: dict) -> Check:
    """The headline: the job ACKed just before the SIGKILL arrived twice."""
    k = e["killed"]
    label = "the job ACKed before the SIGKILL"
    if k is None:
        return Check(label, "not named", False, "dispatcher-1's crash drill names it")
    ok = (k["arrivals"] >= 2 and k["recorded"] == 0 and k["status"] == "done"
          and k["done_by"] != "dispatcher-1" and k["done_token"] == k["inbox_token"]
          and k["done_token"] > k["token"])
    return Check(label, f"{k['id']}: {k['arrivals']} arrivals, tokens {k['token']} and "
                        f"{k['inbox_token']}", ok,
                 f"ACKed at token {k['token']}, never recorded; sent again and done "
                 f"by {k['done_by']} at token {k['done_token']}: 2 arrivals or more")


def check_evidence(e: dict) -> list[Check]:
    """Each piece of evidence against the others; a Check with ok=False is a contradiction."""
    rx = e["receiver"]
    dropped, stale = rx["process_dropped_after_commit"], rx["stale_senders"]
    # Answers lost with dispatcher-1 were never recorded: at most one per job it held.
    unrecorded = e["leased_when_dispatcher_1_died"]
    # The inbox's figures are all-time and the process_* ones this run's: they
    # add up because the demo's inbox is new and its receiver never restarts.
    accounted = (rx["applied"] + rx["duplicates"] + rx["conflicts"] + rx["stale_senders"]
                 + rx["process_rejected"] + rx["process_too_large"] + rx["process_timed_out"]
                 + rx["process_incomplete"] + rx["process_injected_503"]
                 + rx["process_unavailable"])
    return [
        _killed_check(e),
        Check("requests the receiver saw", rx["process_requests"],
              rx["process_requests"] == accounted,
              f"= applied + duplicates + refusals = {accounted}"),
        Check("  applied (new inbox rows)", rx["applied"], rx["applied"] == e["orders"],
              f"= orders ({e['orders']})"),
        # Each dropped answer (a stale one aside) was followed by another arrival of its
        # job, and so was the killed job's ACK, which was neither.
        Check("  duplicates absorbed", rx["duplicates"], rx["duplicates"] + stale >= dropped + 1,
              f">= answers dropped ({dropped}) + the killed job's resend - stale ({stale})"),
        Check("  answers dropped after commit", dropped,
              e["connection_failures"] <= dropped <= e["connection_failures"] + unrecorded,
              f"connection failures on record ({e['connection_failures']}) .. "
              f"+ jobs leased when dispatcher-1 died ({unrecorded})"),
        Check("  stale senders absorbed", stale,
              stale == e["inbox_stale"] and stale <= e["stale_finishes"] + unrecorded,
              f"= the inbox file's ({e['inbox_stale']}), <= stale finishes on record "
              f"({e['stale_finishes']}) + {unrecorded}"),
        Check("  conflicts / rejected", f"{rx['conflicts']} / {rx['process_rejected']}",
              rx["conflicts"] == 0 and rx["process_rejected"] == 0, "0 / 0"),
        Check("inbox rows", e["inbox_rows"], e["inbox_rows"] == e["orders"],
              f"= orders ({e['orders']})"),
        Check("inbox arrivals (rows x times seen)", e["inbox_seen"],
              e["inbox_seen"] == rx["applied"] + rx["duplicates"], "= applied + duplicates"),
        Check("stock", e["stock"], e["stock"] == e["qty_enqueued"],
              f"= sum enqueued ({e['qty_enqueued']})"),
        Check("jobs by status", _fmt(e["by_status"]),
              e["by_status"].get("done") == e["orders"] and e["by_status"].get("pending") == 0
              and e["by_status"].get("leased") == 0 and e["by_status"].get("dead") == 0,
              "all done"),
        Check("dead by reason (now)", _fmt(e["dead_by_reason"]) or "-",
              not e["dead_by_reason"], "none left"),
        Check("redrives (audit rows)", e["redrives"], e["redrives"] >= 1,
              ">= 1 (the expired order)"),
        Check("done but not in the inbox", len(e["done_not_in_inbox"]),
              not e["done_not_in_inbox"], "0"),
        Check("in the inbox but not done", len(e["in_inbox_not_done"]),
              not e["in_inbox_not_done"], "0"),
        Check("quantity mismatches", len(e["qty_mismatches"]), not e["qty_mismatches"], "0"),
        Check("highest claim token", e["max_token"],
              e["max_token"] >= 2 and e["max_token"] == e["inbox_max_token"],
              f">= 2 (recovered work was re-claimed), = the inbox's ({e['inbox_max_token']})"),
        Check("done at a token the inbox did not see last", len(e["token_mismatches"]),
              not e["token_mismatches"], "0"),
        Check("dispatcher-1 exit", e["dispatcher_1_exit"],
              e["dispatcher_1_exit"] == -signal.SIGKILL, f"{-signal.SIGKILL} (SIGKILL)"),
        # 3: its claim moved the 1 ms order to dead (dispatcher-1's claim may do it instead)
        Check("dispatcher-2 exit", e["dispatcher_2_exit"], e["dispatcher_2_exit"] in (0, 3),
              "0, or 3 if the late order died in its run"),
        Check("redrive pass exit", e["dispatcher_2_redrive_pass_exit"],
              e["dispatcher_2_redrive_pass_exit"] == 0, "0"),
        Check("receiver exit on SIGTERM", e["receiver_exit"], e["receiver_exit"] == 0, "0"),
    ]


def _fmt(counts: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in counts.items() if v)


def print_evidence(checks: list[Check]) -> None:
    width = max(len(c.label) for c in checks)
    value_width = max(len(str(c.value)) for c in checks)
    for c in checks:
        mark = "ok " if c.ok else "BAD"
        print(f"  {mark} {c.label.ljust(width)}  {str(c.value).ljust(value_width)}  {c.expected}")
