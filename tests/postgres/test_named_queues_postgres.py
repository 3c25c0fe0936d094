"""Named queues in one PostgreSQL database: each in a schema of its own, woken
on a channel of its own, drained by its own dispatchers, listed by ``stats``;
the default queue exactly where it always was."""

from __future__ import annotations

import json

import psycopg
import pytest

from lease.postgres import PostgresStore, enqueue_in
from lease.stores import list_queues, open_store
from tests.support.commands import cli
from tests.support.servers import ReceiverProcess
from tests.support.waiting import WAIT_S

NAMES = (None, "orders", "mail")


def _schemas(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'lease%' ORDER BY nspname")]


def _make(url: str) -> None:
    for name in NAMES:
        with open_store(url, create=True, queue=name) as store:
            store.enqueue_events([{"id": f"o-{n}", "qty": n + 1} for n in range(5)])


def test_each_queue_has_its_schema_the_default_one_lease(postgres_url):
    _make(postgres_url)
    assert _schemas(postgres_url) == ["lease", "lease_mail", "lease_orders"]
    with open_store(f"{postgres_url}?queue=orders") as by_url, \
            open_store(postgres_url, queue="orders") as by_word:
        assert by_url.name == by_word.name == f"{postgres_url} queue orders"
        assert by_url.counts()["pending"] == 5


def test_a_url_and_a_keyword_naming_two_queues_are_refused(postgres_url):
    with pytest.raises(ValueError, match="two queue names"):
        PostgresStore(f"{postgres_url}?queue=orders", queue="mail")
    with pytest.raises(ValueError, match="a queue's name"):
        PostgresStore(postgres_url, queue="Orders")


def test_an_intake_notifies_its_own_queues_channel(postgres_url):
    _make(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as listening:
        for channel in ("lease_jobs", "lease_jobs_orders", "lease_jobs_mail"):
            listening.execute(f"LISTEN {channel}")
        for name in ("mail", None, "orders"):  # in this order: notifications keep commit order
            with open_store(postgres_url, queue=name) as store:
                store.enqueue_events([{"id": "new", "qty": 1}])
        heard = [note.channel for note in listening.notifies(timeout=WAIT_S, stop_after=3)]
    assert heard == ["lease_jobs_mail", "lease_jobs", "lease_jobs_orders"]


def test_one_queues_intake_never_wakes_anothers_listener(postgres_url):
    _make(postgres_url)
    with open_store(postgres_url, queue="orders") as orders, \
            open_store(postgres_url, queue="mail") as mail, \
            open_store(postgres_url) as default, \
            orders.listener() as orders_hears, mail.listener() as mail_hears:
        mail.enqueue_events([{"id": "m-new", "qty": 1}])
        default.enqueue_events([{"id": "d-new", "qty": 1}])
        assert mail_hears.wait(WAIT_S)  # delivered by now to every listener of its channel
        orders.enqueue_events([{"id": "o-new", "qty": 1}])
        assert orders_hears.wait(WAIT_S)  # its own intake...
        assert not orders_hears.wait(0)  # ...and nothing else was waiting for it
        assert not mail_hears.wait(0)


def test_enqueue_in_writes_to_the_queue_it_names_in_the_services_transaction(postgres_url):
    _make(postgres_url)
    with psycopg.connect(postgres_url) as conn:
        with conn.transaction():
            # o-0 is a duplicate in its queue, whatever the default queue holds
            assert enqueue_in(conn, [{"id": "o-0", "qty": 1}, {"id": "x", "qty": 1}],
                              queue="orders") == [False, True]
        with conn.transaction():
            assert enqueue_in(conn, [{"id": "y", "qty": 1}], queue="mail") == [True]
    with open_store(postgres_url, queue="orders") as orders, \
            open_store(postgres_url, queue="mail") as mail, open_store(postgres_url) as default:
        assert orders.counts()["pending"] == 6 and orders.job_history("x") is not None
        assert mail.counts()["pending"] == 6 and mail.job_history("x") is None
        assert default.counts()["pending"] == 5


def test_a_dispatcher_of_a_named_queue_drains_it_alone(postgres_url, tmp_path):
    _make(postgres_url)
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        out = cli("run", postgres_url, "--queue-name", "orders", "--url", rx.url,
                  "--until-idle")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ok"] == 5
    for name, done in ((None, 0), ("orders", 5), ("mail", 0)):
        with open_store(postgres_url, queue=name, read_only=True) as store:
            counts = store.counts()
            assert (counts["done"], counts["pending"]) == (done, 5 - done), name


def test_stats_lists_the_queues_and_takes_the_queues_name_from_the_environment(postgres_url):
    assert cli("init", postgres_url).returncode == 0
    out = json.loads(cli("stats", postgres_url, "--json").stdout)
    assert "queues" not in out  # a database of one queue shows what it always did
    assert cli("init", postgres_url, "--queue-name", "orders").returncode == 0
    assert cli("enqueue", postgres_url, "--id", "a", "--qty", "1",
               env={"ASYNCWORKER_QUEUE_NAME": "orders"}).returncode == 0
    named = json.loads(cli("stats", postgres_url, "--json",
                           env={"ASYNCWORKER_QUEUE_NAME": "orders"}).stdout)
    default = json.loads(cli("stats", postgres_url, "--json").stdout)
    assert (named["jobs"], default["jobs"]) == (1, 0)
    assert named["queues"] == default["queues"] == ["default", "orders"]
    text = cli("stats", postgres_url, "--queue-name", "default",
               env={"ASYNCWORKER_QUEUE_NAME": "orders"})  # the command line wins
    assert "queues" in text.stdout and "default, orders" in text.stdout
    bad = cli("stats", postgres_url, env={"ASYNCWORKER_QUEUE_NAME": "Orders!"})
    assert bad.returncode == 2 and "ASYNCWORKER_QUEUE_NAME" in bad.stderr
    assert list_queues(postgres_url) == ["default", "orders"]

