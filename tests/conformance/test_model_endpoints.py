"""The claim of deliveries against a model, on every store: several endpoints,
a cap, a bucket, a disabled endpoint, random intakes, claims (of every
endpoint or some), finishes and the passing of time.

After every claim: no endpoint has more live leases than its cap, no bucket
gave more than its burst plus its rate times the time gone by, the claim
was work-conserving: it leased exactly as many as the limit and the
endpoints' allowances let it (the model's own arithmetic, not the code's),
and each endpoint's were the first of its claimable deliveries: its leases
run out (by lease end, then seq), then its due ones, the higher priority
first, then by the time they became due, then seq."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.conftest import ManualClock, Queues
from tests.support.queues import T0

URL = "http://127.0.0.1:9/events"
LEASE_MS = 5_000
POLICY = RetryPolicy(max_attempts=50, ttl_ms=10_000_000)
ENDPOINTS = {
    "capped": {"max_in_flight": 3},
    "metered": {"rate": 4.0, "burst": 3},
    "both": {"max_in_flight": 2, "rate": 10.0, "burst": 2},
    "open": {},
    "off": {"enabled": False},
}
TYPES = {"capped": ("*",), "metered": ("*",), "both": ("t.b",), "open": ("t.b", "t.o"),
         "off": ("*",)}


class Model:
    """The deliveries as the claim should see them, and each bucket."""

    def __init__(self) -> None:
        self.deliveries: dict[str, dict] = {}  # id -> endpoint, status, until, available
        self.tokens = {name: float(spec["burst"]) for name, spec in ENDPOINTS.items()
                       if "rate" in spec}
        self.filled = {name: T0 for name in self.tokens}
        self.leases = {name: 0 for name in ENDPOINTS}  # every lease ever, by endpoint

    def bucket(self, name: str, now: int) -> float:
        spec = ENDPOINTS[name]
        gained = (now - self.filled[name]) * spec["rate"] / 1000
        return min(spec["burst"], self.tokens[name] + gained)

    def live(self, name: str, now: int) -> int:
        return sum(1 for d in self.deliveries.values() if d["endpoint"] == name
                   and d["status"] == "leased" and d["until"] > now)

    def due(self, name: str, now: int) -> int:
        return sum(1 for d in self.deliveries.values() if d["endpoint"] == name and (
            (d["status"] == "pending" and d["available"] <= now)
            or (d["status"] == "leased" and d["until"] <= now)))

    def allowance(self, name: str, now: int) -> int:
        spec = ENDPOINTS[name]
        if spec.get("enabled", True) is False:
            return 0
        room = 10**9 if "max_in_flight" not in spec else spec["max_in_flight"] - self.live(
            name, now)
        if name in self.tokens:
            room = min(room, int(self.bucket(name, now)))
        return max(0, room)

    def claim_order(self, name: str, now: int) -> list[str]:
        """An endpoint's claimable deliveries in the order a claim takes them."""
        mine = [(delivery_id, d) for delivery_id, d in self.deliveries.items()
                if d["endpoint"] == name]
        run_out = sorted((d["until"], d["seq"], delivery_id) for delivery_id, d in mine
                         if d["status"] == "leased" and d["until"] <= now)
        due = sorted((-d["priority"], d["available"], d["seq"], delivery_id)
                     for delivery_id, d in mine
                     if d["status"] == "pending" and d["available"] <= now)
        return [row[-1] for row in run_out] + [row[-1] for row in due]


