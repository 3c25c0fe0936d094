"""The circuit breaker per endpoint, on every store: opened by the finishes,
honoured by every claim of every connection, one probe when half-open, the
waiting deliveries due at once when it closes, Retry-After pausing the
endpoint, and an automatic disable that loses nothing."""

from __future__ import annotations

from lease.breaker import BREAKER
from lease.endpoints import Endpoint
from lease.policy import RetryPolicy
from lease.records import Attempt
from tests.conformance.helpers import body_event, job
from tests.support.queues import T0

URL = "http://127.0.0.1:9/events"
POLICY = RetryPolicy(max_attempts=50, ttl_ms=30 * 86_400_000)
REFUSED = Attempt(T0, 3, None, "connection refused by 127.0.0.1:9")
COOL = BREAKER.cooldown_ms


def setup(store, n: int = 20, **fields) -> None:
    store.add_endpoint(Endpoint("down", URL, types=("d",), **fields), now_ms=T0)
    store.add_endpoint(Endpoint("up", URL, types=("u",)), now_ms=T0)
    store.enqueue_events([{**body_event(f"d{i}", n=i), "type": "d"} for i in range(n)]
                         + [{**body_event(f"u{i}", n=i), "type": "u"} for i in range(n)],
                         POLICY, now_ms=T0)


def claim(store, now: int, limit: int = 100, endpoints="*") -> list:
    return store.claim_jobs("w1", 30_000, limit, now_ms=now, endpoints=endpoints).leased


def fail(store, leased: list, now: int, attempt: Attempt = REFUSED, delay: int = 60_000,
         outcome: str = "retry") -> None:
    store.finish_jobs([(job_.ticket, outcome, delay, attempt._replace(started_ms=now))
                       for job_ in leased], now_ms=now)


def deliver(store, leased: list, now: int) -> None:
    store.finish_jobs([(job_.ticket, "ok", 0, Attempt(now, 3, 200)) for job_ in leased],
                      now_ms=now)


def circuit(store, name: str = "down") -> dict:
    return {row["name"]: row for row in store.endpoints()}[name]["circuit"]


def attempts_spent(store, prefix: str) -> int:
    return sum(row["attempts"] for status in ("pending", "leased", "done", "dead")
               for row in store.jobs_with_status(status) if row["id"].startswith(prefix))


def open_it(store, now: int = T0) -> int:
    """Five failures in a row: the circuit opens. The time it opened."""
    leased = claim(store, now, limit=5, endpoints=("down",))
    assert len(leased) == 5
    fail(store, leased, now + 1)
    return now + 1


def test_five_failures_in_a_row_open_it_and_then_no_attempt_is_spent(store):
    setup(store)
    opened = open_it(store)
    state = circuit(store)
    assert (state["state"], state["since_ms"], state["open_until_ms"]) == (
        "open", opened, opened + COOL)
    assert "5 failures in a row" in state["why"] and "connection refused" in state["why"]
    spent = attempts_spent(store, "d")
    # the deliveries' backoffs end, the circuit is still open: none is claimed
    leased = claim(store, opened + COOL - 1)
    assert {job_.endpoint for job_ in leased} == {"up"}
    assert attempts_spent(store, "d") == spent == 5
    [audit] = [row for row in store.endpoint_audit("down") if row["action"] == "opened"]
    assert (audit["actor"], audit["at_ms"]) == ("breaker", opened)


def test_half_open_lets_one_probe_and_its_success_releases_the_rest_at_once(make_store):
    one, two = make_store(), make_store()
    setup(one)
    opened = open_it(one)
    probe_at = opened + COOL
    [probe] = claim(one, probe_at, endpoints=("down",))
    assert circuit(one)["state"] == "half-open"
    assert claim(two, probe_at + 1, endpoints=("down",)) == []  # one probe at a time
    deliver(one, [probe], probe_at + 2)
    state = circuit(two)
    assert (state["state"], state["failures"]) == ("closed", 0)
    # the five that failed wait out a minute's backoff no more: due now
    assert len(claim(two, probe_at + 3, endpoints=("down",))) == 19
    assert circuit(one)["attempts_saved"] >= 14  # came due while it was open


