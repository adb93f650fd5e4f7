"""``artifex-grpo train``'s option types and option groups, and ``--config`` files.

- argparse types that refuse a bad value with a message naming it: ``--reward`` (a built-in
  name or ``module:function``), booleans (``true``/``false``, not any string), non-negative and
  finite numbers, ``--report-to`` tracker names;
- one option per field of a config dataclass (``GRPOConfig``, ``TrainConfig``,
  ``RolloutConfig``), stored under ``"<Class>.<field>"`` and collected back into keyword
  arguments;
- ``--config FILE`` (.yaml/.yml or .json): its keys become command-line options, checked with
  each option's own parser, before the command line's own (which override them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

_REWARDS = ("math", "format", "overlong")


def _reward_spec(text: str) -> str:
    """An argparse type for ``--reward``: a built-in name or a ``module:function`` path."""
    if text in _REWARDS:
        return text
    module, sep, attr = text.partition(":")
    if sep and module.strip() and attr.strip():
        return text
    msg = (
        f"unknown reward {text!r}: use a built-in one ({', '.join(_REWARDS)}) or an import "
        "path module:function"
    )
    raise argparse.ArgumentTypeError(msg)


def _field_type(tp: Any) -> tuple[Any, tuple[str, ...] | None]:
    """An argparse converter (and choices) for a dataclass field annotation."""
    if isinstance(tp, str):
        tp = eval(tp, {**vars(typing), "types": types})  # annotations are postponed strings
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return str, tuple(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        conv, choices = _field_type(inner[0])

        def optional(text: str) -> Any:
            return None if text.lower() == "none" else conv(text)

        return optional, choices
    if tp is bool:
        return _parse_bool, None
    return tp, None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(text: str) -> bool:
    """``true``/``false`` (and 1/0, yes/no, on/off); anything else is an error, not False."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    msg = f"expected true or false, got {text!r}"
    raise argparse.ArgumentTypeError(msg)


def _non_negative(kind: type) -> Any:
    """An argparse type: a finite number of ``kind`` that is >= 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as err:
            msg = f"expected a {kind.__name__}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from err
        if not math.isfinite(value) or value < 0:
            msg = f"must be a finite number >= 0, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def _report_to(text: str) -> list[str]:
    """An argparse type for ``--report-to``: tracker names, checked (packages included)."""
    from artifex.generative_models.training.trackers import check_report_to

    try:
        check_report_to(text, field="the option")
    except (ValueError, ImportError) as err:  # argparse names the option first
        raise argparse.ArgumentTypeError(str(err).removeprefix("the option: ")) from err
    return [name.strip().lower() for name in text.split(",")]


def _finite_float(text: str) -> float:
    """An argparse type: a finite float."""
    try:
        value = float(text)
    except ValueError as err:
        msg = f"expected a number, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from err
    if not math.isfinite(value):
        msg = f"must be a finite number, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _add_dataclass_options(
    parser: argparse.ArgumentParser, cls: type, *, skip: Sequence[str] = ()
) -> None:
    hints = typing.get_type_hints(cls, include_extras=False)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        conv, choices = _field_type(hints[field.name])
        default = None if field.default is dataclasses.MISSING else field.default
        flag = {"nargs": "?", "const": True} if conv is _parse_bool else {}  # `--overwrite`
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=f"{cls.__name__}.{field.name}",
            type=conv,
            choices=choices,
            default=argparse.SUPPRESS,
            metavar=None if choices else field.name.upper(),
            help=f"default: {default}",
            **flag,
        )


def _collect(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = cls.__name__ + "."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------ config files
def _read_config(path: str) -> dict[str, Any]:
    """The mapping of a ``--config`` file (.yaml/.yml or .json); errors name the file and line.

    A key repeated in one mapping is an error (naming the file, the line and the key), not the
    last value silently.
    """
    from artifex.generative_models.utils.strict_parse import json_loads_unique, yaml_load_unique

    if not os.path.isfile(path):
        msg = f"config file not found: {path} (--config)"
        raise FileNotFoundError(msg)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as err:
            msg = f"reading {path} needs PyYAML: pip install pyyaml (or use a .json file)"
            raise ImportError(msg) from err
        try:
            data = yaml_load_unique(text, path)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            msg = f"{path}{line}: invalid YAML ({problem}): fix the file"
            raise ValueError(msg) from None
    elif path.endswith(".json"):
        try:
            data = json_loads_unique(text, path)
        except json.JSONDecodeError as err:
            msg = f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno}): fix the file"
            raise ValueError(msg) from None
    else:
        msg = f"unknown config file format {path!r} (--config): use .yaml, .yml or .json"
        raise ValueError(msg)
    if data is None:
        return {}
    if not isinstance(data, dict):
        msg = f"{path}: expected a mapping of option names to values, got a {type(data).__name__}"
        raise ValueError(msg)
    return data


def _config_text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    msg = f"{where}: expected a number, a string or true/false, got {type(value).__name__}"
    raise ValueError(msg)


def _config_tokens(action: argparse.Action, option: str, value: Any, where: str) -> list[str]:
    """Command-line tokens for one config entry, checked with the option's own parser."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            msg = f"{where}: expected true or false, got {value!r}"
            raise ValueError(msg)
        return [option] if value else []
    if value is None:
        if action.default is None:
            return []
        try:
            none = action.type("none") if action.type is not None else "none"
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            none = "none"
        if none is None:
            return [f"{option}=none"]
        msg = f"{where}: null is not a value of {option}; leave the key out for its default"
        raise ValueError(msg)
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if isinstance(value, list) and not many:
        msg = f"{where}: {option} takes one value, got a list"
        raise ValueError(msg)
    texts = [_config_text(v, where) for v in (value if isinstance(value, list) else [value])]
    if not texts:
        msg = f"{where}: {option} needs at least one value, got an empty list"
        raise ValueError(msg)
    for text in texts:
        try:
            parsed = text if action.type is None else action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            kind = getattr(action.type, "__name__", "value")
            detail = str(err) if isinstance(err, argparse.ArgumentTypeError) else f"not a {kind}"
            msg = f"{where}: {detail} (got {text!r})"
            raise ValueError(msg) from None
        if action.choices is not None and parsed not in action.choices:
            choices = ", ".join(map(str, action.choices))
            msg = f"{where}: {text!r} is not one of {choices}"
            raise ValueError(msg)
    if isinstance(action, argparse._AppendAction):
        return [f"{option}={t}" for t in texts]
    if action.nargs in ("+", "*"):
        return [option, *texts]
    return [f"{option}={texts[0]}"]


