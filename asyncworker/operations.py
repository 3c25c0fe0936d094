"""What the command line and the operator's page both do and read.

The two front ends (``asyncworker.cli``, ``asyncworker.ui``) call these; each
adds its own words around them (a command's lines and exit codes, a page's
HTML and status codes), and neither imports the other.

- the errors an operator's action ends in: ``UsageError`` (bad usage, a
  missing or foreign file: the command line's exit code 2) and ``WorkFailed``
  (the work failed: exit code 1)
- a queue opened for an operator (``open_queue_store``), shown without its
  password (``shown``), an error's message led by it (``about``); a named
  queue's target (``named_queue``) and the queues beside it
  (``neighbour_queues``)
- the flags' files checked before anything opens or binds: a secrets file,
  a token file's mode, a CA file, a certificate and its key, a receiver's URL
  (``read_secret_file``, ``check_private_file``, ``check_ca_file``,
  ``served_tls``, ``reached``)
- the receiver's figures (``stats_url``, ``receiver_stats``)
- the dead letters' reasons (``DEAD_REASONS``) and a bulk change applied in
  transactions of ``MAX_BATCH`` (``chunks``, ``apply_in_chunks``)
- text: one line (``one_line``), a moment in UTC (``when``)
- a queue's endpoints: read from files (``read_secret_texts``,
  ``read_header_file``), made (``new_endpoint``), added, updated, enabled or
  disabled, removed (``add_endpoint``, ``update_endpoint``,
  ``set_endpoint_enabled``, ``remove_endpoint``), each with a note and an
  actor for its audit row, and read (``endpoint_record``)
- an endpoint's recovery: its deliveries finished since a time sent again,
  a dry run first (``recover_preview``: a count and a fingerprint), then the
  confirmation of exactly that set (``recover_confirmed``; ``RecoveryChanged``
  when it is another one by then)
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from lease.queues import DEFAULT, queue_target, split_url
from lease.records import NotAQueue, StoreError
from lease.rules import MAX_PAGE
from lease.store import Store
from lease.stores import is_postgres_url, list_queues, open_store
from lease.worker import MAX_BATCH

if TYPE_CHECKING:
    from lease.endpoints import Endpoint
    from lease.http import Destination

DEAD_REASONS = ("deadline", "exhausted", "permanent", "cancelled")
INSECURE_FLAG = "--insecure-plain-http"


class UsageError(Exception):
    """Bad usage or a missing file: one line on stderr, exit code 2 (the command
    line's code; the page refuses to start with it)."""


class WorkFailed(Exception):
    """The command ran but its work failed: one line on stderr, exit code 1."""


# ------------------------------------------------------------------ text


def one_line(text: str) -> str:
    """Control characters (a newline in a file name, say) shown escaped: one line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


def when(ms: int | None) -> str:
    """A moment in milliseconds as UTC to the millisecond; '-' for none."""
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}Z"


def paused_words(state: dict | None) -> str:
    """"paused since <when> by <actor> (<note>)", or "not paused"."""
    if state is None:
        return "not paused"
    by = f" by {state['actor']}" if state["actor"] is not None else ""
    return f"paused since {when(state['since_ms'])}{by} ({state['note']})"


# ------------------------------------------------------------------ a queue


def shown(queue: str) -> str:
    """A queue as it may be printed: a URL without its password (in its user
    part or as a ``password=`` parameter); a path as it is."""
    if not is_postgres_url(queue):
        return queue
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(queue)
    except ValueError:  # an unbalanced [ in the host, say: nothing of it is shown
        return queue.split("://", 1)[0] + "://(a URL that does not parse)"
    netloc = parts.netloc
    if "@" in netloc:
        user_part, _, hosts = netloc.rpartition("@")  # a password may hold an "@"
        user = user_part.split(":", 1)[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = "&".join(item for item in parts.query.split("&")
                     if item and item.split("=", 1)[0].strip().lower() != "password")
    url = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    try:
        url, name = split_url(url)
    except ValueError:  # shown as it is: the open refuses it with the reason
        return url
    return url if name is None else f"{url} queue {name}"


def named_queue(queue: str, name: str | None) -> str:
    """What QUEUE with ``--queue-name NAME`` names: the URL with its ``queue``
    parameter, or the file beside (lease.queues); QUEUE itself for None."""
    try:
        return queue_target(queue, name)
    except ValueError as exc:  # a URL that names another queue
        raise UsageError(f"{shown(queue)}: {exc}") from None


def neighbour_queues(queue: str) -> list[str] | None:
    """The queues of QUEUE's database, or beside its file, by name
    (``lease.stores.list_queues``); None when it holds the default one alone,
    so such a queue shows what it always did."""
    names = list_queues(queue)
    return None if names in ([], [DEFAULT]) else names


def passwords(queue: str) -> list[str]:
    """The password a URL carries, in every spelling a message might quote."""
    if not is_postgres_url(queue):
        return []
    from urllib.parse import parse_qsl, unquote, urlsplit

    try:
        parts = urlsplit(queue)
        found = [parts.password or ""]
        found += [value for key, value in parse_qsl(parts.query) if key.lower() == "password"]
    except ValueError:
        return []
    return [word for text in found if text for word in {text, unquote(text)}]


def check_queue_path(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"queue file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"not a file: {path}")


def open_queue_store(queue: str, *, create: bool = False, read_only: bool = False,
                     migrate: bool = True, shared: bool = False,
                     journal: str | None = None) -> Store:
    """The store QUEUE names, for a command: a file is checked first (missing, a
    folder, empty: usage errors), a URL's server is reached and its queue found.

    Not a queue (a foreign file or database, a newer version): UsageError, exit 2,
    nothing changed. A store that fails (locked, read-only, a server that cannot
    be reached): StoreError, exit 1 (main). ``read_only`` writes nothing at all
    (a file's journal mode included); otherwise the queue is migrated to this
    version, unless ``migrate=False`` leaves a file's migration to the intake's
    own transaction, so an intake refused halfway leaves it exactly as it was.
    """
    if not is_postgres_url(queue) and not create:
        check_queue_path(queue)
        if not read_only and os.path.getsize(queue) == 0:  # SQLite would fill it silently
            raise UsageError(f"{queue}: not a queue file: it is empty (init makes one)")
    try:
        if migrate or shared or journal or is_postgres_url(queue):
            return open_store(queue, create=create, read_only=read_only, shared=shared,
                              journal=journal)
        from lease.sqlite import SQLiteStore

        return SQLiteStore(queue, create=create, migrate=False)
    except NotAQueue as exc:
        raise UsageError(about(queue, exc)) from None
    except StoreError:  # locked, read-only, unreachable: the work failed, exit 1
        raise
    except FileNotFoundError as exc:  # removed since it was checked
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a foreign file, by the contract's own refusal
        raise UsageError(about(queue, exc)) from None


def about(queue: str | None, error: object) -> str:
    """An error's message, led by the queue it is about unless it names it already.
    A database server's message may span lines: one line here, its words kept."""
    message = str(error)
    if queue is None:
        return message
    if is_postgres_url(queue):
        message = re.sub(r"\s*\n\s*", " ", message.strip())
    return message if shown(queue) in message else f"{shown(queue)}: {message}"


# ------------------------------------------------------------------ the flags' files

# A secrets file holds a few lines; a larger one is a wrong path (a log, an image).
MAX_SECRETS_FILE_BYTES = 64 * 1024


def check_small_file(flag: str, path: str, cap: int = 1 << 20) -> None:
    """An existing, readable, regular file of at most ``cap`` bytes: a device, a FIFO
    or a folder named by mistake is refused before anything reads it."""
    if not os.path.exists(path):
        raise UsageError(f"{flag}: file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: not a file: {path}")
    try:
        with open(path, "rb") as file:
            size = len(file.read(cap + 1))
    except OSError as exc:  # permission denied, say
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if size > cap:
        raise UsageError(f"{flag}: {path} is larger than {cap} bytes: not the file meant")


def read_secret_file(path: str) -> tuple[bytes, ...]:
    """The keys of a secrets file; a one-line UsageError that names the file and
    the line, never a secret (lease.signing's messages never quote one)."""
    from lease.signing import read_secrets

    check_small_file("--secret-file", path, MAX_SECRETS_FILE_BYTES)
    try:
        keys = read_secrets(path)
    except UnicodeDecodeError:
        raise UsageError(f"--secret-file: {path} is not UTF-8 text") from None
    except ValueError as exc:
        raise UsageError(f"--secret-file: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--secret-file: cannot read {path}: {exc.strerror or exc}") from None
    check_private_file("--secret-file", path)
    return keys


def check_private_file(flag: str, path: str) -> None:
    """A secret's file (--secret-file, --token-file), once read: one every user may
    write is refused (anyone could have put their own secret in it); one others
    may read or write is used, with one warning line on stderr."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError as exc:  # gone since it was read
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if mode & 0o002:
        raise UsageError(f"{flag}: {path} is writable by every user (mode {mode:04o}): anyone "
                         f"could have replaced the secret; chmod 600 it and check its content")
    if mode & 0o077:
        import logging

        # the command line's logger, as every command's own warnings: its name is in the line
        logging.getLogger("asyncworker.cli").warning(
            f"{flag}: {path} is open to other users (mode {mode:04o}): chmod 600 it, so that "
            f"only its owner reads it")


def check_ca_file(path: str) -> None:
    """A regular file from which the senders' TLS context loads CA certificates."""
    from lease.http import client_context

    check_small_file("--ca-file", path)
    try:
        client_context(path)
    except ValueError as exc:
        raise UsageError(f"--ca-file: {exc}") from None


class _EncryptedKey(Exception):
    """OpenSSL asked for a passphrase: a daemon has no one to type it."""


def _no_passphrase() -> str:
    raise _EncryptedKey


def check_tls_files(cert: str | None, key: str | None) -> None:
    """--tls-cert and --tls-key: both or neither, each a file, the key unencrypted
    and the certificate's own. Loaded here once so that each fault has its name
    (ssl says "PEM lib" for most of them)."""
    import ssl

    if (cert is None) != (key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if cert is None or key is None:
        return
    check_small_file("--tls-cert", cert)
    check_small_file("--tls-key", key)
    try:
        ssl.create_default_context(cafile=cert)
    except ssl.SSLError:
        raise UsageError(f"--tls-cert: {cert} holds no PEM certificate") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise UsageError(f"--tls-key: {key} is encrypted (a passphrase): give the key "
                         "unencrypted, readable only by the receiver's user") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise UsageError(f"--tls-key: {key} is not the key of --tls-cert {cert}") from None
        raise UsageError(f"--tls-key: {key} holds no PEM private key ({exc.reason or exc})"
                         ) from None


def served_tls(args: argparse.Namespace) -> bool:
    """--tls-cert and --tls-key (of a command that serves: ``serve``, ``ui``)
    checked: https or not."""
    check_tls_files(args.tls_cert, args.tls_key)
    return args.tls_cert is not None


def reached(args: argparse.Namespace, flag: str, url: str | None, *, ack: str = "echo-id",
            secrets: tuple[bytes, ...] = (), serves: bool = False) -> Destination | None:
    """The receiver ``url`` (given as ``flag``) names, with --ca-file and
    --insecure-plain-http (the options of a command that reaches a receiver,
    worded once in ``asyncworker.cli.parser``), as the destination
    the senders check once more; None when no URL is given. Every fault is a
    one-line usage error, before the queue is opened. ``serves``: the command
    serves too, so --insecure-plain-http means something without the URL."""
    from lease.http import Destination, PlainHttpRefused

    if url is None:
        if args.ca_file is not None or (args.insecure_plain_http and not serves):
            raise UsageError(f"--ca-file{'' if serves else ' and --insecure-plain-http'} "
                             f"go{'es' if serves else ''} with {flag}")
        return None
    if args.ca_file is not None:
        if not url.startswith("https://"):
            raise UsageError(f"--ca-file goes with an https:// {flag}")
        check_ca_file(args.ca_file)
    try:
        return Destination(url, ack=ack, ca_file=args.ca_file, secrets=secrets,
                           insecure_http=args.insecure_plain_http)
    except PlainHttpRefused as exc:  # the flag that allows it, not the argument
        raise UsageError(f"{flag}: {PlainHttpRefused(exc.host, INSECURE_FLAG)}") from None
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


# ------------------------------------------------------------------ the receiver


def stats_url(url: str, ca_file: str | None = None, insecure_http: bool = False,
              allow: str | None = None) -> str:
    """The /stats beside a receiver's POST URL, by the senders' rule for the URL
    (https anywhere, plain http to loopback unless insecure_http); else ValueError,
    naming ``allow`` (a command's flag) as what allows plain http, if any does."""
    from urllib.parse import urlsplit

    from lease.http import Destination, PlainHttpRefused

    try:
        Destination(url, ca_file=ca_file, insecure_http=insecure_http)
    except PlainHttpRefused as exc:
        raise PlainHttpRefused(exc.host, allow) from None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/stats"


def receiver_stats(url: str, ca_file: str | None = None, insecure_http: bool = False
                   ) -> dict:
    """GET the receiver's /stats: no proxy read, no redirect followed, https with
    its certificate verified (against ``ca_file`` only, when given)."""
    import ssl
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None  # a 3xx is an answer, not a receiver's stats

    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({}),
                                                  NoRedirect()]
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=ca_file)
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(stats_url(url, ca_file, insecure_http), timeout=10) as answer:
        found = json.loads(answer.read(1 << 20))
    if not isinstance(found, dict):
        raise ValueError(f"a JSON {type(found).__name__}, not an object")
    return found


# ------------------------------------------------------------------ bulk changes


def chunks(ids: list[str]) -> Iterator[list[str]]:
    """The ids of a bulk change in the chunks each applied in one transaction:
    MAX_BATCH ids at most, in their order."""
    for start in range(0, len(ids), MAX_BATCH):
        yield ids[start:start + MAX_BATCH]


def apply_in_chunks(ids: list[str], apply: Callable[[list[str]], list],
                    done: str) -> list[tuple[str, object]]:
    """(id, True or its ValueError) for each id, MAX_BATCH per transaction.

    A failure part-way (a store error) leaves the chunks before it whole
    and the rest untouched; it is raised as WorkFailed with that count."""
    results: list[tuple[str, object]] = []
    for chunk in chunks(ids):
        try:
            answers = apply(chunk)
        except StoreError as exc:
            count = sum(answer is True for _, answer in results)
            raise WorkFailed(f"{exc}; {count} {done} before it, the rest untouched") from None
        results += zip(chunk, answers, strict=True)
    return results


def dead_matching(store: Store, *, limit: int | None = None, cap: int | None = None,
                  **filters: Any) -> list[dict[str, Any]]:
    """Every dead letter ``filters`` match (``Store.list_jobs``'s: reason,
    id_prefix, key, endpoint, error, http_status, from_ms, to_ms; None is any),
    in seq order, read page by page: the set a bulk redrive or cancel acts
    on, for the command line and the page alike. At most ``limit`` of them;
    more than ``cap`` is TooMany (the caller asks for a narrower filter)."""
    wanted = {name: value for name, value in filters.items() if value is not None}
    found: list[dict[str, Any]] = []
    after: int | None = None
    while limit is None or len(found) < limit:
        size = MAX_PAGE if limit is None else min(MAX_PAGE, limit - len(found))
        page = store.list_jobs(status="dead", after_seq=after, limit=size, **wanted)
        found += page
        if cap is not None and len(found) > cap:
            raise TooMany(f"the filter matches more than {cap} jobs")
        if len(page) < size:
            break
        after = page[-1]["seq"]
    return found


def dead_filters(args: argparse.Namespace, store: Store) -> dict[str, Any]:
    """The command line's dead-letter filter (--reason, --key, --error,
    --http-status, --since, --until) as dead_matching takes it: an age (2h) is
    before now by the queue's own clock, which judges its jobs."""
    def moment(given: tuple[str, int] | None) -> int | None:
        if given is None:
            return None
        kind, ms = given
        return max(0, store.now_ms() - ms) if kind == "ago" else ms

    return {"reason": args.reason, "key": args.key, "error": args.error,
            "http_status": args.http_status, "from_ms": moment(args.since),
            "to_ms": moment(args.until)}


class TooMany(WorkFailed):
    """A bulk filter matches more jobs than one confirmation may change."""


# ------------------------------------------------------------------ endpoints
#
# What the command line (``asyncworker endpoint ...``) and the operator's page
# both do to a queue's endpoints. Each action checks what it is given before
# the store is asked (a bad field: UsageError; an unknown name:
# EndpointNotFound; a name taken or a removal refused: EndpointRefused), and
# the store writes the change and its audit row in one transaction. A secret
# or a header's value is never in a message any of these raise.

# The fields an operator may name, as the command line calls them; the page
# passes its own words (its form's field names) where it wants them.
ENDPOINT_FIELD_NAMES = {field: field for field in (
    "name", "url", "ack", "ca_file", "secrets", "headers", "types", "max_in_flight", "rate",
    "burst", "insecure_http", "enabled", "note", "actor")}


class EndpointNotFound(WorkFailed):
    """No endpoint of that name in the queue (the command line's exit 1, the page's 404)."""


class EndpointRefused(WorkFailed):
    """The change cannot be made as things stand: a name taken, a removal with
    live deliveries (the command line's exit 1, the page's 409)."""


def read_secret_texts(path: str, flag: str = "--secret-file") -> tuple[str, ...]:
    """The ``whsec_`` secrets of a secrets file (one a line, ``#`` comments; two
    or more during a rotation), as an endpoint keeps them: the checks of
    ``read_secret_file``, the same one-line errors, never a secret in them."""
    from lease.signing import parse_secret

    lines = _read_private_lines(flag, path)
    texts = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parse_secret(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {path} line {number}: {exc}") from None
        texts.append(text)
    if not texts:
        raise UsageError(f"{flag}: {path} holds no secret")
    return tuple(texts)


def read_header_file(path: str, flag: str = "--header-file") -> tuple[tuple[str, str], ...]:
    """The static headers of a headers file: ``Name: value`` a line (blank lines
    and lines starting with ``#`` skipped), each value a secret (an
    ``Authorization`` a customer asked for): the file is checked as a secrets
    file is, and no message shows a value. A file with no header: none."""
    from lease.endpoints import check_headers

    pairs = []
    for number, line in enumerate(_read_private_lines(flag, path), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, colon, value = line.partition(":")
        if not colon or not name.strip():
            raise UsageError(f"{flag}: {path} line {number}: not a 'Name: value' line")
        if name != name.strip():
            raise UsageError(f"{flag}: {path} line {number}: no space may come before the "
                             f"':' of a header's name")
        try:
            check_headers([(name, value.strip())])
        except ValueError as exc:  # its messages name the header, never its value
            raise UsageError(f"{flag}: {path} line {number}: {exc}") from None
        pairs.append((name, value.strip()))
    try:
        return check_headers(pairs)
    except ValueError as exc:  # a name given twice, too many
        raise UsageError(f"{flag}: {path}: {exc}") from None


def _read_private_lines(flag: str, path: str) -> list[str]:
    """A secret's small file, read whole and checked: not every user's to write."""
    check_small_file(flag, path, MAX_SECRETS_FILE_BYTES)
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{flag}: {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    check_private_file(flag, path)
    return lines


def _named(field: str, names: dict[str, str] | None) -> str:
    return (names or ENDPOINT_FIELD_NAMES).get(field, field)


def _endpoint_problem(exc: ValueError, names: dict[str, str] | None) -> UsageError:
    """A field's refusal in the front end's words (plain http: the flag that allows it)."""
    from lease.http import PlainHttpRefused

    if isinstance(exc, PlainHttpRefused):
        return UsageError(f"{_named('url', names)}: "
                          f"{PlainHttpRefused(exc.host, _named('insecure_http', names))}")
    return UsageError(str(exc))


def _check_audit(note: str | None, actor: str | None) -> None:
    from lease.policy import check_actor, check_note

    try:
        if note is not None:
            check_note(note)
        check_actor(actor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def new_endpoint(fields: dict[str, Any], names: dict[str, str] | None = None) -> Endpoint:
    """An ``Endpoint`` of ``fields`` (its constructor's names), checked whole;
    a CA file is loaded to see that it is one. UsageError naming the fault."""
    from lease.endpoints import Endpoint

    if fields.get("ca_file") is not None:
        if not str(fields.get("url", "")).startswith("https://"):
            raise UsageError(f"{_named('ca_file', names)} goes with an https:// "
                             f"{_named('url', names)}")
        _check_ca_file_named(fields["ca_file"], names)
    try:
        return Endpoint(**fields)
    except TypeError as exc:  # a field that is not one: the caller's mistake, said plainly
        raise UsageError(f"not an endpoint's field: {exc}") from None
    except ValueError as exc:
        raise _endpoint_problem(exc, names) from None


def _check_ca_file_named(path: str, names: dict[str, str] | None) -> None:
    try:
        check_ca_file(path)
    except UsageError as exc:  # its message in the front end's words
        raise UsageError(str(exc).replace("--ca-file", _named("ca_file", names), 1)) from None


def _endpoint_names(store: Store) -> set[str]:
    return {row["name"] for row in store.endpoints()}


def _known(store: Store, name: str) -> None:
    if name not in _endpoint_names(store):
        raise EndpointNotFound(f"no endpoint {name!r} in {shown(store.name)}")


def add_endpoint(store: Store, endpoint: Endpoint, *, note: str | None = None,
                 actor: str | None = None) -> None:
    """A new endpoint of the queue; from now on each message subscribed to its
    types fans out to it too."""
    from lease.endpoints import EndpointError

    _check_audit(note, actor)
    if endpoint.name in _endpoint_names(store):
        raise EndpointRefused(f"endpoint {endpoint.name!r} exists already in "
                              f"{shown(store.name)} (update changes it)")
    try:
        store.add_endpoint(endpoint, note=note, actor=actor)
    except EndpointError as exc:  # taken meanwhile
        raise EndpointRefused(about(store.name, exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def update_endpoint(store: Store, name: str, changes: dict[str, Any], *,
                    note: str | None = None, actor: str | None = None,
                    names: dict[str, str] | None = None) -> Endpoint:
    """The endpoint with ``changes`` (``Endpoint.changed``'s fields), checked
    whole before anything is written; its audit row names the fields changed."""
    from lease.endpoints import EDITABLE, EndpointError

    _check_audit(note, actor)
    if not changes:
        raise UsageError("nothing to change")
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise UsageError(f"cannot change {', '.join(unknown)} of an endpoint")
    _known(store, name)
    if changes.get("ca_file") is not None:
        _check_ca_file_named(changes["ca_file"], names)
    try:
        [current] = store.endpoint_configs((name,))
    except EndpointError:  # removed meanwhile, or its stored fields no longer valid
        current = None  # the store's own check, below, says which
    if current is not None:
        try:
            current.changed(**changes)  # checked whole before anything is written
        except ValueError as exc:
            raise _endpoint_problem(exc, names) from None
    try:
        return store.update_endpoint(name, changes, note=note, actor=actor)
    except EndpointError as exc:  # removed meanwhile
        raise EndpointRefused(about(store.name, exc)) from None
    except ValueError as exc:
        raise _endpoint_problem(exc, names) from None


def set_endpoint_enabled(store: Store, name: str, enabled: bool, *, note: str | None = None,
                         actor: str | None = None) -> Endpoint:
    """Enable, or disable: a disabled endpoint's deliveries are kept (and new
    messages still fan out to it); none is claimed until it is enabled again."""
    return update_endpoint(store, name, {"enabled": enabled}, note=note, actor=actor)


def live_deliveries(store: Store, name: str) -> tuple[int, int]:
    """(pending, leased): an endpoint's deliveries that are not finished."""
    for row in store.endpoint_stats():
        if row["name"] == name:
            return int(row["ready"]), int(row["in_flight"])
    raise EndpointNotFound(f"no endpoint {name!r} in {shown(store.name)}")


def remove_endpoint(store: Store, name: str, *, cancel_deliveries: bool = False,
                    note: str | None = None, actor: str | None = None,
                    cancel_named: str = "cancel_deliveries with a note") -> int:
    """Remove an endpoint; how many of its pending deliveries were cancelled.

    Refused (EndpointRefused, nothing changed) while it has live deliveries,
    unless ``cancel_deliveries`` (``cancel_named``: how the front end calls
    that): then each pending one is cancelled with its audit row (``note``
    required, and ``actor``), in the removal's transaction; a leased one
    refuses the removal still (its send may be on the wire). Its finished
    deliveries keep its name."""
    from lease.endpoints import EndpointError

    _check_audit(note, actor)
    if cancel_deliveries and note is None:
        raise UsageError("cancelling the deliveries needs a note: each cancelled delivery "
                         "gets an audit row")
    pending, leased = live_deliveries(store, name)
    if leased:
        raise EndpointRefused(
            f"endpoint {name!r} has {_deliveries(leased)} in flight (leased: a send may be on "
            f"the wire) and {pending} pending; nothing removed. Disable it so that no more "
            f"are claimed, and remove it once the ones in flight have finished"
            f"{'' if cancel_deliveries else f' (with {cancel_named} for the pending ones)'}")
    if pending and not cancel_deliveries:
        raise EndpointRefused(
            f"endpoint {name!r} has {_deliveries(pending)} pending; nothing removed. "
            f"{cancel_named} cancels them with the removal, each with an audit row; or "
            f"remove it once they are delivered")
    try:
        return store.remove_endpoint(name, cancel_live=cancel_deliveries, note=note,
                                     actor=actor)
    except EndpointError as exc:  # a delivery leased or added meanwhile: the store's words
        raise EndpointRefused(f"{about(store.name, exc)}; nothing removed") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _deliveries(n: int) -> str:
    return f"{n} {'delivery' if n == 1 else 'deliveries'}"


def endpoint_record(store: Store, name: str) -> dict[str, Any]:
    """One endpoint as a read shows it: its public fields (no secret, no
    header value), created and updated, its figures (``endpoint_stats``) and
    its audit rows, oldest first. EndpointNotFound when there is none."""
    row = next((one for one in endpoint_list(store) if one["name"] == name), None)
    if row is None:
        raise EndpointNotFound(f"no endpoint {name!r} in {shown(store.name)}")
    figures = next((one for one in store.endpoint_stats() if one["name"] == name), {})
    return {**figures, **row, "audit": store.endpoint_audit(name)}


STATS_FIGURES = ("ready", "in_flight", "done", "retried", "dead", "last_error",
                 "last_success_ms", "circuit", "disable_after_ms", "disabled_why")


def endpoint_figures(store: Store) -> list[dict[str, Any]]:
    """Per endpoint, by name, what ``stats`` and the overview show of it: its
    name, whether it is enabled, and its deliveries' figures (ready, in
    flight, done, retried, dead, the last error and the last success), its
    circuit breaker (``circuit``: state, since, why, failures, open and
    paused until, failing since, attempts saved), its ``disable_after_ms``
    and ``disabled_why`` (set by an automatic disable only). Empty
    for a queue without endpoints (and for a file older than them, read
    read-only: it has none)."""
    from lease.endpoints import ALL

    rows = store.endpoint_stats()
    return [{"name": row["name"], "enabled": row.get("enabled", True),
             "types": row.get("types", [ALL]),
             **{key: row.get(key) for key in STATS_FIGURES}} for row in rows]


def endpoint_list(store: Store) -> list[dict[str, Any]]:
    """Every endpoint's public fields (no secret, no header value), with
    ``created_ms`` and ``updated_ms``, by name; none in a file older than them."""
    return store.endpoints()


# ------------------------------------------------------------------ recovery
#
# An endpoint's deliveries finished (done or dead) since a time, sent again as
# new attempts with a fresh budget, each with a redrive audit row: after an
# outage the receiver lost what it had acknowledged, or a breaker's refusals
# sent them dead. A dry run first: how many, and a fingerprint of that set;
# the confirmation carries the fingerprint back and sends exactly the ids the
# dry run showed, or is refused when the set is another one by then. The
# receiver's inbox absorbs a delivery it already applied (the same id).

RECOVER_SAMPLE = 20  # ids a dry run shows
FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")


class RecoveryChanged(WorkFailed):
    """The confirmation names another set than the one recoverable now: nothing
    sent (the command line's exit 1, the page's 409). ``now`` is the dry run
    of now, for the page to show in its place."""

    def __init__(self, message: str, now: dict[str, Any]) -> None:
        super().__init__(message)
        self.now = now


def recover_fingerprint(name: str, since_ms: int, ids: list[str]) -> str:
    """The bulk change's scheme (``asyncworker.ui.bulk.fingerprint``): sha256
    of the action and its filter (the endpoint, the time), then of the sorted
    members (the ids): equal only for the same recovery matching the same set.
    (Neither an endpoint's name nor an id holds a NUL or a newline.)"""
    import hashlib

    digest = hashlib.sha256()
    digest.update(f"recover\0endpoint={name}\0since_ms={since_ms}\n".encode())
    for job_id in sorted(ids):
        digest.update(f"{job_id}\n".encode())
    return digest.hexdigest()


def check_recovery(note: str | None, ttl_ms: int, actor: str | None) -> str:
    """A recovery's note (required: each delivery gets an audit row), its
    deliveries' time to live and its actor; UsageError naming the fault."""
    from lease.policy import PRODUCT

    if note is None or not note.strip():
        raise UsageError("a recovery needs a note: each delivery sent again gets an audit row")
    _check_audit(note, actor)
    if type(ttl_ms) is not int or not 1 <= ttl_ms <= PRODUCT.max_ttl_ms:
        raise UsageError(f"the time to live must be 1..{PRODUCT.max_ttl_ms} ms, got {ttl_ms!r:.40}")
    return note


def recover_preview(store: Store, name: str, since_ms: int) -> dict[str, Any]:
    """The dry run, nothing changed: the endpoint's deliveries finished (done
    or dead) since ``since_ms`` (at most ``MAX_RECOVER``), as ``ids`` (seq
    order), ``count``, a ``sample`` of them, ``fingerprint``, and whether the
    cap was reached (``capped``: there may be more; recover again after)."""
    from lease.endpoints import MAX_RECOVER, EndpointError

    _known(store, name)
    try:
        ids = store.recover_endpoint(name, since_ms, 1, "dry run", dry_run=True)
    except EndpointError as exc:  # removed meanwhile
        raise EndpointNotFound(about(store.name, exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return {"endpoint": name, "since_ms": since_ms, "ids": ids, "count": len(ids),
            "sample": ids[:RECOVER_SAMPLE], "fingerprint": recover_fingerprint(name, since_ms, ids),
            "capped": len(ids) >= MAX_RECOVER}


def recover_confirmed(store: Store, name: str, since_ms: int, ttl_ms: int, note: str | None,
                      fingerprint: str, *, actor: str | None = None) -> dict[str, Any]:
    """The confirmation: only when the set recoverable now has ``fingerprint``
    (the dry run's), exactly those ids are sent again (``recover_endpoint``'s
    ``ids=``), each pending with a fresh budget and a redrive audit row.
    RecoveryChanged, nothing sent, when the set is another one. Returns the
    preview confirmed, with ``recovered`` (the ids sent again) and ``missed``
    (those that left the set between the check and the change: recovered
    or redriven by someone else meanwhile)."""
    from lease.endpoints import EndpointError

    note = check_recovery(note, ttl_ms, actor)
    fingerprint = fingerprint.strip().lower()
    if not FINGERPRINT_RE.fullmatch(fingerprint):
        raise UsageError("a fingerprint is the 64 hexadecimal digits a dry run prints")
    import hmac

    now = recover_preview(store, name, since_ms)
    if not hmac.compare_digest(fingerprint.encode(), now["fingerprint"].encode()):
        raise RecoveryChanged(
            f"the deliveries of {name} finished since {when(since_ms)} are not the set the "
            f"dry run showed ({now['count']} now, fingerprint {now['fingerprint'][:12]}...): "
            f"nothing sent; run the dry run again", now)
    try:
        recovered = store.recover_endpoint(name, since_ms, ttl_ms, note, ids=now["ids"],
                                           actor=actor) if now["ids"] else []
    except EndpointError as exc:
        raise EndpointRefused(about(store.name, exc)) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sent = set(recovered)
    return {**now, "recovered": recovered,
            "missed": [job_id for job_id in now["ids"] if job_id not in sent]}
