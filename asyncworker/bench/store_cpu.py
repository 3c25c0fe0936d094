"""The SQLite store's CPU per job, old code against new: claim_jobs +
finish_jobs of 12 and of 64 jobs a transaction on one thread, as
``asyncworker.bench.cpu``'s "store alone" rows, in paired rounds (A B A B ...).

    python -m asyncworker.bench.store_cpu A_TREE B_TREE [--rounds 4] [--jobs 6000]

A_TREE and B_TREE are source trees (each with its own ``lease`` package, say a
``git worktree`` of the old commit and this one). Each run is a fresh process
importing one tree, doing ``--reps`` runs, each on a fresh queue of ``--jobs``
ready lab events, and reporting the run of least CPU (user + system, the
process's own accounting as ``os.times()`` reads it, from ``getrusage`` for its
microseconds; of the claims and finishes only, not the fill). Printed: each
round's us/job per tree and its user time alone (the system time is mostly
the COMMITs' journal writes and fsyncs, and swings with the machine's other
load), and the median of the paired B/A per size with its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, tempfile
sys.path.insert(0, sys.argv[1])
from lease.records import Attempt
from lease.stores import open_store
jobs, per, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
where = sys.argv[5] or None
runs = []
for rep in range(reps):
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        path = os.path.join(tmp, "queue.db")
        store = open_store(path, create=True)
        for start in range(0, jobs, 5000):
            store.enqueue_events([{"id": f"job-{i}", "qty": i % 1000 + 1}
                                  for i in range(start, min(jobs, start + 5000))])
        done = 0
        before = resource.getrusage(resource.RUSAGE_SELF)
        while (claimed := store.claim_jobs("bench", 30_000, per)).leased:
            seen = Attempt.of(claimed.now_ms, 1, None)
            store.finish_jobs([(job.ticket, "ok", 0, seen) for job in claimed.leased])
            done += len(claimed.leased)
        after = resource.getrusage(resource.RUSAGE_SELF)
        store.close()
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    runs.append({"jobs": done, "cpu_s": user + system, "sys_s": system})
# the least disturbed of the process's runs: the others' load only adds
print(json.dumps(min(runs, key=lambda run: run["cpu_s"])))
"""


def run(tree: str, jobs: int, per: int, reps: int, where: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, tree, str(jobs), str(per), str(reps),
                          where],
                         check=True, capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": ""})
    result = json.loads(out.stdout)
    if result["jobs"] != jobs:
        raise RuntimeError(f"{tree}: {result['jobs']} of {jobs} jobs done")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=3, help="runs per process; the least"
                        " CPU of them counts")
    parser.add_argument("--sizes", default="12,64")
    parser.add_argument("--dir", default="", help="where the queue files go (a tmpfs such as"
                        " /dev/shm takes the disk's fsyncs out of the comparison); the"
                        " system's temporary directory by default")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    ratios: dict[int, list[float]] = {size: [] for size in sizes}
    user_ratios: dict[int, list[float]] = {size: [] for size in sizes}
    per_job: dict[tuple[str, int], list[float]] = {}
    for round_no in range(args.rounds):
        for size in sizes:
            pair, user = {}, {}
            for name, tree in (("A", args.a), ("B", args.b)):
                result = run(tree, args.jobs, size, args.reps, args.dir)
                pair[name] = result["cpu_s"] / result["jobs"] * 1e6
                user[name] = (result["cpu_s"] - result["sys_s"]) / result["jobs"] * 1e6
                per_job.setdefault((name, size), []).append(pair[name])
                per_job.setdefault((name + " user", size), []).append(user[name])
            ratios[size].append(pair["B"] / pair["A"])
            user_ratios[size].append(user["B"] / user["A"])
            print(f"round {round_no + 1} size {size:3}: A {pair['A']:6.1f} us/job"
                  f" (user {user['A']:6.1f})  B {pair['B']:6.1f} (user {user['B']:6.1f})"
                  f"  B/A {pair['B'] / pair['A']:.3f} (user {user['B'] / user['A']:.3f})",
                  flush=True)
    for size in sizes:
        for what, found in (("", ratios[size]), (" user", user_ratios[size])):
            a, b = (statistics.median(per_job[(name + what, size)]) for name in ("A", "B"))
            print(f"size {size:3}{what or ' all':>5}: median A {a:6.1f}  B {b:6.1f} us/job;"
                  f" B/A median {statistics.median(found):.3f}"
                  f" (spread {min(found):.3f}..{max(found):.3f})")


if __name__ == "__main__":
    main()