def _expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Replaces ``--config FILE`` by the options the file holds, before the command line's own.

    Every key is a long option of the subcommand (``-`` or ``_``). Options given on the command
    line override the file; for repeatable options (``--reward``) the command line's values
    replace the file's instead of adding to them.
    """
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    pos = next((i for i, t in enumerate(argv) if t in commands.choices), None)
    if pos is None:
        return argv
    sub = commands.choices[argv[pos]]
    if "--config" not in sub._option_string_actions:
        return argv  # a subcommand without config files: argparse reports --config
    files: list[str] = []
    kept: list[str] = []
    rest = argv[pos + 1 :]
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            kept += rest[i:]
            break
        name, eq, value = token.partition("=")
        is_config = len(name) >= 5 and "--config".startswith(name)  # argparse takes --conf too
        if is_config and not eq and i + 1 < len(rest):
            files.append(rest[i + 1])
            i += 2
            continue
        if is_config and eq:
            files.append(value)
        else:
            kept.append(token)
        i += 1
    if not files:
        return argv
    if len(files) > 1:
        msg = f"--config is given {len(files)} times ({', '.join(files)}): give one file"
        raise ValueError(msg)
    path = files[0]
    given = set()
    for token in kept:
        action = sub._option_string_actions.get(token.partition("=")[0])
        if token.startswith("--") and action is not None:
            given.add(action.dest)
    options = sorted(o for o in sub._option_string_actions if o.startswith("--"))
    tokens: list[str] = []
    for key, value in _read_config(path).items():
        option = "--" + str(key).replace("_", "-")
        action = sub._option_string_actions.get(option)
        if action is None or option in ("--help", "--config"):
            import difflib

            close = difflib.get_close_matches(option, options, n=1)
            hint = f" (did you mean {close[0][2:]!r}?)" if close else ""
            msg = (
                f"{path}: unknown key {key!r}{hint}: the keys are the long options of "
                f"'artifex-grpo {argv[pos]}' (see --help)"
            )
            raise ValueError(msg)
        if action.dest not in given:
            tokens += _config_tokens(action, option, value, f"{path}: key {key!r}")
    return [*argv[: pos + 1], *tokens, *kept]
