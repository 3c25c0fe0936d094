"""The options of run, serve and ui from the environment and a TOML file:
the command line first, then the environment, then the file, then the
built-in default; every bad value an error naming its source, exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from asyncworker.cli.config import (
    CONFIGURABLE,
    configurable_actions,
    env_name,
    key_name,
    parse_arguments,
)
from asyncworker.cli.parser import build_parser


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return parse_arguments(build_parser(), argv, env or {})


def refused(capsys: pytest.CaptureFixture[str], argv: list[str],
            env: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(argv, env)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line
    return err


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "asyncworker.toml"
    path.write_text(text)
    return str(path)


def test_the_command_line_wins_over_the_environment_over_the_file(tmp_path: Path):
    config = toml(tmp_path, "lease-ms = 1000\nconcurrency = 3\njitter = 0.25\n"
                            "owner = \"from-file\"\n")
    env = {"ASYNCWORKER_CONCURRENCY": "5", "ASYNCWORKER_OWNER": "from-env"}
    args = parse(["run", "q.db", "--config", config, "--owner", "from-line"], env)
    assert (args.owner, args.concurrency, args.lease_ms, args.jitter) == (
        "from-line", 5, 1000, 0.25)
    assert args.batch_size == 64 and args.poll_ms == 50  # the built-in defaults
    assert args.queue == "q.db" and args.handler.__name__ == "run"


def test_with_nothing_configured_the_defaults_are_argparses_own():
    plain = build_parser().parse_args(["run", "q.db"])
    assert vars(parse(["run", "q.db"])) == vars(plain)
    for command in ("serve --inbox i.db", "ui q.db"):
        argv = command.split()
        assert vars(parse(argv)) == vars(build_parser().parse_args(argv))


def test_every_option_has_a_name_in_the_environment_and_in_the_file():
    """From the parser's own actions: a new option is configurable at once."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in CONFIGURABLE:
        sub = commands.choices[command]
        options = {one for a in sub._actions for one in a.option_strings
                   if one.startswith("--") and one not in ("--help", "--config")}
        assert "--config" in sub._option_string_actions, command
        actions = configurable_actions(sub)
        assert {f"--{key_name(a)}" for a in actions} == options
        assert all(env_name(a) == "ASYNCWORKER_" + key_name(a).upper().replace("-", "_")
                   for a in actions)
    assert env_name(next(a for a in commands.choices["run"]._actions
                         if a.dest == "endpoint_label")) == "ASYNCWORKER_NO_ENDPOINT_LABEL"


def test_flags_from_the_environment_and_the_file(tmp_path: Path):
    for word, expected in (("1", True), ("yes", True), ("ON", True), ("false", False),
                           ("0", False)):
        assert parse(["run", "q", "--url", "http://127.0.0.1/x"],
                     {"ASYNCWORKER_UNTIL_IDLE": word}).until_idle is expected
    # a store_false flag: --no-endpoint-label = true turns the label off
    config = toml(tmp_path, "no-endpoint-label = true\nuntil-idle = true\n")
    args = parse(["run", "q", "--config", config])
    assert args.endpoint_label is False and args.until_idle is True
    args = parse(["run", "q", "--config", config], {"ASYNCWORKER_UNTIL_IDLE": "no"})
    assert args.until_idle is False


def test_repeatable_options_from_the_environment_and_the_file(tmp_path: Path):
    env = {"ASYNCWORKER_ENDPOINT": "acme, audit"}
    assert parse(["run", "q"], env).endpoints == ["acme", "audit"]
    config = toml(tmp_path, "[ui]\nallowed-host = [\"ops.internal\", \"ops:8443\"]\n")
    assert parse(["ui", "q", "--config", config]).allowed_host == ["ops.internal", "ops:8443"]
    # the command line replaces them, it does not add to them
    assert parse(["run", "q", "--endpoint", "crm"], env).endpoints == ["crm"]
    assert parse(["ui", "q", "--config", config, "--allowed-host", "a"]).allowed_host == ["a"]
    assert parse(["ui", "q"]).allowed_host == []


def test_tables_per_command_and_the_config_file_from_the_environment(tmp_path: Path):
    config = toml(tmp_path, "log-level = \"debug\"\n"
                            "[run]\nconcurrency = 7\n"
                            "[serve]\ninbox = \"/var/lib/inbox.db\"\nport = 8081\n"
                            "[ui]\nport = 9000\n")
    env = {"ASYNCWORKER_CONFIG": config}
    run = parse(["run", "q"], env)
    assert (run.concurrency, run.log_level) == (7, "debug")
    serve = parse(["serve"], env)  # --inbox, required, given by the file
    assert (serve.inbox, serve.port, serve.log_level) == ("/var/lib/inbox.db", 8081, "debug")
    assert parse(["ui", "q"], env).port == 9000


def test_a_required_option_missing_everywhere_is_still_refused(capsys):
    err = refused(capsys, ["serve"])
    assert "--inbox" in err


