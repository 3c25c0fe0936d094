"""Options of ``run``, ``serve`` and ``ui`` from the environment and a TOML
file, as a service manager passes them, beside the command line.

Every option of those commands (from the parser's own actions, so a new
option is configurable the day it is added) may also be given as an
environment variable ``ASYNCWORKER_<OPTION>`` (``--lease-ms``:
``ASYNCWORKER_LEASE_MS``) or as a key of a TOML file named by ``--config``
(or ``ASYNCWORKER_CONFIG``): the option's name without its dashes
(``lease-ms = 30000``). The command line wins over the environment, which
wins over the file, which wins over the built-in default.

- A flag (``--until-idle``) is a TOML boolean, or in the environment one of
  1/0, true/false, yes/no, on/off.
- A repeatable option (``--endpoint``) is a TOML array of strings, or in the
  environment its values separated by commas. Given on the command line, it
  replaces what the environment or the file said.
- Top-level keys are options of the command being run; a table ``[run]``,
  ``[serve]`` or ``[ui]`` holds one command's options over them, so one file
  can serve several commands. The positional QUEUE stays on the command line.
- ``--queue-name`` (``ASYNCWORKER_QUEUE_NAME``) is taken from the
  environment by every command that opens a queue, not by these three alone:
  one variable points a shell's every command at a named queue.
- Variables ``ASYNCWORKER_...`` that name no option of the command are
  ignored: the environment is shared by every command. An empty one is unset. A key of the file that
  names no option is an error, as is a value of the wrong type.

An error names its source (``ASYNCWORKER_LEASE_MS``, ``FILE: lease-ms``) and
the rule, never the value given (it may be a URL with a password): one line on
stderr and exit 2, as argparse's own errors.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CONFIGURABLE", "ENV_PREFIX", "add_config_argument", "env_name", "key_name",
           "parse_arguments"]

CONFIGURABLE = ("run", "serve", "ui")  # the commands a service manager starts
EVERY_COMMAND = ("--queue-name",)  # options every command takes from the environment
ENV_PREFIX = "ASYNCWORKER_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
SEPARATOR = ","  # between the values of a repeatable option in the environment
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NOT_SHOWN = "(the value, not shown)"


class ConfigError(ValueError):
    """A value from the environment or the file that cannot be used: its source
    and the rule, never the value."""


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"read options from this TOML file (or {CONFIG_ENV}): each key an "
                        f"option's name without its dashes (lease-ms = 30000, until-idle = "
                        f"true, endpoint = [\"a\", \"b\"]), top-level or in a [run], [serve] "
                        f"or [ui] table. Every option may also come from the environment: "
                        f"{ENV_PREFIX}<OPTION> ({ENV_PREFIX}LEASE_MS=30000; a repeatable "
                        f"one comma-separated). The command line wins, then the "
                        f"environment, then the file")


# ------------------------------------------------------------------ names


def _long_option(action: argparse.Action) -> str | None:
    longs = [one for one in action.option_strings if one.startswith("--")]
    return longs[0] if longs else None


def key_name(action: argparse.Action) -> str | None:
    """The option's key in a TOML file: ``--lease-ms`` -> ``lease-ms``."""
    option = _long_option(action)
    return None if option is None else option[2:]


def env_name(action: argparse.Action) -> str | None:
    """The option's environment variable: ``--lease-ms`` -> ``ASYNCWORKER_LEASE_MS``."""
    key = key_name(action)
    return None if key is None else ENV_PREFIX + key.upper().replace("-", "_")


