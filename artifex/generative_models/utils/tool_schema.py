"""JSON schemas of Python functions (tools), from their signatures and Google docstrings.

The schema a chat template's ``tools`` argument renders, as transformers'
``get_json_schema`` builds it. Used by the tokenizer (``apply_chat_template(tools=[f])``) and
the multi-turn tool runner.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

__all__ = ["tool_schema"]

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
