"""Tools for multi-turn rollouts: JSON schemas, tool-call parsing and guarded execution.

A tool is a plain Python callable with type hints and a Google-style docstring (a summary line and
an ``Args`` entry per parameter). :func:`tool_schema` turns it into the JSON schema chat templates
expect in their ``tools`` argument (``{"type": "function", "function": {"name", "description",
"parameters"}}``, the layout of transformers' ``get_json_schema``). :func:`parse_tool_calls` reads
the calls a model wrote in its template family's format (Qwen2.5 / Qwen3
``<tool_call>{json}</tool_call>`` blocks, or Llama 3's bare ``{"name": ..., "parameters": ...}``
JSON), and :class:`ToolRunner` executes them on the host with a timeout. Nothing a tool or the model
does can crash the run: an exception, a malformed call, an unknown tool, bad arguments, a timeout or
a non-text result all become an error message for the model (and are counted).

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
    >>> schema = tool_schema(multiply)["function"]
    >>> schema["name"], schema["description"], schema["parameters"]["required"]
    ('multiply', 'Multiplies two integers.', ['a', 'b'])
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from artifex.generative_models.utils.tool_schema import tool_schema, validate_arguments
from artifex.generative_models.utils.validation import check_choice, check_float, check_int

__all__ = [
    "DEFAULT_MAX_TOOL_THREADS",
    "MAX_JSON_DEPTH",
    "ToolCall",
    "ToolResult",
    "ToolRunner",
    "live_tool_threads",
    "parse_tool_calls",
    "tool_schema",
    "validate_arguments",
]

ToolFormat = Literal["qwen", "llama3"]


# ------------------------------------------------------------------------------ parsing
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call read from the model's output.

    Attributes:
        name: The tool's name (``None`` when the call could not be parsed).
        arguments: The keyword arguments.
        error: Why the call is malformed (``None`` for a well-formed call).

    Examples:
        >>> from artifex.generative_models.training.rl import parse_tool_calls
        >>> text = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
        >>> call = parse_tool_calls(text)[0]
        >>> call.name, call.arguments, call.error
        ('multiply', {'a': 6, 'b': 7}, None)
    """

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


MAX_JSON_DEPTH = 64
"""How deeply the JSON of a tool call may nest (objects and arrays); deeper is malformed."""

_JSON_SPECIAL = re.compile(r'["\\\[\]{}]')


def _nesting_depth(text: str, limit: int) -> int:
    """Bracket depth of ``text`` outside JSON strings, counted up to ``limit + 1``.

    Python's ``json`` parser recurses once per level, so a deep enough text would raise
    ``RecursionError``; the depth is checked first, in one linear pass without recursion.
    """
    depth = deepest = 0
    in_string = False
    escaped_at = -1
    for match in _JSON_SPECIAL.finditer(text):
        ch, at = match.group(), match.start()
        if in_string:
            if at == escaped_at:
                continue
            if ch == "\\":
                escaped_at = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


def _loads(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, why the text is not acceptable JSON)``; never raises."""
    if _nesting_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return None, f"it nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, err.msg
    except (ValueError, RecursionError) as err:  # e.g. an integer of more than 4300 digits
        return None, f"{type(err).__name__}: {str(err)[:200]}"


def _call_from_json(text: str, args_key: str) -> ToolCall:
    obj, why = _loads(text)
    if why is not None:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({why}): {text[:200]!r}")
    if not isinstance(obj, dict):
        return ToolCall(None, {}, f"the tool call must be a JSON object, got {text[:200]!r}")
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, "the tool call has no 'name' string")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args, why = _loads(args)
        if why is not None:
            return ToolCall(name, {}, f"the arguments of {name!r} are not valid JSON ({why})")
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
        The calls, malformed ones with their ``error`` set: text that is not JSON, JSON nested
        deeper than :data:`MAX_JSON_DEPTH` levels (checked before parsing, so that no text can
        make the parser recurse without bound), no ``name`` string, or arguments that are not
        a JSON object. No text makes it raise.

    Raises:
        ValueError: An unknown ``tool_format``.
        TypeError: A ``tool_format`` that is not a string.

    Examples:
        >>> from artifex.generative_models.training.rl import parse_tool_calls
        >>> text = ('Let me compute. <tool_call>{"name": "multiply", '
        ...         '"arguments": {"a": 2, "b": 3}}</tool_call>')
        >>> parse_tool_calls(text)
        [ToolCall(name='multiply', arguments={'a': 2, 'b': 3}, error=None)]
        >>> parse_tool_calls("The answer is 6.")
        []
        >>> llama = '{"name": "multiply", "parameters": {"a": 2, "b": 3}}'
        >>> parse_tool_calls(llama, "llama3")[0].name
        'multiply'
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
            ``"arguments"``, ``"exception"``, ``"timeout"``, ``"not_text"`` or ``"overloaded"``
            (not run: too many earlier calls that timed out are still running).

    Examples:
        >>> from artifex.generative_models.training.rl import ToolCall, ToolRunner
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: The first factor.
        ...         b: The second factor.
        ...     '''
        ...     return a * b
        >>> runner = ToolRunner([multiply])
        >>> runner.run(ToolCall(name="multiply", arguments={"a": 6, "b": 7}))
        ToolResult(name='multiply', content='42', error=None)
        >>> runner.run(ToolCall(name="divide", arguments={})).error
        'unknown'
    """

    name: str | None
    content: str
    error: str | None = None


DEFAULT_MAX_TOOL_THREADS = 16
"""Default bound on tool threads alive in the process (see :class:`ToolRunner`)."""

_log = logging.getLogger(__name__)
_LIVE: set[threading.Thread] = set()  # tool threads started and not finished, every runner's
_LIVE_LOCK = threading.Lock()


