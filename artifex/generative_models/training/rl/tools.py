"""Tools for multi-turn rollouts: JSON schemas, tool-call parsing and guarded execution.

A tool is a plain Python callable with type hints and a Google-style docstring:

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiplies two integers.

Args:
            a: The first factor.
            b: The second factor.
        \"\"\"
        return a * b

:func:`tool_schema` turns it into the JSON schema chat templates expect in their ``tools``
argument (``{"type": "function", "function": {"name", "description", "parameters"}}``, the
layout of transformers' ``get_json_schema``). :func:`parse_tool_calls` reads the calls a model
wrote in its template family's format (Qwen2.5 / Qwen3 ``<tool_call>{json}</tool_call>`` blocks,
or Llama 3's bare ``{"name": ..., "parameters": ...}`` JSON), and :class:`ToolRunner` executes
them on the host with a timeout. Nothing a tool or the model does can crash the run: an
exception, a malformed call, an unknown tool, bad arguments, a timeout or a non-text result all
become an error message for the model (and are counted).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from artifex.generative_models.utils.validation import check_choice, check_float

__all__ = [
    "ToolCall",
    "ToolResult",
    "ToolRunner",
    "parse_tool_calls",
    "tool_schema",
]

ToolFormat = Literal["qwen", "llama3"]

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


# ------------------------------------------------------------------------------ parsing
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call read from the model's output.

    Attributes:
        name: The tool's name (``None`` when the call could not be parsed).
        arguments: The keyword arguments.
        error: Why the call is malformed (``None`` for a well-formed call).
    """

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call_from_json(text: str, args_key: str) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({err.msg}): {text[:200]!r}")
    if not isinstance(obj, dict):
        return ToolCall(None, {}, f"the tool call must be a JSON object, got {text[:200]!r}")
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, "the tool call has no 'name' string")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name, {}, f"the arguments of {name!r} are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(name, {}, f"the arguments of {name!r} must be a JSON object")
    return ToolCall(name, args)


def parse_tool_calls(text: str, tool_format: ToolFormat = "qwen") -> list[ToolCall]:
    """The tool calls in one model turn (an empty list: the turn is a plain answer).

    - ``"qwen"`` (Qwen2.5, Qwen3, Hermes-style templates): every
      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; an unclosed block at
      the end of the text is parsed too.
    - ``"llama3"``: the whole turn (after an optional ``<|python_tag|>``) is one JSON object
      ``{"name": ..., "parameters": {...}}``; a turn that starts with ``{`` but is not such an
      object is a malformed call.

    Args:
        text: The decoded turn.
        tool_format: The template family's format.

    Returns:
        The calls, malformed ones with their ``error`` set.

    Raises:
        ValueError: An unknown ``tool_format``.
        TypeError: A ``tool_format`` that is not a string.
    """
    check_choice("parse_tool_calls: tool_format", tool_format, ("qwen", "llama3"))
    if tool_format == "qwen":
        return [_call_from_json(m.group(1).strip(), "arguments") for m in _QWEN_CALL.finditer(text)]
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return []
    return [_call_from_json(body, "parameters")]


# ------------------------------------------------------------------------------ execution
@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The outcome of one call, as text for the model.

    Attributes:
        name: The tool called (``None`` for an unparseable call).
        content: The tool's text result, or the error message shown to the model.
        error: ``None`` on success, else the kind of failure: ``"malformed"``, ``"unknown"``,
            ``"arguments"``, ``"exception"``, ``"timeout"`` or ``"not_text"``.
    """

    name: str | None
    content: str
    error: str | None = None


class ToolRunner:
    """Executes tool calls on the host, each in a daemon thread with a timeout.

    A call that does not finish within ``timeout`` seconds is reported to the model as a
    timeout and abandoned (its thread keeps running in the background but never blocks the run
    or the interpreter's exit). Results must be ``str`` (``int``/``float``/``bool`` are
    formatted, as a convenience); anything else is an error message.

    Args:
        tools: The tools (callables; their ``__name__`` is the name the model calls).
        timeout: Seconds per call (> 0).

    Raises:
        ValueError: Two tools with the same name, no tools, or a timeout <= 0 or not finite.
        TypeError: A tool without a valid schema (see :func:`tool_schema`), or a timeout that
            is not a number.
    """

    def __init__(self, tools: Sequence[Callable[..., Any]], *, timeout: float = 10.0):
        if not tools:
            msg = "ToolRunner needs at least one tool"
            raise ValueError(msg)
        check_float("ToolRunner.timeout", timeout, greater_than=0.0)
        self.schemas = [tool_schema(t) for t in tools]
        self.tools: dict[str, Callable[..., Any]] = {}
        for tool, schema in zip(tools, self.schemas, strict=True):
            name = schema["function"]["name"]
            if name in self.tools:
                msg = f"ToolRunner: two tools are named {name!r}"
                raise ValueError(msg)
            self.tools[name] = tool
        self.timeout = float(timeout)

    def run(self, call: ToolCall) -> ToolResult:
        """Executes one call; never raises.

        Args:
            call: The parsed call.

        Returns:
            The :class:`ToolResult`.
        """
        if call.error is not None and call.name is None:
            return ToolResult(None, f"Error: {call.error}", "malformed")
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools))
            return ToolResult(
                call.name, f"Error: unknown tool {call.name!r} (tools: {known})", "unknown"
            )
        if call.error is not None:
            return ToolResult(call.name, f"Error: {call.error}", "malformed")
        tool = self.tools[call.name]
        try:
            inspect.signature(tool).bind(**call.arguments)
        except TypeError as err:
            return ToolResult(
                call.name, f"Error: bad arguments for {call.name}: {err}", "arguments"
            )
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool(**call.arguments)
            except BaseException as err:
                box["error"] = err

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            return ToolResult(
                call.name, f"Error: {call.name} timed out after {self.timeout:g} s", "timeout"
            )
        if "error" in box:
            err = box["error"]
            return ToolResult(
                call.name, f"Error: {call.name} raised {type(err).__name__}: {err}", "exception"
            )
        value = box.get("value")
        if isinstance(value, bool | int | float) and not isinstance(value, str):
            value = str(value)
        if not isinstance(value, str):
            return ToolResult(
                call.name,
                f"Error: {call.name} returned {type(value).__name__}, not text",
                "not_text",
            )
        return ToolResult(call.name, value)

    def run_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Executes calls one after the other.

        Args:
            calls: Parsed calls.

        Returns:
            One result per call.
        """
        return [self.run(c) for c in calls]
