"""Named queues: several queues in one PostgreSQL database, or beside one
SQLite file, each with its own tables and migrations.

A queue's name is ``[a-z][a-z0-9_]{0,39}``; no name (None, or ``"default"``,
the word every listing shows for it) is the default queue, exactly as it was
before queues had names: schema ``lease``, or the file itself.

- PostgreSQL: the queue ``orders`` lives in schema ``lease_orders`` of the
  same database (``lease.postgres.queues``). A URL names it with a ``queue``
  query parameter (``postgresql://host/db?queue=orders``), taken out before
  libpq sees the URL: libpq refuses a parameter it does not know.
- SQLite: the queue ``orders`` of ``/data/queue.db`` is the file
  ``/data/queue.orders.db`` beside it. A file of its own, not tables in the
  same file: SQLite has one writer lock per file, so queues in one file
  would serialize each other's writes.

Pure functions of names, URLs and paths: no file is opened here.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["DEFAULT", "URL_PARAMETER", "check_queue_name", "family", "queue_target",
           "shown_name", "split_url", "sqlite_path"]

DEFAULT = "default"  # the default queue's name in listings (never a schema or a file's part)
URL_PARAMETER = "queue"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def check_queue_name(name: object) -> str | None:
    """The queue's name, or None for the default queue (None or "default");
    ValueError for anything else than ``[a-z][a-z0-9_]{0,39}``."""
    if name is None or name == DEFAULT:
        return None
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"a queue's name is a lowercase letter, then up to 39 lowercase "
                         f"letters, digits or _ ({DEFAULT!r} is the default queue), "
                         f"got {name!r}")
    return name


def shown_name(name: str | None) -> str:
    return DEFAULT if name is None else name


def _one_name(given: str | None, named: str | None, where: str) -> str | None:
    """The name given both ways must be the same one."""
    given, named = check_queue_name(given), check_queue_name(named)
    if given is not None and named is not None and given != named:
        raise ValueError(f"two queue names: {given!r} and {named!r} in {where}")
    return given if given is not None else named


def split_url(url: str, queue: str | None = None) -> tuple[str, str | None]:
    """A ``postgresql://`` URL without its ``queue`` parameter, and the queue's
    name: the parameter's or ``queue`` (both, and different: ValueError)."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    named = [value for key, value in pairs if key == URL_PARAMETER]
    if len(named) > 1:
        raise ValueError("the URL names its queue more than once")
    if not named:
        return url, _one_name(queue, None, "the URL")
    # the other parameters as written: re-encoded, a %20 would become a + that
    # libpq does not read as a space
    rest = "&".join(item for item in parts.query.split("&")
                    if item and unquote(item.split("=", 1)[0]) != URL_PARAMETER)
    stripped = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
    return stripped, _one_name(queue, named[0], "the URL and the queue argument")


def with_url_queue(url: str, name: str | None) -> str:
    """The URL naming the queue ``name`` (its own parameter, if any, agreeing)."""
    stripped, name = split_url(url, name)
    if name is None:
        return stripped
    parts = urlsplit(stripped)
    query = "&".join(filter(None, [parts.query, urlencode({URL_PARAMETER: name})]))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def sqlite_path(path: str | os.PathLike[str], name: str | None) -> str:
    """The file of queue ``name`` beside ``path``: ``stem.NAME.suffix``."""
    name = check_queue_name(name)
    text = os.fspath(path)
    if name is None:
        return text
    folder, base = os.path.split(text)
    stem, suffix = os.path.splitext(base)
    return os.path.join(folder, f"{stem}.{name}{suffix}")


def family(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """The default queue's file and the queue's name of a queue's file: a file
    ``stem.NAME.suffix`` beside an existing ``stem.suffix`` is its queue NAME;
    any other file is a default queue."""
    text = os.fspath(path)
    folder, base = os.path.split(text)
    stem, suffix = os.path.splitext(base)
    first, dot, name = stem.rpartition(".")
    if dot and first and _NAME.fullmatch(name) and name != DEFAULT:
        parent = os.path.join(folder, first + suffix)
        if os.path.isfile(parent):
            return parent, name
    return text, None


def queue_target(target: str, name: str | None) -> str:
    """What names queue ``name`` of ``target`` (a URL or a file's path) for
    ``lease.stores.open_store``: the URL with its parameter, or the file beside."""
    if target.startswith(_POSTGRES_SCHEMES):
        return with_url_queue(target, name)
    return sqlite_path(target, name)