def configurable_actions(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of a command but --help and --config itself: the parser's own."""
    return [action for action in sub._actions
            if key_name(action) is not None and action.dest not in ("help", "config")
            and not isinstance(action, argparse._HelpAction)]


# ------------------------------------------------------------------ values


def _is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0 and isinstance(action.const, bool)


def _is_repeatable(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction)


def _redacted(message: str, given: str) -> str:
    """A type's message without the value it quotes (which may be a secret):
    argparse's types quote it with repr, sometimes cut short."""
    quoted = repr(given)
    for end in range(len(quoted), 2, -1):
        if quoted[:end] in message:
            return message.replace(quoted[:end], NOT_SHOWN)
    # the range checks end with the number as given: "must be in 1..100, got 0"
    return re.sub(f"got {re.escape(given.strip())}$", f"got {NOT_SHOWN}", message)


def _one_value(action: argparse.Action, text: str, source: str) -> Any:
    """One string through the option's own type and choices, as argparse would."""
    convert = action.type
    try:
        value = convert(text) if callable(convert) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        reason = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else (
            f"not a valid {getattr(convert, '__name__', 'value')}")
        raise ConfigError(f"{source}: {_redacted(reason, text)}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{source}: must be one of "
                          f"{', '.join(map(str, action.choices))}")
    return value


def _flag_value(action: argparse.Action, given: bool) -> Any:
    """A flag set to true is the flag given (its const); false, its default."""
    return action.const if given else action.default


def from_env_text(action: argparse.Action, text: str, source: str) -> Any:
    if _is_flag(action):
        word = text.strip().lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise ConfigError(f"{source}: a flag is one of {'/'.join(TRUE_WORDS)} or "
                              f"{'/'.join(FALSE_WORDS)}")
        return _flag_value(action, word in TRUE_WORDS)
    if _is_repeatable(action):
        parts = [part.strip() for part in text.split(SEPARATOR)]
        if not all(parts):
            raise ConfigError(f"{source}: values separated by '{SEPARATOR}', none empty")
        return [_one_value(action, part, source) for part in parts]
    return _one_value(action, text, source)


def from_toml_value(action: argparse.Action, value: object, source: str) -> Any:
    if _is_flag(action):
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: a flag is true or false")
        return _flag_value(action, value)
    if _is_repeatable(action):
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{source}: a repeatable option is an array, e.g. "
                              f"[\"a\", \"b\"]")
        return [_one_value(action, _scalar_text(one, source), source) for one in value]
    return _one_value(action, _scalar_text(value, source), source)


def _scalar_text(value: object, source: str) -> str:
    """A TOML string or number as the command line would spell it."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        kind = "a boolean" if isinstance(value, bool) else f"a TOML {type(value).__name__}"
        raise ConfigError(f"{source}: a string or a number, not {kind}")
    return value if isinstance(value, str) else str(value)


# ------------------------------------------------------------------ sources


def read_file(path: str, command: str,
              commands: Mapping[str, argparse.ArgumentParser]) -> dict[str, tuple[Any, str]]:
    """The options of ``command`` the file sets, by key: each value and where it
    was written (the top level, or the command's table over it)."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:  # the line and column, no content
        raise ConfigError(f"--config {path}: not TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text") from None
    tables = {name: data.pop(name) for name in CONFIGURABLE if name in data}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name}: a table of {name}'s options ([{name}])")
        _check_keys(path, f"[{name}] ", table, commands[name])
    _check_keys(path, "", data, commands[command])
    found = {key: (value, f"{path}: {key}") for key, value in data.items()}
    found.update((key, (value, f"{path}: [{command}] {key}"))
                 for key, value in tables.get(command, {}).items())
    return found


