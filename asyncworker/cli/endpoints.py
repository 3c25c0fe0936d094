"""``endpoint add|list|show|update|disable|enable|remove``: a queue's endpoints,
changed through ``asyncworker.operations`` (what the operator's page calls
too), each change one transaction with its audit row. Secrets and header
values come from files, never from the command line (any user's ``ps`` shows
it), and no line printed shows one."""

from __future__ import annotations

import argparse
import json
from contextlib import closing
from typing import Any

from asyncworker.cli.exits import EXIT_OK
from asyncworker.cli.output import cell, print_table
from asyncworker.operations import (
    UsageError,
    add_endpoint,
    endpoint_list,
    endpoint_record,
    new_endpoint,
    open_queue_store,
    read_header_file,
    read_secret_texts,
    remove_endpoint,
    set_endpoint_enabled,
    shown,
    update_endpoint,
    when,
)

# How the command line names an endpoint's fields in its messages.
FLAGS = {"name": "NAME", "url": "URL", "ack": "--ack", "ca_file": "--ca-file",
         "secrets": "--secret-file", "headers": "--header-file", "types": "--type",
         "max_in_flight": "--max-in-flight", "rate": "--rate", "burst": "--burst",
         "insecure_http": "--insecure-plain-http", "enabled": "--disabled", "note": "--note",
         "actor": "--actor"}


def _files(args: argparse.Namespace) -> dict[str, Any]:
    """The secrets and headers files read and checked: before any queue is opened."""
    fields: dict[str, Any] = {}
    if args.secret_file is not None:
        fields["secrets"] = read_secret_texts(args.secret_file)
    if args.header_file is not None:
        fields["headers"] = read_header_file(args.header_file)
    return fields


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if args.burst is not None and args.rate is None:
        raise UsageError("--burst goes with --rate (a new rate, with update)")
    for field in ("ack", "ca_file", "max_in_flight", "rate", "burst"):
        if getattr(args, field) is not None:
            fields[field] = getattr(args, field)
    if args.types is not None:
        fields["types"] = tuple(args.types)
    if args.insecure_plain_http:
        fields["insecure_http"] = True
    return fields


def add(args: argparse.Namespace) -> int:
    fields = {"name": args.name, "url": args.url, **_limits(args), **_files(args)}
    if args.disabled:
        fields["enabled"] = False
    endpoint = new_endpoint(fields, FLAGS)  # checked whole, before the queue is opened
    with closing(open_queue_store(args.queue)) as store:
        add_endpoint(store, endpoint, note=args.note, actor=args.actor)
    state = "disabled: its deliveries wait until it is enabled" if not endpoint.enabled \
        else "enabled"
    print(f"added endpoint {endpoint.name} to {shown(args.queue)}: {endpoint.url} "
          f"(types {', '.join(endpoint.types)}; {_signed(len(endpoint.secrets))}; "
          f"{_limits_text(endpoint.max_in_flight, endpoint.rate, endpoint.burst)}; {state})")
    return EXIT_OK


def update(args: argparse.Namespace) -> int:
    changes = _limits(args)
    for flag, field, cleared in (("--clear-ca-file", "ca_file", None),
                                 ("--clear-secrets", "secrets", ()),
                                 ("--clear-headers", "headers", ()),
                                 ("--clear-max-in-flight", "max_in_flight", None),
                                 ("--clear-rate", "rate", None)):
        if getattr(args, flag[2:].replace("-", "_")):
            if field in changes or (field == "secrets" and args.secret_file is not None) or (
                    field == "headers" and args.header_file is not None):
                raise UsageError(f"{flag} goes without a new value for it")
            changes[field] = cleared
    if args.clear_rate and args.burst is not None:
        raise UsageError("--clear-rate goes without --burst (no rate, no burst)")
    if args.secure_only:
        if args.insecure_plain_http:
            raise UsageError("--secure-only and --insecure-plain-http say the opposite")
        changes["insecure_http"] = False
    if args.url is not None:
        changes["url"] = args.url
    if args.enabled is not None:
        changes["enabled"] = args.enabled
    changes.update(_files(args))
    if not changes:
        raise UsageError("nothing to change: give at least one of update's options")
    with closing(open_queue_store(args.queue)) as store:
        endpoint = update_endpoint(store, args.name, changes, note=args.note, actor=args.actor,
                                   names=FLAGS)
    print(f"updated endpoint {endpoint.name} in {shown(args.queue)}: "
          f"{', '.join(sorted(changes))}")
    return EXIT_OK


def disable(args: argparse.Namespace) -> int:
    return _enabled(args, False)


def enable(args: argparse.Namespace) -> int:
    return _enabled(args, True)


def _enabled(args: argparse.Namespace, enabled: bool) -> int:
    with closing(open_queue_store(args.queue)) as store:
        set_endpoint_enabled(store, args.name, enabled, note=args.note, actor=args.actor)
    print(f"enabled endpoint {args.name}: its deliveries are claimed again" if enabled else
          f"disabled endpoint {args.name}: its deliveries are kept and wait until it is "
          f"enabled")
    return EXIT_OK


