"""Endpoints as data, on every store: fan-out at intake, the fair claim under
each endpoint's cap and bucket, the operator's changes and what reads show.

Every call passes ``now_ms``: a cap, a bucket and a lease are judged by the
values the test gives, never by the machine's clock."""

from __future__ import annotations

from typing import Any

import pytest

from lease.endpoints import MAX_IN_FLIGHT, Endpoint, EndpointError, rotation_batch, shares, turns
from lease.policy import RetryPolicy
from lease.records import Attempt, Conflict
from lease.signing import new_secret
from lease.store import Store
from tests.conformance.helpers import body_event, history, job
from tests.support.queues import T0

URL = "http://127.0.0.1:9/events"
SECRET = new_secret(random=b"s" * 32)
HEADER_VALUE = "Bearer do-not-show-me"
POLICY = RetryPolicy(max_attempts=5, ttl_ms=3_600_000)


def endpoint(name: str, **fields: Any) -> Endpoint:
    return Endpoint(name, URL, **fields)


def message(message_id: str, event_type: str | None = None, key: str | None = None,
            **body: object) -> dict:
    event: dict[str, Any] = body_event(message_id, **(body or {"n": 1}))
    if event_type is not None:
        event["type"] = event_type
    if key is not None:
        event["key"] = key
    return event


def enqueue(store: Store, *events: dict, now: int = T0) -> list:
    return store.enqueue_events(list(events), POLICY, now_ms=now)


def claim(store: Store, now: int, limit: int = 100, endpoints: Any = "*",
          owner: str = "w1", lease_ms: int = 30_000) -> list:
    return store.claim_jobs(owner, lease_ms, limit, now_ms=now, endpoints=endpoints).leased


def done(store: Store, leased: list, now: int) -> list:
    return store.finish_jobs([(job.ticket, "ok", 0, Attempt(now, 1, 200)) for job in leased],
                             now_ms=now)


def ids(leased: list) -> list[str]:
    return [job.ticket["id"] for job in leased]


