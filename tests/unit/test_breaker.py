"""The breaker's pure rules (lease.breaker): signals, steps, the claim's room."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lease.breaker import (
    BREAKER,
    CLOSED,
    HALF_OPEN,
    OPEN,
    Circuit,
    claim_room,
    disabled_by,
    signal_of,
    step,
)
from lease.records import Attempt

DOWN = Attempt(0, 1, None, "connection refused")
OK = Attempt(0, 1, 200)


def test_what_an_attempt_tells_the_breaker():
    assert signal_of("ok", OK) == "success"
    assert signal_of("retry", DOWN) == "failure"  # no answer
    assert signal_of("retry", Attempt(0, 1, 502)) == "failure"
    assert signal_of("retry", Attempt(0, 1, 429)) == "failure"
    assert signal_of("permanent", Attempt(0, 1, 422)) == "success"  # it answered
    assert signal_of("retry", Attempt(0, 1, 404)) == "success"  # status policy retries a 404
    assert signal_of(None, DOWN) is None  # evidence only


def test_a_healthy_endpoints_successes_change_nothing():
    circuit = Circuit()
    for now in range(100):
        after, change = step(circuit, "success", OK, now)
        assert (after, change) == (circuit, None)


def test_the_cooldown_doubles_up_to_its_cap():
    circuit, now = Circuit(), 0
    for _ in range(BREAKER.open_after):
        circuit, change = step(circuit, "failure", DOWN, now)
    assert change == "opened" and circuit.cooldown_ms == BREAKER.cooldown_ms
    lengths = []
    for _ in range(12):
        now = circuit.open_until_ms
        circuit, change = step(circuit, "failure", DOWN, now)  # the probe fails
        assert change == "reopened"
        lengths.append(circuit.cooldown_ms)
    assert lengths[:3] == [10_000, 20_000, 40_000] and max(lengths) == BREAKER.cooldown_cap_ms


def test_only_the_probes_success_closes_it():
    circuit = Circuit(state=OPEN, open_until_ms=100, cooldown_ms=5_000, failures=5)
    assert step(circuit, "success", OK, 50) == (circuit, None)  # a send begun before
    closed, change = step(Circuit(state=HALF_OPEN, failures=6, failing_since_ms=1), "success",
                          OK, 200)
    assert change == "closed" and (closed.state, closed.failures, closed.failing_since_ms) == (
        CLOSED, 0, None)


def test_disabled_after_failing_long_enough_and_never_when_told_not_to():
    circuit = Circuit(state=OPEN, failing_since_ms=0, why="down")
    assert disabled_by(circuit, 1_000, 999) is None
    assert "failing for 1 s" in disabled_by(circuit, 1_000, 1_000)
    assert disabled_by(circuit, None, 10**12) is None


@given(st.lists(st.tuples(st.sampled_from(["success", "failure"]),
                          st.integers(0, 120_000), st.integers(0, 3)), max_size=60))
def test_the_claims_room_is_one_probe_at_most_whenever_the_circuit_is_not_closed(script):
    circuit, now = Circuit(), 0
    for signal, gap, live in script:
        now += gap
        circuit, _ = step(circuit, signal, DOWN if signal == "failure" else OK, now)
        room, _ = claim_room(circuit, live, now)
        if circuit.state != CLOSED:
            assert room is not None and room <= max(0, 1 - live)
        if circuit.state == OPEN and circuit.open_until_ms is not None \
                and now < circuit.open_until_ms:
            assert room == 0
        assert circuit.cooldown_ms <= BREAKER.cooldown_cap_ms


def test_step_reads_the_module_thresholds_when_called_not_at_import(monkeypatch):
    import lease.breaker

    monkeypatch.setattr(lease.breaker, "BREAKER", lease.breaker.Breaker(open_after=2))
    circuit = Circuit()
    circuit, change = step(circuit, "failure", DOWN, 1)
    assert change is None
    circuit, change = step(circuit, "failure", DOWN, 2)
    assert change == "opened"  # two in a row: the thresholds in force now
