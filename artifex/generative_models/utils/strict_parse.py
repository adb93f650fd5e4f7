"""JSON and YAML readers that refuse a mapping with a repeated key.

``json.loads`` and ``yaml.safe_load`` keep the last value of a repeated key without a word, so
a config file with ``learning_rate`` twice, or a dataset line with two ``answer`` fields, is
read as something else than its author may believe. These readers raise a ``ValueError`` naming
the file, the line and the key instead.
"""

from __future__ import annotations

import contextlib
import json
import json.scanner
from typing import Any

__all__ = ["DuplicateKeyError", "json_loads_unique", "yaml_load_unique"]


class DuplicateKeyError(ValueError):
    """A JSON object or YAML mapping holds one key twice (file, line and key in the message).

    Examples:
        >>> from artifex.generative_models.utils.strict_parse import DuplicateKeyError
        >>> issubclass(DuplicateKeyError, ValueError)
        True
    """


class _Repeated(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Repeated(key)
        out[key] = value
    return out


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _second_key(text: str, i: int, key: str) -> int | None:
    """Index of the second ``key`` of the object whose ``{`` precedes index ``i``."""
    decoder = json.JSONDecoder()
    seen = False
    i = _skip(text, i)
    while i < len(text) and text[i] == '"':
        start = i
        name, i = json.decoder.scanstring(text, i + 1)
        if name == key:
            if seen:
                return start
            seen = True
        i = _skip(text, _skip(text, i) + 1)  # past the ':'
        _, i = decoder.raw_decode(text, i)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
    return None


def _line_of_repeat(text: str) -> int | None:
    """The line (1-based) of the first repeated key of ``text``, parsed again to find it."""
    found: list[int] = []
    decoder = json.JSONDecoder(object_pairs_hook=_unique_pairs)
    parse_object = decoder.parse_object

    def located(s_and_end: tuple[str, int], *args: Any) -> Any:
        try:
            return parse_object(s_and_end, *args)
        except _Repeated as err:
            if not found:
                at = _second_key(s_and_end[0], s_and_end[1], err.key)
                found.append(-1 if at is None else at)
            raise

    decoder.parse_object = located
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    with contextlib.suppress(_Repeated):
        decoder.decode(text)
    return text.count("\n", 0, found[0]) + 1 if found and found[0] >= 0 else None


def json_loads_unique(text: str, where: str, *, line: int | None = None) -> Any:
    """``json.loads(text)``, refusing an object with a repeated key.

    Args:
        text: The JSON text.
        where: The file, named in errors.
        line: The line of the file ``text`` is (a JSON Lines record); ``None``: ``text`` is
            the whole file and the line is searched for.

    Returns:
        The parsed value.

    Raises:
        DuplicateKeyError: A key repeated in one object (``where:line: ... key 'k'``).
        json.JSONDecodeError: Invalid JSON (as ``json.loads`` raises it).

    Examples:
        >>> from artifex.generative_models.utils.strict_parse import json_loads_unique
        >>> json_loads_unique('{"a": 1, "b": 2}', "rows.jsonl", line=3)
        {'a': 1, 'b': 2}
        >>> json_loads_unique('{"a": 1, "a": 2}', "rows.jsonl", line=3)
        Traceback (most recent call last):
            ...
        artifex.generative_models.utils.strict_parse.DuplicateKeyError: rows.jsonl:3: key 'a' ...
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _Repeated as err:
        at = line if line is not None else _line_of_repeat(text)
        place = where if at is None else f"{where}:{at}"
        msg = (
            f"{place}: key {err.key!r} appears twice in one object (JSON keeps only the last "
            "value): remove one of them"
        )
        raise DuplicateKeyError(msg) from None


def yaml_load_unique(text: str, where: str) -> Any:
    r"""``yaml.safe_load(text)``, refusing a mapping with a repeated key.

    Args:
        text: The YAML text.
        where: The file, named in errors.

    Returns:
        The parsed value.

    Raises:
        DuplicateKeyError: A key repeated in one mapping (``where:line: ... key 'k'``).
        yaml.YAMLError: Invalid YAML.

    Examples:
        >>> from artifex.generative_models.utils.strict_parse import yaml_load_unique
        >>> yaml_load_unique("a: 1\nb: 2\n", "run.yaml")
        {'a': 1, 'b': 2}
        >>> yaml_load_unique("a: 1\nb: 2\na: 3\n", "run.yaml")
        Traceback (most recent call last):
            ...
        artifex.generative_models.utils.strict_parse.DuplicateKeyError: run.yaml:3: key 'a' ...
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: let PyYAML report it
                break
            if repeated:
                msg = (
                    f"{where}:{key_node.start_mark.line + 1}: key {key!r} appears twice in one "
                    "mapping (YAML keeps only the last value): remove one of them"
                )
                raise DuplicateKeyError(msg)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(
        yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping
    )
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass
