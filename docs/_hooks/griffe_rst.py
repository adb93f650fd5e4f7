"""Griffe extension: renders the reST bits of the library's docstrings in Markdown.

The docstrings are Google style with a few reStructuredText constructs that Markdown does not
know. When the package has been loaded, this extension rewrites, in every docstring:

- ``.. math::`` blocks into ``$$ ... $$`` blocks (typeset by MathJax through arithmatex);
- the literal-block marker ``text::`` into ``text:`` (the indented block after it is already a
  Markdown code block), and a lone ``Example::`` into a bold label, not a Google section;
- ``>>>`` examples outside an ``Examples:`` section (in an ``Example:`` admonition, say) into
  ``pycon`` code blocks, which Markdown would otherwise show as nested blockquotes, with
  reference links made of their subscripts (:func:`doctest_blocks`);
- ``:func:`name```, ``:class:`~pkg.mod.Name``` and the other Python roles into links to the
  object's API entry (``~`` shows the last component only). Names are resolved like Python
  would, from the object's class and module; a link whose target is not rendered anywhere falls
  back to plain code, so this never breaks a strict build.

It also hides the undocumented special methods of classes (``__post_init__``, ``__repr__``...),
which the reference would otherwise list because it shows members without docstrings;
``__init__`` (merged into the class signature) and ``__call__`` stay. Undocumented attributes of
classes are hidden too: the class's Attributes or Args section documents them. Hidden members
are marked private (the ``public`` filter of mkdocstrings skips them), never deleted: griffe's
built-in dataclasses extension, which runs after every configured extension, builds each
dataclass's ``__init__`` from the class's fields; deleting them left ``GRPOConfig.__init__``
with ``self`` only, so the reference showed ``GRPOConfig()`` and griffe warned about every
documented parameter. Classes made dataclasses by ``flax.struct.dataclass`` (or
``chex.dataclass``), which griffe does not know, get their ``__init__`` here
(:func:`dataclass_init`).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE_RE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")
_MATH_RE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*$")
_LITERAL_RE = re.compile(r"^(?P<indent>[ \t]*)(?P<text>.*?)::[ \t]*$")


def math_blocks(text: str) -> str:
    r"""Turns every ``.. math::`` directive into a ``$$`` display block.

    Args:
        text: A docstring.

    Returns:
        The docstring with ``$$ ... $$`` blocks at the directive's indentation; in a list
        item whose text is indented by two columns (reST style), at four columns past the
        marker, where Markdown looks for a list item's blocks (at two, arithmatex left the
        ``$$`` as text).
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_RE.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        item = _list_item_indent(out, len(indent))
        i += 1
        body: list[str] = []
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        content = [b for b in body if b.strip()]
        strip = min((len(b) - len(b.lstrip()) for b in content), default=0)
        if item is not None:
            indent = " " * (item + 4)
        out += [f"{indent}$$"] + [f"{indent}{b[strip:]}" for b in content] + [f"{indent}$$", ""]
    return "\n".join(out)


_LIST_ITEM_RE = re.compile(r"^(?P<indent>[ \t]*)(?:[-*+]|\d+[.)])[ \t]+\S")


def _list_item_indent(before: list[str], column: int) -> int | None:
    """Indentation of the list marker whose item's text starts at ``column``, if any.

    Looks back from the end of ``before`` to the last non-blank line indented less than
    ``column``; returns its indentation when it is a list item (``- text``, ``1. text``) whose
    text starts at ``column`` and ``column`` is not already four columns past the marker.
    """
    for line in reversed(before):
        if not line.strip() or len(line) - len(line.lstrip()) >= column:
            continue
        match = _LIST_ITEM_RE.match(line)
        if match is None:
            return None
        marker = len(match.group("indent"))
        text_column = len(line) - len(line[match.end() - 1 :])
        return marker if text_column == column and column < marker + 4 else None
    return None


def literal_markers(text: str) -> str:
    """Turns reST literal-block markers (``text::``) into Markdown.

    Args:
        text: A docstring (after :func:`math_blocks`).

    Returns:
        The docstring with ``text::`` as ``text:``, a lone word (``Example::``) as a bold label
        and a bare ``::`` line dropped.
    """

    def convert(line: str) -> str | None:
        match = _LITERAL_RE.match(line)
        if match is None or line.lstrip().startswith(".."):
            return line
        indent, body = match.group("indent"), match.group("text").rstrip()
        if not body:
            return None
        if re.fullmatch(r"\w+", body):
            return f"{indent}**{body}:**"
        return f"{indent}{body}:"

    return "\n".join(line for line in map(convert, text.splitlines()) if line is not None)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def doctest_blocks(text: str) -> str:
    """Puts ``>>>`` examples outside an ``Examples:`` section into ``pycon`` code blocks.

    griffe shows the ``>>>`` lines of an ``Examples:`` section as code; anywhere else (an
    ``Example:`` or ``Note:`` admonition, a description) they are Markdown prose, where ``>>>``
    makes nested blockquotes and ``x[0][:2]`` a reference link that autorefs cannot resolve (a
    warning, so a failed strict build). A run of such lines, up to a blank line or a dedent,
    becomes a fenced block. Examples sections, fenced blocks and indented code blocks (after a
    blank line, four columns deeper than the text before them) are left as they are.

    Args:
        text: A docstring (after :func:`literal_markers`).

    Returns:
        The docstring with those examples fenced.
    """
    lines = text.splitlines()
    out: list[str] = []
    in_examples = in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped and _indent(line) == 0 and not in_fence:
            in_examples = stripped.lower() == "examples:"
        if stripped.startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_examples or in_fence or not stripped.startswith(">>>") or _indented_code(out, line):
            out.append(line)
            i += 1
            continue
        indent = line[: _indent(line)]
        block = []
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) >= len(indent):
            block.append(lines[i])
            i += 1
        # A blank line before the fence, except after a shallower line (a section or admonition
        # title, or the first line of a description), where it would end what the block is in.
        if out and out[-1].strip() and _indent(out[-1]) >= len(indent):
            out.append("")
        out += [f"{indent}```pycon", *block, f"{indent}```"]
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


