"""Every scenario of ``python -m asyncworker.bench.endpoints`` runs, small, on
both stores, in its own process as ``asyncworker bench --endpoints`` runs it:
a benchmark whose setup no longer matches the schema (a column added to the
intake's statement) fails here, not in the next long run. The figures are
read for what they must hold whatever the machine's speed (every delivery
leased, the cap never exceeded), never for a speed."""

from __future__ import annotations

import pytest

from asyncworker.bench.endpoints import judge, run_child

# (scenario, its small parameters)
SMALL = [
    ("claim", {"deliveries": 2_000, "probes": 10, "rounds": 2, "endpoints": 200,
               "capped": 10}),
    ("fair", {"deliveries": 1_000, "b": 20}),
    ("blocked", {"backlog": 200, "healthy": 200}),
    ("fanout", {"messages": 40, "fan": 5, "probes": 3}),
]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> str | None:
    return None if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.mark.parametrize("name, params", SMALL, ids=[name for name, _ in SMALL])
def test_each_scenario_runs_small(store: str | None, name: str, params: dict) -> None:
    figures = run_child(name, params, store)
    assert figures["rss_mb"] > 0
    verdicts = {key: met for key, _, _, met in judge({name: figures})}
    if name == "claim":
        for label in ("plain", "single", "many", "own"):
            assert figures[label]["jobs"] > 0, (label, figures[label])
        assert figures["capped_in_flight"] == [figures["cap"]]  # held at the cap
    elif name == "fair":
        assert verdicts["fair"], figures
    elif name == "blocked":
        assert figures["served"] == params["healthy"], figures
    else:
        assert verdicts["fan_one"] and verdicts["fan_all"], figures


def test_the_capped_scenario_runs_small_with_two_processes() -> None:
    figures = run_child("capped", {"seconds": 2.0, "processes": 2, "rate": 20.0, "cap": 3})
    assert 0 < figures["peak"] <= 3 and figures["requests"] > 0, figures
