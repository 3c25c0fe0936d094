"""The endpoint commands' pieces that need no queue: the secrets and headers
files (checked like every secrets file, never echoing a value), the fields
checked whole before anything opens, and the arguments each action takes."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import pytest

from asyncworker.cli.parser import build_parser
from asyncworker.operations import (
    UsageError,
    new_endpoint,
    read_header_file,
    read_secret_texts,
)

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"o" * 32).decode()
TOKEN = "Bearer tok-do-not-echo-4242"


def private(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_a_secrets_file_of_two_is_a_rotation_kept_as_texts(tmp_path: Path):
    path = private(tmp_path / "s", f"# new\n{SECRET}\n\n# old\n{OTHER}\n")
    assert read_secret_texts(path) == (SECRET, OTHER)


@pytest.mark.parametrize(("text", "words"), [
    ("", "holds no secret"),
    ("# none yet\n", "holds no secret"),
    (f"{SECRET}\nsk_live_{TOKEN}\n", "line 2"),
    ("whsec_!!\n", "line 1"),
])
def test_a_bad_secrets_file_is_one_line_without_the_secret(tmp_path: Path, text: str,
                                                           words: str):
    path = private(tmp_path / "s", text)
    with pytest.raises(UsageError) as caught:
        read_secret_texts(path)
    assert words in str(caught.value) and "--secret-file" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert TOKEN not in str(caught.value) and SECRET not in str(caught.value)


def test_a_secrets_file_every_user_may_write_is_refused(tmp_path: Path):
    path = private(tmp_path / "s", f"{SECRET}\n", 0o666)
    with pytest.raises(UsageError, match="writable by every user"):
        read_secret_texts(path)


def test_a_secrets_file_others_may_read_is_used_with_one_warning(tmp_path: Path, caplog):
    path = private(tmp_path / "s", f"{SECRET}\n", 0o644)
    with caplog.at_level(logging.WARNING):
        assert read_secret_texts(path) == (SECRET,)
    assert [r.getMessage() for r in caplog.records if "open to other users" in r.getMessage()
            ] and len(caplog.records) == 1


def test_a_headers_file_is_name_value_lines(tmp_path: Path):
    path = private(tmp_path / "h", f"# the customer's\nAuthorization: {TOKEN}\n"
                                   "X-Tenant:  acme  \n\n")
    assert read_header_file(path) == (("Authorization", TOKEN), ("X-Tenant", "acme"))
    assert read_header_file(private(tmp_path / "empty", "# none\n")) == ()


@pytest.mark.parametrize(("text", "words"), [
    (f"Authorization {TOKEN}\n", "line 1: not a 'Name: value' line"),
    (f": {TOKEN}\n", "line 1: not a 'Name: value' line"),
    (f"Bad Name: {TOKEN}\n", "line 1"),
    (f"Content-Type: {TOKEN}\n", "the sender's own"),
    (f"webhook-signature: {TOKEN}\n", "the sender's own"),
    (f"X-A: {TOKEN}\nx-a: {TOKEN}\n", "twice"),
    (f"X-A: {TOKEN}\u00e9\n", "printable ASCII"),
    ("".join(f"X-{n}: {TOKEN}\n" for n in range(21)), "at most 20"),
])
def test_a_bad_headers_file_never_shows_a_value(tmp_path: Path, text: str, words: str):
    path = private(tmp_path / "h", text)
    with pytest.raises(UsageError) as caught:
        read_header_file(path)
    message = str(caught.value)
    assert words in message and message.startswith("--header-file: ")
    assert TOKEN not in message and "tok-do-not" not in message


def test_a_headers_file_is_checked_like_a_secrets_file(tmp_path: Path):
    with pytest.raises(UsageError, match="--header-file: .* writable by every user"):
        read_header_file(private(tmp_path / "h", f"Authorization: {TOKEN}\n", 0o646))
    with pytest.raises(UsageError, match="--header-file: file not found"):
        read_header_file(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="--header-file: not a file"):
        read_header_file(str(tmp_path))
    (tmp_path / "bin").write_bytes(b"\xff\xfeX")
    (tmp_path / "bin").chmod(0o600)
    with pytest.raises(UsageError, match="not UTF-8"):
        read_header_file(str(tmp_path / "bin"))


FLAGS = {"url": "URL", "insecure_http": "--insecure-plain-http", "ca_file": "--ca-file"}


@pytest.mark.parametrize(("fields", "words"), [
    ({"url": "http://example.com/h"}, "URL: plain http only to a loopback host, got "
                                      "'example.com': use https://, or --insecure-plain-http"),
    ({"url": "ftp://example.com/h"}, "url"),
    ({"url": "http://127.0.0.1:9/h", "ca_file": "/nowhere"}, "--ca-file goes with an https:// URL"),
    ({"url": "https://example.com/h", "ca_file": "/nowhere"}, "--ca-file: file not found"),
    ({"url": "https://example.com/h", "burst": 3}, "burst needs a rate"),
    ({"url": "https://example.com/h", "types": ("*", "a.b")}, "stands alone"),
    ({"url": "https://example.com/h", "types": ("a.b", "a.b")}, "distinct"),
])
def test_an_endpoints_fields_are_checked_whole_in_the_flags_words(fields: dict, words: str):
    with pytest.raises(UsageError) as caught:
        new_endpoint({"name": "acme", **fields}, FLAGS)
    assert words in str(caught.value)


def test_plain_http_elsewhere_is_allowed_when_spelled_out():
    endpoint = new_endpoint({"name": "acme", "url": "http://example.com/h",
                             "insecure_http": True, "rate": 2.5}, FLAGS)
    assert (endpoint.insecure_http, endpoint.rate, endpoint.burst) == (True, 2.5, 3)


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_each_action_parses_its_options():
    args = parse("endpoint", "add", "q.db", "acme", "https://acme.example/h", "--type",
                 "invoice.paid", "--type", "user/created", "--max-in-flight", "4", "--rate",
                 "0.5", "--burst", "2", "--disabled", "--note", "new customer", "--actor",
                 "ops-ann")
    assert (args.command, args.action, args.name, args.types, args.max_in_flight, args.rate,
            args.burst, args.disabled, args.actor) == (
        "endpoint", "add", "acme", ["invoice.paid", "user/created"], 4, 0.5, 2, True, "ops-ann")
    args = parse("endpoint", "update", "q.db", "acme", "--clear-rate", "--enabled")
    assert (args.clear_rate, args.enabled, args.url) == (True, True, None)
    assert parse("endpoint", "update", "q.db", "acme", "--disabled").enabled is False
    assert parse("endpoint", "update", "q.db", "acme").enabled is None
    assert parse("endpoint", "remove", "q.db", "acme", "--cancel-deliveries").cancel_deliveries
    assert parse("run", "q.db", "--endpoint", "a", "--endpoint", "b").endpoints == ["a", "b"]
    assert parse("enqueue", "q.db", "--id", "x", "--qty", "1", "--type", "a.b").type == "a.b"


@pytest.mark.parametrize("argv", [
    ["endpoint", "add", "q.db", "bad name", "https://a.example/h"],
    ["endpoint", "add", "q.db", "a@b", "https://a.example/h"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--type", "a b"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--max-in-flight", "0"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--rate", "0"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--rate", "nan"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--rate", "inf"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--actor", "a\nb"],
    ["endpoint", "add", "q.db", "acme", "https://a.example/h", "--secret-value", SECRET],
    ["endpoint", "update", "q.db", "acme", "--disabled", "--enabled"],
    ["endpoint", "list"],
    ["endpoint", "frob", "q.db"],
    ["enqueue", "q.db", "--id", "x", "--qty", "1", "--type", "a b"],
    ["run", "q.db", "--endpoint", "a b"],
])
def test_bad_arguments_are_usage_errors(argv: list[str], capsys):
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