def _prune_live() -> int:
    """Drops finished threads from the registry (the caller holds the lock); the count left."""
    _LIVE.difference_update([t for t in _LIVE if t.ident is not None and not t.is_alive()])
    return len(_LIVE)


def live_tool_threads() -> int:
    """Tool threads alive in this process: calls running and calls abandoned after a timeout.

    Returns:
        The count, over every :class:`ToolRunner`.

    Examples:
        >>> from artifex.generative_models.training.rl.rollouts.multiturn import tools
        >>> tools.live_tool_threads() >= 0
        True
    """
    with _LIVE_LOCK:
        return _prune_live()


def _text(value: Any) -> str:
    """``str(value)`` shortened to 500 characters; never raises (a huge int, a bad ``__str__``)."""
    try:
        text = str(value)
    except Exception as err:  # e.g. an int of more than 4300 digits
        text = f"<{type(value).__name__} that cannot be shown: {type(err).__name__}>"
    return text if len(text) <= 500 else text[:500] + "..."


class ToolRunner:
    """Executes tool calls on the host, each in a daemon thread with a timeout.

    Arguments are checked against the tool's schema first (:func:`validate_arguments`: every
    required argument present, no unknown one, each value of its JSON type; a number with a
    zero fractional part passes as an integer, nothing else is converted); a call that does not
    fit is not run and the model gets the reason as an error message.

    A call that does not finish within ``timeout`` seconds is reported to the model as a
    timeout and abandoned: its thread keeps running in the background (it never blocks the run
    or the interpreter's exit), a warning is logged, and :attr:`timeouts` counts it. Python
    cannot stop a thread, so the number of tool threads alive in the process is bounded
    instead: while ``max_threads`` of them are alive (calls running plus calls abandoned and
    still running, counted over every runner), a new call is not run and the model gets an
    ``"overloaded"`` error; :func:`live_tool_threads` reads the count. Results must be ``str``
    (``int``/``float``/``bool`` are formatted, as a convenience); anything else is an error
    message.

    Args:
        tools: The tools (callables; their ``__name__`` is the name the model calls).
        timeout: Seconds per call (> 0).
        max_threads: Most tool threads alive in the process at once (>= 1), abandoned ones
            included.

    Raises:
        ValueError: Two tools with the same name, no tools, a timeout <= 0 or not finite, or
            ``max_threads < 1``.
        TypeError: A tool without a valid schema (see :func:`tool_schema`), a timeout that is
            not a number, or ``max_threads`` not an int.

    Examples:
        >>> from artifex.generative_models.training.rl import ToolRunner, parse_tool_calls
        >>> def multiply(a: int, b: int) -> int:
        ...     '''Multiplies two integers.
        ...
        ...     Args:
        ...         a: The first factor.
        ...         b: The second factor.
        ...     '''
        ...     return a * b
        >>> runner = ToolRunner([multiply], timeout=5.0)
        >>> calls = parse_tool_calls(
        ...     '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 12}}</tool_call>'
        ...     '<tool_call>{"name": "multiply", "arguments": {"a": "x"}}</tool_call>')
        >>> results = runner.run_all(calls)
        >>> results[0].content, [r.error for r in results]
        ('144', [None, 'arguments'])
        >>> results[1].content
        "Error: bad arguments for multiply: missing a required argument: 'b'"
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        timeout: float = 10.0,
        max_threads: int = DEFAULT_MAX_TOOL_THREADS,
    ):
        if not tools:
            msg = "ToolRunner needs at least one tool"
            raise ValueError(msg)
        check_float("ToolRunner.timeout", timeout, greater_than=0.0)
        self.max_threads = check_int("ToolRunner.max_threads", max_threads, minimum=1)
        self.timeouts = 0
        self.schemas = [tool_schema(t) for t in tools]
        self.tools: dict[str, Callable[..., Any]] = {}
        for tool, schema in zip(tools, self.schemas, strict=True):
            name = schema["function"]["name"]
            if name in self.tools:
                msg = f"ToolRunner: two tools are named {name!r}"
                raise ValueError(msg)
            self.tools[name] = tool
        self.timeout = float(timeout)
        self._schema_of = {s["function"]["name"]: s for s in self.schemas}

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
            arguments = validate_arguments(self._schema_of[call.name], call.arguments)
            inspect.signature(tool).bind(**arguments)
        except (TypeError, ValueError, RecursionError) as err:
            return ToolResult(
                call.name, f"Error: bad arguments for {call.name}: {_text(err)}", "arguments"
            )
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool(**arguments)
            except BaseException as err:
                box["error"] = err
            finally:
                with _LIVE_LOCK:
                    _LIVE.discard(threading.current_thread())

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        with _LIVE_LOCK:
            live = _prune_live()
            if live >= self.max_threads:
                msg = (
                    f"Error: {call.name} was not run: {live} earlier tool calls are still "
                    f"running after their timeout (at most {self.max_threads} at once)"
                )
                return ToolResult(call.name, msg, "overloaded")
            _LIVE.add(thread)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self.timeouts += 1
            _log.warning(
                "tool %r timed out after %g s; its thread is abandoned and keeps running "
                "(%d tool threads alive, at most %d)",
                call.name,
                self.timeout,
                live_tool_threads(),
                self.max_threads,
            )
            return ToolResult(
                call.name, f"Error: {call.name} timed out after {self.timeout:g} s", "timeout"
            )
        if "error" in box:
            err = box["error"]
            return ToolResult(
                call.name,
                f"Error: {call.name} raised {type(err).__name__}: {_text(err)}",
                "exception",
            )
        value = box.get("value")
        if isinstance(value, bool | int | float) and not isinstance(value, str):
            value = _text(value)
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
