"""A batch equals the same single calls in sequence at the same now_ms, on every
store: claim_jobs with a limit of n and n claims of one; finish_jobs of a list
and each item on its own; redrive, cancel and intake of many and of one.

Hypothesis builds a queue by a random program (every call of the interface),
twice: on one twin the batch runs, on the other the single calls, and the
answers, then every job's row and history and the snapshot, must match.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.support.queues import T0

from .conftest import Queues
from .helpers import IDS, OWNERS, Player, dump, evidence, plain, programs, stale_variant


def claims_of_one(store, owner: str, lease: int, limit: int, now: int) -> tuple[list, dict]:
    leased: list = []
    moved = {"deadline": 0, "exhausted": 0}
    for _ in range(limit):
        claimed = store.claim_jobs(owner, lease, 1, now_ms=now)
        for reason, n in claimed.moved.items():
            moved[reason] += n
        if not claimed.leased:
            break
        leased.extend(claimed.leased)
    return leased, moved


def test_a_batch_equals_its_single_calls_in_sequence(queues: Queues) -> None:
    @queues.settings(100, 12)
    @given(program=programs(20), owner=st.sampled_from(OWNERS),
           lease=st.sampled_from([50, 5000]), limit=st.integers(1, 6), data=st.data())
    def check(program: list, owner: str, lease: int, limit: int, data: st.DataObject) -> None:
        with queues.fresh() as batch, queues.fresh() as single:
            one, two = Player(batch, T0), Player(single, T0)
            assert one.play(program) == two.play(program)
            now = one.now

            claimed = batch.claim_jobs(owner, lease, limit, now_ms=now)
            assert (claimed.leased, claimed.moved) == claims_of_one(single, owner, lease,
                                                                    limit, now)
            assert dump(batch, now) == dump(single, now)

            pool = one.tickets + [job.ticket for job in claimed.leased]
            if pool:
                picks = data.draw(st.lists(st.tuples(
                    st.sampled_from(pool), st.sampled_from(["ok", "retry", "permanent", None]),
                    st.sampled_from([0, 30, 5000]), st.sampled_from([0, 0, 1, 2])), max_size=8))
                later = now + data.draw(st.sampled_from([0, 1, 40, 400]))
                items = [(stale_variant(t, v), o, d, evidence(later, o, d)) for t, o, d, v in picks]
                assert batch.finish_jobs(items, now_ms=later) == [
                    found for item in items for found in single.finish_jobs([item],
                                                                            now_ms=later)]
                assert dump(batch, later) == dump(single, later)
                now = later

            ids = data.draw(st.lists(st.sampled_from(IDS), max_size=6))
            assert plain(batch.redrive_jobs(ids, 60_000, "bulk", now_ms=now)) == [
                plain(found) for i in ids
                for found in single.redrive_jobs([i], 60_000, "bulk", now_ms=now)]
            ids = data.draw(st.lists(st.sampled_from(IDS), max_size=6))
            assert plain(batch.cancel_jobs(ids, "bulk", now_ms=now)) == [
                plain(found) for i in ids for found in single.cancel_jobs([i], "bulk", now_ms=now)]
            events = [{"id": i, "qty": 1} if n % 2 else {"id": i, "body": {"n": n}}
                      for n, i in enumerate(data.draw(st.lists(st.sampled_from(IDS[:6]),
                                                               max_size=6)))]
            assert plain(batch.enqueue_events(events, now_ms=now)) == [
                plain(found) for event in events
                for found in single.enqueue_events([event], now_ms=now)]
            assert dump(batch, now) == dump(single, now)

    check()
