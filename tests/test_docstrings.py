"""The library's docstrings are reference text whose examples a reader can copy and run.

For every module docstring, every public function and class (the names in a module's
``__all__``) and the public methods and properties of those classes that have a docstring:

- public functions and classes have an ``Examples:`` section with at least one ``>>>`` example
  (a class's example may sit in its ``__init__`` docstring);
- every example runs with empty globals, so it imports what it uses itself: an example that
  relies on its module's namespace (as ``tests/test_doc_examples.py`` runs them) fails when a
  reader pastes it into a fresh interpreter;
- no docstring is over 400 words;
- no section is titled ``Example:``: for the Google style that mkdocstrings reads, only
  ``Examples:`` renders its ``>>>`` lines as code (``Example:`` becomes an admonition);
- no dates or machine names: measurements belong in docs/benchmarks.md, not in the reference.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
import signal

import pytest

from tests.test_doc_examples import ROOT, _modules, public_by_module

MAX_WORDS = 400

_SINGULAR_RE = re.compile(r"^[ \t]*Example::?[ \t]*$", re.MULTILINE)
_DATE_RE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_MACHINE_RE = re.compile(r"\b(EPYC|Xeon|H100|H200|A100|GFLOP/s)\b")


def _own_doc(obj: object) -> str | None:
    """The docstring written on ``obj`` itself (a class does not inherit its base's)."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__")
    return getattr(obj, "__doc__", None)


def _members(cls: type) -> list[tuple[str, object]]:
    """The public methods and properties a class defines, with a docstring, plus ``__init__``
    and ``__call__`` (rendered with the class)."""
    found = []
    for name, value in cls.__dict__.items():
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if not (inspect.isfunction(value) or isinstance(value, property)):
            continue
        if value.__doc__:
            found.append((name, value))
    return found


PUBLIC = public_by_module()


def _docstrings() -> dict[str, str]:
    """Dotted name -> docstring, for every module and every public object and member."""
    docs: dict[str, str] = {}
    for module_name in _modules():
        doc = importlib.import_module(module_name).__doc__
        if doc:
            docs[module_name] = doc
    for module_name, objects in PUBLIC.items():
        for qualname, obj in objects.items():
            path = f"{module_name}.{qualname}"
            if _own_doc(obj):
                docs[path] = _own_doc(obj)
            if inspect.isclass(obj):
                for name, member in _members(obj):
                    docs[f"{path}.{name}"] = member.__doc__
    return docs


DOCS = _docstrings()


def _examples_section(doc: str) -> str:
    """The text of the docstring's ``Examples:`` sections ("" when it has none)."""
    lines = doc.expandtabs().splitlines()
    body = []
    for i, line in enumerate(lines):
        if line.strip() != "Examples:":
            continue
        indent = len(line) - len(line.lstrip())
        for rest in lines[i + 1 :]:
            if rest.strip() and len(rest) - len(rest.lstrip()) <= indent:
                break
            body.append(rest)
    return "\n".join(body)


def test_every_public_function_and_class_has_an_examples_section():
    missing = []
    for module_name, objects in PUBLIC.items():
        for qualname, obj in objects.items():
            doc = _own_doc(obj) or ""
            if inspect.isclass(obj) and "__init__" in obj.__dict__:
                doc += "\n" + (obj.__init__.__doc__ or "")
            if not doctest.DocTestParser().get_examples(_examples_section(doc)):
                missing.append(f"{module_name}.{qualname}")
    assert not missing, f"{len(missing)} without an `Examples:` section with >>> lines:\n" + (
        "\n".join(sorted(missing))
    )


@pytest.mark.parametrize("module_name", _modules())
def test_examples_run_self_contained(module_name, monkeypatch):
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(recurse=False, exclude_empty=True).find(module, globs={})
    finder = doctest.DocTestFinder(exclude_empty=True)
    for qualname, obj in PUBLIC.get(module_name, {}).items():
        tests += finder.find(obj, f"{module_name}.{qualname}", module=module, globs={})
    tests = [t for t in tests if t.examples]
    if not tests:
        pytest.skip("no examples")
    monkeypatch.chdir(ROOT)  # examples that read tests/fixtures run from a clone's root
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        for test in tests:
            runner.run(test)
    finally:
        signal.signal(signal.SIGINT, previous)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (
        f"{result.failed} example(s) in {module_name} fail with empty globals "
        "(each example imports what it uses)"
    )


def test_docstrings_are_at_most_400_words():
    long = {path: len(doc.split()) for path, doc in DOCS.items() if len(doc.split()) > MAX_WORDS}
    assert not long, f"{len(long)} docstrings over {MAX_WORDS} words:\n" + "\n".join(
        f"{path}: {n}" for path, n in sorted(long.items())
    )


def test_no_singular_example_sections():
    singular = sorted(path for path, doc in DOCS.items() if _SINGULAR_RE.search(doc))
    assert not singular, "sections titled `Example:` (use `Examples:`):\n" + "\n".join(singular)


def test_no_dates_or_machine_names():
    found = []
    for path, doc in sorted(DOCS.items()):
        hits = _DATE_RE.findall(doc) + _MACHINE_RE.findall(doc)
        if hits:
            found.append(f"{path}: {', '.join(sorted(set(hits)))}")
    assert not found, "dates or machine names in docstrings:\n" + "\n".join(found)


def test_the_checks_can_fail():
    doc = """Adds.

    Example:
        >>> add(1, 2)
        3
    """
    assert _SINGULAR_RE.search(doc)
    assert not doctest.DocTestParser().get_examples(_examples_section(doc))
    assert _examples_section(doc.replace("Example:", "Examples:")).strip().startswith(">>>")
    assert _DATE_RE.search("run on 2026-11-25") and _MACHINE_RE.search("an EPYC core")
    test = doctest.DocTestParser().get_doctest(">>> add(1, 2)\n3\n", {}, "add", None, 0)
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda _: None)
    assert runner.summarize(verbose=False).failed == 1  # NameError: nothing in the globals
