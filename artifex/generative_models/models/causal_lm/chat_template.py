"""Chat templates rendered as transformers renders them: the same sandboxed Jinja environment.

:func:`render_chat_template` turns a conversation (and optional tools) into the prompt text a
model was trained on, with transformers' Jinja settings and globals (``raise_exception``,
``strftime_now``, the ``tojson`` filter, the loop-controls extension), so a template from a
Hugging Face checkpoint gives the same text here as in ``apply_chat_template``.
:class:`~artifex.generative_models.models.causal_lm.tokenizer.Tokenizer` calls it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template"]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Renders a chat template the way transformers' `apply_chat_template` does.

    The environment is Jinja's `ImmutableSandboxedEnvironment(trim_blocks=True,
    lstrip_blocks=True)` with the `loopcontrols` extension, a `tojson` filter that does not escape
    HTML (`json.dumps(..., ensure_ascii=False)`), and the globals `raise_exception` and
    `strftime_now`. Keys whose value is None are dropped from each message, as transformers does.

    Args:
        template: The Jinja source.
        messages: Chat messages, dicts with `role` and `content` (and whatever the template
            reads).
        add_generation_prompt: Whether to end with the assistant header.
        tools: Optional tool schemas, passed as `tools`.
        documents: Optional documents, passed as `documents`.
        **variables: Other template variables (e.g. `bos_token`, `eos_token`).

    Returns:
        The rendered text.

    Raises:
        jinja2.exceptions.TemplateError: From `raise_exception` in the template.
        TypeError: If a message is not a mapping.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import render_chat_template
        >>> template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
        >>> render_chat_template(template, [{"role": "user", "content": "2+2?"},
        ...                                 {"role": "assistant", "content": "4"}])
        '[user] 2+2? [assistant] 4 '
    """
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            msg = f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}"
            raise TypeError(msg)
        chat.append({k: v for k, v in message.items() if v is not None})
    return _compile_template(template).render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
