"""``run`` and ``serve`` reading their options from the environment and a TOML
file, as a service manager starts them (real child processes): the command
line first, then ``ASYNCWORKER_<OPTION>``, then the file; a bad file is
exit 2, one line naming it, nothing run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.commands import cli
from tests.support.queues import job_rows
from tests.support.servers import ReceiverProcess


def test_run_takes_its_options_from_the_environment_and_the_file(queue: Path, tmp_path: Path):
    lines = "".join(json.dumps({"id": f"c-{n}", "body": {"n": n}}) + "\n" for n in range(20))
    assert cli("enqueue", str(queue), "--file", "-", stdin=lines).returncode == 0
    with ReceiverProcess(tmp_path / "inbox.db") as rx:
        config = tmp_path / "asyncworker.toml"
        config.write_text(
            "log-level = \"warning\"\n"  # every command's: run's tables below win for run
            "[run]\n"
            f"url = \"{rx.url}\"\n"
            "until-idle = true\n"
            "concurrency = 3\n"
            "lease-ms = 5000\n"
            "owner = \"from-file\"\n"
            "jitter = 0.25\n"
            "[serve]\n"
            "inbox = \"elsewhere.db\"\n")
        out = cli("run", str(queue), "--lease-ms", "7000",
                  env={"ASYNCWORKER_CONFIG": str(config), "ASYNCWORKER_OWNER": "from-env",
                       "ASYNCWORKER_CONCURRENCY": "4", "ASYNCWORKER_LOG_FORMAT": "json"},
                  timeout=60)
        applied = rx.stats()["applied"]
    assert out.returncode == 0, out.stderr  # --until-idle, from the file, ended it
    banner = next(json.loads(line) for line in out.stderr.splitlines()
                  if json.loads(line)["msg"].startswith("run: owner"))  # json, from env
    assert "owner from-env," in banner["msg"]  # the environment over the file
    assert "concurrency 4," in banner["msg"]  # the environment over the file
    assert "lease 7000 ms" in banner["msg"]  # the command line over the file
    assert "jitter 0.25" in banner["msg"]  # the file over the default
    assert f"url {rx.url}" in banner["msg"]
    summary = json.loads(out.stdout)
    assert (summary["owner"], summary["ok"], applied) == ("from-env", 20, 20)


def test_a_bad_configuration_runs_nothing(queue: Path, tmp_path: Path):
    assert cli("enqueue", str(queue), "--id", "j-1", "--body", "{}").returncode == 0
    before = job_rows(queue)
    config = tmp_path / "bad.toml"
    config.write_text("[run]\nurl = \"http://127.0.0.1:9/x\"\nlease_ms = 5000\n")
    out = cli("run", str(queue), "--config", str(config), timeout=30)
    assert out.returncode == 2
    assert out.stderr == (f"asyncworker run: error: {config}: [run] lease_ms: not an option "
                          f"of run (did you mean lease-ms?)\n")
    out = cli("run", str(queue), "--url", "http://127.0.0.1:9/x",
              env={"ASYNCWORKER_UNTIL_IDLE": "sometimes"}, timeout=30)
    assert out.returncode == 2 and "ASYNCWORKER_UNTIL_IDLE: a flag is one of" in out.stderr
    assert job_rows(queue) == before  # nothing claimed


def test_serve_takes_its_required_inbox_from_the_environment(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "receiver.toml"
    config.write_text("[serve]\npath = \"/hooks\"\ngroup = 8\n")
    monkeypatch.setenv("ASYNCWORKER_INBOX", str(tmp_path / "inbox.db"))
    monkeypatch.setenv("ASYNCWORKER_CONFIG", str(config))
    monkeypatch.setenv("ASYNCWORKER_PORT", "0")
    with ReceiverProcess(tmp_path / "unused", command=[
            sys.executable, "-m", "asyncworker", "serve"]) as rx:
        assert rx.url.endswith("/hooks")  # the path from the file
        assert rx.stats()["applied"] == 0
    assert (tmp_path / "inbox.db").exists()  # the inbox from the environment
