"""The finish group committer: what a group waits for, and what it holds.

A group waits for the dispatcher's claim in flight (at most
HOLD_CLAIMS of them) and holds up to HOLD_CLAIMS x batch_size outcomes; it
never waits once full, once no claim is in flight, or into a lease's margin.
The claims here are futures the test resolves, so every step is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncworker import Dispatcher
from asyncworker.finisher import HOLD_CLAIMS, GroupFinisher, Judged, Recorded
from asyncworker.leases import Held, StoreTime, half_way
from asyncworker.store import AsyncStore
from lease.records import Attempt
from lease.stores import open_store
from tests.support.queues import T0

LEASE_MS = 60_000
SHORT_LEASE_MS = 2_500  # a send cut near its lease's end, or one whose extension was capped
MARGIN_MS = 2_000


class Claims:
    """The dispatcher's side: the claim in flight, as a future this test resolves."""

    def __init__(self) -> None:
        self.current: asyncio.Future | None = None

    def start(self) -> None:
        self.current = asyncio.get_running_loop().create_future()

    def commit(self, *, next_one: bool = False) -> None:
        assert self.current is not None
        self.current.set_result(None)
        self.current = None
        if next_one:  # the dispatch loop claims again at once
            self.start()


@dataclass
class Rig:
    """A finisher on a real queue file whose jobs are all claimed, and what it wrote."""

    clock: list  # the injected clock's value, [ms]: a test moves it
    helds: list[Held]
    claims: Claims
    groups: list[list[str]] = field(default_factory=list)  # each committed group's ids
    failed: list[list[str]] = field(default_factory=list)  # each failed group's ids
    finisher: GroupFinisher = field(init=False)

    def recorded(self, held: Held, judged: Judged, result: Recorded) -> None:
        assert result == ("done", None), result
        self.groups[-1].append(held.ticket["id"])


@contextlib.asynccontextmanager
async def finishing(tmp_path: Path, n: int, *, batch_size: int = 64, now_ms: int = T0 + 10,
                    claims: bool = True, short_leases: int = 0) -> AsyncIterator[Rig]:
    """``n`` jobs claimed, and a finisher for them; ``claims``: False for a
    finisher with no claims beside it to wait for; the last ``short_leases``
    jobs are leased for SHORT_LEASE_MS."""
    path = tmp_path / "queue.db"
    with open_store(path, create=True) as store:
        store.enqueue_events([{"id": f"j{i}", "qty": 1} for i in range(n)], now_ms=T0)
        leased = store.claim_jobs("d1", LEASE_MS, n - short_leases, now_ms=T0).leased
        if short_leases:
            leased += store.claim_jobs("d1", SHORT_LEASE_MS, short_leases, now_ms=T0).leased
    helds = [Held(job.ticket, job.event, T0, half_way(T0, job.ticket["lease_until"]))
             for job in leased]
    rig = Rig([now_ms], helds, Claims())
    queue = await AsyncStore(path).open()
    rig.finisher = GroupFinisher(
        queue, StoreTime(lambda: rig.clock[0]), batch_size, on_recorded=rig.recorded,
        on_failed=lambda helds, judged: rig.failed.append([h.ticket["id"] for h in helds]),
        on_committed=lambda seconds: rig.groups.append([]), on_busy=lambda: None,
        claim_in_flight=(lambda: rig.claims.current) if claims else None, margin_ms=MARGIN_MS)
    try:
        yield rig
    finally:
        await queue.close()


def _ok() -> Judged:
    return Judged("ok", 0, Attempt(T0, 1))


async def _turns(n: int = 20) -> None:
    """Let every task that can run, run: the finisher's group and its transaction."""
    for _ in range(n):
        await asyncio.sleep(0.005)


async def test_a_group_waits_for_the_claim_in_flight_and_holds_what_it_sent(tmp_path: Path):
    async with finishing(tmp_path, 6) as rig:
        rig.claims.start()
        for held in rig.helds[:3]:
            rig.finisher.add(held, _ok())
        await _turns()
        assert rig.groups == [] and not rig.finisher.idle  # held while the claim is in flight
        for held in rig.helds[3:]:  # what the claim's sends brought
            rig.finisher.add(held, _ok())
        rig.claims.commit()
        await rig.finisher.settle()
        assert rig.groups == [[f"j{i}" for i in range(6)]]  # one transaction for all six
        assert rig.finisher.idle


