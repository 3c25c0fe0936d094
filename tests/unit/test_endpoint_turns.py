"""The claim's turns (lease.endpoints.rotation_batch, shares, round_robin, turns):
how many endpoints a claim examines at each look, and what each is owed."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from lease.endpoints import SPREAD, TURN, rotation_batch, round_robin, shares, turns


def test_a_big_claim_serves_turns_of_turn_deliveries():
    assert rotation_batch(64) == 64 // TURN
    assert rotation_batch(1000) == -(-1000 // TURN)
    assert shares(dict.fromkeys(map(str, range(rotation_batch(64))), 100), 64) == dict.fromkeys(
        map(str, range(64 // TURN)), TURN)


def test_a_small_claim_is_spread_one_each():
    assert rotation_batch(SPREAD) == SPREAD
    assert rotation_batch(3) == 3
    assert shares(dict.fromkeys("abc", 100), 3) == dict.fromkeys("abc", 1)


def test_each_further_look_examines_twice_as_many_up_to_what_is_wanted():
    assert [rotation_batch(64, n) for n in range(5)] == [8, 16, 32, 64, 64]
    assert [rotation_batch(20, n) for n in range(3)] == [8, 16, 20]


@given(wanted=st.integers(1, 5000), look=st.integers(0, 5))
def test_every_endpoint_examined_is_owed_a_delivery_and_no_look_exceeds_what_is_wanted(
        wanted, look):
    size = rotation_batch(wanted, look)
    assert 1 <= size <= wanted
    owed = shares({str(n): wanted for n in range(size)}, wanted)
    assert len(owed) == size and min(owed.values()) >= 1
    assert sum(owed.values()) >= wanted
    if look == 0 and wanted >= SPREAD * TURN:
        assert max(owed.values()) == TURN  # a turn, never a claim's whole


def test_the_rows_are_taken_one_of_each_in_turn_and_the_limit_cuts_the_last_layer():
    found = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7]}
    assert round_robin(found, ["b", "a", "c"], 5) == [4, 1, 7, 5, 2]


def test_turns_cut_the_last_layer_in_the_shares_order():
    assert turns({"b": 3, "a": 3, "c": 1}, 5) == {"b": 2, "a": 2, "c": 1}
    assert turns({"b": 3, "a": 3, "c": 1}, 4) == {"b": 2, "a": 1, "c": 1}
    assert turns({"a": 2, "b": 2}, 3) == {"a": 2, "b": 1}  # shares rounded up: 3 of 4
    assert turns({"a": 1000}, 64) == {"a": 64}
    assert turns({"a": 0, "b": 5}, 9) == {"a": 0, "b": 5}


@given(share=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 40)),
       limit=st.integers(1, 200))
def test_turns_are_what_round_robin_keeps_of_full_shares(share, limit):
    """A claim that leases as it reads takes of each endpoint what the
    claim that read every share and cut them by round_robin kept."""
    found = {name: [name] * n for name, n in share.items()}
    kept = Counter(round_robin(found, list(share), limit))
    assert turns(share, limit) == {name: kept.get(name, 0) for name in share}