def _check_keys(path: str, where: str, table: Mapping[str, object],
                sub: argparse.ArgumentParser) -> None:
    known = [key_name(action) for action in configurable_actions(sub)]
    for key in table:
        if key in known:
            continue
        if key == "config":
            raise ConfigError(f"{path}: {where}config: a file cannot name another one")
        close = difflib.get_close_matches(key, [k for k in known if k], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        positional = any(action.dest == key and not action.option_strings
                         for action in sub._actions)
        if positional:
            hint = f" ({key.upper()} goes on the command line)"
        raise ConfigError(f"{path}: {where}{key}: not an option of "
                          f"{sub.prog.split()[-1]}{hint}")


def configured(sub: argparse.ArgumentParser, command: str, argv: Sequence[str],
               environ: Mapping[str, str],
               commands: Mapping[str, argparse.ArgumentParser]) -> dict[str, Any]:
    """The values the environment and the file give, by dest: the environment's
    over the file's."""
    actions = configurable_actions(sub)
    values: dict[str, Any] = {}
    path = _config_path(argv, environ)
    if path is not None:
        given = read_file(path, command, commands)
        for action in actions:
            key = key_name(action)
            if key in given:
                value, source = given[key]
                values[action.dest] = from_toml_value(action, value, source)
    for action in actions:
        name = env_name(action)
        # empty is unset: an EnvironmentFile's "ASYNCWORKER_OWNER=" keeps the default
        if name is not None and environ.get(name, "").strip():
            values[action.dest] = from_env_text(action, environ[name], name)
    return values


def _config_path(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config", default=None)
    found, _ = early.parse_known_args(list(argv))
    path = found.config if found.config is not None else environ.get(CONFIG_ENV)
    return path or None


# ------------------------------------------------------------------ the parse


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_in(argv: Sequence[str], commands: Mapping[str, object]) -> str | None:
    """The command named: the first word that is not an option (the top level
    has no option that takes a value)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in commands else None
    return None


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the options of run, serve and ui also
    taken from the environment and the TOML file (the command line first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    commands = _subparsers(parser)
    command = _command_in(argv, commands)
    if command not in CONFIGURABLE:
        return _from_environment(parser, parser.parse_args(argv), environ)
    sub = commands[command]
    after = argv[argv.index(command) + 1:]
    if any(word in ("-h", "--help") for word in after):  # help reads nothing
        return parser.parse_args(argv)
    try:
        values = configured(sub, command, after, environ, commands)
    except ConfigError as exc:
        sub.error(str(exc))
    fallbacks = _leave_unset(sub, values)
    args = parser.parse_args(argv)
    for dest, value in {**fallbacks, **values}.items():
        if not hasattr(args, dest):  # not on the command line
            setattr(args, dest, value)
    return args


def _every_command_action(parser: argparse.ArgumentParser,
                          option: str) -> argparse.Action | None:
    """The first action of ``option`` in any command (each command's is alike)."""
    for action in parser._actions:
        if option in action.option_strings:
            return action
    for sub in _subparsers(parser).values():
        found = _every_command_action(sub, option)
        if found is not None:
            return found
    return None


def _from_environment(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      environ: Mapping[str, str]) -> argparse.Namespace:
    """The options every command takes from the environment, where the command
    has the option and its command line did not give it."""
    for option in EVERY_COMMAND:
        action = _every_command_action(parser, option)
        name = None if action is None else env_name(action)
        if action is None or name is None or getattr(args, action.dest, 0) is not None:
            continue  # the command has no such option, or its command line gave it
        if environ.get(name, "").strip():
            try:
                setattr(args, action.dest, from_env_text(action, environ[name], name))
            except ConfigError as exc:
                parser.error(str(exc))
    return args


def _leave_unset(sub: argparse.ArgumentParser, values: Mapping[str, Any]) -> dict[str, Any]:
    """Make argparse leave every option the command line does not give unset
    (so what it did give is known, a repeatable one included), and hand back
    the built-in defaults, as argparse would have set them. An option that is
    required is no longer so when the environment or the file gives it."""
    defaults: dict[str, Any] = {}
    for action in configurable_actions(sub):
        default = action.default
        if isinstance(default, str) and callable(action.type):
            default = action.type(default)  # argparse converts a string default
        if isinstance(default, list):
            default = list(default)
        defaults.setdefault(action.dest, default)
        action.default = argparse.SUPPRESS
        if action.dest in values:
            action.required = False
    return defaults