def remove(args: argparse.Namespace) -> int:
    if args.cancel_deliveries and args.note is None:
        raise UsageError("--cancel-deliveries needs --note: each cancelled delivery gets an "
                         "audit row")
    with closing(open_queue_store(args.queue)) as store:
        cancelled = remove_endpoint(store, args.name, cancel_deliveries=args.cancel_deliveries,
                                    note=args.note, actor=args.actor,
                                    cancel_named="--cancel-deliveries --note NOTE")
    more = f", {cancelled} pending {'delivery' if cancelled == 1 else 'deliveries'} " \
           f"cancelled" if args.cancel_deliveries else ""
    print(f"removed endpoint {args.name} from {shown(args.queue)}{more}")
    return EXIT_OK


# ------------------------------------------------------------------ reads


def list_(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        rows = endpoint_list(store)
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return EXIT_OK
    if rows:
        print_table([("name", "enabled", "url", "types", "limits", "signed", "headers")] + [
            (row["name"], "yes" if row["enabled"] else "no", cell(row["url"]),
             cell(",".join(row["types"])),
             _limits_text(row["max_in_flight"], row["rate"], row["burst"]),
             _signed(row["secrets"]), cell(",".join(row["headers"]) or None))
            for row in rows])
    print(f"{len(rows)} endpoint{'' if len(rows) == 1 else 's'}")
    return EXIT_OK


def show(args: argparse.Namespace) -> int:
    with closing(open_queue_store(args.queue, read_only=True)) as store:
        record = endpoint_record(store, args.name)
    if args.json:
        print(json.dumps(record, indent=2, ensure_ascii=False))
        return EXIT_OK
    print_table(endpoint_rows(record))
    audit = record["audit"]
    print(f"\naudit: {len(audit) or 'none'}")
    if audit:
        print_table([("at", "action", "fields", "note", "actor")] + [
            (when(row["at_ms"]), row["action"], cell(",".join(row["fields"] or ()) or None),
             cell(row["note"], 80), cell(row["actor"])) for row in audit])
    return EXIT_OK


def endpoint_rows(record: dict) -> list[tuple]:
    """An endpoint's public fields and its figures, as name/value rows."""
    rows: list[tuple] = [
        ("name", record["name"]),
        ("url", cell(record["url"], 100)),
        ("enabled", "yes" if record["enabled"] else "no: its deliveries wait"),
        ("types", ", ".join(record["types"])),
        ("ack", record["ack"]),
        ("ca file", cell(record["ca_file"], 100)),
        ("signed", _signed(record["secrets"])),
        ("headers", cell(", ".join(record["headers"]) or None, 100)),
        ("limits", _limits_text(record["max_in_flight"], record["rate"], record["burst"])),
        ("plain http", "allowed (--insecure-plain-http)" if record["insecure_http"] else "-"),
    ]
    for key, label in (("created_ms", "created"), ("updated_ms", "updated")):
        if key in record:
            rows.append((label, when(record[key])))
    rows += [(label, record[key]) for key, label in FIGURES if key in record]
    if "last_success_ms" in record:
        rows.append(("last success", when(record["last_success_ms"])))
    if "last_error" in record:
        rows.append(("last error", last_error_text(record["last_error"])))
    return rows


FIGURES = (("ready", "ready"), ("in_flight", "in flight"), ("done", "done"),
           ("retried", "retried"), ("dead", "dead"))


def endpoint_stats_rows(figures: list[dict]) -> list[tuple]:
    """stats' table of endpoints: a row each, its figures, last success and error."""
    return [("endpoint", "enabled", *(label for _, label in FIGURES), "last success",
             "last error")] + [
        (row["name"], "yes" if row.get("enabled", True) else "no",
         *(row.get(key, "-") for key, _ in FIGURES), when(row.get("last_success_ms")),
         last_error_text(row.get("last_error"), 60)) for row in figures]


def last_error_text(error: dict | None, width: int = 100) -> str:
    """An endpoint's last error: when, the HTTP status or the error's words."""
    if not error:
        return "-"
    seen = error.get("error") or (f"HTTP {error['http_status']}"
                                  if error.get("http_status") is not None else "?")
    return cell(f"{when(error.get('at_ms'))} {seen}", width)


def _signed(secrets: int) -> str:
    return f"signed with {secrets} secret{'' if secrets == 1 else 's'}" if secrets \
        else "unsigned"


def _limits_text(max_in_flight: int | None, rate: float | None, burst: int | None) -> str:
    parts = []
    if max_in_flight is not None:
        parts.append(f"at most {max_in_flight} in flight")
    if rate is not None:
        parts.append(f"{rate:g}/s (burst {burst})")
    return ", ".join(parts) or "none"


HANDLERS = {"add": add, "list": list_, "show": show, "update": update, "disable": disable,
            "enable": enable, "remove": remove}
