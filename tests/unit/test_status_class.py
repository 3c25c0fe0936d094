"""An answer's HTTP status class as the dispatcher counts it."""

from __future__ import annotations

import pytest

from asyncworker.dispatcher import STATUS_CLASSES, DispatcherStats, status_class


@pytest.mark.parametrize(("status", "expected"), [
    (100, "1xx"), (200, "2xx"), (204, "2xx"), (301, "3xx"), (409, "4xx"), (429, "4xx"),
    (500, "5xx"), (599, "5xx"), (None, "none"), (600, "none"), (99, "none")])
def test_an_answers_class(status, expected):
    assert status_class(status) == expected


def test_every_class_starts_at_zero_and_is_in_the_stats_json():
    stats = DispatcherStats()
    assert stats.answers == dict.fromkeys(STATUS_CLASSES, 0)
    assert stats.as_dict()["answers"] == stats.answers
