"""Stop strings matched on decoded text, as one token-level automaton the sampler steps on device.

A stop string is text, but a tokenizer can write the same text with different tokens: SmolLM2
encodes ``"</tool_call>"`` as ``<``, ``/``, ... and ``" </tool_call>"`` as `` <``, ``/``, ...,
and a token such as ``"}</"`` can hold the start of a stop string after other text. Matching
one tokenization misses the others; decoding the tail of every row on the host at every step
would stop the compiled loop. Instead the stop strings are compiled, once per tokenizer, into a
finite automaton over token ids:

1. an Aho-Corasick automaton over bytes recognises every stop string (UTF-8) anywhere in a
   byte stream; its states are "the longest suffix read so far that is a prefix of some stop
   string", plus one absorbing *match* state;
2. each token's bytes (what ``decode`` writes for it, special tokens as their text) are run
   through the byte automaton from every state, which gives a table ``next[state, token]``.

The sampler carries one state per row (0 at the start of a turn) and looks up
``next[state, token]`` after each sampled token: one gather per step. A row's state reaches the
match state exactly when the concatenated bytes of its turn's tokens contain a stop string, so
the turn stops at the token that completes the first occurrence, however it was tokenized.

References:
    Aho, A. V. and Corasick, M. J., "Efficient string matching: an aid to bibliographic
    search", Communications of the ACM 18(6), 1975.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["stop_string_table", "token_bytes"]

_BREAK = b"\xff"  # a byte no UTF-8 text contains: ends any partial match
_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, tuple[bytes, ...]] = weakref.WeakKeyDictionary()
_TABLES: weakref.WeakKeyDictionary[Any, dict[tuple, np.ndarray]] = weakref.WeakKeyDictionary()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: the character a byte-level BPE writes -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(backend: Any) -> set[str]:
    """The ``type`` names of a ``tokenizers`` decoder and of its parts."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # not a tokenizers decoder: no known layout
        return set()
    types, todo = set(), [spec]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if isinstance(item.get("type"), str):
                types.add(item["type"])
            todo.extend(item.get("decoders") or [])
    return types


def token_bytes(tokenizer: Any) -> tuple[bytes, ...]:
    """The bytes each token id writes when decoded, special tokens as their text.

    For a ``tokenizers``-backed tokenizer (``tokenizer.backend``): added tokens give their
    content; a byte-level BPE (``ByteLevel`` decoder) maps its characters back to bytes, so
    tokens that hold part of a UTF-8 character are exact; ``<0xNN>`` byte-fallback tokens give
    their byte; other tokens give their decoded text (a leading ``"▁"`` as a space, as in the
    middle of a text). A token whose text cannot be recovered alone (a part of a character
    outside a byte-level vocabulary) gives the byte ``0xFF``, which no stop string contains.
    Other tokenizers: ``tokenizer.decode([i], skip_special_tokens=False)`` per id. Cached per
    tokenizer object.

    Args:
        tokenizer: The tokenizer (``vocab_size`` and ``backend`` or ``decode``).

    Returns:
        One ``bytes`` per id in ``[0, tokenizer.vocab_size)``.

    Examples:
        >>> from artifex.generative_models.inference.stop_strings import token_bytes
        >>> from artifex.generative_models.models.causal_lm import Tokenizer
        >>> tok = Tokenizer.for_characters("ab ")
        >>> token_bytes(tok)[tok.encode("a", add_special_tokens=False)[0]]
        b'a'
        >>> token_bytes(tok)[tok.eos_ids[0]]  # special tokens as their text
        b'<eos>'
    """
    try:
        return _TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    size = int(tokenizer.vocab_size)
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "id_to_token"):
        out = _backend_token_bytes(backend, size)
    else:
        out = tuple(
            tokenizer.decode([i], skip_special_tokens=False).encode("utf-8") for i in range(size)
        )
    with contextlib.suppress(TypeError):  # not weakly referenceable: no cache
        _TOKEN_BYTES[tokenizer] = out
    return out


def _backend_token_bytes(backend: Any, size: int) -> tuple[bytes, ...]:
    types = _decoder_types(backend)
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    byte_level = "ByteLevel" in types
    alphabet = _byte_level_alphabet() if byte_level else {}
    byte_fallback = "ByteFallback" in types
    out: list[bytes] = []
    for i in range(size):
        if i in added:
            out.append(added[i].encode("utf-8"))
            continue
        piece = backend.id_to_token(i)
        if piece is None:
            out.append(b"")
        elif byte_level:
            out.append(bytes(alphabet.get(c, 0xFF) for c in piece))
        elif byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            text = backend.decode([i], skip_special_tokens=False)
            if piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text  # a decoder strips the space of a text's first token only
            out.append(_BREAK if "\ufffd" in text and "\ufffd" not in piece else text.encode())
    return tuple(out)


