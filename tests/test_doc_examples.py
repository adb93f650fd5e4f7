"""The examples in the library's docstrings run (doctest), module by module.

Every module of the package is collected (``pkgutil.walk_packages``), and every public function
and class (the names in each module's ``__all__``) must have an example.

Each example runs once in the suite. The module docstrings and the public objects' examples
(with their members') run in ``tests/test_docstrings.py`` with empty globals, the stricter way
(an example there must import what it uses); this file runs the rest (private helpers, members
of private classes) in their module's namespace, as ``python -m doctest`` would.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import inspect
import pkgutil
import signal
from collections import defaultdict
from pathlib import Path

import pytest

import artifex


def _modules() -> list[str]:
    names = ["artifex"] + [m.name for m in pkgutil.walk_packages(artifex.__path__, "artifex.")]
    return sorted(n for n in names if n != "artifex.__main__")


@functools.cache
def public_by_module() -> dict[str, dict[str, object]]:
    """Defining module -> {qualified name -> object} for the public functions and classes."""
    seen: set[int] = set()
    found: dict[str, dict[str, object]] = defaultdict(dict)
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = inspect.unwrap(getattr(module, name))
            is_code = inspect.isclass(obj) or inspect.isfunction(obj)
            if not is_code or not getattr(obj, "__module__", "").startswith("artifex"):
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            found[obj.__module__][obj.__qualname__] = obj
    return dict(found)


def _run_self_contained(module_name: str, test_name: str) -> bool:
    """Whether ``tests/test_docstrings.py`` runs this example (with empty globals)."""
    if test_name == module_name:
        return True
    prefixes = [f"{module_name}.{q}" for q in public_by_module().get(module_name, {})]
    return any(test_name == p or test_name.startswith(p + ".") for p in prefixes)


def _examples(module_name: str) -> list[doctest.DocTest]:
    """The module's examples that ``tests/test_docstrings.py`` does not run."""
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [
        t
        for t in finder.find(module)
        if t.examples and not _run_self_contained(module_name, t.name)
    ]


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name, monkeypatch):
    # Examples that read tests/fixtures use paths relative to the repository root, as a reader
    # running them from a clone would (another test may have changed this worker's directory).
    monkeypatch.chdir(ROOT)
    # Ctrl-C as a reader's interpreter handles it (a process started in the background by a
    # shell without job control inherits SIGINT ignored; the interrupt examples need it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    examples = _examples(module_name)
    if not examples:
        pytest.skip("every example of this module runs in tests/test_docstrings.py")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        for test in examples:
            runner.run(test)
    finally:
        signal.signal(signal.SIGINT, previous)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def _public_objects() -> dict[str, object]:
    """Dotted path (where defined) -> object, for every function and class in an ``__all__``."""
    found: dict[str, object] = {}
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = inspect.unwrap(getattr(module, name))
            is_code = inspect.isclass(obj) or inspect.isfunction(obj)
            if is_code and getattr(obj, "__module__", "").startswith("artifex"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _has_example(obj: object) -> bool:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and "__init__" in obj.__dict__:
        doc = (doc or "") + (obj.__init__.__doc__ or "")
    return bool(doctest.DocTestParser().get_examples(doc or ""))


def test_every_module_is_collected():
    assert "artifex.generative_models.training.rl.core.objective" in _modules()
    assert len(_modules()) > 40


def test_every_public_function_and_class_has_an_example():
    missing = sorted(path for path, obj in _public_objects().items() if not _has_example(obj))
    assert not missing, f"{len(missing)} public objects without a >>> example:\n" + "\n".join(
        missing
    )
