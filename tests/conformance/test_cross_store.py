"""The same calls on both stores give the same answers and the same queue, row
for row: the PostgreSQL store equals the SQLite one, not merely its model.

Not parametrized: each check opens one queue of each kind and plays the same
program on both (random programs, then one that walks every rule in turn).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.support.queues import T0

from .conftest import Queues
from .helpers import Player, dump, programs

# Every call of the interface, with the rules' edges: duplicates and conflicts,
# a delayed intake, batches, a lease that runs out and is claimed again, stale
# finishes (by token, owner, and after the job is done), evidence only, the
# quarantine's reasons, redrive (a ticket from before stays stale), cancel,
# and a prune that takes the newest attempts row of the queue.
WALK = [
    ("enqueue", [{"id": "j0", "qty": 1}, {"id": "j1", "body": {"v": 1}},
                 {"id": "j1", "body": {"v": 1}}, {"id": "j1", "body": {"v": 2}},
                 {"id": "j0", "qty": 2}], 1000, 2, 0),
    ("enqueue", [{"id": "j2", "qty": 1}, {"id": "order:7", "body": {"v": 7}}], 60_000, 5, 50),
    ("claim", "host-a", 100, 3),
    ("extend", 0, 1000),
    ("finish", [(0, "ok", 0, 1), (1, "retry", 30, 0), (2, "ok", 0, 0), (1, "ok", 0, 0)]),
    ("advance", 100),
    ("claim", "host-b", 50, 4),
    ("finish", [(0, "ok", 0, 0), (3, None, 0, 0), (4, "permanent", 0, 0), (5, "ok", 0, 2)]),
    ("advance", 60),
    ("claim", "host-a", 5000, 4),
    ("finish", [(6, "retry", 5000, 0), (7, "retry", 0, 0)]),
    ("advance", 1000),
    ("claim", "host-a", 500, 4),
    ("redrive", ["j1", "j2", "j2", "nope", "j0"], 60_000),
    ("claim", "host-b", 500, 4),  # j1 and j2 again: tickets 7 and 8
    ("finish", [(1, "ok", 0, 0), (7, "ok", 0, 0)]),  # a ticket from before the redrive
    ("finish", [(7, "ok", 0, 0)]),  # stale: the queue's newest attempts row, j1's
    ("advance", 10),
    ("finish", [(8, "ok", 0, 0)]),
    ("prune", 5, 3),  # j0 and j1, with their attempts rows
    ("finish", [(8, "retry", 0, 0)]),  # stale: after j2's delivery in its history
    ("cancel", ["order:7", "order:7", "j2", "nope"]),
    ("enqueue", [{"id": "j0", "qty": 2}, {"id": "j5", "qty": 1}], 1000, 1, 0),
    ("claim", "host-a", 100, 4),
    ("advance", 2000),
    ("claim", "host-a", 100, 4),
]


@pytest.fixture
def both(request: pytest.FixtureRequest) -> tuple[Queues, Queues]:
    return Queues("sqlite", request), Queues("postgresql", request)


def play_on_both(both: tuple[Queues, Queues], program: list) -> None:
    sqlite, postgresql = both
    with sqlite.fresh() as one, postgresql.fresh() as two:
        a, b = Player(one, T0), Player(two, T0)
        for step in program:
            assert a.play([step]) == b.play([step]), step
            assert a.tickets == b.tickets
        assert dump(one, a.now) == dump(two, b.now)


def test_a_walk_through_every_rule_ends_row_for_row_equal(both):
    play_on_both(both, WALK)


def test_random_programs_end_row_for_row_equal(both):
    @settings(max_examples=30, deadline=None)
    @given(program=programs(30))
    def check(program: list) -> None:
        play_on_both(both, program)

    check()
