"""Chat-template text of multi-turn episodes: what the template appends between turns.

The appended text is found from the chat template itself (see
:mod:`~artifex.generative_models.training.rl.rollouts.multiturn.rollout`); these helpers render,
diff and encode it.
"""

from __future__ import annotations

import inspect
import re
import secrets
from typing import Any

from artifex.generative_models.training.rl.rollouts.multiturn.environments import Message

_SENTINEL = "\x00ARTIFEX-ASSISTANT-CONTENT\x00"


def _render(tokenizer: Any, messages: list[Message], tools: Any, *, generation_prompt: bool) -> str:
    extra = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
    )


def _appended_segments(
    tokenizer: Any, history: list[Message], obs: list[Message], tools: Any, generated: str
) -> list[tuple[str, bool]]:
    """Text to append after the model's turn ``generated`` (which ends ``history``), in pieces.

    Each piece is ``(text, plain)``: ``plain`` marks the content of an observation message as
    the template rendered it, which is encoded with special-token strings split into plain
    text (a tool's output cannot write special tokens); the rest is the template's own text.
    The content's rendering is found by rendering the observations with random markers in
    place of their contents, then each content alone, so that no content can pass itself off
    as template text.
    """
    probe = _render(
        tokenizer,
        [*history[:-1], {"role": "assistant", "content": _SENTINEL}],
        tools,
        generation_prompt=False,
    )
    closing = probe[probe.index(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in probe else ""
    overlap = 0
    for k in range(len(closing), 0, -1):
        if generated.endswith(closing[:k]):
            overlap = k
            break
    base = _render(tokenizer, history, tools, generation_prompt=False)

    def appended(messages: list[Message]) -> str:
        full = _render(tokenizer, [*history, *messages], tools, generation_prompt=True)
        if not full.startswith(base):
            msg = (
                "the chat template does not render the conversation as a prefix of its "
                "continuation, so turns cannot be appended; got "
                f"{base[-80:]!r} vs {full[len(base) - 80 : len(base)]!r}"
            )
            raise ValueError(msg)
        return full[len(base) :]

    text = appended(obs)
    nonce = secrets.token_hex(8)
    marks = {
        i: f"ARTIFEX{nonce}OBS{i}END"
        for i, m in enumerate(obs)
        if isinstance(m.get("content"), str) and m["content"]
    }
    if not marks:
        return [(closing[overlap:] + text, False)]

    def marked(real: int | None) -> str:
        return appended(
            [
                dict(m, content=marks[i]) if i in marks and i != real else m
                for i, m in enumerate(obs)
            ]
        )

    skeleton = marked(None)
    rendered: dict[int, str] = {}
    for i, mark in marks.items():
        count = skeleton.count(mark)
        if count:
            alone = marked(i)
            width = len(mark) + (len(alone) - len(skeleton)) // count
            start = skeleton.index(mark)
            rendered[i] = alone[start : start + width]
    pieces: list[tuple[str, bool]] = [(closing[overlap:], False)]
    last = 0
    by_mark = {mark: i for i, mark in marks.items()}
    for found in re.finditer("|".join(map(re.escape, by_mark)), skeleton):
        pieces += [(skeleton[last : found.start()], False), (rendered[by_mark[found[0]]], True)]
        last = found.end()
    pieces.append((skeleton[last:], False))
    if "".join(t for t, _ in pieces[1:]) != text:
        msg = (
            "the chat template renders an observation's content differently depending on the "
            "other messages' contents, so the content cannot be kept apart from the template's "
            "text (and encoded as plain text)"
        )
        raise ValueError(msg)
    merged: list[tuple[str, bool]] = []
    for piece, plain in pieces:
        if merged and merged[-1][1] == plain:
            merged[-1] = (merged[-1][0] + piece, plain)
        elif piece:
            merged.append((piece, plain))
    return merged


def appended_text(
    tokenizer: Any, history: list[Message], obs: list[Message], tools: Any, generated: str
) -> str:
    """Text to append after the model's turn ``generated`` (which ends ``history``)."""
    return "".join(t for t, _ in _appended_segments(tokenizer, history, obs, tools, generated))


def _encode_segments(tokenizer: Any, segments: list[tuple[str, bool]]) -> list[int]:
    """Ids of the appended pieces: the template's text as usual, contents as plain text."""
    ids: list[int] = []
    for text, plain in segments:
        if plain:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        else:
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids


def _check_plain_encoding(tokenizer: Any) -> None:
    """The tokenizer can encode text with special-token strings as plain text."""
    try:
        params = inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        return
    if "split_special_tokens" not in params and not any(
        p.kind is p.VAR_KEYWORD for p in params.values()
    ):
        msg = (
            f"run_episodes: {type(tokenizer).__name__}.encode has no split_special_tokens "
            "option; observations are encoded with it so that a tool's output cannot write "
            "special tokens (the library's Tokenizer has it)"
        )
        raise TypeError(msg)


def _truncated(content: str, limit: int) -> str:
    """``content`` cut to ``limit`` characters, with a notice the model sees."""
    return (
        content[:limit] + f"\n[truncated: the output has {len(content)} characters; the first "
        f"{limit} are shown]"
    )