async def test_a_group_waits_for_at_most_the_claims_it_may_hold(tmp_path: Path):
    async with finishing(tmp_path, HOLD_CLAIMS + 2) as rig:
        rig.claims.start()
        rig.finisher.add(rig.helds[0], _ok())
        for n in range(1, HOLD_CLAIMS + 1):  # the dispatch loop claims again at once
            await _turns(4)
            assert rig.groups == [], f"written after {n - 1} claims"
            rig.finisher.add(rig.helds[n], _ok())
            rig.claims.commit(next_one=True)
        await _turns()
        # the fifth claim is still in flight: the group went without it
        assert rig.groups == [[f"j{i}" for i in range(HOLD_CLAIMS + 1)]]
        assert rig.claims.current is not None and not rig.claims.current.done()
        rig.finisher.add(rig.helds[-1], _ok())  # a new group waits for that claim again
        await _turns(4)
        assert len(rig.groups) == 1
        rig.claims.commit()
        await rig.finisher.settle()
        assert rig.groups[1:] == [[f"j{HOLD_CLAIMS + 1}"]]


async def test_a_full_group_goes_at_once_and_holds_four_batches(tmp_path: Path):
    async with finishing(tmp_path, 4 * 2 + 1, batch_size=2) as rig:
        assert rig.finisher.group_size == HOLD_CLAIMS * 2
        rig.claims.start()
        for held in rig.helds:
            rig.finisher.add(held, _ok())
        await _turns()
        assert rig.groups == [[f"j{i}" for i in range(8)]]  # full: no wait for the claim
        assert not rig.finisher.idle  # the ninth waits for the claim in flight
        rig.claims.commit()
        await rig.finisher.settle()
        assert rig.groups[1:] == [["j8"]]


async def test_a_group_never_waits_into_the_margin_of_a_lease_it_holds(tmp_path: Path):
    async with finishing(tmp_path, 2, now_ms=T0 + LEASE_MS - MARGIN_MS) as rig:
        rig.claims.start()  # the lease's margin has begun
        rig.finisher.add(rig.helds[0], _ok())
        await _turns()
        assert rig.groups == [["j0"]]  # written while the claim is still in flight
        rig.clock[0] = T0 + 10  # a lease with time to spare: the next group waits again
        rig.finisher.add(rig.helds[1], _ok())
        await _turns()
        assert rig.groups == [["j0"]]
        rig.claims.commit()
        await rig.finisher.settle()
        assert rig.groups == [["j0"], ["j1"]]


async def test_an_outcome_whose_lease_ends_sooner_wakes_the_wait(tmp_path: Path):
    async with finishing(tmp_path, 2, short_leases=1) as rig:
        rig.claims.start()
        rig.finisher.add(rig.helds[0], _ok())  # waits for the claim, timed by a 60 s lease
        await _turns(4)
        assert rig.groups == []
        rig.clock[0] = T0 + SHORT_LEASE_MS - MARGIN_MS  # j1's margin begins as it joins
        rig.finisher.add(rig.helds[1], _ok())
        await _turns()
        assert rig.groups == [["j0", "j1"]]  # written with the claim still in flight
        assert not rig.claims.current.done()
        rig.claims.commit()


async def test_a_bad_clock_value_while_a_group_waits_fails_the_group_not_loses_it(
        tmp_path: Path):
    async with finishing(tmp_path, 1) as rig:
        rig.claims.start()
        rig.clock[0] = 1.5  # not an int: no time to judge a lease by
        rig.finisher.add(rig.helds[0], _ok())
        await rig.finisher.settle()
        assert rig.failed == [["j0"]] and rig.finisher.idle  # counted as failed, left leased
        with open_store(tmp_path / "queue.db") as store:
            assert store.counts()["leased"] == 1


