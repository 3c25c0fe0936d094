"""The finish group committer on a real SQLite file: what a group waits for, and what it holds.

On a store of one connection a group waits for the claim in flight (at most
HOLD_CLAIMS of them) and holds up to HOLD_CLAIMS x batch_size outcomes; it
never waits once full, once no claim is in flight, or into a lease's margin.
The claims here are futures the test resolves, so every step is its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import pytest

from asyncworker import Dispatcher
from asyncworker.finisher import HOLD_CLAIMS, GroupFinisher, Judged, Recorded
from asyncworker.leases import Held, StoreTime
from asyncworker.store import AsyncStore
from lease.store import Attempt, open_store

from .conftest import T0

LEASE_MS = 60_000
MARGIN_MS = 2_000


class Claims:
    """The dispatcher's side: the claim in flight, as a future this test resolves."""

    def __init__(self) -> None:
        self.current: Optional[asyncio.Future] = None
        self.waited = 0  # claims resolved so far

    def start(self) -> None:
        self.current = asyncio.get_running_loop().create_future()

    def commit(self, *, next_one: bool = False) -> None:
        assert self.current is not None
        self.current.set_result(None)
        self.waited += 1
        self.current = None
        if next_one:  # the dispatch loop claims again at once
            self.start()


async def _setup(tmp_path: Path, n: int, clock_ms: list[int]
                 ) -> tuple[AsyncStore, StoreTime, list[Held]]:
    path = tmp_path / "queue.db"
    with open_store(path, create=True) as store:
        store.enqueue_events([{"id": f"j{i}", "qty": 1} for i in range(n)], now_ms=T0)
        claimed = store.claim_jobs("d1", LEASE_MS, n, now_ms=T0)
    queue = await AsyncStore(path).open()
    helds = [Held(job.ticket, job.event, T0, T0 + LEASE_MS // 2) for job in claimed.leased]
    return queue, StoreTime(lambda: clock_ms[0]), helds


def _finisher(queue: AsyncStore, time: StoreTime, batch_size: int, claims: Optional[Claims],
              groups: list[list[str]]) -> GroupFinisher:
    def recorded(held: Held, judged: Judged, result: Recorded) -> None:
        assert result == ("done", None), result
        groups[-1].append(held.ticket["id"])

    def failed(helds: list[Held], judged: list[Judged]) -> None:
        raise AssertionError(f"a group failed: {[held.ticket['id'] for held in helds]}")

    return GroupFinisher(queue, time, batch_size, on_recorded=recorded, on_failed=failed,
                         on_committed=lambda seconds: groups.append([]), on_busy=lambda: None,
                         claim_in_flight=None if claims is None else (lambda: claims.current),
                         margin_ms=MARGIN_MS)


def _ok() -> Judged:
    return Judged("ok", 0, Attempt(T0, 1))


async def _turns(n: int = 20) -> None:
    """Let every task that can run, run: the finisher's group and its transaction."""
    for _ in range(n):
        await asyncio.sleep(0.005)


async def test_a_group_waits_for_the_claim_in_flight_and_holds_what_it_sent(tmp_path: Path):
    clock = [T0 + 10]
    queue, time, helds = await _setup(tmp_path, 6, clock)
    groups: list[list[str]] = []
    claims = Claims()
    finisher = _finisher(queue, time, 64, claims, groups)
    try:
        claims.start()
        for held in helds[:3]:
            finisher.add(held, _ok())
        await _turns()
        assert groups == [] and not finisher.idle  # held back while the claim is in flight
        for held in helds[3:]:  # what the claim's sends brought
            finisher.add(held, _ok())
        claims.commit()
        await finisher.settle()
        assert groups == [[f"j{i}" for i in range(6)]]  # one transaction for all six
        assert finisher.idle
    finally:
        await queue.close()


async def test_a_group_waits_for_at_most_the_claims_it_may_hold(tmp_path: Path):
    clock = [T0 + 10]
    queue, time, helds = await _setup(tmp_path, HOLD_CLAIMS + 2, clock)
    groups: list[list[str]] = []
    claims = Claims()
    finisher = _finisher(queue, time, 64, claims, groups)
    try:
        claims.start()
        finisher.add(helds[0], _ok())
        for n in range(1, HOLD_CLAIMS + 1):  # the dispatch loop claims again at once
            await _turns(4)
            assert groups == [], f"written after {n - 1} claims"
            finisher.add(helds[n], _ok())
            claims.commit(next_one=True)
        await _turns()
        # the fifth claim is still in flight: the group went without it
        assert groups == [[f"j{i}" for i in range(HOLD_CLAIMS + 1)]]
        assert claims.current is not None and not claims.current.done()
        finisher.add(helds[-1], _ok())  # a new group waits for that claim again
        await _turns(4)
        assert len(groups) == 1
        claims.commit()
        await finisher.settle()
        assert groups[1:] == [[f"j{HOLD_CLAIMS + 1}"]]
    finally:
        await queue.close()


async def test_a_full_group_goes_at_once_and_holds_four_batches(tmp_path: Path):
    clock = [T0 + 10]
    queue, time, helds = await _setup(tmp_path, 4 * 2 + 1, clock)
    groups: list[list[str]] = []
    claims = Claims()
    finisher = _finisher(queue, time, 2, claims, groups)  # a group: 4 claims of 2
    try:
        assert finisher.group_size == HOLD_CLAIMS * 2
        claims.start()
        for held in helds:
            finisher.add(held, _ok())
        await _turns()
        assert groups == [[f"j{i}" for i in range(8)]]  # full: no wait for the claim
        assert not finisher.idle  # the ninth waits for the claim in flight
        claims.commit()
        await finisher.settle()
        assert groups[1:] == [["j8"]]
    finally:
        await queue.close()


async def test_a_group_never_waits_into_the_margin_of_a_lease_it_holds(tmp_path: Path):
    clock = [T0 + LEASE_MS - MARGIN_MS]  # the lease's margin has begun
    queue, time, helds = await _setup(tmp_path, 2, clock)
    groups: list[list[str]] = []
    claims = Claims()
    finisher = _finisher(queue, time, 64, claims, groups)
    try:
        claims.start()
        finisher.add(helds[0], _ok())
        await _turns()
        assert groups == [["j0"]]  # written while the claim is still in flight
        clock[0] = T0 + 10  # a lease with time to spare: the next group waits again
        finisher.add(helds[1], _ok())
        await _turns()
        assert groups == [["j0"]]
        claims.commit()
        await finisher.settle()
        assert groups == [["j0"], ["j1"]]
    finally:
        await queue.close()


async def test_a_bad_clock_value_while_a_group_waits_fails_the_group_not_loses_it(
        tmp_path: Path):
    clock: list = [T0 + 10]
    queue, time, helds = await _setup(tmp_path, 1, clock)
    failed: list[list[str]] = []
    claims = Claims()
    finisher = GroupFinisher(
        queue, time, 64, on_recorded=lambda *one: None, on_committed=lambda seconds: None,
        on_failed=lambda helds, judged: failed.append([held.ticket["id"] for held in helds]),
        on_busy=lambda: None, claim_in_flight=lambda: claims.current, margin_ms=MARGIN_MS)
    try:
        claims.start()
        clock[0] = 1.5  # not an int: no time to judge a lease by
        finisher.add(helds[0], _ok())
        await finisher.settle()
        assert failed == [["j0"]] and finisher.idle  # counted as failed, left leased
        with open_store(tmp_path / "queue.db") as store:
            assert store.counts()["leased"] == 1
    finally:
        await queue.close()


async def test_without_a_claim_to_wait_for_a_group_is_a_batch_and_goes_at_once(
        tmp_path: Path):
    clock = [T0 + 10]
    queue, time, helds = await _setup(tmp_path, 5, clock)
    groups: list[list[str]] = []
    finisher = _finisher(queue, time, 2, None, groups)  # a store of many connections
    try:
        assert finisher.group_size == 2
        for held in helds:
            finisher.add(held, _ok())
        await finisher.settle()
        assert groups == [["j0", "j1"], ["j2", "j3"], ["j4"]]
    finally:
        await queue.close()


@pytest.mark.parametrize("journal", [None, "wal"])
async def test_a_dispatcher_on_a_file_records_several_claims_in_one_finish(
        tmp_path: Path, journal: Optional[str]):
    path = tmp_path / "queue.db"
    with open_store(path, create=True, journal=journal) as store:
        store.enqueue_events([{"id": f"j{i}", "qty": 1} for i in range(1280)])

    async def send(event: dict, token: int) -> bool:
        return True

    async with Dispatcher(path, "d1", send=send, concurrency=64, batch_size=64,
                          lease_ms=30_000, poll_interval=0.01) as d:
        stats = await asyncio.wait_for(d.run(until_idle=True), 60)
    assert stats.ok == 1280 and stats.in_flight == 0
    assert stats.claim_batches >= 1280 // 64
    # each finish held what two claims or more sent (one each before: as many as claims)
    assert stats.finish_batches <= stats.claim_batches // 2, stats.as_dict()
    with open_store(path) as store:
        assert store.counts()["done"] == 1280
