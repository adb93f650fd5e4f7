"""JSON schemas of Python functions (tools), from their signatures and Google docstrings.

The schema a chat template's ``tools`` argument renders, as transformers'
``get_json_schema`` builds it. Used by the tokenizer (``apply_chat_template(tools=[f])``) and
the multi-turn tool runner.
"""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

__all__ = ["tool_schema", "validate_arguments"]

_SIMPLE_TYPES: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    type(None): "null",
    Any: "any",
}


def _type_schema(tp: Any, where: str) -> dict[str, Any]:
    """JSON schema of one type hint."""
    if tp in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            schema = dict(parts[0])
        elif all(set(p) == {"type"} for p in parts):
            names = [p["type"] for p in parts]
            schema: dict[str, Any] = {"type": names[0] if len(names) == 1 else names}
        else:
            schema = {"anyOf": parts}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is Literal:
        kinds = sorted({_SIMPLE_TYPES.get(type(a), "string") for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if tp is list or origin in (list, Sequence, typing.Sequence):
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if tp is tuple or origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], where)}
        return {"type": "array", "prefixItems": [_type_schema(a, where) for a in args]}
    if tp is dict or origin in (dict, Mapping, typing.Mapping):
        out: dict[str, Any] = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _type_schema(args[1], where)
        return out
    msg = f"tool_schema: {where} has a type hint {tp!r} with no JSON schema"
    raise TypeError(msg)


