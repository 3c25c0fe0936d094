"""The command line's logging: one line per record, as text or as JSON.

``configure(level, fmt)`` puts one handler on the root logger (stderr). The
dispatcher logs every retry, dead job, stale finish, lost lease, bad ACK,
send error and finish failure as one record whose facts (job id, token,
owner, attempt, outcome, status, reason, HTTP status or error, retry delay,
and for a delivery its endpoint) are ``extra=`` fields: the JSON format
emits them as keys, the text format appends them as ``key=value``. Neither
ever spells a record over two lines: a traceback is a field of the JSON
object, and text shows it only at the debug level (below it, the
exception's one-line summary is the ``exc`` field).
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["FORMATS", "LEVELS", "JsonFormatter", "TextFormatter", "configure", "fields_of",
           "json_line", "current_format", "say"]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")

# Every attribute a LogRecord has of its own (3.10 .. 3.13): the rest came as extra=.
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record was given with ``extra=``, in their order."""
    return {key: value for key, value in vars(record).items()
            if key not in _RECORD_KEYS and not key.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    """ISO 8601 in UTC with milliseconds: sortable, and the same on every host."""
    moment = datetime.fromtimestamp(record.created, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _one_line(text: str) -> str:
    """Whitespace runs as one space, and every other unprintable character (a
    terminal's escape sequence in a receiver's answer, a lone surrogate) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape",
                                                       "backslashreplace").decode("ascii")
                   for c in " ".join(text.split()))


def _exception_summary(record: logging.LogRecord) -> str | None:
    if not record.exc_info or record.exc_info[1] is None:
        return None
    error = record.exc_info[1]
    return _one_line(f"{type(error).__name__}: {error}") if str(error) else type(error).__name__


class TextFormatter(logging.Formatter):
    """``TS LEVEL LOGGER message key=value ...``: one line, values quoted when
    they hold a space, a quote or an equals sign."""

    def __init__(self, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        fields = fields_of(record)
        summary = _exception_summary(record)
        if summary is not None and "exc" not in fields:
            fields["exc"] = summary
        parts = [_timestamp(record), record.levelname, record.name,
                 _one_line(record.getMessage())]
        parts += [f"{key}={_text_value(value)}" for key, value in fields.items()]
        line = " ".join(parts)
        if self.tracebacks and record.exc_info:  # debugging: the whole stack, asked for
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(value: object) -> str:
    if isinstance(value, dict):  # {"deadline": 2} -> deadline:2
        text = ",".join(f"{key}:{one}" for key, one in value.items())
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(not c.isprintable() or c.isspace() or c in "\"=" for c in text):
        return json.dumps(text)  # quoted, and every unprintable character escaped
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``, every
    ``extra=`` field as a key of its own, and ``exc`` (the traceback) if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(),
                                 "logger": record.name, "msg": record.getMessage()}
        for key, value in fields_of(record).items():
            entry.setdefault(key, value)  # a field never overwrites the four above
        if record.exc_info:
            entry["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        # ASCII: any character, a lone surrogate too, is escaped and every line writable
        return json.dumps(entry, default=str)


class _Handler(logging.StreamHandler):
    """stderr, and a closed stderr (its reader gone) does not stop the work."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ValueError)):
            return
        super().handleError(record)


_installed: logging.Handler | None = None
_format = "text"


def current_format() -> str:
    """The format ``configure`` set (text until it is called)."""
    return _format


def json_line(msg: str, logger: str, level: str = "info", **fields: Any) -> str:
    """A line the JSON format would write for a record at ``level``: for a
    command's own lines (a banner, a progress line, its error), shown whatever
    the level."""
    record = logging.LogRecord(logger, getattr(logging, level.upper()), "", 0, msg, (), None)
    record.__dict__.update(fields)
    return JsonFormatter().format(record)


def say(line: str, logger: str, level: str = "info", **fields: Any) -> None:
    """One of a command's own lines on stderr, whatever the log level: as it
    is, or with the JSON format one object (``json_line``) with its facts as
    keys. A closed stderr (its reader gone) does not stop the work."""
    text = json_line(line, logger, level, **fields) if _format == "json" else line
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


def configure(level: str = "warning", fmt: str = "text",
              stream: TextIO | None = None) -> logging.Handler:
    """Log records at ``level`` and above to ``stream`` (stderr) in ``fmt``.
    Calling it again replaces the handler it installed; no other handler is touched."""
    global _installed, _format
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else TextFormatter(tracebacks=level == "debug"))
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _installed, _format = handler, fmt
    return handler
