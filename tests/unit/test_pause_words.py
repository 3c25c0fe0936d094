"""The pause in words: what ``stats``, the progress line and ``pause`` say,
and the pure decision both stores take (lease.rules)."""

from __future__ import annotations

import pytest

from asyncworker.cli.output import progress_line
from asyncworker.dispatcher import DispatcherStats
from asyncworker.operations import paused_words
from lease.rules import pause_decision, paused_state


def test_the_pause_is_said_with_when_who_and_why():
    state = {"since_ms": 1_700_000_000_123, "actor": "ops", "note": "deploy"}
    assert paused_words(state) == "paused since 2023-11-14 22:13:20.123Z by ops (deploy)"
    assert paused_words({**state, "actor": None}) == \
        "paused since 2023-11-14 22:13:20.123Z (deploy)"
    assert paused_words(None) == "not paused"


def test_the_progress_line_says_paused_only_while_paused():
    line = progress_line(DispatcherStats(), 0.0)
    assert "paused" not in line
    assert progress_line(DispatcherStats(), 0.0, "paused since x (y)").endswith(
        "  paused since x (y)")


def test_a_change_is_written_only_when_it_changes_the_state():
    assert pause_decision("pause", False, "n", None) is True
    assert pause_decision("pause", True, "n", None) is False
    assert pause_decision("resume", True, "n", "ops") is True
    assert pause_decision("resume", False, "n", None) is False
    with pytest.raises(ValueError, match="action"):
        pause_decision("stop", False, "n", None)
    with pytest.raises(ValueError, match="note"):
        pause_decision("pause", False, "", None)
    assert paused_state(None) is None
    assert paused_state((5, None, "n")) == {"since_ms": 5, "actor": None, "note": "n"}