def test_a_failed_probe_opens_it_again_for_twice_as_long(store):
    setup(store)
    opened = open_it(store)
    [probe] = claim(store, opened + COOL, endpoints=("down",))
    fail(store, [probe], opened + COOL + 1)
    state = circuit(store)
    assert state["state"] == "open" and state["why"].startswith("the probe failed")
    assert state["open_until_ms"] == opened + COOL + 1 + 2 * COOL
    assert claim(store, opened + 2 * COOL, endpoints=("down",)) == []
    assert [row["action"] for row in store.endpoint_audit("down")] == [
        "add", "opened", "reopened"]


def test_a_refusal_of_one_message_is_an_answer_not_an_outage(store):
    setup(store)
    leased = claim(store, T0, limit=9, endpoints=("down",))
    for index, job_ in enumerate(leased):
        if index % 3 == 2:  # a 422 refusal between every two failures
            fail(store, [job_], T0 + 1, Attempt(T0, 1, 422, "HTTP 422"), outcome="permanent")
        else:
            fail(store, [job_], T0 + 1)
    assert circuit(store)["state"] == "closed"


def test_mostly_failing_without_five_in_a_row_opens_it_by_rate(store):
    setup(store, n=40)
    now = T0
    for _ in range(6):  # three failures, one success, again and again
        leased = claim(store, now, limit=4, endpoints=("down",))
        fail(store, leased[:3], now + 1)
        deliver(store, leased[3:], now + 1)
        now += 2
    state = circuit(store)
    assert state["state"] == "open" and "of 2" in state["why"] and "failed in 60 s" in state[
        "why"]


def test_retry_after_pauses_the_endpoint_not_only_the_delivery(store):
    setup(store)
    [first] = claim(store, T0, limit=1, endpoints=("down",))
    busy = Attempt(T0, 2, 503, "HTTP 503", retry_after_ms=30_000)
    fail(store, [first], T0 + 1, busy, delay=30_000)
    assert circuit(store)["paused_until_ms"] == T0 + 30_001
    assert claim(store, T0 + 30_000, endpoints=("down",)) == []
    leased = claim(store, T0 + 30_001, endpoints=("down",))
    assert len(leased) == 20  # the one that read it is due again too
    week = Attempt(T0, 2, 429, "HTTP 429", retry_after_ms=7 * 86_400_000)
    fail(store, leased[:1], T0 + 30_002, week, delay=3_600_000)
    # a longer wait is honoured up to the cap, never for a week
    assert circuit(store)["paused_until_ms"] == T0 + 30_002 + BREAKER.pause_cap_ms


def test_an_endpoint_failing_for_days_is_disabled_and_loses_nothing(store):
    setup(store, disable_after_ms=3_600_000)
    opened = open_it(store)
    now = opened
    while circuit(store)["state"] != "closed" and now < opened + 2 * 3_600_000:
        now = max(now, circuit(store)["open_until_ms"] or now)
        leased = claim(store, now, endpoints=("down",))
        if not leased:
            break
        fail(store, leased, now + 1)
        now += 1
    [down] = [row for row in store.endpoints() if row["name"] == "down"]
    assert down["enabled"] is False and "failing for" in down["disabled_why"]
    assert store.counts()["dead"] == 0
    assert claim(store, now + 10 * 3_600_000, endpoints=("down",)) == []
    store.update_endpoint("down", {"enabled": True}, now_ms=now + 1, actor="ops")
    [down] = [row for row in store.endpoints() if row["name"] == "down"]
    assert down["enabled"] is True and down["disabled_why"] is None
    assert job(store, "d19@down")["status"] == "pending"  # waited, in order, nothing lost


# ----------------------------------------------------------------- recovery