def _byte_automaton(patterns: Sequence[bytes]) -> np.ndarray:
    """Aho-Corasick transitions ``(S, 256)`` over bytes; state ``S - 1`` is the absorbing match."""
    children: list[dict[int, int]] = [{}]
    ends = [False]
    for pattern in patterns:
        state = 0
        for b in pattern:
            if b not in children[state]:
                children.append({})
                ends.append(False)
                children[state][b] = len(children) - 1
            state = children[state][b]
        ends[state] = True
    n = len(children)
    match = n
    delta = np.zeros((n + 1, 256), np.int32)
    fail = [0] * n
    for b, child in children[0].items():
        delta[0, b] = child
    queue = deque(children[0].values())
    while queue:  # breadth first: a state's failure link is shallower, so it is done before it
        state = queue.popleft()
        ends[state] = ends[state] or ends[fail[state]]
        delta[state] = delta[fail[state]]
        for b, child in children[state].items():
            fail[child] = int(delta[fail[state], b]) if state else 0
            delta[state, b] = child
            queue.append(child)
    remap = np.arange(n + 1, dtype=np.int32)
    remap[np.flatnonzero(ends)] = match  # reaching the end of any stop string is the match
    delta = remap[delta]
    delta[match] = match
    return delta


def stop_string_table(
    tokenizer: Any, stop_strings: Sequence[str], vocab_size: int | None = None
) -> np.ndarray:
    """The token-level automaton of ``stop_strings``: ``next[state, token]``, int32.

    State 0 is the start of a turn; the last state (``table.shape[0] - 1``) is the match state,
    which is absorbing. From state 0, running a turn's tokens through the table reaches the
    match state at the first token after which the turn's text (special tokens written out)
    contains one of the stop strings.

    Args:
        tokenizer: The tokenizer (see :func:`token_bytes`).
        stop_strings: Non-empty strings.
        vocab_size: Columns of the table (the model's vocabulary, which may be larger than the
            tokenizer's: ids past the tokenizer's write nothing); default the tokenizer's.

    Returns:
        ``(S, vocab_size)`` int32 with ``S`` at most the total length of the stop strings in
        UTF-8 bytes plus 2.

    Raises:
        ValueError: No stop string, an empty one, or ``vocab_size`` smaller than the tokenizer's.
        TypeError: A stop string that is not a ``str``.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.inference.stop_strings import stop_string_table
        >>> from artifex.generative_models.models.causal_lm import Tokenizer
        >>> tok = Tokenizer.for_characters("<>/ab ")
        >>> table = stop_string_table(tok, ["</a>"])
        >>> def matched_at(text):  # the token after which the text contains the stop string
        ...     state = 0
        ...     for i, token in enumerate(tok.encode(text, add_special_tokens=False)):
        ...         state = table[state, token]
        ...         if state == table.shape[0] - 1:
        ...             return i
        >>> matched_at("b </a> a"), matched_at("</b>")
        (5, None)
    """
    if isinstance(stop_strings, str) or not stop_strings:
        msg = f"stop_string_table: stop_strings must be a non-empty sequence, got {stop_strings!r}"
        raise ValueError(msg)
    for j, s in enumerate(stop_strings):
        if not isinstance(s, str):
            msg = f"stop_string_table: stop_strings[{j}] must be a str, got {type(s).__name__}"
            raise TypeError(msg)
        if not s:
            msg = f"stop_string_table: stop_strings[{j}] is empty"
            raise ValueError(msg)
    pieces = token_bytes(tokenizer)
    width = len(pieces) if vocab_size is None else int(vocab_size)
    if width < len(pieces):
        msg = (
            f"stop_string_table: vocab_size ({width}) is smaller than the tokenizer's "
            f"({len(pieces)})"
        )
        raise ValueError(msg)
    key = (tuple(stop_strings), width)
    try:
        cached = _TABLES.setdefault(tokenizer, {}).get(key)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    delta = _byte_automaton([s.encode("utf-8") for s in stop_strings])
    states = delta.shape[0]
    lengths = np.zeros(width, np.int64)
    lengths[: len(pieces)] = [len(p) for p in pieces]
    flat = np.frombuffer(b"".join(pieces), np.uint8)
    starts = np.zeros(width, np.int64)
    starts[1 : len(pieces)] = np.cumsum(lengths[: len(pieces) - 1])
    # Run every token's bytes from every state, longest tokens first, so that step j only
    # touches the tokens longer than j.
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths, sorted_starts = lengths[order], starts[order]
    current = np.repeat(np.arange(states, dtype=np.int32)[:, None], width, axis=1)
    for j in range(int(sorted_lengths[0]) if width else 0):
        count = int(np.searchsorted(-sorted_lengths, -j, side="left"))  # tokens longer than j
        byte = flat[sorted_starts[:count] + j]
        current[:, :count] = delta[current[:, :count], byte[None, :]]
    table = np.empty_like(current)
    table[:, order] = current
    table.flags.writeable = False  # shared by every caller through the cache
    with contextlib.suppress(TypeError):
        _TABLES.setdefault(tokenizer, {})[key] = table
    return table
