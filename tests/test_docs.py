"""The API reference covers every public name, and public docstrings follow the house style.

The reference pages are generated at build time by ``docs/_hooks/api_pages.py``; these tests read
the same generator (plus any hand-written ``:::`` directive under ``docs/``) instead of building
the site. ``mkdocs build --strict`` itself runs in ``.ci/run``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

import artifex

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_api_pages", DOCS / "_hooks" / "api_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


api_pages = _load_hook()


def public_modules() -> dict[str, ModuleType]:
    """Every importable ``artifex`` module that declares ``__all__``."""
    found = {"artifex": artifex}
    for info in pkgutil.walk_packages(artifex.__path__, "artifex."):
        found[info.name] = importlib.import_module(info.name)
    return {name: mod for name, mod in sorted(found.items()) if hasattr(mod, "__all__")}


def public_objects() -> Iterator[tuple[str, str, Any]]:
    """``(module, name, object)`` for every name in every ``__all__``."""
    for module_name, module in public_modules().items():
        for name in module.__all__:
            yield module_name, name, getattr(module, name)


# --------------------------------------------------------------------------- (a) coverage
_DIRECTIVE_RE = re.compile(r"^::: *(?P<ident>[\w.]+) *\n(?P<options>(?:[ \t]+.*\n?)*)", re.M)


def directives(markdown: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(identifier, options)`` of each mkdocstrings ``:::`` directive in ``markdown``."""
    for match in _DIRECTIVE_RE.finditer(markdown):
        block = yaml.safe_load(textwrap.dedent(match.group("options"))) or {}
        yield match.group("ident"), block.get("options") or {}


def all_markdown() -> dict[str, str]:
    pages = {str(p.relative_to(DOCS)): p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md")}
    pages.update(api_pages.api_pages(ROOT))
    return pages


def rendered_paths() -> set[str]:
    """Dotted paths of the objects that some ``:::`` directive renders."""
    modules = public_modules()
    rendered: set[str] = set()
    for markdown in all_markdown().values():
        for ident, options in directives(markdown):
            rendered.add(ident)
            members = options.get("members")
            if isinstance(members, list):
                rendered.update(f"{ident}.{m}" for m in members)
            elif members is not False and ident in modules:
                rendered.update(f"{ident}.{m}" for m in modules[ident].__all__)
    return rendered


def _object_at(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def test_hook_finds_the_same_public_modules_as_an_import_walk():
    static = {info.name: info.public for info in api_pages.public_modules(ROOT)}
    dynamic = {name: tuple(mod.__all__) for name, mod in public_modules().items()}
    assert static == dynamic


def test_every_public_name_is_in_the_api_reference():
    rendered = rendered_paths()
    rendered_ids = {id(obj) for obj in map(_object_at, rendered) if obj is not None}
    missing = [
        f"{module}.{name}"
        for module, name, obj in public_objects()
        if f"{module}.{name}" not in rendered and id(obj) not in rendered_ids
    ]
    assert not missing, "public names missing from the API reference:\n" + "\n".join(missing)


def test_reexport_tables_link_to_rendered_objects():
    rendered = rendered_paths()
    broken = [
        f"{info.name}.{name} -> {target}"
        for info in api_pages.public_modules(ROOT)
        for name, target in info.reexported.items()
        if target not in rendered
    ]
    assert not broken, "re-exported names whose target is not rendered:\n" + "\n".join(broken)


def test_nav_and_pages_exist():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_IgnoreTags)

    def pages(nav: Any) -> Iterator[str]:
        if isinstance(nav, str):
            yield nav
        elif isinstance(nav, list):
            for item in nav:
                yield from pages(item)
        elif isinstance(nav, dict):
            for value in nav.values():
                yield from pages(value)

    missing = [p for p in pages(config["nav"]) if not (DOCS / p).is_file()]
    assert not missing, f"nav pages missing from docs/: {missing}"


def test_every_public_module_is_in_a_group_of_the_api_navigation():
    modules = {info.name for info in api_pages.public_modules(ROOT)}
    placed = [m for group in api_pages.GROUPS for m in group.modules]
    assert len(placed) == len(set(placed)), "a module is in two groups"
    assert not modules - set(placed), f"modules in no group: {sorted(modules - set(placed))}"
    assert not set(placed) - modules, f"groups name unknown modules: {set(placed) - modules}"


def test_api_navigation_is_grouped_with_an_index_page():
    config = {"nav": [{"Home": "index.md"}]}
    api_pages.on_config(config)
    ((title, entries),) = config["nav"][-1].items()
    assert title == "API reference"
    assert entries[0] == {"Overview": "api/index.md"}
    groups = [next(iter(e)) for e in entries[1:]]
    assert groups == [g.title for g in api_pages.GROUPS]
    index = api_pages.api_pages(ROOT)["api/index.md"]
    for group in api_pages.GROUPS:
        assert f"## {group.title}" in index
        for module in group.modules:
            assert f"[`{module}`]({module}.md)" in index


class _IgnoreTags(yaml.SafeLoader):
    """Reads mkdocs.yml, whose ``!!python/name:`` tags a safe loader would refuse."""


_IgnoreTags.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
_IgnoreTags.add_constructor("!ENV", lambda loader, node: None)


# --------------------------------------------------------------------------- (b) docstrings
# Offenders in library code, reported to its owners; new offenders fail the test. Delete an
# entry once its docstring is fixed (a stale entry is harmless).
KNOWN_OFFENDERS: set[str] = set()


def _own_doc(obj: Any) -> str:
    """The object's own docstring (not inherited, not a dataclass's generated signature)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc:
        return ""
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""  # dataclasses fill in the signature when the class has no docstring
    return inspect.cleandoc(doc)


def _section(doc: str, *titles: str) -> str | None:
    """The body of the first Google-style section with one of ``titles``, or None."""
    pattern = rf"^(?:{'|'.join(titles)}):[ \t]*\n(?P<body>(?:[ \t]+.*\n?|[ \t]*\n)*)"
    match = re.search(pattern, doc + "\n", re.M)
    return None if match is None else match.group("body")


def _parameters(func: Any) -> list[str]:
    """Names of the parameters a caller passes (``self``/``cls`` excluded)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name not in ("self", "cls")]


def _init_parameters(cls: type) -> list[str]:
    names = _parameters(cls)
    if names == ["args", "kwargs"] and cls.__init__ is not object.__init__:
        names = _parameters(cls.__init__)  # metaclasses (nnx.Module) hide the signature
    return names


def _returns_value(func: Any) -> bool:
    """Whether a function returns something: by its annotation, else by its source."""
    annotation = inspect.signature(func).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None", "NoReturn", "Never")
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(tree.body[0]))


def _is_record(cls: type) -> bool:
    """Dataclasses and named tuples document their fields as ``Attributes:``."""
    return dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def _undocumented(names: list[str], section: str) -> list[str]:
    return [n for n in names if not re.search(rf"^\s+\**{re.escape(n)}\b[^:\n]*:", section, re.M)]