_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?|References?)"
    r":\s*$",
    re.MULTILINE,
)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """``(description, {arg: description}, returns)`` of a Google docstring."""
    doc = inspect.cleandoc(doc)
    sections = list(_SECTION.finditer(doc))
    description = (doc[: sections[0].start()] if sections else doc).strip()
    args: dict[str, str] = {}
    returns = None
    for i, m in enumerate(sections):
        end = sections[i + 1].start() if i + 1 < len(sections) else len(doc)
        body = doc[m.end() : end]
        name = m.group(1)
        if name in ("Args", "Arguments", "Parameters"):
            current = None
            indent = 0
            for line in body.splitlines():
                item = re.match(r"^\s{1,8}(\*{0,2}\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)$", line)
                if item and (current is None or len(line) - len(line.lstrip()) <= indent):
                    current = item.group(1).lstrip("*")
                    indent = len(line) - len(line.lstrip())
                    args[current] = item.group(2).strip()
                elif current is not None and line.strip():
                    args[current] = (args[current] + " " + line.strip()).strip()
        elif name in ("Returns", "Return"):
            returns = " ".join(line.strip() for line in body.splitlines() if line.strip())
    return description, args, returns


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool, from its signature, type hints and Google docstring.

    Every parameter needs a type hint and a line in the docstring's ``Args:`` section;
    parameters without a default are ``required``. A return annotation adds a ``return``
    entry (with the ``Returns:`` text as its description), as transformers does.

    Args:
        func: The tool (a plain function or any callable with a signature).

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}``.

    Raises:
        TypeError: Not callable, no docstring, a parameter without a type hint or a
            description, ``*args`` / ``**kwargs``, or a type with no JSON schema.

    Examples:
        >>> from artifex.generative_models.training.rl import tool_schema
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: The first factor.
        ...         b: The second factor.
        ...     '''
        ...     return a * b
        >>> schema = tool_schema(multiply)
        >>> schema["function"]["name"], schema["function"]["description"]
        ('multiply', 'Multiplies two integers.')
        >>> parameters = schema["function"]["parameters"]
        >>> parameters["required"], parameters["properties"]["a"]
        (['a', 'b'], {'type': 'integer', 'description': 'The first factor.'})
    """
    if not callable(func):
        msg = f"tool_schema: a tool must be callable, got {type(func).__name__}"
        raise TypeError(msg)
    name = getattr(func, "__name__", type(func).__name__)
    doc = inspect.getdoc(func)
    if not doc:
        msg = f"tool_schema: tool {name!r} has no docstring (it describes the tool to the model)"
        raise TypeError(msg)
    description, arg_docs, returns = _parse_docstring(doc)
    hints = typing.get_type_hints(func)
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(func).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            msg = f"tool_schema: tool {name!r} has *args/**kwargs ({param.name}); name them"
            raise TypeError(msg)
        if param.name not in hints:
            msg = f"tool_schema: parameter {param.name!r} of tool {name!r} has no type hint"
            raise TypeError(msg)
        if param.name not in arg_docs:
            msg = (
                f"tool_schema: parameter {param.name!r} of tool {name!r} is not described in "
                "the docstring's Args: section"
            )
            raise TypeError(msg)
        schema = _type_schema(hints[param.name], f"parameter {param.name!r} of {name!r}")
        schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        ret = _type_schema(hints["return"], f"the return type of {name!r}")
        if returns:
            ret["description"] = returns
        function["return"] = ret
    return {"type": "function", "function": function}


def _show(value: Any) -> str:
    """A short description of a value for an error message."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


_KIND_NAMES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "an object",
}


def _conform(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """``value`` checked against ``schema`` (and converted where JSON Schema allows it)."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return _conform(value, option, where)
            except ValueError:
                continue
        msg = f"{where} matches none of the allowed types, got {_show(value)}"
        raise ValueError(msg)
    kinds = schema.get("type", "any")
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        ok, out = _as_kind(value, kind, schema, where)
        if ok:
            if "enum" in schema and not any(
                out == e and type(out) is type(e) for e in schema["enum"]
            ):
                allowed = ", ".join(repr(e) for e in schema["enum"])
                msg = f"{where} must be one of {allowed}, got {_show(value)}"
                raise ValueError(msg)
            return out
    wanted = " or ".join(
        _KIND_NAMES.get(k, k) for k in ([kinds] if isinstance(kinds, str) else kinds)
    )
    if schema.get("nullable"):
        wanted += " or null"
    msg = f"{where} must be {wanted}, got {_show(value)}"
    raise ValueError(msg)


def _as_kind(value: Any, kind: str, schema: Mapping[str, Any], where: str) -> tuple[bool, Any]:
    """``(True, converted value)`` when ``value`` is of the JSON type ``kind``."""
    if kind == "any":
        return True, value
    if kind == "null":
        return value is None, value
    if kind == "boolean":
        return isinstance(value, bool), value
    if kind == "string":
        return isinstance(value, str), value
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False, value
        if isinstance(value, float) and not math.isfinite(value):
            msg = f"{where} must be a finite number, got {_show(value)}"
            raise ValueError(msg)
        if kind == "number" or isinstance(value, int):
            return True, value
        # JSON Schema counts a number with a zero fractional part as an integer (3.0 is 3).
        return (True, int(value)) if value.is_integer() else (False, value)
    if kind == "array":
        if not isinstance(value, list | tuple):
            return False, value
        if "prefixItems" in schema:
            items = schema["prefixItems"]
            if len(value) != len(items):
                msg = f"{where} must have {len(items)} items, got {len(value)}"
                raise ValueError(msg)
            pairs = enumerate(zip(value, items, strict=True))
            return True, [_conform(v, s, f"{where}[{i}]") for i, (v, s) in pairs]
        if "items" in schema:
            item = schema["items"]
            return True, [_conform(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return True, list(value)
    if kind == "object":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return False, value
        if "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            return True, {k: _conform(v, extra, f"{where}[{k!r}]") for k, v in value.items()}
        return True, dict(value)
    msg = f"{where} has a schema of unknown type {kind!r}"
    raise ValueError(msg)


def validate_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's arguments checked against the tool's JSON schema, converted where JSON allows.

    Every required parameter must be present and no unknown one; each value must be of its
    parameter's JSON type (recursively for array items and object values, ``enum`` for
    ``Literal``, ``null`` for optional parameters). The only conversions are those under which
    JSON Schema itself counts the value as of the type: a number with a zero fractional part is
    an ``integer`` (``3.0`` becomes ``3``), a list given for a fixed-length tuple is checked item
    by item (the tool receives a list), and an integer is a ``number``. Nothing else is
    converted: ``"3"`` is not an integer, ``1`` is not a boolean, ``true`` is not a number, and
    NaN or infinity is never a number (JSON has no such values).

    Args:
        schema: The tool's schema (what :func:`tool_schema` returns), or its ``parameters``.
        arguments: The call's keyword arguments (decoded JSON).

    Returns:
        The arguments, converted.

    Raises:
        ValueError: A missing or unknown argument, or a value that does not fit its schema
            (the message names the argument).
        TypeError: ``arguments`` is not a mapping with string keys.

    Examples:
        >>> from artifex.generative_models.utils.tool_schema import (
        ...     tool_schema, validate_arguments)
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: The first factor.
        ...         b: The second factor.
        ...     '''
        ...     return a * b
        >>> validate_arguments(tool_schema(multiply), {"a": 6, "b": 7.0})
        {'a': 6, 'b': 7}
        >>> validate_arguments(tool_schema(multiply), {"a": "x", "b": 7})
        Traceback (most recent call last):
            ...
        ValueError: argument 'a' must be an integer, got 'x' (str)
    """
    params = schema.get("function", {}).get("parameters", schema)
    if not isinstance(arguments, Mapping) or not all(isinstance(k, str) for k in arguments):
        msg = f"the arguments must be a mapping with string keys, got {_show(arguments)}"
        raise TypeError(msg)
    properties = params.get("properties", {})
    for name in params.get("required", ()):
        if name not in arguments:
            msg = f"missing a required argument: {name!r}"
            raise ValueError(msg)
    for name in arguments:
        if name not in properties:
            msg = f"got an unexpected keyword argument {name!r}"
            raise ValueError(msg)
    return {
        name: _conform(value, properties[name], f"argument {name!r}")
        for name, value in arguments.items()
    }