class EndpointMachine(RuleBasedStateMachine):
    def __init__(self, queues: Queues) -> None:
        super().__init__()
        self.clock = ManualClock(T0)
        self._fresh = queues.fresh(self.clock)
        self.store = self._fresh.__enter__()
        for name, spec in ENDPOINTS.items():
            self.store.add_endpoint(Endpoint(name, URL, types=TYPES[name], **spec), now_ms=T0)
        self.model = Model()
        self.now = T0
        self.next_id = 0
        self.held: list = []  # Leased not finished yet
        self.seq = 0  # the order of the deliveries' intake

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def teardown(self) -> None:
        self._fresh.__exit__(None, None, None)

    @rule(kind=st.sampled_from([None, "t.b", "t.o"]),
          priorities=st.lists(st.sampled_from([None, 0, 1, 7, -7]), min_size=1, max_size=6))
    def enqueue(self, kind: str | None, priorities: list[int | None]) -> None:
        events = []
        n = len(priorities)
        for priority in priorities:
            self.next_id += 1
            event: dict[str, object] = {"id": f"m{self.next_id}", "body": {"n": self.next_id}}
            if kind is not None:
                event["type"] = kind
            if priority is not None:
                event["priority"] = priority
            events.append(event)
        assert self.store.enqueue_events(events, POLICY, now_ms=self.now) == [True] * n
        for event in events:
            for name, types in TYPES.items():
                if "*" in types or kind in types:
                    self.model.deliveries[f"{event['id']}@{name}"] = {
                        "endpoint": name, "status": "pending", "until": 0,
                        "available": self.now, "priority": event.get("priority", 0),
                        "seq": self.next_seq()}

    @rule(ms=st.sampled_from([1, 90, 250, 1_000, 6_000]))
    def wait(self, ms: int) -> None:
        self.now += ms

    @rule(limit=st.integers(1, 12),
          served=st.sampled_from(["*", ("capped", "metered"), ("both",), ("open", "off")]))
    def claim(self, limit: int, served: str | tuple[str, ...]) -> None:
        names = list(ENDPOINTS) if served == "*" else list(served)
        room = {name: min(self.model.allowance(name, self.now), self.model.due(name, self.now))
                for name in names}
        order = {name: self.model.claim_order(name, self.now) for name in names}
        leased = self.store.claim_jobs("w1", LEASE_MS, limit, now_ms=self.now,
                                       endpoints=served).leased
        assert len(leased) == min(limit, sum(room.values())), (room, limit)
        taken: dict[str, int] = {}
        for job in leased:
            assert job.endpoint in names
            taken[job.endpoint] = taken.get(job.endpoint, 0) + 1
            delivery = self.model.deliveries[job.ticket["id"]]
            delivery.update(status="leased", until=self.now + LEASE_MS)
        for name, n in taken.items():
            assert n <= room[name], (name, n, room)
            assert {job.ticket["id"] for job in leased if job.endpoint == name} == set(
                order[name][:n]), (name, order[name])
            self.model.leases[name] += n
            if name in self.model.tokens:
                self.model.tokens[name] = self.model.bucket(name, self.now) - n
                self.model.filled[name] = self.now
        self.held = [job for job in self.held if job.ticket["id"] not in
                     {j.ticket["id"] for j in leased}] + leased

    @precondition(lambda self: self.held)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "retry"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        job = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        # a retry the receiver answered (409): the endpoint is up, its breaker stays closed
        [result] = self.store.finish_jobs([(job.ticket, outcome, 500, Attempt(self.now, 1, 409))],
                                          now_ms=self.now)
        delivery = self.model.deliveries[job.ticket["id"]]
        if delivery["status"] != "leased" or delivery["until"] <= self.now:
            # its lease ran out: a finish may still land if no one took it since
            fresh = delivery["status"] == "leased" and result is not False
            if not fresh:
                return
        if result is False:
            return
        delivery.update(status="done" if outcome == "ok" else "pending", until=0,
                        available=self.now + 500)

    @invariant()
    def caps_hold(self) -> None:
        for row in self.store.jobs_with_status("leased"):
            assert row["endpoint"] in ENDPOINTS
        for name, spec in ENDPOINTS.items():
            if "max_in_flight" in spec:
                live = sum(1 for row in self.store.jobs_with_status("leased")
                           if row["endpoint"] == name and row["lease_until"] > self.now)
                assert live <= spec["max_in_flight"]
            if "rate" in spec:
                allowed = spec["burst"] + spec["rate"] * (self.now - T0) / 1000
                assert self.model.leases[name] <= allowed + 1e-9
            if spec.get("enabled", True) is False:
                assert self.model.leases[name] == 0


def test_the_claim_of_deliveries_matches_its_model(queues: Queues) -> None:
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(lambda: EndpointMachine(queues),
                              settings=queues.settings(40, 10, stateful_step_count=40))