def test_unknown_keys_and_wrong_types_name_their_source(tmp_path: Path, capsys):
    config = toml(tmp_path, "leas-ms = 10\n")
    err = refused(capsys, ["run", "q", "--config", config])
    assert f"{config}: leas-ms: not an option of run (did you mean lease-ms?)" in err
    assert err.startswith("asyncworker run: error: ")

    config = toml(tmp_path, "[serve]\nlease-ms = 10\n")  # another command's table: checked
    err = refused(capsys, ["run", "q", "--config", config])
    assert "[serve] lease-ms: not an option of serve" in err

    config = toml(tmp_path, "queue = \"q.db\"\n")
    assert "QUEUE goes on the command line" in refused(capsys, ["run", "--config", config])

    err = refused(capsys, ["run", "q", "--config", toml(tmp_path, "[run]\nlease-ms = 0\n")])
    assert f"{tmp_path}/asyncworker.toml: [run] lease-ms: must be in 1..3600000, got " in err

    for text, words in (("lease-ms = true", "not a boolean"),
                        ("lease-ms = [1]", "not a TOML list"),
                        ("lease-ms = 0", "asyncworker.toml: lease-ms: must be in 1..3600000"),
                        ("concurrency = 1.5", "not an integer"),
                        ("until-idle = \"yes\"", "a flag is true or false"),
                        ("endpoint = \"acme\"", "a repeatable option is an array"),
                        ("loop = \"trio\"", "must be one of auto, asyncio, uvloop"),
                        ("run = 3", "a table of run's options")):
        err = refused(capsys, ["run", "q", "--config", toml(tmp_path, text)])
        assert f"{tmp_path}" in err and words in err, (text, err)

    err = refused(capsys, ["run", "q", "--config", toml(tmp_path, "lease-ms = = 3")])
    assert "not TOML" in err and "line 1" in err
    err = refused(capsys, ["run", "q", "--config", str(tmp_path / "missing.toml")])
    assert "missing.toml: No such file or directory" in err


def test_bad_environment_values_name_the_variable(capsys):
    cases = (({"ASYNCWORKER_UNTIL_IDLE": "maybe"}, "ASYNCWORKER_UNTIL_IDLE: a flag is one of"),
             ({"ASYNCWORKER_LEASE_MS": "soon"}, "ASYNCWORKER_LEASE_MS: not an integer"),
             ({"ASYNCWORKER_ENDPOINT": "acme,,audit"},
              "ASYNCWORKER_ENDPOINT: values separated by ','"),
             ({"ASYNCWORKER_ENDPOINT": "acme,bad name"}, "ASYNCWORKER_ENDPOINT: an endpoint's"),
             ({"ASYNCWORKER_LOG_FORMAT": "xml"}, "ASYNCWORKER_LOG_FORMAT: must be one of"))
    for env, words in cases:
        assert words in refused(capsys, ["run", "q"], env)


def test_errors_never_show_the_value_given(capsys, tmp_path: Path):
    secret = "hunter2-very-secret-words-" * 4  # long: the types cut a quoted value short
    for env in ({"ASYNCWORKER_OWNER": secret}, {"ASYNCWORKER_LEASE_MS": secret},
                {"ASYNCWORKER_ENDPOINT": f"ok,{secret}"}):
        err = refused(capsys, ["run", "q"], env)
        assert "hunter2" not in err and "(the value, not shown)" in err, err
    # a number out of range, named as the rule's "got N"
    err = refused(capsys, ["run", "q"], {"ASYNCWORKER_LEASE_MS": "99999999"})
    assert "99999999" not in err and "got (the value, not shown)" in err, err
    err = refused(capsys, ["run", "q"], {"ASYNCWORKER_JITTER": "7.5"})
    assert "7.5" not in err and "must be in 0..1" in err, err
    err = refused(capsys, ["run", "q", "--config", toml(tmp_path, f"owner = \"{secret}\"")])
    assert "hunter2" not in err


def test_variables_of_no_option_are_ignored_and_other_commands_read_nothing(tmp_path: Path):
    env = {"ASYNCWORKER_UI_SCREENSHOT": "x.png", "ASYNCWORKER_INBOX": "elsewhere.db",
           "ASYNCWORKER_CONFIG": str(tmp_path / "missing.toml"),
           "ASYNCWORKER_JSON": "yes"}
    assert parse(["stats", "q"], env).json is False  # stats: the command line alone
    assert parse(["run", "q", "--config", toml(tmp_path, "")], env).owner is None
    # an empty variable is unset: the file's value, else the default, stands
    config = toml(tmp_path, "concurrency = 9\n")
    args = parse(["run", "q", "--config", config],
                 {"ASYNCWORKER_CONCURRENCY": "", "ASYNCWORKER_OWNER": " "})
    assert (args.concurrency, args.owner) == (9, None)


def test_help_reads_no_configuration(capsys, tmp_path: Path):
    with pytest.raises(SystemExit) as exited:
        parse(["run", "--help"], {"ASYNCWORKER_CONFIG": str(tmp_path / "missing.toml")})
    assert exited.value.code == 0
    assert "ASYNCWORKER_<OPTION>" in capsys.readouterr().out


def test_the_documented_file_and_unit_parse(tmp_path: Path):
    """docs/service.md's TOML example, for run and serve, and the unit's ExecStart."""
    import re
    import shlex

    docs = Path(__file__).resolve().parents[2] / "docs"
    [example] = re.findall(r"```toml\n(.*?)```", (docs / "service.md").read_text(), re.S)
    config = toml(tmp_path, example)
    run = parse(["run", "q", "--config", config])
    assert (run.concurrency, run.lease_ms, run.send_timeout, run.metrics, run.log_format) == (
        64, 30_000, 120_000, ("127.0.0.1", 9100), "json")
    serve = parse(["serve", "--config", config])
    assert (serve.inbox, serve.port) == ("/var/lib/asyncworker/inbox.db", 8443)

    unit = (docs / "asyncworker.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert (settings["Type"], settings["NotifyAccess"], settings["KillSignal"]) == (
        "notify", "main", "SIGTERM")
    # the drain lasts up to a lease (30 s by default): the stop timeout outlasts it
    assert int(settings["TimeoutStopSec"]) > 30
    command = shlex.split(settings["ExecStart"])
    assert command[0].endswith("/asyncworker") and command[1] == "run"
    args = parse(command[1:], {"ASYNCWORKER_CONFIG": config})
    assert args.queue.startswith(settings["ReadWritePaths"])