async def test_without_a_claim_to_wait_for_a_group_is_a_batch_and_goes_at_once(
        tmp_path: Path):
    async with finishing(tmp_path, 5, batch_size=2, claims=False) as rig:
        assert rig.finisher.group_size == 2
        rig.claims.start()  # not the finisher's to see: no claims beside it
        for held in rig.helds:
            rig.finisher.add(held, _ok())
        await rig.finisher.settle()
        assert rig.groups == [["j0", "j1"], ["j2", "j3"], ["j4"]]


@pytest.fixture(params=["rollback journal", "wal", "postgres"])
def queue_target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty queue: a SQLite file in either journal mode, or a PostgreSQL database."""
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    path = str(tmp_path / "queue.db")
    open_store(path, create=True, journal="wal" if request.param == "wal" else None).close()
    return path


async def test_a_dispatcher_records_several_claims_in_one_finish(queue_target: str):
    with open_store(queue_target, create=True) as store:
        store.enqueue_events([{"id": f"j{i}", "qty": 1} for i in range(1280)])

    async def send(event: dict, token: int) -> bool:
        return True

    async with Dispatcher(queue_target, "d1", send=send, concurrency=64, batch_size=64,
                          lease_ms=30_000, poll_interval=0.01) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 60)
    assert stats.ok == 1280 and stats.in_flight == 0
    assert stats.claim_batches >= 1280 // 64
    # each finish held what two claims or more sent (one each before: as many as claims)
    assert stats.finish_batches <= stats.claim_batches // 2, stats.as_dict()
    with open_store(queue_target) as store:
        assert store.counts()["done"] == 1280


async def test_a_store_busy_past_every_lease_records_nothing_and_is_no_stale_finish(
        tmp_path: Path):
    """The store stays busy (another process's write lock) until the group's
    lease is over: nothing was recorded and no fence judged the finish. It is
    counted as an outcome not recorded, in stats and metrics, not as stale."""
    path = tmp_path / "queue.db"
    with open_store(path, create=True) as store:
        store.enqueue_events([{"id": "j0", "qty": 1}], now_ms=T0)
    clock = [T0 + 10]
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    async def send(event: dict, token: int) -> bool:
        if clock[0] == T0 + 10:  # the first send: a write lock held past the lease's end
            holder.execute("BEGIN IMMEDIATE")
            clock[0] = T0 + 10 + SHORT_LEASE_MS + 1
        return True

    try:
        async with Dispatcher(path, "d1", send=send, clock=lambda: clock[0],
                              lease_ms=SHORT_LEASE_MS, poll_interval=0.01) as d:
            run = asyncio.create_task(d.run())
            while not d.stats.unrecorded_busy and not run.done():
                await asyncio.sleep(0.01)
            d.stop()
            holder.execute("ROLLBACK")
            stats = await asyncio.wait_for(run, 30)
            exposed = d.metrics.exposition()[0].decode()
    finally:
        holder.close()
    assert (stats.unrecorded_busy, stats.stale, stats.in_flight) == (1, 0, 0)
    assert "asyncworker_outcomes_unrecorded_busy_total 1.0" in exposed
    assert "asyncworker_stale_completions_refused_total 0.0" in exposed
    with open_store(path) as store:
        assert store.snapshot(T0 + 20)["stale_finishes"] == 0  # no fence refused it


async def test_a_delivered_attempt_records_the_http_status_of_its_answer(queue_target: str):
    """The answer taken as delivered (here 202 with the ACK) is the attempt's
    evidence, on the done job's row and in its history, on both stores."""
    from tests.support.servers import HostileServer, answer

    def accept(request, sock) -> None:
        job_id = request.headers["webhook-id"]
        answer(202, json.dumps({"id": job_id}).encode(),
               {"Content-Type": "application/json"})(request, sock)

    with open_store(queue_target, create=True) as store:
        store.enqueue_events([{"id": "j0", "qty": 1}])
    with HostileServer(accept) as server:
        async with Dispatcher(queue_target, "d1", url=server.url, poll_interval=0.01) as d:
            stats = await asyncio.wait_for(d.run(until_idle=True), 60)
    assert stats.ok == 1
    with open_store(queue_target) as store:
        history = store.job_history("j0")
    assert history is not None and history["job"]["done_http_status"] == 202
    assert [(a["result"], a["http_status"]) for a in history["attempts"]] == [("done", 202)]
