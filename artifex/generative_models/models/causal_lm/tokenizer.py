"""Tokenizer: Hugging Face `tokenizer.json` + chat templates, without transformers.

`Tokenizer.from_pretrained` reads the files transformers writes (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja` / `chat_template.json`,
`generation_config.json`) and reproduces transformers' `encode`, `decode` and
`apply_chat_template` (same Jinja environment and globals). `Tokenizer.for_characters` builds a
character-level tokenizer in memory for toy tasks.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from artifex.generative_models.models.causal_lm.chat_template import render_chat_template
from artifex.generative_models.utils.atomic import atomic_write_json, commit_file, temp_path
from artifex.generative_models.utils.tool_schema import tool_schema

__all__ = ["Tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_str(value: Any) -> str | None:
    """A special token given as a string or a serialised `AddedToken` dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    msg = f"special token must be a string or an AddedToken dict, got {value!r}"
    raise ValueError(msg)


def _clean_up_tokenization(text: str) -> str:
    """Transformers' `clean_up_tokenization` (removes spaces before punctuation/contractions)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class Tokenizer:
    """Text <-> token ids, chat templates and padding for a language model.

    Wraps a `tokenizers.Tokenizer` with the special tokens and chat template from the
    transformers files. `pad_id` falls back to the (first) eos id when the tokenizer defines no
    pad token, which is what Hugging Face users usually set; padding positions are masked, so the
    id only has to be valid.

    Args:
        backend: The `tokenizers.Tokenizer` (with its post-processor deciding which special
            tokens `encode(add_special_tokens=True)` adds).
        bos_token: Beginning-of-sequence token string or None.
        eos_token: End-of-sequence token string or None.
        pad_token: Padding token string or None.
        unk_token: Unknown token string or None.
        chat_template: Jinja chat template or None.
        extra_eos_ids: More ids that end a generation (e.g. from generation_config.json).
        clean_up_tokenization_spaces: Apply transformers' space clean-up in `decode` (ignored
            for BPE models, as transformers 5 does).

    Raises:
        ValueError: If a special token is not in the vocabulary.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import Tokenizer
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> ids = tok.encode("1+2=")
        >>> ids, tok.decode(ids)
        ([1, 5, 14, 6, 15], '1+2=')
        >>> ids, mask = tok.pad_batch([tok.encode("1+2="), tok.encode("3=")])
        >>> ids.tolist(), mask.tolist()
        ([[1, 5, 14, 6, 15], [0, 0, 1, 7, 15]], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._bos_id = self._id_of("bos_token", bos_token)
        eos_id = self._id_of("eos_token", eos_token)
        self._pad_id = self._id_of("pad_token", pad_token)
        self._id_of("unk_token", unk_token)
        eos: list[int] = [] if eos_id is None else [eos_id]
        for e in extra_eos_ids:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.vocab_size:
                msg = f"extra_eos_ids: expected ids in [0, {self.vocab_size}), got {e!r}"
                raise ValueError(msg)
            if e not in eos:
                eos.append(e)
        self._eos_ids = tuple(eos)

    def _id_of(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            msg = f"{name}: token {token!r} is not in the vocabulary"
            raise ValueError(msg)
        return token_id

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads a tokenizer directory written by transformers.

        Reads `tokenizer.json`; special tokens from `tokenizer_config.json` and
        `special_tokens_map.json` (strings or AddedToken dicts); the chat template from
        `tokenizer_config.json`, `chat_template.jinja` or `chat_template.json` (a list of named
        templates picks "default"); extra eos ids from `generation_config.json`.

        Args:
            path: The directory.

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: If `tokenizer.json` is missing.
            ValueError: If a special token is not in the vocabulary.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> tok = Tokenizer.from_pretrained("tests/fixtures/tokenizer_tiny")  # from repo root
            >>> tok.vocab_size, tok.bos_token, tok.eos_ids  # eos ids of generation_config.json
            (400, '<|bos|>', (2, 4))
            >>> ids = tok.encode("hello world")
            >>> ids, tok.decode(ids)
            ([1, 264, 305, 383], 'hello world')
        """
        directory = os.fspath(path)
        tok_path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(tok_path):
            msg = f"no tokenizer.json in {directory!r}"
            raise FileNotFoundError(msg)
        backend = _HFTokenizer.from_file(tok_path)

        def read(name: str) -> dict[str, Any]:
            p = os.path.join(directory, name)
            if not os.path.exists(p):
                return {}
            with open(p, encoding="utf-8") as f:
                return json.load(f)

        config = read("tokenizer_config.json")
        special_map = read("special_tokens_map.json")
        tokens = {}
        for name in _SPECIAL_NAMES:
            value = config.get(name, special_map.get(name))
            tokens[name] = _token_str(value)

        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif template is None:
            template = read("chat_template.json").get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))

        generation = read("generation_config.json")
        extra = generation.get("eos_token_id")
        extra_ids = [] if extra is None else ([extra] if isinstance(extra, int) else list(extra))
        return cls(
            backend,
            chat_template=template,
            extra_eos_ids=extra_ids,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            **tokens,
        )

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Writes the tokenizer files that `from_pretrained` and transformers read back.

        `tokenizer.json` holds the tokenizer itself; the special tokens and the chat template
        go to `tokenizer_config.json`; end-of-sequence ids beyond `eos_token` go to
        `generation_config.json` only if that file does not exist yet (a model's
        `save_pretrained` may have written it).

        Args:
            path: The directory (created).

        Examples:
            >>> import os, tempfile
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> tok = Tokenizer.for_characters("abc", chat_template="{{ messages[0]['content'] }}")
            >>> with tempfile.TemporaryDirectory() as out:
            ...     tok.save_pretrained(out)
            ...     files = sorted(os.listdir(out))
            ...     again = Tokenizer.from_pretrained(out)
            >>> files, again.encode("cab") == tok.encode("cab"), again.chat_template
            (['tokenizer.json', 'tokenizer_config.json'], True, "{{ messages[0]['content'] }}")
        """
        directory = os.fspath(path)
        os.makedirs(directory, exist_ok=True)
        tmp = temp_path(os.path.join(directory, "tokenizer.json"))
        try:
            self.backend.save(tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        commit_file(tmp, os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
        }
        for name in _SPECIAL_NAMES:
            value = getattr(self, name, None)
            if value is not None:
                config[name] = value
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        atomic_write_json(os.path.join(directory, "tokenizer_config.json"), config)
        eos = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        extra = [e for e in self._eos_ids if e != eos]
        generation = os.path.join(directory, "generation_config.json")
        if extra and not os.path.exists(generation):
            atomic_write_json(generation, {"eos_token_id": list(self._eos_ids)})

    @classmethod
    def for_characters(
        cls,
        alphabet: str | Iterable[str],
        *,
        bos_token: str = "<bos>",
        eos_token: str = "<eos>",
        pad_token: str = "<pad>",
        unk_token: str | None = "<unk>",
        add_bos: bool = True,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Builds a character-level tokenizer in memory (no files needed).

        Ids: pad 0, bos 1, eos 2, unk 3 (if set), then the characters of `alphabet` in order
        (duplicates dropped). Special token strings in the text are matched as single tokens; every
        other character is one token (unknown ones become `unk_token`). `decode` concatenates
        the characters.

        Args:
            alphabet: The characters (a string or an iterable of single characters).
            bos_token: Beginning-of-sequence token.
            eos_token: End-of-sequence token.
            pad_token: Padding token.
            unk_token: Token for characters outside the alphabet; None makes them an error of
                `encode`.
            add_bos: Whether `encode(add_special_tokens=True)` prepends `bos_token`.
            chat_template: Optional Jinja chat template.

        Returns:
            The tokenizer.

        Raises:
            ValueError: If an alphabet entry is not a single character or is a special token.
        """
        specials = [pad_token, bos_token, eos_token] + ([unk_token] if unk_token else [])
        chars: list[str] = []
        for c in alphabet:
            if not isinstance(c, str) or len(c) != 1:
                msg = f"alphabet entries must be single characters, got {c!r}"
                raise ValueError(msg)
            if c not in chars:
                chars.append(c)
        vocab = {tok: i for i, tok in enumerate(specials + chars)}
        if len(vocab) != len(specials) + len(chars):
            msg = f"alphabet: special tokens {specials} must not be alphabet characters"
            raise ValueError(msg)
        backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
        backend.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in specials]
        )
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        if add_bos:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token} $A",
                pair=f"{bos_token} $A {bos_token} $B:1",
                special_tokens=[(bos_token, vocab[bos_token])],
            )
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            unk_token=unk_token,
            chat_template=chat_template,
        )

    # ------------------------------------------------------------------ properties

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token (None if there is none)."""
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the eos token first, then generation_config's others."""
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        """Id used for padding: the pad token, else the first eos id (HF users' convention).

        Raises:
            ValueError: If the tokenizer has neither a pad nor an eos token.
        """
        if self._pad_id is not None:
            return self._pad_id
        if self._eos_ids:
            return self._eos_ids[0]
        msg = "pad_id: the tokenizer has neither a pad_token nor an eos_token"
        raise ValueError(msg)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------ encode / decode

    def encode(
        self, text: str, add_special_tokens: bool = True, *, split_special_tokens: bool = False
    ) -> list[int]:
        """Tokenises one text.

        Args:
            text: The text.
            add_special_tokens: Whether to let the post-processor add its special tokens
                (e.g. a leading bos).
            split_special_tokens: Encode special-token strings in ``text`` (``"<|im_end|>"``)
                as plain text, never as their special ids (transformers' option of the same
                name): for text that must not be able to write special tokens, such as a
                tool's output placed in a conversation.

        Returns:
            The token ids.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> tok = Tokenizer.for_characters("ab<>eos")
            >>> tok.encode("a<eos>", add_special_tokens=False)
            [4, 2]
            >>> tok.encode("a<eos>", add_special_tokens=False, split_special_tokens=True)
            [4, 6, 8, 9, 10, 7]
        """
        backend = self._plain_backend() if split_special_tokens else self.backend
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _plain_backend(self) -> _HFTokenizer:
        """A copy of the backend that encodes special-token strings as plain text (cached)."""
        cached = getattr(self, "_plain", None)
        size = self.backend.get_vocab_size(with_added_tokens=True)
        if cached is None or cached[0] is not self.backend or cached[1] != size:
            plain = _HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            cached = (self.backend, size, plain)
            self._plain = cached
        return cached[2]

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Tokenises several texts.

        Args:
            texts: The texts.
            add_special_tokens: As in `encode`.

        Returns:
            One id list per text.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> Tokenizer.for_characters("0123456789").encode_batch(["12", "3"])  # bos, then digits
            [[1, 5, 6], [1, 7]]
        """
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Turns ids back into text.

        Args:
            ids: Token ids (a list or 1-D array).
            skip_special_tokens: Whether to drop special tokens (bos, eos, pad, ...).

        Returns:
            The text.
        """
        id_list = [int(i) for i in np.asarray(ids).reshape(-1)]
        text = self.backend.decode(id_list, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and not isinstance(self.backend.model, models.BPE):
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(
        self, batch: Iterable[Iterable[int]] | np.ndarray, skip_special_tokens: bool = True
    ) -> list[str]:
        """Decodes each row of a batch.

        Args:
            batch: Rows of ids (list of lists or a 2-D array).
            skip_special_tokens: As in `decode`.

        Returns:
            One string per row.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> tok = Tokenizer.for_characters("0123456789")  # pad 0, bos 1, eos 2, unk 3
            >>> tok.batch_decode([[1, 5, 6, 2], [0, 1, 7, 2]])  # special tokens dropped
            ['12', '3']
        """
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in batch]

    def pad_batch(
        self,
        sequences: Sequence[Sequence[int]],
        length: int | None = None,
        side: str = "left",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pads id lists into a rectangle with `pad_id`.

        Args:
            sequences: One id list per row.
            length: Output length L; None means the longest row. Rows are never truncated.
            side: "left" (prompts, the default) or "right".

        Returns:
            `(ids, mask)`: int32 ids (B, L) and int32 mask (B, L), 1 on real tokens.

        Raises:
            ValueError: If a row is longer than `length`, or `side` is not "left"/"right".
        """
        if side not in ("left", "right"):
            msg = f"side must be 'left' or 'right', got {side!r}"
            raise ValueError(msg)
        lengths = [len(s) for s in sequences]
        width = max(lengths, default=0) if length is None else length
        ids = np.full((len(sequences), width), self.pad_id, np.int32)
        mask = np.zeros((len(sequences), width), np.int32)
        for b, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            if n > width:
                msg = f"pad_batch: row {b} has {n} tokens, longer than length={width}"
                raise ValueError(msg)
            sl = slice(width - n, width) if side == "left" else slice(0, n)
            ids[b, sl] = np.asarray(seq, np.int32)
            mask[b, sl] = 1
        return ids, mask

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int] | str | list[list[int]] | list[str]:
        """Renders chat messages with the chat template, like transformers.

        The template sees `messages`, `add_generation_prompt`, `tools`, `documents`, the special
        tokens as strings (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and `kwargs`
        (which override the special tokens). With `tokenize=True` the text is encoded with
        `add_special_tokens=False` (the template writes its own).

        Args:
            messages: One conversation (list of message dicts) or a list of conversations.
            add_generation_prompt: Whether to end with the assistant header.
            tokenize: Return ids (True) or the text (False).
            chat_template: Template to use instead of the tokenizer's.
            **kwargs: Extra template variables (e.g. `tools`, `enable_thinking`). `tools` may hold
                JSON schemas or plain functions (converted with `tool_schema`).

        Returns:
            Ids or text; a list of them for a list of conversations.

        Raises:
            ValueError: If there is no chat template or a conversation is empty.

        Examples:
            >>> from artifex.generative_models.models.causal_lm import Tokenizer
            >>> template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            ...             "{% if add_generation_prompt %}<assistant>{% endif %}")
            >>> tok = Tokenizer.for_characters("<>aehinrstu", chat_template=template)
            >>> chat = [{"role": "user", "content": "hi"}]
            >>> tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            '<user>hi<assistant>'
            >>> ids = tok.apply_chat_template(chat, add_generation_prompt=True)
            >>> tok.decode(ids), ids[0] == tok.bos_id  # no bos added: the template writes its own
            ('<user>hi<assistant>', False)
        """
        template = chat_template or self.chat_template
        if template is None:
            msg = "apply_chat_template: this tokenizer has no chat_template; pass chat_template="
            raise ValueError(msg)
        if not messages:
            msg = "apply_chat_template: messages is empty"
            raise ValueError(msg)
        batched = not isinstance(messages[0], Mapping)
        conversations = messages if batched else [messages]
        variables = {
            name: getattr(self, name) for name in _SPECIAL_NAMES if getattr(self, name) is not None
        }
        variables.update(kwargs)
        tools = variables.get("tools")
        if tools is not None and any(callable(t) for t in tools):
            # Plain Python functions become JSON schemas, as transformers does.
            variables["tools"] = [tool_schema(t) if callable(t) else t for t in tools]
        out = []
        for conversation in conversations:
            if not conversation:
                msg = "apply_chat_template: a conversation is empty"
                raise ValueError(msg)
            text = render_chat_template(
                template, conversation, add_generation_prompt=add_generation_prompt, **variables
            )
            out.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        return out if batched else out[0]