def by_endpoint(leased: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for leased_job in leased:
        counts[leased_job.endpoint] = counts.get(leased_job.endpoint, 0) + 1
    return counts


# ----------------------------------------------------------------- fan-out


def test_a_message_fans_out_to_each_endpoint_subscribed_to_its_type(store):
    store.add_endpoint(endpoint("all"), now_ms=T0)
    store.add_endpoint(endpoint("billing", types=("invoice.paid", "invoice.due")), now_ms=T0)
    store.add_endpoint(endpoint("users", types=("user.created",)), now_ms=T0)
    assert enqueue(store, message("m1", "invoice.paid"), message("m2"),
                   message("m3", "user.created")) == [True, True, True]
    leased = claim(store, T0)
    assert sorted(ids(leased)) == ["m1@all", "m1@billing", "m2@all", "m3@all", "m3@users"]
    for job_ in leased:
        # the receiver sees the message's id, the same for every endpoint
        assert job_.event["id"] == job_.message == job_.ticket["id"].split("@")[0]
        assert job_.endpoint == job_.ticket["id"].split("@")[1]
    row = job(store, "m1@billing")
    assert (row["endpoint"], row["message"], row["event_type"]) == ("billing", "m1",
                                                                    "invoice.paid")


def test_intake_is_idempotent_by_message_id_and_content_type_included(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    assert enqueue(store, message("m1", "t.one", n=1)) == [True]
    rows_before = [job(store, f"m1@{name}") for name in "ab"]
    assert enqueue(store, message("m1", "t.one", n=1), now=T0 + 5) == [False]
    assert [job(store, f"m1@{name}") for name in "ab"] == rows_before
    [other_body] = enqueue(store, message("m1", "t.one", n=2))
    [other_type] = enqueue(store, message("m1", "t.two", n=1))
    assert isinstance(other_body, Conflict) and isinstance(other_type, Conflict)
    assert "type 't.two'" in str(other_type)
    # an endpoint added later does not get the old message by a duplicate intake
    store.add_endpoint(endpoint("c"), now_ms=T0)
    assert enqueue(store, message("m1", "t.one", n=1)) == [False]
    assert store.job_history("m1@c") is None


def test_one_intake_fans_out_all_or_none(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    with pytest.raises(ValueError):
        enqueue(store, message("m1"), {"id": "bad", "body": "not an object"})
    assert store.counts()["pending"] == 0
    # an id too long to fan out with the endpoint's name is a bad event
    with pytest.raises(ValueError, match="too long to fan out"):
        enqueue(store, message("m2"), message("x" * 254))
    assert store.counts()["pending"] == 0


def test_a_queue_without_endpoints_keeps_its_own_jobs_apart(store):
    enqueue(store, message("own-1"))
    store.add_endpoint(endpoint("a"), now_ms=T0)
    enqueue(store, message("m1"))
    assert ids(claim(store, T0, endpoints="*")) == ["m1@a"]
    assert ids(store.claim_jobs("w2", 30_000, 10, now_ms=T0).leased) == ["own-1"]


def test_a_delivery_is_a_job_redriven_and_cancelled_by_its_own_id(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    enqueue(store, message("m1"))
    [first, second] = claim(store, T0)
    store.finish_jobs([(first.ticket, "permanent", 0, Attempt(T0, 1, 410, "gone"))],
                      now_ms=T0 + 1)
    done(store, [second], T0 + 1)
    assert store.redrive_jobs([first.ticket["id"]], 60_000, "fixed", now_ms=T0 + 2) == [True]
    [again] = claim(store, T0 + 3)
    assert again.ticket["id"] == first.ticket["id"] and again.event == first.event
    assert again.ticket["token"] > first.ticket["token"]
    assert store.cancel_jobs([again.ticket["id"]], "no", now_ms=T0 + 4) != [True]  # leased


def test_an_ordering_key_orders_per_endpoint(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    enqueue(store, message("m1", key="order-7"), message("m2", key="order-7"))
    first = claim(store, T0)
    assert sorted(ids(first)) == ["m1@a", "m1@b"]  # one line per endpoint
    [at_a] = [job_ for job_ in first if job_.endpoint == "a"]
    done(store, [at_a], T0 + 1)
    assert ids(claim(store, T0 + 2)) == ["m2@a"]  # b's line still waits on m1@b
    assert job(store, "m2@b")["ordering_key"] == "order-7"
    keyed = store.list_jobs(key="order-7")
    assert sorted(row["id"] for row in keyed) == ["m1@a", "m1@b", "m2@a", "m2@b"]


# ----------------------------------------------------------------- the claim


def test_the_cap_counts_live_leases_and_not_expired_ones(make_store):
    one, two = make_store(), make_store()
    one.add_endpoint(endpoint("slow", max_in_flight=3), now_ms=T0)
    enqueue(one, *(message(f"m{i}") for i in range(10)))
    assert len(claim(one, T0, lease_ms=1_000)) == 3
    assert claim(two, T0 + 1, owner="w2") == []  # another connection, the same cap
    assert len(claim(two, T0 + 1_000, owner="w2")) == 3  # those leases ran out
    leased = claim(two, T0 + 1_000, owner="w2")
    assert leased == []
    live = [row for row in one.jobs_with_status("leased") if row["lease_until"] > T0 + 1_000]
    assert len(live) == 3


def test_a_finish_frees_a_place_under_the_cap(store):
    store.add_endpoint(endpoint("slow", max_in_flight=2), now_ms=T0)
    store.add_endpoint(endpoint("fast"), now_ms=T0)
    enqueue(store, *(message(f"m{i}") for i in range(20)))
    leased = claim(store, T0, limit=10)
    assert by_endpoint(leased) == {"slow": 2, "fast": 8}
    slow = [job_ for job_ in leased if job_.endpoint == "slow"]
    done(store, slow[:1], T0 + 1)
    assert by_endpoint(claim(store, T0 + 2, limit=10)) == {"slow": 1, "fast": 9}


def test_the_bucket_holds_burst_and_rate_by_the_stores_clock(store):
    store.add_endpoint(endpoint("metered", rate=10, burst=5), now_ms=T0)
    enqueue(store, *(message(f"m{i}") for i in range(100)))
    assert len(claim(store, T0)) == 5  # a new bucket is full
    assert len(claim(store, T0)) == 0
    assert len(claim(store, T0 + 99)) == 0  # 0.99 of a token
    assert len(claim(store, T0 + 100)) == 1
    assert len(claim(store, T0 + 10_000)) == 5  # never above the burst
    # over any stretch: at most the burst plus the rate times its length
    taken, now = 0, T0 + 10_000
    for step in range(1, 41):
        taken += len(claim(store, now + step * 50))
    assert taken <= 10 * 2.0 + 1  # 2 s at 10/s, the bucket emptied just before


def test_a_new_rate_starts_a_full_bucket_and_no_rate_is_no_limit(store):
    store.add_endpoint(endpoint("metered", rate=1, burst=2), now_ms=T0)
    enqueue(store, *(message(f"m{i}") for i in range(20)))
    assert len(claim(store, T0)) == 2
    store.update_endpoint("metered", {"rate": 100, "burst": 4}, now_ms=T0 + 1)
    assert len(claim(store, T0 + 1)) == 4
    store.update_endpoint("metered", {"rate": None}, now_ms=T0 + 2)
    assert len(claim(store, T0 + 2)) == 14


def test_a_disabled_endpoint_keeps_its_deliveries_and_they_wait(store):
    store.add_endpoint(endpoint("a", enabled=False), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    enqueue(store, message("m1"))  # a disabled endpoint still subscribes: nothing is lost
    assert ids(claim(store, T0)) == ["m1@b"]
    store.update_endpoint("a", {"enabled": True}, now_ms=T0 + 1, actor="ops")
    assert ids(claim(store, T0 + 2)) == ["m1@a"]


def test_a_claim_takes_the_endpoints_it_is_named_for_only(store):
    for name in ("a", "b", "c"):
        store.add_endpoint(endpoint(name), now_ms=T0)
    enqueue(store, message("m1"), message("m2"))
    assert sorted(ids(claim(store, T0, endpoints=("b",)))) == ["m1@b", "m2@b"]
    assert sorted(ids(claim(store, T0, endpoints=("a", "c")))) == ["m1@a", "m1@c", "m2@a",
                                                                   "m2@c"]
    with pytest.raises(ValueError):
        claim(store, T0, endpoints=())


def test_a_small_endpoint_is_served_beside_a_large_backlog(store):
    """Fair: B's ten deliveries, enqueued after A's five hundred, are served
    in turn with A's, not after them."""
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b", types=("b.only",)), now_ms=T0)
    enqueue(store, *(message(f"a{i}", "a.only") for i in range(500)))
    now = T0
    for _ in range(5):  # A has been served a while: its ranks moved on
        now += 1
        done(store, claim(store, now, limit=8), now)
    enqueue(store, *(message(f"b{i}", "b.only") for i in range(10)), now=now)
    served: list[str] = []
    for _ in range(3):
        now += 1
        leased = claim(store, now, limit=8)
        served += [job_.endpoint for job_ in leased]
        done(store, leased, now)
    assert served.count("b") == 10, served
    assert served.count("a") >= 10  # and A was not stopped either


def test_an_endpoint_back_from_idle_does_not_jump_the_line(store):
    """Start-time fair queuing: a new backlog starts at the ranks served now,
    not at its endpoint's old small ranks, so the two backlogs take turns."""
    store.add_endpoint(endpoint("a", types=("a.only",)), now_ms=T0)
    store.add_endpoint(endpoint("b", types=("b.only",)), now_ms=T0)
    enqueue(store, *(message(f"a{i}", "a.only") for i in range(500)))
    now = T0
    for _ in range(10):
        now += 1
        done(store, claim(store, now, limit=8), now)
    enqueue(store, *(message(f"b{i}", "b.only") for i in range(100)), now=now)
    for _ in range(4):
        now += 1
        leased = claim(store, now, limit=8)
        assert by_endpoint(leased) == {"a": 4, "b": 4}
        done(store, leased, now)


def test_a_backlog_that_may_not_be_sent_never_holds_back_the_others(store):
    """An endpoint at its cap and a disabled one, each with thousands waiting
    in front, leave every claim to the healthy one's deliveries."""
    store.add_endpoint(endpoint("capped", types=("c",), max_in_flight=8), now_ms=T0)
    store.add_endpoint(endpoint("off", types=("o",), enabled=False), now_ms=T0)
    store.add_endpoint(endpoint("healthy", types=("h",)), now_ms=T0)
    enqueue(store, *(message(f"c{i}", "c") for i in range(2000)))
    enqueue(store, *(message(f"o{i}", "o") for i in range(2000)))
    enqueue(store, *(message(f"h{i}", "h") for i in range(600)), now=T0 + 1)
    now, served = T0 + 1, 0
    for _ in range(12):
        now += 1
        leased = claim(store, now, limit=64)
        healthy = [job_ for job_ in leased if job_.endpoint == "healthy"]
        assert len(healthy) == min(64 - (8 if now == T0 + 2 else 0), 600 - served)
        served += len(healthy)
        done(store, healthy, now)
    assert served == 600


def test_an_endpoint_back_from_a_long_block_gets_its_turn_and_no_more(store):
    store.add_endpoint(endpoint("big", types=("b",)), now_ms=T0)
    store.add_endpoint(endpoint("steady", types=("s",)), now_ms=T0)
    enqueue(store, *(message(f"b{i}", "b") for i in range(500)))
    store.update_endpoint("big", {"enabled": False}, now_ms=T0)
    enqueue(store, *(message(f"s{i}", "s") for i in range(500)))
    now = T0
    for _ in range(20):  # a while without "big": its deliveries wait
        now += 1
        leased = claim(store, now, limit=8)
        assert by_endpoint(leased) == {"steady": 8}
        done(store, leased, now)
    store.update_endpoint("big", {"enabled": True}, now_ms=now)
    for _ in range(10):
        now += 1
        leased = claim(store, now, limit=8)
        assert by_endpoint(leased) == {"big": 4, "steady": 4}
        done(store, leased, now)


def test_a_claim_shares_itself_among_the_endpoints_it_examines_in_turns(store):
    """Endpoints without limits, each with more than a claim takes: each
    claim examines the first endpoints of the rotation (rotation_batch) and
    leases of each its turns of the claim (turns of equal shares: the
    quotient, one more for the first ones), whatever the limit; with one
    capped endpoint among them, the same rule with its room."""
    names = [f"e{i:02d}" for i in range(20)]
    for name in names:
        store.add_endpoint(endpoint(name, types=(name,)), now_ms=T0)
    enqueue(store, *(message(f"{name}-{i}", name) for name in names for i in range(60)))
    served = dict.fromkeys(names, 0)

    def rotation() -> list[str]:  # the least recently served first, then by name
        return sorted(names, key=lambda name: (served[name], name))

    def examine(limit: int, now: int) -> list[str]:
        examined = rotation()[:rotation_batch(limit)]
        served.update(dict.fromkeys(examined, now))
        return examined

    now = T0
    for limit in (1, 5, 8, 13, 64, 100, 7):
        now += 1
        examined = examine(limit, now)
        wanted = turns(shares(dict.fromkeys(examined, MAX_IN_FLIGHT), limit), limit)
        leased = claim(store, now, limit=limit)
        assert by_endpoint(leased) == {name: n for name, n in wanted.items() if n}, limit
        done(store, leased, now)
    now += 1
    capped = rotation()[1]
    store.update_endpoint(capped, {"max_in_flight": 1}, now_ms=now)
    examined = examine(13, now)
    rooms = {name: 1 if name == capped else MAX_IN_FLIGHT for name in examined}
    wanted = turns(shares(rooms, 13), 13)
    leased = claim(store, now, limit=13)
    assert by_endpoint(leased) == {name: n for name, n in wanted.items() if n}
    assert by_endpoint(leased)[capped] == 1 and len(leased) == 13


def test_endpoints_at_their_cap_in_front_do_not_leave_a_claim_empty(store):
    store.add_endpoint(endpoint("capped", max_in_flight=1), now_ms=T0)
    store.add_endpoint(endpoint("open", types=("open",)), now_ms=T0)
    enqueue(store, *(message(f"c{i}") for i in range(600)))  # only "capped" gets untyped ones
    enqueue(store, *(message(f"o{i}", "open") for i in range(3)))
    assert by_endpoint(claim(store, T0, limit=10)) == {"capped": 1, "open": 3}


# ----------------------------------------------------------------- the operator


def test_secrets_and_header_values_are_never_read_back(store):
    store.add_endpoint(endpoint("a", secrets=(SECRET,), headers=(("Authorization",
                                                                   HEADER_VALUE),)),
                       now_ms=T0, note="customer 7", actor="ops")
    store.update_endpoint("a", {"secrets": (SECRET, new_secret(random=b"t" * 32))},
                          now_ms=T0 + 1, actor="ops")
    enqueue(store, message("m1"))
    shown = repr([store.endpoints(), store.endpoint_stats(), store.endpoint_audit(),
                  store.endpoint_configs(), history(store, "m1@a")])
    assert SECRET not in shown and HEADER_VALUE not in shown and "whsec_" not in shown
    [public] = store.endpoints()
    assert (public["secrets"], public["headers"]) == (2, ["Authorization"])
    [config] = store.endpoint_configs()
    assert config.secrets[0] == SECRET and config.headers == (("Authorization", HEADER_VALUE),)


def test_every_change_is_audited_with_its_fields_never_their_values(store):
    store.add_endpoint(endpoint("a"), now_ms=T0, note="new customer", actor="alice")
    store.update_endpoint("a", {"max_in_flight": 4, "secrets": (SECRET,)}, now_ms=T0 + 1,
                          actor="bob")
    store.update_endpoint("a", {"enabled": False}, now_ms=T0 + 2, note="down", actor="carol")
    store.update_endpoint("a", {"enabled": True}, now_ms=T0 + 3, actor="carol")
    store.remove_endpoint("a", now_ms=T0 + 4, note="churned", actor="dave")
    audit = store.endpoint_audit("a")
    assert [(row["action"], row["fields"], row["note"], row["actor"], row["at_ms"])
            for row in audit] == [
        ("add", [], "new customer", "alice", T0),
        ("update", ["max_in_flight", "secrets"], None, "bob", T0 + 1),
        ("disable", ["enabled"], "down", "carol", T0 + 2),
        ("enable", ["enabled"], None, "carol", T0 + 3),
        ("remove", [], "churned", "dave", T0 + 4),
    ]
    assert store.endpoints() == []


def test_bad_changes_are_refused_whole(store):
    store.add_endpoint(endpoint("a", max_in_flight=2), now_ms=T0)
    with pytest.raises(EndpointError, match="exists"):
        store.add_endpoint(endpoint("a"), now_ms=T0)
    with pytest.raises(EndpointError, match="no endpoint named 'zz'"):
        store.update_endpoint("zz", {"enabled": False}, now_ms=T0)
    with pytest.raises(ValueError, match="plain http"):
        store.update_endpoint("a", {"url": "http://example.com/hook"}, now_ms=T0)
    with pytest.raises(ValueError, match="cannot change name"):
        store.update_endpoint("a", {"name": "b"}, now_ms=T0)
    with pytest.raises(ValueError, match="max_in_flight"):
        store.update_endpoint("a", {"max_in_flight": 0}, now_ms=T0)
    [shown] = store.endpoints()
    assert (shown["url"], shown["max_in_flight"]) == (URL, 2)
    assert [row["action"] for row in store.endpoint_audit()] == ["add"]


def test_removing_an_endpoint_with_live_deliveries_is_refused_or_cancels_them(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    enqueue(store, message("m1"), message("m2"))
    [leased] = claim(store, T0, limit=1, endpoints=("a",))
    with pytest.raises(EndpointError, match="2 deliveries still to send"):
        store.remove_endpoint("a", now_ms=T0 + 1)
    with pytest.raises(EndpointError, match="on the wire"):
        store.remove_endpoint("a", cancel_live=True, now_ms=T0 + 1)
    done(store, [leased], T0 + 2)
    assert store.remove_endpoint("a", cancel_live=True, note="gone", actor="ops",
                                 now_ms=T0 + 3) == 1
    cancelled = job(store, "m2@a") if leased.ticket["id"] == "m1@a" else job(store, "m1@a")
    assert (cancelled["status"], cancelled["reason"]) == ("dead", "cancelled")
    [cancel] = history(store, cancelled["id"])["cancels"]
    assert (cancel["note"], cancel["actor"]) == ("gone", "ops")
    assert [row["name"] for row in store.endpoints()] == ["b"]
    assert sorted(ids(claim(store, T0 + 4))) == ["m1@b", "m2@b"]


def test_stats_per_endpoint(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b", types=("only.b",)), now_ms=T0)
    enqueue(store, message("m1"), message("m2"), message("m3"))
    [one, two, three] = sorted(claim(store, T0, endpoints=("a",)), key=lambda j: j.ticket["id"])
    store.finish_jobs([(one.ticket, "ok", 0, Attempt(T0, 5, 200)),
                       (two.ticket, "retry", 1_000, Attempt(T0, 5, 503, "HTTP 503")),
                       (three.ticket, "permanent", 0, Attempt(T0, 5, 410, "gone"))],
                      now_ms=T0 + 10)
    stats = {row["name"]: row for row in store.endpoint_stats()}
    a = stats["a"]
    assert (a["ready"], a["in_flight"], a["done"], a["dead"], a["retried"]) == (1, 0, 1, 1, 1)
    assert a["dead_by_reason"] == {"permanent": 1} and stats["b"]["dead_by_reason"] == {}
    assert a["last_success_ms"] == T0 + 10
    assert a["last_error"]["at_ms"] == T0 + 10 and a["last_error"]["http_status"] in (503, 410)
    assert (stats["b"]["ready"], stats["b"]["last_error"], stats["b"]["last_success_ms"]) == (
        0, None, None)
    assert "secrets" in a and "types" in a


def test_idle_is_judged_by_what_a_claim_serves(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b", enabled=False), now_ms=T0)
    enqueue(store, message("m1"))
    store.remove_endpoint("a", cancel_live=True, now_ms=T0)  # m1@a cancelled
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.enqueue_events([message("own")], POLICY, now_ms=T0)  # fans out: a queue with
    assert not store.is_idle_for("*")                          # endpoints has no own jobs
    assert store.is_idle_for(("b",))  # its delivery waits for an operator: idle
    assert store.is_idle_for(None)  # no job of the queue's own
    done(store, claim(store, T0), T0 + 1)
    assert store.is_idle_for("*") and store.is_idle_for(("a",)) and not store.is_idle()


def test_an_endpoint_whose_ca_file_is_gone_can_be_given_another_or_removed(store, tmp_path):
    import trustme
    ca = trustme.CA()
    first, second = tmp_path / "first.pem", tmp_path / "second.pem"
    ca.cert_pem.write_to_path(str(first))
    ca.cert_pem.write_to_path(str(second))
    store.add_endpoint(Endpoint("tls", "https://127.0.0.1:9/hook", ca_file=str(first)),
                       now_ms=T0)
    first.unlink()
    with pytest.raises(EndpointError, match="'tls'"):
        store.endpoint_configs()
    store.update_endpoint("tls", {"ca_file": str(second)}, now_ms=T0 + 1)
    assert store.endpoint_configs()[0].ca_file == str(second)
    second.unlink()
    store.remove_endpoint("tls", now_ms=T0 + 2)
    assert store.endpoints() == []


def test_one_endpoints_deliveries_listed_and_its_dead_letters(store):
    store.add_endpoint(endpoint("a"), now_ms=T0)
    store.add_endpoint(endpoint("b"), now_ms=T0)
    enqueue(store, message("m1"), message("m2"))
    leased = claim(store, T0, endpoints=("a",))
    store.finish_jobs([(leased[0].ticket, "permanent", 0, Attempt(T0, 1, 410, "gone"))],
                      now_ms=T0 + 1)
    assert [row["id"] for row in store.list_jobs(endpoint="a")] == ["m1@a", "m2@a"]
    assert [row["id"] for row in store.list_jobs(endpoint="b", status="pending")] == [
        "m1@b", "m2@b"]
    assert [row["id"] for row in store.dead_jobs(endpoint="a")] == [leased[0].ticket["id"]]
    assert store.dead_jobs(endpoint="b") == [] and store.list_jobs(endpoint="zz") == []
    with pytest.raises(ValueError, match="endpoint"):
        store.list_jobs(endpoint="not an endpoint")