def docstring_problems(obj: Any) -> list[str]:
    """What the docstring of a public function or class lacks (empty when nothing).

    Functions: a docstring; an ``Args:`` section naming every parameter (if any); a
    ``Returns:`` (or ``Yields:``) section if they return something. Classes: a docstring and an
    ``Args:`` section naming every constructor parameter, in the class or ``__init__``
    docstring (``Attributes:`` for dataclasses and named tuples); no ``Returns:``.
    """
    doc = _own_doc(obj)
    if not doc:
        return ["no docstring"]
    if inspect.isclass(obj):
        if getattr(obj, "_is_protocol", False):
            return []
        names = _init_parameters(obj)
        titles = ("Args", "Attributes") if _is_record(obj) else ("Args",)
        init_doc = _own_doc(obj.__init__) if "__init__" in obj.__dict__ else ""
        section = _section(doc, *titles)
        section = _section(init_doc, "Args") if section is None else section
        if not names:
            return []
        if section is None:
            return [f"no {' or '.join(t + ':' for t in titles)} section"]
        missing = _undocumented(names, section)
        return [f"parameters not in {titles[0]}: {missing}"] if missing else []
    func = inspect.unwrap(obj)
    problems = []
    names = _parameters(func)
    section = _section(doc, "Args")
    if names and section is None:
        problems.append("no Args: section")
    elif names and _undocumented(names, section):
        problems.append(f"parameters not in Args: {_undocumented(names, section)}")
    if _returns_value(func) and _section(doc, "Returns", "Yields") is None:
        problems.append("no Returns: section")
    return problems


def _is_artifex_code(obj: Any) -> bool:
    target = inspect.unwrap(obj) if callable(obj) else obj
    is_code = inspect.isclass(target) or inspect.isfunction(target)
    return is_code and getattr(target, "__module__", "").startswith("artifex")


def documented_objects() -> Iterator[tuple[str, Any]]:
    """``(path, object)``: public functions and classes, and the public methods of the classes."""
    seen: set[int] = set()
    for _module, name, obj in public_objects():
        if id(obj) in seen or not _is_artifex_code(obj):
            continue
        seen.add(id(obj))
        path = f"{inspect.unwrap(obj).__module__}.{name}"
        yield path, obj
        if not inspect.isclass(obj) or getattr(obj, "_is_protocol", False):
            continue
        for attr, member in vars(obj).items():
            func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            public = not attr.startswith("_") or attr == "__call__"
            if public and inspect.isfunction(func) and _is_artifex_code(func):
                yield f"{path}.{attr}", func


def test_public_functions_and_classes_have_google_docstrings():
    offenders = []
    for path, obj in documented_objects():
        problems = docstring_problems(obj)
        if problems and path not in KNOWN_OFFENDERS:
            offenders.append(f"{path}: {'; '.join(problems)}")
    assert not offenders, f"{len(offenders)} docstring offenders:\n" + "\n".join(offenders)


# --------------------------------------------------------------------------- self-checks
def test_docstring_check_catches_missing_sections():
    def no_sections(x: int) -> int:
        """Doubles."""
        return 2 * x

    def complete(x: int) -> int:
        """Doubles.

        Args:
            x: A number.

        Returns:
            ``2 x``.
        """
        return 2 * x

    def unannotated(x):
        """Prints.

        Args:
            x: A value.
        """
        print(x)

    def partial(x: int, *, scale: int = 2, **extra: int) -> int:
        """Scales.

        Args:
            x: A number.

        Returns:
            ``scale x``.
        """
        return scale * x

    @dataclasses.dataclass
    class Record:
        a: int

    @dataclasses.dataclass
    class Documented:
        """A record.

        Attributes:
            a: A field.
        """

        a: int

    class Plain:
        """A class.

        Args:
            a: A value.
        """

        def __init__(self, a: int, b: int):
            self.a, self.b = a, b

    assert docstring_problems(no_sections) == ["no Args: section", "no Returns: section"]
    assert docstring_problems(complete) == []
    assert docstring_problems(unannotated) == []
    assert docstring_problems(partial) == ["parameters not in Args: ['scale', 'extra']"]
    assert docstring_problems(Record) == ["no docstring"]
    assert docstring_problems(Documented) == []
    assert docstring_problems(Plain) == ["parameters not in Args: ['b']"]


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("::: a.b\n", {"a.b": {}}),
        ("::: a.b\n    options:\n      members: [x, y]\n", {"a.b": {"members": ["x", "y"]}}),
        ("text\n::: a.c\n    options:\n      members: false\n\nmore", {"a.c": {"members": False}}),
    ],
)
def test_directive_parser(markdown, expected):
    assert dict(directives(markdown)) == expected