def test_recovery_sends_again_what_was_done_or_dead_since_a_time(store):
    setup(store, n=6)
    leased = sorted(claim(store, T0, endpoints=("down",)), key=lambda j: j.ticket["id"])
    deliver(store, leased[:2], T0 + 10)  # d0, d1 done at T0 + 10
    fail(store, leased[2:3], T0 + 20, Attempt(T0, 1, 410, "gone"), outcome="permanent")
    deliver(store, leased[3:4], T0 + 5)  # d3 done before the time asked
    since = T0 + 8
    preview = store.recover_endpoint("down", since, 60_000, "replay", dry_run=True,
                                     now_ms=T0 + 30)
    assert preview == ["d0@down", "d1@down", "d2@down"]
    assert job(store, "d0@down")["status"] == "done"  # a dry run changes nothing
    recovered = store.recover_endpoint("down", since, 60_000, "replay", ids=preview[1:],
                                       actor="ops", now_ms=T0 + 31)
    assert recovered == ["d1@down", "d2@down"]  # only the ones confirmed
    for job_id in recovered:
        row = job(store, job_id)
        assert (row["status"], row["attempts"], row["deadline"]) == ("pending", 0,
                                                                    T0 + 31 + 60_000)
    history = store.job_history("d1@down")
    assert [a["result"] for a in history["attempts"]] == ["done"]  # its delivery kept
    assert [(r["note"], r["actor"]) for r in history["redrives"]] == [("replay", "ops")]
    again = claim(store, T0 + 32, endpoints=("down",))
    assert {j.ticket["id"] for j in again} >= {"d1@down", "d2@down"}
    d1 = next(j for j in again if j.ticket["id"] == "d1@down")
    assert d1.ticket["token"] > leased[1].ticket["token"] and d1.event == leased[1].event


def test_a_thirty_day_outage_disables_at_its_time_loses_nothing_and_enable_keeps_key_order(
        store):
    """A virtual month: the endpoint refuses everything from the start. Each
    probe fails and backs its delivery off as a dispatcher's policy would
    (doubling from 1 s, at most 6 h); the endpoint is disabled at the first
    failure past the default disable_after (3 days), nothing is claimed after,
    nothing goes dead; enabled an hour before their 30-day deadline, every
    delivery is sent, each key's in intake order."""
    from lease.breaker import DISABLE_AFTER_MS

    day = 86_400_000
    month = RetryPolicy(max_attempts=50, ttl_ms=30 * day)  # the longest time to live
    outage = 30 * day - 3_600_000  # enabled an hour before their deadline
    store.add_endpoint(Endpoint("down", URL, types=("d",)), now_ms=T0)
    keys = [f"k{i % 4}" for i in range(20)]
    store.enqueue_events([{**body_event(f"d{i}", n=i), "type": "d", "key": keys[i]}
                          for i in range(20)], month, now_ms=T0)

    def next_due() -> int:  # of the first of each key's line: the ones a claim may take
        return min(row["available_at"] for row in store.jobs_with_status("pending")
                   if not row["held"])

    now, disabled_at, probes = T0, None, 0
    while now < T0 + outage:
        state = circuit(store)
        [down] = [row for row in store.endpoints() if row["name"] == "down"]
        if not down["enabled"]:
            disabled_at = disabled_at or now
            assert claim(store, now, endpoints=("down",)) == []  # never while disabled
            now += 3 * day
            continue
        now = max(now, next_due(), state.get("open_until_ms") or now)
        leased = claim(store, now, endpoints=("down",))
        assert len(leased) <= (5 if state["state"] == "closed" else 1)  # then one probe
        if state["state"] != "closed":
            probes += 1
        for one in leased:
            spent = one.ticket["attempt"]
            fail(store, [one], now + 1, delay=min(1000 * 2 ** spent, 6 * 3_600_000))
        now += 2
    assert disabled_at is not None and probes > 10
    first_failure = T0 + 1
    assert first_failure + DISABLE_AFTER_MS < disabled_at <= (
        first_failure + DISABLE_AFTER_MS + 6 * 3_600_000 + BREAKER.cooldown_cap_ms + 3 * day)
    assert store.counts()["dead"] == 0 and store.counts()["pending"] == 20  # nothing lost

    enabled = T0 + outage
    store.update_endpoint("down", {"enabled": True}, now_ms=enabled, actor="ops")
    sent: list[str] = []
    now = enabled
    while len(sent) < 20 and now < enabled + 3_000_000:
        now = max(now + 1, min(now + BREAKER.cooldown_cap_ms, next_due()))
        leased = claim(store, now, endpoints=("down",))
        deliver(store, leased, now + 1)
        sent += [one.ticket["id"].split("@")[0] for one in leased]
    assert sorted(sent, key=lambda m: int(m[1:])) == [f"d{i}" for i in range(20)]
    for key in set(keys):
        mine = [m for m in sent if keys[int(m[1:])] == key]
        assert mine == sorted(mine, key=lambda m: int(m[1:])), key  # intake order per key
