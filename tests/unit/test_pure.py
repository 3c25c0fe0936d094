"""Tier 1: the pure decisions, no database, no clock."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lease.worker import (
    BadAck,
    Permanent,
    Retryable,
    check_jitter,
    check_second_clock,
    classify_error,
    classify_result,
    finish_decision,
    parse_event,
    retry_delay,
)


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "jitter", "expected"),
    [
        (1, 100, 1000, 1, 100),
        (1, 100, 1000, 1.0, 100),
        (1, 100, 1000, 0, 0),
        (1, 100, 1000, 0.0, 0),
        (1, 100, 1000, 0.5, 50),
        (2, 100, 1000, 0.5, 100),
        (3, 100, 1000, 1, 400),
        (4, 100, 1000, 1, 800),
        (5, 100, 1000, 1, 1000),  # 1600 capped to 1000 before the multiply
        (16, 100, 1000, 0.5, 500),  # cap first: 0.5 * 1000, not min(1000, 0.5 * 3276800)
        (16, 60000, 60000, 1, 60000),
        (1, 100, 1000, 5e-324, 0),  # tiny jitter floors to 0
        (1, 100, 1000, 0.999, 99),  # floor, not round
        (2, 3, 5, 0.7, 3),  # min(5, 6) = 5; 5 * 0.7 = 3.5 -> 3
        (1, 1, 1, 1, 1),
    ],
)
def test_retry_delay_values(attempt, base, cap, jitter, expected):
    assert retry_delay(attempt, base, cap, jitter) == expected
    assert type(retry_delay(attempt, base, cap, jitter)) is int


@pytest.mark.parametrize(
    "args",
    [
        (0, 100, 1000, 1), (17, 100, 1000, 1), (True, 100, 1000, 1), (1.0, 100, 1000, 1),
        (1, 0, 1000, 1), (1, 60001, 60001, 1), (1, True, 1000, 1), (1, 100.0, 1000, 1),
        (1, 100, 99, 1), (1, 100, 60001, 1), (1, 100, False, 1), (1, 100, 1000.0, 1),
        (1, 100, 1000, -0.1), (1, 100, 1000, 1.0000001), (1, 100, 1000, 2),
        (1, 100, 1000, math.nan), (1, 100, 1000, math.inf), (1, 100, 1000, -math.inf),
        (1, 100, 1000, True), (1, 100, 1000, False), (1, 100, 1000, "0.5"),
        (1, 100, 1000, None), (1, 100, 1000, 10**400),
    ],
)
def test_retry_delay_rejects(args):
    with pytest.raises(ValueError):
        retry_delay(*args)


@given(
    attempt=st.integers(1, 16),
    base=st.integers(1, 60000),
    data=st.data(),
    jitter=st.floats(0, 1, allow_nan=False),
)
def test_retry_delay_is_floor_of_capped_times_jitter(attempt, base, data, jitter):
    cap = data.draw(st.integers(base, 60000))
    got = retry_delay(attempt, base, cap, jitter)
    assert got == math.floor(min(cap, base * 2 ** (attempt - 1)) * jitter)
    assert 0 <= got <= cap


def test_check_jitter_accepts_edges():
    for value in (0, 1, 0.0, 1.0, 0.5, 5e-324):
        assert check_jitter(value) == value


def test_classify_result_only_exact_true():
    assert classify_result(True) == ("ok", 0)

    class Truthy:
        def __bool__(self) -> bool:
            return True

    for value in (1, "True", None, False, Truthy(), [True], 1.0):
        with pytest.raises(BadAck):
            classify_result(value)


def test_classify_error():
    assert classify_error(Permanent("no"), 1, 0.5) == ("permanent", 0)
    assert classify_error(Retryable("later"), 1, 0.5) == ("retry", 50)
    assert classify_error(Retryable("later"), 4, 1) == ("retry", 800)
    assert classify_error(Retryable("later"), 9, 1) == ("retry", 1000)

    class SubRetry(Retryable):
        pass

    assert classify_error(SubRetry(), 2, 1.0) == ("retry", 200)
    for error in (RuntimeError(), BadAck(), ValueError(), KeyboardInterrupt(), TimeoutError()):
        assert classify_error(error, 1, 0.5) is None


def test_classify_error_rejects_bad_jitter():
    with pytest.raises(ValueError):
        classify_error(Retryable(), 1, math.nan)


@pytest.mark.parametrize(
    ("outcome", "attempts", "max_attempts", "deadline", "now", "delay", "expected"),
    [
        ("ok", 3, 3, 2000, 1000, 0, ("done", None, 1000)),
        ("permanent", 1, 3, 2000, 1000, 500, ("dead", "permanent", 1000)),
        ("retry", 3, 3, 9999, 1000, 0, ("dead", "exhausted", 1000)),
        ("retry", 4, 3, 9999, 1000, 0, ("dead", "exhausted", 1000)),
        ("retry", 1, 3, 1500, 1000, 500, ("dead", "deadline", 1000)),  # now + delay == deadline
        ("retry", 1, 3, 1501, 1000, 500, ("pending", "retry", 1500)),
        ("retry", 3, 3, 1500, 1000, 500, ("dead", "exhausted", 1000)),  # budget wins
        ("retry", 1, 3, 1001, 1000, 0, ("pending", "retry", 1000)),
    ],
)
def test_finish_decision(outcome, attempts, max_attempts, deadline, now, delay, expected):
    assert finish_decision(outcome, attempts, max_attempts, deadline, now, delay) == expected


def test_second_clock():
    assert check_second_clock(10, 10) == 10
    assert check_second_clock(10, 11) == 11
    for bad in (9, -1, True, 10.0, None, "11", 10**15):
        with pytest.raises(ValueError):
            check_second_clock(10, bad)


# ----------------------------------------------------------------- parse_event


@pytest.mark.parametrize(("data", "event"), [
    ('{"id": "a", "qty": 1}', {"id": "a", "qty": 1}),
    (b'{"qty": 1000, "id": "snack-7"}', {"id": "snack-7", "qty": 1000}),
    (' {"id": "a", "qty": 1}\n', {"id": "a", "qty": 1}),
])
def test_parse_event_reads_strict_json(data, event):
    assert parse_event(data) == event


@pytest.mark.parametrize(("data", "message"), [
    ('{"id": "a", "qty": 1, "qty": 2}', "duplicate key"),
    ('{"id": "a", "id": "b", "qty": 1}', "duplicate key"),
    ('{"id": "a", "qty": NaN}', "NaN is not valid JSON"),
    ('{"id": "a", "qty": Infinity}', "Infinity is not valid JSON"),
    ('{"id": "a", "qty": 1', "not valid JSON"),
    ('[{"id": "a", "qty": 1}]', "event must be"),
    ('{"id": "a", "qty": 1.0}', "qty"),
    ('{"id": "a", "qty": true}', "qty"),
    ('{"id": "a b", "qty": 1}', "event id"),
    (b'{"id": "\xff", "qty": 1}', "not UTF-8"),
    ('{"id": "a", "qty": 1, "x": {"k": 1, "k": 2}}', "duplicate key"),
    ('{"id": "a", "qty": 1}'.encode("utf-16"), "not UTF-8"),
    (b'\xef\xbb\xbf{"id": "a", "qty": 1}', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("", "not valid JSON"),
    (None, "str or bytes"),
    ({"id": "a", "qty": 1}, "str or bytes"),
    ('{"id": "a", "qty": 1, "x": 1}', "exactly the keys"),
])
def test_parse_event_refuses_with_a_clear_error(data, message):
    with pytest.raises(ValueError, match=message):
        parse_event(data)


class CountedId(str):
    """A job id that counts every equality test made on it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_redrive_finds_each_ids_result_without_scanning_the_ids():
    """The audit rows a redrive keeps (lease.sqlite.kept_audits), for 2,000
    ids each named twice in a shuffled order, every seventh refused at its
    first place: the right rows, with the ids compared about once each, not
    once per id before it (a scan of the list per id, inside the write
    transaction, cost 0.8 s at 10,000 ids)."""
    from lease.rules import kept_audits

    names = [f"job-{n}" for n in range(2000)]
    job_ids = [CountedId(name) for name in names] + [CountedId(name) for name in names]
    random.Random(3).shuffle(job_ids)
    firsts: dict[str, CountedId] = {}
    for job_id in job_ids:
        firsts.setdefault(str(job_id), job_id)
    refused = {name for n, name in enumerate(names) if n % 7 == 0}
    results = [ValueError("refused") if firsts[str(job_id)] is not job_id or job_id in refused
               else True for job_id in job_ids]
    # the audit rows _redrive_decisions gives: each id at its first place, in that order
    audits = [(job_id, n) for n, job_id in enumerate(job_ids) if firsts[str(job_id)] is job_id]
    CountedId.compared = 0
    kept = kept_audits(audits, results, job_ids)
    compared = CountedId.compared
    assert kept == [(job_id, n) for job_id, n in audits if str(job_id) not in refused]
    assert compared <= 2 * len(job_ids), compared