def _indented_code(before: list[str], line: str) -> bool:
    """Whether ``line``, after the lines ``before``, is in a Markdown indented code block."""
    if not before or before[-1].strip():
        return False  # no blank line before it: a paragraph's or an admonition's text
    text = [b for b in before if b.strip()]
    return bool(text) and _indent(line) >= _indent(text[-1]) + 4


def _resolve(name: str, obj: griffe.Object) -> str | None:
    """Dotted path of ``name`` as seen from ``obj`` (its class, then its module), or None."""
    if name.startswith("artifex."):
        return name
    head, _, rest = name.partition(".")
    scope: Any = obj
    while scope is not None:
        member = scope.members.get(head) if hasattr(scope, "members") else None
        if member is not None:
            try:
                path = member.final_target.path if member.is_alias else member.path
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                path = member.target_path
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return None


def roles(text: str, obj: griffe.Object) -> str:
    """Turns reST Python roles into (optional) cross-references.

    Args:
        text: A docstring.
        obj: The object the docstring belongs to (for resolving relative names).

    Returns:
        The docstring with ``<autoref>`` links; unresolved names become code.
    """

    def replace(match: re.Match[str]) -> str:
        tilde, name = match.groups()
        name = name.strip()
        title = name.rsplit(".", 1)[-1] if tilde else name
        path = _resolve(name, obj)
        if path is None:
            return f"`{title}`"
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    return _ROLE_RE.sub(replace, text)


# Decorators that make a class a dataclass besides ``dataclasses.dataclass`` (which griffe's
# built-in extension handles): griffe does not know them, so the class had no ``__init__``.
_OTHER_DATACLASS_DECORATORS = frozenset({"flax.struct.dataclass", "chex.dataclass"})


def _call_arguments(value: Any) -> dict[str, Any] | None:
    """Keyword arguments of a ``field(...)`` call expression (any module's), else None."""
    if isinstance(value, griffe.ExprCall) and str(value.function).split(".")[-1] == "field":
        return {a.name: a.value for a in value.arguments if isinstance(a, griffe.ExprKeyword)}
    return None


def dataclass_init(cls: griffe.Class) -> None:
    """Gives a flax/chex dataclass the ``__init__`` that its decorator generates.

    The parameters are the class's annotated fields in order (properties and ``ClassVar``
    attributes excepted), with the defaults of their values or of their
    ``field(default=...)``; a field with ``init=False`` is left out. Does nothing for other
    classes and for a class that defines ``__init__``.

    Args:
        cls: A class of the loaded package.
    """
    paths = {d.value.canonical_path for d in cls.decorators if isinstance(d.value, griffe.Expr)}
    paths |= {str(d.value) for d in cls.decorators}
    if "__init__" in cls.members or not paths & _OTHER_DATACLASS_DECORATORS:
        return
    params = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for member in cls.members.values():
        if member.is_alias or not member.is_attribute or member.annotation is None:
            continue
        # Properties, and ClassVar attributes (griffe labels them class attributes only), as
        # griffe's own dataclasses extension decides.
        labels = member.labels
        if {"property", "cached_property"} & labels or (
            "class-attribute" in labels and "instance-attribute" not in labels
        ):
            continue
        default = member.value
        field = _call_arguments(member.value)
        if field is not None:
            if str(field.get("init")) == "False":
                continue
            default = field.get("default")
            if "default_factory" in field:
                default = griffe.ExprCall(function=field["default_factory"], arguments=[])
        params.append(
            griffe.Parameter(
                member.name,
                annotation=member.annotation,
                kind=griffe.ParameterKind.positional_or_keyword,
                default=default,
            )
        )
    init = griffe.Function(
        "__init__",
        lineno=0,
        endlineno=0,
        parent=cls,
        parameters=griffe.Parameters(*params),
        returns="None",
    )
    cls.set_member("__init__", init)
    cls.labels.add("dataclass")


class RestToMarkdown(griffe.Extension):
    """Rewrites reST math blocks and roles in every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Called by griffe once the whole package is loaded.

        Args:
            pkg: The package.
            **kwargs: Other event arguments (unused).
        """
        self._visit(pkg, set())

    def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            text = doctest_blocks(literal_markers(math_blocks(obj.docstring.value)))
            obj.docstring.value = roles(text, obj)
        if obj.is_class:
            dataclass_init(obj)
            # Hidden, not deleted: griffe's dataclasses extension runs after this one and builds
            # a dataclass's ``__init__`` (the signature and its defaults) from these members, and
            # the Attributes section takes its types from them.
            for name, member in obj.members.items():
                if _hidden(name, member):
                    member.public = False
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member, seen)


def _hidden(name: str, member: griffe.Object | griffe.Alias) -> bool:
    special = name.startswith("__") and name.endswith("__")
    if special:
        return name not in ("__init__", "__call__") and member.docstring is None
    # Undocumented attributes (``self.mesh = mesh``, dataclass fields) would render as
    # ``mesh = mesh`` or twice; the class's Attributes/Args section documents them.
    return not member.is_alias and member.is_attribute and member.docstring is None
