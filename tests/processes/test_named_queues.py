"""Named queues from the command line and on the page: ``--queue-name`` and
``ASYNCWORKER_QUEUE_NAME`` on a SQLite file (the queue beside it), ``stats``
and the overview listing the queues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncworker.ui import ui_app
from lease.stores import open_store
from tests.support.commands import cli


def test_a_named_queue_beside_the_file_from_the_command_line_and_the_environment(tmp_path):
    base = tmp_path / "queue.db"
    assert cli("init", str(base)).returncode == 0
    out = cli("init", str(base), "--queue-name", "orders")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "queue.orders.db").is_file()
    for events, env in (("a", {"ASYNCWORKER_QUEUE_NAME": "orders"}), ("b", {})):
        assert cli("enqueue", str(base), "--id", events, "--qty", "1", env=env).returncode == 0
    with open_store(base, queue="orders", read_only=True) as orders, \
            open_store(base, read_only=True) as default:
        assert [row["id"] for row in orders.list_jobs()] == ["a"]
        assert [row["id"] for row in default.list_jobs()] == ["b"]
    assert cli("init", str(tmp_path / "alone.db")).returncode == 0
    alone = json.loads(cli("stats", str(tmp_path / "alone.db"), "--json").stdout)
    assert "queues" not in alone  # a file with no queue beside shows what it always did
    (tmp_path / "queue.notes.db").write_text("not a queue")  # beside, but no queue: ignored
    named = json.loads(cli("stats", str(base), "--json",
                           env={"ASYNCWORKER_QUEUE_NAME": "orders"}).stdout)
    assert (named["jobs"], named["queues"]) == (1, ["default", "orders"])
    text = cli("stats", str(base), env={"ASYNCWORKER_QUEUE_NAME": "orders"})
    assert text.returncode == 0 and "default, orders" in text.stdout
    dead = cli("dead", str(base), "--queue-name", "mail")  # no such queue: its file is missing
    assert dead.returncode == 2 and "queue.mail.db" in dead.stderr


def test_a_bad_queue_name_is_a_usage_error_wherever_it_comes_from(tmp_path):
    base = tmp_path / "queue.db"
    assert cli("init", str(base)).returncode == 0
    flag = cli("stats", str(base), "--queue-name", "Orders")
    assert flag.returncode == 2 and "a queue's name" in flag.stderr
    env = cli("stats", str(base), env={"ASYNCWORKER_QUEUE_NAME": "../x"})
    assert env.returncode == 2 and "ASYNCWORKER_QUEUE_NAME" in env.stderr
    assert "../x" not in env.stderr  # as every value from the environment: not shown
    run = cli("run", str(base), "--url", "http://127.0.0.1:9/x", "--until-idle",
              env={"ASYNCWORKER_QUEUE_NAME": "a-b"})
    assert run.returncode == 2 and "ASYNCWORKER_QUEUE_NAME" in run.stderr


def test_a_toml_file_names_the_queue_of_run(tmp_path):
    base = tmp_path / "queue.db"
    assert cli("init", str(base), "--queue-name", "orders").returncode == 0
    config = tmp_path / "run.toml"
    config.write_text('queue-name = "orders"\nuntil-idle = true\n')
    out = cli("run", str(base), "--config", str(config), "--url", "http://127.0.0.1:9/x")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] == 0
    assert not base.exists()  # the default queue was never made


@pytest.fixture(params=["sqlite", "postgresql"])
def home(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "queue.db")
    return str(request.getfixturevalue("postgres_url"))


async def test_the_overview_lists_the_queues_of_its_database(home):
    open_store(home, create=True).close()
    async with TestClient(TestServer(ui_app(home))) as client:  # type: ignore[arg-type]
        alone = await client.get("/?format=json")
        assert "queues" not in await alone.json()
        assert 'id="queues"' not in await (await client.get("/")).text()
    open_store(home, create=True, queue="orders").close()
    async with TestClient(TestServer(ui_app(home))) as client:  # type: ignore[arg-type]
        assert (await (await client.get("/?format=json")).json())["queues"] == [
            "default", "orders"]
        assert "Queues in this database: default, orders" in await (await client.get("/")).text()
