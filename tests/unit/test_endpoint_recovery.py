"""An endpoint's recovery and breaker options, the parts the command line and
the page share: the fingerprint of a recovery's set, --since and
--disable-after as parsed, and the confirmation against a store (a SQLite
file) sending exactly the set the dry run showed, or nothing."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

import pytest

from asyncworker.cli.parser import build_parser, parse_since
from asyncworker.operations import (
    RecoveryChanged,
    UsageError,
    recover_confirmed,
    recover_fingerprint,
    recover_preview,
)
from lease.endpoints import Endpoint
from lease.records import Attempt
from lease.stores import open_store

T0 = 1_800_000_000_000


def test_a_recoverys_fingerprint_is_its_endpoint_time_and_set_in_any_order():
    base = recover_fingerprint("acme", T0, ["a@acme", "b@acme"])
    assert base == recover_fingerprint("acme", T0, ["b@acme", "a@acme"])
    assert len({base, recover_fingerprint("beta", T0, ["a@acme", "b@acme"]),
                recover_fingerprint("acme", T0 + 1, ["a@acme", "b@acme"]),
                recover_fingerprint("acme", T0, ["a@acme"]),
                recover_fingerprint("acme", T0, ["a@acme", "b@acme", "c@acme"]),
                recover_fingerprint("acme", T0, [])}) == 6


@pytest.mark.parametrize(("text", "expected"), [
    ("2h", ("ago", 7_200_000)),
    ("30m", ("ago", 1_800_000)),
    ("7d", ("ago", 7 * 86_400_000)),
    ("250ms", ("ago", 250)),
    ("2027-01-15T08:00:00Z", ("at", int(datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp()
                                        * 1000))),
    ("2027-01-15T10:00:00+02:00", ("at", int(datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp()
                                             * 1000))),
    ("2027-01-15 08:00:00.250", ("at", int(datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp()
                                           * 1000) + 250)),
    ("2027-01-15", ("at", int(datetime(2027, 1, 15, tzinfo=UTC).timestamp() * 1000))),
])
def test_since_is_an_iso_time_utc_by_default_or_an_age(text: str, expected: tuple):
    assert parse_since(text) == expected


@pytest.mark.parametrize("text", ["", "2", "1700000000000", "2h ago", "yesterday", "12:00",
                                  "2027-02-30", "T08:00", "1969-12-31T00:00:00Z"])
def test_since_refuses_what_is_neither(text: str):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_since(text)


def test_the_time_a_dry_run_prints_is_taken_back_exactly():
    from asyncworker.cli.endpoints import _iso

    for ms in (T0, T0 + 1, T0 + 999, 0):
        assert parse_since(_iso(ms)) == ("at", ms)


@pytest.mark.parametrize(("text", "expected"), [
    ("never", "never"), ("1m", 60_000), ("12h", 43_200_000), ("365d", 365 * 86_400_000),
    ("90000", 90_000)])
def test_disable_after_parses(text: str, expected: object):
    args = build_parser().parse_args(["endpoint", "add", "q", "a", "http://127.0.0.1/x",
                                      "--disable-after", text])
    assert args.disable_after == expected


def test_run_keeps_the_endpoint_label_unless_told():
    parser = build_parser()
    assert parser.parse_args(["run", "q"]).endpoint_label is True
    assert parser.parse_args(["run", "q", "--no-endpoint-label"]).endpoint_label is False


# ----------------------------------------------------------------- against a store


@pytest.fixture
def store(tmp_path: Path):
    with open_store(tmp_path / "q.db", create=True) as opened:
        opened.add_endpoint(Endpoint("acme", "http://127.0.0.1:9/x"), now_ms=T0)
        opened.enqueue_events([{"id": f"m{i}", "body": {}} for i in range(4)], now_ms=T0)
        leased = opened.claim_jobs("w", 30_000, 3, now_ms=T0 + 1, endpoints="*").leased
        opened.finish_jobs([(job.ticket, "ok", 0, Attempt(T0 + 1, 2, 200)) for job in leased],
                           now_ms=T0 + 2)
        yield opened


def redrives(store) -> int:
    return store.snapshot()["redrives"]


def test_the_confirmation_sends_exactly_the_set_shown(store):
    shown = recover_preview(store, "acme", T0)
    assert shown["count"] == 3 and shown["capped"] is False
    done = recover_confirmed(store, "acme", T0, 60_000, "replay", shown["fingerprint"].upper(),
                             actor="ops")
    assert sorted(done["recovered"]) == sorted(shown["ids"]) and done["missed"] == []
    assert redrives(store) == 3
    with pytest.raises(RecoveryChanged, match="nothing sent"):  # pending now: another set
        recover_confirmed(store, "acme", T0, 60_000, "replay", shown["fingerprint"])
    assert redrives(store) == 3


def test_a_set_changed_since_is_refused_and_nothing_is_sent(store):
    shown = recover_preview(store, "acme", T0)
    [last] = store.claim_jobs("w", 30_000, 1, now_ms=T0 + 3, endpoints="*").leased
    store.finish_jobs([(last.ticket, "ok", 0, Attempt(T0 + 3, 2, 200))], now_ms=T0 + 4)
    with pytest.raises(RecoveryChanged, match=r"\(4 now"):
        recover_confirmed(store, "acme", T0, 60_000, "replay", shown["fingerprint"])
    assert redrives(store) == 0


@pytest.mark.parametrize(("note", "ttl_ms", "fingerprint", "words"), [
    (None, 60_000, "0" * 64, "needs a note"),
    ("  ", 60_000, "0" * 64, "needs a note"),
    ("n", 0, "0" * 64, "time to live"),
    ("n", 60_000, "0" * 63, "64 hexadecimal"),
    ("n", 60_000, "g" * 64, "64 hexadecimal"),
])
def test_a_bad_confirmation_is_a_usage_error_before_anything(store, note, ttl_ms, fingerprint,
                                                            words):
    with pytest.raises(UsageError, match=words):
        recover_confirmed(store, "acme", T0, ttl_ms, note, fingerprint)
    assert redrives(store) == 0
